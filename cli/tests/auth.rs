//! Authenticated peers: with FERRY_AUTH_KEY set, the handshake is a mutual
//! HMAC challenge-response; a peer without the secret, or with another one,
//! is refused with a clear error and gets no access.

mod common;

use std::time::Duration;

use common::*;
use ferry::{Config, Endpoint, Error, Secret};

fn keyed(path: Path, key: Option<&str>) -> Endpoint {
    let cfg = {
        let mut conf = path_config(path);
        conf.auth_key = key.map(|k| Secret::new(k.as_bytes().to_vec()).unwrap());
        conf
    };
    Endpoint::builder().config(cfg).build().unwrap()
}

fn handshake_reason(r: ferry::Result<ferry::ConnId>) -> String {
    match r {
        Err(Error::Handshake { reason, .. }) => reason,
        Err(Error::Unsupported { reason, .. }) => reason,
        other => panic!("expected a refused handshake, got {other:?}"),
    }
}

#[test]
fn tcp_peers_must_share_the_secret() {
    let t = Target::start_on(
        Path::TcpEpoll,
        4096,
        &[("FERRY_AUTH_KEY", "correct horse battery")],
    );
    // The right key: connected, and data moves.
    let good = keyed(Path::TcpEpoll, Some("correct horse battery"));
    let conn = good.add_remote(&t.served.meta).unwrap();
    let local = good.alloc(64).unwrap();
    good.read(conn, &local, 0, 64, &t.served.rbuf).unwrap();
    // No key.
    let none = keyed(Path::TcpEpoll, None);
    let why = handshake_reason(none.add_remote(&t.served.meta));
    assert!(why.contains("authentication required"), "{why}");
    // Another key: the target's proof does not check out for us.
    let wrong = keyed(Path::TcpEpoll, Some("incorrect horse battery"));
    let why = handshake_reason(wrong.add_remote(&t.served.meta));
    assert!(why.contains("proof is wrong"), "{why}");
    // A keyed client refuses an unkeyed target.
    let open = Target::start_on(Path::TcpEpoll, 4096, &[]);
    let why = handshake_reason(good.add_remote(&open.served.meta));
    assert!(why.contains("FERRY_AUTH_KEY"), "{why}");
    // The secret never shows in debug output.
    let cfg = {
        let mut conf = Config::default();
        conf.auth_key = Some(Secret::new(b"hunter2hunter2".to_vec()).unwrap());
        conf
    };
    assert!(!format!("{cfg:?}").contains("hunter2"));
    assert!(Secret::new(b"short".to_vec()).is_err());
}

#[test]
fn same_host_connects_are_authenticated_too() {
    let target = keyed(Path::Shm, Some("0123456789abcdef"));
    target.start_passive_accept().unwrap();
    let good = keyed(Path::Shm, Some("0123456789abcdef"));
    let conn = good.add_remote(&target.metadata_bytes()).unwrap();
    assert!(matches!(good.peer(conn), Some(ferry::Peer::Local { .. })));
    let (_, peer) = target.accept(Duration::from_secs(5)).unwrap();
    assert!(matches!(peer, ferry::Peer::Local { .. }));
    // Straight to the accept ring, skipping the tcp handshake: still refused.
    let wrong = keyed(Path::Shm, Some("fedcba9876543210"));
    let why = handshake_reason(wrong.connect_local(target.id()));
    assert!(why.contains("authentication"), "{why}");
    let none = keyed(Path::Shm, None);
    let why = handshake_reason(none.connect_local(target.id()));
    assert!(why.contains("authentication"), "{why}");
}

/// A relay that forwards an authenticated client's handshake and then
/// writes its own WRITE frame into the stream: the target checks every
/// frame's MAC, drops the connection at the forged frame, and its memory is
/// untouched. (Before frame MACs the forged WRITE landed.)
#[test]
fn a_relay_cannot_inject_after_the_handshake() {
    use ferry::wire::{DataHeader, DataKind, EndpointMetadata};
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let key = "correct horse battery";
    let t = Target::start_on(Path::TcpEpoll, 4096, &[("FERRY_AUTH_KEY", key)]);
    let target = EndpointMetadata::decode(&t.served.meta)
        .unwrap()
        .socket_addr();
    let rb = t.served.rbuf;
    let relay = TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_addr = relay.local_addr().unwrap();
    let inject = Arc::new(AtomicBool::new(false));
    let injected = Arc::new(AtomicBool::new(false));
    let (inject2, injected2) = (inject.clone(), injected.clone());
    std::thread::spawn(move || {
        let (mut from_client, _) = relay.accept().unwrap();
        let mut to_target = TcpStream::connect(target).unwrap();
        let (mut back_from, mut back_to) = (
            to_target.try_clone().unwrap(),
            from_client.try_clone().unwrap(),
        );
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut back_from, &mut back_to);
        });
        from_client
            .set_read_timeout(Some(Duration::from_millis(10)))
            .unwrap();
        let mut buf = [0u8; 4096];
        loop {
            if inject2.load(Ordering::Relaxed) && !injected2.load(Ordering::Relaxed) {
                // The client is idle after its handshake: a frame boundary.
                let forged =
                    DataHeader::request(DataKind::WriteReq, rb.rkey, rb.key_tag(), 1, rb.addr, 64);
                let mut f = forged.encode().to_vec();
                f.extend_from_slice(&[0u8; 16]); // no MAC key: a guessed tag
                f.extend_from_slice(&[0xee; 64]);
                let _ = to_target.write_all(&f);
                injected2.store(true, Ordering::Relaxed);
            }
            match from_client.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    if to_target.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(_) => return,
            }
        }
    });
    let relayed = {
        let mut conf = path_config(Path::TcpEpoll);
        conf.auth_key = Some(Secret::new(key.as_bytes().to_vec()).unwrap());
        conf.streams_per_conn = 1;
        Endpoint::builder().config(conf).build().unwrap()
    };
    let conn = relayed.connect(relay_addr).unwrap();
    let local = relayed.alloc(64).unwrap();
    relayed.read(conn, &local, 0, 64, &rb).unwrap();
    let direct = keyed(Path::TcpEpoll, Some(key));
    let dconn = direct.add_remote(&t.served.meta).unwrap();
    let before = remote_hash(&direct, dconn, 0, 64);
    inject.store(true, Ordering::Relaxed);
    while !injected.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        remote_hash(&direct, dconn, 0, 64),
        before,
        "the forged WRITE landed"
    );
    // The target dropped the relayed connection at the forged frame.
    let e = relayed.read(conn, &local, 0, 64, &rb).unwrap_err();
    assert!(
        matches!(e, Error::ConnFailed { .. } | Error::Timeout { .. }),
        "{e}"
    );
}

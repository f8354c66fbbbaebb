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

//! The directory against a real etcd (Debian's `etcd-server`; `.ci/run`
//! installs it): a server on 127.0.0.1 with a temporary data dir per test.
//! Run: `cargo test --features directory --test directory`.
#![cfg(feature = "directory")]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::directory::{DirError, Directory, Event};
use ferry::{Config, Endpoint};

struct Etcd {
    child: Child,
    url: String,
    dir: std::path::PathBuf,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// An etcd of its own on free ports; waits until it answers.
fn etcd() -> Etcd {
    let (client, peer) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("ferry-etcd-{}-{client}", std::process::id()));
    let url = format!("http://127.0.0.1:{client}");
    let child = Command::new("etcd")
        .args(["--data-dir", dir.to_str().unwrap()])
        .args([
            "--listen-client-urls",
            &url,
            "--advertise-client-urls",
            &url,
        ])
        .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
        .args([
            "--initial-advertise-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
        ])
        .args([
            "--initial-cluster",
            &format!("default=http://127.0.0.1:{peer}"),
        ])
        // Room for the oversized record a test puts (etcd's default is 1.5 MiB).
        .args(["--max-request-bytes", "33554432"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcd not found: install Debian's etcd-server (.ci/run does)");
    let e = Etcd { child, url, dir };
    let d = Directory::new(&e.url, "probe").unwrap();
    let t0 = Instant::now();
    while d.list().is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "etcd did not come up"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    e
}

fn endpoint() -> Endpoint {
    let mut cfg = Config::default();
    cfg.listen_addr = "127.0.0.1".parse().unwrap();
    let ep = Endpoint::builder().config(cfg).build().unwrap();
    ep.start_passive_accept().unwrap();
    ep
}

#[test]
fn lookup_and_transfer_by_name() {
    let e = etcd();
    let dir = Directory::new(&e.url, "c1").unwrap();
    let target = endpoint();
    let dst = target.alloc(4096).unwrap();
    let pubn = dir
        .publish(&target, "target", Duration::from_secs(5))
        .unwrap();
    pubn.add_window("kv", &dst.advertise(0, 4096).unwrap().encode())
        .unwrap();

    let entry = dir.lookup("target").unwrap();
    assert_eq!(entry.incarnation, pubn.incarnation());
    assert_eq!(entry.metadata, target.metadata_bytes());
    assert_eq!(entry.windows.len(), 1);
    let listed = dir.list().unwrap();
    assert_eq!(
        listed.iter().map(|x| x.name.as_str()).collect::<Vec<_>>(),
        ["target"]
    );

    let initiator = endpoint();
    let conn = dir.connect_by_name(&initiator, "target").unwrap();
    assert_eq!(
        dir.connect_by_name(&initiator, "target").unwrap(),
        conn,
        "memoized"
    );
    let win = ferry::RemoteBuf::decode(&dir.window("target", "kv").unwrap()).unwrap();
    let src = initiator.register(b"by name".to_vec()).unwrap();
    initiator.write(conn, &src, 0, 7, &win).unwrap();
    let mut got = [0u8; 7];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"by name");

    assert!(matches!(
        dir.lookup("nobody"),
        Err(DirError::NotFound { .. })
    ));
    assert!(matches!(
        dir.window("target", "nope"),
        Err(DirError::NoWindow { .. })
    ));
    assert!(matches!(dir.lookup("a/b"), Err(DirError::Bad { .. })));
    // Another cluster sees nothing.
    assert!(Directory::new(&e.url, "c2")
        .unwrap()
        .list()
        .unwrap()
        .is_empty());
    // Closing revokes the lease: everything goes at once.
    pubn.close();
    assert!(matches!(
        dir.lookup("target"),
        Err(DirError::NotFound { .. })
    ));
}

#[test]
fn a_peer_that_stops_renewing_vanishes_within_its_ttl_and_watch_says_so() {
    let e = etcd();
    let dir = Directory::new(&e.url, "c1").unwrap();
    let peer = endpoint();
    let pubn = dir.publish(&peer, "p", Duration::from_secs(2)).unwrap();
    pubn.add_window("w", &[7u8; 64]).unwrap();
    let mut watch = dir.watch("p").unwrap();
    // As a killed process: no more keep-alives, no revoke.
    let died = Instant::now();
    pubn.abandon();
    let mut seen = Vec::new();
    while !seen.contains(&Event::Gone) {
        assert!(
            died.elapsed() < Duration::from_secs(10),
            "no Gone event: {seen:?}"
        );
        if let Some(ev) = watch.next(Duration::from_millis(500)).unwrap() {
            seen.push(ev);
        }
    }
    let gone_after = died.elapsed();
    // Its window's deletion comes in the same batch.
    while let Some(ev) = watch.next(Duration::from_millis(300)).unwrap() {
        seen.push(ev);
    }
    eprintln!("entries gone {gone_after:?} after the last renewal (TTL 2 s)");
    assert!(gone_after < Duration::from_secs(5), "{gone_after:?}");
    assert!(seen.contains(&Event::WindowGone("w".into())), "{seen:?}");
    assert!(matches!(dir.lookup("p"), Err(DirError::NotFound { .. })));
}

/// A name held by a live endpoint cannot be taken by accident; taken on
/// purpose, its first holder learns it and stops renewing, and the name
/// goes with its new holder (issue 28 #4).
#[test]
fn a_held_name_is_refused_and_a_replaced_holder_learns_it() {
    let e = etcd();
    let dir = Directory::new(&e.url, "c1").unwrap();
    let (first, second) = (endpoint(), endpoint());
    let p1 = dir.publish(&first, "a", Duration::from_secs(2)).unwrap();
    p1.add_window("w", &[1u8; 64]).unwrap();
    let err = dir
        .publish(&second, "a", Duration::from_secs(2))
        .err()
        .expect("a held name is refused");
    assert!(
        matches!(err, DirError::Taken { incarnation, .. } if incarnation == p1.incarnation()),
        "{err}"
    );
    assert!(err.to_string().contains("--replace"), "{err}");
    // The refusal touched nothing of the holder's.
    let entry = dir.lookup("a").unwrap();
    assert_eq!(entry.incarnation, p1.incarnation());
    assert_eq!(entry.windows.len(), 1);

    let p2 = dir
        .publish_replacing(&second, "a", Duration::from_secs(2))
        .unwrap();
    assert_eq!(dir.lookup("a").unwrap().incarnation, p2.incarnation());
    let t0 = Instant::now();
    while p1.last_error().is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the first holder never learned"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(p1.last_error().unwrap().contains("took the name over"));
    // The second leaves: the name goes, and the first does not bring it back.
    drop(p2);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(matches!(dir.lookup("a"), Err(DirError::NotFound { .. })));
    drop(p1);
}

/// A holder that crashed (stopped renewing, lease not revoked) does not
/// keep its name: a new publisher waits its lease out and takes it.
#[test]
fn a_crashed_holder_is_outlived() {
    let e = etcd();
    let dir = Directory::new(&e.url, "c1").unwrap();
    let (first, second) = (endpoint(), endpoint());
    dir.publish(&first, "b", Duration::from_secs(2))
        .unwrap()
        .abandon();
    let t0 = Instant::now();
    let p2 = dir.publish(&second, "b", Duration::from_secs(2)).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(dir.lookup("b").unwrap().incarnation, p2.incarnation());
}

#[test]
fn a_restarted_peer_is_reached_at_its_new_incarnation() {
    let e = etcd();
    let dir = Directory::new(&e.url, "c1").unwrap();
    let initiator = endpoint();
    let mut watch = dir.watch("svc").unwrap();

    let first = endpoint();
    let p1 = dir.publish(&first, "svc", Duration::from_secs(5)).unwrap();
    let c1 = dir.connect_by_name(&initiator, "svc").unwrap();
    let inc1 = p1.incarnation();
    drop(p1);
    drop(first);

    let second = endpoint();
    let dst = second.alloc(64).unwrap();
    let p2 = dir.publish(&second, "svc", Duration::from_secs(5)).unwrap();
    p2.add_window("w", &dst.advertise(0, 64).unwrap().encode())
        .unwrap();
    assert_ne!(p2.incarnation(), inc1);
    let c2 = dir.connect_by_name(&initiator, "svc").unwrap();
    assert_ne!(c1, c2, "the old connection is not handed back");
    let win = ferry::RemoteBuf::decode(&dir.window("svc", "w").unwrap()).unwrap();
    let src = initiator.register(vec![5u8; 64]).unwrap();
    initiator.write(c2, &src, 0, 64, &win).unwrap();
    let mut got = [0u8; 64];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, [5u8; 64]);

    let mut ups = Vec::new();
    let t0 = Instant::now();
    while ups.len() < 2 && t0.elapsed() < Duration::from_secs(5) {
        if let Some(Event::Up { incarnation }) = watch.next(Duration::from_millis(200)).unwrap() {
            ups.push(incarnation);
        }
    }
    assert_eq!(ups, [inc1, p2.incarnation()]);
}

#[test]
fn etcd_stopped_leaves_connections_working_and_directory_errors_named() {
    let mut e = etcd();
    let mut dir = Directory::new(&e.url, "c1").unwrap();
    dir.set_timeout(Duration::from_millis(500));
    let target = endpoint();
    let dst = target.alloc(64).unwrap();
    let pubn = dir.publish(&target, "t", Duration::from_secs(3)).unwrap();
    pubn.add_window("w", &dst.advertise(0, 64).unwrap().encode())
        .unwrap();
    let initiator = endpoint();
    let conn = dir.connect_by_name(&initiator, "t").unwrap();
    let win = ferry::RemoteBuf::decode(&dir.window("t", "w").unwrap()).unwrap();

    e.child.kill().unwrap();
    e.child.wait().unwrap();
    let src = initiator.register(vec![9u8; 64]).unwrap();
    for _ in 0..100 {
        initiator.write(conn, &src, 0, 64, &win).unwrap();
    }
    let err = dir.lookup("t").unwrap_err().to_string();
    assert!(
        err.contains("127.0.0.1") && err.contains("connect"),
        "{err}"
    );
    // The keep-alive says what went wrong.
    let t0 = Instant::now();
    while pubn.last_error().is_none() && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(pubn.last_error().is_some());
    drop(pubn); // revoke fails and is logged; no hang
}

#[test]
fn many_endpoints_register_and_look_up() {
    let e = etcd();
    let dir = Directory::new(&e.url, "many").unwrap();
    let mut eps = Vec::new();
    let mut pubs = Vec::new();
    for i in 0..100 {
        let ep = endpoint();
        pubs.push(
            dir.publish(&ep, &format!("ep{i}"), Duration::from_secs(10))
                .unwrap(),
        );
        eps.push(ep);
    }
    assert_eq!(dir.list().unwrap().len(), 100);
    let t0 = Instant::now();
    let n = 500;
    for i in 0..n {
        let name = format!("ep{}", i % 100);
        let got = dir.lookup(&name).unwrap();
        assert_eq!(got.metadata, eps[i % 100].metadata_bytes());
    }
    let rate = n as f64 / t0.elapsed().as_secs_f64();
    eprintln!("{n} lookups: {rate:.0} lookups/s");
}

/// Puts `key = value` with etcd's v3 JSON gateway (a raw record, as a
/// broken or hostile publisher might leave one).
fn raw_put(url: &str, key: &str, value: &[u8]) {
    use std::io::{Read, Write};
    fn b64(b: &[u8]) -> String {
        const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::new();
        for c in b.chunks(3) {
            let n = (c[0] as u32) << 16
                | (*c.get(1).unwrap_or(&0) as u32) << 8
                | *c.get(2).unwrap_or(&0) as u32;
            for i in 0..4 {
                if i <= c.len() {
                    out.push(T[(n >> (18 - 6 * i) & 63) as usize] as char);
                } else {
                    out.push('=');
                }
            }
        }
        out
    }
    let body = format!(
        "{{\"key\":\"{}\",\"value\":\"{}\"}}",
        b64(key.as_bytes()),
        b64(value)
    );
    let host = url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(host).unwrap();
    write!(
        s,
        "POST /v3/kv/put HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
}

#[test]
fn a_bad_record_is_skipped_and_the_others_are_listed() {
    let e = etcd();
    let dir = Directory::new(&e.url, "c3").unwrap();
    let target = endpoint();
    let _pubn = dir
        .publish(&target, "good", Duration::from_secs(5))
        .unwrap();
    raw_put(&e.url, "ferry/c3/garbage/endpoint", b"v1 zz not-hex");
    raw_put(&e.url, "ferry/c3/future/endpoint", b"v9 1 00");
    raw_put(&e.url, "ferry/c3/huge/endpoint", &vec![b'7'; 100_000]);
    let listed = dir.list().unwrap();
    assert_eq!(
        listed.iter().map(|x| x.name.as_str()).collect::<Vec<_>>(),
        ["good"]
    );
    // Lookups of the good name work; of a bad one, they say why.
    assert!(dir.lookup("good").is_ok());
    assert!(matches!(dir.lookup("garbage"), Err(DirError::Bad { .. })));
}

/// One record of 20 MB under a name (a peer, or an operator's mistake)
/// costs only that name: the listing reads keys a page at a time and each
/// name's records under a bound, so every good name is still listed.
#[test]
fn an_oversized_record_does_not_hide_the_others() {
    let e = etcd();
    let dir = Directory::new(&e.url, "c4").unwrap();
    let target = endpoint();
    let _a = dir
        .publish(&target, "alpha", Duration::from_secs(5))
        .unwrap();
    raw_put(&e.url, "ferry/c4/bloated/endpoint", &vec![b'7'; 20_000_000]);
    let other = endpoint();
    let _z = dir.publish(&other, "zulu", Duration::from_secs(5)).unwrap();
    let listed = dir.list().unwrap();
    assert_eq!(
        listed.iter().map(|x| x.name.as_str()).collect::<Vec<_>>(),
        ["alpha", "zulu"]
    );
    assert!(dir.lookup("bloated").is_err());
    assert!(dir.lookup("zulu").is_ok());
}

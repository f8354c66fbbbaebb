//! Endpoint behaviour that needs no second process: accept modes, embedded
//! shards, several shards, bounds on in-flight work, raw registration.

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::*;
use ferry::oob::IoPreference;
use ferry::{Access, Config, Endpoint, Error, Mode};
use ferry_cli::testkit::{check_pattern, fill_pattern};

fn pair(cfg_a: Config, cfg_b: Config) -> (Endpoint, Endpoint, ferry::ConnId, ferry::ConnId) {
    let a = Endpoint::builder().config(cfg_a).build().unwrap();
    let b = Endpoint::builder().config(cfg_b).build().unwrap();
    b.start_passive_accept().unwrap();
    let ca = a.add_remote(&b.metadata_bytes()).unwrap();
    let (cb, peer) = b.accept(Duration::from_secs(5)).unwrap();
    assert!(
        matches!(peer, ferry::Peer::Net(a) if a.ip().is_loopback()),
        "{peer}"
    );
    (a, b, ca, cb)
}

#[test]
fn passive_accept_and_both_sides_initiate() {
    let (a, b, ca, cb) = pair(config(IoPreference::Auto), config(IoPreference::Auto));
    let ma = a.alloc(1 << 16).unwrap();
    let mb = b.alloc(1 << 16).unwrap();
    let mut p = vec![0u8; 1 << 16];
    fill_pattern(&mut p, 0, 3);
    ma.write_at(0, &p).unwrap();
    // a writes into b, then b reads from a: the connection is two-way.
    a.write(ca, &ma, 0, 1 << 16, &mb.advertise(0, 1 << 16).unwrap())
        .unwrap();
    let mut got = vec![0u8; 1 << 16];
    mb.read_at(0, &mut got).unwrap();
    assert_eq!(check_pattern(&got, 0, 3), None);
    mb.write_at(0, &[0u8; 1 << 16]).unwrap();
    b.read(cb, &mb, 0, 1 << 16, &ma.advertise(0, 1 << 16).unwrap())
        .unwrap();
    mb.read_at(0, &mut got).unwrap();
    assert_eq!(check_pattern(&got, 0, 3), None);
    // Notifications both ways.
    a.send_notification(ca, b"to b").unwrap();
    assert_eq!(
        b.recv_notification(Duration::from_secs(5)).unwrap(),
        (cb, b"to b".to_vec())
    );
    b.send_notification(cb, b"to a").unwrap();
    assert_eq!(
        a.recv_notification(Duration::from_secs(5)).unwrap(),
        (ca, b"to a".to_vec())
    );
    b.stop_accept();
}

#[test]
fn embedded_shard_is_driven_by_the_caller() {
    let target = client(IoPreference::Auto);
    target.start_passive_accept().unwrap();
    let ep = embedded(IoPreference::Auto);
    let mut shards = ep.take_shards();
    assert_eq!(shards.len(), 1);
    assert!(ep.take_shards().is_empty(), "shards are handed out once");
    let conn = ep.add_remote(&target.metadata_bytes()).unwrap();
    let remote = target.alloc(4096).unwrap();
    remote.write_at(0, b"embedded").unwrap();
    let local = ep.alloc(4096).unwrap();
    let mut t = ep
        .read_async(conn, &local, 0, 8, &remote.advertise(0, 4096).unwrap())
        .unwrap();
    // Nothing moves until the caller polls.
    std::thread::sleep(Duration::from_millis(50));
    assert!(t.poll().is_none());
    let deadline = Instant::now() + Duration::from_secs(5);
    let r = loop {
        shards[0].poll();
        if let Some(r) = t.poll() {
            break r;
        }
        assert!(Instant::now() < deadline, "embedded read never completed");
    };
    r.unwrap();
    let mut got = [0u8; 8];
    local.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"embedded");
    assert_eq!(shards[0].conn_count(), 1);
}

#[test]
fn connections_spread_over_shards() {
    let cfg = {
        let mut conf = config(IoPreference::Auto);
        conf.shards = 3;
        conf
    };
    let ep = Endpoint::builder().config(cfg).build().unwrap();
    let peers: Vec<Endpoint> = (0..4).map(|_| client(IoPreference::Auto)).collect();
    for p in &peers {
        p.start_passive_accept().unwrap();
    }
    let local = ep.alloc(1 << 20).unwrap();
    for (i, p) in peers.iter().enumerate() {
        let conn = ep.add_remote(&p.metadata_bytes()).unwrap();
        let m = p.alloc(1 << 20).unwrap();
        let mut src = vec![0u8; 1 << 20];
        fill_pattern(&mut src, 0, i as u8);
        local.write_at(0, &src).unwrap();
        ep.write(conn, &local, 0, 1 << 20, &m.advertise(0, 1 << 20).unwrap())
            .unwrap();
        let mut got = vec![0u8; 1 << 20];
        m.read_at(0, &mut got).unwrap();
        assert_eq!(check_pattern(&got, 0, i as u8), None, "peer {i}");
    }
}

#[test]
fn in_flight_ops_are_bounded() {
    let target = client(IoPreference::Auto);
    target.start_passive_accept().unwrap();
    let cfg = {
        let mut conf = config(IoPreference::Auto);
        conf.max_inflight_ops = 4;
        conf.mode = Mode::Embedded;
        conf
    };
    let ep = Endpoint::builder().config(cfg).build().unwrap();
    let mut shard = ep.take_shards().pop().unwrap();
    let conn = ep.add_remote(&target.metadata_bytes()).unwrap();
    let remote = target.alloc(4096).unwrap();
    let rb = remote.advertise(0, 4096).unwrap();
    let local = ep.alloc(4096).unwrap();
    let mut ts: Vec<_> = (0..4)
        .map(|_| ep.write_async(conn, &local, 0, 64, &rb).unwrap())
        .collect();
    let e = ep.write_async(conn, &local, 0, 64, &rb).unwrap_err();
    assert!(matches!(e, Error::TooManyInflight { max: 4 }), "{e}");
    // Dropping an in-flight transfer frees its slot once the op ends.
    ts.pop();
    while ts.iter_mut().any(|t| !t.is_done()) || ep.inflight_ops() > 3 {
        shard.poll();
    }
    ts.clear();
    assert_eq!(ep.inflight_ops(), 0);
    ep.write_async(conn, &local, 0, 64, &rb).unwrap();
}

#[test]
fn ops_that_wait_for_stream_room_count_once_against_the_conn_limit() {
    // One request in flight per stream: every op after the first waits for
    // room before its first frame, and is retried. Each must still count
    // once against the 8-op connection limit, or the limit fills with
    // ops that have long finished.
    let target = client(IoPreference::Auto);
    target.start_passive_accept().unwrap();
    let cfg = {
        let mut conf = config(IoPreference::Auto);
        conf.stream_inflight = 1;
        conf.max_conn_inflight_ops = 8;
        conf
    };
    let ep = Endpoint::builder().config(cfg).build().unwrap();
    let conn = ep.add_remote(&target.metadata_bytes()).unwrap();
    let remote = target.alloc(4096).unwrap();
    let rb = remote.advertise(0, 4096).unwrap();
    let local = ep.alloc(4096).unwrap();
    for round in 0..50 {
        let ts: Vec<_> = (0..8)
            .map(|_| ep.write_async(conn, &local, 0, 64, &rb).unwrap())
            .collect();
        for t in ts {
            t.wait().unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
    }
}

#[test]
fn submission_queue_full_is_back_pressure() {
    let target = client(IoPreference::Auto);
    target.start_passive_accept().unwrap();
    let cfg = {
        let mut conf = config(IoPreference::Auto);
        conf.sq_depth = 2;
        conf.mode = Mode::Embedded;
        conf
    };
    let ep = Endpoint::builder().config(cfg).build().unwrap();
    let mut shard = ep.take_shards().pop().unwrap();
    let conn = ep.add_remote(&target.metadata_bytes()).unwrap();
    shard.poll(); // adopt the connection
    let remote = target.alloc(4096).unwrap();
    let rb = remote.advertise(0, 4096).unwrap();
    let local = ep.alloc(4096).unwrap();
    let mut ts = [
        ep.write_async(conn, &local, 0, 8, &rb).unwrap(),
        ep.write_async(conn, &local, 0, 8, &rb).unwrap(),
    ];
    let e = ep.write_async(conn, &local, 0, 8, &rb).unwrap_err();
    assert!(
        matches!(
            e,
            Error::QueueFull {
                shard: 0,
                capacity: 2
            }
        ),
        "{e}"
    );
    assert_eq!(ep.inflight_ops(), 2, "a refused op holds no slot");
    while ts.iter_mut().any(|t| !t.is_done()) {
        shard.poll();
    }
}

#[test]
fn raw_registration_and_deregistration() {
    let (a, b, ca, _) = pair(config(IoPreference::Auto), config(IoPreference::Auto));
    let mut mine = vec![0u8; 8192];
    // SAFETY: `mine` outlives the region: it is deregistered below, before
    // `mine` is dropped.
    let raw =
        unsafe { b.register_raw(mine.as_mut_ptr(), mine.len(), Access::REMOTE_WRITE) }.unwrap();
    let rb = raw.advertise(100, 50).unwrap();
    let src = a.register(vec![9u8; 50]).unwrap();
    a.write(ca, &src, 0, 50, &rb).unwrap();
    b.deregister(raw).unwrap();
    assert!(mine[100..150].iter().all(|&x| x == 9));
    assert!(mine[..100].iter().all(|&x| x == 0));
    // The key is gone now: the peer is refused.
    let e = a.write(ca, &src, 0, 50, &rb).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote {
                status: ferry::wire::Status::UnknownKey,
                ..
            }
        ),
        "{e}"
    );
    drop(mine);
}

#[test]
fn garbage_on_the_control_port_does_not_hurt_the_listener() {
    for io in [IoPreference::Uring, IoPreference::Epoll] {
        require_backend(io);
        let target = client(io);
        target.start_passive_accept().unwrap();
        let addr = target.metadata().socket_addr();
        let mut junk = std::net::TcpStream::connect(addr).unwrap();
        junk.write_all(&[0xde; 100]).unwrap();
        let _half_open = std::net::TcpStream::connect(addr).unwrap();
        let ep = client(io);
        let conn = ep.add_remote(&target.metadata_bytes()).unwrap();
        let m = target.alloc(64).unwrap();
        let local = ep.alloc(64).unwrap();
        ep.read(conn, &local, 0, 64, &m.advertise(0, 64).unwrap())
            .unwrap();
    }
}

#[test]
fn metadata_names_the_listener() {
    let ep = client(IoPreference::Auto);
    let m = ep.metadata();
    assert_eq!(m.addr, "127.0.0.1".parse::<std::net::IpAddr>().unwrap());
    assert_ne!(m.port, 0);
    assert_eq!(
        ferry::EndpointMetadata::decode(&ep.metadata_bytes()).unwrap(),
        *m
    );
    // IPv6 loopback is required: a machine without it fails here rather
    // than passing without having tried.
    let v6 = Endpoint::builder()
        .config({
            let mut conf = config(IoPreference::Auto);
            conf.listen_addr = "::1".parse().unwrap();
            conf
        })
        .build()
        .expect("an endpoint on ::1 (IPv6 loopback)");
    assert_eq!(v6.metadata_bytes().len(), 19);
    let peer = client(IoPreference::Auto);
    v6.start_passive_accept().unwrap();
    peer.add_remote(&v6.metadata_bytes()).unwrap();
}

/// A peer that completes the handshake and then never answers: requests
/// fail after the op timeout instead of hanging, and the error sticks.
#[test]
fn silent_peer_fails_requests_after_the_op_timeout() {
    use std::io::Read;
    let (addr, server) = raw_peer(16, |mut s| {
        // Read and ignore whatever comes, answering nothing.
        let mut sink = [0u8; 4096];
        while let Ok(n) = s.read(&mut sink) {
            if n == 0 {
                break;
            }
        }
    });
    let ep = Endpoint::builder()
        .config({
            let mut conf = config(IoPreference::Auto);
            conf.op_timeout_ms = 700;
            conf
        })
        .build()
        .unwrap();
    let conn = ep.connect(addr).unwrap();
    let local = ep.alloc(64).unwrap();
    let rb = unanswered_window();
    let start = Instant::now();
    let e = ep.write(conn, &local, 0, 64, &rb).unwrap_err();
    let took = start.elapsed();
    assert!(
        matches!(&e, Error::ConnFailed { cause: ferry::ConnFault::Timeout { what, .. }, .. } if what.contains("FERRY_OP_TIMEOUT_MS")),
        "{e}"
    );
    assert!(
        took >= Duration::from_millis(700) && took < Duration::from_secs(3),
        "took {took:?}"
    );
    let e2 = ep.read(conn, &local, 0, 8, &rb).unwrap_err();
    assert_eq!(
        e.to_string(),
        e2.to_string(),
        "the first error stays on the connection"
    );
    drop(ep);
    server.join().unwrap();
}

/// `build()` validates the config: each zero that used to panic deep in
/// the engine is an error naming its field.
#[test]
fn build_refuses_zero_limits_naming_the_field() {
    type Set = fn(&mut Config);
    let cases: [(&str, Set); 5] = [
        ("shards", |c| c.shards = 0),
        ("max_inflight_ops", |c| c.max_inflight_ops = 0),
        ("streams_per_conn", |c| c.streams_per_conn = 0),
        ("chunk_bytes", |c| c.chunk_bytes = 0),
        ("sq_depth", |c| c.sq_depth = 0),
    ];
    for (field, set) in cases {
        let mut c = config(IoPreference::Auto);
        set(&mut c);
        let Err(e) = Endpoint::builder().config(c).build() else {
            panic!("{field} = 0 was accepted");
        };
        assert!(matches!(e, ferry::Error::Config { .. }), "{field}: {e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains(field) && msg.contains("\"0\""),
            "{field}: {msg}"
        );
    }
}

/// A key from `mr.advertise(off, len)` reaches that window and nothing
/// else of the registration (it used to reach all of it), on tcp and shm.
#[test]
fn advertised_windows_are_enforced() {
    use ferry::wire::Status;
    for path in [Path::TcpEpoll, Path::Shm] {
        let target = Endpoint::builder()
            .config(path_config(path))
            .build()
            .unwrap();
        target.start_passive_accept().unwrap();
        let ep = path_client(path);
        let conn = ep.add_remote(&target.metadata_bytes()).unwrap();
        let mem = target.alloc_host(1 << 20).unwrap();
        let local = ep.alloc_host(1 << 20).unwrap();
        let win = mem.advertise(512 << 10, 4096).unwrap();
        assert_ne!(win.rkey, mem.rkey(), "a part gets a key of its own");
        assert_eq!(mem.advertise(512 << 10, 4096).unwrap().rkey, win.rkey);
        ep.read(conn, &local, 0, 4096, &win).unwrap();
        ep.write(conn, &local, 0, 4096, &win).unwrap();
        let refused = |e: Error| {
            matches!(
                e,
                Error::Remote {
                    status: Status::OutOfBounds,
                    ..
                }
            )
        };
        // Past the window's end, and before its start (the registration's
        // offset 0), with the window's key: refused.
        let mut wide = win;
        wide.size = 1 << 20;
        let e = ep.read(conn, &local, 0, 1 << 20, &wide).unwrap_err();
        assert!(refused(e), "{path:?}");
        let mut at0 = win;
        at0.addr = mem.addr();
        let e = ep.read(conn, &local, 0, 4096, &at0).unwrap_err();
        assert!(refused(e), "{path:?}");
        // The whole registration: its own key, everything reachable, and
        // the connection survived the refusals.
        let whole = mem.advertise(0, 1 << 20).unwrap();
        assert_eq!(whole.rkey, mem.rkey());
        ep.read(conn, &local, 0, 1 << 20, &whole).unwrap();
    }
}

/// Limits are ours, not the peer's: a peer that declares 2^20 requests in
/// flight per stream gets min(ours, its) — here 8 — and is dropped when it
/// sends a 9th without reading the answers; nothing was sized by its word.
#[test]
fn a_peer_declaring_huge_limits_gets_ours() {
    use ferry::wire::{DataHeader, DataKind};
    let (addr, server) = raw_peer(1 << 20, |mut s| {
        // Nine READs of 8 bytes under a key that does not exist, and never
        // a read of the answers. One write: the nine arrive together, so
        // the shard holds all of them at once however busy the machine is
        // (written one by one, a slow shard could answer each before the
        // next came, and the limit was never crossed).
        let mut all = Vec::new();
        for op in 0..9u64 {
            let h = DataHeader::request(DataKind::ReadReq, 1, 0, op, 0x1000, 8);
            all.extend_from_slice(&h.encode());
        }
        let _ = s.write_all(&all);
        std::thread::sleep(Duration::from_secs(2));
    });
    let ep = Endpoint::builder()
        .config({
            let mut conf = config(IoPreference::Auto);
            conf.stream_inflight = 8;
            conf
        })
        .build()
        .unwrap();
    let conn = ep.connect(addr).unwrap();
    let local = ep.alloc(64).unwrap();
    let rb = unanswered_window();
    let deadline = Instant::now() + Duration::from_secs(5);
    let e = loop {
        // The connection dies as soon as the shard reads the 9th request.
        match ep.write_async(conn, &local, 0, 8, &rb) {
            Err(e) => break e,
            Ok(mut t) => {
                if let Err(e) = t.wait_timeout(Duration::from_millis(200)) {
                    if !matches!(e, Error::Timeout { .. }) {
                        break e;
                    }
                }
            }
        }
        assert!(Instant::now() < deadline, "the connection was not dropped");
    };
    assert!(
        matches!(&e, Error::ConnFailed { cause: ferry::ConnFault::PeerMisbehaved { what }, .. } if what.contains("agreed 8 requests")),
        "{e}"
    );
    drop(ep);
    server.join().unwrap();
}

/// No head-of-line blocking across connections: a peer that never reads
/// fills its connection with notifications; ops on another connection of
/// the same shard go on at normal speed, and the stuck connection fails
/// with a named reason at the op timeout instead of holding the shard.
#[test]
fn a_peer_that_stops_reading_stalls_only_itself() {
    let (addr, silent) = raw_peer(16, |s| {
        std::thread::sleep(Duration::from_secs(6));
        drop(s);
    });
    let ep = std::sync::Arc::new(
        Endpoint::builder()
            .config({
                let mut conf = config(IoPreference::Auto);
                conf.op_timeout_ms = 1500;
                // Room for the whole flood below: it must park, not be
                // refused at the call.
                conf.notify_outbox = 8192;
                conf
            })
            .build()
            .unwrap(),
    );
    let stuck = ep.connect(addr).unwrap();
    let target = client(IoPreference::Auto);
    target.start_passive_accept().unwrap();
    let good = ep.add_remote(&target.metadata_bytes()).unwrap();
    let dst = target.alloc(4096).unwrap();
    let win = dst.advertise(0, 4096).unwrap();
    let local = ep.alloc(4096).unwrap();
    // Fill the silent peer's connection (kernel buffers, the stream's
    // queue, then parked commands: 24 MiB, more than loopback buffers hold)
    // from another thread.
    let e2 = ep.clone();
    let flood = std::thread::spawn(move || {
        // Stops early only if the stuck connection has already failed.
        for _ in 0..6000 {
            if e2.send_notification(stuck, &[7u8; 4096]).is_err() {
                break;
            }
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    // Loose bounds for a loaded 2-core CI machine; a shard blocked behind
    // the silent peer would hold these ops until that peer closes (6 s).
    for _ in 0..200 {
        let t0 = Instant::now();
        ep.write(good, &local, 0, 4096, &win).unwrap();
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "an op took {:?}",
            t0.elapsed()
        );
    }
    flood.join().unwrap();
    // Nothing drains the stuck connection: at the op timeout it fails,
    // and says why.
    std::thread::sleep(Duration::from_millis(2500));
    let rb = unanswered_window();
    let e = ep
        .write_async(stuck, &local, 0, 8, &rb)
        .and_then(|mut t| t.wait_timeout(Duration::from_secs(1)))
        .unwrap_err();
    assert!(
        matches!(&e, Error::ConnFailed { cause: ferry::ConnFault::Timeout { what, .. }, .. } if what.contains("not reading")),
        "{e}"
    );
    ep.write(good, &local, 0, 4096, &win).unwrap();
    silent.join().unwrap();
}

/// One connection parks at most `sq_depth` commands; more ops on it fail
/// at once with `Backlogged` (naming it), while other connections of the
/// same shard go on.
#[test]
fn one_connection_cannot_fill_the_shard() {
    let (addr, silent) = raw_peer(16, |s| {
        std::thread::sleep(Duration::from_secs(4));
        drop(s);
    });
    let ep = Endpoint::builder()
        .config({
            let mut conf = config(IoPreference::Auto);
            conf.sq_depth = 64;
            conf.op_timeout_ms = 2000;
            conf
        })
        .build()
        .unwrap();
    let stuck = ep.connect(addr).unwrap();
    let target = client(IoPreference::Auto);
    target.start_passive_accept().unwrap();
    let good = ep.add_remote(&target.metadata_bytes()).unwrap();
    let dst = target.alloc(4096).unwrap();
    let win = dst.advertise(0, 4096).unwrap();
    let local = ep.alloc(4096).unwrap();
    let rb = unanswered_window();
    // 16 in flight (the peer's limit), 64 parked, the rest refused.
    let mut transfers = Vec::new();
    let mut refused = 0;
    for _ in 0..400 {
        match ep.write_async(stuck, &local, 0, 8, &rb) {
            Ok(t) => transfers.push(t),
            Err(Error::QueueFull { .. }) => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => panic!("{e}"),
        }
        ep.write(good, &local, 0, 64, &win).unwrap();
    }
    let t0 = Instant::now();
    for mut t in transfers {
        match t.wait_timeout(Duration::from_secs(10)) {
            Err(Error::Backlogged { conn, waiting }) => {
                assert_eq!((conn, waiting), (stuck, 64));
                refused += 1;
            }
            // The parked and in-flight ones fail at the op timeout.
            Err(Error::ConnFailed { .. }) | Err(Error::Timeout { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    assert!(refused >= 400 - 16 - 64 - 64, "only {refused} refused");
    assert!(t0.elapsed() < Duration::from_secs(8));
    ep.write(good, &local, 0, 4096, &win).unwrap();
    silent.join().unwrap();
}

/// One remote address cannot take every slot: past
/// `FERRY_MAX_CONNS_PER_PEER` its connections are refused, naming it.
#[test]
fn one_peer_cannot_take_every_slot() {
    let target = Endpoint::builder()
        .config({
            let mut conf = config(IoPreference::Auto);
            conf.max_conns_per_peer = 2;
            conf
        })
        .build()
        .unwrap();
    target.start_passive_accept().unwrap();
    let clients: Vec<Endpoint> = (0..3).map(|_| client(IoPreference::Auto)).collect();
    let meta = target.metadata_bytes();
    assert!(clients[0].add_remote(&meta).is_ok());
    assert!(clients[1].add_remote(&meta).is_ok());
    let Err(e) = clients[2].add_remote(&meta) else {
        panic!("a third connection from 127.0.0.1 was accepted");
    };
    assert!(e.to_string().contains("FERRY_MAX_CONNS_PER_PEER"), "{e}");
}

/// `FERRY_IDLE_TIMEOUT_MS`: a connection with nothing in flight and no
/// traffic for that long is closed, with that reason (tcp and shm).
#[test]
fn idle_connections_time_out_when_asked() {
    for path in [Path::TcpEpoll, Path::Shm] {
        let target = Endpoint::builder()
            .config(path_config(path))
            .build()
            .unwrap();
        target.start_passive_accept().unwrap();
        let ep = Endpoint::builder()
            .config({
                let mut conf = path_config(path);
                conf.idle_timeout_ms = 300;
                conf
            })
            .build()
            .unwrap();
        let conn = ep.add_remote(&target.metadata_bytes()).unwrap();
        let dst = target.alloc_host(4096).unwrap();
        let win = dst.advertise(0, 4096).unwrap();
        let local = ep.alloc_host(4096).unwrap();
        // Busy connections stay.
        let until = Instant::now() + Duration::from_millis(700);
        while Instant::now() < until {
            ep.write(conn, &local, 0, 4096, &win).unwrap();
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(1200));
        let e = ep.write(conn, &local, 0, 4096, &win).unwrap_err();
        assert!(
            matches!(&e, Error::ConnFailed { cause: ferry::ConnFault::Timeout { what, .. }, .. } if what.contains("FERRY_IDLE_TIMEOUT_MS")),
            "{path:?}: {e}"
        );
    }
}

/// A window of a key the raw peers in these tests never answer for.
fn unanswered_window() -> ferry::RemoteBuf {
    ferry::RemoteBuf {
        addr: 0x1000,
        size: 64,
        rkey: 1,
        ..Default::default()
    }
}

/// A region its owner holds read-only (registered without LOCAL_WRITE, as
/// Python registers `bytes`) is never the destination of a READ, in any
/// form; it may still be a WRITE's source, and peers may READ it.
#[test]
fn a_read_into_a_read_only_registration_is_refused_and_changes_nothing() {
    let (a, b, ca, cb) = pair(config(IoPreference::Auto), config(IoPreference::Auto));
    let src = b.alloc(4096).unwrap();
    src.write_at(0, &[9u8; 4096]).unwrap();
    let win = src.advertise(0, 4096).unwrap();
    let ro = a
        .register_with(vec![7u8; 4096], Access::REMOTE_READ)
        .unwrap();
    let refused = |e: ferry::Error| {
        assert!(
            matches!(e, ferry::Error::ReadOnlyDestination { len: 4096, .. }),
            "{e}"
        );
    };
    refused(a.read(ca, &ro, 0, 4096, &win).unwrap_err());
    refused(a.read_async(ca, &ro, 0, 16, &win).unwrap_err());
    refused(a.readv(ca, &[(&ro, 0, 16)], &[win]).unwrap_err());
    let mut now = vec![0u8; 4096];
    ro.read_at(0, &mut now).unwrap();
    assert!(now.iter().all(|&x| x == 7), "the read-only bytes changed");
    // Its own uses stay: the source of a WRITE, READ by the peer.
    let dst = b.alloc(4096).unwrap();
    a.write(ca, &ro, 0, 4096, &dst.advertise(0, 4096).unwrap())
        .unwrap();
    let back = b.alloc(4096).unwrap();
    b.read(cb, &back, 0, 4096, &ro.advertise(0, 4096).unwrap())
        .unwrap();
    let mut got = vec![0u8; 4096];
    back.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 7));
}

/// Three ways a connection dies, three causes a caller can match: a peer
/// that goes silent (`Timeout`), one that sends garbage
/// (`PeerMisbehaved`), one that hangs up (`PeerGone`) — each also its own
/// `FailureKind`, which the C, Python and NIXL faces report from.
#[test]
fn a_silent_a_lying_and_a_gone_peer_are_three_causes() {
    use ferry::rogue::{spawn, Behaviour};
    use ferry::{ConnFault, FailureKind};
    let ep = Endpoint::builder()
        .config({
            let mut conf = config(IoPreference::Auto);
            conf.op_timeout_ms = 500;
            conf
        })
        .build()
        .unwrap();
    let local = ep.alloc(64).unwrap();
    let rb = unanswered_window();
    let fail = |how| {
        let conn = ep.connect(spawn(how).unwrap()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match ep.write(conn, &local, 0, 64, &rb) {
                Err(Error::ConnFailed { cause, .. }) => break cause,
                Err(e) => panic!("{how:?}: {e}"),
                // A write may land in the kernel before the peer's
                // garbage or hang-up is read; the next one sees it.
                Ok(()) => assert!(Instant::now() < deadline, "{how:?}: never failed"),
            }
        }
    };
    let silent = fail(Behaviour::Silent);
    assert!(matches!(silent, ConnFault::Timeout { .. }), "{silent:?}");
    assert_eq!(silent.kind(), FailureKind::PeerTimeout);
    let lying = fail(Behaviour::Garbage);
    assert!(
        matches!(lying, ConnFault::PeerMisbehaved { .. }),
        "{lying:?}"
    );
    assert_eq!(lying.kind(), FailureKind::PeerMisbehaved);
    let gone = fail(Behaviour::HangUp);
    assert!(matches!(gone, ConnFault::PeerGone { .. }), "{gone:?}");
    assert_eq!(gone.kind(), FailureKind::Disconnected);
}

/// `vouch` proves who dialed a connection by asking the endpoint the
/// caller trusts by its address: the real dialer says yes, another
/// endpoint's connection is not vouched for, and a relay that passes off
/// a connection the trusted endpoint dialed *to the relay* is caught (the
/// trusted endpoint answers with the relay's address, not ours).
#[test]
fn vouch_tells_the_dialer_from_a_claimant_and_a_relay() {
    let ours = Endpoint::builder()
        .config(config(IoPreference::Auto))
        .build()
        .unwrap();
    ours.start_passive_accept().unwrap();
    let trusted = Endpoint::builder()
        .config(config(IoPreference::Auto))
        .build()
        .unwrap();
    trusted.start_passive_accept().unwrap();
    let other = client(IoPreference::Auto);
    let at = trusted.metadata().socket_addr();

    let dialed = trusted.add_remote(&ours.metadata_bytes()).unwrap();
    let (from_trusted, _) = ours.accept(Duration::from_secs(5)).unwrap();
    assert!(ours.vouch(from_trusted, at).unwrap(), "the real dialer");
    // The dialing side knows whom it dialed without asking.
    assert!(trusted
        .vouch(dialed, ours.metadata().socket_addr())
        .unwrap());
    assert!(!trusted
        .vouch(dialed, other.metadata().socket_addr())
        .unwrap());

    other.add_remote(&ours.metadata_bytes()).unwrap();
    let (from_other, _) = ours.accept(Duration::from_secs(5)).unwrap();
    assert!(!ours.vouch(from_other, at).unwrap(), "someone else");

    // The trusted endpoint dials a relay, which offers that very
    // connection (its nonce) to us.
    let relay = ferry::rogue::spawn(ferry::rogue::Behaviour::Relay {
        to: ours.metadata().socket_addr(),
    })
    .unwrap();
    trusted.connect(relay).unwrap();
    let (relayed, _) = ours.accept(Duration::from_secs(5)).unwrap();
    assert!(!ours.vouch(relayed, at).unwrap(), "a relay");

    // Asking an address where no endpoint listens is an error, not a no.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let nobody = closed.local_addr().unwrap();
    drop(closed);
    assert!(ours.vouch(from_trusted, nobody).is_err());
    assert!(matches!(
        ours.vouch(ferry::ConnId(u64::MAX >> 8), at),
        Err(Error::UnknownConn { .. })
    ));
}

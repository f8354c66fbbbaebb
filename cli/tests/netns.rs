//! Several hosts on one machine: network namespaces joined by a veth pair,
//! an endpoint in each, over IPv4 and IPv6 — metadata exchange, connect,
//! transfers, and a link cut in the middle of transfers. `#[ignore]`d: it
//! needs root and iproute2; `.ci/run` runs it with `--ignored`.
//!
//! The addresses (198.18.0.0/24 from the benchmarking range, fd77::/64 ULA)
//! exist only inside the namespaces this test creates and removes.

mod common;

use common::hosts::*;

use std::io::BufReader;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use ferry::{Config, Endpoint, Error, Peer, Transport};
use ferry_cli::testkit::{check_pattern, fill_pattern, fnv64, read_served, Served};

const MIB: usize = 1 << 20;

/// `ferry serve` inside namespace `ns`, listening on `addr`.
fn serve_in(ns: &str, addr: &str, bytes: usize) -> (Child, Served) {
    let mut child = Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            env!("CARGO_BIN_EXE_ferry"),
            "serve",
            "--listen",
            addr,
            "--bytes",
            &bytes.to_string(),
        ])
        .env("FERRY_LOG", "error")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let served = read_served(&mut out).expect("ferry serve in a namespace");
    (child, served)
}

fn client_config() -> Config {
    {
        let mut conf = config(ferry::oob::IoPreference::Auto);
        conf.listen_addr = "0.0.0.0".parse().unwrap();
        conf.transport = Transport::Auto;
        conf.op_timeout_ms = 2000;
        conf.connect_timeout_ms = 3000;
        conf
    }
}

/// Runs `client` on a thread inside namespace `ns` (a host), then stops
/// the targets `served` (whatever the client did) and passes its panic on.
fn on_host(ns: &str, served: Vec<Child>, client: impl FnOnce() + Send + 'static) {
    let ns = ns.to_string();
    let r = std::thread::spawn(move || {
        enter(&ns);
        client();
    })
    .join();
    for mut srv in served {
        let _ = srv.kill();
        let _ = srv.wait();
    }
    if let Err(p) = r {
        std::panic::resume_unwind(p);
    }
}

/// From host B: connect to the target on host A, move data both ways.
fn transfers_between_hosts(served: &Served) {
    let ep = Endpoint::builder().config(client_config()).build().unwrap();
    let conn = ep.add_remote(&served.meta).unwrap();
    assert!(
        matches!(ep.peer(conn), Some(Peer::Net(_))),
        "another host is reached over tcp: {:?}",
        ep.peer(conn)
    );
    let local = ep.alloc(8 * MIB).unwrap();
    let win = served.rbuf.slice(3, (8 * MIB - 3) as u32).unwrap();
    ep.read(conn, &local, 0, 8 * MIB - 3, &win).unwrap();
    let mut got = vec![0u8; 8 * MIB - 3];
    local.read_at(0, &mut got).unwrap();
    assert_eq!(check_pattern(&got, 3, 0), None);
    let mut src = vec![0u8; 8 * MIB - 3];
    fill_pattern(&mut src, 0, 0x61);
    local.write_at(0, &src).unwrap();
    ep.write(conn, &local, 0, 8 * MIB - 3, &win).unwrap();
    assert_eq!(remote_hash(&ep, conn, 3, 8 * MIB - 3), fnv64(&src));
}

#[test]
#[ignore = "needs root to make network namespaces (cargo test --test netns -- --ignored)"]
fn endpoints_on_separate_hosts() {
    let hosts = Hosts::make_as_root();
    let (v4, v4_served) = serve_in(&hosts.a, "198.18.0.1", 64 * MIB);
    let (v6, v6_served) = serve_in(&hosts.a, "fd77::1", 16 * MIB);
    assert_eq!(
        ferry::EndpointMetadata::decode(&v4_served.meta)
            .unwrap()
            .addr
            .to_string(),
        "198.18.0.1"
    );
    assert_eq!(v6_served.meta.len(), 19, "IPv6 metadata");
    let b = hosts.b.clone();
    let hosts = std::sync::Arc::new(hosts);
    let h2 = hosts.clone();
    on_host(&b, vec![v4, v6], move || {
        transfers_between_hosts(&v4_served);
        transfers_between_hosts(&v6_served);

        // Cut the link in the middle of transfers: errors within the op timeout.
        let ep = Endpoint::builder().config(client_config()).build().unwrap();
        let conn = ep.add_remote(&v4_served.meta).unwrap();
        let local = ep.alloc(64 * MIB).unwrap();
        let ts: Vec<_> = (0..16)
            .map(|i| {
                let w = v4_served
                    .rbuf
                    .slice((i * 4 * MIB) as u32, (4 * MIB) as u32)
                    .unwrap();
                ep.read_async(conn, &local, i * 4 * MIB, 4 * MIB, &w)
                    .unwrap()
            })
            .collect();
        std::thread::sleep(Duration::from_millis(20));
        let cut = Instant::now();
        h2.link_a(false);
        let mut failed = 0;
        for mut t in ts {
            match t.wait_timeout(Duration::from_secs(15)) {
                Ok(()) => {}
                Err(Error::ConnFailed { .. }) => failed += 1,
                Err(e) => panic!("unexpected {e}"),
            }
        }
        let took = cut.elapsed();
        h2.link_a(true);
        assert!(failed > 0, "a cut link failed nothing");
        assert!(
            took < Duration::from_millis(2000 + 2000),
            "errors took {took:?} with a 2 s op timeout"
        );
        println!("link cut: {failed} of 16 transfers failed after {took:?}");
    });
    drop(hosts);
}

/// A peer that vanishes without a FIN while nothing is in flight (the link
/// cut under an idle connection) is noticed by keepalive: the connection
/// is failed within `FERRY_LIVENESS_MS` + 1 s, cause PeerGone, and an op
/// posted after fails at once. An idle connection whose peer is there
/// stays up past the bound.
#[test]
#[ignore = "needs root to make network namespaces (cargo test --test netns -- --ignored)"]
fn an_idle_connection_to_a_vanished_peer_fails_within_the_liveness_bound() {
    const LIVENESS_MS: u64 = 2000;
    let hosts = Hosts::make_as_root();
    let (srv, served) = serve_in(&hosts.a, "198.18.0.1", 8 * MIB);
    let b = hosts.b.clone();
    let hosts = std::sync::Arc::new(hosts);
    let h2 = hosts.clone();
    on_host(&b, vec![srv], move || {
        let mut cfg = client_config();
        cfg.liveness_ms = LIVENESS_MS;
        let ep = Endpoint::builder().config(cfg).build().unwrap();
        let conn = ep.add_remote(&served.meta).unwrap();
        assert!(matches!(ep.peer(conn), Some(Peer::Net(_))));
        let local = ep.alloc(MIB).unwrap();
        ep.write(conn, &local, 0, 4096, &served.rbuf).unwrap();
        // Idle, peer there: still up after twice the bound.
        std::thread::sleep(Duration::from_millis(2 * LIVENESS_MS));
        assert!(ep.conn_status(conn).is_ok(), "a live idle peer was failed");
        let cut = Instant::now();
        h2.link_a(false);
        let failed = loop {
            if let Err(e) = ep.conn_status(conn) {
                break e;
            }
            assert!(
                cut.elapsed() < Duration::from_millis(LIVENESS_MS + 1000),
                "the link went down {:?} ago and the idle connection is still up",
                cut.elapsed()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let took = cut.elapsed();
        h2.link_a(true);
        assert!(
            matches!(failed.as_fault(), ferry::ConnFault::PeerGone { .. }),
            "{failed}"
        );
        let at_once = Instant::now();
        let e = ep.write(conn, &local, 0, 4096, &served.rbuf).unwrap_err();
        assert!(
            matches!(e.as_fault(), ferry::ConnFault::PeerGone { .. }),
            "{e}"
        );
        assert!(at_once.elapsed() < Duration::from_millis(100));
        println!("idle connection to a vanished peer failed after {took:?}: {failed}");
    });
    drop(hosts);
}

/// A peer that is merely slow is not a vanished one: over a link shaped
/// to 2 Mbit/s, a 1 MiB READ takes about twice `FERRY_LIVENESS_MS` and
/// completes, byte-exact, and the connection stays up (its data keeps
/// being acknowledged, so neither keepalive nor the user timeout fires).
#[test]
#[ignore = "needs root to make network namespaces (cargo test --test netns -- --ignored)"]
fn a_slow_peer_is_not_failed_by_the_liveness_bound() {
    const LIVENESS_MS: u64 = 2000;
    let hosts = Hosts::make_as_root();
    let (srv, served) = serve_in(&hosts.a, "198.18.0.1", 2 * MIB);
    hosts.shape_a("2mbit");
    let b = hosts.b.clone();
    on_host(&b, vec![srv], move || {
        let mut cfg = client_config();
        cfg.liveness_ms = LIVENESS_MS;
        cfg.op_timeout_ms = 30_000;
        let ep = Endpoint::builder().config(cfg).build().unwrap();
        let conn = ep.add_remote(&served.meta).unwrap();
        let local = ep.alloc(MIB).unwrap();
        let start = Instant::now();
        ep.read(
            conn,
            &local,
            0,
            MIB,
            &served.rbuf.slice(0, MIB as u32).unwrap(),
        )
        .unwrap();
        let took = start.elapsed();
        let mut got = vec![0u8; MIB];
        local.read_at(0, &mut got).unwrap();
        assert_eq!(check_pattern(&got, 0, 0), None);
        assert!(
            took > Duration::from_millis(LIVENESS_MS),
            "the shaped READ took {took:?}: not slow enough to test the bound"
        );
        assert!(ep.conn_status(conn).is_ok(), "a slow peer was failed");
        println!("a 1 MiB READ over a 2 Mbit/s link took {took:?}; the connection is up");
    });
    drop(hosts);
}

/// A peer far away is not a vanished one: over a link that delays every
/// packet by 400 ms each way (a userspace forwarder between two TUN
/// devices: this kernel has no `sch_netem` for `tc … delay`), an idle
/// connection stays up for three times `FERRY_LIVENESS_MS` (2 s) and
/// moves data byte-exact before and after; the first op's round trip
/// shows the delay is there.
#[test]
#[ignore = "needs root to make network namespaces (cargo test --test netns -- --ignored)"]
fn a_peer_behind_a_long_delay_is_not_failed_by_the_liveness_bound() {
    const LIVENESS_MS: u64 = 2000;
    const DELAY: Duration = Duration::from_millis(400);
    let hosts = Delayed::make_as_root(DELAY);
    let (srv, served) = serve_in(&hosts.a, "198.18.0.1", MIB);
    let b = hosts.b.clone();
    on_host(&b, vec![srv], move || {
        let mut cfg = client_config();
        cfg.liveness_ms = LIVENESS_MS;
        cfg.op_timeout_ms = 10_000;
        cfg.connect_timeout_ms = 10_000;
        let ep = Endpoint::builder().config(cfg).build().unwrap();
        let conn = ep.add_remote(&served.meta).unwrap();
        let local = ep.alloc(64 << 10).unwrap();
        let win = served.rbuf.slice(0, 64 << 10).unwrap();
        let start = Instant::now();
        ep.read(conn, &local, 0, 64 << 10, &win).unwrap();
        let rtt = start.elapsed();
        assert!(
            rtt >= 2 * DELAY,
            "a READ took {rtt:?}: the link is not delayed"
        );
        let mut got = vec![0u8; 64 << 10];
        local.read_at(0, &mut got).unwrap();
        assert_eq!(check_pattern(&got, 0, 0), None);
        std::thread::sleep(Duration::from_millis(3 * LIVENESS_MS));
        assert!(ep.conn_status(conn).is_ok(), "a far, idle peer was failed");
        let mut src = vec![0u8; 64 << 10];
        fill_pattern(&mut src, 0, 0x33);
        local.write_at(0, &src).unwrap();
        ep.write(conn, &local, 0, 64 << 10, &win).unwrap();
        assert_eq!(remote_hash(&ep, conn, 0, 64 << 10), fnv64(&src));
        assert!(ep.conn_status(conn).is_ok());
        println!(
            "round trip over the delayed link {rtt:?}; idle {} ms, still up",
            3 * LIVENESS_MS
        );
    });
    drop(hosts);
}

//! Faults with real processes, and the configured limits: restarts, stopped
//! and killed peers, connection churn without growth, limits that name
//! themselves.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use ferry::oob::IoPreference;
use ferry::{Endpoint, Error, Mode};

const MIB: usize = 1 << 20;

fn signal(pid: u32, sig: &str) {
    assert!(Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success());
}

/// Waits until every thread of `pid` has stopped: `kill -STOP` returns when
/// the signal is queued, and on a loaded machine a thread of the target can
/// still run (and answer a handshake) until the group stop reaches it.
fn wait_stopped(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let all = std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .flatten()
            .all(|t| {
                let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                // The state follows the parenthesised command name.
                stat.rsplit(") ")
                    .next()
                    .is_some_and(|rest| rest.starts_with('T'))
            });
        if all {
            return;
        }
        assert!(Instant::now() < deadline, "pid {pid} did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn restarted_peer_on_the_same_address() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let env = [("FERRY_LISTEN_PORT", port.to_string())];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut first = Target::start_on(Path::TcpEpoll, MIB, &env);
    let ep = client(IoPreference::Epoll);
    let conn = ep.add_remote(&first.served.meta).unwrap();
    let local = ep.alloc(4096).unwrap();
    let old_rb = first.served.rbuf;
    ep.read(conn, &local, 0, 64, &old_rb).unwrap();
    first.kill();
    let second = Target::start_on(Path::TcpEpoll, MIB, &env);
    assert_eq!(
        second.served.meta, first.served.meta,
        "same address and port"
    );
    // The old connection is stale: an error, not a hang.
    let e = ep.read(conn, &local, 0, 64, &old_rb).unwrap_err();
    assert!(matches!(e, Error::ConnFailed { .. }), "{e}");
    // add_remote forgets the dead connection and reconnects.
    let conn2 = ep.add_remote(&second.served.meta).unwrap();
    assert_ne!(conn2, conn);
    // The old incarnation's key means nothing to the new one.
    let e = ep.read(conn2, &local, 0, 64, &old_rb).unwrap_err();
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
    ep.read(conn2, &local, 0, 64, &second.served.rbuf).unwrap();
}

#[test]
fn stopped_peer_is_back_pressure_with_bounded_memory() {
    let t = Target::start_on(Path::TcpEpoll, 64 * MIB, &[]);
    let cfg = {
        let mut conf = config(IoPreference::Epoll);
        conf.max_inflight_ops = 64;
        conf.op_timeout_ms = 20_000;
        conf
    };
    let ep = Endpoint::builder().config(cfg).build().unwrap();
    let conn = ep.add_remote(&t.served.meta).unwrap();
    let local = ep.alloc(64 * MIB).unwrap();
    let rss0 = rss_kib(std::process::id());
    signal(t.child.id(), "-STOP");
    wait_stopped(t.child.id());
    let mut ts = Vec::new();
    let mut refused = 0;
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(800) {
        match ep.write_async(
            conn,
            &local,
            0,
            4 * MIB,
            &t.served.rbuf.slice(0, (4 * MIB) as u32).unwrap(),
        ) {
            Ok(tr) => ts.push(tr),
            Err(Error::TooManyInflight { max: 64 }) | Err(Error::QueueFull { .. }) => {
                refused += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("{e}"),
        }
    }
    let rss1 = rss_kib(std::process::id());
    assert_eq!(ts.len(), 64, "in-flight ops are capped");
    assert!(refused > 0, "a stopped peer must push back");
    assert!(
        rss1 < rss0 + 32 * 1024,
        "memory grew {rss0} -> {rss1} KiB while the peer was stopped"
    );
    signal(t.child.id(), "-CONT");
    for tr in ts {
        tr.wait().unwrap();
    }
    println!("refused {refused} submissions while stopped; rss {rss0} -> {rss1} KiB");
}

#[test]
fn peer_killed_mid_handshake_is_an_error_not_a_hang() {
    let t = Target::start_on(Path::TcpEpoll, 4096, &[]);
    let pid = t.child.id();
    // Stopped, the kernel still accepts the TCP connection but nobody answers.
    signal(pid, "-STOP");
    wait_stopped(pid);
    let meta = t.served.meta.clone();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        signal(pid, "-KILL");
    });
    let ep = Endpoint::builder()
        .config({
            let mut conf = config(IoPreference::Epoll);
            conf.connect_timeout_ms = 10_000;
            conf
        })
        .build()
        .unwrap();
    let start = Instant::now();
    let e = ep.add_remote(&meta).unwrap_err();
    let took = start.elapsed();
    killer.join().unwrap();
    assert!(
        took < Duration::from_secs(5),
        "took {took:?}: the dead peer's reset must end the handshake"
    );
    println!("handshake with a killed peer: {e} after {took:?}");
}

#[test]
fn limits_are_enforced_and_named() {
    // Connections, on the connecting side and on the accepting side.
    let t = Target::start_on(Path::TcpEpoll, 4096, &[("FERRY_MAX_CONNS", "1")]);
    let ep = Endpoint::builder()
        .config({
            let mut conf = config(IoPreference::Epoll);
            conf.max_conns = 1;
            conf
        })
        .build()
        .unwrap();
    ep.add_remote(&t.served.meta).unwrap();
    let other = Target::start_on(Path::TcpEpoll, 4096, &[]);
    let e = ep.add_remote(&other.served.meta).unwrap_err();
    assert!(
        matches!(
            e,
            Error::LimitReached {
                limit: "FERRY_MAX_CONNS",
                max: 1
            }
        ),
        "{e}"
    );
    let ep2 = client(IoPreference::Epoll);
    let e = ep2.add_remote(&t.served.meta).unwrap_err();
    assert!(e.to_string().contains("FERRY_MAX_CONNS"), "{e}");
    // Registrations.
    let ep3 = Endpoint::builder()
        .config({
            let mut conf = config(IoPreference::Epoll);
            conf.max_registrations = 2;
            conf
        })
        .build()
        .unwrap();
    let a = ep3.alloc(8).unwrap();
    let _b = ep3.alloc(8).unwrap();
    let e = ep3.alloc(8).unwrap_err();
    assert!(
        matches!(
            e,
            Error::LimitReached {
                limit: "FERRY_MAX_REGISTRATIONS",
                max: 2
            }
        ),
        "{e}"
    );
    ep3.deregister(a).unwrap();
    let _c = ep3.alloc(8).unwrap();
    assert_eq!(ep3.registration_count(), 2);
    // In-flight operations on one connection.
    let cfg = {
        let mut conf = config(IoPreference::Epoll);
        conf.max_conn_inflight_ops = 2;
        conf.mode = Mode::Embedded;
        conf
    };
    let ep4 = Endpoint::builder().config(cfg).build().unwrap();
    let mut shard = ep4.take_shards().pop().unwrap();
    let conn = ep4.add_remote(&other.served.meta).unwrap();
    let local = ep4.alloc(64).unwrap();
    let mut ts: Vec<_> = (0..3)
        .map(|_| {
            ep4.read_async(conn, &local, 0, 8, &other.served.rbuf)
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    while ts.iter_mut().any(|t| !t.is_done()) {
        shard.poll();
        assert!(Instant::now() < deadline);
    }
    let results: Vec<_> = ts.iter_mut().map(|t| t.poll().unwrap()).collect();
    assert!(results[0].is_ok() && results[1].is_ok());
    assert!(
        matches!(
            results[2],
            Err(Error::LimitReached {
                limit: "FERRY_MAX_CONN_INFLIGHT_OPS",
                max: 2
            })
        ),
        "{:?}",
        results[2]
    );
}

/// `ferry serve` takes its text commands from peers: a length it cannot
/// serve is an error reply, never an allocation of that size (it used to
/// abort on "hash 0 99999999999999").
#[test]
fn serve_refuses_ranges_outside_its_region() {
    let t = Target::start_on(Path::TcpEpoll, 4096, &[]);
    let ep = client(IoPreference::Epoll);
    let conn = ep.add_remote(&t.served.meta).unwrap();
    for req in [
        "hash 0 99999999999999",
        "fill 0 99999999999999 1",
        "hash 18446744073709551615 2",
        "hash 4000 97",
    ] {
        let a = ask(&ep, conn, req);
        assert!(a.starts_with("error range"), "{req}: {a}");
    }
    assert!(
        ask(&ep, conn, "hash 0 4096").starts_with("hash "),
        "still serving"
    );
}

//! The RDMA verbs path's behaviour where there is no NIC (every machine
//! this project tests on): the endpoint says why verbs is off, and
//! connections fall back to tcp and move bytes intact. `cargo test
//! --features rdma` runs the whole transfer suite in an rdma build too.

mod common;

use common::{config, Path, Target};
use ferry::oob::IoPreference;
use ferry::Endpoint;
use ferry_cli::testkit::{check_pattern, fill_pattern};

#[test]
fn without_a_nic_verbs_says_why_and_tcp_carries_the_bytes() {
    // Where this machine has RDMA devices, name one that does not exist:
    // verbs is off all the same, and the fallback still runs here.
    let has_nics = ferry::verbs::status(None, None).is_ok();
    let mut cfg = config(IoPreference::Auto);
    if has_nics {
        cfg.rdma_dev = Some("ferry-test-no-such-nic".into());
    }
    let ep = Endpoint::builder().config(cfg).build().unwrap();
    let why = ep
        .verbs_status()
        .expect_err("verbs must be off for this test")
        .to_owned();
    println!("verbs off: {why}");
    if has_nics {
        assert!(why.contains("ferry-test-no-such-nic"), "{why}");
    } else if cfg!(feature = "rdma") {
        assert!(
            why.contains("libibverbs")
                || why.contains("RDMA device")
                || why.contains("RDMA support"),
            "an rdma build names what is missing: {why}"
        );
        // The same reason, computed directly.
        assert_eq!(ferry::verbs::status(None, None).unwrap_err().why, why);
    } else {
        assert!(why.contains("`rdma` feature"), "{why}");
        assert_eq!(ferry::verbs::status(None, None).unwrap_err().why, why);
    }

    let target = Target::start_on(Path::TcpEpoll, 8 << 20, &[("FERRY_TRANSPORT", "tcp")]);
    let conn = ep.add_remote(&target.served.meta).unwrap();
    assert!(matches!(ep.peer(conn), Some(ferry::Peer::Net(_))));
    let mut src = vec![0u8; 8 << 20];
    fill_pattern(&mut src, 0, 41);
    let mr = ep.register(src).unwrap();
    ep.write(conn, &mr, 0, 8 << 20, &target.served.rbuf)
        .unwrap();
    let back = ep.alloc(8 << 20).unwrap();
    ep.read(conn, &back, 0, 8 << 20, &target.served.rbuf)
        .unwrap();
    let mut got = vec![0u8; 8 << 20];
    back.read_at(0, &mut got).unwrap();
    assert_eq!(check_pattern(&got, 0, 41), None);
}

// ---------------------------------------------------------------------
// The verbs path itself. These need an RDMA NIC, or the software NIC
// (`tools/softverbs/test` builds it and runs them with it first on the
// library path); the faults they inject (`SOFTVERBS_*` in the target's
// environment) are the software NIC's.

const MIB: usize = 1 << 20;

fn verbs_pair(bytes: usize, env: &[(&str, &str)]) -> (Target, Endpoint, ferry::ConnId) {
    Path::Verbs.require();
    let t = Target::start_on(Path::Verbs, bytes, env);
    let ep = common::path_client(Path::Verbs);
    let conn = ep.add_remote(&t.served.meta).expect("connect to target");
    (t, ep, conn)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_pattern(&mut v, 0, seed);
    v
}

#[test]
#[ignore = "needs an RDMA NIC or the software NIC (tools/softverbs/test)"]
fn deregistration_while_ops_are_in_flight_keeps_their_memory() {
    let (t, ep, conn) = verbs_pair(64 * MIB, &[]);
    assert!(ep.uses_verbs(conn));
    let rb = t.served.rbuf;
    for round in 0..4u8 {
        let src = ep.register(pattern(64 * MIB, round)).unwrap();
        let ts: Vec<_> = (0..64)
            .map(|i| {
                let w = rb.slice((i * MIB) as u32, MIB as u32).unwrap();
                ep.write_async(conn, &src, i * MIB, MIB, &w).unwrap()
            })
            .collect();
        // The handle goes while every op is in flight: the NIC must still
        // find the memory (and its registration) until they complete.
        if round % 2 == 0 {
            drop(src);
        } else {
            ep.deregister(src).unwrap();
        }
        for mut tr in ts {
            tr.wait_timeout(std::time::Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
        assert_eq!(
            common::remote_hash(&ep, conn, 0, 64 * MIB),
            ferry_cli::testkit::fnv64(&pattern(64 * MIB, round)),
            "round {round}"
        );
    }
    assert!(ep.uses_verbs(conn), "the connection stayed on verbs");
}

#[test]
#[ignore = "needs an RDMA NIC or the software NIC (tools/softverbs/test)"]
fn an_op_of_more_pieces_than_the_queues_hold_completes() {
    Path::Verbs.require();
    let t = Target::start_on(Path::Verbs, 32 * MIB, &[]);
    let mut cfg = common::path_config(Path::Verbs);
    // 4 KiB pieces: a 24 MiB op is 6144 work requests, more than 4 QPs
    // of depth 1024 can ever hold at once.
    cfg.chunk_bytes = 4096;
    let ep = Endpoint::builder().config(cfg).build().unwrap();
    let conn = ep.add_remote(&t.served.meta).unwrap();
    assert!(ep.uses_verbs(conn));
    let len = 24 * MIB;
    let src = ep.register(pattern(len, 7)).unwrap();
    let w = t.served.rbuf.slice(0, len as u32).unwrap();
    ep.write(conn, &src, 0, len, &w).unwrap();
    assert_eq!(
        common::remote_hash(&ep, conn, 0, len),
        ferry_cli::testkit::fnv64(&pattern(len, 7))
    );
    let back = ep.alloc(len).unwrap();
    ep.read(conn, &back, 0, len, &w).unwrap();
    let mut got = vec![0u8; len];
    back.read_at(0, &mut got).unwrap();
    assert!(got == pattern(len, 7), "READ of 6144 pieces");
    // A vectored op of 5000 parts, too.
    let parts: Vec<_> = (0..5000).map(|i| (&src, i * 4096, 4096)).collect();
    let wins: Vec<_> = (0..5000)
        .map(|i| t.served.rbuf.slice((i * 4096) as u32, 4096).unwrap())
        .collect();
    ep.writev(conn, &parts, &wins).unwrap();
    assert!(ep.uses_verbs(conn));
}

#[test]
#[ignore = "needs an RDMA NIC or the software NIC (tools/softverbs/test)"]
fn a_remote_access_error_fails_the_connection_and_ends_every_op_once() {
    let (t, ep, conn) = verbs_pair(64 * MIB, &[]);
    assert!(ep.uses_verbs(conn));
    let rb = t.served.rbuf;
    let src = ep.alloc(64 * MIB).unwrap();
    // Good ops in flight, then one with a NIC key the target never gave.
    let mut ts: Vec<_> = (0..32)
        .map(|i| {
            let w = rb.slice((i * 2 * MIB) as u32, 2 * MIB as u32).unwrap();
            ep.write_async(conn, &src, i * 2 * MIB, 2 * MIB, &w)
                .unwrap()
        })
        .collect();
    let mut forged = rb;
    let key = rb.nic_rkey().expect("the window carries a NIC key") ^ 0x00ab_0000;
    forged.reserved[12..16].copy_from_slice(&key.to_le_bytes());
    ts.push(ep.write_async(conn, &src, 0, 4096, &forged).unwrap());
    ts.extend((0..32).map(|i| {
        let w = rb.slice((i * 2 * MIB) as u32, 2 * MIB as u32).unwrap();
        ep.read_async(conn, &src, i * 2 * MIB, 2 * MIB, &w).unwrap()
    }));
    let started = std::time::Instant::now();
    let (mut ok, mut failed) = (0, 0);
    for mut tr in ts {
        match tr.wait_timeout(std::time::Duration::from_secs(10)) {
            Ok(()) => ok += 1,
            Err(ferry::Error::ConnFailed { .. }) | Err(ferry::Error::Verbs { .. }) => failed += 1,
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    println!("{ok} completed, {failed} failed in {:?}", started.elapsed());
    assert!(failed >= 1, "the forged key was refused");
    assert_eq!(ok + failed, 65, "every op ended once");
    // The connection is gone, and says so at once.
    let e = ep.write(conn, &src, 0, 8, &rb).unwrap_err();
    assert!(
        matches!(e, ferry::Error::ConnFailed { .. }),
        "later ops: {e}"
    );
    // A new connection to the same target works.
    let conn2 = ep.add_remote(&t.served.meta).unwrap();
    assert!(ep.uses_verbs(conn2));
    ep.write(conn2, &src, 0, MIB, &rb).unwrap();
}

#[test]
#[ignore = "needs the software NIC, whose faults it injects (tools/softverbs/test)"]
fn a_side_whose_queue_pairs_fail_to_connect_leaves_both_on_tcp() {
    require_softverbs();
    for point in ["rtr", "rts", "create_qp"] {
        let (t, ep, conn) = verbs_pair(8 * MIB, &[("SOFTVERBS_FAIL", point)]);
        assert!(
            !ep.uses_verbs(conn),
            "the target failed at {point}: the client must not use verbs"
        );
        let src = ep.register(pattern(8 * MIB, 3)).unwrap();
        ep.write(conn, &src, 0, 8 * MIB, &t.served.rbuf).unwrap();
        let back = ep.alloc(8 * MIB).unwrap();
        ep.read(conn, &back, 0, 8 * MIB, &t.served.rbuf).unwrap();
        let mut got = vec![0u8; 8 * MIB];
        back.read_at(0, &mut got).unwrap();
        assert!(got == pattern(8 * MIB, 3), "{point}: bytes over tcp");
    }
}

#[test]
#[ignore = "needs the software NIC, whose faults it injects (tools/softverbs/test)"]
fn read_depth_is_clamped_to_the_peers() {
    require_softverbs();
    // The target's NIC takes 2 READs in flight per QP; ours 16. Asking for
    // more than the responder has is a remote invalid-request error.
    let (t, ep, conn) = verbs_pair(64 * MIB, &[("SOFTVERBS_MAX_QP_RD_ATOM", "2")]);
    assert!(ep.uses_verbs(conn));
    let back = ep.alloc(64 * MIB).unwrap();
    ep.read(conn, &back, 0, 64 * MIB, &t.served.rbuf).unwrap();
    let mut got = vec![0u8; 64 * MIB];
    back.read_at(0, &mut got).unwrap();
    assert_eq!(check_pattern(&got, 0, 0), None);
    assert!(ep.uses_verbs(conn));
}

#[test]
#[ignore = "needs the software NIC, whose faults it injects (tools/softverbs/test)"]
fn a_registration_the_nic_refuses_moves_that_memory_over_tcp() {
    require_softverbs();
    // The target may pin 1 MiB (RLIMIT_MEMLOCK): its 16 MiB window gets
    // no NIC key, and ops on it go over tcp; the connection keeps verbs.
    let (t, ep, conn) = verbs_pair(16 * MIB, &[("SOFTVERBS_MEMLOCK_BYTES", "1048576")]);
    assert!(ep.uses_verbs(conn));
    assert_eq!(
        t.served.rbuf.nic_rkey(),
        None,
        "the target's window has no NIC key"
    );
    let src = ep.register(pattern(16 * MIB, 9)).unwrap();
    ep.write(conn, &src, 0, 16 * MIB, &t.served.rbuf).unwrap();
    assert_eq!(
        common::remote_hash(&ep, conn, 0, 16 * MIB),
        ferry_cli::testkit::fnv64(&pattern(16 * MIB, 9))
    );
}

/// Fails the calling test unless libibverbs is the software NIC (the test
/// injects faults only it has).
fn require_softverbs() {
    Path::Verbs.require();
    let nics = ferry::verbs::status(None, None).unwrap();
    assert!(
        softverbs_wrs(&nics[0]).is_some(),
        "this test injects the software NIC's faults: run it with tools/softverbs/test"
    );
}

/// A function of the software NIC's test hooks (a symbol of the
/// libibverbs.so.1 rdma-mummy-sys loaded); `None` on a real libibverbs.
fn softverbs_hook(name: &std::ffi::CStr) -> Option<*mut libc::c_void> {
    // SAFETY: RTLD_NOLOAD only finds the library already loaded; dlsym
    // only looks a name up.
    unsafe {
        let h = libc::dlopen(
            c"libibverbs.so.1".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_NOLOAD,
        );
        if h.is_null() {
            return None;
        }
        let f = libc::dlsym(h, name.as_ptr());
        (!f.is_null()).then_some(f)
    }
}

/// The software NIC's count of work requests this process's queue pairs on
/// `dev` executed; `None` on a real libibverbs.
fn softverbs_wrs(dev: &str) -> Option<u64> {
    let name = std::ffi::CString::new(dev).unwrap();
    let f = softverbs_hook(c"softverbs_device_wrs")?;
    // SAFETY: the hook's C signature is `uint64_t (const char *)`.
    let f: extern "C" fn(*const libc::c_char) -> u64 = unsafe { std::mem::transmute(f) };
    Some(f(name.as_ptr()))
}

/// Counts the work requests the whole process posts per NIC: run alone
/// (tools/softverbs/test does), or tests beside it add to the counts.
#[test]
#[ignore = "needs an RDMA NIC or the software NIC; alone (tools/softverbs/test)"]
fn queue_pairs_are_striped_over_every_nic() {
    let (t, ep, conn) = verbs_pair(64 * MIB, &[]);
    let nics = ep.verbs_status().expect("verbs is on").to_vec();
    if nics.len() < 2 {
        panic!("this test needs two NICs (tools/softverbs/test gives two): {nics:?}");
    }
    assert!(ep.uses_verbs(conn));
    let before: Vec<Option<u64>> = nics.iter().map(|n| softverbs_wrs(n)).collect();
    let src = ep.register(pattern(64 * MIB, 5)).unwrap();
    ep.write(conn, &src, 0, 64 * MIB, &t.served.rbuf).unwrap();
    assert_eq!(
        common::remote_hash(&ep, conn, 0, 64 * MIB),
        ferry_cli::testkit::fnv64(&pattern(64 * MIB, 5))
    );
    let back = ep.alloc(64 * MIB).unwrap();
    ep.read(conn, &back, 0, 64 * MIB, &t.served.rbuf).unwrap();
    let mut got = vec![0u8; 64 * MIB];
    back.read_at(0, &mut got).unwrap();
    assert!(got == pattern(64 * MIB, 5), "READ over every NIC");
    // Where the NIC is the software one, each NIC carried a share.
    for (n, b) in nics.iter().zip(before) {
        if let (Some(b), Some(a)) = (b, softverbs_wrs(n)) {
            println!("{n}: {} work requests", a - b);
            assert!(a > b, "{n} carried none of the connection's work requests");
        }
    }
    // FERRY_RDMA_MAX_NICS=1 keeps an endpoint on its best NIC.
    let mut cfg = common::path_config(Path::Verbs);
    cfg.rdma_max_nics = 1;
    let one = Endpoint::builder().config(cfg).build().unwrap();
    let c1 = one.add_remote(&t.served.meta).unwrap();
    assert!(one.uses_verbs(c1));
    let second = softverbs_wrs(&nics[1]);
    let src1 = one.register(pattern(8 * MIB, 6)).unwrap();
    one.write(c1, &src1, 0, 8 * MIB, &t.served.rbuf).unwrap();
    assert_eq!(
        common::remote_hash(&one, c1, 0, 8 * MIB),
        ferry_cli::testkit::fnv64(&pattern(8 * MIB, 6))
    );
    assert_eq!(softverbs_wrs(&nics[1]), second, "one NIC only");
}

#[test]
#[ignore = "needs an RDMA NIC or the software NIC (tools/softverbs/test)"]
fn info_lists_each_nic_with_its_port_and_gid() {
    Path::Verbs.require();
    let out = std::process::Command::new(common::ferry_bin())
        .arg("info")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    let nics = ferry::verbs::status(None, None).unwrap();
    for n in &nics {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{n} port 1:")))
            .unwrap_or_else(|| panic!("no line for {n}"));
        assert!(line.contains("GID index"), "{line}");
    }
    if softverbs_wrs(&nics[0]).is_some() {
        // The software NIC's RoCE table: index 3 is RoCE v2, IPv4-mapped.
        assert!(text.contains("ACTIVE, Ethernet, GID index 3"), "{text}");
        assert!(text.contains("RoCE v2, IPv4-mapped: routable"), "{text}");
    }
}

#[test]
#[ignore = "needs the software NIC, whose faults it injects (tools/softverbs/test)"]
fn bench_runs_over_verbs_and_refuses_a_connection_without_queue_pairs() {
    require_softverbs();
    Path::Verbs.require();
    let run = |env: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(common::ferry_bin());
        cmd.args([
            "bench",
            "--transport",
            "verbs",
            "--sizes",
            "4K,1M",
            "--seconds",
            "0.2",
            "--json",
        ]);
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    };
    let out = run(&[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("\"transport\":\"verbs\""))
        .collect();
    assert_eq!(rows.len(), 4, "write and read at two sizes: {text}");
    // Both processes fail QP setup: the bench says so instead of measuring tcp.
    let out = run(&[("SOFTVERBS_FAIL", "rtr")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("has no RDMA queue pairs"), "{err}");
}

#[test]
#[ignore = "needs the software NIC, whose faults it injects (tools/softverbs/test)"]
fn a_nic_refusing_to_destroy_queue_pairs_does_not_take_the_target_down() {
    require_softverbs();
    // The target's NIC refuses every destroy: closing a connection must
    // not panic its shard (sideway asserts on a failed destroy).
    // (Its shard catches sideway's panics: no backtraces in the log.)
    let (t, ep, conn) = verbs_pair(
        8 * MIB,
        &[
            ("SOFTVERBS_FAIL", "destroy_qp,destroy_cq"),
            ("RUST_BACKTRACE", "0"),
        ],
    );
    assert!(ep.uses_verbs(conn));
    let src = ep.register(pattern(8 * MIB, 1)).unwrap();
    for round in 0..3u8 {
        let c = if round == 0 {
            conn
        } else {
            ep.add_remote(&t.served.meta).unwrap()
        };
        assert!(ep.uses_verbs(c), "round {round}");
        ep.write(c, &src, 0, 8 * MIB, &t.served.rbuf).unwrap();
        assert_eq!(
            common::remote_hash(&ep, c, 0, 8 * MIB),
            ferry_cli::testkit::fnv64(&pattern(8 * MIB, 1)),
            "round {round}"
        );
        ep.remove_remote(c).unwrap();
        // Let the target drop its side of the connection.
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Calls the software NIC's `softverbs_set_port`; `false` on a real
/// libibverbs (no such hook).
fn softverbs_set_port(dev: &str, up: bool) -> bool {
    let name = std::ffi::CString::new(dev).unwrap();
    let Some(f) = softverbs_hook(c"softverbs_set_port") else {
        return false;
    };
    // SAFETY: the hook's C signature is `int (const char *, int)`.
    let f: extern "C" fn(*const libc::c_char, libc::c_int) -> libc::c_int =
        unsafe { std::mem::transmute(f) };
    f(name.as_ptr(), up as libc::c_int) == 0
}

/// Takes the port down for every process of the host, so other verbs
/// tests must not run beside it: `tools/softverbs/test` runs it alone.
#[test]
#[ignore = "needs the software NIC, alone (tools/softverbs/test runs it so)"]
fn port_down_fails_idle_connections_through_async_events() {
    Path::Verbs.require();
    let (t, ep, conn) = verbs_pair(8 * MIB, &[]);
    assert!(ep.uses_verbs(conn));
    let nics = ep.verbs_status().unwrap().to_vec();
    let dev = nics.last().unwrap().clone();
    struct Up(String);
    impl Drop for Up {
        fn drop(&mut self) {
            softverbs_set_port(&self.0, true);
        }
    }
    assert!(
        softverbs_set_port(&dev, false),
        "this test needs the software NIC's port hook"
    );
    let _up = Up(dev.clone());
    // Nothing is in flight: only the NIC's event can fail the connection.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while ep.conn_count() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the port of {dev} went down 10 s ago and the idle connection is still open"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let src = ep.alloc(MIB).unwrap();
    // Whichever side saw the event first closed it (the port is down for
    // both processes of this host).
    let e = ep.write(conn, &src, 0, MIB, &t.served.rbuf).unwrap_err();
    assert!(
        format!("{e}").contains("down")
            || matches!(e.as_fault(), ferry::ConnFault::PeerGone { .. }),
        "the connection's error: {e}"
    );
    // The port comes back: new connections get queue pairs again.
    softverbs_set_port(&dev, true);
    std::thread::sleep(std::time::Duration::from_millis(200));
    let c2 = ep.add_remote(&t.served.meta).unwrap();
    assert!(ep.uses_verbs(c2));
    ep.write(c2, &src, 0, MIB, &t.served.rbuf).unwrap();
}

/// The software NIC's count of inline WRITEs executed by this process.
fn softverbs_inline_wrs() -> Option<u64> {
    let f = softverbs_hook(c"softverbs_inline_wrs")?;
    // SAFETY: the hook's C signature is `uint64_t (void)`.
    let f: extern "C" fn() -> u64 = unsafe { std::mem::transmute(f) };
    Some(f())
}

#[test]
#[ignore = "needs the software NIC, which counts inline WRITEs (tools/softverbs/test)"]
fn small_host_writes_go_inline_and_arrive_intact() {
    require_softverbs();
    let (t, ep, conn) = verbs_pair(MIB, &[]);
    assert!(ep.uses_verbs(conn));
    let src = ep.register(pattern(MIB, 8)).unwrap();
    let before = softverbs_inline_wrs().unwrap();
    for (off, len) in [
        (0usize, 1usize),
        (100, 8),
        (4096, 64),
        (9000, 65),
        (20000, 4096),
    ] {
        let w = t.served.rbuf.slice(off as u32, len as u32).unwrap();
        ep.write(conn, &src, off, len, &w).unwrap();
        assert_eq!(
            common::remote_hash(&ep, conn, off, len),
            ferry_cli::testkit::fnv64(&pattern(MIB, 8)[off..off + len]),
            "{len} B at {off}"
        );
    }
    let inline = softverbs_inline_wrs().unwrap() - before;
    assert!(
        inline >= 3,
        "1, 8 and 64 B went inline ({inline} inline WRITEs)"
    );
}

#[test]
#[ignore = "needs the software NIC, which counts completion queues; alone (tools/softverbs/test)"]
fn a_shards_connections_share_its_completion_queues() {
    require_softverbs();
    let live = || -> i64 {
        let f = softverbs_hook(c"softverbs_live_cqs").expect("the software NIC");
        // SAFETY: the hook's C signature is `int64_t (void)`.
        let f: extern "C" fn() -> i64 = unsafe { std::mem::transmute(f) };
        f()
    };
    let t = Target::start_on(Path::Verbs, 16 * MIB, &[]);
    let mut cfg = common::path_config(Path::Verbs);
    cfg.shards = 2;
    let ep = Endpoint::builder().config(cfg).build().unwrap();
    let nics = ep.verbs_status().unwrap().len().min(4);
    let before = live();
    let conns: Vec<_> = (0..10)
        .map(|_| {
            ep.connect(
                ferry::EndpointMetadata::decode(&t.served.meta)
                    .unwrap()
                    .socket_addr(),
            )
            .unwrap()
        })
        .collect();
    assert!(conns.iter().all(|&c| ep.uses_verbs(c)));
    let made = live() - before;
    assert!(
        made <= (2 * nics) as i64,
        "10 connections on 2 shards made {made} completion queues (at most one per shard per NIC)"
    );
    // Ops on every connection at once: completions find their links.
    let src = ep.register(pattern(16 * MIB, 4)).unwrap();
    let win = |i: usize| {
        t.served
            .rbuf
            .slice(((i % 16) * MIB) as u32, MIB as u32)
            .unwrap()
    };
    let writes: Vec<_> = (0..160)
        .map(|i| {
            ep.write_async(conns[i % conns.len()], &src, (i % 16) * MIB, MIB, &win(i))
                .unwrap()
        })
        .collect();
    for mut tr in writes {
        tr.wait_timeout(std::time::Duration::from_secs(10)).unwrap();
    }
    assert_eq!(
        common::remote_hash(&ep, conns[0], 0, 16 * MIB),
        ferry_cli::testkit::fnv64(&pattern(16 * MIB, 4))
    );
    let back = ep.alloc(16 * MIB).unwrap();
    let reads: Vec<_> = (0..160)
        .map(|i| {
            ep.read_async(conns[i % conns.len()], &back, (i % 16) * MIB, MIB, &win(i))
                .unwrap()
        })
        .collect();
    for mut tr in reads {
        tr.wait_timeout(std::time::Duration::from_secs(10)).unwrap();
    }
    let mut got = vec![0u8; 16 * MIB];
    back.read_at(0, &mut got).unwrap();
    assert!(got == pattern(16 * MIB, 4), "READs over 10 connections");
    assert!(conns.iter().all(|&c| ep.uses_verbs(c)));
}

//! The same-host path: its shared-memory objects, crashed peers, the ring
//! under several producer processes, and memfd host memory.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use ferry::{Error, Peer};
use ferry_cli::testkit::{check_pattern, fill_pattern, fnv64};

const MIB: usize = 1 << 20;

fn shm_files_with(id_hex: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("ferry-") && n.contains(id_hex))
        .collect()
}

#[test]
fn shm_objects_are_private_and_removed_on_clean_shutdown() {
    let mut t = Target::start_on(Path::Shm, MIB, &[]);
    let ep = path_client(Path::Shm);
    let conn = ep.add_remote(&t.served.meta).unwrap();
    assert!(
        matches!(ep.peer(conn), Some(Peer::Local { .. })),
        "{:?}",
        ep.peer(conn)
    );
    let me = format!("{:016x}", ep.id());
    let files = shm_files_with(&me);
    // Our accept ring, our shard's doorbell (page and FIFO), and one ring
    // per direction of the connection.
    assert_eq!(files.len(), 5, "{files:?}");
    assert!(
        files.contains(&format!("ferry-{me}-bell0.fifo")),
        "{files:?}"
    );
    for f in &files {
        let mode = std::fs::metadata(format!("/dev/shm/{f}"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode & 0o077, 0, "/dev/shm/{f} has mode {mode:o}");
    }
    let target_id = files
        .iter()
        .find_map(|f| {
            f.strip_prefix(&format!("ferry-{me}-"))
                .map(|rest| rest[..16].to_owned())
        })
        .expect("a ring from us to the target");
    // Clean shutdown of both: the target when its stdin closes.
    drop(t.child.stdin.take());
    let status = t.child.wait().unwrap();
    assert!(status.success(), "{status}");
    drop(ep);
    assert!(
        shm_files_with(&me).is_empty(),
        "left behind: {:?}",
        shm_files_with(&me)
    );
    assert!(
        shm_files_with(&target_id).is_empty(),
        "left behind: {:?}",
        shm_files_with(&target_id)
    );
}

#[test]
fn crashed_peer_fails_transfers_and_its_rings_are_swept() {
    let mut t = Target::start_on(Path::Shm, 256 * MIB, &[]);
    let ep = path_client(Path::Shm);
    let conn = ep.add_remote(&t.served.meta).unwrap();
    let target = match ep.peer(conn) {
        Some(Peer::Local { endpoint_id, .. }) => endpoint_id,
        other => panic!("{other:?}"),
    };
    let me = format!("{:016x}", ep.id());
    let bell = format!("/dev/shm/ferry-{target:016x}-bell0");
    let stale = [
        format!("/dev/shm/ferry-{me}-{target:016x}-{:08x}", conn.0 as u32),
        bell.clone(),
        format!("{bell}.fifo"),
    ];
    for f in &stale {
        assert!(std::path::Path::new(f).exists(), "{f} is not there");
    }
    let local = ep.alloc(256 * MIB).unwrap();
    let rb = t.served.rbuf;
    let ts: Vec<_> = (0..64)
        .map(|i| {
            let len = 4 * MIB;
            ep.write_async(
                conn,
                &local,
                i * len,
                len,
                &rb.slice((i * len) as u32, len as u32).unwrap(),
            )
            .unwrap()
        })
        .collect();
    let pid = t.child.id();
    let killed = Instant::now();
    t.kill();
    let mut failed = 0;
    for mut tr in ts {
        match tr.wait_timeout(Duration::from_secs(10)) {
            Ok(()) => {}
            Err(Error::ConnFailed { cause, .. }) => {
                assert!(
                    matches!(cause, ferry::ConnFault::PeerGone { .. }),
                    "{cause:?}"
                );
                failed += 1;
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    let took = killed.elapsed();
    assert!(took < Duration::from_secs(6), "took {took:?}");
    let e = ep.write(conn, &local, 0, 8, &rb).unwrap_err();
    assert!(matches!(e, Error::ConnFailed { .. }), "{e}");
    println!("{failed} of 64 transfers failed after killing pid {pid}");
    // The dead target's ring and doorbell (page and FIFO), named from its
    // id, were there while it lived; once a new endpoint has started (this
    // one, or one of a test running beside this one), they are gone.
    let _fresh = path_client(Path::Shm);
    for f in &stale {
        assert!(!std::path::Path::new(f).exists(), "stale {f} was not swept");
    }
}

#[test]
fn memfd_host_memory_moves_byte_exact() {
    memfd_moves_byte_exact(&[]);
}

/// The target has four shards and no copy threads: copies of 1 MiB or
/// more are cut into slices its sibling shards copy (`start_host_copies`).
#[test]
fn memfd_host_memory_moves_byte_exact_in_slices_over_shards() {
    memfd_moves_byte_exact(&[("FERRY_SHARDS", "4"), ("FERRY_COPY_THREADS", "1")]);
}

/// Memory the target cannot map (plain registered memory): its copies go
/// through process_vm_readv/writev, sliced over the target's shards too.
#[test]
fn cma_memory_moves_byte_exact_in_slices_over_shards() {
    moves_byte_exact(&[("FERRY_SHARDS", "4"), ("FERRY_COPY_THREADS", "1")], false);
}

/// One shard and four copy threads (`FERRY_COPY_THREADS`): a large copy
/// is cut into slices the endpoint's copy threads share with the shard.
#[test]
fn memfd_host_memory_moves_byte_exact_in_slices_over_copy_threads() {
    let helpers = moves_byte_exact(&[("FERRY_SHARDS", "1"), ("FERRY_COPY_THREADS", "4")], true);
    assert_eq!(helpers, 3, "three helpers beside the shard");
}

#[test]
fn cma_memory_moves_byte_exact_in_slices_over_copy_threads() {
    let helpers = moves_byte_exact(&[("FERRY_SHARDS", "1"), ("FERRY_COPY_THREADS", "4")], false);
    assert_eq!(helpers, 3, "three helpers beside the shard");
}

/// A KV-cache shaped request (3000 pieces of about 4 KiB at odd offsets,
/// memory the target cannot map, so each piece is a CMA copy): the
/// target's shard hands its runs of pieces to the copy threads (which
/// start only for that: no piece is large) and answers each piece once
/// its job is done. Both ways, byte-exact, nothing outside the pieces
/// touched.
#[test]
fn many_small_cma_pieces_move_byte_exact_over_copy_threads() {
    const N: usize = 3000;
    let t = Target::start_on(
        Path::Shm,
        32 * MIB,
        &[("FERRY_SHARDS", "1"), ("FERRY_COPY_THREADS", "4")],
    );
    let ep = path_client(Path::Shm);
    let conn = ep.add_remote(&t.served.meta).unwrap();
    let rb = t.served.rbuf;
    let local = ep.alloc(32 * MIB).unwrap();
    // (local offset, remote offset, length): 4 KiB give or take, gaps
    // between them, odd places.
    let pieces: Vec<(usize, usize, usize)> = (0..N)
        .map(|i| (i * 8200 + i % 13, i * 9000 + 7 + i % 5, 4096 - 3 + i % 7))
        .collect();
    let mut src = vec![0u8; 32 * MIB];
    fill_pattern(&mut src, 0, 0x42);
    local.write_at(0, &src).unwrap();
    let locals: Vec<_> = pieces.iter().map(|&(l, _, n)| (&local, l, n)).collect();
    let wins: Vec<_> = (pieces.iter())
        .map(|&(_, r, n)| rb.slice(r as u32, n as u32).unwrap())
        .collect();
    ep.writev(conn, &locals, &wins).unwrap();
    for &(l, r, n) in pieces.iter().step_by(97) {
        assert_eq!(
            remote_hash(&ep, conn, r, n),
            fnv64(&src[l..l + n]),
            "piece at {r}"
        );
    }
    // Back into a clean buffer: only the pieces change.
    local.write_at(0, &vec![0xEEu8; 32 * MIB]).unwrap();
    ep.readv(conn, &locals, &wins).unwrap();
    let mut got = vec![0u8; 32 * MIB];
    local.read_at(0, &mut got).unwrap();
    let mut expect = vec![0xEEu8; 32 * MIB];
    for &(l, _, n) in &pieces {
        expect[l..l + n].copy_from_slice(&src[l..l + n]);
    }
    assert!(got == expect, "the READ back differs");
    assert_eq!(
        copy_threads_of(t.child.id()),
        3,
        "the pieces went to the copy threads"
    );
}

/// Without large copies, or with `FERRY_COPY_THREADS=1`, no copy thread
/// is started.
#[test]
fn copy_threads_start_only_when_a_large_copy_needs_them() {
    let t = Target::start_on(Path::Shm, 4 * MIB, &[("FERRY_COPY_THREADS", "4")]);
    let ep = path_client(Path::Shm);
    let conn = ep.add_remote(&t.served.meta).unwrap();
    let local = ep.alloc_host(4 * MIB).unwrap();
    ep.write(conn, &local, 0, 4096, &t.served.rbuf).unwrap();
    assert_eq!(copy_threads_of(t.child.id()), 0, "a small copy needs none");
    assert_eq!(moves_byte_exact(&[("FERRY_COPY_THREADS", "1")], true), 0);
}

/// Threads of process `pid` named as copy threads.
fn copy_threads_of(pid: u32) -> usize {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.starts_with("ferry-copy-"))
        .count()
}

fn memfd_moves_byte_exact(env: &[(&str, &str)]) {
    moves_byte_exact(env, true);
}

/// Moves odd ranges both ways; returns how many copy threads the target
/// had then.
fn moves_byte_exact(env: &[(&str, &str)], memfd: bool) -> usize {
    let t = Target::start_on(Path::Shm, 64 * MIB, env);
    let ep = path_client(Path::Shm);
    let conn = ep.add_remote(&t.served.meta).unwrap();
    let rb = t.served.rbuf;
    let local = if memfd {
        ep.alloc_host(64 * MIB).unwrap()
    } else {
        ep.alloc(64 * MIB).unwrap()
    };
    for (roff, loff, len) in [
        (0usize, 0usize, 64 * MIB - 64),
        (3, 17, 5 * MIB + 3),
        (4096 - 1, 1, 100),
        (7, 8, 4096),
        (65, 0, MIB),
        (1, 2, MIB - 1),
        (MIB + 5, 3, 3 * MIB + 65537),
    ] {
        let win = rb.slice(roff as u32, len as u32).unwrap();
        ep.read(conn, &local, loff, len, &win).unwrap();
        let mut got = vec![0u8; len];
        local.read_at(loff, &mut got).unwrap();
        assert_eq!(
            check_pattern(&got, roff as u64, 0),
            None,
            "read {len} at {roff}"
        );
        let mut src = vec![0u8; len];
        fill_pattern(&mut src, 0, 0x5c);
        local.write_at(loff, &src).unwrap();
        ep.write(conn, &local, loff, len, &win).unwrap();
        assert_eq!(
            remote_hash(&ep, conn, roff, len),
            fnv64(&src),
            "write {len} at {roff}"
        );
        assert_eq!(ask(&ep, conn, &format!("fill {roff} {len} 0")), "ok");
    }
    copy_threads_of(t.child.id())
}

#[test]
fn transport_choice_is_honoured() {
    let t = Target::start_on(Path::Shm, 4096, &[]);
    // auto picks shm for a peer on this host; tcp never does.
    let auto = ferry::Endpoint::builder()
        .config({
            let mut conf = config(ferry::oob::IoPreference::Auto);
            conf.transport = ferry::Transport::Auto;
            conf
        })
        .build()
        .unwrap();
    let c = auto.add_remote(&t.served.meta).unwrap();
    assert!(matches!(auto.peer(c), Some(Peer::Local { .. })));
    let tcp = client(ferry::oob::IoPreference::Auto);
    let c = tcp.add_remote(&t.served.meta).unwrap();
    assert!(matches!(tcp.peer(c), Some(Peer::Net(_))));
    // shm to a target that refuses shared memory is an error, not a silent tcp.
    let tcp_only = Target::start_on(Path::TcpEpoll, 4096, &[("FERRY_TRANSPORT", "tcp")]);
    let shm = path_client(Path::Shm);
    let e = shm.add_remote(&tcp_only.served.meta).unwrap_err();
    assert!(e.to_string().contains("shm"), "{e}");
}

/// A same-host peer that cannot reach our rings or memory (another user):
/// the connection falls back to tcp and still works.
#[test]
#[ignore = "needs root and setpriv to run the target as another user (cargo test --test shm -- --ignored)"]
fn refused_same_host_path_falls_back_to_tcp() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "needs root");
    assert!(
        std::path::Path::new("/usr/bin/setpriv").exists(),
        "needs /usr/bin/setpriv"
    );
    let mut cmd = Command::new("/usr/bin/setpriv");
    cmd.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        &common::ferry_bin(),
        "serve",
        "--bytes",
        "4096",
    ])
    .env("FERRY_TRANSPORT", "auto")
    .env("FERRY_LOG", "error")
    .stdin(std::process::Stdio::piped())
    .stdout(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let served = match ferry_cli::testkit::read_served(&mut out) {
        Ok(s) => s,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the target cannot run as nobody here: {e}");
        }
    };
    let cfg = {
        let mut conf = config(ferry::oob::IoPreference::Auto);
        conf.transport = ferry::Transport::Auto;
        conf.connect_timeout_ms = 1000;
        conf
    };
    let ep = ferry::Endpoint::builder().config(cfg).build().unwrap();
    let conn = ep.add_remote(&served.meta).unwrap();
    assert!(
        matches!(ep.peer(conn), Some(Peer::Net(_))),
        "{:?}",
        ep.peer(conn)
    );
    let local = ep.alloc(64).unwrap();
    ep.read(conn, &local, 0, 64, &served.rbuf).unwrap();
    let mut got = [0u8; 64];
    local.read_at(0, &mut got).unwrap();
    assert_eq!(check_pattern(&got, 0, 0), None);
    let _ = child.kill();
    let _ = child.wait();
}

/// The seed's explicit pair: `connect_local(peer id)` and `accept_local`.
#[test]
fn connect_local_and_accept_local() {
    let target = path_client(Path::Shm);
    let client = path_client(Path::Shm);
    let tid = target.id();
    let h = std::thread::spawn(move || {
        let got = target.accept_local(Duration::from_secs(5));
        (target, got)
    });
    let conn = client.connect_local(tid).unwrap();
    let (target, got) = h.join().unwrap();
    let (tconn, peer, pid) = got.unwrap();
    assert_eq!(peer, client.id());
    assert_eq!(pid, std::process::id());
    let m = target.alloc(64).unwrap();
    m.write_at(0, b"local").unwrap();
    let rb = target.advertise(tconn, &m, 0, 64).unwrap();
    let local = client.alloc(64).unwrap();
    client.read(conn, &local, 0, 5, &rb).unwrap();
    let mut got = [0u8; 5];
    local.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"local");
    assert!(matches!(
        target.accept_local(Duration::from_millis(50)),
        Err(Error::AcceptTimeout { timeout_ms: 50 })
    ));
}

/// Same-host connections spread over the shards like tcp ones (ids in
/// turn): an op on a connection completes when its own shard is polled and
/// never by another shard alone; each shard has its own doorbell, so a
/// shard other than 0 sleeps through idle time (no 1 ms wake-ups) and is
/// woken by the reply to its request.
#[test]
fn same_host_connections_spread_over_shards_and_each_shard_wakes_by_its_doorbell() {
    let t = Target::start_on(Path::Shm, MIB, &[("FERRY_SHARDS", "2")]);
    let mut c = path_config(Path::Shm);
    c.shards = 2;
    c.mode = ferry::Mode::Embedded;
    let ep = ferry::Endpoint::builder().config(c).build().unwrap();
    let mut shards = ep.take_shards();
    let me = format!("{:016x}", ep.id());
    for i in 0..2 {
        let files = shm_files_with(&me);
        assert!(
            files.contains(&format!("ferry-{me}-bell{i}.fifo")),
            "no doorbell for shard {i}: {files:?}"
        );
    }
    let addr = ferry::EndpointMetadata::decode(&t.served.meta)
        .unwrap()
        .socket_addr();
    let conns: Vec<_> = (0..4).map(|_| ep.connect(addr).unwrap()).collect();
    assert!(conns
        .iter()
        .all(|&c| matches!(ep.peer(c), Some(Peer::Local { .. }))));
    let src = ep.alloc_host(4096).unwrap();
    let win = t.served.rbuf.slice(0, 4096).unwrap();
    let mut owners = Vec::new();
    for &conn in &conns {
        let mut tr = ep.write_async(conn, &src, 0, 4096, &win).unwrap();
        // Polled alone, one shard completes it; the other never does.
        let mut owner = None;
        for (i, other) in [(0usize, 1usize), (1, 0)] {
            let until = Instant::now() + Duration::from_millis(200);
            while Instant::now() < until && tr.poll().is_none() {
                shards[i].poll();
            }
            if let Some(r) = tr.poll() {
                r.unwrap();
                owner = Some(i);
                // The other shard alone completes nothing of the next op.
                let mut t2 = ep.write_async(conn, &src, 0, 4096, &win).unwrap();
                let until = Instant::now() + Duration::from_millis(200);
                while Instant::now() < until {
                    shards[other].poll();
                }
                assert!(t2.poll().is_none(), "{conn} completed on shard {other} too");
                let deadline = Instant::now() + Duration::from_secs(10);
                while t2.poll().is_none() {
                    shards[i].poll();
                    assert!(Instant::now() < deadline, "never completed");
                }
                break;
            }
        }
        owners.push(owner.unwrap_or_else(|| panic!("{conn} never completed")));
    }
    assert!(
        owners.contains(&0) && owners.contains(&1),
        "4 same-host connections all on one shard: {owners:?}"
    );
    // Shard 1's connections go quiet (cold rings: their peer rings the
    // doorbell from now on); an idle park then lasts its whole length ...
    let (s1, conn1) = (1, conns[owners.iter().position(|&o| o == 1).unwrap()]);
    let until = Instant::now() + Duration::from_millis(100);
    while Instant::now() < until {
        shards[s1].poll();
    }
    let t0 = Instant::now();
    shards[s1].park(Duration::from_millis(400));
    let idle = t0.elapsed();
    assert!(
        idle >= Duration::from_millis(300),
        "an idle shard with same-host connections woke after {idle:?}"
    );
    // ... and a reply to a request wakes it.
    let mut tr = ep.write_async(conn1, &src, 0, 4096, &win).unwrap();
    shards[s1].poll();
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(10);
    while tr.poll().is_none() {
        shards[s1].park(Duration::from_secs(5));
        shards[s1].poll();
        assert!(Instant::now() < deadline, "never completed");
    }
    tr.poll().unwrap().unwrap();
    // (Unwoken, a park lasts a quarter of the op timeout: 2.5 s.)
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "the reply did not wake the parked shard ({:?})",
        t0.elapsed()
    );
}

#[test]
fn same_host_connects_to_a_passive_acceptor_are_answered_at_once() {
    // The passive accept thread waits in its gate for up to 500 ms; a
    // same-host CONNECT arrives on a ring, not a socket, and must wake it.
    // Without that wake, 40 connections in a row take ~10 s on average.
    let t = Target::start_on(Path::Shm, MIB, &[]);
    let ep = path_client(Path::Shm);
    let addr = ferry::EndpointMetadata::decode(&t.served.meta)
        .unwrap()
        .socket_addr();
    let start = Instant::now();
    let mut conns: Vec<_> = (0..40)
        .map(|_| {
            let c = ep.connect(addr).unwrap();
            assert!(matches!(ep.peer(c), Some(Peer::Local { .. })));
            c
        })
        .collect();
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(4),
        "40 same-host connects took {took:?}: the accept thread was not woken"
    );
    conns.sort();
    conns.dedup();
    assert_eq!(conns.len(), 40, "40 distinct connections");
}

/// Another user keeps resizing a file named like ours in /dev/shm (between
/// 0 and 4096 bytes) while 100 `ferry serve` processes start, each
/// sweeping /dev/shm: none dies (SIGBUS was 13 of 110 before the sweep
/// stopped mapping objects: issue 28 #1).
#[test]
#[ignore = "needs root and setpriv to resize as another user (cargo test --test shm -- --ignored)"]
fn a_neighbour_resizing_a_planted_object_crashes_no_start() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "needs root");
    let planted = format!("/dev/shm/ferry-planted-{}", std::process::id());
    // As fast as it can: 0 bytes, then 4096 (/usr/bin/python3: .ci/run
    // installs python3-venv, which brings it).
    let script = format!(
        "import os\nfd = os.open('{planted}', os.O_RDWR | os.O_CREAT, 0o644)\n\
         while True:\n    os.ftruncate(fd, 0)\n    os.ftruncate(fd, 4096)\n"
    );
    let mut resizer = Command::new("/usr/bin/setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .args(["/usr/bin/python3", "-c", &script])
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !std::path::Path::new(&planted).exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the resizer did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut deaths = Vec::new();
    for i in 0..100 {
        let mut child = Command::new(common::ferry_bin())
            .args(["serve", "--bytes", "4096"])
            .env("FERRY_TRANSPORT", "auto")
            .env("FERRY_LOG", "error")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let ready = ferry_cli::testkit::read_served(&mut out);
        let _ = child.kill();
        let status = child.wait().unwrap();
        if let Err(e) = ready {
            deaths.push(format!("start {i}: {e} ({status})"));
        }
    }
    let _ = resizer.kill();
    let _ = resizer.wait();
    let _ = std::fs::remove_file(&planted);
    assert!(
        deaths.is_empty(),
        "{} of 100 starts died: {deaths:?}",
        deaths.len()
    );
}

/// `vouch` on a same-host connection: the endpoint that dialed us (by
/// our metadata) vouches for it; one that dialed us by id alone
/// (`connect_local`, no address) vouches for none, nor does a stranger.
#[test]
fn vouch_on_one_host() {
    let ours = path_client(Path::Shm);
    ours.start_passive_accept().unwrap();
    let trusted = path_client(Path::Shm);
    trusted.start_passive_accept().unwrap();
    let at = trusted.metadata().socket_addr();
    trusted.add_remote(&ours.metadata_bytes()).unwrap();
    let (by_meta, peer) = ours.accept(Duration::from_secs(5)).unwrap();
    assert!(matches!(peer, Peer::Local { .. }), "{peer}");
    assert!(ours.vouch(by_meta, at).unwrap());
    trusted.connect_local(ours.id()).unwrap();
    let (by_id, _) = ours.accept(Duration::from_secs(5)).unwrap();
    assert!(!ours.vouch(by_id, at).unwrap());
    let stranger = path_client(Path::Shm);
    stranger.add_remote(&ours.metadata_bytes()).unwrap();
    let (theirs, _) = ours.accept(Duration::from_secs(5)).unwrap();
    assert!(!ours.vouch(theirs, at).unwrap());
}

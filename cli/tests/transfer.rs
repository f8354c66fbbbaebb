//! The public API's transfer suite, against a target in another process,
//! over real sockets, on both control-path backends.

mod common;

use std::time::{Duration, Instant};

use common::*;
use ferry::wire::Status;
use ferry::{Error, RemoteBuf};
use ferry_cli::testkit::{check_pattern, fill_pattern, fnv64};

const MIB: usize = 1 << 20;

/// Runs each listed test over tcp with the io_uring and the epoll control
/// path, and over the same-host shared-memory path.
macro_rules! on_every_path {
    ($($name:ident),* $(,)?) => {
        mod uring {
            $( #[test] fn $name() { super::Path::TcpUring.require(); super::$name(super::Path::TcpUring) } )*
        }
        mod epoll {
            $( #[test] fn $name() { super::$name(super::Path::TcpEpoll) } )*
        }
        mod shm {
            $( #[test] fn $name() { super::$name(super::Path::Shm) } )*
        }
    };
}

/// The suite's tests whose expectations hold on RDMA too. Not here: a bad
/// key or window is refused by the target's NIC, which moves the RC queue
/// pair to the error state (the connection fails, as in the seed), so the
/// "connection stays usable" tests are tcp/shm only; a killed peer shows as
/// a retry-exceeded completion.
macro_rules! on_verbs {
    ($($name:ident),* $(,)?) => {
        mod verbs {
            $(
                #[test]
                #[ignore = "needs an RDMA NIC or the software NIC (tools/softverbs/test)"]
                fn $name() { super::Path::Verbs.require(); super::$name(super::Path::Verbs) }
            )*
        }
    };
}

on_verbs!(
    byte_exact_sizes_and_unaligned_offsets,
    large_transfer_256_mib,
    vectored_ops,
    prepared_ops,
    async_ops_complete_out_of_order,
    thousand_ops_in_flight,
    local_argument_errors,
    notifications_and_remove_remote,
    peer_killed_mid_transfer_fails_within_timeout,
    connect_errors_within_timeout,
    bad_metadata_is_an_error,
    several_streams_chunked,
);

on_every_path!(
    byte_exact_sizes_and_unaligned_offsets,
    large_transfer_256_mib,
    vectored_ops,
    prepared_ops,
    async_ops_complete_out_of_order,
    thousand_ops_in_flight,
    bad_key_bounds_and_access_keep_connection_usable,
    local_argument_errors,
    peer_killed_mid_transfer_fails_within_timeout,
    connect_errors_within_timeout,
    bad_metadata_is_an_error,
    notifications_and_remove_remote,
    several_streams_chunked,
);

fn setup(io: Path, bytes: usize) -> (Target, ferry::Endpoint, ferry::ConnId) {
    let t = Target::start_on(io, bytes, &[]);
    let ep = path_client(io);
    let conn = ep.add_remote(&t.served.meta).expect("connect to target");
    if io == Path::Verbs {
        assert!(
            ep.uses_verbs(conn),
            "both sides have a NIC: the connection has queue pairs"
        );
        assert!(
            t.served.rbuf.nic_rkey().is_some(),
            "the target's window carries its NIC key"
        );
    }
    (t, ep, conn)
}

/// READ checks against the target's initial pattern; WRITE is checked by
/// the target's own hash of its memory, then read back.
#[allow(clippy::too_many_arguments)]
fn round_trip(
    ep: &ferry::Endpoint,
    conn: ferry::ConnId,
    rb: &RemoteBuf,
    local: &ferry::MemoryRegion,
    roff: usize,
    loff: usize,
    len: usize,
    seed: u8,
) {
    let win = rb.slice(roff as u32, len as u32).unwrap();
    ep.read(conn, local, loff, len, &win).unwrap();
    let mut got = vec![0u8; len];
    local.read_at(loff, &mut got).unwrap();
    if let Some(i) = check_pattern(&got, roff as u64, 0) {
        panic!("READ of {len} B at remote {roff}: byte {i} wrong");
    }
    let mut src = vec![0u8; len];
    fill_pattern(&mut src, roff as u64, seed);
    local.write_at(loff, &src).unwrap();
    ep.write(conn, local, loff, len, &win).unwrap();
    assert_eq!(
        remote_hash(ep, conn, roff, len),
        fnv64(&src),
        "WRITE of {len} B at remote {roff}"
    );
    local.write_at(loff, &vec![0u8; len]).unwrap();
    ep.read(conn, local, loff, len, &win).unwrap();
    local.read_at(loff, &mut got).unwrap();
    assert!(got == src, "read-back of {len} B at remote {roff}");
    // Put the target's pattern back for the next check.
    assert_eq!(ask(ep, conn, &format!("fill {roff} {len} 0")), "ok");
}

fn byte_exact_sizes_and_unaligned_offsets(io: Path) {
    let (_t, ep, conn) = setup(io, 40 * MIB);
    let rb = _t.served.rbuf;
    let local = ep.alloc(40 * MIB).unwrap();
    let sizes = [
        1usize,
        2,
        3,
        7,
        8,
        31,
        32,
        33,
        4095,
        4096,
        4097,
        65_535,
        65_536 + 3,
        MIB + 1,
        4 * MIB - 7,
        16 * MIB,
    ];
    for (i, &len) in sizes.iter().enumerate() {
        let roff = [0usize, 1, 3, 4093, 65_537][i % 5];
        let loff = [0usize, 5, 1, 7, 4099][(i + 2) % 5];
        round_trip(&ep, conn, &rb, &local, roff, loff, len, i as u8 + 1);
    }
}

fn large_transfer_256_mib(io: Path) {
    let (_t, ep, conn) = setup(io, 256 * MIB + 4096);
    let local = ep.alloc(256 * MIB + 4096).unwrap();
    round_trip(
        &ep,
        conn,
        &_t.served.rbuf,
        &local,
        4096 - 3,
        1,
        256 * MIB,
        0x77,
    );
}

fn vectored_ops(io: Path) {
    let (t, ep, conn) = setup(io, 8 * MIB);
    let rb = t.served.rbuf;
    let locals: Vec<_> = (0..8).map(|_| ep.alloc(MIB).unwrap()).collect();
    let lens = [1usize, 100, 4096, 5000, 65_536, 1000, MIB - 1, 3];
    let remotes: Vec<RemoteBuf> = (0..8)
        .map(|i| rb.slice((i * MIB + i) as u32, lens[i] as u32).unwrap())
        .collect();
    let pieces: Vec<(&ferry::MemoryRegion, usize, usize)> =
        locals.iter().zip(lens).map(|(m, l)| (m, 0, l)).collect();
    ep.readv(conn, &pieces, &remotes).unwrap();
    for i in 0..8 {
        let mut got = vec![0u8; lens[i]];
        locals[i].read_at(0, &mut got).unwrap();
        assert_eq!(
            check_pattern(&got, (i * MIB + i) as u64, 0),
            None,
            "readv piece {i}"
        );
        let mut src = vec![0u8; lens[i]];
        fill_pattern(&mut src, 0, i as u8 + 50);
        locals[i].write_at(0, &src).unwrap();
    }
    ep.writev(conn, &pieces, &remotes).unwrap();
    for (i, &len) in lens.iter().enumerate() {
        let mut src = vec![0u8; len];
        fill_pattern(&mut src, 0, i as u8 + 50);
        assert_eq!(
            remote_hash(&ep, conn, i * MIB + i, len),
            fnv64(&src),
            "writev piece {i}"
        );
    }
    assert!(matches!(
        ep.writev(conn, &pieces[..2], &remotes[..3]),
        Err(Error::VectorMismatch {
            locals: 2,
            remotes: 3
        })
    ));
    let none: [ferry::RemoteBuf; 0] = [];
    assert!(matches!(
        ep.readv(conn, &[], &none),
        Err(Error::EmptyVector)
    ));
}

/// An op prepared once and posted again and again moves the bytes the
/// memory holds at each post; a prepare refuses what a post would.
fn prepared_ops(io: Path) {
    let (t, ep, conn) = setup(io, 8 * MIB);
    let rb = t.served.rbuf;
    let local = ep.alloc(8 * MIB).unwrap();
    let lens = [1usize, 100, 4096, 5000, 65_536, 1000, MIB - 1, 3];
    let at = |i: usize| i * MIB + i;
    let windows: Vec<ferry::AnyWindow> = (0..8)
        .map(|i| ferry::AnyWindow::Key(rb.slice(at(i) as u32, lens[i] as u32).unwrap()))
        .collect();
    let pieces: Vec<(&ferry::MemoryRegion, usize, usize)> =
        (0..8).map(|i| (&local, at(i), lens[i])).collect();
    let write = ep
        .prepare(conn, ferry::OpKind::Write, &pieces, &windows)
        .unwrap();
    let read = ep
        .prepare(conn, ferry::OpKind::Read, &pieces, &windows)
        .unwrap();
    assert_eq!((write.pieces(), write.is_planned()), (8, false));
    for round in 0..3u8 {
        for (i, &len) in lens.iter().enumerate() {
            let mut src = vec![0u8; len];
            fill_pattern(&mut src, 0, 60 + round + i as u8);
            local.write_at(at(i), &src).unwrap();
        }
        let note = format!("round {round}");
        let note = (round == 2).then_some(note.as_bytes());
        ep.post(&write, note).unwrap().wait().unwrap();
        if note.is_some() {
            // The target reads notifications as requests: it says it does
            // not know this one, so it came (after the data).
            let (_, said) = ep.recv_notification(Duration::from_secs(10)).unwrap();
            let said = String::from_utf8_lossy(&said).into_owned();
            assert!(said.contains("round 2"), "{said}");
        }
        for (i, &len) in lens.iter().enumerate() {
            let mut src = vec![0u8; len];
            fill_pattern(&mut src, 0, 60 + round + i as u8);
            assert_eq!(
                remote_hash(&ep, conn, at(i), len),
                fnv64(&src),
                "round {round} piece {i}"
            );
        }
        // Back into zeroed memory.
        local.write_at(0, &vec![0u8; 8 * MIB]).unwrap();
        ep.post(&read, None).unwrap().wait().unwrap();
        for (i, &len) in lens.iter().enumerate() {
            let mut got = vec![0u8; len];
            local.read_at(at(i), &mut got).unwrap();
            assert_eq!(
                check_pattern(&got, 0, 60 + round + i as u8),
                None,
                "read back {i}"
            );
        }
    }
    // Refused at prepare as a post refuses.
    let kind = ferry::OpKind::Write;
    assert!(matches!(
        ep.prepare(conn, kind, &pieces[..2], &windows[..3]),
        Err(Error::VectorMismatch {
            locals: 2,
            remotes: 3
        })
    ));
    assert!(matches!(
        ep.prepare(conn, kind, &[], &[]),
        Err(Error::EmptyVector)
    ));
    let outside = [(&local, 8 * MIB - 2, 3)];
    assert!(ep.prepare(conn, kind, &outside, &windows[..1]).is_err());
    let too_long = [(&local, 0, 5)];
    assert!(matches!(
        ep.prepare(conn, kind, &too_long, &windows[..1]),
        Err(Error::RemoteTooSmall { len: 5, .. })
    ));
    let frozen = ep
        .register_with(vec![0u8; 4096], ferry::Access::REMOTE_READ)
        .unwrap();
    assert!(matches!(
        ep.prepare(conn, ferry::OpKind::Read, &[(&frozen, 0, 1)], &windows[..1]),
        Err(Error::ReadOnlyDestination { .. })
    ));
}

fn async_ops_complete_out_of_order(io: Path) {
    let (t, ep, conn) = setup(io, 64 * MIB);
    let rb = t.served.rbuf;
    let local = ep.alloc(64 * MIB).unwrap();
    // Big and small ops mixed; waited on newest first.
    let plan: Vec<(usize, usize)> = (0..24)
        .map(|i| {
            (
                i * 2 * MIB + i,
                if i % 3 == 0 { 2 * MIB - 100 } else { 10 + i },
            )
        })
        .collect();
    let mut ts: Vec<_> = plan
        .iter()
        .map(|&(off, len)| {
            ep.read_async(
                conn,
                &local,
                off,
                len,
                &rb.slice(off as u32, len as u32).unwrap(),
            )
            .unwrap()
        })
        .collect();
    let mut seen_done_early = 0;
    while let Some(mut t) = ts.pop() {
        if t.is_done() {
            seen_done_early += 1;
        }
        t.wait_timeout(Duration::from_secs(20)).unwrap();
        assert!(
            t.poll().unwrap().is_ok(),
            "poll after completion repeats the outcome"
        );
    }
    let _ = seen_done_early;
    for &(off, len) in &plan {
        let mut got = vec![0u8; len];
        local.read_at(off, &mut got).unwrap();
        assert_eq!(
            check_pattern(&got, off as u64, 0),
            None,
            "async read at {off}"
        );
    }
    assert_eq!(ep.inflight_ops(), 0, "every slot was freed");
}

fn thousand_ops_in_flight(io: Path) {
    let (t, ep, conn) = setup(io, 8 * MIB);
    let rb = t.served.rbuf;
    let local = ep.alloc(4096 * 1000).unwrap();
    let mut src = vec![0u8; 4096 * 1000];
    fill_pattern(&mut src, 0, 0x42);
    local.write_at(0, &src).unwrap();
    let ts: Vec<_> = (0..1000)
        .map(|i| {
            ep.write_async(
                conn,
                &local,
                i * 4096,
                4096,
                &rb.slice((i * 4096) as u32, 4096).unwrap(),
            )
            .unwrap()
        })
        .collect();
    assert!(ep.inflight_ops() > 0);
    for t in ts {
        t.wait().unwrap();
    }
    assert_eq!(remote_hash(&ep, conn, 0, 4096 * 1000), fnv64(&src));
}

fn bad_key_bounds_and_access_keep_connection_usable(io: Path) {
    let (t, ep, conn) = setup(io, MIB);
    let s = &t.served;
    let local = ep.alloc(MIB).unwrap();
    let still_works = || {
        ep.read(conn, &local, 0, 64, &s.rbuf).unwrap();
        let mut got = vec![0u8; 64];
        local.read_at(0, &mut got).unwrap();
        assert_eq!(check_pattern(&got, 0, 0), None);
    };
    let remote_status = |r: Result<(), Error>| match r {
        Err(Error::Remote { status, .. }) => status,
        other => panic!("expected a refusal from the target, got {other:?}"),
    };
    // Unknown key, on WRITE (its payload must be skipped) and READ.
    let bad_key = RemoteBuf {
        rkey: s.rbuf.rkey ^ 0x5555,
        ..s.rbuf
    };
    assert_eq!(
        remote_status(ep.write(conn, &local, 0, 4096, &bad_key)),
        Status::UnknownKey
    );
    still_works();
    assert_eq!(
        remote_status(ep.read(conn, &local, 0, 4096, &bad_key)),
        Status::UnknownKey
    );
    still_works();
    // Out of bounds: past the end, before the start, and wrapping around.
    let past = RemoteBuf {
        addr: s.rbuf.addr + MIB as u64 - 10,
        size: 4096,
        ..s.rbuf
    };
    assert_eq!(
        remote_status(ep.write(conn, &local, 0, 100, &past)),
        Status::OutOfBounds
    );
    still_works();
    let before = RemoteBuf {
        addr: s.rbuf.addr - 1,
        ..s.rbuf
    };
    assert_eq!(
        remote_status(ep.read(conn, &local, 0, 10, &before)),
        Status::OutOfBounds
    );
    let wrap = RemoteBuf {
        addr: u64::MAX - 5,
        size: 4096,
        ..s.rbuf
    };
    assert_eq!(
        remote_status(ep.read(conn, &local, 0, 100, &wrap)),
        Status::OutOfBounds
    );
    still_works();
    // Permissions.
    assert_eq!(
        remote_status(ep.write(conn, &local, 0, 16, &s.rbuf_ro)),
        Status::AccessDenied
    );
    assert_eq!(
        remote_status(ep.read(conn, &local, 0, 16, &s.rbuf_wo)),
        Status::AccessDenied
    );
    ep.read(conn, &local, 0, 16, &s.rbuf_ro).unwrap();
    ep.write(conn, &local, 0, 16, &s.rbuf_wo).unwrap();
    // A refusal in the middle of a vector fails the transfer; the others land.
    let pieces = [(&local, 0usize, 8usize), (&local, 8, 8)];
    let e = ep
        .writev(conn, &pieces, &[s.rbuf.slice(0, 8).unwrap(), bad_key])
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote {
                status: Status::UnknownKey,
                ..
            }
        ),
        "{e}"
    );
    let mut first = [0u8; 8];
    local.read_at(0, &mut first).unwrap();
    assert_eq!(
        remote_hash(&ep, conn, 0, 8),
        fnv64(&first),
        "the good piece landed"
    );
    assert_eq!(ask(&ep, conn, "fill 0 8 0"), "ok");
    still_works();
}

fn local_argument_errors(io: Path) {
    let (t, ep, conn) = setup(io, MIB);
    let rb = t.served.rbuf;
    let local = ep.alloc(4096).unwrap();
    // Longer than the advertised window: refused before anything is sent.
    let small = rb.slice(0, 100).unwrap();
    assert!(matches!(
        ep.write(conn, &local, 0, 101, &small),
        Err(Error::RemoteTooSmall {
            len: 101,
            remote_size: 100
        })
    ));
    // Outside the local region.
    assert!(matches!(
        ep.read(conn, &local, 4000, 100, &rb),
        Err(Error::OutOfRange {
            offset: 4000,
            len: 100,
            region_len: 4096
        })
    ));
    assert!(matches!(
        ep.read(conn, &local, usize::MAX, 2, &rb),
        Err(Error::OutOfRange { .. })
    ));
    // A connection id that was never opened.
    let e = ep
        .write(ferry::ConnId(999_999), &local, 0, 8, &rb)
        .unwrap_err();
    assert!(matches!(e, Error::UnknownConn { .. }), "{e}");
    assert!(matches!(
        ep.send_notification(conn, &[0u8; 5000]),
        Err(Error::NotifyTooLong {
            len: 5000,
            max: 4096
        })
    ));
}

fn peer_killed_mid_transfer_fails_within_timeout(io: Path) {
    let (mut t, ep, conn) = setup(io, 256 * MIB);
    let rb = t.served.rbuf;
    let local = ep.alloc(256 * MIB).unwrap();
    let ts: Vec<_> = (0..8)
        .map(|i| {
            let len = 32 * MIB;
            let w = rb.slice((i * len) as u32, len as u32).unwrap();
            if i % 2 == 0 {
                ep.write_async(conn, &local, i * len, len, &w).unwrap()
            } else {
                ep.read_async(conn, &local, i * len, len, &w).unwrap()
            }
        })
        .collect();
    std::thread::sleep(Duration::from_millis(30));
    let killed = Instant::now();
    t.kill();
    let mut failed = 0;
    for mut tr in ts {
        match tr.wait_timeout(Duration::from_secs(10)) {
            Err(Error::ConnFailed { .. }) => failed += 1,
            Ok(()) => {}
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    let took = killed.elapsed();
    assert!(failed > 0, "killing the peer failed no transfer");
    assert!(
        took < Duration::from_millis(5000 + 1000),
        "errors took {took:?}, the op timeout is 5 s"
    );
    // The error stays on the connection.
    let e = ep.write(conn, &local, 0, 8, &rb).unwrap_err();
    assert!(matches!(e, Error::ConnFailed { .. }), "{e}");
}

fn connect_errors_within_timeout(io: Path) {
    let ep = path_client(io);
    // A closed port: refused at once.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let start = Instant::now();
    let e = ep
        .connect(format!("127.0.0.1:{port}").parse().unwrap())
        .unwrap_err();
    assert!(matches!(e, Error::Connect { .. }), "{e}");
    assert!(start.elapsed() < Duration::from_secs(3));
    // A listener that accepts but never answers the handshake: timeout.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let start = Instant::now();
    let e = ep.connect(addr).unwrap_err();
    assert!(
        matches!(
            e,
            Error::ConnectTimeout {
                timeout_ms: 3000,
                ..
            }
        ),
        "{e}"
    );
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(2900) && took < Duration::from_secs(6),
        "took {took:?}"
    );
    // A listener that answers with garbage: a handshake error naming it.
    let garbage = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gaddr = garbage.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        use std::io::Write;
        let (mut s, _) = garbage.accept().unwrap();
        s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(200));
    });
    let e = ep.connect(gaddr).unwrap_err();
    assert!(matches!(e, Error::Decode(_)), "{e}");
    h.join().unwrap();
    // Accept with nobody coming.
    let start = Instant::now();
    assert!(matches!(
        ep.accept(Duration::from_millis(300)),
        Err(Error::AcceptTimeout { timeout_ms: 300 })
    ));
    assert!(start.elapsed() < Duration::from_secs(2));
}

fn bad_metadata_is_an_error(io: Path) {
    let t = Target::start_on(io, 4096, &[]);
    let ep = path_client(io);
    let meta = &t.served.meta;
    for cut in [0, 1, 6, meta.len() - 1] {
        assert!(
            matches!(ep.add_remote(&meta[..cut]), Err(Error::Decode(_))),
            "truncated to {cut}"
        );
    }
    let mut long = meta.clone();
    long.extend_from_slice(&[0u8; 300]);
    assert!(matches!(ep.add_remote(&long), Err(Error::Decode(_))));
    assert!(matches!(
        ep.add_remote(&[0xffu8; 19]),
        Err(Error::Decode(_))
    ));
    // Good metadata still works, and is memoized.
    let a = ep.add_remote(meta).unwrap();
    let b = ep.add_remote(meta).unwrap();
    assert_eq!(a, b);
}

fn notifications_and_remove_remote(io: Path) {
    let (t, ep, conn) = setup(io, 4096);
    assert_eq!(ask(&ep, conn, "echo hello"), "echo hello");
    let big = format!("echo {}", "x".repeat(4000));
    assert_eq!(ask(&ep, conn, &big), big);
    let local = ep.alloc(64).unwrap();
    ep.remove_remote(conn).unwrap();
    let e = ep.read(conn, &local, 0, 8, &t.served.rbuf).unwrap_err();
    assert!(matches!(e, Error::UnknownConn { .. }), "{e}");
    assert!(matches!(
        ep.remove_remote(conn),
        Err(Error::UnknownConn { .. })
    ));
    // A new connection to the same peer works.
    let c2 = ep.add_remote(&t.served.meta).unwrap();
    assert_ne!(c2, conn);
    ep.read(c2, &local, 0, 8, &t.served.rbuf).unwrap();
}

fn several_streams_chunked(io: Path) {
    let t = Target::start_on(io, 32 * MIB, &[]);
    let cfg = {
        let mut conf = path_config(io);
        conf.streams_per_conn = 4;
        conf.chunk_bytes = 64 * 1024;
        conf
    };
    let ep = ferry::Endpoint::builder().config(cfg).build().unwrap();
    let conn = ep.add_remote(&t.served.meta).unwrap();
    let local = ep.alloc(32 * MIB).unwrap();
    round_trip(&ep, conn, &t.served.rbuf, &local, 7, 3, 32 * MIB - 7, 0x99);
    round_trip(&ep, conn, &t.served.rbuf, &local, 0, 0, 100_000, 0x98);
}

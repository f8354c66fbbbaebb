//! One connection spread over several shards (lanes): large ops are cut
//! over the lanes and land byte-exact, both sides' lanes are independent
//! (a 4-lane side talks to a 2-lane one), vectored ops and small ones are
//! dealt over the lanes, windows scoped to the connection work on every
//! lane, and an op really runs on several shards (placement).

mod common;

use std::time::{Duration, Instant};

use common::*;
use ferry::oob::IoPreference;
use ferry::{Config, Endpoint, Error, Mode};
use ferry_cli::testkit::{check_pattern, fill_pattern};

const CHUNK: usize = 64 << 10;

fn cfg(shards: usize, streams: u16) -> Config {
    let mut c = config(IoPreference::Auto);
    c.shards = shards;
    c.streams_per_conn = streams;
    c.chunk_bytes = CHUNK;
    c
}

fn pair(a: Config, b: Config) -> (Endpoint, Endpoint, ferry::ConnId, ferry::ConnId) {
    let a = Endpoint::builder().config(a).build().unwrap();
    let b = Endpoint::builder().config(b).build().unwrap();
    b.start_passive_accept().unwrap();
    let ca = a.add_remote(&b.metadata_bytes()).unwrap();
    let (cb, _) = b.accept(Duration::from_secs(5)).unwrap();
    (a, b, ca, cb)
}

#[test]
fn striped_ops_are_byte_exact_over_lanes() {
    // 4 lanes of 2 streams against 2 lanes of 4 streams (and back).
    let (a, b, ca, cb) = pair(cfg(4, 8), cfg(2, 8));
    assert_ne!(ca.0 >> 56, 0, "the connection is spread: {ca}");
    let size = 8 << 20;
    let ma = a.alloc(size).unwrap();
    let mb = b.alloc(size).unwrap();
    let win_b = mb.advertise(0, size).unwrap();
    let win_a = ma.advertise(0, size).unwrap();
    let mut src = vec![0u8; size];
    for (round, (off, len)) in [
        (0usize, size),
        (3, size - 7),
        (CHUNK - 1, 2 * CHUNK + 5),
        (17, 2 * CHUNK),
        (0, 100),
        (5 * CHUNK, 3 * CHUNK + 1),
    ]
    .into_iter()
    .enumerate()
    {
        let seed = round as u8 + 1;
        fill_pattern(&mut src, 0, seed);
        ma.write_at(0, &src).unwrap();
        mb.write_at(0, &vec![0u8; size]).unwrap();
        a.write(
            ca,
            &ma,
            off,
            len,
            &win_b.slice(off as u32, len as u32).unwrap(),
        )
        .unwrap();
        let mut got = vec![0u8; size];
        mb.read_at(0, &mut got).unwrap();
        assert_eq!(
            &got[off..off + len],
            &src[off..off + len],
            "write {off}+{len}"
        );
        assert!(
            got[..off].iter().all(|&x| x == 0),
            "write {off}+{len}: before"
        );
        assert!(
            got[off + len..].iter().all(|&x| x == 0),
            "write {off}+{len}: after"
        );
        // READ back into a's zeroed memory, from the other side's lanes too.
        ma.write_at(0, &vec![0u8; size]).unwrap();
        a.read(
            ca,
            &ma,
            off,
            len,
            &win_b.slice(off as u32, len as u32).unwrap(),
        )
        .unwrap();
        let mut back = vec![0u8; size];
        ma.read_at(0, &mut back).unwrap();
        assert_eq!(
            &back[off..off + len],
            &src[off..off + len],
            "read {off}+{len}"
        );
        // And b initiating on its (2-lane) side.
        mb.write_at(0, &vec![0u8; size]).unwrap();
        b.read(
            cb,
            &mb,
            off,
            len,
            &win_a.slice(off as u32, len as u32).unwrap(),
        )
        .unwrap();
        mb.read_at(0, &mut got).unwrap();
        assert_eq!(
            &got[off..off + len],
            &back[off..off + len],
            "b reads {off}+{len}"
        );
    }
}

#[test]
fn vectored_small_ops_and_notifications_over_lanes() {
    let (a, b, ca, cb) = pair(cfg(4, 8), cfg(2, 8));
    let size = 8 << 20;
    let ma = a.alloc(size).unwrap();
    let mb = b.alloc(size).unwrap();
    let win_b = mb.advertise(0, size).unwrap();
    let mut src = vec![0u8; size];
    // Vectored: eight pairs dealt over the lanes.
    fill_pattern(&mut src, 0, 99);
    ma.write_at(0, &src).unwrap();
    mb.write_at(0, &vec![0u8; size]).unwrap();
    let pieces: Vec<(usize, usize)> = (0..8).map(|i| (i * (size / 8), size / 8 - i)).collect();
    let locals: Vec<_> = pieces.iter().map(|&(o, l)| (&ma, o, l)).collect();
    let remotes: Vec<_> = pieces
        .iter()
        .map(|&(o, l)| win_b.slice(o as u32, l as u32).unwrap())
        .collect();
    a.writev(ca, &locals, &remotes).unwrap();
    let mut got = vec![0u8; size];
    mb.read_at(0, &mut got).unwrap();
    for &(o, l) in &pieces {
        assert_eq!(&got[o..o + l], &src[o..o + l], "writev piece at {o}");
    }
    // Many small ops at once, dealt round-robin, all land.
    let ts: Vec<_> = (0..64)
        .map(|i| {
            a.write_async(
                ca,
                &ma,
                i * 4096,
                4096,
                &win_b.slice((i * 4096) as u32, 4096).unwrap(),
            )
            .unwrap()
        })
        .collect();
    for t in ts {
        t.wait().unwrap();
    }
    // Notifications both ways carry the connection's own id.
    a.send_notification(ca, b"hello").unwrap();
    assert_eq!(
        b.recv_notification(Duration::from_secs(5)).unwrap(),
        (cb, b"hello".to_vec())
    );
    b.send_notification(cb, b"back").unwrap();
    assert_eq!(
        a.recv_notification(Duration::from_secs(5)).unwrap(),
        (ca, b"back".to_vec())
    );
}

#[test]
fn a_window_scoped_to_the_connection_works_on_every_lane() {
    let (a, b, ca, cb) = pair(cfg(4, 4), cfg(4, 4));
    let size = 2 << 20;
    let ma = a.alloc(size).unwrap();
    let mb = b.alloc(size).unwrap();
    let mut src = vec![0u8; size];
    fill_pattern(&mut src, 0, 7);
    ma.write_at(0, &src).unwrap();
    let scoped = b.advertise(cb, &mb, 0, size).unwrap();
    a.write(ca, &ma, 0, size, &scoped).unwrap();
    let mut got = vec![0u8; size];
    mb.read_at(0, &mut got).unwrap();
    assert_eq!(check_pattern(&got, 0, 7), None);
    // Closing the connection revokes it and fails later ops with its id.
    a.remove_remote(ca).unwrap();
    match a.write(ca, &ma, 0, size, &scoped) {
        Err(Error::UnknownConn { .. }) | Err(Error::ConnFailed { .. }) => {}
        other => panic!("{other:?}"),
    }
}

/// Embedded shards: an op cut over two lanes completes only once both
/// shards have been polled; one small op needs one shard.
#[test]
fn a_large_op_runs_on_several_shards() {
    let target = Endpoint::builder().config(cfg(2, 2)).build().unwrap();
    target.start_passive_accept().unwrap();
    let ep = Endpoint::builder()
        .config({
            let mut c = cfg(2, 2);
            c.mode = Mode::Embedded;
            c
        })
        .build()
        .unwrap();
    let mut shards = ep.take_shards();
    assert_eq!(shards.len(), 2);
    let conn = ep.add_remote(&target.metadata_bytes()).unwrap();
    let size = 4 * CHUNK;
    let remote = target.alloc(size).unwrap();
    let mut src = vec![0u8; size];
    fill_pattern(&mut src, 0, 5);
    remote.write_at(0, &src).unwrap();
    let local = ep.alloc(size).unwrap();
    let win = remote.advertise(0, size).unwrap();
    // Each shard alone moves its part of an op, never the whole: one op
    // polled only by shard 0, another only by shard 1, neither completes
    // (a connection on one shard would complete one of them).
    let mut ts = Vec::new();
    for (alone, shard) in shards.iter_mut().enumerate() {
        let mut t = ep.read_async(conn, &local, 0, size, &win).unwrap();
        let until = Instant::now() + Duration::from_millis(300);
        while Instant::now() < until {
            shard.poll();
        }
        assert!(t.poll().is_none(), "completed on shard {alone} alone");
        ts.push(t);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for mut t in ts {
        let r = loop {
            shards[0].poll();
            shards[1].poll();
            if let Some(r) = t.poll() {
                break r;
            }
            assert!(Instant::now() < deadline, "never completed");
        };
        r.unwrap();
    }
    let mut got = vec![0u8; size];
    local.read_at(0, &mut got).unwrap();
    assert_eq!(check_pattern(&got, 0, 5), None);
}

/// With an idle timeout, a connection kept busy by one thread's small ops
/// (all on one lane) is not closed for its other lanes' idleness: the
/// lanes share when the connection last moved bytes.
#[test]
fn busy_connection_survives_the_idle_timeout_of_its_quiet_lanes() {
    let idle = |mut c: Config| {
        c.idle_timeout_ms = 300;
        c
    };
    let (a, b, ca, _cb) = pair(idle(cfg(4, 4)), idle(cfg(4, 4)));
    let size = 4 * CHUNK;
    let ma = a.alloc(size).unwrap();
    let mb = b.alloc(size).unwrap();
    let win = mb.advertise(0, size).unwrap();
    let until = Instant::now() + Duration::from_millis(1200);
    while Instant::now() < until {
        a.write(ca, &ma, 0, 64, &win.slice(0, 64).unwrap()).unwrap();
        std::thread::sleep(Duration::from_millis(5));
    }
    // Every lane is still there: a large op runs on all of them.
    a.write(ca, &ma, 0, size, &win).unwrap();
}

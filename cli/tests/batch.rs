//! `Endpoint::batch`: ops staged together, queued one command per shard,
//! each with its own transfer and outcome.

mod common;

use std::time::Duration;

use common::*;
use ferry::oob::IoPreference;
use ferry::{Access, Endpoint, Error, Mode, Transfer};
use ferry_cli::testkit::{check_pattern, fill_pattern};

const OPS: usize = 200;

/// Waits for `t` with a deadline: a lost op fails the test, not hangs it.
fn done(mut t: Transfer) {
    t.wait_timeout(Duration::from_secs(10))
        .expect("the op ends within 10 s");
}
const OP_BYTES: usize = 512;

/// Over `path`, with four shards a side and `conns` connections (tcp ones
/// spread over four lanes): a batch of `OPS` WRITEs (more than one
/// command holds for one shard) lands byte-exact, then a batch of READs
/// brings it all back; large ops cut over lanes in a batch land too.
fn batch_round_trip(path: Path, conns: usize) {
    path.require();
    let cfg = || {
        let mut c = path_config(path);
        c.shards = 4;
        c.streams_per_conn = 4;
        c
    };
    let a = Endpoint::builder().config(cfg()).build().unwrap();
    let b = Endpoint::builder().config(cfg()).build().unwrap();
    b.start_passive_accept().unwrap();
    let cs: Vec<_> = (0..conns)
        .map(|_| a.add_remote(&b.metadata_bytes()).unwrap())
        .collect();
    let len = OPS * OP_BYTES;
    let (local, remote) = (a.alloc(len).unwrap(), b.alloc(len).unwrap());
    let window = remote.advertise(0, len).unwrap();
    let mut p = vec![0u8; len];
    fill_pattern(&mut p, 0, 7);
    local.write_at(0, &p).unwrap();
    let each = |read: bool| -> Vec<Transfer> {
        let mut batch = a.batch();
        let ts = (0..OPS)
            .map(|i| {
                let (c, off) = (cs[i % conns], i * OP_BYTES);
                let w = window.slice(off as u32, OP_BYTES as u32).unwrap();
                match read {
                    false => batch.write(c, &local, off, OP_BYTES, &w).unwrap(),
                    true => batch.read(c, &local, off, OP_BYTES, &w).unwrap(),
                }
            })
            .collect();
        batch.submit().unwrap();
        ts
    };
    each(false).into_iter().for_each(done);
    let mut got = vec![0u8; len];
    remote.read_at(0, &mut got).unwrap();
    assert_eq!(check_pattern(&got, 0, 7), None, "{path:?}: the writes");
    local.write_at(0, &vec![0u8; len]).unwrap();
    each(true).into_iter().for_each(done);
    local.read_at(0, &mut got).unwrap();
    assert_eq!(check_pattern(&got, 0, 7), None, "{path:?}: the reads");
    // Four ops of a quarter each, large enough to be cut over lanes.
    let big = OPS * OP_BYTES / 4;
    remote.write_at(0, &vec![0u8; len]).unwrap();
    let mut batch = a.batch();
    let ts: Vec<_> = (0..4)
        .map(|i| {
            let w = window.slice((i * big) as u32, big as u32).unwrap();
            batch.write(cs[0], &local, i * big, big, &w).unwrap()
        })
        .collect();
    drop(batch);
    ts.into_iter().for_each(done);
    remote.read_at(0, &mut got).unwrap();
    assert_eq!(
        check_pattern(&got, 0, 7),
        None,
        "{path:?}: the large writes"
    );
}

#[test]
fn a_batch_lands_every_op_over_tcp() {
    batch_round_trip(Path::TcpEpoll, 3);
}

#[test]
fn a_batch_lands_every_op_on_one_host() {
    batch_round_trip(Path::Shm, 3);
}

#[test]
fn a_refused_batch_fails_its_ops_through_their_transfers() {
    let target = client(IoPreference::Auto);
    target.start_passive_accept().unwrap();
    let mut cfg = config(IoPreference::Auto);
    cfg.sq_depth = 1;
    cfg.mode = Mode::Embedded;
    let ep = Endpoint::builder().config(cfg).build().unwrap();
    let mut shard = ep.take_shards().pop().unwrap();
    let conn = ep.add_remote(&target.metadata_bytes()).unwrap();
    shard.poll(); // adopt the connection
    let remote = target.alloc(4096).unwrap();
    let rb = remote.advertise(0, 4096).unwrap();
    let local = ep.alloc(4096).unwrap();
    // The one queue slot is taken: the batch's one command is refused.
    let mut first = ep.write_async(conn, &local, 0, 8, &rb).unwrap();
    let mut batch = ep.batch();
    let mut ts: Vec<_> = (0..3)
        .map(|_| batch.write(conn, &local, 0, 8, &rb).unwrap())
        .collect();
    assert_eq!(batch.len(), 3);
    let e = batch.submit().unwrap_err();
    assert!(matches!(e, Error::QueueFull { capacity: 1, .. }), "{e}");
    for t in &mut ts {
        let e = t.poll().expect("failed at once").unwrap_err();
        assert!(matches!(e, Error::QueueFull { .. }), "{e}");
    }
    drop(ts);
    while !first.is_done() {
        shard.poll();
    }
    first.poll().unwrap().unwrap();
    assert_eq!(ep.inflight_ops(), 0, "every slot came back");
}

#[test]
fn a_dropped_batch_queues_its_ops_and_a_bad_one_is_refused_when_staged() {
    let target = client(IoPreference::Auto);
    target.start_passive_accept().unwrap();
    let ep = client(IoPreference::Auto);
    let conn = ep.add_remote(&target.metadata_bytes()).unwrap();
    let remote = target.alloc(4096).unwrap();
    let rb = remote.advertise(0, 4096).unwrap();
    let local = ep.alloc(4096).unwrap();
    local.write_at(0, b"batched!").unwrap();
    let read_only = ep
        .register_with(vec![0u8; 64], Access::REMOTE_READ)
        .unwrap();
    let mut batch = ep.batch();
    let t = batch.write(conn, &local, 0, 8, &rb).unwrap();
    let e = batch.read(conn, &read_only, 0, 8, &rb).unwrap_err();
    assert!(matches!(e, Error::ReadOnlyDestination { .. }), "{e}");
    let e = batch.write(conn, &local, 4000, 200, &rb).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }), "{e}");
    drop(batch);
    done(t);
    let mut got = [0u8; 8];
    remote.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"batched!");
}

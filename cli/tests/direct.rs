//! `Endpoint::write_async_on` / `read_async_on`: an op the thread driving
//! an embedded shard applies on it at once, with no queue hop.

mod common;

use std::time::{Duration, Instant};

use common::*;
use ferry::{Endpoint, Mode, Shard, Transfer};

/// An embedded endpoint over `path` (its one shard taken) and a managed
/// target, connected.
fn pair(path: Path) -> (Endpoint, Shard, Endpoint, ferry::ConnId) {
    path.require();
    let target = path_client(path);
    target.start_passive_accept().unwrap();
    let mut cfg = path_config(path);
    cfg.mode = Mode::Embedded;
    let ep = Endpoint::builder().config(cfg).build().unwrap();
    let mut shard = ep.take_shards().pop().expect("one shard");
    let conn = ep.add_remote(&target.metadata_bytes()).unwrap();
    shard.poll(); // adopts the connection
    (ep, shard, target, conn)
}

/// Polls `shard` until `t` ends (10 s at most: a lost op fails the test).
fn finish(shard: &mut Shard, mut t: Transfer) {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        shard.poll();
        if let Some(r) = t.poll() {
            return r.expect("the op ends well");
        }
        assert!(Instant::now() < end, "the op did not end within 10 s");
    }
}

fn lands_and_reads_back(path: Path) {
    let (ep, mut shard, target, conn) = pair(path);
    let remote = target.alloc(4096).unwrap();
    let rb = remote.advertise(0, 4096).unwrap();
    let local = ep.alloc(4096).unwrap();
    local.write_at(0, b"directly").unwrap();
    let t = ep
        .write_async_on(&mut shard, conn, &local, 0, 8, &rb)
        .unwrap();
    finish(&mut shard, t);
    let mut got = [0u8; 8];
    remote.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"directly", "{path:?}: the write");
    remote.write_at(64, b"and back").unwrap();
    let w = rb.slice(64, 8).unwrap();
    let t = ep
        .read_async_on(&mut shard, conn, &local, 128, 8, &w)
        .unwrap();
    finish(&mut shard, t);
    local.read_at(128, &mut got).unwrap();
    assert_eq!(&got, b"and back", "{path:?}: the read");
    assert_eq!(ep.inflight_ops(), 0, "every slot came back");
}

#[test]
fn an_op_on_the_embedded_shard_lands_and_reads_back_on_one_host() {
    lands_and_reads_back(Path::Shm);
}

#[test]
fn an_op_on_the_embedded_shard_lands_and_reads_back_over_tcp() {
    lands_and_reads_back(Path::TcpEpoll);
}

#[test]
fn an_op_on_the_embedded_shard_leaves_in_the_call_not_at_the_next_poll() {
    // Same host: the request is on the target's ring when the call
    // returns, and the (managed) target applies it while this shard is
    // never polled. Through the queue it would wait for a poll forever.
    let (ep, mut shard, target, conn) = pair(Path::Shm);
    let remote = target.alloc(4096).unwrap();
    let rb = remote.advertise(0, 4096).unwrap();
    let local = ep.alloc(4096).unwrap();
    local.write_at(0, b"no queue").unwrap();
    let t = ep
        .write_async_on(&mut shard, conn, &local, 0, 8, &rb)
        .unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    let mut got = [0u8; 8];
    while &got != b"no queue" {
        assert!(Instant::now() < end, "not applied without a poll");
        std::thread::sleep(Duration::from_millis(1));
        remote.read_at(0, &mut got).unwrap();
    }
    finish(&mut shard, t);
}

#[test]
fn an_op_on_the_embedded_shard_goes_behind_what_the_thread_queued_before() {
    // Two WRITEs to the same bytes: the first queued (write_async, not
    // yet polled), the second on the shard. Applied out of order, the
    // first would land last.
    let (ep, mut shard, target, conn) = pair(Path::Shm);
    let remote = target.alloc(4096).unwrap();
    let rb = remote.advertise(0, 4096).unwrap();
    let local = ep.alloc(4096).unwrap();
    local.write_at(0, b"first!!!second!!").unwrap();
    for _ in 0..20 {
        remote.write_at(0, &[0u8; 8]).unwrap();
        let a = ep.write_async(conn, &local, 0, 8, &rb).unwrap();
        let b = ep
            .write_async_on(&mut shard, conn, &local, 8, 8, &rb)
            .unwrap();
        finish(&mut shard, a);
        finish(&mut shard, b);
        let mut got = [0u8; 8];
        remote.read_at(0, &mut got).unwrap();
        assert_eq!(&got, b"second!!", "the later op landed first");
    }
}

#[test]
fn a_shard_of_another_endpoint_is_not_used_the_op_goes_through_its_own_queue() {
    let (ep, mut shard, target, conn) = pair(Path::Shm);
    let (_other, mut other_shard, _t2, _c2) = pair(Path::Shm);
    let remote = target.alloc(4096).unwrap();
    let rb = remote.advertise(0, 4096).unwrap();
    let local = ep.alloc(4096).unwrap();
    local.write_at(0, b"rightful").unwrap();
    // The other endpoint's shard knows nothing of `conn`: applied there,
    // the op would fail as on an unknown connection.
    let t = ep
        .write_async_on(&mut other_shard, conn, &local, 0, 8, &rb)
        .unwrap();
    other_shard.poll();
    finish(&mut shard, t);
    let mut got = [0u8; 8];
    remote.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"rightful");
}

//! Ops queued to a shard hold no count of their region until the shard
//! takes them (`RegionSlice::borrowed`): a region dropped right after its
//! ops were queued must stay alive until the shard took them, and its ops
//! must land byte-exact.

mod common;

use common::*;
use ferry::{Endpoint, Mode};
use ferry_cli::testkit::{check_pattern, fill_pattern};

const OPS: usize = 16;
const OP_BYTES: usize = 4096;

fn region_dropped_with_its_ops_queued(path: Path) {
    path.require();
    let target = Endpoint::builder()
        .config(path_config(path))
        .build()
        .unwrap();
    target.start_passive_accept().unwrap();
    let mut cfg = path_config(path);
    cfg.mode = Mode::Embedded;
    let ep = Endpoint::builder().config(cfg).build().unwrap();
    // Nobody polls the shard until the region is gone.
    let mut shard = ep.take_shards().pop().unwrap();
    let conn = ep.add_remote(&target.metadata_bytes()).unwrap();
    shard.poll();
    let len = OPS * OP_BYTES;
    let remote = target.alloc(len).unwrap();
    let window = remote.advertise(0, len).unwrap();
    for round in 0..3u8 {
        let local = ep.alloc(len).unwrap();
        let mut p = vec![0u8; len];
        fill_pattern(&mut p, 0, round + 1);
        local.write_at(0, &p).unwrap();
        let mut ts: Vec<_> = (0..OPS)
            .map(|i| {
                let w = window
                    .slice((i * OP_BYTES) as u32, OP_BYTES as u32)
                    .unwrap();
                ep.write_async(conn, &local, i * OP_BYTES, OP_BYTES, &w)
                    .unwrap()
            })
            .collect();
        // Deregistered (and, but for the shard's table, freed) before the
        // shard took a single op.
        drop(local);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while ts.iter_mut().any(|t| !t.is_done()) {
            assert!(std::time::Instant::now() < deadline, "{path:?}: ops lost");
            shard.poll();
        }
        for t in &mut ts {
            t.poll().unwrap().unwrap();
        }
        let mut got = vec![0u8; len];
        remote.read_at(0, &mut got).unwrap();
        assert_eq!(
            check_pattern(&got, 0, round + 1),
            None,
            "{path:?}: round {round}"
        );
    }
}

#[test]
fn tcp_ops_outlive_their_dropped_region() {
    region_dropped_with_its_ops_queued(Path::TcpEpoll);
}

#[test]
fn same_host_ops_outlive_their_dropped_region() {
    region_dropped_with_its_ops_queued(Path::Shm);
}

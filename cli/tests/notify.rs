//! A notification riding with a transfer (`transfer_notify_async`): sent
//! by the shard once the transfer ended well — after the data is in place,
//! for READ as well as WRITE — with nobody polling the transfer; none for a
//! transfer that failed; once for an op cut over lanes.

mod common;

use std::time::Duration;

use common::*;
use ferry::{Endpoint, Error, OpKind};
use ferry_cli::testkit::{check_pattern, fill_pattern};

const WAIT: Duration = Duration::from_secs(10);

fn rides_with_the_transfer(path: Path, lanes: bool) {
    path.require();
    let cfg = || {
        let mut c = path_config(path);
        if lanes {
            c.shards = 4;
            c.streams_per_conn = 4;
        }
        c
    };
    let a = Endpoint::builder().config(cfg()).build().unwrap();
    let b = Endpoint::builder().config(cfg()).build().unwrap();
    b.start_passive_accept().unwrap();
    let ca = a.add_remote(&b.metadata_bytes()).unwrap();
    let len = 8 << 20;
    let (src, dst) = (a.alloc(len).unwrap(), b.alloc(len).unwrap());
    let mut p = vec![0u8; len];
    fill_pattern(&mut p, 0, 3);
    src.write_at(0, &p).unwrap();
    let w = dst.advertise(0, len).unwrap();
    // WRITE: the transfer is dropped at once; the note still comes, after
    // the bytes.
    let t = a
        .transfer_notify_async(ca, OpKind::Write, &[(&src, 0, len)], &[w], b"wrote it")
        .unwrap();
    drop(t);
    let (cb, note) = b.recv_notification(WAIT).unwrap();
    assert_eq!(note, b"wrote it");
    let mut got = vec![0u8; len];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(
        check_pattern(&got, 0, 3),
        None,
        "{path:?}: bytes before the note"
    );
    // READ: the peer hears once the bytes are here.
    let back = a.alloc(len).unwrap();
    let t = a
        .transfer_notify_async(ca, OpKind::Read, &[(&back, 0, len)], &[w], b"read it")
        .unwrap();
    assert_eq!(
        b.recv_notification(WAIT).unwrap(),
        (cb, b"read it".to_vec())
    );
    let mut t = t;
    t.wait_timeout(WAIT).unwrap();
    back.read_at(0, &mut got).unwrap();
    assert_eq!(check_pattern(&got, 0, 3), None);
    // A transfer the peer refuses (past its window) sends no note.
    let small = dst.advertise(0, 64).unwrap();
    let mut bad = ferry::RemoteBuf { size: 128, ..small };
    bad.size = 128;
    let mut t = a
        .transfer_notify_async(ca, OpKind::Write, &[(&src, 0, 128)], &[bad], b"never")
        .unwrap();
    assert!(t.wait_timeout(WAIT).is_err());
    assert!(
        matches!(
            b.recv_notification(Duration::from_millis(300)),
            Err(Error::Timeout { .. })
        ),
        "a failed transfer sent its note"
    );
    // Exactly one note per transfer, also when cut over lanes.
    assert!(b.try_recv_notification().is_none());
}

#[test]
fn a_note_rides_with_a_transfer_over_tcp() {
    rides_with_the_transfer(Path::TcpEpoll, false);
}

#[test]
fn a_note_rides_with_a_transfer_cut_over_lanes() {
    rides_with_the_transfer(Path::TcpEpoll, true);
}

#[test]
fn a_note_rides_with_a_transfer_on_one_host() {
    rides_with_the_transfer(Path::Shm, false);
}

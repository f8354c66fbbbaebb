//! Keys: a random tag per key (in the RemoteBuf's reserved bytes), keys
//! scoped to one connection and one window, and revocation on
//! deregistration and on the connection's end — on tcp and on shm.

mod common;

use std::time::Duration;

use common::*;
use ferry::wire::Status;
use ferry::{Endpoint, Error, RemoteBuf};

fn status(r: Result<(), Error>) -> Status {
    match r {
        Err(Error::Remote { status, .. }) => status,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn keys(path: Path) {
    let b = Endpoint::builder()
        .config(path_config(path))
        .build()
        .unwrap();
    b.start_passive_accept().unwrap();
    let (a1, a2) = (path_client(path), path_client(path));
    let c1 = a1.add_remote(&b.metadata_bytes()).unwrap();
    let (b1, _) = b.accept(Duration::from_secs(5)).unwrap();
    let c2 = a2.add_remote(&b.metadata_bytes()).unwrap();
    let (_b2, _) = b.accept(Duration::from_secs(5)).unwrap();
    let mr = b.alloc(8192).unwrap();
    let l1 = a1.alloc(8192).unwrap();
    let l2 = a2.alloc(8192).unwrap();

    let open = mr.advertise(0, 8192).unwrap();
    assert_ne!(open.key_tag(), 0, "keys carry a random tag");
    a1.read(c1, &l1, 0, 8192, &open).unwrap();
    a2.read(c2, &l2, 0, 8192, &open).unwrap();

    // A guessed tag, or none (as a FifoItem from a peer without tags), is an unknown key.
    let mut guessed = open;
    guessed.reserved[0] ^= 1;
    assert_eq!(status(a1.read(c1, &l1, 0, 8, &guessed)), Status::UnknownKey);
    let untagged = RemoteBuf {
        reserved: [0; 32],
        ..open
    };
    assert_eq!(
        status(a1.write(c1, &l1, 0, 8, &untagged)),
        Status::UnknownKey
    );

    // A key for a1's connection, for one window; several at once.
    let v = b.advertisev(b1, &[(&mr, 0, 16), (&mr, 16, 16)]).unwrap();
    assert_eq!(v.len(), 2);
    a1.read(c1, &l1, 0, 16, &v[1]).unwrap();
    let g1 = b.advertise(b1, &mr, 4096, 1024).unwrap();
    a1.write(c1, &l1, 0, 1024, &g1).unwrap();
    let edge = RemoteBuf {
        addr: g1.addr + 1000,
        size: 100,
        ..g1
    };
    assert_eq!(
        status(a1.read(c1, &l1, 0, 100, &edge)),
        Status::OutOfBounds,
        "past the window, inside the region"
    );
    let before = RemoteBuf {
        addr: g1.addr - 1,
        size: 2,
        ..g1
    };
    assert_eq!(status(a1.read(c1, &l1, 0, 2, &before)), Status::OutOfBounds);
    // Another peer cannot use it.
    assert_eq!(
        status(a2.read(c2, &l2, 0, 8, &g1)),
        Status::UnknownKey,
        "foreign key"
    );

    // The connection ends: its keys are revoked, even for the same peer reconnecting.
    b.remove_remote(b1).unwrap();
    let e = a1.read(c1, &l1, 0, 8, &g1).unwrap_err();
    assert!(matches!(e, Error::ConnFailed { .. }), "{e}");
    let c1b = a1.add_remote(&b.metadata_bytes()).unwrap();
    let _ = b.accept(Duration::from_secs(5)).unwrap();
    assert_eq!(
        status(a1.read(c1b, &l1, 0, 8, &g1)),
        Status::UnknownKey,
        "revoked with its connection"
    );
    a1.read(c1b, &l1, 0, 8, &open).unwrap();

    // Deregistration revokes every key of the region.
    b.deregister(mr).unwrap();
    assert_eq!(status(a1.read(c1b, &l1, 0, 8, &open)), Status::UnknownKey);
    assert_eq!(status(a2.read(c2, &l2, 0, 8, &open)), Status::UnknownKey);
}

#[test]
fn keys_on_tcp() {
    keys(Path::TcpEpoll);
}

#[test]
fn keys_on_shm() {
    keys(Path::Shm);
}

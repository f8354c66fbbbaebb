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
        assert_eq!(ferry::verbs::status(None, None).unwrap_err(), why);
    } else {
        assert!(why.contains("`rdma` feature"), "{why}");
        assert_eq!(ferry::verbs::status(None, None).unwrap_err(), why);
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

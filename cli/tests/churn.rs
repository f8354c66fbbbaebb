//! Connection churn: 1000 connect/transfer/disconnect cycles on tcp and on
//! shm, measuring descriptors, shared-memory objects and memory on both
//! sides.

mod common;

use std::time::Duration;

use common::*;

const MIB: usize = 1 << 20;

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn shm_count() -> usize {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("ferry-"))
                .count()
        })
        .unwrap_or(0)
}

/// Connect, one transfer, disconnect, many times: no growth in descriptors,
/// shared-memory objects or memory, on either side.
fn churn(path: Path) {
    let t = Target::start_on(path, MIB, &[]);
    let ep = path_client(path);
    let local = ep.alloc(4096).unwrap();
    let me = std::process::id();
    let them = t.child.id();
    let cycle = |i: usize| {
        let conn = ep.add_remote(&t.served.meta).unwrap();
        ep.read(
            conn,
            &local,
            0,
            4096,
            &t.served.rbuf.slice((i % 200 * 4096) as u32, 4096).unwrap(),
        )
        .unwrap();
        ep.remove_remote(conn).unwrap();
    };
    for i in 0..100 {
        cycle(i);
    }
    std::thread::sleep(Duration::from_millis(300));
    let (fd0, tfd0, shm0, rss0, trss0) = (
        fd_count(me),
        fd_count(them),
        shm_count(),
        rss_kib(me),
        rss_kib(them),
    );
    for i in 100..1100 {
        cycle(i);
    }
    // Closing is asynchronous on the target's side; give it a moment.
    std::thread::sleep(Duration::from_millis(500));
    let (fd1, tfd1, shm1, rss1, trss1) = (
        fd_count(me),
        fd_count(them),
        shm_count(),
        rss_kib(me),
        rss_kib(them),
    );
    println!("{path:?}: fds {fd0}->{fd1}, target fds {tfd0}->{tfd1}, /dev/shm {shm0}->{shm1}, rss {rss0}->{rss1} KiB, target rss {trss0}->{trss1} KiB");
    assert!(fd1 <= fd0 + 4, "our fds grew {fd0} -> {fd1}");
    assert!(tfd1 <= tfd0 + 4, "target fds grew {tfd0} -> {tfd1}");
    assert!(shm1 <= shm0 + 2, "/dev/shm grew {shm0} -> {shm1}");
    assert!(
        rss1 <= rss0 + 16 * 1024,
        "our memory grew {rss0} -> {rss1} KiB"
    );
    assert!(
        trss1 <= trss0 + 16 * 1024,
        "target memory grew {trss0} -> {trss1} KiB"
    );
    assert_eq!(ep.conn_count(), 0);
}

/// One test in its own binary: descriptor and /dev/shm counts are
/// process- and machine-wide, so nothing else may run beside it.
#[test]
fn thousand_connect_disconnect_cycles_without_growth() {
    churn(Path::TcpEpoll);
    churn(Path::Shm);
}

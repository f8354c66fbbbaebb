//! Many connections held at once: 10 000 tcp connections from one endpoint
//! to one target process, all idle but one at a time, and an operation on
//! any of them completes. (`ferry bench --idle-conns N` measures what they
//! cost the operations of the others; this checks they can be held.)

mod common;

use common::*;
use ferry::{Endpoint, EndpointMetadata};

/// Raises this process's descriptor limit (its children inherit it) to
/// at least `want`, as far as the hard limit allows; returns the limit.
fn raise_nofile(want: u64) -> u64 {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
        if l.rlim_cur < want {
            l.rlim_cur = want.min(l.rlim_max);
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
    l.rlim_cur
}

#[test]
fn ten_thousand_connections_are_held_and_each_one_works() {
    let n: usize = std::env::var("FERRY_MANY_CONNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let limit = raise_nofile(n as u64 + 1024);
    assert!(
        limit >= n as u64 + 256,
        "the descriptor limit ({limit}) cannot hold {n} connections; raise `ulimit -n`"
    );
    let room = (n + 64).to_string();
    let t = Target::start_on(
        Path::TcpEpoll,
        1 << 20,
        &[
            ("FERRY_MAX_CONNS", &room),
            ("FERRY_MAX_CONNS_PER_PEER", &room),
        ],
    );
    let addr = EndpointMetadata::decode(&t.served.meta)
        .unwrap()
        .socket_addr();
    let client = Endpoint::builder()
        .config({
            let mut conf = path_config(Path::TcpEpoll);
            conf.max_conns = n + 64;
            conf.max_conns_per_peer = n + 64;
            conf
        })
        .build()
        .unwrap();
    let before = (rss_kib(std::process::id()), rss_kib(t.child.id()));
    let t0 = std::time::Instant::now();
    let conns: Vec<_> = (0..n)
        .map(|i| {
            client
                .connect(addr)
                .unwrap_or_else(|e| panic!("connection {i}: {e}"))
        })
        .collect();
    let opened = t0.elapsed();
    assert_eq!(client.conn_count(), n);
    let after = (rss_kib(std::process::id()), rss_kib(t.child.id()));
    println!(
        "{n} connections opened in {opened:?}; resident memory per connection: {:.1} KiB here, \
         {:.1} KiB at the target",
        after.0.saturating_sub(before.0) as f64 / n as f64,
        after.1.saturating_sub(before.1) as f64 / n as f64,
    );
    let local = client.alloc(4096).unwrap();
    let rb = t.served.rbuf;
    for i in [0, 1, n / 3, n / 2, n - 2, n - 1] {
        client
            .read(conns[i], &local, 0, 4096, &rb)
            .unwrap_or_else(|e| panic!("READ on connection {i}: {e}"));
        client
            .write(conns[i], &local, 0, 64, &rb)
            .unwrap_or_else(|e| panic!("WRITE on connection {i}: {e}"));
    }
}

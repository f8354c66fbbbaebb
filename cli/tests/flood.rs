//! Silent, half-authenticated and half-assembled sockets held open against
//! a target while honest clients connect: handshakes cost the target no
//! thread, so the flood cannot lock anyone out, and a connection of several
//! streams is acknowledged only when whole, so none is born dead.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use ferry::wire::{ControlFrame, EndpointMetadata, Hello, CAP_AUTH};
use ferry::{Endpoint, Secret};

const KEY: &str = "correct horse battery";

/// What each attacker socket does after connecting.
#[derive(Clone, Copy)]
enum Kind {
    /// Sends nothing.
    Silent,
    /// Sends an authenticating Hello, reads the ack, never proves the key.
    HalfAuthenticated,
    /// Sends stream 0 of a 2-stream connection, never stream 1.
    HalfAssembled,
}

fn open(addr: SocketAddr, kind: Kind) -> Option<TcpStream> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    let hello = |count| Hello {
        endpoint_id: 0xbad,
        caps: CAP_AUTH,
        conn_nonce: rand(),
        stream_idx: 0,
        stream_count: count,
        max_inflight: 8,
        host_token: 0,
        auth_nonce: rand(),
    };
    match kind {
        Kind::Silent => {}
        Kind::HalfAuthenticated => s.write_all(&ControlFrame::Hello(hello(1)).encode()).ok()?,
        Kind::HalfAssembled => s.write_all(&ControlFrame::Hello(hello(2)).encode()).ok()?,
    }
    s.set_nonblocking(true).ok()?;
    Some(s)
}

fn rand() -> u64 {
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut b)
        .unwrap();
    u64::from_le_bytes(b)
}

/// Holds `n` sockets of each kind open until `stop`, reopening each one
/// the target drops, and counts the reopenings.
fn flood(
    addr: SocketAddr,
    kinds: &[(Kind, usize)],
    stop: Arc<AtomicBool>,
    reopened: Arc<AtomicU64>,
) {
    let mut socks: Vec<(Kind, Option<TcpStream>)> = kinds
        .iter()
        .flat_map(|&(k, n)| (0..n).map(move |_| k))
        .map(|k| (k, open(addr, k)))
        .collect();
    while !stop.load(Ordering::Relaxed) {
        for (kind, s) in socks.iter_mut() {
            let gone = match s {
                None => true,
                Some(s) => {
                    // Drain what the target sent (acks, proofs); EOF or an
                    // error means it dropped us.
                    let mut buf = [0u8; 512];
                    loop {
                        match s.read(&mut buf) {
                            Ok(0) => break true,
                            Ok(_) => continue,
                            Err(e) if e.kind() == ErrorKind::WouldBlock => break false,
                            Err(_) => break true,
                        }
                    }
                }
            };
            if gone {
                *s = open(addr, *kind);
                reopened.fetch_add(1, Ordering::Relaxed);
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_flood_of_silent_and_half_open_sockets_locks_nobody_out() {
    let secs: u64 = std::env::var("FERRY_FLOOD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let t = Target::start_on(Path::TcpEpoll, 1 << 20, &[("FERRY_AUTH_KEY", KEY)]);
    let addr = EndpointMetadata::decode(&t.served.meta)
        .unwrap()
        .socket_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let reopened = Arc::new(AtomicU64::new(0));
    let flooder = {
        let (stop, reopened) = (stop.clone(), reopened.clone());
        let kinds = [
            (Kind::Silent, 200),
            (Kind::HalfAuthenticated, 200),
            (Kind::HalfAssembled, 64),
        ];
        std::thread::spawn(move || flood(addr, &kinds, stop, reopened))
    };
    // Let the flood take its places first.
    std::thread::sleep(Duration::from_millis(500));
    let client = Endpoint::builder()
        .config({
            let mut conf = path_config(Path::TcpEpoll);
            conf.auth_key = Some(Secret::new(KEY.as_bytes().to_vec()).unwrap());
            conf.streams_per_conn = 2;
            conf
        })
        .build()
        .unwrap();
    let local = client.alloc(4096).unwrap();
    let end = Instant::now() + Duration::from_secs(secs);
    let (mut tries, mut fast, mut slowest) = (0u32, 0u32, Duration::ZERO);
    let mut failures = Vec::new();
    while Instant::now() < end {
        tries += 1;
        let t0 = Instant::now();
        match client.connect(addr) {
            Ok(conn) => {
                let took = t0.elapsed();
                slowest = slowest.max(took);
                if took <= Duration::from_secs(1) {
                    fast += 1;
                }
                // Never a dead connection: data moves on it.
                client
                    .read(conn, &local, 0, 4096, &t.served.rbuf)
                    .unwrap_or_else(|e| panic!("connection {tries} is dead: {e}"));
                client.remove_remote(conn).unwrap();
            }
            Err(e) => failures.push(e.to_string()),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    flooder.join().unwrap();
    let reopened = reopened.load(Ordering::Relaxed);
    println!(
        "flood: 464 sockets held for {secs} s (reopened {reopened} times); honest connects: \
         {fast}/{tries} within 1 s, slowest {slowest:?}, failures {failures:?}"
    );
    assert!(
        fast * 100 >= tries * 95,
        "{fast} of {tries} connects within 1 s; failures {failures:?}"
    );
    assert!(
        reopened >= 200,
        "silent sockets were never dropped at the first-bytes deadline ({reopened})"
    );
}

/// Limits are ours: 40 peers each declaring 2^20 requests in flight send
/// READs of 64 KiB as fast as they may and never read an answer. The
/// target keeps to its own limit per stream, answers from the registered
/// memory itself (no copies), and its resident memory grows by what its own
/// limits allow, not by what the peers declared.
#[test]
fn peers_declaring_huge_limits_cost_only_our_limits() {
    use ferry::wire::{DataHeader, DataKind};
    let t = Target::start_on(Path::TcpEpoll, 1 << 20, &[("FERRY_STREAM_INFLIGHT", "64")]);
    let addr = EndpointMetadata::decode(&t.served.meta)
        .unwrap()
        .socket_addr();
    let rb = t.served.rbuf;
    let pid = t.child.id();
    std::thread::sleep(Duration::from_millis(200));
    let before = rss_kib(pid);
    let mut socks = Vec::new();
    for _ in 0..40 {
        let mut s = TcpStream::connect(addr).unwrap();
        let hello = Hello {
            endpoint_id: rand(),
            caps: 0,
            conn_nonce: rand(),
            stream_idx: 0,
            stream_count: 1,
            max_inflight: 1 << 20,
            host_token: 0,
            auth_nonce: rand(),
        };
        s.write_all(&ControlFrame::Hello(hello).encode()).unwrap();
        let ControlFrame::HelloAck(_) = read_control_frame(&mut s) else {
            panic!("not acknowledged")
        };
        // Our limit is 64: exactly that many, so the peers stay connected.
        s.set_nonblocking(true).unwrap();
        for op in 0..64u64 {
            let off = (op % 16) * 65536;
            let h = DataHeader::request(
                DataKind::ReadReq,
                rb.rkey,
                rb.key_tag(),
                op,
                rb.addr + off,
                65536,
            );
            let _ = s.write_all(&h.encode());
        }
        socks.push(s);
    }
    std::thread::sleep(Duration::from_millis(1000));
    let after = rss_kib(pid);
    let grew_mib = after.saturating_sub(before) as f64 / 1024.0;
    println!(
        "target RSS {before} KiB -> {after} KiB (+{grew_mib:.1} MiB) for 40 peers declaring \
         2^20 in flight, 64 READs of 64 KiB each unread"
    );
    // 40 streams x (256 KiB receive buffer + queues of 64 + 64 frames):
    // ~11 MiB. The peers' word would have been ~96 MiB per stream.
    assert!(grew_mib < 48.0, "target grew by {grew_mib:.1} MiB");
    // And it still serves others.
    let c = path_client(Path::TcpEpoll);
    let conn = c.add_remote(&t.served.meta).unwrap();
    let local = c.alloc(4096).unwrap();
    c.read(conn, &local, 0, 4096, &rb).unwrap();
    drop(socks);
}

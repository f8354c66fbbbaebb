//! Metrics an operator scrapes. `ferry serve --metrics` counts exactly the
//! bytes a client moved and the requests it sent, on tcp and on the
//! same-host path, and the refusal of a request its checks refused; the
//! client's own counters count its ops, their bytes and outcomes, and its
//! duration histogram holds one observation per op. The listener answers
//! only GET and bounds the request it reads.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::*;
use ferry::metrics::Via;
use ferry::OpKind;
use ferry_cli::scrape::{fetch, total};

const LEN: usize = 16 * 1024;
const WRITES: usize = 40;
const READS: usize = 25;
/// One large write, cut into frames of the client's chunk size on tcp.
const BIG: usize = 1 << 20;
const CHUNK: usize = 64 * 1024;

fn moves_and_counts(path: Path) {
    path.require();
    let t = Target::start_with(path, 4 << 20, &[], &["--metrics", "127.0.0.1:0"]);
    let addr = t.served.metrics.clone().expect("a METRICS line");
    let mut cfg = path_config(path);
    cfg.chunk_bytes = CHUNK;
    let ep = ferry::Endpoint::builder().config(cfg).build().unwrap();
    let conn = ep.add_remote(&t.served.meta).unwrap();
    let local = ep.alloc(2 << 20).unwrap();
    let rb = &t.served.rbuf;
    for i in 0..WRITES {
        let win = rb.slice((i * LEN) as u32, LEN as u32).unwrap();
        ep.write(conn, &local, i * LEN, LEN, &win).unwrap();
    }
    for i in 0..READS {
        let win = rb.slice((i * LEN) as u32, LEN as u32).unwrap();
        ep.read(conn, &local, i * LEN, LEN, &win).unwrap();
    }
    ep.write(conn, &local, 0, BIG, &rb.slice(0, BIG as u32).unwrap())
        .unwrap();
    let refused = ep.write(conn, &local, 0, 64, &t.served.rbuf_ro);
    assert!(
        matches!(refused, Err(ferry::Error::Remote { .. })),
        "{refused:?}"
    );

    // The target's view: every byte, every request.
    let via = match path {
        Path::Shm => Via::Shm,
        _ => Via::Tcp,
    };
    let text = fetch(&addr).unwrap();
    let tp = format!("transport=\"{}\"", via.name());
    let target_bytes = |dir: &str| {
        let dir = format!("direction=\"{dir}\"");
        total(&text, "ferry_bytes_total", &["role=\"target\"", &tp, &dir]) as usize
    };
    assert_eq!(target_bytes("in"), WRITES * LEN + BIG, "{text}");
    assert_eq!(target_bytes("out"), READS * LEN, "{text}");
    let served = |op: &str, result: &str| {
        let (op, result) = (format!("op=\"{op}\""), format!("result=\"{result}\""));
        total(&text, "ferry_requests_served_total", &[&tp, &op, &result]) as usize
    };
    assert_eq!(served("read", "ok"), READS);
    assert_eq!(served("write", "refused"), 1);
    // Requests are frames or ring messages: a large op is several on tcp.
    let big_requests = served("write", "ok") - WRITES;
    match path {
        Path::Shm => assert!(big_requests >= 1, "{big_requests}"),
        _ => assert_eq!(big_requests, BIG / CHUNK, "one request a chunk"),
    }
    assert_eq!(total(&text, "ferry_connections", &[&tp]), 1.0, "{text}");

    // The client's view: its ops, their bytes and outcomes, one duration
    // each.
    let m = ep.metrics();
    let row = |op: OpKind| *m.ops.iter().find(|r| r.op == op && r.via == via).unwrap();
    let (w, r) = (row(OpKind::Write), row(OpKind::Read));
    assert_eq!((w.ok, w.failed), (WRITES as u64 + 1, 1));
    assert_eq!((r.ok, r.failed), (READS as u64, 0));
    assert_eq!(w.bytes, (WRITES * LEN + BIG + 64) as u64);
    assert_eq!(r.bytes, (READS * LEN) as u64);
    let ops: u64 = m.ops.iter().map(|r| r.ok + r.failed).sum();
    let observed: u64 = m.op_duration.iter().map(|h| h.count()).sum();
    assert_eq!(observed, ops, "one duration per op");
    let remote = m
        .failures
        .iter()
        .find(|(k, _)| *k == ferry::FailureKind::Remote);
    assert_eq!(remote.map(|(_, n)| *n), Some(1));
    assert_eq!(m.ops_in_flight, 0);
    let mine = ep.metrics_text();
    let count = total(&mine, "ferry_op_duration_seconds_count", &[]);
    assert_eq!(count as u64, ops, "{mine}");
    println!(
        "{}: target saw {} requests; client ops {ops}",
        path.transport_name(),
        served("write", "ok") + READS + 1
    );
}

#[test]
fn a_tcp_run_is_counted_exactly_on_both_sides() {
    moves_and_counts(Path::TcpEpoll);
}

#[test]
fn a_same_host_run_is_counted_exactly_on_both_sides() {
    moves_and_counts(Path::Shm);
}

/// Sends `req` to the metrics listener; its answer's status line.
fn status_of(addr: &str, req: &[u8]) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // The listener may answer (and close) before it read all of a long one.
    let _ = s.write_all(req);
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.lines().next().unwrap_or("").to_string()
}

#[test]
fn the_metrics_listener_answers_only_get_and_bounds_the_request() {
    let t = Target::start_with(Path::TcpEpoll, 1 << 20, &[], &["--metrics", "127.0.0.1:0"]);
    let addr = t.served.metrics.clone().unwrap();
    let post = status_of(
        &addr,
        b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    );
    assert_eq!(post, "HTTP/1.1 405 Method Not Allowed");
    let elsewhere = status_of(&addr, b"GET /admin HTTP/1.1\r\n\r\n");
    assert_eq!(elsewhere, "HTTP/1.1 404 Not Found");
    let mut huge = b"GET /metrics HTTP/1.1\r\nX-Pad: ".to_vec();
    huge.resize(64 * 1024, b'a');
    let long = status_of(&addr, &huge);
    assert_eq!(long, "HTTP/1.1 431 Request Header Fields Too Large");
    // Clients that connect and send nothing hold up nobody: with 4 of
    // them waiting, a scrape is answered at once.
    let silent: Vec<_> = (0..4)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let t0 = std::time::Instant::now();
    let text = fetch(&addr).unwrap();
    assert!(text.contains("# TYPE ferry_ops_total counter"), "{text}");
    assert!(
        t0.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t0.elapsed()
    );
    // Past 16 at once, one is refused at once rather than queued.
    let more: Vec<_> = (0..16)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let refused = status_of(&addr, b"GET /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(refused, "HTTP/1.1 503 Service Unavailable");
    drop((silent, more));
}

#[test]
fn ferry_stat_prints_a_summary_of_a_running_serve() {
    let t = Target::start_with(Path::TcpEpoll, 1 << 20, &[], &["--metrics", "127.0.0.1:0"]);
    let addr = t.served.metrics.clone().unwrap();
    let ep = client(ferry::oob::IoPreference::Epoll);
    let conn = ep.add_remote(&t.served.meta).unwrap();
    let local = ep.alloc(4096).unwrap();
    ep.write(conn, &local, 0, 4096, &t.served.rbuf).unwrap();
    let out = std::process::Command::new(ferry_bin())
        .args(["stat", &addr])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("connections   1 tcp"), "{text}");
    assert!(text.contains("bytes target    out 0 in 4096"), "{text}");
}

/// The log lines of this test binary, for the stall reports.
fn captured_logs() -> &'static std::sync::Mutex<Vec<u8>> {
    static LOGS: std::sync::OnceLock<&'static std::sync::Mutex<Vec<u8>>> =
        std::sync::OnceLock::new();
    LOGS.get_or_init(|| {
        let logs: &'static std::sync::Mutex<Vec<u8>> =
            Box::leak(Box::new(std::sync::Mutex::new(Vec::new())));
        #[derive(Clone, Copy)]
        struct Into(&'static std::sync::Mutex<Vec<u8>>);
        impl std::io::Write for Into {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || Into(logs))
            .try_init();
        logs
    })
}

/// A peer that answers nothing: each op in flight past `FERRY_STALL_MS`
/// is reported once (a warning with its connection, peer, size and age,
/// and the count), then the op timeout fails them, and the counters say
/// both.
#[test]
fn a_stalled_op_is_reported_once_then_times_out() {
    use ferry::rogue::{spawn, Behaviour};
    const OPS: usize = 3;
    let logs = captured_logs();
    let mut cfg = config(ferry::oob::IoPreference::Auto);
    cfg.op_timeout_ms = 2500;
    cfg.stall_ms = 300;
    let ep = ferry::Endpoint::builder().config(cfg).build().unwrap();
    let peer = spawn(Behaviour::Silent).unwrap();
    let conn = ep.connect(peer).unwrap();
    let local = ep.alloc(4096).unwrap();
    let window = ferry::RemoteBuf {
        addr: 0x1000,
        size: 4096,
        rkey: 1,
        ..Default::default()
    };
    let ops: Vec<_> = (0..OPS)
        .map(|_| ep.write_async(conn, &local, 0, 4096, &window).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    let m = ep.metrics();
    assert_eq!(m.stalled_ops, OPS as u64, "{m:?}");
    assert!(m.oldest_op_age >= Duration::from_millis(300), "{m:?}");
    let text = String::from_utf8_lossy(&logs.lock().unwrap()).to_string();
    let reports: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("op stalled") && l.contains(&peer.to_string()))
        .collect();
    assert_eq!(reports.len(), OPS, "{text}");
    assert!(
        reports[0].contains("bytes=4096") && reports[0].contains("WRITE"),
        "{}",
        reports[0]
    );
    for t in ops {
        let e = t.wait().unwrap_err();
        assert_eq!(e.kind(), ferry::FailureKind::PeerTimeout, "{e}");
    }
    let m = ep.metrics();
    assert_eq!(m.stalled_ops, OPS as u64, "still one report per op");
    let count = |v: &[(ferry::FailureKind, u64)]| {
        v.iter()
            .find(|(k, _)| *k == ferry::FailureKind::PeerTimeout)
            .map(|(_, n)| *n)
    };
    assert_eq!(count(&m.failures), Some(OPS as u64), "{m:?}");
    assert_eq!(count(&m.conn_failures), Some(1), "{m:?}");
    let w = m
        .ops
        .iter()
        .find(|r| r.op == OpKind::Write && r.via == Via::Tcp)
        .unwrap();
    assert_eq!((w.ok, w.failed), (0, OPS as u64));
    println!("{}", reports[0]);
}

/// `kill -USR1` of a `ferry serve` prints the summary `ferry stat` prints,
/// on its stderr, and it goes on serving.
#[test]
fn sigusr1_prints_the_summary_to_stderr() {
    use std::io::BufRead;
    let mut child = std::process::Command::new(ferry_bin())
        .args(["serve", "--bytes", "65536", "--listen", "127.0.0.1"])
        .env("FERRY_LOG", "error")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let served = ferry_cli::testkit::read_served(&mut out).unwrap();
    let ep = client(ferry::oob::IoPreference::Epoll);
    let conn = ep.add_remote(&served.meta).unwrap();
    let local = ep.alloc(4096).unwrap();
    ep.write(conn, &local, 0, 4096, &served.rbuf).unwrap();
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGUSR1) }, 0);
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut lines = Vec::new();
    for _ in 0..5 {
        let mut l = String::new();
        err.read_line(&mut l).unwrap();
        lines.push(l);
    }
    let text = lines.concat();
    assert!(text.starts_with("connections   1 tcp"), "{text}");
    assert!(text.contains("bytes target    out 0 in 4096"), "{text}");
    ep.write(conn, &local, 0, 4096, &served.rbuf).unwrap();
    let _ = child.kill();
    let _ = child.wait();
}

use super::*;

/// Adds a one-stream connection `id` (no lanes, verbs or MACs).
fn add_plain(side: &mut TcpSide, id: u64, s: std::net::TcpStream, limits: StreamLimits) -> usize {
    side.add(
        ConnId(id),
        ConnId(id),
        None,
        vec![s],
        limits,
        None,
        Vec::new(),
    )
    .unwrap()
}

/// Data sockets carry keepalive and a user timeout of the liveness bound
/// or the op timeout, the smaller (a peer that stops acknowledging is
/// dropped in seconds, not after the kernel's ~15 minutes of
/// retransmissions); the probes fit in the bound.
#[test]
fn data_sockets_get_keepalive_and_a_user_timeout() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (_b, _) = l.accept().unwrap();
    let live = Liveness::new(Duration::from_millis(5_000), Duration::from_millis(7_000));
    assert_eq!(live.user_timeout, Duration::from_secs(5));
    assert!(live.idle + live.interval * KEEPALIVE_PROBES <= Duration::from_secs(5));
    assert!(live.idle >= Duration::from_secs(1) && live.interval >= Duration::from_secs(1));
    let short = Liveness::new(Duration::from_secs(30), Duration::from_secs(2));
    assert_eq!(
        short.user_timeout,
        Duration::from_secs(2),
        "the op timeout, when shorter"
    );
    let (mut side, _waker) = TcpSide::new(0, live).unwrap();
    let limits = StreamLimits {
        own_max: 4,
        peer_max: 4,
        codec: false,
    };
    let idx = add_plain(&mut side, 1, a, limits);
    let sock = socket2::SockRef::from(&side.conns[idx].streams[0].sock);
    assert_eq!(
        sock.tcp_user_timeout().unwrap(),
        Some(Duration::from_millis(5_000))
    );
    assert!(sock.keepalive().unwrap());
    assert_eq!(sock.keepalive_time().unwrap(), live.idle);
    assert_eq!(sock.keepalive_interval().unwrap(), live.interval);
    assert_eq!(sock.keepalive_retries().unwrap(), KEEPALIVE_PROBES);
    let conn = side.take(idx);
    assert_eq!(conn.id, ConnId(1));
    assert_eq!(side.stream_count, 0);
}

/// A pass visits what epoll reported (and what left work behind), not
/// every connection: 40 idle connections cost a pass nothing, and a
/// frame on one of them costs a visit to that one.
#[test]
fn a_pass_visits_only_ready_connections() {
    use crate::reactor::source::CxParts;
    use crate::wire::{DataHeader, DataKind};
    use std::io::Write;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let live = Liveness::new(Duration::from_secs(5), Duration::from_secs(7));
    let (mut side, _waker) = TcpSide::new(0, live).unwrap();
    let limits = StreamLimits {
        own_max: 4,
        peer_max: 4,
        codec: false,
    };
    let mut peers = Vec::new();
    for i in 0..40 {
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        add_plain(&mut side, i, a, limits);
        peers.push(b);
    }
    let (mut parts, notes) = CxParts::new(16);
    let mut cx = parts.cx();
    // Each new connection gets a first turn; then nothing is ready.
    side.poll(&mut cx);
    assert_eq!(side.visited, 40);
    for _ in 0..3 {
        side.poll(&mut cx);
    }
    assert_eq!(side.visited, 0, "idle connections were visited");
    assert_eq!(side.may_park(), Park::Yes);
    // A notification on connection 17: one visit delivers it.
    let mut frame = DataHeader::request(DataKind::Notify, 0, 0, 0, 0, 4)
        .encode()
        .to_vec();
    frame.extend_from_slice(b"\0abc");
    peers[17].write_all(&frame).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut visits = 0;
    let got = loop {
        side.poll(&mut cx);
        visits += side.visited;
        if let Ok(n) = notes.try_recv() {
            break n;
        }
        assert!(std::time::Instant::now() < deadline, "never delivered");
    };
    assert_eq!(got, (ConnId(17), b"abc".to_vec()));
    assert!(visits <= 2, "{visits} visits for one ready connection");
    assert!(cx.to_fail.is_empty());
}

/// A descriptor watched with `said` ends a park and is reported once (the
/// fd-passing socket: the shard accepts on it only then); one watched
/// without it only ends the park.
#[test]
fn a_said_descriptor_is_reported_once_and_a_plain_one_never() {
    let (mut side, _waker) = TcpSide::new(
        0,
        Liveness::new(Duration::from_secs(5), Duration::from_secs(5)),
    )
    .unwrap();
    let (plain_r, plain_w) = std::os::unix::net::UnixStream::pair().unwrap();
    let (said_r, said_w) = std::os::unix::net::UnixStream::pair().unwrap();
    use std::io::Write;
    use std::os::fd::AsRawFd;
    side.watch_wake_fd(plain_r.as_raw_fd(), false).unwrap();
    side.watch_wake_fd(said_r.as_raw_fd(), true).unwrap();
    side.wait(Duration::from_millis(1));
    assert!(!side.take_said(), "nothing was ready");
    (&plain_w).write_all(b"x").unwrap();
    let t0 = std::time::Instant::now();
    side.wait(Duration::from_secs(5));
    assert!(
        t0.elapsed() < Duration::from_secs(4),
        "the plain one did not end the park"
    );
    assert!(!side.take_said(), "the plain one was reported");
    (&said_w).write_all(b"x").unwrap();
    side.wait(Duration::from_secs(5));
    assert!(side.take_said(), "the said one was not reported");
    assert!(!side.take_said(), "reported twice");
}

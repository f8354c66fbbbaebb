use super::*;
use crate::error::ConnId;
use crate::reactor::source::CxParts;
use crate::sys::fd_readable as readable;

/// `n` connections into `side`, returned as the peers' ends (connection
/// i's peer has id 100 + i). With `bell`, our rings name the doorbell
/// of endpoint `bell`, shard 0, and the peers ring it.
fn connect_pairs(side: &mut LocalSide, tag: &str, n: u32, bell: Option<u64>) -> Vec<LocalConn> {
    let base = format!("/ferry-test-{:x}-{tag}", std::process::id());
    let pid = std::process::id();
    let remote =
        bell.map(|id| std::sync::Arc::new(crate::shm::bell::RemoteBell::open(id, 0).unwrap()));
    let mut peers = Vec::new();
    for i in 0..n {
        let ab = ShmRing::create(&format!("{base}-{i}-ab"), 16, 1).unwrap();
        let ba = ShmRing::create(&format!("{base}-{i}-ba"), 16, 1).unwrap();
        if let Some(id) = bell {
            ba.ring.set_bell_home(id, 0);
        }
        let to_b = ShmRing::open(&format!("{base}-{i}-ab")).unwrap();
        let mut to_a = ShmRing::open(&format!("{base}-{i}-ba")).unwrap();
        assert_eq!(to_a.ring.bell_home(), bell.map(|id| (id, 0)));
        to_a.bell = remote.clone();
        side.add(LocalConn::new(ConnId(i as u64), 2, pid, i, ba, to_b, 4, 4));
        peers.push(LocalConn::new(
            ConnId(100 + i as u64),
            1,
            pid,
            i,
            ab,
            to_a,
            4,
            4,
        ));
    }
    peers
}

/// Quiet same-host connections cool off: a pass then looks at one ring
/// every few passes, not at all of them; a message on a cold one is
/// still found (in turn) and makes it hot again.
#[test]
fn quiet_rings_are_polled_in_turn_and_wake_on_traffic() {
    let mut side = LocalSide::new(0, LocalInit::bare(None));
    let mut peers = connect_pairs(&mut side, "coldhot", 40, None);
    let (mut parts, notes) = CxParts::new(16);
    let mut cx = parts.cx();
    side.poll(&mut cx);
    assert!(side.visited >= 40, "new connections start hot");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !side.hot.is_empty() {
        side.poll(&mut cx);
        assert!(std::time::Instant::now() < deadline, "never cooled");
    }
    let mut most = 0;
    for _ in 0..64 {
        side.poll(&mut cx);
        most = most.max(side.visited);
    }
    assert!(most <= 1, "a pass looked at {most} quiet rings");
    // A notification on connection 17's ring: found within one turn
    // of the quiet ones, and the connection is hot again.
    assert!(peers[17].push_notify(b"\0abc"));
    let mut passes = 0;
    let got = loop {
        side.poll(&mut cx);
        passes += 1;
        if let Ok(n) = notes.try_recv() {
            break n;
        }
        assert!(
            passes <= 40 * COLD_EVERY_PASSES as usize * 4 + 8,
            "not found in turn"
        );
    };
    assert_eq!(got, (ConnId(17), b"abc".to_vec()));
    assert!(side.conns[17].hot);
    assert!(cx.to_fail.is_empty());
}

/// With a doorbell, quiet rings cost a pass nothing, a message on one
/// is found on the very next pass, and a shard that announced a sleep
/// is woken through the FIFO by a message on any ring, hot or cold.
#[test]
fn rung_rings_are_found_at_once_and_wake_a_sleeper() {
    let id = (u64::from(std::process::id()) << 16) | 0xbe11;
    let mut side = LocalSide::new(0, LocalInit::bare(Some(Bell::create(id, 0).unwrap())));
    let mut peers = connect_pairs(&mut side, "rung", 40, Some(id));
    let (mut parts, notes) = CxParts::new(16);
    let mut cx = parts.cx();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let cool = |side: &mut LocalSide, cx: &mut Cx<'_>| {
        while !side.hot.is_empty() {
            side.poll(cx);
            assert!(std::time::Instant::now() < deadline, "never cooled");
        }
    };
    cool(&mut side, &mut cx);
    let mut total = 0;
    for _ in 0..200 {
        side.poll(&mut cx);
        total += side.visited;
    }
    // (Only the rare safety-net look at one quiet ring in turn.)
    assert!(total <= 1, "200 passes looked at {total} quiet rings");
    // A message on a cold ring: found on the next pass.
    assert!(peers[17].push_notify(b"\0abc"));
    side.poll(&mut cx);
    assert_eq!(notes.try_recv().unwrap(), (ConnId(17), b"abc".to_vec()));
    assert!(side.conns[17].hot);
    // A sleeper: connection 17 is hot, the rest cold; a message on
    // either kind wakes it.
    for (peer, conn) in [(17usize, 17u64), (5, 5)] {
        side.park_begin();
        assert_eq!(side.poll(&mut cx), 0);
        assert_eq!(side.may_park(), Park::Yes);
        assert!(!readable(side.wake_fds()[0].unwrap().0, 0));
        assert!(peers[peer].push_notify(b"\0wake"));
        assert!(
            readable(side.wake_fds()[0].unwrap().0, 5000),
            "a message on connection {conn} did not wake the sleeper"
        );
        side.park_end();
        side.poll(&mut cx);
        assert_eq!(notes.try_recv().unwrap(), (ConnId(conn), b"wake".to_vec()));
        assert!(!readable(side.wake_fds()[0].unwrap().0, 0), "drained");
    }
    assert!(cx.to_fail.is_empty());
}

/// A connection its shard polls every pass (hot) pushes without
/// ringing and rings a sleeping peer once at the end of the pass
/// (`ring_if_due`, which `Shard::poll` calls through `ring_due`): the
/// peer wakes to all of the pass's messages, not at the first.
#[test]
fn a_hot_connection_wakes_a_sleeping_peer_at_the_end_of_its_pass() {
    let id = (u64::from(std::process::id()) << 16) | 0xbe12;
    let mut side = LocalSide::new(0, LocalInit::bare(Some(Bell::create(id, 0).unwrap())));
    let mut peers = connect_pairs(&mut side, "quiet", 2, Some(id));
    let (mut parts, notes) = CxParts::new(16);
    let mut cx = parts.cx();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !side.hot.is_empty() {
        side.poll(&mut cx);
        assert!(std::time::Instant::now() < deadline, "never cooled");
    }
    let fd = side.wake_fds()[0].unwrap().0;
    side.park_begin();
    assert_eq!(side.poll(&mut cx), 0);
    peers[1].hot = true;
    for k in 0..3u8 {
        assert!(peers[1].push_notify(&[0, k]));
    }
    assert!(!readable(fd, 20), "woken before the end of the pass");
    peers[1].ring_if_due();
    assert!(
        readable(fd, 5000),
        "the end of the pass did not wake the sleeper"
    );
    side.park_end();
    side.poll(&mut cx);
    for k in 0..3u8 {
        assert_eq!(notes.try_recv().unwrap(), (ConnId(1), vec![k]));
    }
    // A connection that is not polled every pass rings at once.
    side.park_begin();
    while side.poll(&mut cx) > 0 {}
    assert!(peers[0].push_notify(b"\0now"));
    assert!(readable(fd, 5000), "a cold connection's push did not ring");
    side.park_end();
    side.poll(&mut cx);
    assert_eq!(notes.try_recv().unwrap(), (ConnId(0), b"now".to_vec()));
}

/// Every shard's copy of the peers' maps follows the endpoint's: a
/// region a peer shared (through shard 0's socket) is in the copy after
/// the next pass, and goes with the peer's last connection.
#[test]
fn a_shards_copy_of_peer_maps_follows_the_endpoints() {
    let shares: Arc<PeerShares> = Arc::default();
    let mut side = LocalSide::new(
        1,
        LocalInit {
            setup: None,
            bell: None,
            shares: shares.clone(),
        },
    );
    let (mut parts, _notes) = CxParts::new(16);
    let mut cx = parts.cx();
    shares.conn_up(9, 77);
    side.poll(&mut cx);
    assert!(side.peer_maps.is_empty());
    let map = crate::sys::Mapping::map_fd(-1, 0).unwrap();
    shares.insert_for_test(
        9,
        5,
        crate::shm::local::PeerMap {
            map: Arc::new(map),
            base: 0x1000,
        },
    );
    side.poll(&mut cx);
    assert_eq!(side.peer_maps.get(&(9, 5)).map(|m| m.base), Some(0x1000));
    // Its last connection (on another shard) ends: gone here too.
    shares.conn_down(9, 77);
    side.poll(&mut cx);
    assert!(side.peer_maps.is_empty());
}

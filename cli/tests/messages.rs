//! Two-sided send/recv: messages matched in order per connection to the
//! buffers the receiver posted, over tcp and on one host.

mod common;

use std::time::Duration;

use common::*;
use ferry::{ConnId, Endpoint, Error, MessageOp};
use ferry_cli::testkit::{check_pattern, fill_pattern};

const WAIT: Duration = Duration::from_secs(10);

fn pair(path: Path) -> (Endpoint, Endpoint, ConnId, ConnId) {
    path.require();
    let a = path_client(path);
    let b = path_client(path);
    b.start_passive_accept().unwrap();
    let ca = a.add_remote(&b.metadata_bytes()).unwrap();
    let (cb, _) = b.accept(WAIT).unwrap();
    (a, b, ca, cb)
}

fn done(ep: &Endpoint, op: MessageOp) -> ferry::Result<usize> {
    ep.wait_message(op, WAIT)
}

/// Polls each side's ops until every one ended (a side's calls move its
/// part), failing the test after `4 × WAIT`; `ended` holds what already
/// did (`None`: not yet), and comes back whole.
fn until_all_ended(
    path: Path,
    ops: &[(&Endpoint, MessageOp)],
    ended: &mut [Option<ferry::Result<usize>>],
) {
    let deadline = std::time::Instant::now() + 4 * WAIT;
    while ended.iter().any(Option::is_none) {
        assert!(
            std::time::Instant::now() < deadline,
            "{path:?}: {} of {} ops ended",
            ended.iter().flatten().count(),
            ended.len()
        );
        for ((ep, op), r) in ops.iter().zip(ended.iter_mut()) {
            if r.is_none() {
                *r = ep.poll_message(*op);
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Three messages of different sizes, buffers posted before and after
/// they were sent: each lands whole in its own buffer, in order, with its
/// length; a buffer larger than its registration is cut to it (as the
/// seed's `recv(…, size)` callers expect); notifications never mix in.
/// (One thread plays both sides: a side's work moves in its own calls, so
/// the sender waits first.)
fn in_order(path: Path) {
    let (a, b, ca, cb) = pair(path);
    let src = a.alloc(1 << 20).unwrap();
    let mut p = vec![0u8; 1 << 20];
    fill_pattern(&mut p, 0, 5);
    src.write_at(0, &p).unwrap();
    let dst = b.alloc(3 << 20).unwrap();
    let early = b.recv_async(cb, &dst, 0, 1 << 20).unwrap();
    let sizes = [1 << 20, 17, 0];
    let sends: Vec<_> = sizes
        .iter()
        .map(|&n| a.send_async(ca, &src, 0, n).unwrap())
        .collect();
    a.send_notification(ca, b"an app note").unwrap();
    let later = [
        b.recv_async(cb, &dst, 1 << 20, 1 << 20).unwrap(),
        // More than the registration holds: cut to its end.
        b.recv_async(cb, &dst, 2 << 20, 8 << 20).unwrap(),
    ];
    // The sender's calls move its sends (a send ends once its bytes are
    // in the peer's buffer), then the receives have ended too.
    for (s, n) in sends.into_iter().zip(sizes) {
        assert_eq!(done(&a, s).unwrap(), n, "{path:?}");
    }
    assert_eq!(done(&b, early).unwrap(), 1 << 20);
    assert_eq!(done(&b, later[0]).unwrap(), 17);
    assert_eq!(done(&b, later[1]).unwrap(), 0);
    let mut got = vec![0u8; 1 << 20];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(
        check_pattern(&got, 0, 5),
        None,
        "{path:?}: the first message"
    );
    dst.read_at(1 << 20, &mut got[..17]).unwrap();
    assert_eq!(check_pattern(&got[..17], 0, 5), None);
    // Only the application's note is in the application's inbox.
    assert_eq!(
        b.recv_notification(WAIT).unwrap(),
        (cb, b"an app note".to_vec())
    );
    assert!(b.try_recv_notification().is_none());
}

#[test]
fn messages_land_in_order_over_tcp() {
    in_order(Path::TcpEpoll);
}

#[test]
fn messages_land_in_order_on_one_host() {
    in_order(Path::Shm);
}

#[test]
fn a_message_longer_than_its_buffer_fails_both_sides() {
    let (a, b, ca, cb) = pair(Path::TcpEpoll);
    let src = a.alloc(4096).unwrap();
    let dst = b.alloc(4096).unwrap();
    dst.write_at(0, &[9u8; 4096]).unwrap();
    let r = b.recv_async(cb, &dst, 0, 100).unwrap();
    let s = a.send_async(ca, &src, 0, 200).unwrap();
    for e in [done(&a, s).unwrap_err(), done(&b, r).unwrap_err()] {
        assert!(
            matches!(
                e,
                Error::MessageTooLarge {
                    len: 200,
                    posted: 100
                }
            ),
            "{e}"
        );
    }
    let mut got = [0u8; 4096];
    dst.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 9), "nothing landed");
    // The connection goes on: the next message fits.
    let r = b.recv_async(cb, &dst, 0, 4096).unwrap();
    let s = a.send_async(ca, &src, 0, 64).unwrap();
    assert_eq!(done(&a, s).unwrap(), 64);
    assert_eq!(done(&b, r).unwrap(), 64);
}

/// More receives posted than a sender holds offers for (`MAX_UNMATCHED`,
/// 1024): the rest wait on the receiver's side and are offered as earlier
/// ones end, so every send lands, byte-exact, in its buffer in order —
/// 3000 receives, then 1100 sends (each with its own bytes).
fn many_posted(path: Path) {
    let (a, b, ca, cb) = pair(path);
    const RECVS: usize = 3000;
    const SENDS: usize = 1100;
    const LEN: usize = 256;
    let src = a.alloc(SENDS * LEN).unwrap();
    let mut p = vec![0u8; SENDS * LEN];
    fill_pattern(&mut p, 0, 11);
    src.write_at(0, &p).unwrap();
    let dst = b.alloc(RECVS * LEN).unwrap();
    let recvs: Vec<_> = (0..RECVS)
        .map(|i| b.recv_async(cb, &dst, i * LEN, LEN).unwrap())
        .collect();
    let sends: Vec<_> = (0..SENDS)
        .map(|i| a.send_async(ca, &src, i * LEN, LEN - i % 7).unwrap())
        .collect();
    // Both sides' calls move their parts: poll them in turn.
    let ops: Vec<_> = (0..SENDS)
        .flat_map(|i| [(&a, sends[i]), (&b, recvs[i])])
        .collect();
    let mut ended: Vec<Option<ferry::Result<usize>>> = ops.iter().map(|_| None).collect();
    until_all_ended(path, &ops, &mut ended);
    let (mut sent, mut got): (Vec<_>, Vec<_>) = ended
        .chunks_exact_mut(2)
        .map(|pair| (pair[0].take(), pair[1].take()))
        .unzip();
    let mut back = vec![0u8; SENDS * LEN];
    dst.read_at(0, &mut back).unwrap();
    for i in 0..SENDS {
        let n = LEN - i % 7;
        assert_eq!(sent[i].take().unwrap().unwrap(), n, "{path:?} send {i}");
        assert_eq!(got[i].take().unwrap().unwrap(), n, "{path:?} receive {i}");
        assert_eq!(
            &back[i * LEN..i * LEN + n],
            &p[i * LEN..i * LEN + n],
            "{path:?} message {i}"
        );
    }
    // The receives past the sends still wait, offered or not.
    assert!(b.poll_message(recvs[SENDS]).is_none());
}

#[test]
fn many_receives_posted_all_sends_land_over_tcp() {
    many_posted(Path::TcpEpoll);
}

#[test]
fn many_receives_posted_all_sends_land_on_one_host() {
    many_posted(Path::Shm);
}

/// 20 000 notifications to a peer that reads slowly: each is delivered,
/// in order, or refused at the call (`NotifyOutboxFull`); none is dropped
/// and the connection lives on.
fn flood(path: Path) {
    let (a, b, ca, _cb) = pair(path);
    const SENT: u32 = 20_000;
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        loop {
            match b.recv_notification(Duration::from_secs(3)) {
                Ok((_, m)) => {
                    got.push(u32::from_le_bytes(m[..4].try_into().unwrap()));
                    if got.len() % 100 == 0 {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                }
                Err(Error::Timeout { .. }) => break,
                Err(e) => panic!("{e}"),
            }
        }
        (b, got)
    });
    let mut accepted = Vec::new();
    let mut refused = 0;
    for i in 0..SENT {
        let mut msg = i.to_le_bytes().to_vec();
        msg.resize(256, 7);
        match a.send_notification(ca, &msg) {
            Ok(()) => accepted.push(i),
            Err(Error::NotifyOutboxFull { .. }) => refused += 1,
            Err(e) => panic!("{path:?}: notification {i}: {e}"),
        }
    }
    let (b, got) = reader.join().unwrap();
    assert_eq!(accepted.len() + refused, SENT as usize);
    assert_eq!(got.len(), accepted.len(), "{path:?}: {refused} refused");
    assert_eq!(got, accepted, "{path:?}: in order");
    eprintln!(
        "{path:?}: {} delivered, {refused} refused at the call",
        got.len()
    );
    a.send_notification(ca, b"still here").unwrap();
    let (_, m) = b.recv_notification(WAIT).unwrap();
    assert_eq!(m, b"still here");
}

#[test]
fn a_notification_flood_is_delivered_or_refused_over_tcp() {
    flood(Path::TcpEpoll);
}

#[test]
fn a_notification_flood_is_delivered_or_refused_on_one_host() {
    flood(Path::Shm);
}

#[test]
fn a_gone_connection_fails_its_messages() {
    let (a, b, ca, cb) = pair(Path::TcpEpoll);
    let dst = b.alloc(64).unwrap();
    let src = a.alloc(64).unwrap();
    let r = b.recv_async(cb, &dst, 0, 64).unwrap();
    let s = a.send_async(ca, &src, 0, 200).unwrap_err();
    assert!(matches!(s, Error::OutOfRange { .. }), "{s}");
    a.remove_remote(ca).unwrap();
    let e = done(&b, r).unwrap_err();
    assert!(
        matches!(e, Error::UnknownConn { .. } | Error::ConnFailed { .. }),
        "{e}"
    );
    let e = a.send_async(ca, &src, 0, 8).unwrap_err();
    assert!(matches!(e, Error::UnknownConn { .. }), "{e}");
}

/// Connections that come, exchange a message and go leave no two-sided
/// state behind on either side: a peer that churns connections does not
/// grow our memory (the entries of those that died idle are swept once
/// the map has doubled).
#[test]
fn connections_that_end_idle_leave_no_message_state() {
    let path = Path::TcpEpoll;
    path.require();
    let a = path_client(path);
    let b = path_client(path);
    b.start_passive_accept().unwrap();
    let src = a.alloc(64).unwrap();
    let dst = b.alloc(64).unwrap();
    const N: usize = 200;
    for i in 0..N {
        let ca = a.add_remote(&b.metadata_bytes()).unwrap();
        let (cb, _) = b.accept(WAIT).unwrap();
        let r = b.recv_async(cb, &dst, 0, 64).unwrap();
        let s = a.send_async(ca, &src, 0, 8).unwrap();
        assert_eq!(done(&a, s).unwrap(), 8, "send {i}");
        assert_eq!(done(&b, r).unwrap(), 8, "recv {i}");
        a.remove_remote(ca).unwrap();
        // b learns of the end from its socket.
        let t0 = std::time::Instant::now();
        while b.peer(cb).is_some() {
            assert!(t0.elapsed() < WAIT, "b never saw connection {i} end");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    // Without the sweep each side keeps all N entries.
    assert!(a.message_conns() <= 64, "a keeps {}", a.message_conns());
    assert!(b.message_conns() <= 64, "b keeps {}", b.message_conns());
}

/// What a sender was told is done is not lost when it closes at once: a
/// send that returned and a notification accepted, then the endpoint
/// dropped — the receive still completes with the bytes and the
/// notification arrives (a closing shard sends what it accepted: its
/// `linger`). UCCL's own `test_engine_send.py` exits this way.
fn close_after_send(path: Path) {
    for round in 0..10 {
        let (a, b, ca, cb) = pair(path);
        let src = a.alloc(4096).unwrap();
        src.write_at(0, &[round as u8 + 1; 4096]).unwrap();
        let dst = b.alloc(8192).unwrap();
        let r = b.recv_async(cb, &dst, 0, 8192).unwrap();
        let s = a.send_async(ca, &src, 0, 4096).unwrap();
        assert_eq!(done(&a, s).unwrap(), 4096);
        a.send_notification(ca, b"last words").unwrap();
        drop(a);
        assert_eq!(done(&b, r).unwrap(), 4096, "{path:?} round {round}");
        let mut got = vec![0u8; 4096];
        dst.read_at(0, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == round as u8 + 1), "{path:?}");
        let (_, note) = b.recv_notification(WAIT).unwrap();
        assert_eq!(note, b"last words", "{path:?} round {round}");
    }
}

#[test]
fn a_sender_that_closes_at_once_loses_nothing_over_tcp() {
    close_after_send(Path::TcpEpoll);
}

#[test]
fn a_sender_that_closes_at_once_loses_nothing_on_one_host() {
    close_after_send(Path::Shm);
}

/// A sender that closes while its peer is not reading yet: every
/// notification it accepted still arrives once the peer reads (a closing
/// shard waits for room while bytes are unsent, up to its linger bound).
fn close_while_peer_is_slow(path: Path) {
    let (a, b, ca, _cb) = pair(path);
    let mut accepted = 0u32;
    for i in 0..1024u32 {
        let mut msg = i.to_le_bytes().to_vec();
        msg.resize(4000, 0x5a);
        match a.send_notification(ca, &msg) {
            Ok(()) => accepted += 1,
            Err(Error::NotifyOutboxFull { .. }) => break,
            Err(e) => panic!("{path:?}: {e}"),
        }
    }
    let reader = std::thread::spawn(move || {
        // Not reading while the sender closes.
        std::thread::sleep(Duration::from_millis(300));
        let mut got = 0u32;
        while let Ok((_, m)) = b.recv_notification(Duration::from_secs(3)) {
            assert_eq!(u32::from_le_bytes(m[..4].try_into().unwrap()), got);
            got += 1;
        }
        got
    });
    drop(a);
    assert_eq!(reader.join().unwrap(), accepted, "{path:?}");
}

#[test]
fn a_sender_that_closes_while_its_peer_is_slow_loses_nothing_over_tcp() {
    close_while_peer_is_slow(Path::TcpEpoll);
}

#[test]
fn a_sender_that_closes_while_its_peer_is_slow_loses_nothing_on_one_host() {
    close_while_peer_is_slow(Path::Shm);
}

/// Messages sent before their receives are posted, from `conns` peers:
/// the small ones go eagerly and the receiver holds them (64 a
/// connection, 8 MiB in all: `conns` × 64 × `eager` (the path's eager
/// bound: 8 KiB over tcp, 4 KiB on one host) is past that, so some are
/// answered `Again` and come the usual way), the sender's window of 64
/// sends the rest the usual way, sizes about the 8 KiB bound. Every
/// message lands byte-exact, in order, with its length, on both sides.
fn early_sends(path: Path, eager: usize, conns: usize) {
    assert!(conns * 64 * eager > 8 << 20, "past the receiver's bound");
    const PER: usize = 70;
    const SLOT: usize = 20_000;
    const SIZES: [usize; 9] = [0, 1, 17, 4095, 4096, 4097, 8192, 8193, SLOT];
    let len = |i: usize| {
        if i < 64 {
            eager
        } else {
            SIZES[i % SIZES.len()]
        }
    };
    path.require();
    let b = path_client(path);
    b.start_passive_accept().unwrap();
    let mut p = vec![0u8; conns * PER * SLOT];
    fill_pattern(&mut p, 0, 23);
    let slot = |k: usize, i: usize| (k * PER + i) * SLOT;
    // Each peer: its endpoint, its connection, ours, its source.
    let peers: Vec<_> = (0..conns)
        .map(|k| {
            let a = path_client(path);
            let ca = a.add_remote(&b.metadata_bytes()).unwrap();
            let (cb, _) = b.accept(WAIT).unwrap();
            let src = a.alloc(PER * SLOT).unwrap();
            src.write_at(0, &p[slot(k, 0)..slot(k + 1, 0)]).unwrap();
            (a, ca, cb, src)
        })
        .collect();
    let dst = b.alloc(conns * PER * SLOT).unwrap();
    let mut sends = Vec::new();
    for (a, ca, _, src) in &peers {
        for i in 0..PER {
            sends.push(a.send_async(*ca, src, i * SLOT, len(i)).unwrap());
        }
    }
    let poll_sends = |sent: &mut [Option<ferry::Result<usize>>]| {
        for (j, s) in sends.iter().enumerate() {
            if sent[j].is_none() {
                sent[j] = peers[j / PER].0.poll_message(*s);
            }
        }
    };
    let n = conns * PER;
    let mut sent: Vec<Option<ferry::Result<usize>>> = (0..n).map(|_| None).collect();
    // The receiver takes what came (its calls move it) before posting:
    // a message of its own, never received, is the handle it polls.
    let one = b.alloc(1).unwrap();
    let handle = b.send_async(peers[0].2, &one, 0, 1).unwrap();
    let until = std::time::Instant::now() + Duration::from_millis(500);
    while std::time::Instant::now() < until {
        poll_sends(&mut sent);
        assert!(b.poll_message(handle).is_none());
        std::thread::sleep(Duration::from_millis(2));
    }
    let mut recvs = Vec::new();
    for (k, (_, _, cb, _)) in peers.iter().enumerate() {
        for i in 0..PER {
            recvs.push(b.recv_async(*cb, &dst, slot(k, i), SLOT).unwrap());
        }
    }
    let mut ops: Vec<_> = (sends.iter().enumerate())
        .map(|(j, s)| (&peers[j / PER].0, *s))
        .collect();
    ops.extend(recvs.iter().map(|r| (&b, *r)));
    sent.extend((0..n).map(|_| None));
    until_all_ended(path, &ops, &mut sent);
    let mut got = sent.split_off(n);
    let mut back = vec![0u8; n * SLOT];
    dst.read_at(0, &mut back).unwrap();
    for k in 0..conns {
        for i in 0..PER {
            let (j, at, l) = (k * PER + i, slot(k, i), len(i));
            assert_eq!(sent[j].take().unwrap().unwrap(), l, "{path:?} send {k}/{i}");
            assert_eq!(
                got[j].take().unwrap().unwrap(),
                l,
                "{path:?} receive {k}/{i}"
            );
            assert_eq!(
                &back[at..at + l],
                &p[at..at + l],
                "{path:?} message {k}/{i}"
            );
        }
    }
}

#[test]
fn messages_sent_before_their_receives_land_over_tcp() {
    early_sends(Path::TcpEpoll, 8192, 24);
}

#[test]
fn messages_sent_before_their_receives_land_on_one_host() {
    early_sends(Path::Shm, 4096, 40);
}

/// A send that went eagerly and ended (its receive was offered: it ends
/// at once) does not keep its buffer's registration while the receiver's
/// answer is on the way (the receiver has not polled yet): deregistering
/// it does not wait. The receives then end with the bytes.
#[test]
fn an_ended_eager_send_holds_no_registration() {
    let (a, b, ca, cb) = pair(Path::TcpEpoll);
    let src = a.alloc(64).unwrap();
    src.write_at(0, b"eight by").unwrap();
    let dst = b.alloc(64).unwrap();
    let r0 = b.recv_async(cb, &dst, 0, 8).unwrap();
    let r1 = b.recv_async(cb, &dst, 8, 8).unwrap();
    // The first send's wait takes both offers in.
    let s0 = a.send_async(ca, &src, 0, 8).unwrap();
    assert_eq!(done(&a, s0).unwrap(), 8);
    // The second's offer is here: it ends at the call.
    let s1 = a.send_async(ca, &src, 0, 8).unwrap();
    assert_eq!(a.poll_message(s1).map(Result::unwrap), Some(8));
    let t0 = std::time::Instant::now();
    a.deregister(src).unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "an ended send held its buffer"
    );
    assert_eq!(done(&b, r0).unwrap(), 8);
    assert_eq!(done(&b, r1).unwrap(), 8);
    let mut got = [0u8; 16];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"eight byeight by");
}

/// A request loop on one host (UCCL's benchmark: each receive posted
/// once the last one ended, the sender ahead or behind): after the first
/// receive the receiver grants bounce slots, and host messages past the
/// inline bound and within a slot go into them without waiting for their
/// offer. Sizes about both bounds, the inline (4 KiB) and the slot's
/// (16 KiB: past it, the usual way); every message lands byte-exact with
/// its length on both sides, and the slots were used.
#[test]
fn a_request_loop_goes_through_bounce_slots_on_one_host() {
    request_loop(pair(Path::Shm), true);
}

/// With `FERRY_MSG_BOUNCE_SLOTS=0` on the receiver it grants none: the
/// same loop lands whole, every message the usual way.
#[test]
fn no_bounce_slots_when_the_receiver_grants_none() {
    Path::Shm.require();
    let a = path_client(Path::Shm);
    let mut cfg = path_config(Path::Shm);
    cfg.msg_bounce_slots = 0;
    let b = Endpoint::builder().config(cfg).build().unwrap();
    b.start_passive_accept().unwrap();
    let ca = a.add_remote(&b.metadata_bytes()).unwrap();
    let (cb, _) = b.accept(WAIT).unwrap();
    request_loop((a, b, ca, cb), false);
}

fn request_loop((a, b, ca, cb): (Endpoint, Endpoint, ConnId, ConnId), slots: bool) {
    const N: usize = 300;
    const SLOT: usize = 20_000;
    const SIZES: [usize; 8] = [4097, 8192, 16384, 16385, 4096, 12_001, 5000, 1];
    let mut p = vec![0u8; N * SLOT];
    fill_pattern(&mut p, 0, 41);
    let src = a.alloc(N * SLOT).unwrap();
    src.write_at(0, &p).unwrap();
    let dst = b.alloc(N * SLOT).unwrap();
    for i in 0..N {
        let len = SIZES[i % SIZES.len()];
        // The sender first (its message waits in a slot), or the receiver.
        let (s, r) = if i % 3 == 0 {
            let r = b.recv_async(cb, &dst, i * SLOT, SLOT).unwrap();
            (a.send_async(ca, &src, i * SLOT, len).unwrap(), r)
        } else {
            let s = a.send_async(ca, &src, i * SLOT, len).unwrap();
            for _ in 0..(i % 5) {
                let _ = a.poll_message(s);
                std::thread::sleep(Duration::from_micros(200));
            }
            (s, b.recv_async(cb, &dst, i * SLOT, SLOT).unwrap())
        };
        let mut ended = [None, None];
        until_all_ended(Path::Shm, &[(&a, s), (&b, r)], &mut ended);
        for (side, e) in ["send", "receive"].iter().zip(ended) {
            assert_eq!(e.unwrap().unwrap(), len, "{side} {i} of {len} bytes");
        }
    }
    let mut back = vec![0u8; N * SLOT];
    dst.read_at(0, &mut back).unwrap();
    for i in 0..N {
        let (at, len) = (i * SLOT, SIZES[i % SIZES.len()]);
        assert_eq!(&back[at..at + len], &p[at..at + len], "message {i}");
    }
    let (out, got) = (a.metrics().bounced_out, b.metrics().bounced_in);
    if !slots {
        assert_eq!((out, got), (0, 0), "no slots, none used");
        return;
    }
    // The last answer may still be on its way (its send ended on the
    // offer).
    assert!(
        got >= out && got <= out + 1,
        "every message in a slot was taken out: {out} sent, {got} taken"
    );
    // The first message comes before any grant; of the rest, 5 sizes in
    // 8 fit a slot.
    assert!(
        out >= (N as u64 - SIZES.len() as u64) * 5 / 8 / 2,
        "{out} in slots"
    );
}

/// More messages sent ahead than the receiver has slots: 16 wait in the
/// slots, the rest for their offers (the usual way); one longer than its
/// buffer fails both sides and frees its slot; every other message lands
/// byte-exact, in order, and the slots are used again after.
#[test]
fn messages_past_the_slots_and_one_too_long_for_its_buffer() {
    const N: usize = 60;
    const SLOT: usize = 10_000;
    const BAD: usize = 7;
    let (a, b, ca, cb) = pair(Path::Shm);
    let mut p = vec![0u8; (N + 1) * SLOT];
    fill_pattern(&mut p, 0, 43);
    let src = a.alloc((N + 1) * SLOT).unwrap();
    src.write_at(0, &p).unwrap();
    let dst = b.alloc((N + 1) * SLOT).unwrap();
    // One message and receive first: the receiver's grant reaches the
    // sender with it.
    let r0 = b.recv_async(cb, &dst, 0, SLOT).unwrap();
    let s0 = a.send_async(ca, &src, 0, 6000).unwrap();
    let mut ended = [None, None];
    until_all_ended(Path::Shm, &[(&a, s0), (&b, r0)], &mut ended);
    let len = |i: usize| 4100 + i * 97;
    let sends: Vec<_> = (1..=N)
        .map(|i| a.send_async(ca, &src, i * SLOT, len(i)).unwrap())
        .collect();
    // The receiver takes in what landed before posting (its own message,
    // never received, is the handle it polls), the sender ends its
    // WRITEs (its last send waits for a receive not posted yet).
    let one = b.alloc(1).unwrap();
    let handle = b.send_async(cb, &one, 0, 1).unwrap();
    let last = *sends.last().unwrap();
    let until = std::time::Instant::now() + Duration::from_millis(300);
    while std::time::Instant::now() < until {
        assert!(a.poll_message(last).is_none() && b.poll_message(handle).is_none());
        std::thread::sleep(Duration::from_millis(2));
    }
    let recvs: Vec<_> = (1..=N)
        .map(|i| {
            let max = if i == BAD { len(i) - 1 } else { SLOT };
            b.recv_async(cb, &dst, i * SLOT, max).unwrap()
        })
        .collect();
    let mut ops: Vec<_> = sends.iter().map(|s| (&a, *s)).collect();
    ops.extend(recvs.iter().map(|r| (&b, *r)));
    let mut ended: Vec<_> = ops.iter().map(|_| None).collect();
    until_all_ended(Path::Shm, &ops, &mut ended);
    let mut back = vec![0u8; (N + 1) * SLOT];
    dst.read_at(0, &mut back).unwrap();
    for i in 1..=N {
        let (s, r) = (
            ended[i - 1].take().unwrap(),
            ended[N + i - 1].take().unwrap(),
        );
        if i == BAD {
            for e in [s, r] {
                assert!(
                    matches!(e, Err(Error::MessageTooLarge { len: l, posted }) if l == len(i) as u64 && posted == len(i) as u64 - 1),
                    "{e:?}"
                );
            }
            continue;
        }
        assert_eq!((s.unwrap(), r.unwrap()), (len(i), len(i)), "message {i}");
        let at = i * SLOT;
        assert_eq!(&back[at..at + len(i)], &p[at..at + len(i)], "message {i}");
    }
    // The first 16 went into the slots (the refused one among them), the
    // rest the usual way.
    assert_eq!(a.metrics().bounced_out, 15, "the slots were used");
    assert_eq!(b.metrics().bounced_in, 15);
    // The slots are free again: the next messages go into them.
    let before = a.metrics().bounced_out;
    for i in 0..20 {
        let s = a.send_async(ca, &src, 0, 5000).unwrap();
        let r = b.recv_async(cb, &dst, N * SLOT, SLOT).unwrap();
        let mut ended = [None, None];
        until_all_ended(Path::Shm, &[(&a, s), (&b, r)], &mut ended);
        assert!(
            ended.iter().all(|e| matches!(e, Some(Ok(5000)))),
            "{i}: {ended:?}"
        );
    }
    assert!(a.metrics().bounced_out >= before + 16, "slots used again");
}

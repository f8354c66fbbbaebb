use super::*;
use crate::error::{Error, OpKind};
use crate::region::KeyRef;
use crate::wire::shm_msg::MAX_INLINE;
use crate::wire::Status;

#[test]
fn copy_bytes_is_exact_at_every_skew_and_tail() {
    let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + i / 255) as u8).collect();
    for skew in [0usize, 1, 8, 16, 63, 64, 100] {
        for len in [0usize, 5, 4095, 4096, 4097, 10_000, 12_345] {
            let mut dst = vec![0u8; len + 200];
            // SAFETY: both buffers hold the ranges used.
            unsafe { copy_bytes(dst.as_mut_ptr().add(skew), src.as_ptr(), len) };
            assert_eq!(&dst[skew..skew + len], &src[..len], "skew {skew} len {len}");
            assert!(dst[..skew].iter().all(|&b| b == 0));
            assert!(dst[skew + len..].iter().all(|&b| b == 0));
        }
    }
}

use crate::region::{Grant, Region, RegionTable};
use crate::xfer::testing::{bytes_of, owned_region, write_into, RecSink, View};

const KEY: KeyRef = KeyRef {
    rkey: 0x77,
    tag: 0x1234_5678,
};

/// The peer is this process, so its addresses are ours: copies the way
/// process_vm_* would, without the syscall; or refuses, as a kernel
/// with ptrace restrictions does.
#[derive(Default)]
struct SameProcess {
    refuse: bool,
    calls: usize,
    /// Sizes of the `copy_many` batches it took (`None`: it refuses
    /// batches, as a kernel that fails one of them would).
    batches: Option<Vec<usize>>,
    /// An address whose copy fails.
    bad_addr: Option<u64>,
    /// The count of each batched copy's region as it was copied.
    counts: Vec<usize>,
}

impl PeerMemory for SameProcess {
    fn copy_many<'a>(
        &mut self,
        pid: u32,
        pairs: impl Iterator<Item = (&'a RegionSlice, u64)>,
        from_peer: bool,
    ) -> io::Result<()> {
        let pairs: Vec<_> = pairs.collect();
        if self.batches.is_none() || pairs.iter().any(|p| Some(p.1) == self.bad_addr) {
            return Err(io::Error::from_raw_os_error(libc::EFAULT));
        }
        for (ours, addr) in &pairs {
            self.counts.push(Arc::strong_count(ours.region()));
            self.copy(pid, ours, *addr, from_peer)?;
        }
        self.batches.as_mut().expect("checked").push(pairs.len());
        Ok(())
    }

    fn copy(
        &mut self,
        _pid: u32,
        ours: &RegionSlice,
        addr: u64,
        from_peer: bool,
    ) -> io::Result<()> {
        self.calls += 1;
        if self.refuse || Some(addr) == self.bad_addr {
            return Err(io::Error::from_raw_os_error(libc::EPERM));
        }
        // SAFETY: `addr` is a live region of this test (the "peer"),
        // `ours` a checked slice; the two do not overlap.
        unsafe {
            if from_peer {
                std::ptr::copy_nonoverlapping(addr as *const u8, ours.ptr(), ours.len())
            } else {
                std::ptr::copy_nonoverlapping(ours.ptr(), addr as *mut u8, ours.len())
            }
        }
        Ok(())
    }
}

struct Side {
    conn: LocalConn,
    mem: Arc<Region>,
    table: RegionTable,
    done: Vec<(u32, Result<()>)>,
    inbox: VecDeque<Vec<u8>>,
}

impl Side {
    fn poll(&mut self, mem: &mut SameProcess) -> Result<usize, ConnFault> {
        let mut regions = View {
            table: &self.table,
            conn: self.conn.id,
        };
        let mut sink = RecSink {
            done: &mut self.done,
            inbox: &mut self.inbox,
            cap: 8,
        };
        self.conn
            .poll(&mut regions, &PeerMaps::default(), mem, &mut sink)
    }
}

/// Two connection engines over real rings, in one process.
fn pair(tag: &str) -> (Side, Side) {
    let base = format!("/ferry-test-{:x}-{tag}", std::process::id());
    let ab = ShmRing::create(&format!("{base}-ab"), 64, 1).unwrap();
    let ba = ShmRing::create(&format!("{base}-ba"), 64, 1).unwrap();
    let to_b = ShmRing::open(&format!("{base}-ab")).unwrap();
    let to_a = ShmRing::open(&format!("{base}-ba")).unwrap();
    let pid = std::process::id();
    let side = |id, peer, rx, tx| {
        let mem = owned_region(1 << 20, KEY.rkey, KEY.tag);
        let mut table = RegionTable::default();
        table.insert(KEY.rkey, Grant::whole(&mem));
        Side {
            conn: LocalConn::new(ConnId(id), peer, pid, 7, rx, tx, 16, 16),
            mem,
            table,
            done: Vec::new(),
            inbox: VecDeque::new(),
        }
    };
    (side(1, 2, ba, to_b), side(2, 1, ab, to_a))
}

/// `a` starts an op of `len` bytes at offset `off` of both regions;
/// both sides poll until it ends.
fn op(
    a: &mut Side,
    b: &mut Side,
    mem: &mut SameProcess,
    kind: OpKind,
    off: usize,
    len: usize,
) -> Result<()> {
    let local = RegionSlice::new(&a.mem, off, len).unwrap();
    let addr = b.mem.addr() + off as u64;
    assert!(a
        .conn
        .push_request(kind, 5, KEY, addr, &local, false, None, Instant::now())
        .is_some());
    b.poll(mem).unwrap();
    a.poll(mem).unwrap();
    assert_eq!(a.done.len(), 1, "the op ended once");
    a.done.pop().unwrap().1
}

#[test]
fn inline_and_copied_transfers_are_byte_exact() {
    let (mut a, mut b) = pair("exact");
    let mut mem = SameProcess::default();
    let data: Vec<u8> = (0..70_000u32).map(|i| (i * 13 + i / 256) as u8).collect();
    for (kind, off, len) in [
        (OpKind::Write, 3, 100),
        (OpKind::Read, 200, MAX_INLINE),
        (OpKind::Write, 4096, 65_536),
        (OpKind::Read, 90_000, 70_000),
    ] {
        let (src, dst) = match kind {
            OpKind::Write => (a.mem.clone(), b.mem.clone()),
            OpKind::Read => (b.mem.clone(), a.mem.clone()),
        };
        write_into(&src, off, &data[..len]);
        op(&mut a, &mut b, &mut mem, kind, off, len).unwrap();
        assert_eq!(bytes_of(&dst, off, len), &data[..len], "{kind} {len}");
    }
    // Only the two large ones needed the peer's memory.
    assert_eq!(mem.calls, 2);
}

/// `a` starts `ops` (kind, offset, length) at once; `b` serves them in
/// one pass; their outcomes in the order they were pushed.
fn ops_in_one_pass(
    a: &mut Side,
    b: &mut Side,
    mem: &mut SameProcess,
    ops: &[(OpKind, usize, usize)],
) -> Vec<Result<()>> {
    for (i, &(kind, off, len)) in ops.iter().enumerate() {
        let local = RegionSlice::new(&a.mem, off, len).unwrap();
        let addr = b.mem.addr() + off as u64;
        assert!(a
            .conn
            .push_request(
                kind,
                i as u32,
                KEY,
                addr,
                &local,
                false,
                None,
                Instant::now()
            )
            .is_some());
    }
    b.poll(mem).unwrap();
    a.poll(mem).unwrap();
    assert_eq!(a.done.len(), ops.len(), "each op ended once");
    let mut done = std::mem::take(&mut a.done);
    done.sort_by_key(|d| d.0);
    done.into_iter().map(|d| d.1).collect()
}

#[test]
fn a_pass_copies_its_requests_in_one_batch_per_direction_in_order() {
    let (mut a, mut b) = pair("batch");
    let mut mem = SameProcess {
        batches: Some(Vec::new()),
        ..Default::default()
    };
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 1) as u8).collect();
    write_into(&a.mem, 0, &data);
    write_into(&b.mem, 65_536, &data);
    // Four WRITEs of 4 KiB, then an inline READ of bytes the first one
    // writes (it must see them: the batch is copied before the READ is
    // answered), then two READs of 4 KiB.
    let ops = [
        (OpKind::Write, 0, 4096),
        (OpKind::Write, 4096, 4096),
        (OpKind::Write, 8192, 4096),
        (OpKind::Write, 12_288, 4096),
        (OpKind::Read, 0, 100),
        (OpKind::Read, 65_536, 4096),
        (OpKind::Read, 65_536 + 4096, 4096),
    ];
    for r in ops_in_one_pass(&mut a, &mut b, &mut mem, &ops[..4]) {
        r.unwrap();
    }
    assert_eq!(bytes_of(&b.mem, 0, 8192), &data[..]);
    let fresh: Vec<u8> = (0..4096u32).map(|i| (i * 3 + 5) as u8).collect();
    write_into(&a.mem, 0, &fresh);
    for r in ops_in_one_pass(&mut a, &mut b, &mut mem, &ops) {
        r.unwrap();
    }
    assert_eq!(bytes_of(&b.mem, 0, 4096), &fresh[..]);
    assert_eq!(
        bytes_of(&a.mem, 0, 100),
        &fresh[..100],
        "the READ saw the WRITE"
    );
    assert_eq!(bytes_of(&a.mem, 65_536, 8192), &data[..]);
    // The first pass: one batch of 4; the second: the 4 WRITEs before
    // the inline READ, then the 2 READs.
    assert_eq!(mem.batches.as_deref(), Some(&[4, 4, 2][..]));
}

/// A request is checked with a borrowed slice (no count: the table
/// holds the region while it is served); one whose copy is put off to
/// the pass's batch takes its own count, since the table may change
/// before the batch is copied (a later request's lookup applies queued
/// registration changes, removals too).
#[test]
fn a_put_off_copy_holds_its_region() {
    let (mut a, mut b) = pair("held");
    let mut mem = SameProcess {
        batches: Some(Vec::new()),
        ..Default::default()
    };
    let ops = [(OpKind::Write, 0, 4096), (OpKind::Read, 4096, 4096)];
    for r in ops_in_one_pass(&mut a, &mut b, &mut mem, &ops) {
        r.unwrap();
    }
    // b's table and b's handle, and one count for each of the two
    // put-off copies (both in the batch at once).
    assert_eq!(mem.counts, [4, 4]);
    assert_eq!(Arc::strong_count(&b.mem), 2, "and let go after");
}

#[test]
fn a_failed_batch_fails_only_the_op_that_cannot_be_copied() {
    let (mut a, mut b) = pair("batchfail");
    let mut mem = SameProcess {
        batches: Some(Vec::new()),
        bad_addr: Some(a.mem.addr() + 8192),
        ..Default::default()
    };
    let ops = [
        (OpKind::Write, 0, 4096),
        (OpKind::Write, 4096, 4096),
        (OpKind::Write, 8192, 4096),
        (OpKind::Write, 12_288, 4096),
    ];
    let out = ops_in_one_pass(&mut a, &mut b, &mut mem, &ops);
    for (i, r) in out.iter().enumerate() {
        assert_eq!(r.is_err(), i == 2, "op {i}: {r:?}");
    }
    // The connection goes on.
    mem.bad_addr = None;
    for r in ops_in_one_pass(&mut a, &mut b, &mut mem, &ops) {
        r.unwrap();
    }
}

#[test]
fn unreachable_peer_memory_fails_the_op_not_the_connection() {
    let (mut a, mut b) = pair("refuse");
    let mut mem = SameProcess {
        refuse: true,
        ..Default::default()
    };
    let e = op(&mut a, &mut b, &mut mem, OpKind::Write, 0, 10_000).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote {
                status: Status::PeerMemory,
                ..
            }
        ),
        "{e:?}"
    );
    mem.refuse = false;
    op(&mut a, &mut b, &mut mem, OpKind::Write, 0, 10_000).unwrap();
}

/// The IPC revocations `b` finds in its ring, in order (other
/// messages are skipped).
fn revokes_in_ring(b: &mut Side) -> Vec<u64> {
    let mut out = Vec::new();
    let mut buf = [0u8; SLOT_PAYLOAD];
    while let Some(n) = b.conn.rx.ring.pop(&mut buf) {
        let (m, _) = Msg::decode(&buf[..n]).unwrap();
        if m.kind == MsgKind::IpcRevoke {
            out.push(m.addr);
        }
    }
    out
}

#[test]
fn revocations_wait_for_room_in_a_full_ring_and_are_never_refused() {
    let (mut a, mut b) = pair("revoke");
    let mut mem = SameProcess::default();
    // The peer stops reading: its ring fills with notifications' worth
    // of other messages.
    let filler = Msg::new(MsgKind::Close);
    let mut sent = 0;
    while a.conn.send(&filler, &[]) {
        sent += 1;
    }
    assert!(sent > 0);
    a.conn.push_ipc_revoke(0xa000);
    a.conn.push_ipc_revoke(0xb000);
    a.conn.push_ipc_revoke(0xa000);
    assert_eq!(a.conn.revokes_owed(), 2, "kept once each");
    assert!(
        a.conn.owes_revokes() && a.conn.busy(),
        "kept hot: only polling sends them"
    );
    // Still full: polling sends nothing and loses nothing.
    a.poll(&mut mem).unwrap();
    assert_eq!(a.conn.revokes_owed(), 2);
    // The peer reads; our next pass sends them, in order.
    assert!(revokes_in_ring(&mut b).is_empty());
    a.poll(&mut mem).unwrap();
    assert_eq!(a.conn.revokes_owed(), 0);
    assert!(!a.conn.busy());
    assert_eq!(revokes_in_ring(&mut b), vec![0xa000, 0xb000]);
    // With room, one goes at once.
    a.conn.push_ipc_revoke(0xc000);
    assert_eq!(a.conn.revokes_owed(), 0);
    assert_eq!(revokes_in_ring(&mut b), vec![0xc000]);
}

#[test]
fn a_peer_that_never_reads_holds_at_most_the_cap_of_revocations() {
    let (mut a, _b) = pair("revoke-cap");
    let filler = Msg::new(MsgKind::Close);
    while a.conn.send(&filler, &[]) {}
    for i in 0..(MAX_REVOKES_OWED as u64 + 10) {
        a.conn.push_ipc_revoke(0x1000 * (i + 1));
    }
    assert_eq!(a.conn.revokes_owed(), MAX_REVOKES_OWED);
    // The oldest went first.
    assert_eq!(a.conn.revokes_owed[0], 0x1000 * 11);
}

#[test]
fn a_reply_to_nothing_breaks_the_connection() {
    let (mut a, mut b) = pair("stray");
    let mut mem = SameProcess::default();
    let mut m = Msg::new(MsgKind::WriteAck);
    m.conn = 7;
    m.op_id = 999;
    assert!(b.conn.send(&m, &[]));
    let e = a.poll(&mut mem).unwrap_err();
    assert!(
        matches!(&e, ConnFault::PeerMisbehaved { what } if what.contains("not outstanding")),
        "{e}"
    );
}

#[test]
fn a_notification_past_the_cap_breaks_the_connection() {
    let (mut a, mut b) = pair("notify");
    let mut mem = SameProcess::default();
    assert!(b.conn.push_notify(&[1u8; 3000]));
    a.poll(&mut mem).unwrap();
    assert_eq!(a.inbox.pop_front().unwrap(), vec![1u8; 3000]);
    // Fragments that add up past MAX_NOTIFY_WIRE_BYTES.
    let mut m = Msg::new(MsgKind::Notify);
    m.conn = 7;
    m.status = 1;
    for _ in 0..=(MAX_NOTIFY_WIRE_BYTES / MAX_INLINE) {
        assert!(b.conn.send(&m, &[0u8; MAX_INLINE]));
    }
    let e = a.poll(&mut mem).unwrap_err();
    assert!(
        matches!(&e, ConnFault::PeerMisbehaved { what } if what.contains("longer than")),
        "{e}"
    );
}

/// A notification riding in a WRITE request reaches the target's inbox
/// with the copy, never before it: at once for an inline write, after
/// the put-off copy of a large one (the pass after its answer).
#[test]
fn a_riding_note_lands_with_its_write() {
    let (mut a, mut b) = pair("ride");
    a.conn.set_notes_ride(true);
    let mut mem = SameProcess::default();
    let data: Vec<u8> = (0..70_000u32).map(|i| (i * 7) as u8).collect();
    for (off, len) in [(3usize, 100usize), (4096, 65_536)] {
        write_into(&a.mem, off, &data[..len]);
        let local = RegionSlice::new(&a.mem, off, len).unwrap();
        let addr = b.mem.addr() + off as u64;
        let note = [b"\x00note ".as_slice(), &len.to_le_bytes()].concat();
        let rode = a.conn.push_request(
            OpKind::Write,
            5,
            KEY,
            addr,
            &local,
            false,
            Some(&note),
            Instant::now(),
        );
        assert_eq!(rode, Some(true));
        // A notification sent after it: an inline write, answered at once,
        // hands its note over first.
        assert!(a.conn.push_notify(b"\x00after"));
        b.poll(&mut mem).unwrap();
        b.poll(&mut mem).unwrap();
        assert_eq!(bytes_of(&b.mem, off, len), &data[..len], "{len}");
        let got: Vec<Vec<u8>> = b.inbox.drain(..).collect();
        assert_eq!(got.len(), 2, "{len}");
        assert!(got.contains(&note), "{len}");
        if len <= MAX_INLINE {
            assert_eq!(got[0], note, "{len}");
        }
        a.poll(&mut mem).unwrap();
        assert!(matches!(a.done.pop(), Some((5, Ok(())))));
        // Nothing rides back, nothing else arrives.
        assert!(a.inbox.is_empty());
    }
}

/// A request that fails (its window does not hold it) answers the error
/// and drops its riding notification: nothing reaches the inbox.
#[test]
fn a_riding_note_of_a_failed_write_is_never_delivered() {
    let (mut a, mut b) = pair("ride-fail");
    a.conn.set_notes_ride(true);
    let mut mem = SameProcess::default();
    let local = RegionSlice::new(&a.mem, 0, 4096).unwrap();
    let beyond = b.mem.addr() + (1 << 20) - 100;
    let rode = a.conn.push_request(
        OpKind::Write,
        6,
        KEY,
        beyond,
        &local,
        false,
        Some(b"\x00lost"),
        Instant::now(),
    );
    assert_eq!(rode, Some(true));
    b.poll(&mut mem).unwrap();
    b.poll(&mut mem).unwrap();
    assert!(b.inbox.is_empty(), "a note of a failed write was delivered");
    a.poll(&mut mem).unwrap();
    assert!(matches!(a.done.pop(), Some((6, Err(_)))));
}

/// To a peer that did not say it takes them, a note does not ride (the
/// shard sends it as the op ends); a peer that claims a riding note longer
/// than its request's bytes breaks the connection.
#[test]
fn notes_ride_only_where_the_peer_takes_them_and_as_long_as_they_are() {
    let (mut a, mut b) = pair("ride-old");
    let mut mem = SameProcess::default();
    let local = RegionSlice::new(&a.mem, 0, 64).unwrap();
    let addr = b.mem.addr();
    let rode = a.conn.push_request(
        OpKind::Write,
        1,
        KEY,
        addr,
        &local,
        false,
        Some(b"\x00x"),
        Instant::now(),
    );
    assert_eq!(rode, Some(false));
    b.poll(&mut mem).unwrap();
    assert!(b.inbox.is_empty());
    a.poll(&mut mem).unwrap();
    let mut m = Msg::new(MsgKind::WriteReq);
    m.conn = 7;
    m.op_id = 3;
    m.rkey = KEY.rkey;
    m.aux = KEY.tag;
    m.addr = addr;
    m.len = 8;
    m.status = REQ_NOTE;
    m.aux2 = 64;
    assert!(a.conn.send_raw(&m, &[0u8; 8]));
    let e = b.poll(&mut mem).unwrap_err();
    assert!(
        matches!(&e, ConnFault::PeerMisbehaved { what } if what.contains("status 4")),
        "{e}"
    );
    // A READ does not carry one.
    let (mut a, mut b) = pair("ride-read");
    m.kind = MsgKind::ReadReq;
    m.aux2 = 2;
    assert!(a.conn.send_raw(&m, &[0u8; 10]));
    let e = b.poll(&mut mem).unwrap_err();
    assert!(
        matches!(&e, ConnFault::PeerMisbehaved { what } if what.contains("riding notification")),
        "{e}"
    );
}

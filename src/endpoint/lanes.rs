//! Lanes: a tcp connection spread over shards is one connection id per
//! shard ("lane"), numbered so that the id says how many there are and
//! which shard serves each. The arithmetic is pure (tested below); the
//! submission of an op over a connection's lanes is here too.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{Inner, Mode};
use crate::error::{ConnId, Error, OpKind, Result};
use crate::reactor::completion::CompletionTable;
use crate::reactor::{Command, OpCmd, OpParts, Shard, ShardHandle, Transfer, MAX_BATCH};
use crate::wire::MAX_NOTIFY_BYTES;

/// A connection spread over shards has an id whose top byte is its lane
/// count (2..=255) and whose rest is its first lane's id; lane i is
/// `ConnId(base + i)`. Others have a zero top byte: one lane, themselves.
pub(super) const LANES_SHIFT: u32 = 56;

pub(super) const MAX_LANES: usize = 255;

pub(super) fn lanes_of(conn: ConnId) -> (u64, usize) {
    let k = (conn.0 >> LANES_SHIFT) as usize;
    if k > 1 {
        (conn.0 & ((1 << LANES_SHIFT) - 1), k)
    } else {
        (conn.0, 1)
    }
}

/// How many lanes a new tcp connection of `streams` streams gets with
/// `shards` shards and `FERRY_LANES` = `cap` (0: no cap).
pub(super) fn lane_count(streams: usize, shards: usize, cap: usize) -> usize {
    let cap = if cap == 0 { usize::MAX } else { cap };
    streams.min(shards).min(cap).clamp(1, MAX_LANES)
}

/// The first id of `k > 1` lanes when the next free id is `next`: a
/// multiple of the shard count, so lane i is served by shard i.
pub(super) fn lanes_base(next: u64, shards: u64) -> u64 {
    next.div_ceil(shards) * shards
}

/// Cuts an op on a connection of `k` lanes into (lane, part) pairs (the
/// lane modulo `k`): a large single op into at most `k` contiguous pieces
/// at `chunk` boundaries, a vectored one dealt pair by pair over the
/// lanes, a small one whole onto `small_lane()` (the calling thread's
/// lane: one thread's small ops batch on one shard and stay in order,
/// several threads spread over the lanes).
pub(super) fn cut(
    parts: OpParts,
    k: usize,
    chunk: u64,
    small_lane: impl FnOnce() -> u64,
) -> Vec<(u64, OpParts)> {
    match parts {
        OpParts::One(d) if d.len() >= 2 * chunk => {
            let total = d.len();
            let per = total.div_ceil(chunk).div_ceil(k as u64) * chunk;
            let mut out = Vec::with_capacity(total.div_ceil(per) as usize);
            let mut off = 0;
            while off < total {
                let len = per.min(total - off);
                out.push((off / per, OpParts::One(d.piece(off, len))));
                off += len;
            }
            out
        }
        OpParts::Many(ds) if ds.len() > 1 => {
            let lanes = k.min(ds.len());
            let mut groups: Vec<Vec<_>> = (0..lanes).map(|_| Vec::new()).collect();
            for (i, d) in ds.into_iter().enumerate() {
                groups[i % lanes].push(d);
            }
            groups
                .into_iter()
                .enumerate()
                .map(|(i, g)| (i as u64, OpParts::Many(g)))
                .collect()
        }
        whole => vec![(small_lane(), whole)],
    }
}

/// The shards and what every op goes through.
pub(super) struct ShardSet {
    pub(super) shards: Vec<ShardHandle>,
    /// Every op's completion slot.
    pub(super) table: Arc<CompletionTable>,
    /// The codec threads (None: `FERRY_COMPRESS=off`).
    pub(super) codec: Option<Arc<crate::reactor::codec_pool::LazyCodecPool>>,
    /// Turn of the lanes handed to threads for their small ops
    /// (`thread_lane`).
    pub(super) next_lane: AtomicU64,
    /// The shard the next same-host connection goes to (mod the shards).
    pub(super) next_local_shard: AtomicU64,
}

impl Inner {
    /// The shard that serves `conn` (for a connection spread over shards:
    /// its first lane's).
    pub(super) fn shard_of(&self, conn: ConnId) -> &ShardHandle {
        let (base, _) = lanes_of(conn);
        &self.shards.shards[(base % self.shards.shards.len() as u64) as usize]
    }

    /// Before an op on `conn` is checked and built: has the queue slot its
    /// command will fill come to this core (`CmdRing::prepare_push`) — for
    /// a managed shard (on another core) and a connection of one lane (its
    /// shard known before the op is cut).
    pub(super) fn prepare_submit(&self, conn: ConnId) {
        if self.cfg.mode != Mode::Managed {
            return;
        }
        self.shards.table.prepare_claim();
        if lanes_of(conn).1 == 1 {
            self.shard_of(conn).wake.cmds.prepare_push();
        }
    }

    /// Each lane of `conn` (itself, unless spread over shards), with the
    /// shard that serves it.
    pub(super) fn lanes(&self, conn: ConnId) -> impl Iterator<Item = (ConnId, &ShardHandle)> {
        let (base, k) = lanes_of(conn);
        let n = self.shards.shards.len() as u64;
        (0..k as u64).map(move |i| {
            (
                ConnId(base + i),
                &self.shards.shards[((base + i) % n) as usize],
            )
        })
    }

    /// How many lanes a new tcp connection of `streams` streams gets.
    pub(super) fn lanes_for(&self, streams: usize) -> usize {
        lane_count(streams, self.shards.shards.len(), self.cfg.lanes)
    }

    /// The lane (modulo a connection's count) this thread's small ops use:
    /// dealt round-robin to threads on their first op.
    pub(super) fn thread_lane(&self) -> u64 {
        thread_local! {
            static LANE: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
        }
        LANE.with(|l| match l.get() {
            Some(lane) => lane,
            None => {
                let lane = self.shards.next_lane.fetch_add(1, Ordering::Relaxed);
                l.set(Some(lane));
                lane
            }
        })
    }

    /// Ids for `k` lanes: `base..base + k`, with `base` a multiple of the
    /// shard count when k > 1, so lane i is served by shard i.
    pub(super) fn alloc_conn_ids(&self, k: usize) -> u64 {
        if k <= 1 {
            return self.conns.next_id.fetch_add(1, Ordering::Relaxed);
        }
        let n = self.shards.shards.len() as u64;
        let mut cur = self.conns.next_id.load(Ordering::Relaxed);
        loop {
            let base = lanes_base(cur, n);
            match self.conns.next_id.compare_exchange_weak(
                cur,
                base + k as u64,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return base,
                Err(c) => cur = c,
            }
        }
    }

    /// Claims a slot for an op on `conn` and sends its command(s) `via`
    /// their shard's queue or a batch.
    pub(super) fn submit(
        &self,
        conn: ConnId,
        kind: OpKind,
        parts: OpParts,
        via: &mut Via<'_>,
    ) -> Result<Transfer> {
        check_note(via.note)?;
        let t = self.shards.table.claim().ok_or(Error::TooManyInflight {
            max: self.shards.table.capacity(),
        })?;
        if let Some(n) = via.note {
            self.attach_note(&t, conn, via.note_kind, n);
        }
        let (base, k) = lanes_of(conn);
        if k > 1 {
            return self.submit_lanes(t, base, k, kind, parts, via);
        }
        let cmd = OpCmd {
            conn,
            kind,
            slot: t.slot(),
            parts,
            at: Default::default(),
            total: None,
        };
        match self.send_op(self.shard_of(conn).id, cmd, via) {
            Ok(()) => Ok(t),
            Err(e) => {
                // Never submitted: complete it ourselves so the slot frees.
                self.shards.table.cancel_note(t.slot());
                self.shards.table.complete(t.slot(), Ok(()));
                drop(t);
                Err(e)
            }
        }
    }

    /// Submits an op on a connection spread over `k` lanes: a large
    /// single op is cut into `k` contiguous pieces (at chunk boundaries),
    /// one per lane; a vectored one deals its pairs over the lanes; a
    /// small one goes whole to the calling thread's lane. The pieces complete
    /// into one slot (`CompletionTable::set_parts`).
    fn submit_lanes(
        &self,
        t: Transfer,
        base: u64,
        k: usize,
        kind: OpKind,
        parts: OpParts,
        via: &mut Via<'_>,
    ) -> Result<Transfer> {
        let slot = t.slot();
        let chunk = self.cfg.chunk_bytes as u64;
        let n = self.shards.shards.len() as u64;
        let pieces = cut(parts, k, chunk, || self.thread_lane());
        self.shards.table.set_parts(slot, pieces.len() as u32);
        let mut failed = None;
        for (lane_idx, piece) in pieces {
            let lane = base + lane_idx % k as u64;
            if failed.is_some() {
                // An earlier piece was refused: this one is never sent.
                self.shards.table.complete(slot, Ok(()));
                continue;
            }
            let cmd = OpCmd {
                conn: ConnId(lane),
                kind,
                slot,
                parts: piece,
                at: Default::default(),
                total: None,
            };
            if let Err(e) = self.send_op((lane % n) as usize, cmd, via) {
                // Never submitted: its part is completed here, so the slot
                // frees once the pieces already sent end (and the note is
                // never sent: the op is not whole).
                self.shards.table.cancel_note(slot);
                self.shards.table.complete(slot, Ok(()));
                failed = Some(e);
            }
        }
        match failed {
            None => Ok(t),
            Some(e) => {
                drop(t);
                Err(e)
            }
        }
    }

    /// Sends one op's command to shard `shard`: queued now, or staged in
    /// a batch (which queues a shard's staged ops once it holds
    /// `MAX_BATCH`). Only a command queued now can be refused here.
    fn send_op(&self, shard: usize, cmd: OpCmd, via: &mut Via<'_>) -> Result<()> {
        match &mut via.to {
            To::Shard(s) if s.is(&self.shards.shards[shard]) => {
                s.submit_here(Command::Op(cmd)).map_err(|(e, _)| e)
            }
            To::Queue | To::Shard(_) => self.shards.shards[shard]
                .submit(Command::Op(cmd))
                .map_err(|(e, _)| e),
            To::Staged(staged) => {
                let q = &mut staged[shard];
                if q.capacity() == 0 {
                    *q = self.shards.shards[shard].wake.bufs.take();
                }
                q.push(cmd);
                if q.len() >= MAX_BATCH {
                    let _ = self.queue_staged(shard, q);
                }
                Ok(())
            }
        }
    }

    /// Queues shard `shard`'s staged ops as one command: one queue push
    /// and at most one wake for all. A refused command fails each of its
    /// ops through its transfer (and the error is returned too).
    pub(super) fn queue_staged(&self, shard: usize, q: &mut Vec<OpCmd>) -> Result<()> {
        let cmd = match q.len() {
            0 => return Ok(()),
            1 => Command::Op(q.pop().expect("one op")),
            _ => Command::Ops(std::mem::take(q)),
        };
        let Err((e, cmd)) = self.shards.shards[shard].submit(cmd) else {
            return Ok(());
        };
        let ops = match cmd {
            Command::Op(op) => vec![op],
            Command::Ops(ops) => ops,
            _ => unreachable!("only ops are staged"),
        };
        for op in ops {
            self.shards.table.complete(op.slot, Err(e.duplicate()));
        }
        Err(e)
    }
}

/// A notification that would ride with an op: refused before anything
/// is claimed if it is too long.
pub(super) fn check_note(note: Option<&[u8]>) -> Result<()> {
    match note {
        Some(n) if n.len() > MAX_NOTIFY_BYTES => Err(Error::NotifyTooLong {
            len: n.len(),
            max: MAX_NOTIFY_BYTES,
        }),
        _ => Ok(()),
    }
}

impl Inner {
    /// Stores `n` in `t`'s slot: the shard that ends the op sends it to
    /// the peer on `conn`'s first lane (as send_notification's) if the op
    /// ended well, as a notification of `kind` (`NOTE_APP`: the
    /// application's; `NOTE_CTL`: the engine's two-sided messages).
    pub(super) fn attach_note(&self, t: &Transfer, conn: ConnId, kind: u8, n: &[u8]) {
        let (lane, shard) = self.lanes(conn).next().expect("a lane");
        let mut payload = Vec::with_capacity(1 + n.len());
        payload.push(kind);
        payload.extend_from_slice(n);
        let note = crate::reactor::completion::Note {
            conn: lane,
            shard: shard.id,
            payload,
        };
        self.shards.table.set_note(t.slot(), note);
    }
}

/// Where an op's commands go: straight onto their shards' queues, into
/// a batch's per-shard lists (queued when the batch is), or applied at
/// once by the embedded shard the calling thread drives (commands for
/// other shards still go to their queues). Public only as a sealed
/// trait's argument; nothing outside can make or read one.
pub struct Via<'a> {
    to: To<'a>,
    note: Option<&'a [u8]>,
    /// The note's kind (`wire::NOTE_APP` unless the engine's own).
    note_kind: u8,
}

enum To<'a> {
    Queue,
    Staged(&'a mut [Vec<OpCmd>]),
    Shard(&'a mut Shard),
}

impl<'a> Via<'a> {
    pub(super) fn now() -> Self {
        Via {
            to: To::Queue,
            note: None,
            note_kind: crate::wire::NOTE_APP,
        }
    }

    pub(super) fn staged(per_shard: &'a mut [Vec<OpCmd>]) -> Self {
        Via {
            to: To::Staged(per_shard),
            note: None,
            note_kind: crate::wire::NOTE_APP,
        }
    }

    pub(super) fn on(shard: &'a mut Shard) -> Self {
        Via {
            to: To::Shard(shard),
            note: None,
            note_kind: crate::wire::NOTE_APP,
        }
    }

    /// Whether the op is queued to its shard (or applied by it) now, not
    /// staged in a batch, which may be queued after its regions are gone:
    /// its slices may then be borrowed (`RegionSlice::borrowed`).
    pub(super) fn is_now(&self) -> bool {
        !matches!(self.to, To::Staged(_))
    }

    /// Whether a notification rides with the op.
    pub(super) fn note(&self) -> Option<&'a [u8]> {
        self.note
    }

    /// The kind of that notification (`wire::NOTE_APP` or `NOTE_CTL`).
    pub(super) fn note_kind(&self) -> u8 {
        self.note_kind
    }

    /// With a notification for the peer, sent by a shard once the op
    /// ended well.
    pub(super) fn noting(mut self, note: &'a [u8]) -> Self {
        self.note = Some(note);
        self
    }

    /// With one of the engine's two-sided messages (`wire::msg`) for the
    /// peer, sent by the shard that ends the op, once it ended well: at
    /// once, not when the caller next looks.
    pub(super) fn noting_engine(mut self, msg: &'a [u8]) -> Self {
        self.note = Some(msg);
        self.note_kind = crate::wire::NOTE_CTL;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reactor::OpDesc;
    use crate::region::{Region, RegionSlice};
    use crate::xfer::testing::owned_region;

    fn desc(region: &std::sync::Arc<Region>, off: usize, len: usize) -> OpDesc {
        OpDesc {
            local: RegionSlice::new(region, off, len).unwrap(),
            remote_addr: 0x10_0000 + off as u64,
            rkey: 1,
            tag: 2,
            remote_device: false,
            dtype: None,
            nic_rkeys: None,
        }
    }

    #[test]
    fn an_id_says_its_lanes() {
        assert_eq!(lanes_of(ConnId(77)), (77, 1));
        for k in [2u64, 16, 255] {
            let id = ConnId(1000 | k << LANES_SHIFT);
            assert_eq!(lanes_of(id), (1000, k as usize));
        }
        // A top byte of 1 is one lane too.
        assert_eq!(
            lanes_of(ConnId(5 | 1 << LANES_SHIFT)),
            (5 | 1 << LANES_SHIFT, 1)
        );
    }

    #[test]
    fn lane_counts_and_bases() {
        assert_eq!(lane_count(4, 16, 0), 4);
        assert_eq!(lane_count(32, 16, 0), 16);
        assert_eq!(lane_count(32, 16, 3), 3);
        assert_eq!(lane_count(0, 16, 0), 1);
        assert_eq!(lane_count(1000, 1000, 0), MAX_LANES);
        assert_eq!(lanes_base(17, 16), 32);
        assert_eq!(lanes_base(32, 16), 32);
        assert_eq!(lanes_base(0, 4), 0);
    }

    #[test]
    fn a_large_op_is_cut_into_contiguous_chunk_aligned_pieces() {
        let r = owned_region(10 << 20, 1, 2);
        let chunk = 256 << 10;
        for (len, k) in [
            (10 << 20, 4),
            ((10 << 20) - 3, 3),
            (2 * chunk, 8),
            (5 * chunk + 1, 2),
        ] {
            let pieces = cut(OpParts::One(desc(&r, 0, len)), k, chunk as u64, || 99);
            assert!(
                pieces.len() <= k && pieces.len() > 1,
                "{len} over {k}: {}",
                pieces.len()
            );
            let mut off = 0;
            for (i, (lane, p)) in pieces.iter().enumerate() {
                assert_eq!(*lane, i as u64);
                let d = &p.as_slice()[0];
                assert_eq!(d.local.addr(), r.addr() + off as u64);
                assert_eq!(d.remote_addr, 0x10_0000 + off as u64);
                if i + 1 < pieces.len() {
                    assert_eq!(d.local.len() % chunk, 0);
                }
                off += d.local.len();
            }
            assert_eq!(off, len);
        }
    }

    #[test]
    fn a_vectored_op_is_dealt_and_a_small_one_goes_whole() {
        let r = owned_region(1 << 20, 1, 2);
        let ds: Vec<_> = (0..7).map(|i| desc(&r, i * 1000, 100)).collect();
        let pieces = cut(OpParts::Many(ds), 3, 1 << 18, || 99);
        let lens: Vec<usize> = pieces.iter().map(|(_, p)| p.as_slice().len()).collect();
        assert_eq!(lens, [3, 2, 2]);
        assert_eq!(pieces[1].1.as_slice()[0].remote_addr, 0x10_0000 + 1000);
        let small = cut(OpParts::One(desc(&r, 0, 4096)), 4, 1 << 18, || 99);
        assert_eq!(small.len(), 1);
        assert_eq!(small[0].0, 99);
    }
}

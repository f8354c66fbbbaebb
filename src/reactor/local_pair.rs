//! `LocalPair`: the same-host transport's counterpart of `tcp/pair.rs`.
//! Two `LocalSide`s, the code a shard runs for its same-host connections,
//! with one connection between them over rings in memfd memory (each side
//! its own mapping, as two processes have; no names in /dev/shm), driven in
//! one thread through the `Carrier` and `Source` traits as the shard
//! drives them, with the shard's own ledger and completion table. Only the
//! shard's routing of an op (`Shard::apply_op`, a dozen lines) is
//! restated here.
//!
//! Deterministic from a seed: ops both ways (inline, ring-copied and
//! CMA-sized), notifications both ways into a small inbox drained slowly,
//! and faults: one side stops polling for a while (the rings fill: back
//! pressure), a hostile message in a ring, the peer process gone, a peer
//! that never answers (the op timeout), in virtual time. The harness checks
//! that every op ends exactly once (a second completion underflows the
//! ledger's count; a missing one leaves its transfer in flight), byte-exact
//! when it succeeded, that nothing lands past an op's window, that
//! notifications arrive whole and in order (all of them unless the
//! connection died), and that nothing is left in flight.

use std::collections::VecDeque;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::completion::{CompletionTable, Transfer};
use super::ledger::OpLedger;
use super::local_side::{LocalInit, LocalSide};
use super::queue::{OpCmd, OpDesc, OpParts};
use super::source::{Carrier, ConnRef, CxParts, Source, SubmitCx};
use crate::error::{ConnFault, ConnId, Error, OpKind, Result};
use crate::region::{Grant, KeyRef, Region, RegionSlice};
use crate::shm::local::LocalConn;
use crate::shm::named_ring::ShmRing;
use crate::wire::shm_msg::{Msg, MsgKind, MAX_INLINE};
use crate::wire::testrng::Rng;
use crate::xfer::testing::{bytes_of, owned_region, write_into};

const KEY: KeyRef = KeyRef {
    rkey: 0x4c4c,
    tag: 0x6c6f_6361_6c21_0001,
};
const CHUNK: usize = 256 << 10;
/// The largest op, and the room each op's window gets (with a guard after).
const MAX_OP: usize = 300_000;
const STRIDE: usize = MAX_OP + 4096;
const OPS: usize = 24;
const MEM: usize = OPS * STRIDE;
/// Small, so rings fill; a notification of up to 3000 bytes fits whole.
const RING_SLOTS: usize = 32;
const MAX_REQS: usize = 4;
/// Virtual time per step, and the op timeout in it.
const STEP: Duration = Duration::from_millis(1);
const LIMIT: Duration = Duration::from_millis(200);
const MAX_STEPS: u32 = 20_000;

/// The faults of one run.
#[derive(Debug, Clone, Default)]
pub(crate) struct Faults {
    /// (side, from step, for steps): that side does not poll.
    pub stop: Option<(usize, u32, u32)>,
    /// (side, step): a reply to nothing lands in that side's ring.
    pub garbage: Option<(usize, u32)>,
    /// (side, step): that side's peer process is gone.
    pub peer_gone: Option<(usize, u32)>,
    /// That side's peer never polls again.
    pub silent_peer: Option<usize>,
    /// Notifications the application takes per step (0: all).
    pub drain_per_step: usize,
}

/// One side: the transport with its connection, and what the shard keeps
/// around it.
struct End {
    side: LocalSide,
    /// The connection's index in `side` (None once removed).
    idx: Option<usize>,
    conn: ConnId,
    parts: CxParts,
    notes: Receiver<(ConnId, Vec<u8>)>,
    table: Arc<CompletionTable>,
    ledger: OpLedger,
    mem: Arc<Region>,
    /// Ops and notifications handed back for room, retried in order (the
    /// shard's parked commands).
    waiting: VecDeque<OpCmd>,
    notes_waiting: VecDeque<Vec<u8>>,
    failed: Option<ConnFault>,
    /// Ops the transport handed back for room.
    handed_back: usize,
}

impl End {
    fn new(conn: LocalConn) -> End {
        let mut side = LocalSide::new(0, LocalInit::bare(None));
        let id = conn.id;
        let idx = side.add(conn);
        let (mut parts, notes) = CxParts::new(4);
        let mem = owned_region(MEM, KEY.rkey, KEY.tag);
        parts.regions().insert(KEY.rkey, Grant::whole(&mem));
        let table = CompletionTable::new(64);
        End {
            side,
            idx: Some(idx),
            conn: id,
            parts,
            notes,
            ledger: OpLedger::new(table.clone(), 64, Default::default()),
            table,
            mem,
            waiting: VecDeque::new(),
            notes_waiting: VecDeque::new(),
            failed: None,
            handed_back: 0,
        }
    }

    /// `Shard::apply_op`: counts the op in the ledger with the pieces the
    /// transport makes of it, then submits it; what found no room comes
    /// back.
    fn apply(&mut self, mut op: OpCmd, now: Instant) -> Option<OpCmd> {
        let Some(idx) = self.idx else {
            let err = Error::ConnFailed {
                conn: op.conn,
                cause: self
                    .failed
                    .clone()
                    .unwrap_or(ConnFault::Closed { why: "removed" }),
            };
            match op.total {
                None => self.ledger.fail(op.slot, err),
                Some(total) => self.ledger.fail_rest(op.slot, total - op.at.emitted, err),
            }
            return None;
        };
        if op.total.is_none() {
            let (total, _) = self.side.pieces(idx, &op, CHUNK);
            let counted = crate::reactor::ledger::Counted {
                op: crate::metrics::op_idx(op.kind),
                via: crate::metrics::Via::Shm,
                bytes: op.parts.bytes(),
                start: now,
            };
            if let Err(e) = self.ledger.open(op.slot, total, Some(op.conn), counted) {
                self.ledger.fail(op.slot, e);
                return None;
            }
            op.total = Some(total);
        }
        let mut cx = SubmitCx {
            ledger: &mut self.ledger,
            gpu: None,
            chunk: CHUNK,
            now,
        };
        self.side.submit(idx, op, &mut cx)
    }

    /// Queues an op behind those waiting (a connection's ops go in order).
    fn start(&mut self, op: OpCmd, now: Instant) {
        if !self.waiting.is_empty() {
            self.waiting.push_back(op);
        } else if let Some(op) = self.apply(op, now) {
            self.handed_back += 1;
            self.waiting.push_back(op);
        }
    }

    fn retry(&mut self, now: Instant) {
        while let Some(op) = self.waiting.pop_front() {
            if let Some(op) = self.apply(op, now) {
                self.handed_back += 1;
                self.waiting.push_front(op);
                break;
            }
        }
        while let Some(n) = self.notes_waiting.pop_front() {
            let Some(idx) = self.idx else {
                // Gone with the connection, as the shard drops them.
                continue;
            };
            if let Err(n) = self.side.notify(idx, n) {
                self.notes_waiting.push_front(n);
                break;
            }
        }
    }

    fn remove(&mut self, cause: ConnFault) {
        if let Some(idx) = self.idx.take() {
            let gone = self.side.remove(idx, &cause, &mut self.parts.cx());
            assert_eq!(gone.id, self.conn);
            self.failed = Some(cause);
        }
    }

    /// One shard pass: retries, the poll, the broken connections, the
    /// timeout check, the ledger.
    fn pass(&mut self, now: Instant) {
        self.retry(now);
        self.side.poll(&mut self.parts.cx());
        self.side.ring_due();
        for (at, reason) in self.parts.take_failed() {
            assert!(matches!(at, ConnRef::Local(i) if Some(i) == self.idx));
            self.remove(reason);
        }
        if let Some(idx) = self.idx {
            let c = self.side.check(idx, now, LIMIT, &mut None);
            if let Some(why) = c.why {
                self.remove(why);
            }
        }
        self.parts.take_done(&mut self.ledger.done);
        let live = self.idx.is_some();
        self.ledger.publish(|_| live);
    }
}

/// One op of a run and what became of it.
struct Op {
    t: Transfer,
    from: usize,
    kind: OpKind,
    off: usize,
    data: Vec<u8>,
    ended: Option<Result<()>>,
}

pub(crate) struct LocalPair {
    ends: [End; 2],
    ops: Vec<Op>,
    /// Notifications sent by each side, and those the other received.
    sent: [Vec<Vec<u8>>; 2],
    got: [Vec<Vec<u8>>; 2],
    start: Instant,
    step: u32,
    faults: Faults,
}

impl LocalPair {
    pub fn new(faults: Faults) -> LocalPair {
        let (a_rx, to_a) = ShmRing::memfd_pair(RING_SLOTS).unwrap();
        let (b_rx, to_b) = ShmRing::memfd_pair(RING_SLOTS).unwrap();
        let pid = std::process::id();
        let conn =
            |id, peer, rx, tx| LocalConn::new(ConnId(id), peer, pid, 9, rx, tx, MAX_REQS, MAX_REQS);
        LocalPair {
            ends: [
                End::new(conn(1, 2, a_rx, to_b)),
                End::new(conn(2, 1, b_rx, to_a)),
            ],
            ops: Vec::new(),
            sent: Default::default(),
            got: Default::default(),
            start: Instant::now(),
            step: 0,
            faults,
        }
    }

    fn now(&self) -> Instant {
        self.start + STEP * self.step
    }

    /// Starts op `n` (its own window at `n * STRIDE` on both sides) from
    /// side `from`: the source side's bytes are `data` first.
    pub fn op(&mut self, from: usize, kind: OpKind, n: usize, data: Vec<u8>) {
        let off = n * STRIDE;
        let (src, dst) = match kind {
            OpKind::Write => (from, 1 - from),
            OpKind::Read => (1 - from, from),
        };
        write_into(&self.ends[src].mem, off, &data);
        let _ = dst;
        let me = &self.ends[from];
        let t = me.table.claim().expect("a free slot");
        let op = OpCmd {
            conn: me.conn,
            kind,
            slot: t.slot(),
            parts: OpParts::One(OpDesc {
                local: RegionSlice::new(&me.mem, off, data.len()).unwrap(),
                remote_addr: self.ends[1 - from].mem.addr() + off as u64,
                rkey: KEY.rkey,
                tag: KEY.tag,
                remote_device: false,
                dtype: None,
                nic_rkeys: None,
            }),
            at: Default::default(),
            total: None,
        };
        let now = self.now();
        self.ends[from].start(op, now);
        self.ops.push(Op {
            t,
            from,
            kind,
            off,
            data,
            ended: None,
        });
    }

    pub fn notify(&mut self, from: usize, payload: Vec<u8>) {
        self.sent[from].push(payload.clone());
        // As `send_notification` sends it: after the application's kind byte.
        let mut wire = vec![crate::wire::NOTE_APP];
        wire.extend_from_slice(&payload);
        self.ends[from].notes_waiting.push_back(wire);
        let now = self.now();
        self.ends[from].retry(now);
    }

    fn polls(&self, side: usize) -> bool {
        if self.faults.silent_peer == Some(1 - side) {
            return false;
        }
        !matches!(self.faults.stop, Some((s, from, n)) if s == side && (from..from + n).contains(&self.step))
    }

    fn inject(&mut self) {
        let step = self.step;
        if let Some((side, at)) = self.faults.garbage {
            if at == step {
                let mut m = Msg::new(MsgKind::WriteAck);
                m.conn = 9;
                m.op_id = 0xdead_beef;
                let peer = &mut self.ends[1 - side];
                if let Some(i) = peer.idx {
                    peer.side.conns[i].send_raw(&m, &[]);
                }
            }
        }
        if let Some((side, at)) = self.faults.peer_gone {
            if at == step {
                let me = &mut self.ends[side];
                if let Some(i) = me.idx {
                    me.side.conns[i].peer_pid = 0;
                }
            }
        }
    }

    /// One step of virtual time: both sides pass (unless stopped), the
    /// applications drain their inboxes, ended ops are reaped.
    fn step(&mut self) {
        self.inject();
        let now = self.now();
        for side in 0..2 {
            if self.polls(side) {
                self.ends[side].pass(now);
            }
            let e = &self.ends[side];
            let mut n = 0;
            while self.faults.drain_per_step == 0 || n < self.faults.drain_per_step {
                let Ok((conn, payload)) = e.notes.try_recv() else {
                    break;
                };
                assert_eq!(conn, e.conn);
                self.got[side].push(payload);
                n += 1;
            }
        }
        for op in &mut self.ops {
            if op.ended.is_none() {
                op.ended = op.t.poll();
            }
        }
        self.step += 1;
    }

    /// Whether side `side` runs at all (a silent peer's side does not:
    /// its ops are not this run's to finish).
    fn runs(&self, side: usize) -> bool {
        self.faults.silent_peer != Some(1 - side)
    }

    fn settled(&self) -> bool {
        self.ops
            .iter()
            .all(|o| o.ended.is_some() || !self.runs(o.from))
            && (0..2).all(|s| !self.runs(s) || self.ends[s].waiting.is_empty())
            && self
                .ends
                .iter()
                .all(|e| e.notes_waiting.is_empty() || e.failed.is_some())
            && (0..2).all(|s| {
                self.got[1 - s].len() == self.sent[s].len()
                    || self.ends[s].failed.is_some()
                    || self.ends[1 - s].failed.is_some()
            })
    }

    /// Steps until every op ended and every notification arrived (or its
    /// connection died); checks the outcome. Returns (ops that succeeded,
    /// ops that failed).
    pub fn run(&mut self) -> (usize, usize) {
        while !self.settled() {
            assert!(
                self.step < MAX_STEPS,
                "stuck at step {}: {}",
                self.step,
                self.stuck()
            );
            self.step();
        }
        // A few more passes: nothing may end twice or appear late.
        for _ in 0..8 {
            self.step();
        }
        self.check()
    }

    fn stuck(&self) -> String {
        let open: Vec<usize> = (0..self.ops.len())
            .filter(|&i| self.ops[i].ended.is_none())
            .collect();
        format!(
            "ops in flight {open:?}; waiting {}/{}; notes {}/{} of {}/{}; failed {:?} {:?}",
            self.ends[0].waiting.len(),
            self.ends[1].waiting.len(),
            self.got[1].len(),
            self.got[0].len(),
            self.sent[0].len(),
            self.sent[1].len(),
            self.ends[0].failed,
            self.ends[1].failed,
        )
    }

    fn check(&self) -> (usize, usize) {
        let (mut ok, mut failed) = (0, 0);
        for (i, op) in self.ops.iter().enumerate() {
            if !self.runs(op.from) {
                continue;
            }
            let dst = match op.kind {
                OpKind::Write => 1 - op.from,
                OpKind::Read => op.from,
            };
            let mem = &self.ends[dst].mem;
            match op.ended.as_ref().expect("ended") {
                Ok(()) => {
                    ok += 1;
                    assert!(
                        bytes_of(mem, op.off, op.data.len()) == op.data,
                        "op {i}: bytes differ"
                    );
                }
                Err(_) => failed += 1,
            }
            // Nothing past the window, whatever became of the op.
            let guard = op.off + op.data.len();
            assert!(
                bytes_of(mem, guard, STRIDE - op.data.len())
                    .iter()
                    .all(|&b| b == 0),
                "op {i} wrote past its window"
            );
        }
        for s in 0..2 {
            let (sent, got) = (&self.sent[s], &self.got[1 - s]);
            assert!(
                got.len() <= sent.len() && got[..] == sent[..got.len()],
                "side {s}'s notifications: lost, repeated or reordered"
            );
            if self.runs(s) {
                assert_eq!(self.ends[s].table.in_use(), 0, "side {s} has slots in use");
            }
        }
        (ok, failed)
    }
}

/// A seeded workload: `OPS` ops, both ways, sizes across the paths
/// (inline, ring-copied, CMA), notifications both ways, with `faults`.
pub(crate) fn random_run(seed: u64, faults: Faults) -> (LocalPair, (usize, usize)) {
    let mut rng = Rng(seed | 1);
    let mut p = LocalPair::new(faults);
    let sizes = [
        1,
        100,
        MAX_INLINE,
        MAX_INLINE + 1,
        4096,
        65_536,
        200_001,
        MAX_OP,
    ];
    for n in 0..OPS {
        let from = rng.below(2) as usize;
        let kind = if rng.below(2) == 0 {
            OpKind::Write
        } else {
            OpKind::Read
        };
        let len = sizes[rng.below(sizes.len() as u64) as usize];
        let data = rng.bytes(len);
        p.op(from, kind, n, data);
        if rng.below(3) == 0 {
            let len = 1 + rng.below(3000) as usize;
            p.notify(rng.below(2) as usize, rng.bytes(len));
        }
        for _ in 0..rng.below(3) {
            p.step();
        }
    }
    let r = p.run();
    (p, r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_both_ways_are_exact_and_end_once() {
        for seed in 1..=12 {
            let (p, (ok, failed)) = random_run(seed, Faults::default());
            assert_eq!((ok, failed), (OPS, 0), "seed {seed}");
            assert!(p.ends.iter().all(|e| e.failed.is_none()));
        }
    }

    #[test]
    fn a_side_that_stops_polling_is_back_pressure_not_loss() {
        for seed in 1..=8 {
            let faults = Faults {
                stop: Some(((seed % 2) as usize, 2, 150)),
                drain_per_step: 1,
                ..Faults::default()
            };
            let (p, (ok, failed)) = random_run(seed, faults);
            assert_eq!((ok, failed), (OPS, 0), "seed {seed}");
            assert_eq!(
                p.got[0].len() + p.got[1].len(),
                p.sent[0].len() + p.sent[1].len()
            );
            assert!(
                p.ends.iter().any(|e| e.handed_back > 0),
                "seed {seed}: no ring filled"
            );
        }
    }

    #[test]
    fn a_hostile_message_fails_the_connection_and_every_op_ends_once() {
        for seed in 1..=8 {
            let side = (seed % 2) as usize;
            let faults = Faults {
                garbage: Some((side, 5)),
                ..Faults::default()
            };
            let (p, (_ok, failed)) = random_run(seed, faults);
            let why = p.ends[side].failed.clone().expect("the connection failed");
            assert!(
                matches!(&why, ConnFault::PeerMisbehaved { what } if what.contains("not outstanding")),
                "{why}"
            );
            assert!(failed > 0, "seed {seed}: ops after the failure fail");
        }
    }

    #[test]
    fn a_gone_peer_process_fails_the_ops_with_the_reason() {
        for seed in 1..=6 {
            let side = (seed % 2) as usize;
            let faults = Faults {
                peer_gone: Some((side, 4)),
                ..Faults::default()
            };
            let (p, (_ok, failed)) = random_run(seed, faults);
            let why = p.ends[side].failed.clone().expect("the connection failed");
            assert_eq!(why, ConnFault::process_died());
            assert!(failed > 0);
        }
    }

    #[test]
    fn a_peer_that_never_answers_times_out() {
        for seed in 1..=6 {
            let side = (seed % 2) as usize;
            let faults = Faults {
                silent_peer: Some(side),
                ..Faults::default()
            };
            let (p, (ok, failed)) = random_run(seed, faults);
            let why = p.ends[side].failed.clone().expect("the connection failed");
            assert!(matches!(why, ConnFault::Timeout { .. }), "{why}");
            let mine = p.ops.iter().filter(|o| o.from == side).count();
            assert!(
                failed > 0 && ok + failed == mine,
                "seed {seed}: {ok} + {failed} of {mine}"
            );
        }
    }
}

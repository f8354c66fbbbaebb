//! The op ledger: a shard's record of the operations it runs. Each op has a
//! slot (its index in the endpoint's completion table), a count of pieces
//! still out (frames, ring messages, copies, RDMA completions), the first
//! error any piece saw, and the connection it counts against. When the last
//! piece ends, the ledger publishes the op's one outcome to the table.
//!
//! Transports report piece completions into `done` (through their `Sink`);
//! `publish` applies them once per pass. Pieces that will never be sent (a
//! dead connection, a refused op) are written off in one call, `fail_rest`,
//! with one error, instead of one error per piece.

use std::sync::Arc;
use std::time::Instant;

use super::completion::CompletionTable;
use crate::error::{ConnId, Error, Result};
use crate::metrics::{OpClock, ShardMetrics, Via};
use crate::sys::IntMap;

/// What the metrics count of an op: its kind (`metrics::op_idx`), path,
/// bytes and when its shard took it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Counted {
    pub bytes: u64,
    pub start: Instant,
    pub op: u8,
    pub via: Via,
}

#[derive(Default)]
struct LedgerOp {
    remaining: u32,
    error: Option<Error>,
    /// The connection the op counts against (its in-flight limit).
    conn: Option<ConnId>,
    /// The op itself, for transports whose hardware reads and writes its
    /// local memory after posting (RDMA): its regions (and their NIC
    /// registrations) stay alive until the op ends, and are let go before
    /// the outcome is published, so a deregistration that follows it
    /// finds them free.
    hold: Option<super::queue::OpCmd>,
    /// For the metrics (None: failed before it reached a connection).
    counted: Option<Counted>,
    /// Reported stalled already.
    stalled: bool,
}

pub(crate) struct OpLedger {
    ops: Box<[LedgerOp]>,
    /// Piece completions reported since the last `publish`.
    pub done: Vec<(u32, Result<()>)>,
    /// Operations in flight per connection.
    conn_ops: IntMap<ConnId, usize>,
    max_conn_ops: usize,
    table: Arc<CompletionTable>,
    /// Notifications of ops that ended well, for the shard to send.
    pub notes: Vec<super::completion::Note>,
    pub metrics: Arc<ShardMetrics>,
    /// Ops opened (with a count) and not yet ended.
    in_flight: usize,
    /// Reads the time an op ended (cheaply: see `metrics/clock.rs`).
    pub clock: OpClock,
}

impl OpLedger {
    /// The completion table the ledger publishes to (for a note that
    /// rides in its op's request: `CompletionTable::take_note`).
    pub fn table(&self) -> &CompletionTable {
        &self.table
    }

    pub fn new(
        table: Arc<CompletionTable>,
        max_conn_ops: usize,
        metrics: Arc<ShardMetrics>,
    ) -> Self {
        Self {
            metrics,
            in_flight: 0,
            clock: OpClock::default(),
            ops: (0..table.capacity()).map(|_| LedgerOp::default()).collect(),
            done: Vec::with_capacity(table.capacity()),
            conn_ops: Default::default(),
            max_conn_ops,
            notes: Vec::new(),
            table,
        }
    }

    /// Opens op `slot` with `pieces` pieces, counted against `conn` when
    /// given. Fails (opening nothing) when `conn` is at its in-flight limit.
    pub fn open(
        &mut self,
        slot: u32,
        pieces: u32,
        conn: Option<ConnId>,
        counted: Counted,
    ) -> Result<()> {
        if let Some(c) = conn {
            let n = self.conn_ops.entry(c).or_insert(0);
            if *n >= self.max_conn_ops {
                return Err(Error::LimitReached {
                    limit: "FERRY_MAX_CONN_INFLIGHT_OPS",
                    max: self.max_conn_ops,
                });
            }
            *n += 1;
        }
        self.metrics.bytes[counted.op as usize][counted.via as usize].add(counted.bytes);
        self.in_flight += 1;
        // Field by field: the slot's last op left `hold` and `error` empty
        // (`publish` took them), so neither is built, moved nor dropped on
        // this path (the record is 248 bytes, half of it the held op).
        let op = &mut self.ops[slot as usize];
        debug_assert!(op.hold.is_none() && op.counted.is_none());
        op.remaining = pieces;
        op.error = None;
        op.conn = conn;
        op.counted = Some(counted);
        op.stalled = false;
        Ok(())
    }

    /// Keeps `op` (its local memory) alive until op `op.slot` ends.
    pub fn hold(&mut self, op: super::queue::OpCmd) {
        let slot = op.slot as usize;
        self.ops[slot].hold = Some(op);
    }

    /// Ends op `slot` at once with `err` (it was never opened, or none of
    /// its pieces went out).
    pub fn fail(&mut self, slot: u32, err: Error) {
        self.ops[slot as usize] = LedgerOp {
            remaining: 1,
            ..LedgerOp::default()
        };
        self.done.push((slot, Err(err)));
    }

    /// Writes off `pieces` pieces of op `slot` that will never be sent,
    /// with one error; the op ends when its sent pieces have.
    pub fn fail_rest(&mut self, slot: u32, pieces: u32, err: Error) {
        if pieces == 0 {
            return;
        }
        let op = &mut self.ops[slot as usize];
        debug_assert!(op.remaining >= pieces);
        // All but one written off here; the last goes through `done`, so
        // the op completes in `publish` like any other.
        op.remaining -= pieces - 1;
        self.done.push((slot, Err(err)));
    }

    /// Forgets the count of a connection that died with nothing in flight.
    pub fn forget_conn_if_idle(&mut self, conn: ConnId) {
        if self.conn_ops.get(&conn) == Some(&0) {
            self.conn_ops.remove(&conn);
        }
    }

    /// Applies the completions reported since the last call and publishes
    /// each op that ended. `live` says whether a connection still exists
    /// (a dead one's count is dropped with its last op). Returns how many
    /// completions it applied.
    pub fn publish(&mut self, live: impl Fn(ConnId) -> bool) -> usize {
        let n = self.done.len();
        // One clock read per publish that ends a counted op.
        let mut now = None;
        for (slot, result) in self.done.drain(..) {
            let op = &mut self.ops[slot as usize];
            if let Err(e) = result {
                op.error.get_or_insert(e);
            }
            op.remaining -= 1;
            if op.remaining == 0 {
                drop(op.hold.take());
                if let Some(c) = op.conn.take() {
                    if let Some(k) = self.conn_ops.get_mut(&c) {
                        *k = k.saturating_sub(1);
                        if *k == 0 && !live(c) {
                            self.conn_ops.remove(&c);
                        }
                    }
                }
                let result = op.error.take().map_or(Ok(()), Err);
                let counted = op.counted.take();
                let unlabelled = match counted {
                    None => result.as_ref().err().map(|e| e.kind()),
                    Some(_) => None,
                };
                self.in_flight -= counted.is_some() as usize;
                let ending = self.table.complete_noting(slot, result);
                if let Some(failed) = ending.ended {
                    match counted {
                        Some(c) => {
                            let clock = &self.clock;
                            let now = *now.get_or_insert_with(|| clock.now());
                            let took = now.saturating_duration_since(c.start);
                            self.metrics.op_ended(c.op as usize, c.via, failed, took);
                        }
                        None => {
                            if let Some(k) = failed.or(unlabelled) {
                                self.metrics.failures[crate::metrics::failure_idx(k)].add(1);
                            }
                        }
                    }
                }
                if let Some(note) = ending.note {
                    self.notes.push(*note);
                }
            }
        }
        n
    }

    /// Looks at the ops in flight at `now`: sets the shard's in-flight
    /// and oldest-age gauges, and reports (`report`: connection, op, age)
    /// and counts each op past `stall` once. Walks the slots only while
    /// some op is in flight, and stops at the last.
    pub fn scan(
        &mut self,
        now: Instant,
        stall: std::time::Duration,
        mut report: impl FnMut(Option<ConnId>, &Counted, std::time::Duration),
    ) {
        let mut left = self.in_flight;
        let mut oldest = std::time::Duration::ZERO;
        for op in self.ops.iter_mut() {
            if left == 0 {
                break;
            }
            let Some(c) = op.counted.as_ref().filter(|_| op.remaining > 0) else {
                continue;
            };
            left -= 1;
            let age = now.saturating_duration_since(c.start);
            oldest = oldest.max(age);
            if age >= stall && !op.stalled {
                op.stalled = true;
                self.metrics.stalls.add(1);
                report(op.conn, c, age);
            }
        }
        self.metrics.in_flight.set(self.in_flight as u64);
        self.metrics.oldest_us.set(oldest.as_micros() as u64);
    }

    #[cfg(test)]
    fn conn_count(&self, c: ConnId) -> Option<usize> {
        self.conn_ops.get(&c).copied()
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_held_op_keeps_its_memory_until_its_last_piece_ends() {
        use crate::reactor::queue::{OpCmd, OpDesc, OpParts};
        let (table, mut l) = ledger(4, 8);
        let mut buf = vec![0u8; 64];
        let region = crate::region::test_region(&mut buf);
        let t = table.claim().expect("a slot");
        let slot = t.slot();
        l.open(slot, 2, None, counted()).expect("open");
        let local = crate::region::RegionSlice::new(&region, 0, 64).expect("slice");
        l.hold(OpCmd {
            conn: ConnId(1),
            kind: crate::error::OpKind::Write,
            slot,
            parts: OpParts::One(OpDesc {
                local,
                remote_addr: 0,
                rkey: 1,
                tag: 0,
                remote_device: false,
                dtype: None,
                nic_rkeys: crate::wire::NicKeys::new(&[9]),
            }),
            at: Default::default(),
            total: Some(1),
        });
        assert_eq!(
            Arc::strong_count(&region),
            2,
            "the ledger holds the op's region"
        );
        l.done.push((slot, Ok(())));
        l.publish(|_| true);
        assert_eq!(Arc::strong_count(&region), 2, "one piece is still out");
        l.done.push((slot, Ok(())));
        l.publish(|_| true);
        assert_eq!(Arc::strong_count(&region), 1, "let go when the op ended");
        drop(t);
    }

    use super::*;

    fn counted() -> Counted {
        Counted {
            op: 0,
            via: Via::Tcp,
            bytes: 100,
            start: Instant::now(),
        }
    }

    fn ledger(slots: usize, per_conn: usize) -> (Arc<CompletionTable>, OpLedger) {
        let t = CompletionTable::new(slots);
        let l = OpLedger::new(t.clone(), per_conn, Default::default());
        (t, l)
    }

    #[test]
    fn an_op_ends_once_with_its_first_error() {
        let (t, mut l) = ledger(4, 8);
        let mut tr = t.claim().unwrap();
        let c = ConnId(3);
        l.open(tr.slot(), 3, Some(c), counted()).unwrap();
        l.done.push((tr.slot(), Ok(())));
        l.done.push((tr.slot(), Err(Error::Shutdown)));
        assert_eq!(l.publish(|_| true), 2);
        assert!(tr.poll().is_none(), "one piece still out");
        l.done.push((tr.slot(), Err(Error::EmptyVector)));
        l.publish(|_| true);
        assert!(matches!(tr.poll(), Some(Err(Error::Shutdown))));
        assert_eq!(l.conn_count(c), Some(0));
    }

    #[test]
    fn unsent_pieces_are_written_off_with_one_error() {
        let (t, mut l) = ledger(4, 8);
        let mut tr = t.claim().unwrap();
        l.open(tr.slot(), 10, None, counted()).unwrap();
        // 4 pieces went out and will complete; 6 never will.
        l.fail_rest(tr.slot(), 6, Error::Shutdown);
        assert_eq!(l.done.len(), 1, "one error, not six");
        for _ in 0..4 {
            l.done.push((tr.slot(), Ok(())));
        }
        l.publish(|_| true);
        assert!(matches!(tr.poll(), Some(Err(Error::Shutdown))));
    }

    #[test]
    fn the_per_connection_limit_refuses_and_frees() {
        let (t, mut l) = ledger(4, 1);
        let c = ConnId(9);
        let mut a = t.claim().unwrap();
        let b = t.claim().unwrap();
        l.open(a.slot(), 1, Some(c), counted()).unwrap();
        assert!(matches!(
            l.open(b.slot(), 1, Some(c), counted()),
            Err(Error::LimitReached { max: 1, .. })
        ));
        l.fail(b.slot(), Error::Shutdown);
        l.done.push((a.slot(), Ok(())));
        l.publish(|_| false);
        assert!(matches!(a.poll(), Some(Ok(()))));
        assert_eq!(l.conn_count(c), None, "a dead connection's count goes");
        drop(b);
    }

    #[test]
    fn an_op_counts_once_when_it_ends_and_a_stall_is_reported_once() {
        let (t, mut l) = ledger(4, 8);
        let mut tr = t.claim().unwrap();
        let mut c = counted();
        c.start -= std::time::Duration::from_secs(3);
        l.open(tr.slot(), 2, Some(ConnId(5)), c).unwrap();
        let mut seen = Vec::new();
        let stall = std::time::Duration::from_secs(2);
        l.scan(Instant::now(), stall, |conn, c, _| {
            seen.push((conn, c.bytes))
        });
        l.scan(Instant::now(), stall, |conn, c, _| {
            seen.push((conn, c.bytes))
        });
        assert_eq!(seen, vec![(Some(ConnId(5)), 100)], "reported once");
        assert_eq!(l.metrics.stalls.get(), 1);
        assert_eq!(l.metrics.in_flight.get(), 1);
        assert!(l.metrics.oldest_us.get() >= 3_000_000);
        l.done.push((tr.slot(), Ok(())));
        l.publish(|_| true);
        assert_eq!(l.metrics.ops[0][0][0].get(), 0, "one piece still out");
        l.done.push((tr.slot(), Err(Error::Shutdown)));
        l.publish(|_| true);
        assert!(matches!(tr.poll(), Some(Err(Error::Shutdown))));
        let m = l.metrics.clone();
        assert_eq!((m.ops[0][0][0].get(), m.ops[0][0][1].get()), (0, 1));
        assert_eq!(m.bytes[0][0].get(), 100);
        assert_eq!(
            m.failures[crate::metrics::failure_idx(Error::Shutdown.kind())].get(),
            1
        );
        let observed: u64 = m.duration[0].buckets.iter().map(|b| b.get()).sum();
        assert_eq!(observed, 1);
        l.scan(Instant::now(), stall, |_, _, _| panic!("nothing in flight"));
        assert_eq!((m.in_flight.get(), m.oldest_us.get()), (0, 0));
    }

    #[test]
    fn an_op_split_over_two_ledgers_counts_once_with_all_its_bytes() {
        let t = CompletionTable::new(4);
        let mut a = OpLedger::new(t.clone(), 8, Default::default());
        let mut b = OpLedger::new(t.clone(), 8, Default::default());
        let mut tr = t.claim().unwrap();
        t.set_parts(tr.slot(), 2);
        a.open(tr.slot(), 1, None, counted()).unwrap();
        b.open(tr.slot(), 1, None, counted()).unwrap();
        a.done.push((tr.slot(), Ok(())));
        a.publish(|_| true);
        b.done.push((tr.slot(), Ok(())));
        b.publish(|_| true);
        assert!(matches!(tr.poll(), Some(Ok(()))));
        let ops = |l: &OpLedger| l.metrics.ops[0][0][0].get();
        assert_eq!(ops(&a) + ops(&b), 1, "one op");
        let bytes = |l: &OpLedger| l.metrics.bytes[0][0].get();
        assert_eq!(bytes(&a) + bytes(&b), 200, "each part's bytes");
    }
}

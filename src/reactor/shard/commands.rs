//! A shard's commands: drained from its bounded queue (or applied at once
//! in embedded mode), parked when their connection's share is full and
//! retried, and applied — ops routed to their transport, connections
//! added and removed, regions and notifications.

use std::sync::Arc;
use std::time::Instant;

use tracing::{debug, warn};

use super::{route, Shard, COMMANDS_PER_POLL};
use crate::error::{ConnFault, ConnId, Error};
use crate::reactor::backlog::Backlog;
use crate::reactor::ledger::Counted;
use crate::reactor::queue::{Command, OpCmd, ShardHandle};
use crate::reactor::source::{ConnRef, SubmitCx};

impl Shard {
    pub(super) fn drain_commands(&mut self) -> usize {
        let mut n = self.retry_parked();
        // Parked commands came out of the bounded queue. One connection
        // parks at most the queue's depth (more are refused at once, so a
        // connection whose peer stops reading cannot fill the shard); all
        // together at most PARKED_PER_DEPTH times it, past which the queue
        // stays full: back-pressure reaches the submitters.
        while n < COMMANDS_PER_POLL && !self.parked.full() {
            match self.wake.cmds.pop(&mut self.cmds) {
                Some(mut cmd) => {
                    crate::stage_trace::mark(crate::stage_trace::Stage::CmdTaken);
                    cmd.adopt();
                    n += cmd.weight();
                    self.take(cmd);
                }
                None => break,
            }
        }
        self.regions
            .commands_taken(self.wake.cmds.taken(&self.cmds));
        n
    }

    /// Embedded mode: a command from the thread that drives this shard,
    /// applied now — no queue push, no wake, no wait for the next pass's
    /// drain (on the 2-core machine the hand-off through the queue was
    /// ~50 ns of a ~600 ns same-host round trip). While commands are still
    /// queued it goes behind them instead, so one thread's ops keep their
    /// order however it submitted them; a full queue hands it back.
    #[allow(clippy::result_large_err)]
    pub(crate) fn submit_here(&mut self, mut cmd: Command) -> Result<(), (Error, Command)> {
        if self.wake.cmds.pending(&self.cmds) {
            self.wake.push(self.id, cmd)?;
            return Ok(());
        }
        // A pass's clock may be old: the op's deadline starts now.
        self.pass_now = None;
        cmd.adopt();
        let conn = cmd.waits_on();
        self.take(cmd);
        // What it pushed to a peer that sleeps rings now, not at the end
        // of the next pass; only its own connection can have become due.
        if let Some(ConnRef::Local(i)) = conn.and_then(|c| self.dir.get(c)) {
            self.local.ring_one(i);
        }
        Ok(())
    }

    /// Whether `h` is this shard's handle (and so of this endpoint).
    pub(crate) fn is(&self, h: &ShardHandle) -> bool {
        Arc::ptr_eq(&self.wake, &h.wake)
    }

    /// A command from the queue: an op refused when its connection has its
    /// share parked, anything parked behind that connection's waiting ones,
    /// else applied (and parked if it finds no room). A batch overshoots
    /// the backlog's total by less than `MAX_BATCH`: the bound still holds.
    ///
    /// Only ops are refused at the share: an op's caller sees
    /// `Backlogged`, while a notification has no outcome to report and
    /// waits in line past the share. That stays bounded: the application's
    /// are refused at the call past `FERRY_NOTIFY_OUTBOX`, an op's own by
    /// the ops in flight, the two-sided protocol's by its posted messages.
    /// A peer that never reads fails the connection at the op timeout
    /// (`check_timeouts`).
    pub(super) fn take(&mut self, cmd: Command) {
        match (cmd.waits_on(), cmd) {
            (Some(c), Command::Op(op)) if self.parked.at_share(c) => self.refuse_backlogged(c, op),
            (Some(c), cmd) if self.parked.has(c) => {
                self.ledger.metrics.parked.add(1);
                self.parked.push(c, cmd)
            }
            (_, cmd) => {
                if let Some(back) = self.apply(cmd) {
                    let c = back.waits_on().expect("only waiting commands come back");
                    self.ledger.metrics.parked.add(1);
                    self.parked.push(c, back);
                }
            }
        }
    }

    /// An op for a connection that already has its share parked: it fails
    /// at once, naming the connection and its count.
    pub(super) fn refuse_backlogged(&mut self, conn: ConnId, op: OpCmd) {
        let waiting = self.parked.len_of(conn);
        self.ledger
            .fail(op.slot, Error::Backlogged { conn, waiting })
    }

    /// Applies parked commands, each connection's in order, until one
    /// finds no room again. Returns how many went through.
    pub(super) fn retry_parked(&mut self) -> usize {
        if self.parked.is_empty() {
            return 0;
        }
        let mut parked = std::mem::replace(&mut self.parked, Backlog::new(0, 0));
        let n = parked.retry(|cmd| self.apply(cmd));
        self.parked = parked;
        n
    }

    /// Applies one command; hands it back if it cannot proceed yet.
    pub(super) fn apply(&mut self, cmd: Command) -> Option<Command> {
        match cmd {
            Command::Op(op) => self.apply_op(op).map(Command::Op),
            Command::Ops(mut ops) => {
                for op in ops.drain(..) {
                    self.take(Command::Op(op));
                }
                self.wake.bufs.give(ops);
                None
            }
            Command::Ipc(cmd) => {
                self.apply_ipc(cmd);
                None
            }
            Command::CopySlice(s) => {
                s.run();
                None
            }
            Command::AddConn {
                conn,
                group,
                activity,
                streams,
                limits,
                verbs,
                macs,
            } => {
                match self
                    .tcp
                    .add(conn, group, activity, streams, limits, verbs, macs)
                {
                    Ok(idx) => {
                        self.dir.insert(conn, ConnRef::Tcp(idx));
                        self.arm_new(ConnRef::Tcp(idx), conn);
                        debug!(shard = self.id, %conn, "connection adopted");
                    }
                    Err(e) => {
                        warn!(shard = self.id, %conn, "could not adopt connection: {e}");
                        self.remember_failed(conn, group, e.as_fault());
                    }
                }
                None
            }
            Command::AddLocal(lc) => {
                let conn = lc.id;
                let idx = self.local.add(*lc);
                self.dir.insert(conn, ConnRef::Local(idx));
                self.arm_new(ConnRef::Local(idx), conn);
                debug!(shard = self.id, %conn, "same-host connection adopted");
                None
            }
            Command::RemoveConn(conn, ack, why) => {
                if let Some(at) = self.dir.get(conn) {
                    self.drop_at(at, ConnFault::Closed { why });
                }
                self.dir.forget_failed(conn);
                if let Some(ack) = ack {
                    let _ = ack.try_send(());
                }
                None
            }
            Command::Notify {
                conn,
                payload,
                ticket,
            } => {
                let Some(at) = self.dir.get(conn) else {
                    warn!(shard = self.id, %conn, "notification for a connection that is gone: dropped");
                    return None;
                };
                let (t, idx) = route(&mut self.tcp, &mut self.local, at);
                t.notify(idx, payload).err().map(|payload| Command::Notify {
                    conn,
                    payload,
                    ticket,
                })
            }
        }
    }

    /// Counts a new op in the ledger with the pieces its transport makes
    /// of it, then hands it to that transport; an op that found no room
    /// comes back (and is parked).
    pub(super) fn apply_op(&mut self, mut op: OpCmd) -> Option<OpCmd> {
        let Some(at) = self.dir.get(op.conn) else {
            // Unknown, or its connection died while the op waited for room.
            let err = self.dir.error_of(op.conn);
            match op.total {
                None => self.ledger.fail(op.slot, err),
                Some(total) => self.ledger.fail_rest(op.slot, total - op.at.emitted, err),
            }
            return None;
        };
        let (t, idx) = route(&mut self.tcp, &mut self.local, at);
        let now = *self.pass_now.get_or_insert_with(Instant::now);
        if op.total.is_none() {
            let (total, via) = t.pieces(idx, &op, self.cfg.chunk_bytes);
            let counted = Counted {
                op: crate::metrics::op_idx(op.kind),
                via,
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
            gpu: self.gpu.as_mut(),
            chunk: self.cfg.chunk_bytes,
            now,
        };
        t.submit(idx, op, &mut cx)
    }
}

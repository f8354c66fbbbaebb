//! A tcp shard's submission side: ops dealt onto streams as frames (or
//! posted to RDMA queue pairs), codec jobs that ended handed back to their
//! streams, and the Carrier face the shard submits through.

use std::time::{Duration, Instant};

use super::TcpSide;
use crate::error::{ConnFault, ConnId, Error, OpKind};
use crate::reactor::gpu;
use crate::reactor::ledger::OpLedger;
use crate::reactor::plan::{self, Route};
use crate::reactor::queue::OpCmd;
use crate::reactor::source::{Carrier, ConnCheck, ConnRef, Cx, Removed, ShardSink, SubmitCx};
use crate::region::RegionSlice;
use crate::tcp::conn::{Dealt, DeviceFrame, DeviceStep};
use crate::xfer::Bounce;

impl TcpSide {
    /// Hands each codec job that ended to its stream: a packed frame goes,
    /// a decoded WRITE is acknowledged, a decoded READ completes. A peer's
    /// frame that did not decode fails its connection. A job whose
    /// connection is gone still settles what it owes (a READ's op, the
    /// endpoint's count of held bytes).
    pub(super) fn apply_codec_done(&mut self, cx: &mut Cx<'_>) -> usize {
        let mut n = 0;
        while let Some(d) = self.codec.as_mut().and_then(|c| c.next_done()) {
            n += 1;
            let Some(conn) = self.conns.get_mut(d.idx).filter(|c| c.id == d.conn) else {
                if let Some(c) = self.codec.as_mut() {
                    c.orphan(d, cx.done);
                }
                continue;
            };
            let (slot, read) = (d.ticket.slot, d.ticket.gate == 0);
            let group = conn.group;
            let mut sink = ShardSink::tcp(cx, group);
            let r = match conn.streams.get_mut(d.ticket.stream as usize) {
                Some(s) => s.codec_done(d.ticket, d.outcome, &mut sink),
                None => Ok(()),
            };
            if let Err(reason) = r {
                if read {
                    let e = Error::ConnFailed {
                        conn: group,
                        cause: reason.clone(),
                    };
                    cx.done.push((slot, Err(e)));
                }
                cx.to_fail.push((ConnRef::Tcp(d.idx), reason));
            }
            self.mark(d.idx);
        }
        n
    }

    /// Whether `op` goes over connection `idx`'s RDMA queue pairs: it has
    /// them, every window carries the peer NIC's key, every local region is
    /// registered with the NIC (a refusal, remembered on the region, means
    /// tcp), and its work requests fit the send queues at all (else it
    /// would wait forever: it goes over the tcp streams). It then completes
    /// once.
    fn via_verbs(&self, idx: usize, op: &OpCmd) -> bool {
        let Some(link) = self.conns.get(idx).and_then(|c| c.verbs.as_ref()) else {
            return false;
        };
        let descs = op.parts.as_slice();
        descs.iter().all(|d| {
            d.nic_rkeys.is_some_and(|k| link.takes(&k)) && link.lkeys(d.local.region()).is_ok()
        }) && link.fits(
            descs
                .iter()
                .map(|d| link.pieces(d.local.len() as u64))
                .sum(),
        )
    }

    /// Posts a whole op on the connection's RDMA queue pairs, or none of it
    /// (hands it back) while their send queues lack room: an op completes
    /// once, when the last of its completions arrives.
    fn post_verbs(&mut self, idx: usize, op: OpCmd, ledger: &mut OpLedger) -> Option<OpCmd> {
        // Its completion queue is polled on the connection's visits.
        self.mark(idx);
        let link = self.conns[idx]
            .verbs
            .as_mut()
            .expect("checked by via_verbs");
        let descs = op.parts.as_slice();
        let pieces: usize = descs
            .iter()
            .map(|d| link.pieces(d.local.len() as u64))
            .sum();
        if !link.has_room(pieces) {
            return Some(op);
        }
        for d in descs {
            match link.lkeys(d.local.region()) {
                Ok(lkeys) => link.add(
                    lkeys,
                    &d.local,
                    d.nic_rkeys.expect("checked by via_verbs"),
                    d.remote_addr,
                ),
                Err(e) => {
                    // Nothing of this op has been posted yet: drop the
                    // gathered parts by posting none.
                    link.discard();
                    link.fail_slot(op.slot, e, &mut ledger.done);
                    return None;
                }
            }
        }
        match link.post(op.kind == OpKind::Write, op.slot) {
            // The NIC reads (WRITE) or writes (READ) the op's local memory
            // until its completions arrive: the ledger keeps the op's
            // regions, and their MRs, alive until then.
            Ok(_) => ledger.hold(op),
            Err(e) => link.fail_slot(op.slot, e, &mut ledger.done),
        }
        None
    }

    /// Deals `op`'s frames over connection `idx`'s streams (`tcp::conn`),
    /// until one is full (the op comes back, its progress kept). GPU memory
    /// goes through a pinned bounce buffer: a WRITE chunk is sent once
    /// copied out (later chunks copy while earlier ones are on the wire); a
    /// READ lands in the bounce buffer and is copied on before the op
    /// completes.
    fn deal_frames(&mut self, idx: usize, mut op: OpCmd, cx: &mut SubmitCx<'_>) -> Option<OpCmd> {
        let total = op.total.expect("an op is counted before it is queued");
        // Frames queued now go out on the next visit.
        self.mark(idx);
        let conn = &mut self.conns[idx];
        let (kind, slot, conn_id, now) = (op.kind, op.slot, op.conn, cx.now);
        let gpu = &mut cx.gpu;
        let device = |s: &mut crate::tcp::proto::StreamProto, f: DeviceFrame| {
            let n = f.local.len();
            let Some(g) = gpu.as_mut() else {
                return DeviceStep::Failed;
            };
            let bounce = match g.bounce(n) {
                Bounce::Ready(b) => b,
                Bounce::Busy => return DeviceStep::Busy,
                Bounce::Never => return DeviceStep::Failed,
            };
            match kind {
                OpKind::Write => {
                    let send = gpu::TcpSend {
                        conn: conn_id,
                        stream: f.stream,
                        slot,
                        op_id: f.op_id,
                        key: f.key,
                        addr: f.addr,
                        len: n,
                        dtype: f.dtype,
                    };
                    g.stage_send(send, f.local, bounce);
                }
                OpKind::Read => {
                    let into = RegionSlice::new(&bounce, 0, n).expect("bounce fits a chunk");
                    s.push_request(OpKind::Read, slot, f.op_id, f.key, f.addr, into, now);
                    s.stage_last_read(f.local);
                }
            }
            DeviceStep::Queued
        };
        let dealt = crate::tcp::conn::deal(
            &mut conn.streams,
            &mut conn.next,
            (kind, slot),
            op.parts.as_slice(),
            &mut op.at,
            (cx.chunk, now),
            device,
        );
        match dealt {
            Dealt::All => None,
            Dealt::Full => Some(op),
            Dealt::Failed => {
                let e = Error::Unsupported {
                    what: "GPU memory on a tcp connection",
                    reason: "no pinned bounce buffer could be allocated (see the log)".into(),
                };
                cx.ledger.fail_rest(op.slot, total - op.at.emitted, e);
                None
            }
        }
    }
}

impl Carrier for TcpSide {
    fn pieces(&self, idx: usize, op: &OpCmd, chunk: usize) -> (u32, crate::metrics::Via) {
        let (route, via) = if self.via_verbs(idx, op) {
            (Route::Verbs, crate::metrics::Via::Rdma)
        } else {
            (Route::Tcp, crate::metrics::Via::Tcp)
        };
        let lens = op.parts.as_slice().iter().map(|d| d.local.len());
        (plan::pieces(route, lens, chunk), via)
    }

    fn submit(&mut self, idx: usize, op: OpCmd, cx: &mut SubmitCx<'_>) -> Option<OpCmd> {
        if self.via_verbs(idx, &op) {
            self.post_verbs(idx, op, cx.ledger)
        } else {
            self.deal_frames(idx, op, cx)
        }
    }

    fn notify(&mut self, idx: usize, payload: Vec<u8>) -> std::result::Result<(), Vec<u8>> {
        self.mark(idx);
        let s = &mut self.conns[idx].streams[0];
        if !s.can_notify() {
            return Err(payload);
        }
        s.push_notify(payload);
        Ok(())
    }

    fn conn_id(&self, idx: usize) -> ConnId {
        self.conns[idx].id
    }

    fn has_pending(&self, idx: usize) -> bool {
        self.conns[idx].streams.iter().any(|s| s.has_pending())
    }

    fn check(
        &mut self,
        idx: usize,
        now: Instant,
        limit: Duration,
        _seen: &mut Option<(u32, bool)>,
    ) -> ConnCheck {
        let conn = &self.conns[idx];
        let oldest = crate::tcp::conn::oldest_pending(&conn.streams);
        let why = crate::tcp::conn::overdue(&conn.streams, now, limit);
        let busy = conn.streams.iter().any(|s| s.has_pending() || s.has_tx())
            || conn.verbs.as_ref().is_some_and(|v| v.busy());
        // A lane is idle only while the whole connection is.
        let last_active = conn
            .activity
            .as_ref()
            .map_or(conn.last_active, |a| a.last(conn.last_active));
        ConnCheck {
            why,
            busy,
            last_active,
            oldest,
        }
    }

    fn remove(&mut self, idx: usize, cause: &ConnFault, cx: &mut Cx<'_>) -> Removed {
        let mut conn = self.take(idx);
        let err = &Error::ConnFailed {
            conn: conn.group,
            cause: cause.clone(),
        };
        let mut sink = ShardSink::plain(cx, conn.group);
        for s in conn.streams.iter_mut() {
            s.fail_pending(err, &mut sink);
        }
        if let Some(v) = &mut conn.verbs {
            v.fail_all(err, sink.done);
        }
        Removed {
            id: conn.id,
            group: conn.group,
        }
    }
}

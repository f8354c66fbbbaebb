//! The shard's glue between sources: large same-host copies spread over
//! the sibling shards, CUDA copies for same-host requests and IPC ops,
//! tcp frames staged through pinned bounce buffers, and IPC revocations.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::Shard;
use crate::error::OpKind;
use crate::reactor::gpu::GpuWork;
use crate::reactor::queue::{Command, CopyJoin, CopySlice};
use crate::reactor::source::ConnRef;
use crate::region::RegionSlice;
use crate::wire::Status;

impl Shard {
    /// Cuts each large same-host copy of this pass into slices: the
    /// endpoint's copy threads take all but one (or, without them, the
    /// sibling shards through their queues); a slice that finds no room is
    /// copied here, as is the first, now.
    pub(super) fn start_host_copies(&mut self) {
        use std::sync::atomic::AtomicUsize;
        let pool = self.cfg.copy_pool.clone();
        let threads = pool.as_ref().and_then(|p| p.get().map(|_| p.share()));
        for req in self.host_copies.drain(..) {
            let len = req.ours.len();
            let count = match threads {
                Some(n) => crate::reactor::copy_pool::slices(len, n),
                None => self.siblings.len() + 1,
            };
            // Slices of whole 64 KiB blocks.
            let slice = len.div_ceil(count).next_multiple_of(64 << 10);
            let count = len.div_ceil(slice);
            let join = Arc::new(CopyJoin {
                left: AtomicUsize::new(count),
                ..Default::default()
            });
            let piece = |i: usize| {
                let off = i * slice;
                let ours = req.ours.sub(off, slice.min(len - off))?;
                CopySlice::new(ours, req.theirs.at(off), req.write, join.clone())
            };
            // The others' slices first, so they copy while we copy ours.
            for i in (1..count).chain(0..1) {
                let Some(s) = piece(i) else {
                    // Unreachable: the request's ranges were checked whole.
                    join.failed.store(true, Ordering::Relaxed);
                    join.left.fetch_sub(1, Ordering::Release);
                    continue;
                };
                if i == 0 {
                    s.run();
                } else if let Some(p) = pool.as_ref().and_then(|p| p.get()) {
                    if let Err(back) = p.try_submit(s) {
                        back.run();
                    }
                } else if let Err((_, Command::CopySlice(back))) =
                    self.siblings[i - 1].submit(Command::CopySlice(s))
                {
                    back.run();
                }
            }
            self.copy_waits.push((join, req.conn, req.op_id, req.write));
        }
    }

    /// Answers the spread copies whose every slice is done.
    pub(super) fn finish_host_copies(&mut self) -> usize {
        let before = self.copy_waits.len();
        let replies = &mut self.gpu_replies;
        self.copy_waits.retain(|(join, conn, op, write)| {
            if join.left.load(Ordering::Acquire) == 0 {
                let status = if join.failed.load(Ordering::Relaxed) {
                    Status::PeerMemory
                } else {
                    Status::Ok
                };
                replies.push((*conn, *op, *write, status));
                false
            } else {
                true
            }
        });
        before - self.copy_waits.len()
    }

    /// Tells every same-host peer of this shard to close its mappings of
    /// the IPC-exported allocations this endpoint deregistered.
    pub(super) fn send_ipc_revocations(&mut self) {
        for base in std::mem::take(&mut self.regions.ipc_revoked) {
            self.local.revoke_ipc(base);
        }
    }

    /// Starts a CUDA IPC op. It counts against its connection's in-flight
    /// limit like any op, and fails like one on an unknown connection.
    pub(super) fn apply_ipc(&mut self, cmd: crate::reactor::queue::IpcCmd) {
        let total = cmd.parts.len() as u32;
        if !self.dir.contains(cmd.conn) {
            let e = self.dir.error_of(cmd.conn);
            return self.ledger.fail(cmd.slot, e);
        }
        let counted = crate::reactor::ledger::Counted {
            op: crate::metrics::op_idx(cmd.kind),
            via: crate::metrics::Via::Ipc,
            bytes: cmd.parts.bytes(),
            start: *self.pass_now.get_or_insert_with(Instant::now),
        };
        if let Err(e) = self.ledger.open(cmd.slot, total, Some(cmd.conn), counted) {
            return self.ledger.fail(cmd.slot, e);
        }
        self.gpu_work().start(cmd);
    }

    pub(super) fn gpu_work(&mut self) -> &mut GpuWork {
        let counters = &self.ipc_counters;
        let (streams, way) = (self.cfg.gpu_streams, self.cfg.gpu_copy);
        let (bounce, bounce_bytes) = (self.cfg.chunk_bytes, self.cfg.gpu_bounce_bytes);
        self.gpu.get_or_insert_with(|| {
            GpuWork::new(counters.clone(), streams, way, bounce, bounce_bytes)
        })
    }

    /// Starts the CUDA copies same-host peers asked of our memory.
    pub(super) fn start_gpu_reqs(&mut self) {
        // Taken and put back, so the vector keeps its capacity.
        let mut reqs = std::mem::take(&mut self.gpu_reqs);
        let g = self.gpu_work();
        for r in reqs.drain(..) {
            g.start_target(r);
        }
        self.gpu_reqs = reqs;
    }

    /// Releases gated tcp frames whose copies ended, and sends WRITE
    /// chunks that reached their bounce buffers (later, if the stream is
    /// full now).
    pub(super) fn deliver_tcp_staging(&mut self) {
        let Some(g) = &mut self.gpu else { return };
        for (conn, stream, gate, ok) in g.releases.drain(..) {
            if let Some(ConnRef::Tcp(i)) = self.dir.get(conn) {
                self.tcp.mark(i);
                if let Some(s) = self.tcp.conns[i].streams.get_mut(stream as usize) {
                    s.release(gate, ok);
                }
            }
        }
        let now = Instant::now();
        let mut i = 0;
        while i < g.sends.len() {
            let (ts, bounce, r) = &g.sends[i];
            let stream = match self.dir.get(ts.conn) {
                Some(ConnRef::Tcp(ci)) => {
                    self.tcp.mark(ci);
                    self.tcp.conns[ci].streams.get_mut(ts.stream)
                }
                _ => None,
            };
            match (r, stream, bounce) {
                (Ok(()), Some(s), Some(b)) => {
                    use crate::tcp::PackChoice;
                    let choice = s.pack_choice(ts.dtype, ts.len);
                    if !s.can_request() || choice == PackChoice::Wait {
                        i += 1;
                        continue;
                    }
                    let from = RegionSlice::new(b, 0, ts.len).expect("bounce fits a chunk");
                    let (slot, op_id, key, addr) = (ts.slot, ts.op_id, ts.key, ts.addr);
                    match choice {
                        PackChoice::Pack(d) => {
                            s.push_write_packed(d, slot, op_id, key, addr, from, now)
                        }
                        _ => s.push_request(OpKind::Write, slot, op_id, key, addr, from, now),
                    }
                }
                (Err(e), _, _) => self.ledger.done.push((ts.slot, Err(e.duplicate()))),
                _ => {
                    let e = self.dir.error_of(ts.conn);
                    self.ledger.done.push((ts.slot, Err(e)));
                }
            }
            let _ = g.sends.swap_remove(i);
        }
    }

    pub(super) fn send_gpu_replies(&mut self) {
        for (conn, op_id, write, status) in self.gpu_replies.drain(..) {
            if let Some(ConnRef::Local(idx)) = self.dir.get(conn) {
                self.local.heat(idx);
                self.local.conns[idx].finish_gpu(op_id, write, status);
            }
        }
    }

    /// Applies revocations heard on same-host rings to the IPC cache.
    pub(super) fn apply_ipc_revocations(&mut self) {
        for (conn, base) in self.ipc_revoked.drain(..) {
            let Some(ConnRef::Local(idx)) = self.dir.get(conn) else {
                continue;
            };
            if let Some(g) = &mut self.gpu {
                g.revoke(self.local.conns[idx].peer_id, base);
            }
        }
    }
}

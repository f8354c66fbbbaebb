//! The shard's glue between sources: large same-host copies spread over
//! the sibling shards, CUDA copies for same-host requests and IPC ops,
//! tcp frames staged through pinned bounce buffers, and IPC revocations.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::Shard;
use crate::error::OpKind;
use crate::reactor::copy_pool::LazyCopyPool;
use crate::reactor::gpu::GpuWork;
use crate::reactor::queue::{Command, CopyJoin, CopySlice};
use crate::reactor::source::ConnRef;
use crate::region::RegionSlice;
use crate::wire::Status;
use crate::xfer::{CmaBatch, HostCopy, HostWork, CMA_JOB_MIN_BYTES};

/// A large copy's slices (whole 64 KiB blocks, as many as `threads`
/// copy threads take, or one per shard), all counted in one join; None
/// (nothing to wait for) when the request's ranges do not cut, which
/// they always do (checked whole).
fn span_jobs(
    req: &HostCopy,
    threads: Option<usize>,
    share: usize,
) -> Option<(Arc<CopyJoin>, Vec<CopySlice>)> {
    let len = req.ours.len();
    let count = match threads {
        Some(n) => crate::reactor::copy_pool::slices(len, n),
        None => share,
    };
    let slice = len.div_ceil(count).next_multiple_of(64 << 10);
    let count = len.div_ceil(slice);
    let join = Arc::new(CopyJoin {
        left: AtomicUsize::new(count),
        ..Default::default()
    });
    let jobs: Option<Vec<_>> = (0..count)
        .map(|i| {
            let off = i * slice;
            let ours = req.ours.sub(off, slice.min(len - off))?;
            CopySlice::new(ours, req.theirs.at(off), req.write, join.clone())
        })
        .collect();
    Some((join, jobs?))
}

/// A run of small CMA copies cut into `share` jobs at most, none under
/// `CMA_JOB_MIN_BYTES` (a shorter one copies faster than a thread wakes
/// for it), all counted in one join: its requests are answered once every
/// job is done, all failed if any piece failed (a request may then be
/// reported failed whose bytes did land; never the other way).
fn cma_jobs(batch: &CmaBatch, share: usize) -> (Arc<CopyJoin>, Vec<CopySlice>) {
    let bytes: usize = batch.pieces.iter().map(|(_, s, _)| s.len()).sum();
    let count = (bytes / CMA_JOB_MIN_BYTES).clamp(1, share.max(1));
    let per = bytes.div_ceil(count);
    let join = Arc::new(CopyJoin::default());
    let mut jobs = Vec::with_capacity(count);
    let mut cur = Vec::new();
    let mut cur_bytes = 0;
    for (op, ours, addr) in &batch.pieces {
        cur_bytes += ours.len();
        cur.push((*op, ours.clone(), *addr));
        if cur_bytes >= per {
            let pieces = std::mem::take(&mut cur);
            jobs.push(CopySlice::pieces(
                batch.pid,
                pieces,
                batch.write,
                join.clone(),
            ));
            cur_bytes = 0;
        }
    }
    if !cur.is_empty() {
        jobs.push(CopySlice::pieces(batch.pid, cur, batch.write, join.clone()));
    }
    join.left.store(jobs.len(), Ordering::Release);
    (join, jobs)
}

impl Shard {
    /// Cuts each large same-host copy of this pass into slices, and each
    /// run of small CMA copies into jobs: the endpoint's copy threads take
    /// all but one (or, without them, the sibling shards through their
    /// queues); one that finds no room is copied here, as is the first,
    /// now.
    pub(super) fn start_host_copies(&mut self) {
        let pool = self.cfg.copy_pool.clone();
        let threads = pool.as_ref().and_then(|p| p.get().map(|_| p.share()));
        let share = threads.unwrap_or(self.siblings.len() + 1);
        // Taken and put back, so the vector keeps its capacity.
        let mut works = std::mem::take(&mut self.host_copies);
        for work in works.drain(..) {
            let (join, jobs) = match work {
                HostWork::One(req) => {
                    let Some((join, jobs)) = span_jobs(&req, threads, share) else {
                        // Unreachable: the request's ranges were checked whole.
                        let failed = (req.conn, req.op_id, req.write, Status::PeerMemory);
                        self.gpu_replies.push(failed);
                        continue;
                    };
                    self.copy_waits
                        .push((join.clone(), req.conn, req.op_id, req.write));
                    (join, jobs)
                }
                HostWork::Cma(batch) => {
                    let (join, jobs) = cma_jobs(&batch, share);
                    for (op, _, _) in &batch.pieces {
                        self.copy_waits
                            .push((join.clone(), batch.conn, *op, batch.write));
                    }
                    (join, jobs)
                }
            };
            drop(join);
            self.hand_out(jobs, pool.as_deref());
        }
        self.host_copies = works;
    }

    /// Runs the first job here and hands the others to the copy threads
    /// (or the siblings), first, so they copy while we copy ours.
    fn hand_out(&mut self, mut jobs: Vec<CopySlice>, pool: Option<&LazyCopyPool>) {
        if jobs.is_empty() {
            return;
        }
        let first = jobs.remove(0);
        for (i, s) in jobs.into_iter().enumerate() {
            if let Some(p) = pool.and_then(|p| p.get()) {
                if let Err(back) = p.try_submit(s) {
                    back.run();
                }
            } else if self.siblings.is_empty() {
                s.run();
            } else if let Err((_, Command::CopySlice(back))) =
                self.siblings[i % self.siblings.len()].submit(Command::CopySlice(s))
            {
                back.run();
            }
        }
        first.run();
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

//! A shard's GPU work: CUDA copies for this endpoint's IPC ops and for
//! same-host peers' requests on its GPU memory, issued in batches once per
//! drain and finished by polling their events in the loop; and the shard's
//! cache of opened IPC handles.
//!
//! Results collect in two outboxes the shard drains after each call:
//! completions of our ops (`done`) and answers to peers' requests
//! (`replies`), so no failure path can lose either.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::queue::{IpcCmd, IpcDesc, IpcParts, IpcPlan};
use crate::error::{ConnId, Error, OpKind, Result};
use crate::gpu::copy::{span_of, Allow, Copier, CopyWay};
use crate::gpu::ipc::{IpcCache, IpcCounters, MapTicket};
use crate::gpu::MemKind;
use crate::region::{KeyRef, Region, RegionSlice};
use crate::wire::{IpcBuf, Status};
use crate::xfer::{Bounce, GpuReq, Stage, Theirs};

pub(crate) type Done = Vec<(u32, Result<()>)>;
/// Answers to same-host peers' requests: (connection, op id, write, status).
pub(crate) type Replies = Vec<(ConnId, u64, bool, Status)>;

/// The shard's record of one CUDA copy: what it leads to, the IPC mapping
/// to release and the memory to hold until it ends (the copier hands it
/// back untouched).
pub(crate) struct Entry {
    pub then: Then,
    pub mapping: Option<MapTicket>,
    /// Alive until the copy ends (deregistration waits for it).
    pub keep: Option<Arc<Region>>,
    /// The copy's other side, when it is a region too; held, never read.
    #[allow(dead_code)]
    pub keep2: Option<Arc<Region>>,
    /// A same-host peer's memfd mapping the copy reads or writes; held,
    /// never read.
    #[allow(dead_code)]
    pub keep_map: Option<Arc<crate::sys::Mapping>>,
    /// A prepared op's mappings (released when it ends) and local regions.
    pub planned: Option<Box<PlannedHold>>,
}

/// What a prepared op's copies hold until they end.
pub(crate) struct PlannedHold {
    tickets: Vec<MapTicket>,
    /// The local regions, in plan order (held until the copies end).
    keep: Vec<RegionSlice>,
}

/// What a finished copy leads to.
pub(crate) enum Then {
    /// One piece of our op `slot` is done.
    Op(u32),
    /// Answer a same-host peer's request (connection, op id, write).
    Reply(ConnId, u64, bool),
    /// A WRITE chunk of GPU memory is in its bounce buffer: send it.
    Send(TcpSend),
    /// Release gated frame `gate` of stream `stream` of a tcp connection.
    Release(ConnId, u8, u64),
}

/// A staged tcp WRITE chunk, sent once its GPU→bounce copy is done.
pub(crate) struct TcpSend {
    pub conn: ConnId,
    pub stream: usize,
    pub slot: u32,
    pub op_id: u64,
    pub key: KeyRef,
    pub addr: u64,
    pub len: usize,
    /// The values' type: the chunk may go packed once in its bounce buffer.
    pub dtype: Option<crate::codec::FloatType>,
}

/// Pinned bounce buffers for GPU memory on the tcp path. A buffer is free
/// when only the pool holds it: frames and copies hold clones while they
/// use it, so nothing needs to give it back explicitly.
struct BouncePool {
    bufs: Vec<Arc<Region>>,
    buf_len: usize,
    max: usize,
}

/// The device allocation `(base, len)` of a region of GPU memory.
fn device_alloc(r: &Region) -> Option<(u64, u64)> {
    match r.mem {
        MemKind::Device {
            alloc_base,
            alloc_len,
            ..
        } => Some((alloc_base, alloc_len as u64)),
        _ => None,
    }
}

/// The device allocation a slice of ours lies in, whole: copies join only
/// inside one (a copy must not cross allocations; a registration of host
/// memory, or one over several allocations, never joins).
fn local_span(s: &RegionSlice) -> Option<u64> {
    let (base, len) = device_alloc(s.region())?;
    let (at, n) = (s.addr(), s.len() as u64);
    (at >= base && at + n <= base + len).then_some(base)
}

/// The regions a prepared op's entry holds, in plan order.
fn entry_regions(e: &Entry) -> impl Iterator<Item = &Region> {
    e.planned
        .iter()
        .flat_map(|h| h.keep.iter().map(|s| s.region().as_ref()))
}

/// A tcp staging copy: between a pinned bounce buffer and a region of this
/// GPU, so the kernel may copy it; bounce buffers are separate
/// allocations, so it never joins another.
fn kernel_only() -> Allow {
    Allow {
        kernel: true,
        split: false,
        span: 0,
    }
}

impl BouncePool {
    fn take(&mut self, len: usize) -> Bounce {
        if len <= self.buf_len {
            if let Some(b) = self.bufs.iter().find(|b| Arc::strong_count(b) == 1) {
                return Bounce::Ready(b.clone());
            }
            if self.bufs.len() >= self.max {
                return Bounce::Busy;
            }
        }
        // Grow the pool (or, for a frame larger than the pool's buffers,
        // which a peer with a larger FERRY_CHUNK_BYTES sends, use a one-off).
        match crate::gpu::memory::PinnedBuf::new(len.max(self.buf_len)) {
            Ok(p) => {
                let b = Arc::new(Region::bounce(p, len.max(self.buf_len)));
                if len <= self.buf_len {
                    self.bufs.push(b.clone());
                }
                Bounce::Ready(b)
            }
            Err(e) => {
                tracing::warn!("no pinned bounce buffer of {len} bytes: {e}");
                Bounce::Never
            }
        }
    }
}

pub(crate) struct GpuWork {
    /// One stream pool per device this shard has copied on.
    copiers: Vec<Copier<Entry>>,
    cache: IpcCache,
    streams: usize,
    /// Which way small copies go (`FERRY_GPU_COPY`, `FERRY_GPU_RUNNER_US`).
    way: CopyWay,
    done: Done,
    replies: Replies,
    pool: BouncePool,
    /// Staged tcp WRITE chunks ready to send (or failed).
    pub sends: Vec<(TcpSend, Option<Arc<Region>>, Result<()>)>,
    /// Gated tcp frames whose copy ended: (conn, stream, gate, ok).
    pub releases: Vec<(ConnId, u8, u64, bool)>,
    /// Scratch for `poll` (kept for its capacity).
    finished: Vec<(Entry, Result<()>)>,
}

impl GpuWork {
    pub fn new(
        counters: Arc<IpcCounters>,
        streams: usize,
        way: CopyWay,
        bounce_len: usize,
        bounce_bytes: usize,
    ) -> Self {
        Self {
            copiers: Vec::new(),
            cache: IpcCache::new(counters),
            streams,
            way,
            done: Vec::with_capacity(256),
            replies: Vec::with_capacity(256),
            pool: BouncePool {
                bufs: Vec::new(),
                buf_len: bounce_len,
                max: (bounce_bytes / bounce_len.max(1)).max(2),
            },
            sends: Vec::with_capacity(64),
            releases: Vec::with_capacity(64),
            finished: Vec::with_capacity(64),
        }
    }

    pub fn busy(&self) -> bool {
        self.copiers.iter().any(|c| c.busy())
    }

    /// Moves finished (or failed) work into the shard's queues.
    pub fn drain_into(&mut self, done: &mut Done, replies: &mut Replies) {
        done.append(&mut self.done);
        replies.append(&mut self.replies);
    }

    pub fn bounce(&mut self, len: usize) -> Bounce {
        self.pool.take(len)
    }

    /// The device a copy between these regions runs on: the GPU side's.
    fn ordinal_of(a: &Region, b: &Region) -> i32 {
        match (a.mem, b.mem) {
            (MemKind::Device { ordinal, .. }, _) | (_, MemKind::Device { ordinal, .. }) => ordinal,
            _ => 0,
        }
    }

    /// Starts the copy a tcp stream staged (see `Stage`).
    pub fn stage_tcp(&mut self, conn: ConnId, st: Stage) {
        let then = if st.gate == 0 {
            Then::Op(st.slot)
        } else {
            Then::Release(conn, st.stream, st.gate)
        };
        let ordinal = Self::ordinal_of(st.dst.region(), st.src.region());
        let (dst, src, len) = (st.dst.addr(), st.src.addr(), st.dst.len().min(st.src.len()));
        let entry = Entry {
            then,
            mapping: None,
            keep: Some(st.dst.region().clone()),
            keep2: Some(st.src.region().clone()),
            keep_map: None,
            planned: None,
        };
        match self.copier(ordinal) {
            // A pinned bounce buffer and a region of this GPU.
            Ok(ci) => self.stage(ci, entry, dst, src, len, kernel_only()),
            Err(e) => self.fail_all(e, vec![entry]),
        }
    }

    /// Stages the GPU→bounce copy of a tcp WRITE chunk; `Then::Send` sends
    /// it when done.
    pub fn stage_send(&mut self, send: TcpSend, gpu: RegionSlice, bounce: Arc<Region>) {
        let ordinal = Self::ordinal_of(gpu.region(), &bounce);
        let (dst, src) = (bounce.addr(), gpu.addr());
        let len = gpu.len().min(bounce.len());
        let entry = Entry {
            then: Then::Send(send),
            mapping: None,
            keep: Some(bounce),
            keep2: Some(gpu.region().clone()),
            keep_map: None,
            planned: None,
        };
        match self.copier(ordinal) {
            // A pinned bounce buffer and a region of this GPU.
            Ok(ci) => self.stage(ci, entry, dst, src, len, kernel_only()),
            Err(e) => self.fail_all(e, vec![entry]),
        }
    }

    fn copier(&mut self, ordinal: i32) -> Result<usize> {
        if let Some(i) = self.copiers.iter().position(|c| c.ordinal() == ordinal) {
            return Ok(i);
        }
        self.copiers
            .push(Copier::new(ordinal, self.streams, self.way)?);
        Ok(self.copiers.len() - 1)
    }

    /// Reports one entry's outcome to the right outbox.
    fn report(&mut self, en: Entry, r: Result<()>) {
        if let Some(k) = en.mapping {
            self.cache.release(k);
        }
        if let Some(h) = en.planned {
            for k in h.tickets {
                self.cache.release(k);
            }
        }
        match en.then {
            Then::Reply(conn, op, write) => {
                let st = match r {
                    Ok(()) => Status::Ok,
                    Err(e) => {
                        tracing::warn!(%conn, "same-host GPU copy for op {op} failed: {e}");
                        Status::PeerMemory
                    }
                };
                self.replies.push((conn, op, write, st));
            }
            Then::Op(slot) => self.done.push((slot, r)),
            Then::Send(s) => self.sends.push((s, en.keep, r)),
            Then::Release(conn, stream, gate) => {
                if let Err(e) = &r {
                    tracing::warn!(%conn, "staging GPU memory for tcp failed: {e}");
                }
                self.releases.push((conn, stream, gate, r.is_ok()))
            }
        }
    }

    fn fail_all(&mut self, e: Error, failed: Vec<Entry>) {
        for en in failed {
            self.report(en, Err(e.duplicate()));
        }
    }

    /// Stages one copy on copier `ci`. Every caller puts in `entry` the
    /// regions, the IPC mapping (counted in the cache until released) or
    /// the peer's memfd mapping that hold `dst` and `src`. `allow`: whether
    /// the kernel may copy it and its span (see `Allow`); whether it may be
    /// split is decided here.
    fn stage(&mut self, ci: usize, entry: Entry, dst: u64, src: u64, len: usize, allow: Allow) {
        // A large copy between two buffers of the copier's own GPU (CUDA
        // IPC on one device) runs whole: pieces on parallel streams only
        // compete there (`Copier::stage`). Asked of the driver only for
        // copies that would be split.
        let split_ok = len < crate::gpu::copy::SPLIT_MIN_BYTES || {
            let ord = self.copiers[ci].ordinal();
            let on_ours = |p: u64| {
                matches!(crate::gpu::memory::classify(p),
                    Ok(crate::gpu::MemKind::Device { ordinal, .. }) if ordinal == ord)
            };
            !(on_ours(dst) && on_ours(src))
        };
        let copier = &mut self.copiers[ci];
        let allow = Allow {
            split: split_ok,
            ..allow
        };
        // SAFETY: both ranges stay valid until the entry returns (see above);
        // the copier returns it only once the copy has ended or failed.
        let staged = unsafe { copier.stage(entry, dst, src, len, allow) };
        if let Err((e, failed)) = staged {
            self.fail_all(e, failed);
        }
    }

    /// Stages every piece of an IPC op; each piece reports once.
    pub fn start(&mut self, cmd: IpcCmd) {
        let slot = cmd.slot;
        // The copier's context is made current once for all the pieces
        // (opening an IPC handle needs it).
        let current = crate::gpu::cuda().and_then(|c| c.make_current(cmd.ordinal));
        let ci = match current.and_then(|()| self.copier(cmd.ordinal)) {
            Ok(i) => i,
            Err(e) => {
                for _ in 0..cmd.parts.len() {
                    self.done.push((slot, Err(e.duplicate())));
                }
                return;
            }
        };
        let kind = cmd.kind;
        match cmd.parts {
            IpcParts::One(d) => self.start_one(ci, kind, slot, d),
            IpcParts::Many(v) => {
                for d in v {
                    self.start_one(ci, kind, slot, d);
                }
            }
            IpcParts::Planned { plan, keep } => self.start_planned(ci, kind, slot, &plan, keep),
            IpcParts::Local { dst, src } => self.start_local(ci, slot, dst, src),
        }
    }

    /// A copy between two slices of our own memory (the copier's context
    /// is current): by the kernel (or the runner, alone) when both are
    /// device memory its GPU reaches.
    fn start_local(&mut self, ci: usize, slot: u32, dst: RegionSlice, src: RegionSlice) {
        let theirs = match src.region().mem {
            MemKind::Device { ordinal, .. } => ordinal,
            _ => -1,
        };
        let allow = Allow {
            kernel: theirs >= 0 && self.kernel_reaches(ci, dst.region(), theirs),
            split: false,
            span: 0,
        };
        let (to, from, len) = (dst.addr(), src.addr(), dst.len().min(src.len()));
        let entry = Entry {
            then: Then::Op(slot),
            mapping: None,
            keep: Some(dst.region().clone()),
            keep2: Some(src.region().clone()),
            keep_map: None,
            planned: None,
        };
        self.stage(ci, entry, to, from, len, allow);
    }

    /// Stages a prepared op: each peer allocation opened once, then every
    /// piece's copy into one batch with one entry (the copier's context is
    /// current).
    fn start_planned(
        &mut self,
        ci: usize,
        kind: OpKind,
        slot: u32,
        plan: &IpcPlan,
        keep: Vec<RegionSlice>,
    ) {
        let me = self.copiers[ci].ordinal();
        let mut tickets = Vec::with_capacity(plan.remotes.len());
        // Per peer allocation: its base here and whether our kernels reach it.
        let mut bases = Vec::with_capacity(plan.remotes.len());
        for r in &plan.remotes {
            match self.cache.acquire(r, me) {
                Ok((base, ticket, theirs)) => {
                    tickets.extend(ticket);
                    let reach = crate::gpu::cuda().is_ok_and(|c| c.reaches(me, theirs));
                    bases.push((base, reach));
                }
                Err(e) => {
                    for k in tickets {
                        self.cache.release(k);
                    }
                    return self.done.push((slot, Err(e)));
                }
            }
        }
        let entry = Entry {
            then: Then::Op(slot),
            mapping: None,
            keep: None,
            keep2: None,
            keep_map: None,
            planned: Some(Box::new(PlannedHold { tickets, keep })),
        };
        // Each local region's device allocation: pieces join only inside one.
        let allocs: Vec<Option<(u64, u64)>> = entry_regions(&entry).map(device_alloc).collect();
        let copy = |i: usize| {
            let p = plan.pieces[i];
            let (base, reach) = bases[p.remote as usize];
            let remote = base + p.remote_off;
            let (dst, src) = match kind {
                OpKind::Write => (remote, p.local),
                OpKind::Read => (p.local, remote),
            };
            let allow = Allow {
                kernel: reach && plan.region_gpu[p.region as usize] == me,
                split: false,
                span: allocs[p.region as usize]
                    .filter(|&(base, len)| p.local >= base && p.local + p.len <= base + len)
                    .map_or(0, |(base, _)| span_of(base, u64::from(p.remote) + 1)),
            };
            (dst, src, p.len as usize, allow)
        };
        let copier = &mut self.copiers[ci];
        // SAFETY: every range was checked at prepare time against its local
        // region (held in the entry's `keep`) and its peer allocation
        // (mapped while the entry's tickets are held); the copier returns
        // the entry only once the copies ended or failed.
        let staged = unsafe { copier.stage_many(entry, plan.pieces.len(), copy) };
        if let Err((e, failed)) = staged {
            self.fail_all(e, failed);
        }
    }

    fn acquire(&mut self, ordinal: i32, b: &IpcBuf) -> Result<(u64, Option<MapTicket>, i32)> {
        crate::gpu::cuda()?.make_current(ordinal)?;
        self.cache.acquire(b, ordinal)
    }

    /// Whether the gather kernel of copier `ci` may copy between our
    /// `local` region and peer memory on device `theirs` (IPC memory is
    /// always device memory): ours on the copier's GPU, theirs on a GPU
    /// its kernels reach. Host memory may be pageable: the engine's.
    fn kernel_reaches(&self, ci: usize, local: &Region, theirs: i32) -> bool {
        let me = self.copiers[ci].ordinal();
        matches!(local.mem, MemKind::Device { ordinal, .. } if ordinal == me)
            && crate::gpu::cuda().is_ok_and(|c| c.reaches(me, theirs))
    }

    /// One piece of an IPC op (the copier's context is current).
    fn start_one(&mut self, ci: usize, kind: OpKind, slot: u32, d: IpcDesc) {
        let ordinal = self.copiers[ci].ordinal();
        let (remote, key, theirs) = match self.cache.acquire(&d.remote, ordinal) {
            Ok(x) => x,
            Err(e) => return self.done.push((slot, Err(e))),
        };
        let allow = Allow {
            kernel: self.kernel_reaches(ci, d.local.region(), theirs),
            split: false,
            // Pieces in one allocation of ours and one of the peer's may join.
            span: local_span(&d.local)
                .map_or(0, |a| span_of(a, d.remote.alloc_base ^ d.remote.owner_id)),
        };
        let local = d.local.addr();
        let len = d.local.len();
        let (dst, src) = match kind {
            OpKind::Write => (remote, local),
            OpKind::Read => (local, remote),
        };
        let entry = Entry {
            then: Then::Op(slot),
            mapping: key,
            keep: Some(d.local.region().clone()),
            keep2: None,
            keep_map: None,
            planned: None,
        };
        self.stage(ci, entry, dst, src, len, allow);
    }

    /// Stages the copy a same-host peer's request needs: its GPU memory
    /// through its IPC handle, or its memfd memory mapped here. Runs on our
    /// region's GPU, else GPU 0. Always answered (now if it cannot start).
    pub fn start_target(&mut self, r: GpuReq) {
        let len = r.ours.len();
        let ordinal = match r.ours.region().mem {
            crate::gpu::MemKind::Device { ordinal, .. } => ordinal,
            _ => 0,
        };
        let (theirs, keep_map, theirs_alloc) = match r.theirs {
            // Their memfd memory mapped here: pageable to a kernel.
            Theirs::Host(p, m) => {
                let id = Arc::as_ptr(&m) as u64;
                (Ok((p as u64, None, -1)), Some(m), id)
            }
            Theirs::Ipc(x) => {
                let b = IpcBuf {
                    device: 0,
                    owner_id: r.peer_id,
                    host_token: 0,
                    owner_pid: r.peer_pid,
                    alloc_id: 0,
                    alloc_base: x.alloc_base,
                    alloc_len: 0,
                    offset: x.offset,
                    len: len as u64,
                    handle: x.handle,
                };
                (self.acquire(ordinal, &b), None, x.alloc_base ^ r.peer_id)
            }
        };
        let started = theirs.and_then(|t| Ok((t, self.copier(ordinal)?)));
        let ((theirs, key, their_gpu), ci) = match started {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(conn = %r.conn, "same-host GPU copy for op {} failed: {e}", r.op_id);
                return self
                    .replies
                    .push((r.conn, r.op_id, r.write, Status::PeerMemory));
            }
        };
        let ours = r.ours.addr();
        let (dst, src) = if r.write {
            (ours, theirs)
        } else {
            (theirs, ours)
        };
        let allow = Allow {
            kernel: their_gpu >= 0 && self.kernel_reaches(ci, r.ours.region(), their_gpu),
            split: false,
            // Requests in one allocation of ours and one of theirs (an IPC
            // allocation, or their memfd mapping) may join.
            span: local_span(&r.ours).map_or(0, |a| span_of(a, theirs_alloc)),
        };
        let entry = Entry {
            then: Then::Reply(r.conn, r.op_id, r.write),
            mapping: key,
            keep: Some(r.ours.region().clone()),
            keep2: None,
            keep_map,
            planned: None,
        };
        self.stage(ci, entry, dst, src, len, allow);
    }

    /// Issues the copies staged since the last flush (once per drain).
    pub fn flush(&mut self) {
        for ci in 0..self.copiers.len() {
            if let Err((e, failed)) = self.copiers[ci].flush() {
                tracing::warn!("CUDA copy batch failed: {e}");
                self.fail_all(e, failed);
            }
        }
    }

    /// Collects finished copies; returns how many finished.
    pub fn poll_events(&mut self) -> usize {
        let mut finished = std::mem::take(&mut self.finished);
        let n: usize = self
            .copiers
            .iter_mut()
            .map(|c| c.poll(|en, r| finished.push((en, r))))
            .sum();
        for (en, r) in finished.drain(..) {
            self.report(en, r);
        }
        self.finished = finished;
        n
    }

    /// Waits (up to `max`) for every copy in flight.
    pub fn finish_all(&mut self, max: Duration) {
        self.flush();
        let deadline = Instant::now() + max;
        while self.busy() && Instant::now() < deadline {
            self.poll_events();
            // Copies held back while batches ran go out as those end.
            self.flush();
            std::thread::yield_now();
        }
    }

    pub fn revoke(&mut self, owner_id: u64, alloc_base: u64) {
        self.cache.revoke(owner_id, alloc_base);
    }

    pub fn revoke_owner(&mut self, owner_id: u64) {
        self.cache.revoke_owner(owner_id);
    }
}

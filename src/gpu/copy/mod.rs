//! Asynchronous copies on a pool of CUDA streams, finished by events that
//! the shard's loop polls (`cuEventQuery`): no thread ever blocks on a
//! stream.
//!
//! Small copies are staged while the shard drains its queue and issued
//! together by `flush` — one `cuMemcpyBatchAsync` and one event for the
//! whole group where the driver has it (CUDA 12.8+), since the per-call
//! cost of `cuMemcpyAsync` (~2 µs) otherwise caps small transfers. A busy
//! shard finds one or two new copies a pass, so a flush per pass would
//! still pay a launch and an event per copy: at most `BATCHES_IN_FLIGHT`
//! batches run at once, and copies staged meanwhile wait for the next
//! flush after one ends, so batches grow with the load (an idle copier
//! issues at once: no added latency). Large copies are split across the
//! stream pool so several copy engines work on one transfer — unless both
//! ends are memory of the copier's own GPU: such a copy runs on the GPU's
//! own engines as one call, and pieces on parallel streams only compete
//! (a 16 MiB same-GPU copy through CUDA IPC ran at 0.44 of one
//! cudaMemcpy split four ways, 0.81 whole; docs/benchmarks-log.md).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;

use super::driver::{check, cuda};
use super::gather::{Gather, KERNEL_MAX_BYTES};
use super::runner::{self, Runner, RUNNER_MAX_BYTES};

mod choice;
use crate::error::{Error, Result};
use choice::{Choice, Way};

/// Which way batches of small copies go (`FERRY_GPU_COPY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuCopy {
    /// Each copier measures both ways and takes the faster (see `Choice`).
    #[default]
    Auto,
    /// The gather kernel whenever the memory allows it.
    Kernel,
    /// The copy engine (`cuMemcpyBatchAsync`, or a call per copy).
    Engine,
}

/// How a copier's small copies go: `FERRY_GPU_COPY`, the runner's idle
/// span (`FERRY_GPU_RUNNER_US`; None: no runner) and where the gather
/// kernel reads its descriptors (`FERRY_GPU_DEVICE_DESCS`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct CopyWay {
    pub way: GpuCopy,
    pub runner_idle: Option<Duration>,
    /// Batches of at least this many copies: descriptors in device memory.
    pub device_descs: usize,
}

/// Pieces one copy is split into at most (one per stream).
pub(crate) const MAX_SPLIT: usize = 8;
/// Copies below this size go on one stream: splitting only adds latency.
pub(crate) const SPLIT_MIN_BYTES: usize = 8 << 20;
/// Staged copies issued in one batch at most: a KV-cache hand-off of
/// 100 000 blocks goes in one launch (the kernel's descriptors grow to
/// fit), not as a hundred batches, most of which would find no kernel
/// slot and go to the copy engine one copy after another.
pub(crate) const MAX_BATCH: usize = 1 << 17;
/// Room kept for staged copies from the start.
const STAGED_CAPACITY: usize = 1024;
/// Batches of small copies in flight at once (see the module doc).
pub(crate) const BATCHES_IN_FLIGHT: usize = 2;

/// What a staged copy may do besides one plain copy-engine call.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Allow {
    /// Both ranges are device memory of the copier's GPU (or one its
    /// kernels reach) or `cuMemHostAlloc` memory: the gather kernel may
    /// copy it (`gather.rs`).
    pub kernel: bool,
    /// A large copy may be split across the streams (false: both ends are
    /// on the copier's GPU, where pieces only compete).
    pub split: bool,
    /// The pair of allocations the copy lies in (0: not known). A copy
    /// that continues the last one staged, in the same pair, joins it;
    /// no copy may span two allocations, so different pairs never join.
    pub span: u64,
}

/// A span for `Allow` from the identities of the two allocations (never 0).
pub(crate) fn span_of(a: u64, b: u64) -> u64 {
    let mut x = a ^ b.rotate_left(29) ^ 0x9e37_79b9_7f4a_7c15;
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (x ^ (x >> 31)) | 1
}

/// A staging outcome: on failure, the error and every entry it took down.
pub(crate) type Staged<E> = std::result::Result<(), (Error, Vec<E>)>;

/// Copies issued together, done when all their events have fired.
struct InFlight<E> {
    events: [cu::CUevent; MAX_SPLIT],
    n: usize,
    entries: Vec<E>,
    /// A batch of small copies (counted in `batches`), not a split one.
    batch: bool,
    /// The gather kernel's descriptor slot it holds, if it ran there.
    slot: Option<usize>,
    /// For `Choice`: when a batch of `count` eligible copies was issued, and
    /// which way (None: not measured).
    timed: Option<(Instant, usize, Way)>,
    /// A lone copy the runner makes (no event: its done word ends it).
    runner: bool,
}

/// A device's stream pool, staged copies and copies in flight. Owned by
/// one shard. `E` is the caller's record of each copy (what to do when it
/// ends, and whatever keeps its memory alive); the copier only holds it and
/// hands it back, so this layer knows nothing of who asked.
pub(crate) struct Copier<E> {
    ordinal: i32,
    streams: Vec<cu::CUstream>,
    free_events: Vec<cu::CUevent>,
    next_stream: usize,
    has_batch: bool,
    staged: Vec<E>,
    dsts: Vec<u64>,
    srcs: Vec<u64>,
    sizes: Vec<usize>,
    /// Whether every staged copy may run in the gather kernel.
    all_kernel_ok: bool,
    /// The span of the last staged copy (0: none may join it).
    last_span: u64,
    /// The gather kernel, loaded on first use (after a failed load `choice`
    /// never picks it again).
    gather: Option<Gather>,
    inflight: VecDeque<InFlight<E>>,
    /// Batches of small copies among `inflight`.
    batches: usize,
    /// Emptied entry vectors, reused so steady state allocates nothing.
    spare: Vec<Vec<E>>,
    /// The resident kernel for a lone small copy (`runner/`), loaded on
    /// first use; `runner_idle` None: not used (off, or it failed to load).
    runner: Option<Runner>,
    runner_idle: Option<Duration>,
    /// `CopyWay::device_descs`, for the gather kernel when it loads.
    device_descs: usize,
    /// Which way kernel-eligible copies go (see `Choice`): index 0 for a
    /// lone copy, 1 for a batch of several. Kept apart because a lone copy
    /// is all fixed cost (a launch or an engine call, and the GPU's start),
    /// which a per-copy average over batches would hide.
    choice: [Choice; 2],
}

// SAFETY: streams and events are driver handles usable from any thread; a
// Copier is used by one shard at a time (it moves with the shard).
unsafe impl<E: Send> Send for Copier<E> {}

impl<E> Copier<E> {
    /// `way.runner_idle`: how long the runner kernel waits for the next
    /// lone copy before it ends (None: lone copies are launched as batches
    /// are).
    pub fn new(ordinal: i32, streams: usize, way: CopyWay) -> Result<Self> {
        let c = cuda()?;
        c.make_current(ordinal)?;
        c.enable_peer_access();
        c.make_current(ordinal)?;
        let mut v = Vec::with_capacity(streams);
        for _ in 0..streams.clamp(1, MAX_SPLIT) {
            let mut s: cu::CUstream = std::ptr::null_mut();
            // SAFETY: creates a stream in the current context. Non-blocking:
            // it must not serialise with the legacy default stream that the
            // application may be using.
            check("cuStreamCreate", unsafe {
                cu::cuStreamCreate(&mut s, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
            })?;
            v.push(s);
        }
        Ok(Self {
            ordinal,
            streams: v,
            free_events: Vec::new(),
            next_stream: 0,
            has_batch: c.has_batch_copy,
            staged: Vec::with_capacity(STAGED_CAPACITY),
            dsts: Vec::with_capacity(STAGED_CAPACITY),
            srcs: Vec::with_capacity(STAGED_CAPACITY),
            sizes: Vec::with_capacity(STAGED_CAPACITY),
            all_kernel_ok: true,
            last_span: 0,
            gather: None,
            inflight: VecDeque::with_capacity(64),
            batches: 0,
            spare: Vec::new(),
            runner: None,
            runner_idle: way.runner_idle,
            device_descs: way.device_descs,
            choice: [Choice::forced(way.way), Choice::forced(way.way)],
        })
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    pub fn busy(&self) -> bool {
        !self.inflight.is_empty() || !self.staged.is_empty()
    }

    fn event(&mut self) -> Result<cu::CUevent> {
        if let Some(e) = self.free_events.pop() {
            return Ok(e);
        }
        let mut e: cu::CUevent = std::ptr::null_mut();
        // SAFETY: creates an event in the current context; timing off makes
        // record and query cheaper.
        check("cuEventCreate", unsafe {
            cu::cuEventCreate(&mut e, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(e)
    }

    fn next_stream(&mut self) -> cu::CUstream {
        let s = self.streams[self.next_stream % self.streams.len()];
        self.next_stream = self.next_stream.wrapping_add(1);
        s
    }

    fn entries_vec(&mut self) -> Vec<E> {
        self.spare.pop().unwrap_or_default()
    }

    /// Queues a copy of `len` bytes from `src` to `dst` (any addresses the
    /// driver can reach: device, mapped IPC, pinned or pageable host).
    /// Large copies start now; small ones wait for `flush`; `allow` says
    /// what else the copy may do.
    ///
    /// # Safety
    /// `[dst, dst + len)` and `[src, src + len)` must stay valid (mapped,
    /// not freed) until `entry` comes back from `poll`, or with an error
    /// from here or `flush`: the DMA engine reads and writes them until then.
    /// Holding what keeps them alive inside `entry` meets this.
    pub unsafe fn stage(
        &mut self,
        entry: E,
        dst: u64,
        src: u64,
        len: usize,
        allow: Allow,
    ) -> Staged<E> {
        let kernel_ok = allow.kernel;
        let span = std::mem::replace(&mut self.last_span, allow.span);
        if len >= SPLIT_MIN_BYTES {
            self.last_span = 0;
            let pieces = if allow.split { self.streams.len() } else { 1 };
            // SAFETY: the caller's promise, passed on.
            return unsafe { self.start_split(entry, dst, src, len, pieces) };
        }
        self.staged.push(entry);
        self.push_copy(dst, src, len, kernel_ok, span != 0 && span == allow.span);
        self.flush_if_full()
    }

    /// Queues the copies of one request for `flush`, all in one batch with
    /// the one `entry` that ends them: `copy(i)` is the i-th of `n`, as
    /// (dst, src, len, allow); none may be `SPLIT_MIN_BYTES` or longer.
    ///
    /// # Safety
    /// As `stage`, for every copy.
    pub unsafe fn stage_many(
        &mut self,
        entry: E,
        n: usize,
        mut copy: impl FnMut(usize) -> (u64, u64, usize, Allow),
    ) -> Staged<E> {
        if !self.sizes.is_empty() && self.sizes.len() + n > MAX_BATCH {
            if let Err((e, mut failed)) = self.flush() {
                failed.push(entry);
                return Err((e, failed));
            }
        }
        self.staged.push(entry);
        for i in 0..n {
            let (dst, src, len, allow) = copy(i);
            debug_assert!(len < SPLIT_MIN_BYTES, "the caller plans small copies");
            let span = std::mem::replace(&mut self.last_span, allow.span);
            self.push_copy(dst, src, len, allow.kernel, span != 0 && span == allow.span);
        }
        self.flush_if_full()
    }

    /// Adds one copy to the staged batch. A copy that continues the last
    /// one on both sides in the same span (a KV block next to the previous
    /// one) joins it: one copy for both.
    fn push_copy(&mut self, dst: u64, src: u64, len: usize, kernel_ok: bool, same_span: bool) {
        if let (Some(&d), Some(&s), Some(last), true) = (
            self.dsts.last(),
            self.srcs.last(),
            self.sizes.last_mut(),
            same_span,
        ) {
            let joined = *last + len;
            if d + *last as u64 == dst && s + *last as u64 == src && joined < SPLIT_MIN_BYTES {
                *last = joined;
                self.all_kernel_ok &= kernel_ok && joined <= KERNEL_MAX_BYTES;
                return;
            }
        }
        self.all_kernel_ok &= kernel_ok && len <= KERNEL_MAX_BYTES;
        self.dsts.push(dst);
        self.srcs.push(src);
        self.sizes.push(len);
    }

    fn flush_if_full(&mut self) -> Staged<E> {
        if self.sizes.len() >= MAX_BATCH {
            return self.flush();
        }
        Ok(())
    }

    /// A large copy, started now in `pieces` pieces over the stream pool,
    /// one event per piece.
    ///
    /// # Safety
    /// As `stage`.
    unsafe fn start_split(
        &mut self,
        entry: E,
        dst: u64,
        src: u64,
        len: usize,
        pieces: usize,
    ) -> Staged<E> {
        let mut entries = self.entries_vec();
        entries.push(entry);
        // Pieces are multiples of 64 KiB so each stays aligned.
        let piece = len.div_ceil(pieces).next_multiple_of(64 << 10);
        let mut f = InFlight {
            events: [std::ptr::null_mut(); MAX_SPLIT],
            n: 0,
            entries,
            batch: false,
            slot: None,
            timed: None,
            runner: false,
        };
        let mut off = 0;
        let r = (|| {
            cuda()?.make_current(self.ordinal)?;
            while off < len {
                let n = piece.min(len - off);
                let stream = self.next_stream();
                // SAFETY: both ranges are valid for `len` bytes until the
                // entry is returned (the caller's promise in `stage`).
                check("cuMemcpyAsync", unsafe {
                    cu::cuMemcpyAsync(dst + off as u64, src + off as u64, n, stream)
                })?;
                let ev = self.event()?;
                f.events[f.n] = ev;
                f.n += 1;
                // SAFETY: event and stream belong to the current context.
                check("cuEventRecord", unsafe { cu::cuEventRecord(ev, stream) })?;
                off += n;
            }
            Ok(())
        })();
        self.launched(f, r)
    }

    /// Issues every staged copy: one batch call (or one cuMemcpyAsync per
    /// copy without batch support) and one event, on the next stream —
    /// unless `BATCHES_IN_FLIGHT` batches are running: the staged copies
    /// then go with a later flush, after one of them ends (the copier
    /// stays `busy` until they do, so its owner keeps polling).
    pub fn flush(&mut self) -> Staged<E> {
        if self.staged.is_empty()
            || (self.batches >= BATCHES_IN_FLIGHT && self.sizes.len() < MAX_BATCH)
        {
            return Ok(());
        }
        self.issue()
    }

    fn issue(&mut self) -> Staged<E> {
        let mut entries = self.entries_vec();
        std::mem::swap(&mut entries, &mut self.staged);
        let mut f = InFlight {
            events: [std::ptr::null_mut(); MAX_SPLIT],
            n: 0,
            entries,
            batch: true,
            slot: None,
            timed: None,
            runner: false,
        };
        let stream = self.next_stream();
        let r = (|| {
            cuda()?.make_current(self.ordinal)?;
            let count = self.sizes.len();
            // A lone small copy the kernel may make goes to the runner when
            // it is free, unless the engine is forced. Not measured against
            // the engine: the runner is fast only while it stays resident,
            // and a copy sent its way now and then (as `Choice` explores)
            // would find it ended and pay a launch each time, so it could
            // never look faster. (On an H200 a 4 KiB IPC write took 11.5
            // us launched and 6.6 with the runner, `ferry bench --latency
            // --shards 2`.)
            if count == 1
                && self.all_kernel_ok
                && self.sizes[0] <= RUNNER_MAX_BYTES
                && runner::reaches(self.dsts[0], self.srcs[0])
                && !self.choice[0].engine_only()
            {
                let (dst, src, len) = (self.dsts[0], self.srcs[0], self.sizes[0]);
                if let Some(r) = self.free_runner() {
                    // SAFETY: as the gather kernel's launch below: memory
                    // kernels may touch (`kernel_ok`), valid until the
                    // entry returns, which `poll` holds until the runner's
                    // done word (or its failure).
                    unsafe { r.start(dst, src, len) }?;
                    f.runner = true;
                    return Ok(());
                }
            }
            let way = (count > 0 && self.all_kernel_ok)
                .then(|| self.choice[usize::from(count > 1)].pick());
            let slot = match way {
                Some(Way::Kernel) => self.gather_slot(),
                _ => None,
            };
            // Measured the way it really went (no slot: the engine).
            let went = if slot.is_some() {
                Way::Kernel
            } else {
                Way::Engine
            };
            f.timed = way.map(|_| (Instant::now(), count, went));
            f.slot = slot;
            if let Some(slot) = slot {
                let g = self.gather.as_mut().expect("a slot came from it");
                // SAFETY: every range is device or cuMemHostAlloc memory
                // (`kernel_ok` at staging) valid until its entry returns;
                // the slot stays taken until this launch's event fires.
                unsafe { g.launch(slot, &self.dsts, &self.srcs, &self.sizes, stream) }?;
            } else if count > 1 && self.has_batch {
                // SAFETY: zero is a valid value for this plain C struct
                // (location hints "invalid": no hint).
                let mut attr: cu::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
                attr.srcAccessOrder = cu::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
                let mut idx = [0usize];
                // SAFETY: three arrays of `count` entries; every range is
                // valid until its entry returns (the promise in `stage`).
                check("cuMemcpyBatchAsync", unsafe {
                    cu::cuMemcpyBatchAsync_v2(
                        self.dsts.as_mut_ptr(),
                        self.srcs.as_mut_ptr(),
                        self.sizes.as_mut_ptr(),
                        count,
                        &mut attr,
                        idx.as_mut_ptr(),
                        1,
                        stream,
                    )
                })?;
            } else {
                for i in 0..count {
                    // SAFETY: as above, one copy at a time.
                    check("cuMemcpyAsync", unsafe {
                        cu::cuMemcpyAsync(self.dsts[i], self.srcs[i], self.sizes[i], stream)
                    })?;
                }
            }
            let ev = self.event()?;
            f.events[0] = ev;
            f.n = 1;
            // SAFETY: event and stream belong to the current context.
            check("cuEventRecord", unsafe { cu::cuEventRecord(ev, stream) })
        })();
        self.dsts.clear();
        self.srcs.clear();
        self.sizes.clear();
        self.all_kernel_ok = true;
        self.last_span = 0;
        self.launched(f, r)
    }

    /// The runner, loaded on first use, if it is on, loaded and free.
    fn free_runner(&mut self) -> Option<&mut Runner> {
        let idle = self.runner_idle?;
        if self.runner.is_none() {
            match Runner::load(self.ordinal, idle) {
                Ok(r) => self.runner = Some(r),
                Err(e) => {
                    self.runner_idle = None;
                    tracing::warn!(
                        gpu = self.ordinal,
                        "the copy runner did not load ({e}): lone small copies are launched"
                    );
                    return None;
                }
            }
        }
        self.runner.as_mut().filter(|r| r.free())
    }

    /// A descriptor slot of the gather kernel, loading it on first use on
    /// this copier's device; None if it cannot load here (said once; then
    /// `choice` never asks again) or every slot is in use.
    fn gather_slot(&mut self) -> Option<usize> {
        if self.gather.is_none() {
            match Gather::load(self.ordinal, BATCHES_IN_FLIGHT + 2, self.device_descs) {
                Ok(g) => self.gather = Some(g),
                Err(e) => {
                    self.choice.iter_mut().for_each(Choice::no_kernel);
                    tracing::warn!(
                        gpu = self.ordinal,
                        "the gather kernel did not load ({e}): small copies stay on the copy engine"
                    );
                }
            }
        }
        self.gather.as_mut()?.take_slot()
    }

    fn launched(&mut self, mut f: InFlight<E>, r: Result<()>) -> Staged<E> {
        match r {
            Ok(()) => {
                self.batches += usize::from(f.batch);
                self.inflight.push_back(f);
                Ok(())
            }
            Err(e) => {
                // Copies already queued may still run: wait for them before
                // the caller lets go of the memory.
                for &ev in &f.events[..f.n] {
                    // SAFETY: a recorded (or never recorded) event of ours.
                    unsafe { cu::cuEventSynchronize(ev) };
                }
                self.free_events.extend_from_slice(&f.events[..f.n]);
                if let (Some(s), Some(g)) = (f.slot, self.gather.as_mut()) {
                    g.free_slot(s);
                }
                Err((e, std::mem::take(&mut f.entries)))
            }
        }
    }

    /// Hands every finished copy's entry to `out`; returns how many.
    pub fn poll(&mut self, mut out: impl FnMut(E, Result<()>)) -> usize {
        let mut n = 0;
        let mut i = 0;
        while i < self.inflight.len() {
            let f = &mut self.inflight[i];
            let mut result = Ok(());
            let mut ready = true;
            if f.runner {
                match self.runner.as_mut().and_then(Runner::poll) {
                    Some(r) => result = r,
                    None => ready = false,
                }
            }
            while ready && f.n > 0 {
                let ev = f.events[f.n - 1];
                // SAFETY: a live event of this copier.
                let r = unsafe { cu::cuEventQuery(ev) };
                if r == cu::CUresult::CUDA_ERROR_NOT_READY {
                    ready = false;
                    break;
                }
                f.n -= 1;
                self.free_events.push(ev);
                if let Err(e) = check("cuEventQuery", r) {
                    result = Err(e);
                }
            }
            if !ready {
                i += 1;
                continue;
            }
            let mut f = self.inflight.remove(i).expect("index in range");
            self.batches -= usize::from(f.batch);
            if let (Some((t0, count, way)), Ok(())) = (f.timed, &result) {
                self.choice[usize::from(count > 1)].took(way, t0.elapsed(), count);
            }
            if let (Some(s), Some(g)) = (f.slot, self.gather.as_mut()) {
                g.free_slot(s);
            }
            for e in f.entries.drain(..) {
                out(e, result.as_ref().map(|_| ()).map_err(Error::duplicate));
                n += 1;
            }
            self.spare.push(f.entries);
        }
        n
    }
}

impl<E> Drop for Copier<E> {
    fn drop(&mut self) {
        if cuda().and_then(|c| c.make_current(self.ordinal)).is_err() {
            return;
        }
        for &s in &self.streams {
            // SAFETY: waits for and destroys a stream this copier created.
            unsafe {
                cu::cuStreamSynchronize(s);
                cu::cuStreamDestroy_v2(s);
            }
        }
        let in_flight = self.inflight.iter().flat_map(|f| f.events[..f.n].to_vec());
        for e in self.free_events.iter().copied().chain(in_flight) {
            // SAFETY: an event this copier created; its stream is idle.
            unsafe { cu::cuEventDestroy_v2(e) };
        }
    }
}

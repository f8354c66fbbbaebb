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
use crate::error::{Error, Result};

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
    pub fn new(ordinal: i32, streams: usize, way: GpuCopy) -> Result<Self> {
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
            choice: [Choice::forced(way), Choice::forced(way)],
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
        };
        let stream = self.next_stream();
        let r = (|| {
            cuda()?.make_current(self.ordinal)?;
            let count = self.sizes.len();
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

    /// A descriptor slot of the gather kernel, loading it on first use on
    /// this copier's device; None if it cannot load here (said once; then
    /// `choice` never asks again) or every slot is in use.
    fn gather_slot(&mut self) -> Option<usize> {
        if self.gather.is_none() {
            match Gather::load(self.ordinal, BATCHES_IN_FLIGHT + 2) {
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
            while f.n > 0 {
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

/// The two ways a batch of small eligible copies can go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// `cuMemcpyBatchAsync` (or one `cuMemcpyAsync` per copy).
    Engine,
    /// The gather kernel.
    Kernel,
}

/// Which way is faster here, learnt from the batches themselves. The
/// kernel wins by far where the GPU runs this process's work alone (one
/// launch for the batch, every copy in parallel); where another process's
/// context shares the GPU without MPS, every kernel waits for a context
/// switch and the copy engine wins (measured on one H200 shared by the
/// two processes of `ferry bench`: 0.32 against 0.64 GB/s at 4 KiB; with
/// MPS the kernel gave 1.03). So each way keeps a moving average of the
/// time from issue to completion per copy, the faster one takes the
/// batches, and every `EXPLORE_EVERY`-th batch goes the other way so a
/// change (a neighbour that comes or goes) is seen.
#[derive(Debug, Default)]
struct Choice {
    /// Nanoseconds per copy, per way (index `Way as usize`); None: no
    /// sample yet.
    ns_per_copy: [Option<f64>; 2],
    batches: u64,
    kernel_off: bool,
    /// Set by `FERRY_GPU_COPY`: this way, never measured against the other.
    forced: Option<Way>,
}

/// One batch in this many goes the way that is not the faster one.
const EXPLORE_EVERY: u64 = 32;
/// Weight of a new sample in the moving average.
const SAMPLE_WEIGHT: f64 = 0.25;

impl Choice {
    fn forced(way: GpuCopy) -> Self {
        let forced = match way {
            GpuCopy::Auto => None,
            GpuCopy::Kernel => Some(Way::Kernel),
            GpuCopy::Engine => Some(Way::Engine),
        };
        Self {
            forced,
            ..Self::default()
        }
    }

    fn pick(&mut self) -> Way {
        self.batches += 1;
        if self.kernel_off {
            return Way::Engine;
        }
        if let Some(way) = self.forced {
            return way;
        }
        let [engine, kernel] = self.ns_per_copy;
        let (Some(e), Some(k)) = (engine, kernel) else {
            // Each way is tried before either is trusted.
            return if kernel.is_none() {
                Way::Kernel
            } else {
                Way::Engine
            };
        };
        let best = if k <= e { Way::Kernel } else { Way::Engine };
        // The other way is tried so that its cost to the batches stays
        // near 1/EXPLORE_EVERY of theirs: the slower it is, the rarer (the
        // engine ran 4 KiB x 32 at ten times the kernel's time per copy).
        let slower = (k.max(e) / k.min(e).max(1.0)).clamp(1.0, 64.0) as u64;
        if self.batches % (EXPLORE_EVERY * slower) == 0 {
            match best {
                Way::Kernel => Way::Engine,
                Way::Engine => Way::Kernel,
            }
        } else {
            best
        }
    }

    /// A batch of `count` copies that went `way` took `took`.
    fn took(&mut self, way: Way, took: Duration, count: usize) {
        let sample = took.as_nanos() as f64 / count.max(1) as f64;
        let avg = &mut self.ns_per_copy[way as usize];
        *avg = Some(match *avg {
            Some(a) => a + SAMPLE_WEIGHT * (sample - a),
            None => sample,
        });
    }

    /// The kernel cannot load here: always the engine.
    fn no_kernel(&mut self) {
        self.kernel_off = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_faster_way_takes_the_batches_and_the_other_is_still_tried() {
        let mut c = Choice::default();
        // Both tried first.
        assert_eq!(c.pick(), Way::Kernel);
        c.took(Way::Kernel, Duration::from_micros(64), 32);
        assert_eq!(c.pick(), Way::Engine);
        c.took(Way::Engine, Duration::from_micros(32), 32);
        // The engine is faster (1 µs a copy against 2): most batches go there.
        let picks: Vec<Way> = (0..64).map(|_| c.pick()).collect();
        let kernel = picks.iter().filter(|&&w| w == Way::Kernel).count();
        assert!(
            (1..=3).contains(&kernel),
            "{kernel} of 64 explored the kernel"
        );
        // The kernel gets faster (the neighbour left): it takes over.
        for _ in 0..8 {
            c.took(Way::Kernel, Duration::from_micros(8), 32);
        }
        let picks: Vec<Way> = (0..64).map(|_| c.pick()).collect();
        let engine = picks.iter().filter(|&&w| w == Way::Engine).count();
        assert!(
            (1..=3).contains(&engine),
            "{engine} of 64 explored the engine"
        );
        // Without a kernel, always the engine.
        c.no_kernel();
        assert!((0..100).all(|_| c.pick() == Way::Engine));
    }

    #[test]
    fn a_forced_way_is_kept_whatever_it_measures() {
        let mut k = Choice::forced(GpuCopy::Kernel);
        let mut e = Choice::forced(GpuCopy::Engine);
        for _ in 0..4 {
            k.took(Way::Kernel, Duration::from_micros(640), 32);
            k.took(Way::Engine, Duration::from_micros(1), 32);
            e.took(Way::Engine, Duration::from_micros(640), 32);
            e.took(Way::Kernel, Duration::from_micros(1), 32);
        }
        assert!((0..100).all(|_| k.pick() == Way::Kernel));
        assert!((0..100).all(|_| e.pick() == Way::Engine));
        // A kernel that cannot load still gives way to the engine.
        k.no_kernel();
        assert_eq!(k.pick(), Way::Engine);
    }
}

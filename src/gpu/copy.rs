//! Asynchronous copies on a pool of CUDA streams, finished by events that
//! the shard's loop polls (`cuEventQuery`): no thread ever blocks on a
//! stream. A large copy is split across the pool so several copy engines
//! work on it at once.

use cudarc::driver::sys as cu;

use super::driver::{check, cuda};
use crate::error::Result;

/// Pieces one copy is split into at most (one per stream).
pub(crate) const MAX_SPLIT: usize = 8;
/// Copies below this size go on one stream: splitting only adds latency.
pub(crate) const SPLIT_MIN_BYTES: usize = 8 << 20;

/// One copy (of one op's piece) in flight: the events that end it.
pub(crate) struct CopyJob {
    pub slot: u32,
    events: [cu::CUevent; MAX_SPLIT],
    n: usize,
    /// A cached IPC mapping this copy uses, released when it ends.
    pub mapping: Option<super::ipc::MapKey>,
    /// The local registration, alive until the copy ends (deregistration
    /// waits for it).
    pub keep: Option<std::sync::Arc<crate::region::Region>>,
}

/// A device's stream pool and a free list of events. Owned by one shard.
pub(crate) struct Copier {
    ordinal: i32,
    streams: Vec<cu::CUstream>,
    free_events: Vec<cu::CUevent>,
    next_stream: usize,
    split_min: usize,
}

// SAFETY: streams and events are driver handles usable from any thread; a
// Copier is used by one shard at a time (it moves with the shard).
unsafe impl Send for Copier {}
// SAFETY: CopyJob holds event handles only; see Copier.
unsafe impl Send for CopyJob {}

impl Copier {
    pub fn new(ordinal: i32, streams: usize) -> Result<Self> {
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
            split_min: SPLIT_MIN_BYTES,
        })
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
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

    /// Starts copying `len` bytes from `src` to `dst` (any addresses the
    /// driver can reach: device, mapped IPC, pinned or pageable host).
    pub fn start(&mut self, slot: u32, dst: u64, src: u64, len: usize) -> Result<CopyJob> {
        cuda()?.make_current(self.ordinal)?;
        let pieces = if len >= self.split_min {
            self.streams.len()
        } else {
            1
        };
        // Pieces are multiples of 64 KiB so each stays aligned.
        let piece = len.div_ceil(pieces).next_multiple_of(64 << 10);
        let mut job = CopyJob {
            slot,
            events: [std::ptr::null_mut(); MAX_SPLIT],
            n: 0,
            mapping: None,
            keep: None,
        };
        let mut off = 0;
        while off < len || (len == 0 && job.n == 0) {
            let n = piece.min(len - off);
            let stream = self.streams[self.next_stream % self.streams.len()];
            self.next_stream = self.next_stream.wrapping_add(1);
            if n > 0 {
                // SAFETY: the caller guarantees both ranges are live for
                // `len` bytes until the job completes (regions are held by
                // the op, mappings by the job).
                let r = unsafe { cu::cuMemcpyAsync(dst + off as u64, src + off as u64, n, stream) };
                if let Err(e) = check("cuMemcpyAsync", r) {
                    self.finish(job);
                    return Err(e);
                }
            }
            let ev = self.event()?;
            // SAFETY: event and stream belong to the current context.
            check("cuEventRecord", unsafe { cu::cuEventRecord(ev, stream) })?;
            job.events[job.n] = ev;
            job.n += 1;
            off += n;
            if len == 0 {
                break;
            }
        }
        Ok(job)
    }

    /// `Some(Ok)` once every piece of the job is done; `None` while not.
    pub fn query(&mut self, job: &mut CopyJob) -> Option<Result<()>> {
        while job.n > 0 {
            let ev = job.events[job.n - 1];
            // SAFETY: a live event of this copier.
            let r = unsafe { cu::cuEventQuery(ev) };
            if r == cu::CUresult::CUDA_ERROR_NOT_READY {
                return None;
            }
            job.n -= 1;
            self.free_events.push(ev);
            if let Err(e) = check("cuEventQuery", r) {
                return Some(Err(e));
            }
        }
        Some(Ok(()))
    }

    /// Returns a job's events to the free list (after failure or completion).
    pub fn finish(&mut self, mut job: CopyJob) {
        while job.n > 0 {
            job.n -= 1;
            self.free_events.push(job.events[job.n]);
        }
    }
}

impl Drop for Copier {
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
        for &e in &self.free_events {
            // SAFETY: an event this copier created, no longer recorded.
            unsafe { cu::cuEventDestroy_v2(e) };
        }
    }
}

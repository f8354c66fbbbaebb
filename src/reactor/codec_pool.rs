//! The endpoint's codec threads (`FERRY_COMPRESS_THREADS`): they pack and
//! unpack tcp frames (`crate::codec`) so that no shard waits on the codec.
//!
//! A shard hands a job over with `try_submit` (a bounded queue: when it is
//! full the job comes back and the shard settles it itself, see
//! `TcpSide`); a thread runs it and sends its end to the shard's own
//! channel, then wakes the shard if it is parked. The threads stop when the
//! pool (the endpoint and its shards) is dropped.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::codec::Codec;
use crate::error::{ConnId, Error, Result};
use crate::tcp::{CodecCounters, PackMode, PackShared};
use crate::xfer::{CodecJob, CodecOutcome, CodecTicket, CodecWork};

use super::queue::WakeState;

/// Jobs waiting for a thread, endpoint-wide (each stream has at most
/// `PACK_SLOTS` out, so this is rarely reached).
const QUEUE_DEPTH: usize = 1024;
/// What one thread is assumed to pack per second before it has measured
/// itself (zstd level 1 on a byte plane plus the split, a slow core).
const FIRST_RATE_PER_THREAD: u64 = 400_000_000;
/// Peers' packed bytes held at once, endpoint-wide.
const HELD_MAX: usize = 256 << 20;

/// What an endpoint's codec did (`Endpoint::compress_stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CompressStats {
    /// Codec threads running (0: no connection has agreed to compress yet).
    pub threads: usize,
    /// Chunks this side tried to pack.
    pub tried: u64,
    /// Of those, the ones that went packed (the rest did not shrink by
    /// 5 % and went as they were).
    pub packed: u64,
    /// Bytes of the chunks that went packed (their ratio to `wire_bytes`
    /// is what packing saved).
    pub raw_bytes: u64,
    /// Bytes of their packed frames.
    pub wire_bytes: u64,
    /// Packed frames received from peers.
    pub unpacked: u64,
    /// The bytes they decode to.
    pub unpacked_bytes: u64,
    /// Their bytes on the wire.
    pub unpacked_wire_bytes: u64,
}

/// Where a job's end goes: its connection on its shard.
pub(crate) struct Reply {
    /// The connection's slab index in its shard's tcp side, and its id
    /// (a result for an index that now holds another connection is dropped).
    pub idx: usize,
    pub conn: ConnId,
    pub to: Sender<CodecDone>,
    pub wake: Arc<WakeState>,
}

pub(crate) struct CodecDone {
    pub idx: usize,
    pub conn: ConnId,
    pub ticket: CodecTicket,
    pub outcome: CodecOutcome,
}

type Queued = (CodecJob, Reply);

pub(crate) struct CodecPool {
    tx: Option<SyncSender<Queued>>,
    threads: Vec<JoinHandle<()>>,
    shared: PackShared,
}

impl std::fmt::Debug for CodecPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CodecPool")
            .field("threads", &self.threads.len())
            .field("mode", &self.shared.mode)
            .finish()
    }
}

impl CodecPool {
    /// `threads` codec threads, keeping `shared.codec_rate` up to date.
    pub fn new(threads: usize, shared: PackShared) -> Result<Arc<CodecPool>> {
        let (tx, rx) = mpsc::sync_channel::<Queued>(QUEUE_DEPTH);
        let rx = Arc::new(Mutex::new(rx));
        let rate_each = Arc::new(AtomicU64::new(FIRST_RATE_PER_THREAD));
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let rx = rx.clone();
            let (each, total) = (rate_each.clone(), shared.codec_rate.clone());
            let n = threads as u64;
            let h = std::thread::Builder::new()
                .name(format!("ferry-codec-{i}"))
                .spawn(move || work(&rx, &each, &total, n))
                .map_err(|e| Error::io("spawning a codec thread", e))?;
            handles.push(h);
        }
        Ok(Arc::new(CodecPool {
            tx: Some(tx),
            threads: handles,
            shared,
        }))
    }

    /// Queues a job; gives it back (boxed: the rare path) when the queue
    /// is full.
    pub fn try_submit(
        &self,
        job: CodecJob,
        reply: Reply,
    ) -> std::result::Result<(), Box<CodecJob>> {
        let tx = self.tx.as_ref().expect("the sender lives until drop");
        match tx.try_send((job, reply)) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full((job, _)) | TrySendError::Disconnected((job, _))) => {
                Err(Box::new(job))
            }
        }
    }
}

impl Drop for CodecPool {
    fn drop(&mut self) {
        // The threads see the queue close, finish their job and stop.
        drop(self.tx.take());
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Runs one job with `codec` (a pool thread's, or a shard's when the
/// queue was full).
pub(crate) fn run(codec: &mut Codec, work: CodecWork) -> CodecOutcome {
    match work {
        CodecWork::Encode {
            dtype,
            src,
            mut out,
        } => {
            // SAFETY: `src` is host memory of a registration the job holds
            // alive; the op that reads it is in flight until this ends.
            let chunk = unsafe { std::slice::from_raw_parts(src.ptr(), src.len()) };
            let packed = codec.pack(dtype, chunk, &mut out).unwrap_or(false);
            CodecOutcome::Encoded { buf: out, packed }
        }
        CodecWork::Decode { frame, dst } => {
            // SAFETY: `dst` is a checked, writable window of host memory
            // (or our bounce buffer) held alive by the job; the peer's
            // request for it is answered only when this ends.
            let into = unsafe { std::slice::from_raw_parts_mut(dst.ptr(), dst.len()) };
            let result = codec.decode(&frame, into).map(|_| ()).map_err(|e| {
                crate::error::ConnFault::misbehaved(format!(
                    "a packed frame from the peer is bad: {e}"
                ))
            });
            CodecOutcome::Decoded { buf: frame, result }
        }
    }
}

/// This thread's CPU time in seconds.
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to fill; the clock id is a constant.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// A pool thread: jobs until the queue closes. It measures what it packs
/// and keeps the pool's rate (`total`) up to date for `Auto`.
fn work(rx: &Mutex<Receiver<Queued>>, each: &AtomicU64, total: &AtomicU64, threads: u64) {
    let Ok(mut codec) = Codec::new() else {
        tracing::warn!("a codec thread could not make its zstd contexts; it stops");
        return;
    };
    loop {
        let next = rx.lock().map(|r| r.recv());
        let Ok(Ok((job, reply))) = next else { return };
        let bytes = match &job.work {
            CodecWork::Encode { src, .. } => src.len(),
            CodecWork::Decode { .. } => 0,
        };
        // The thread's own CPU time, not the wall clock: a codec thread
        // preempted on a busy host would otherwise look slow and turn
        // `auto` off exactly where the cores are the link's equal.
        let t0 = thread_cpu_s();
        let outcome = run(&mut codec, job.work);
        if bytes >= 1 << 20 {
            let rate = bytes as f64 / (thread_cpu_s() - t0).max(1e-6);
            let old = each.load(Ordering::Relaxed) as f64;
            let new = (0.8 * old + 0.2 * rate) as u64;
            each.store(new, Ordering::Relaxed);
            total.store(new.saturating_mul(threads), Ordering::Relaxed);
        }
        let done = CodecDone {
            idx: reply.idx,
            conn: reply.conn,
            ticket: job.ticket,
            outcome,
        };
        if reply.to.send(done).is_ok() {
            reply.wake.wake_if_parked();
        }
    }
}

/// The pool an endpoint may need: started by the first codec job, so an
/// endpoint that never packs nor unpacks a frame has no codec thread.
#[derive(Debug)]
pub(crate) struct LazyCodecPool {
    threads: usize,
    pool: std::sync::OnceLock<Option<Arc<CodecPool>>>,
    shared: PackShared,
}

impl LazyCodecPool {
    /// `threads` 0: half the cores, 1 to 8.
    pub fn new(mode: PackMode, threads: usize) -> Arc<LazyCodecPool> {
        let threads = if threads == 0 {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / 2).clamp(1, 8)
        } else {
            threads
        };
        Arc::new(LazyCodecPool {
            threads,
            pool: std::sync::OnceLock::new(),
            shared: PackShared {
                mode,
                codec_rate: Arc::new(AtomicU64::new(FIRST_RATE_PER_THREAD * threads as u64)),
                held: Arc::new(AtomicUsize::new(0)),
                held_max: HELD_MAX,
                stats: Arc::<CodecCounters>::default(),
            },
        })
    }

    /// What the codec did so far, and the threads it has (0: not started).
    pub fn stats(&self) -> CompressStats {
        use std::sync::atomic::Ordering::Relaxed;
        let s = &self.shared.stats;
        CompressStats {
            threads: match self.pool.get() {
                Some(Some(_)) => self.threads,
                _ => 0,
            },
            tried: s.tried.load(Relaxed),
            packed: s.packed.load(Relaxed),
            raw_bytes: s.raw_bytes.load(Relaxed),
            wire_bytes: s.wire_bytes.load(Relaxed),
            unpacked: s.unpacked.load(Relaxed),
            unpacked_bytes: s.unpacked_bytes.load(Relaxed),
            unpacked_wire_bytes: s.unpacked_wire_bytes.load(Relaxed),
        }
    }

    /// What every stream that packs shares (no thread is started for it).
    pub fn shared(&self) -> &PackShared {
        &self.shared
    }

    /// The pool, started by the first codec job; None if its threads could
    /// not be (the shards then run their jobs themselves).
    pub fn get(&self) -> Option<Arc<CodecPool>> {
        self.pool
            .get_or_init(|| match CodecPool::new(self.threads, self.shared.clone()) {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::warn!("no codec threads; shards run codec jobs themselves: {e}");
                    None
                }
            })
            .clone()
    }
}

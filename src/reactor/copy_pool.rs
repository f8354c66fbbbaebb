//! The endpoint's copy threads (`FERRY_COPY_THREADS`): one large same-host
//! host-memory copy (a 64 MiB WRITE or READ) is cut into slices that these
//! threads copy beside the shard that owns the request, so one op uses the
//! cores a machine has (one core moves ~7–10 GB/s; eight, ~30).
//!
//! A shard hands a slice over with `try_submit` (a bounded queue: a slice
//! that finds it full comes back and the shard copies it itself). A slice
//! counts itself done in its request's `CopyJoin`, which the owning shard
//! polls (it does not park while a join is open), so no thread needs to
//! wake it. Started by the first slice; the threads stop when the pool (the
//! endpoint and its shards) is dropped.

use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use super::queue::CopySlice;
use crate::error::Result;

/// Slices waiting for a thread, endpoint-wide.
const QUEUE_DEPTH: usize = 256;
/// A copy is cut into slices of at least this much: a shorter one is
/// copied faster than a thread is woken for it.
pub(crate) const SLICE_MIN_BYTES: usize = 1 << 20;

pub(crate) struct CopyPool {
    tx: Option<SyncSender<CopySlice>>,
    threads: Vec<JoinHandle<()>>,
}

impl CopyPool {
    fn new(threads: usize) -> Result<CopyPool> {
        let (tx, rx) = mpsc::sync_channel::<CopySlice>(QUEUE_DEPTH);
        let rx = Arc::new(Mutex::new(rx));
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let rx = rx.clone();
            let h = std::thread::Builder::new()
                .name(format!("ferry-copy-{i}"))
                .spawn(move || work(&rx))
                .map_err(|e| crate::error::Error::io("spawning a copy thread", e))?;
            handles.push(h);
        }
        Ok(CopyPool {
            tx: Some(tx),
            threads: handles,
        })
    }

    /// Queues `s` for a copy thread; gives it back when the queue is full.
    pub fn try_submit(&self, s: CopySlice) -> std::result::Result<(), CopySlice> {
        let tx = self.tx.as_ref().expect("open until dropped");
        tx.try_send(s).map_err(|e| match e {
            TrySendError::Full(s) | TrySendError::Disconnected(s) => s,
        })
    }
}

fn work(rx: &Mutex<Receiver<CopySlice>>) {
    loop {
        // The lock is held only while waiting for the next slice, never
        // while copying: the other threads take the next ones meanwhile.
        let next = rx.lock().map(|r| r.recv());
        match next {
            Ok(Ok(s)) => s.run(),
            _ => return,
        }
    }
}

impl Drop for CopyPool {
    fn drop(&mut self) {
        // Closing the channel ends every thread once the queue is empty.
        self.tx = None;
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// The pool an endpoint may need: started by the first large copy, so an
/// endpoint that never serves one has no copy thread.
pub(crate) struct LazyCopyPool {
    /// Threads sharing one copy, the owning shard included.
    share: usize,
    pool: OnceLock<Option<CopyPool>>,
}

impl std::fmt::Debug for LazyCopyPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyCopyPool")
            .field("share", &self.share)
            .field("started", &matches!(self.pool.get(), Some(Some(_))))
            .finish()
    }
}

impl LazyCopyPool {
    /// `threads`: how many share one copy, the shard included (0: half
    /// the cores, at most 8; 1: the shard alone, no pool).
    pub fn new(threads: usize) -> Option<Arc<LazyCopyPool>> {
        let share = if threads == 0 {
            default_share(std::thread::available_parallelism().map_or(1, |n| n.get()))
        } else {
            threads
        };
        (share > 1).then(|| {
            Arc::new(LazyCopyPool {
                share,
                pool: OnceLock::new(),
            })
        })
    }

    /// Threads that share one copy, the shard included.
    pub fn share(&self) -> usize {
        self.share
    }

    /// The pool, started by the first slice; None if its threads could not
    /// be (the shard then copies whole).
    pub fn get(&self) -> Option<&CopyPool> {
        self.pool
            .get_or_init(|| match CopyPool::new(self.share - 1) {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::warn!("no copy threads; large copies run on their shard: {e}");
                    None
                }
            })
            .as_ref()
    }
}

/// Threads sharing one copy by default on a machine of `cores`: half of
/// them (the other half run the peer and the shards), at most 8 — past
/// that a copy is bound by memory, not cores.
pub(crate) fn default_share(cores: usize) -> usize {
    (cores / 2).clamp(1, 8)
}

/// How many slices a copy of `len` bytes is cut into, sharing it among
/// `share` threads: none shorter than `SLICE_MIN_BYTES`.
pub(crate) fn slices(len: usize, share: usize) -> usize {
    (len / SLICE_MIN_BYTES).clamp(1, share.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_half_the_cores_up_to_eight() {
        assert_eq!(default_share(1), 1);
        assert_eq!(default_share(2), 1);
        assert_eq!(default_share(16), 8);
        assert_eq!(default_share(128), 8);
        assert!(LazyCopyPool::new(1).is_none(), "1: the shard alone");
        assert_eq!(LazyCopyPool::new(3).unwrap().share(), 3);
    }

    #[test]
    fn no_slice_is_shorter_than_the_minimum() {
        assert_eq!(slices(SLICE_MIN_BYTES - 1, 8), 1);
        assert_eq!(slices(2 * SLICE_MIN_BYTES, 8), 2);
        assert_eq!(slices(64 << 20, 8), 8);
        assert_eq!(slices(64 << 20, 1), 1);
    }
}

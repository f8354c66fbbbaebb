//! GPU facts the rest of the engine names: where a registration's bytes
//! live, and the IPC counters.

use std::sync::atomic::{AtomicU64, Ordering};

/// Where the bytes of a registration live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    /// Ordinary (pageable) host memory, or no driver to say otherwise.
    Host,
    /// Host memory the driver has pinned (page-locked); GPUs reach it by DMA.
    Pinned,
    /// Memory of GPU `ordinal`, inside the allocation `[alloc_base,
    /// alloc_base + alloc_len)` (from the driver, not assumed).
    Device {
        /// The GPU's ordinal.
        ordinal: i32,
        /// The start of the allocation holding it.
        alloc_base: u64,
        /// The allocation's length.
        alloc_len: usize,
    },
}

impl MemKind {
    /// Whether it is GPU memory.
    pub fn is_device(&self) -> bool {
        matches!(self, MemKind::Device { .. })
    }
}

/// IPC counters, shared by an endpoint's shards (read by `Endpoint::ipc_stats`).
#[derive(Debug, Default)]
pub(crate) struct IpcCounters {
    pub opens: AtomicU64,
    pub hits: AtomicU64,
    pub closes: AtomicU64,
    pub same_process: AtomicU64,
}

/// A snapshot of the IPC counters of one endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IpcStats {
    /// `cuIpcOpenMemHandle` calls (cache misses).
    pub opens: u64,
    /// Operations that found their mapping already open.
    pub hits: u64,
    /// `cuIpcCloseMemHandle` calls.
    pub closes: u64,
    /// Operations on memory of this same process (no handle opened).
    pub same_process: u64,
    /// Mappings open now (`opens - closes`).
    pub open_now: u64,
}

impl IpcCounters {
    pub fn snapshot(&self) -> IpcStats {
        let opens = self.opens.load(Ordering::Relaxed);
        let closes = self.closes.load(Ordering::Relaxed);
        IpcStats {
            opens,
            hits: self.hits.load(Ordering::Relaxed),
            closes,
            same_process: self.same_process.load(Ordering::Relaxed),
            open_now: opens.saturating_sub(closes),
        }
    }
}

//! The transport-neutral contract: what an operation in flight is, where a
//! transport reports what it finished, and the copy requests it hands to the
//! GPU layer. tcp, shm and verbs use these types; none of them owns them,
//! so transports never import each other.
//!
//! A transport engine is driven by its shard. It reports through a [`Sink`]:
//! one call per finished frame of an operation (`done`), notifications that
//! arrived, and requests that need a CUDA copy — a same-host peer's request
//! on GPU memory ([`GpuReq`]) or a tcp frame staged through a pinned bounce
//! buffer ([`Stage`]). The shard answers those when the copy ends.

#[cfg(test)]
pub(crate) mod testing;

use std::sync::Arc;
use std::time::Instant;

use crate::error::{ConnId, Error, OpKind, Result};
use crate::region::{Region, RegionSlice};
use crate::sys::Mapping;
use crate::wire::{IpcRef, Status};

/// Where a stream reports what it finished.
pub(crate) trait Sink {
    /// One request frame of operation `slot` ended.
    fn done(&mut self, slot: u32, result: Result<()>);
    /// A peer's request was checked: `len` its bytes when it passed (it is
    /// served), `None` when refused (for the metrics).
    fn served(&mut self, _write: bool, _len: Option<u64>) {}
    /// A notification arrived; hand it back if the inbox is full.
    fn notify(&mut self, payload: Vec<u8>) -> Result<(), Vec<u8>>;
    /// The peer deregistered IPC-exported GPU memory at `alloc_base`.
    fn ipc_revoked(&mut self, _alloc_base: u64) {}
    /// Takes a same-host request that needs a CUDA copy; `false` when this
    /// sink cannot (the request is then refused with `DeviceMemory`).
    fn gpu_copy(&mut self, _req: GpuReq) -> bool {
        false
    }
    /// Takes a large host copy to spread over the shards; gives it back
    /// when this sink copies alone (the caller then copies inline).
    fn host_copy(&mut self, req: HostCopy) -> Result<(), HostCopy> {
        Err(req)
    }
    /// Takes a large run of small CMA copies to spread over copy threads;
    /// gives it back when this sink copies alone.
    fn cma_batch(&mut self, batch: CmaBatch) -> Result<(), CmaBatch> {
        Err(batch)
    }
    /// A pinned bounce buffer of at least `len` bytes, for GPU memory on
    /// the tcp path.
    fn bounce(&mut self, _len: usize) -> Bounce {
        Bounce::Never
    }
    /// Starts the CUDA copy a staged frame needs (see `Stage`).
    fn gpu_stage(&mut self, _stage: Stage) {}
}

/// What `Sink::bounce` found.
pub(crate) enum Bounce {
    Ready(Arc<Region>),
    /// All in use: try again once some copy or send finishes.
    Busy,
    /// No GPU path here: GPU memory cannot go over tcp.
    Never,
}

/// A CUDA copy between GPU memory and a bounce buffer for a tcp frame.
/// With `gate` set it releases that gated frame of stream `stream` when
/// done (a WriteAck after the bounce→GPU copy, a ReadResp after GPU→bounce);
/// with `gate` 0 it completes one frame of op `slot` (a READ that landed in
/// a bounce buffer, copied on into GPU memory).
/// The two slices are equally long and alive until the copy ends.
pub(crate) struct Stage {
    pub stream: u8,
    pub gate: u64,
    pub slot: u32,
    pub dst: RegionSlice,
    pub src: RegionSlice,
}

/// A request sent and not yet answered (the shm path uses it too).
pub(crate) struct PendingOp {
    pub slot: u32,
    pub kind: OpKind,
    /// Local memory: the source of a WRITE, the destination of a READ;
    /// held alive while the peer reads from or writes to it.
    pub local: RegionSlice,
    pub rkey: u32,
    pub addr: u64,
    pub sent_at: Instant,
    /// A READ received into a bounce buffer (`local`) goes on into this
    /// GPU memory before the op completes.
    pub post: Option<RegionSlice>,
}

impl PendingOp {
    /// The operation's result, given the status its target answered.
    pub fn outcome(&self, status: Status) -> Result<()> {
        if status == Status::Ok {
            return Ok(());
        }
        Err(Error::Remote {
            op: self.kind,
            status,
            rkey: self.rkey,
            addr: self.addr,
            len: self.local.len() as u64,
        })
    }
}

/// The initiator's side of a copy the target does with CUDA.
pub(crate) enum Theirs {
    /// GPU memory of the peer, to be mapped through its IPC handle.
    Ipc(IpcRef),
    /// The peer's memfd memory mapped here: the address, and the mapping,
    /// held until the copy ends (a peer's new mapping or its departure
    /// cannot unmap it under the DMA engine).
    Host(*mut u8, Arc<Mapping>),
}

/// A same-host request that needs a CUDA copy (a GPU side): checked like
/// any request, then handed to the shard, which replies when it is done.
pub(crate) struct GpuReq {
    pub conn: ConnId,
    pub peer_id: u64,
    pub peer_pid: u32,
    pub op_id: u64,
    pub write: bool,
    /// Our memory, as the request's key check found it.
    pub ours: RegionSlice,
    pub theirs: Theirs,
}

// SAFETY: the one raw pointer (`Theirs::Host`) is an address for a CUDA
// copy into a peer mapping the request holds; nothing dereferences it here.
unsafe impl Send for GpuReq {}

/// A large same-host copy between our memory and a peer's, which the shard
/// spreads over its sibling shards (each copies a slice) and answers once
/// every slice is done.
pub(crate) struct HostCopy {
    pub conn: ConnId,
    pub op_id: u64,
    /// The peer writes into `ours` (else reads from it).
    pub write: bool,
    pub ours: RegionSlice,
    pub theirs: PeerBytes,
}

/// A run of checked same-host requests of one direction, each copied with
/// CMA between one of our slices and the peer process's address: many
/// small pieces (a KV-cache request of 4 KiB blocks) that the shard cuts
/// into jobs for the copy threads, answering each request once its job
/// is done.
pub(crate) struct CmaBatch {
    pub conn: ConnId,
    /// The peer process.
    pub pid: u32,
    /// The peer writes into ours (else reads from it).
    pub write: bool,
    /// (request's op id, our slice, the peer's address), in order.
    pub pieces: Vec<(u64, RegionSlice, u64)>,
}

/// The least one job of a `CmaBatch` copies: a shorter one copies faster
/// than a thread wakes for it. A run is handed over from twice this.
pub(crate) const CMA_JOB_MIN_BYTES: usize = 256 << 10;

/// What a shard spreads over its copy threads or sibling shards.
pub(crate) enum HostWork {
    One(HostCopy),
    Cma(CmaBatch),
}

/// Where the peer's side of a `HostCopy` is, `ours.len()` bytes long.
#[derive(Clone)]
pub(crate) enum PeerBytes {
    /// At byte `off` of its memfd memory mapped here (the mapping kept
    /// alive with it).
    Mapped { map: Arc<Mapping>, off: usize },
    /// At `addr` in process `pid`, reached with process_vm_readv/writev.
    Process { pid: u32, addr: u64 },
}

impl PeerBytes {
    /// The same place, `by` bytes further on.
    pub fn at(&self, by: usize) -> PeerBytes {
        match self {
            PeerBytes::Mapped { map, off } => PeerBytes::Mapped {
                map: map.clone(),
                off: off + by,
            },
            PeerBytes::Process { pid, addr } => PeerBytes::Process {
                pid: *pid,
                addr: addr + by as u64,
            },
        }
    }
}

/// Progress through an op's parts when it is queued piece by piece (it
/// may stall on a full stream and resume on a later pass).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Progress {
    /// The part being queued, and the offset in it.
    pub desc: usize,
    pub off: usize,
    /// Pieces queued so far.
    pub emitted: u32,
}

impl Progress {
    /// The length of the next tcp frame of a part of `part_len` bytes.
    pub fn frame_len(&self, part_len: usize, chunk: usize) -> usize {
        chunk.min(part_len - self.off)
    }

    /// One more piece of `n` bytes of the current part (of `part_len`)
    /// is queued.
    pub fn advance(&mut self, n: usize, part_len: usize) {
        self.emitted += 1;
        self.off += n;
        if self.off >= part_len {
            self.desc += 1;
            self.off = 0;
        }
    }
}

/// Which frame a codec job belongs to, so its end finds it: stream
/// `stream`'s gated frame `gate` (a packed request or response waiting for
/// its bytes, a WriteAck waiting for the decode), or with `gate` 0 one
/// frame of op `slot` (a READ's packed data, decoded into its memory, and
/// copied on into GPU memory `post` when it landed in a bounce buffer).
pub(crate) struct CodecTicket {
    pub stream: u8,
    pub gate: u64,
    pub slot: u32,
    /// (GPU memory, the bounce buffer the READ was decoded into).
    pub post: Option<(RegionSlice, RegionSlice)>,
    /// A peer's packed bytes counted against the endpoint's bound until
    /// the job's end is handled (or dropped).
    pub _held: Option<Held>,
}

/// Bytes counted in a shared total while this lives.
pub(crate) struct Held {
    n: usize,
    of: Arc<std::sync::atomic::AtomicUsize>,
}

impl Held {
    /// Counts `n` more bytes in `of` unless that passes `max` (one claim
    /// is let through when nothing is held, so a lone frame never waits).
    pub fn claim(of: &Arc<std::sync::atomic::AtomicUsize>, n: usize, max: usize) -> Option<Held> {
        use std::sync::atomic::Ordering::Relaxed;
        let before = of.fetch_add(n, Relaxed);
        if before > 0 && before + n > max {
            of.fetch_sub(n, Relaxed);
            return None;
        }
        Some(Held { n, of: of.clone() })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.of
            .fetch_sub(self.n, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Work for the codec pool: it runs off the shard, which goes on polling.
pub(crate) enum CodecWork {
    /// Pack `src` (values of `dtype`) into `out` (a spare buffer).
    Encode {
        dtype: crate::codec::FloatType,
        src: RegionSlice,
        out: Vec<u8>,
    },
    /// Unpack a peer's codec frame into `dst` (its length is the request's).
    Decode { frame: Vec<u8>, dst: RegionSlice },
}

pub(crate) struct CodecJob {
    pub ticket: CodecTicket,
    pub work: CodecWork,
}

/// What a codec job came back with; its buffer returns either way.
pub(crate) enum CodecOutcome {
    /// `buf` is the frame when `packed`; else the chunk did not shrink
    /// enough and goes as it is (`buf` is spare again).
    Encoded { buf: Vec<u8>, packed: bool },
    /// The frame (spare again) and whether it decoded exactly into place.
    Decoded {
        buf: Vec<u8>,
        result: std::result::Result<(), crate::error::ConnFault>,
    },
}

//! What other threads send a shard, and the handle they send it through.

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Sender, SyncSender};
use std::sync::Arc;

use super::cmd_ring::{CmdRing, PushError};

use crate::error::{ConnId, Error, OpKind, Result};
use crate::region::{Region, RegionSlice};
use crate::tcp::StreamLimits;
use crate::xfer::PeerBytes;

/// One contiguous piece of a one-sided operation.
pub(crate) struct OpDesc {
    /// Our side, checked against its registration when the op was made.
    pub local: RegionSlice,
    pub remote_addr: u64,
    pub rkey: u32,
    /// The advertised key's tag (RemoteBuf reserved bytes 0..8).
    pub tag: u64,
    /// The advertiser marked the window as GPU memory.
    pub remote_device: bool,
    /// The window's RDMA rkeys (one per NIC of the advertiser), when its
    /// NICs registered it.
    pub nic_rkeys: Option<crate::wire::NicKeys>,
    /// What the bytes are, for the codec: the window's advertised type,
    /// else our region's (None: plain bytes on the wire).
    pub dtype: Option<crate::codec::FloatType>,
}

impl OpDesc {
    /// Bytes it moves.
    pub fn len(&self) -> u64 {
        self.local.len() as u64
    }

    /// `len` bytes of it from `off` (both sides moved alike); the caller
    /// keeps `off + len <= self.len()`.
    pub fn piece(&self, off: u64, len: u64) -> OpDesc {
        OpDesc {
            local: self
                .local
                .sub(off as usize, len as usize)
                .expect("a piece lies inside its op"),
            remote_addr: self.remote_addr + off,
            rkey: self.rkey,
            tag: self.tag,
            remote_device: self.remote_device,
            nic_rkeys: self.nic_rkeys,
            dtype: self.dtype,
        }
    }
}

impl crate::tcp::conn::FramePart for OpDesc {
    fn local(&self) -> &RegionSlice {
        &self.local
    }

    fn dtype(&self) -> Option<crate::codec::FloatType> {
        self.dtype
    }

    fn key(&self) -> crate::region::KeyRef {
        crate::region::KeyRef {
            rkey: self.rkey,
            tag: self.tag,
        }
    }

    fn remote_addr(&self) -> u64 {
        self.remote_addr
    }
}

pub(crate) enum OpParts {
    One(OpDesc),
    Many(Vec<OpDesc>),
}

impl OpParts {
    /// The bytes the op moves.
    #[inline]
    pub fn bytes(&self) -> u64 {
        match self {
            OpParts::One(d) => d.len(),
            OpParts::Many(v) => v.iter().map(|d| d.len()).sum(),
        }
    }

    pub fn as_slice(&self) -> &[OpDesc] {
        match self {
            OpParts::One(d) => std::slice::from_ref(d),
            OpParts::Many(v) => v,
        }
    }
}

pub(crate) struct OpCmd {
    pub conn: ConnId,
    pub kind: OpKind,
    pub slot: u32,
    pub parts: OpParts,
    /// How far the op is queued.
    pub at: super::plan::Progress,
    /// The pieces it was counted with in the ledger (and against its
    /// connection's in-flight limit), once counted: an op that stalls
    /// before its first piece is retried, and must not count twice; one
    /// whose connection dies meanwhile fails exactly the rest.
    pub total: Option<u32>,
}

/// One piece of a CUDA IPC operation: a local slice and the peer's window.
pub(crate) struct IpcDesc {
    pub local: RegionSlice,
    pub remote: crate::wire::IpcBuf,
}

pub(crate) enum IpcParts {
    One(IpcDesc),
    Many(Vec<IpcDesc>),
    /// A prepared op: its plan, and a slice over each of its local regions
    /// (held until the copies end). One piece for the ledger: its copies
    /// go in one batch and end together.
    Planned {
        plan: std::sync::Arc<IpcPlan>,
        keep: Vec<RegionSlice>,
    },
    /// A copy between two slices of this endpoint's own GPU memory (a
    /// two-sided message out of its bounce slot: `endpoint::two_sided`),
    /// `src` into `dst`, no peer memory involved; the kind is ignored.
    Local {
        dst: RegionSlice,
        src: RegionSlice,
    },
}

impl IpcParts {
    pub fn len(&self) -> usize {
        match self {
            IpcParts::One(_) => 1,
            IpcParts::Many(v) => v.len(),
            IpcParts::Planned { .. } | IpcParts::Local { .. } => 1,
        }
    }

    /// The bytes the op moves.
    pub fn bytes(&self) -> u64 {
        match self {
            IpcParts::One(d) => d.local.len() as u64,
            IpcParts::Many(v) => v.iter().map(|d| d.local.len() as u64).sum(),
            IpcParts::Planned { plan, .. } => plan.bytes,
            IpcParts::Local { dst, .. } => dst.len() as u64,
        }
    }
}

/// A CUDA IPC op checked once (`Endpoint::prepare`) and posted any number
/// of times: its pieces by index into its distinct local regions and peer
/// allocations, so a post copies and checks nothing per piece.
#[derive(Debug)]
pub(crate) struct IpcPlan {
    /// The peer's allocations, each a window from its start (offset 0).
    pub remotes: Vec<crate::wire::IpcBuf>,
    /// Per local region (in the order of `IpcParts::Planned::keep`): its
    /// GPU, or -1 for host memory.
    pub region_gpu: Vec<i32>,
    pub pieces: Vec<PlannedPiece>,
    /// Their lengths summed.
    pub bytes: u64,
}

/// One piece of an `IpcPlan`, each below `gpu::copy::SPLIT_MIN_BYTES`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlannedPiece {
    /// Our bytes' address (inside region `region`, checked).
    pub local: u64,
    pub region: u32,
    /// The peer's allocation (index into `remotes`) and the offset in it.
    pub remote: u32,
    pub remote_off: u64,
    pub len: u64,
}

/// A write_ipc/read_ipc: the initiator copies itself, on device `ordinal`'s
/// streams, into or out of the peer's mapped GPU memory.
pub(crate) struct IpcCmd {
    pub conn: ConnId,
    pub kind: OpKind,
    pub slot: u32,
    pub ordinal: i32,
    pub parts: IpcParts,
}

/// Ops one command carries at most (a batch's ops for one shard go in
/// commands of up to this many): the queue's depth in commands then bounds
/// the ops queued at `MAX_BATCH` times it.
pub(crate) const MAX_BATCH: usize = 64;

pub(crate) enum Command {
    Op(OpCmd),
    /// Several ops at once (an [`Endpoint::batch`](crate::Endpoint::batch)'s
    /// for this shard): one queue push and one wake for all, each then
    /// handled as if it came alone. At most `MAX_BATCH`.
    Ops(Vec<OpCmd>),
    Ipc(IpcCmd),
    AddConn {
        /// The shard's id for it ...
        conn: ConnId,
        /// ... and the application's (differs for one lane of a connection
        /// spread over shards).
        group: ConnId,
        /// When any lane of the connection last moved bytes (lanes only).
        activity: Option<Arc<crate::sys::Activity>>,
        streams: Vec<TcpStream>,
        limits: StreamLimits,
        /// RDMA queue pairs, when both sides set them up.
        verbs: Option<Box<crate::verbs::DynLink>>,
        /// Each stream's frame MACs (authenticated connections); empty: none.
        macs: Vec<crate::tcp::Integrity>,
    },
    AddLocal(Box<crate::shm::local::LocalConn>),
    /// One slice of another shard's large same-host copy.
    CopySlice(CopySlice),
    /// Drops a connection, failing what is under way on it with the
    /// reason given; the sender (if any) hears once it is gone.
    RemoveConn(ConnId, Option<SyncSender<()>>, &'static str),
    Notify {
        conn: ConnId,
        payload: Vec<u8>,
        /// The application's count of this connection's notifications
        /// not yet sent (None: one of ferry's own, bounded otherwise).
        ticket: Option<NoteTicket>,
    },
}

/// One notification counted in its connection's outbox
/// (`FERRY_NOTIFY_OUTBOX`): the count drops when the ticket does — once
/// the stream or ring took the notification, or the connection is gone.
pub(crate) struct NoteTicket(Arc<AtomicUsize>);

impl NoteTicket {
    /// Takes a place in `outbox` if fewer than `max` are taken; else the
    /// count there now.
    pub fn take(outbox: &Arc<AtomicUsize>, max: usize) -> std::result::Result<Self, usize> {
        let was = outbox.fetch_add(1, Ordering::AcqRel);
        if was >= max {
            outbox.fetch_sub(1, Ordering::AcqRel);
            return Err(was);
        }
        Ok(NoteTicket(outbox.clone()))
    }
}

impl Drop for NoteTicket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Command {
    /// Takes a count of the region of each borrowed slice in the op(s):
    /// the shard does it as it takes the command from its queue.
    pub fn adopt(&mut self) {
        let ops: &mut [OpCmd] = match self {
            Command::Op(op) => std::slice::from_mut(op),
            Command::Ops(ops) => ops,
            _ => return,
        };
        for op in ops {
            match &mut op.parts {
                OpParts::One(d) => d.local.adopt(),
                OpParts::Many(v) => v.iter_mut().for_each(|d| d.local.adopt()),
            }
        }
    }

    /// How many commands this counts as in a shard's per-pass budget.
    pub fn weight(&self) -> usize {
        match self {
            Command::Ops(ops) => ops.len(),
            _ => 1,
        }
    }

    /// The connection a command may wait on for room (an op or a
    /// notification on a full stream or ring); `None` for those that never
    /// wait.
    pub fn waits_on(&self) -> Option<ConnId> {
        match self {
            Command::Op(op) => Some(op.conn),
            Command::Notify { conn, .. } => Some(*conn),
            _ => None,
        }
    }
}

/// Emptied vectors of `Command::Ops` that a shard hands back for the next
/// batch, so that a thread posting batches allocates nothing in the steady
/// state (a vector allocated by the submitter and freed by the shard
/// moved memory between threads' allocator caches on every batch). A
/// fixed line of pointers, no lock: `give` drops a vector when the line is
/// full, `take` allocates when it is empty. Only vectors of exactly
/// `MAX_BATCH` capacity travel (their layout is then known).
pub(crate) struct BatchBufs {
    slots: crate::sync::Padded<[std::sync::atomic::AtomicPtr<OpCmd>; 8]>,
}

impl Default for BatchBufs {
    fn default() -> Self {
        BatchBufs {
            slots: crate::sync::Padded(Default::default()),
        }
    }
}

impl BatchBufs {
    /// An empty vector with room for `MAX_BATCH` ops.
    pub fn take(&self) -> Vec<OpCmd> {
        use std::sync::atomic::Ordering;
        for s in self.slots.iter() {
            // A load first: an empty slot costs no locked instruction.
            if s.load(Ordering::Relaxed).is_null() {
                continue;
            }
            let p = s.swap(std::ptr::null_mut(), Ordering::Acquire);
            if !p.is_null() {
                // SAFETY: `give` stored the pointer of an emptied vector of
                // capacity MAX_BATCH and forgot it; the swap made it ours
                // alone (Acquire: after the shard's last use of it).
                return unsafe { Vec::from_raw_parts(p, 0, MAX_BATCH) };
            }
        }
        Vec::with_capacity(MAX_BATCH)
    }

    #[cfg(all(test, not(loom)))]
    fn kept(&self) -> usize {
        let n = self.slots.iter();
        n.filter(|s| !s.load(std::sync::atomic::Ordering::Relaxed).is_null())
            .count()
    }

    /// Keeps `v`'s memory for a later `take` (its ops already taken).
    pub fn give(&self, mut v: Vec<OpCmd>) {
        use std::sync::atomic::Ordering;
        v.clear();
        if v.capacity() != MAX_BATCH {
            return;
        }
        let mut v = std::mem::ManuallyDrop::new(v);
        let p = v.as_mut_ptr();
        for s in self.slots.iter() {
            if s.load(Ordering::Relaxed).is_null()
                && s.compare_exchange(
                    std::ptr::null_mut(),
                    p,
                    Ordering::Release,
                    Ordering::Relaxed,
                )
                .is_ok()
            {
                return;
            }
        }
        // The line is full: free it after all.
        // SAFETY: `v` is not used again (ManuallyDrop kept it alive only
        // for a slot).
        unsafe { std::mem::ManuallyDrop::drop(&mut v) };
    }
}

impl Drop for BatchBufs {
    fn drop(&mut self) {
        for s in self.slots.0.iter_mut() {
            let p = std::mem::replace(s.get_mut(), std::ptr::null_mut());
            if !p.is_null() {
                // SAFETY: as in `take`; we own the struct, nobody else can.
                drop(unsafe { Vec::from_raw_parts(p, 0, MAX_BATCH) });
            }
        }
    }
}

/// Registration changes, on their own queue so that a shard can always
/// apply them, even while its operation queue is stalled.
pub(crate) enum RegionCmd {
    Add(Arc<Region>),
    /// A key for one window of a region, usually for one connection only.
    Grant {
        rkey: u32,
        grant: crate::region::Grant,
    },
    /// Deregistration of a key. Applied once the shard has taken every
    /// command queued before it was sent (its queue's position `after`):
    /// ops queued with borrowed slices of the region are adopted by then.
    Remove {
        rkey: u32,
        after: u64,
    },
    /// This endpoint deregistered IPC-exported GPU memory: same-host peers
    /// must close their mappings of the allocation at this base. On this
    /// channel, not the bounded command queue, so it is never refused:
    /// one per deregistration, so the application's calls bound them.
    RevokeIpc(u64),
}

/// How submitters wake a shard.
pub(crate) struct WakeState {
    /// The shard's commands; its tail word holds the shard's park bit
    /// (`cmd_ring.rs`).
    pub cmds: CmdRing<Command>,
    /// Set after each registration change is sent (`ShardHandle::region`):
    /// the shard looks at that channel only then (a `try_recv` on every
    /// pass was ~3 % of an idle shard's samples, `perf` on 16 cores).
    pub regions_dirty: AtomicBool,
    /// Emptied batch vectors, back from the shard for reuse.
    pub bufs: BatchBufs,
    pub waker: mio::Waker,
    pub shutdown: AtomicBool,
}

impl WakeState {
    /// Queues a command for shard `shard` (this one's id, for the error);
    /// `Ok(true)`: the shard is parked and wants a wake. A full queue is
    /// back-pressure and hands the command back.
    #[allow(clippy::result_large_err)]
    pub fn push(&self, shard: usize, cmd: Command) -> Result<bool, (Error, Command)> {
        self.cmds.push(cmd).map_err(|e| match e {
            (PushError::Full, c) => (
                Error::QueueFull {
                    shard,
                    capacity: self.cmds.depth(),
                },
                c,
            ),
            (PushError::Closed, c) => (Error::Shutdown, c),
        })
    }

    /// For wakers with queues of their own (written before this call).
    pub fn wake_if_parked(&self) {
        if self.cmds.park_wanted() {
            let _ = self.waker.wake();
        }
    }
}

/// A spread copy's countdown of slices, and whether one failed.
#[derive(Debug, Default)]
pub(crate) struct CopyJoin {
    pub left: std::sync::atomic::AtomicUsize,
    pub failed: std::sync::atomic::AtomicBool,
}

/// One slice of a large same-host copy (`HostCopy`), or one job of a run
/// of small CMA copies (`CmaBatch`), run by a copy thread, a sibling shard
/// or the owner, then counted in `join`. Built only from slices of our
/// regions and places in the peer's memory whose ranges were checked (a
/// mapping's by `new`; a process's by the kernel), so running it is safe.
pub(crate) struct CopySlice {
    what: SliceWork,
    /// The peer's bytes go into ours (else ours into the peer's).
    from_peer: bool,
    join: Arc<CopyJoin>,
}

enum SliceWork {
    Span {
        ours: RegionSlice,
        theirs: PeerBytes,
    },
    /// (op id, our slice, the peer's address) in process `pid`.
    Pieces {
        pid: u32,
        pieces: Vec<(u64, RegionSlice, u64)>,
    },
}

impl CopySlice {
    /// A copy between `ours` and as many bytes at `theirs`; None if those
    /// lie outside the peer's mapping.
    pub fn new(
        ours: RegionSlice,
        theirs: PeerBytes,
        from_peer: bool,
        join: Arc<CopyJoin>,
    ) -> Option<CopySlice> {
        if let PeerBytes::Mapped { map, off } = &theirs {
            if off.checked_add(ours.len())? > map.len() {
                return None;
            }
        }
        Some(CopySlice {
            what: SliceWork::Span { ours, theirs },
            from_peer,
            join,
        })
    }

    /// CMA copies of `pieces` between our slices and process `pid`.
    pub fn pieces(
        pid: u32,
        pieces: Vec<(u64, RegionSlice, u64)>,
        from_peer: bool,
        join: Arc<CopyJoin>,
    ) -> CopySlice {
        CopySlice {
            what: SliceWork::Pieces { pid, pieces },
            from_peer,
            join,
        }
    }

    /// Copies the slice and counts it done (a failure marks the copy).
    pub fn run(self) {
        use std::sync::atomic::Ordering;
        let ok = match &self.what {
            SliceWork::Span {
                ours,
                theirs: PeerBytes::Mapped { map, off },
            } => {
                // SAFETY: `new` checked off + len against the mapping, which
                // `self` holds, as it holds our region; the two are distinct
                // memories (ours and the peer's).
                unsafe {
                    let theirs = map.ptr().add(*off);
                    if self.from_peer {
                        crate::shm::local::copy_bytes(ours.ptr(), theirs, ours.len());
                    } else {
                        crate::shm::local::copy_bytes(theirs, ours.ptr(), ours.len());
                    }
                }
                true
            }
            SliceWork::Span {
                ours,
                theirs: PeerBytes::Process { pid, addr },
            } => {
                // SAFETY: our slice is `len` live bytes held by `self`; the
                // kernel checks the peer's side.
                unsafe { crate::shm::cma::cma(*pid, ours.ptr(), *addr, ours.len(), self.from_peer) }
                    .is_ok()
            }
            SliceWork::Pieces { pid, pieces } => {
                crate::shm::cma::copy_run(*pid, pieces, self.from_peer)
            }
        };
        if !ok {
            self.join.failed.store(true, Ordering::Relaxed);
        }
        self.join.left.fetch_sub(1, Ordering::Release);
    }
}

/// How the endpoint reaches one shard.
#[derive(Clone)]
pub(crate) struct ShardHandle {
    pub id: usize,
    pub regions: Sender<RegionCmd>,
    pub wake: Arc<WakeState>,
    /// The shard's counters (read by `Endpoint::metrics`).
    pub metrics: Arc<crate::metrics::ShardMetrics>,
}

impl ShardHandle {
    /// Queues a command; a full queue is back-pressure and hands it back.
    // The large Err carries the command back to the caller; the hot path
    // returns Ok and moves nothing.
    #[allow(clippy::result_large_err)]
    pub fn submit(&self, cmd: Command) -> Result<(), (Error, Command)> {
        if self.wake.push(self.id, cmd)? {
            let _ = self.wake.waker.wake();
        }
        Ok(())
    }

    /// Queues a control command, retrying while the queue is full (the
    /// control path may wait; the shard drains the queue as it runs).
    pub fn submit_blocking(&self, mut cmd: Command, deadline: std::time::Instant) -> Result<()> {
        loop {
            match self.submit(cmd) {
                Ok(()) => return Ok(()),
                Err((Error::QueueFull { .. }, c)) if std::time::Instant::now() < deadline => {
                    cmd = c;
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
                Err((e, _)) => return Err(e),
            }
        }
    }

    pub fn region(&self, cmd: RegionCmd) -> Result<()> {
        self.regions.send(cmd).map_err(|_| Error::Shutdown)?;
        // After the send (Release): a shard that takes the flag (Acquire)
        // finds the command.
        self.wake
            .regions_dirty
            .store(true, std::sync::atomic::Ordering::Release);
        self.wake.wake_if_parked();
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn op(r: &Arc<Region>, slot: u32) -> OpCmd {
        OpCmd {
            conn: ConnId(1),
            kind: OpKind::Write,
            slot,
            parts: OpParts::One(OpDesc {
                local: RegionSlice::new(r, 0, 8).expect("inside"),
                remote_addr: 0,
                rkey: 1,
                tag: 0,
                remote_device: false,
                nic_rkeys: None,
                dtype: None,
            }),
            at: Default::default(),
            total: None,
        }
    }

    #[test]
    fn batch_buffers_come_back_empty_and_the_line_is_bounded() {
        let mut mem = vec![0u8; 64];
        let r = crate::region::test_region(&mut mem);
        let bufs = BatchBufs::default();
        let mut v = bufs.take();
        assert_eq!((v.len(), v.capacity()), (0, MAX_BATCH));
        v.push(op(&r, 3));
        let p = v.as_ptr();
        // Given back with an op still in it: the op is dropped (its count
        // of the region with it), the memory kept.
        bufs.give(v);
        assert_eq!(Arc::strong_count(&r), 1);
        let v = bufs.take();
        assert_eq!((v.as_ptr(), v.len(), v.capacity()), (p, 0, MAX_BATCH));
        // A vector of another capacity is not kept.
        bufs.give(Vec::with_capacity(MAX_BATCH * 2));
        assert_eq!(bufs.kept(), 0);
        bufs.give(v);
        assert_eq!(bufs.kept(), 1);
        let _ = bufs.take();
        // Nine back, eight kept; the rest freed (and the kept ones on drop).
        let nine: Vec<Vec<OpCmd>> = (0..9).map(|_| bufs.take()).collect();
        let ptrs: Vec<*const OpCmd> = nine.iter().map(|v| v.as_ptr()).collect();
        for v in nine {
            bufs.give(v);
        }
        assert_eq!(bufs.kept(), 8);
        let kept: Vec<Vec<OpCmd>> = (0..8).map(|_| bufs.take()).collect();
        assert!(kept.iter().all(|v| ptrs[..8].contains(&v.as_ptr())));
        for v in kept {
            bufs.give(v);
        }
    }
}

//! Event sources: what a shard polls. Each source — the tcp sockets (and
//! their RDMA completion queues), the same-host rings, the CUDA events —
//! owns its state, does one pass over what is ready when polled, and says
//! whether the shard may sleep. `Shard::poll` and `Shard::park` are loops
//! over sources; a new transport adds a source, not a branch.
//!
//! What every source reports into lives in `Cx`, borrowed from the shard
//! for one pass: the region table it checks requests against, the ledger's
//! completion list, the application's inbox, and the lists of follow-up
//! work (connections found broken, CUDA copies to start, IPC revocations).

use std::sync::mpsc::{self, Receiver, SyncSender};
use std::time::{Duration, Instant};

use tracing::warn;

use super::gpu::GpuWork;
use super::ledger::OpLedger;
use super::queue::{OpCmd, RegionCmd};
use crate::error::{ConnFault, ConnId, Result};
use crate::region::{Access, KeyRef, RegionSlice, RegionTable, Regions};
use crate::wire::Status;
use crate::xfer::{Bounce, GpuReq, Sink, Stage};

/// Where a connection id lives in a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum ConnRef {
    Tcp(usize),
    Local(usize),
}

/// Whether a source lets the shard sleep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Park {
    /// Nothing to watch that epoll would not wake the shard for.
    Yes,
    /// Sleep at most this long: this source cannot wake an epoll wait.
    Within(Duration),
    /// Work is outstanding that only polling finds (ring replies, CUDA
    /// events, RDMA completions): keep spinning.
    No,
}

impl Park {
    /// The stricter of two answers.
    pub fn and(self, other: Park) -> Park {
        match (self, other) {
            (Park::No, _) | (_, Park::No) => Park::No,
            (Park::Within(a), Park::Within(b)) => Park::Within(a.min(b)),
            (Park::Within(a), Park::Yes) | (Park::Yes, Park::Within(a)) => Park::Within(a),
            (Park::Yes, Park::Yes) => Park::Yes,
        }
    }
}

/// What a source reports into during one pass.
pub(crate) struct Cx<'a> {
    pub regions: &'a mut RegionTable,
    pub updates: &'a Receiver<RegionCmd>,
    /// Piece completions for the ledger.
    pub done: &'a mut Vec<(u32, Result<()>)>,
    pub inbox: &'a Inboxes,
    /// (connection, allocation base) revocations heard on same-host rings.
    pub ipc_revoked: &'a mut Vec<(ConnId, u64)>,
    /// Same-host requests for our memory that need a CUDA copy.
    pub gpu_reqs: &'a mut Vec<GpuReq>,
    /// Answers to those, once copied: (connection, op id, write, status).
    pub gpu_replies: &'a mut Vec<(ConnId, u64, bool, Status)>,
    /// Large same-host copies to spread over the shards (None: one shard).
    pub host_copies: Option<&'a mut Vec<crate::xfer::HostWork>>,
    /// The GPU work, for tcp bounce buffers (absent while it is the source
    /// being polled, or without a driver).
    pub gpu: Option<&'a mut GpuWork>,
    /// Connections found broken in this pass, dropped after it.
    pub to_fail: &'a mut Vec<(ConnRef, ConnFault)>,
    /// The shard's counters (peers' requests served).
    pub metrics: &'a crate::metrics::ShardMetrics,
}

pub(crate) trait Source {
    /// One pass over what is ready; returns how much work it found.
    fn poll(&mut self, cx: &mut Cx<'_>) -> usize;
    /// Whether the shard may sleep now (see `Park`).
    fn may_park(&self) -> Park;
}

/// What a transport needs to queue an op: the ledger (a piece that fails
/// at once, an op the NIC holds), the GPU work (bounce buffers for GPU
/// memory on tcp), the chunk size and the time.
pub(crate) struct SubmitCx<'a> {
    pub ledger: &'a mut OpLedger,
    pub gpu: Option<&'a mut GpuWork>,
    pub chunk: usize,
    pub now: Instant,
}

/// What a transport says of one connection at a timeout check.
pub(crate) struct ConnCheck {
    /// Why it must fail now, if it must.
    pub why: Option<ConnFault>,
    /// Anything under way (it is then not idle).
    pub busy: bool,
    /// When it last moved bytes.
    pub last_active: Instant,
    /// When its oldest request still waiting for a reply went out.
    pub oldest: Option<Instant>,
}

/// A connection a transport let go of.
pub(crate) struct Removed {
    pub id: ConnId,
    /// The id the application knows it by.
    pub group: ConnId,
}

/// A source whose connections carry ops: it owns their whole life —
/// queueing ops and notifications, what the timeout checks look at, and
/// teardown. The shard routes to it by `ConnRef` and keeps the ledger,
/// the parked commands and the timers.
pub(crate) trait Carrier: Source {
    /// The pieces `op` becomes on connection `idx` (its ledger count), and
    /// the path it takes there (for the metrics).
    fn pieces(&self, idx: usize, op: &OpCmd, chunk: usize) -> (u32, crate::metrics::Via);
    /// Queues what fits of `op` on connection `idx` (its progress kept in
    /// `op.at`) and hands back the rest when a stream or ring is full.
    fn submit(&mut self, idx: usize, op: OpCmd, cx: &mut SubmitCx<'_>) -> Option<OpCmd>;
    /// Queues a notification; hands it back when there is no room.
    fn notify(&mut self, idx: usize, payload: Vec<u8>) -> std::result::Result<(), Vec<u8>>;
    /// The id of connection `idx`.
    fn conn_id(&self, idx: usize) -> ConnId;
    /// Whether requests of ours wait for replies on connection `idx`.
    fn has_pending(&self, idx: usize) -> bool;
    /// Looks at connection `idx` for the timeout checks (`limit`: the op
    /// timeout). `seen`: the last peer process looked up, and whether it
    /// was alive (many connections often share one peer).
    fn check(
        &mut self,
        idx: usize,
        now: Instant,
        limit: Duration,
        seen: &mut Option<(u32, bool)>,
    ) -> ConnCheck;
    /// Lets go of connection `idx`, failing what it had under way into
    /// `cx` (`ConnFailed` with `cause`).
    fn remove(&mut self, idx: usize, cause: &ConnFault, cx: &mut Cx<'_>) -> Removed;
}

/// Region lookups that first catch up on registrations the endpoint has
/// queued: a peer can only name a key after `register` returned, and the
/// update was queued before that, so a miss is retried once after draining.
pub(crate) struct LiveRegions<'a> {
    pub table: &'a mut RegionTable,
    pub updates: &'a Receiver<RegionCmd>,
    /// The connection whose requests are being checked.
    pub conn: ConnId,
}

impl Regions for LiveRegions<'_> {
    fn check_as(
        &mut self,
        key: KeyRef,
        addr: u64,
        len: u64,
        need: Access,
        borrowed: bool,
    ) -> std::result::Result<RegionSlice, Status> {
        let conn = self.conn;
        match self
            .table
            .check_window_as(conn, key, addr, len, need, borrowed)
        {
            Err(Status::UnknownKey) => {
                apply_region_updates(self.table, self.updates);
                self.table
                    .check_window_as(conn, key, addr, len, need, borrowed)
            }
            other => other,
        }
    }
}

pub(crate) fn apply_region_updates(
    table: &mut RegionTable,
    updates: &Receiver<RegionCmd>,
) -> usize {
    let mut n = 0;
    while let Ok(cmd) = updates.try_recv() {
        n += 1;
        match cmd {
            RegionCmd::Add(r) => table.insert(r.rkey, crate::region::Grant::whole(&r)),
            RegionCmd::Grant { rkey, grant } => table.insert(rkey, grant),
            RegionCmd::Remove { rkey, after } => table.remove_after(rkey, after),
            RegionCmd::RevokeIpc(base) => table.ipc_revoked.push(base),
        }
    }
    n
}

/// The receiving end of an inbox: (connection, message).
pub(crate) type NoteRx = Receiver<(ConnId, Vec<u8>)>;

/// Where a shard puts the notifications that arrive: the application's
/// (`recv_notification`) and the engine's own (two-sided messages), told
/// apart by the payload's first byte (`NOTE_APP` / `NOTE_CTL`), which is
/// taken off. Each bounded: a full one hands the payload back (the
/// transport holds it and stops reading that connection).
#[derive(Clone)]
pub(crate) struct Inboxes {
    pub app: SyncSender<(ConnId, Vec<u8>)>,
    pub ctl: SyncSender<(ConnId, Vec<u8>)>,
    /// The endpoint's completion fd, raised by each delivery.
    pub signal: std::sync::Arc<super::signal::Signal>,
}

impl Inboxes {
    /// Two inboxes of `depth` each, and their receiving ends (app, ctl).
    pub fn new(
        depth: usize,
        signal: std::sync::Arc<super::signal::Signal>,
    ) -> (Inboxes, NoteRx, NoteRx) {
        let (app, app_rx) = std::sync::mpsc::sync_channel(depth);
        let (ctl, ctl_rx) = std::sync::mpsc::sync_channel(depth);
        (Inboxes { app, ctl, signal }, app_rx, ctl_rx)
    }

    pub fn deliver(&self, conn: ConnId, payload: Vec<u8>) -> std::result::Result<(), Vec<u8>> {
        let to = match payload.first() {
            // The wire allows the engine's longer messages; the
            // application's are never longer than it may send.
            Some(&crate::wire::NOTE_APP) if payload.len() > 1 + crate::wire::MAX_NOTIFY_BYTES => {
                tracing::warn!(%conn, len = payload.len() - 1, "a notification longer than {} bytes: dropped", crate::wire::MAX_NOTIFY_BYTES);
                return Ok(());
            }
            Some(&crate::wire::NOTE_APP) => &self.app,
            Some(&crate::wire::NOTE_CTL) => &self.ctl,
            // Not ours to read: a peer speaking another protocol.
            _ => {
                tracing::warn!(%conn, "a notification of unknown kind: dropped");
                return Ok(());
            }
        };
        let mut msg = payload;
        msg.remove(0);
        match to.try_send((conn, msg)) {
            Ok(()) => {
                self.signal.raise();
                Ok(())
            }
            Err(mpsc::TrySendError::Full((_, mut p))) => {
                let kind = if std::ptr::eq(to, &self.app) {
                    crate::wire::NOTE_APP
                } else {
                    crate::wire::NOTE_CTL
                };
                p.insert(0, kind);
                Err(p)
            }
            // Nobody will ever read it: the endpoint is gone.
            Err(mpsc::TrySendError::Disconnected(_)) => Ok(()),
        }
    }
}

/// Where one connection's transport reports what it finished.
pub(crate) struct ShardSink<'a> {
    pub done: &'a mut Vec<(u32, Result<()>)>,
    pub inbox: &'a Inboxes,
    pub conn: ConnId,
    pub ipc_revoked: &'a mut Vec<(ConnId, u64)>,
    /// Same-host requests that need a CUDA copy (None on tcp: refused).
    pub gpu_reqs: Option<&'a mut Vec<GpuReq>>,
    /// Large same-host copies to spread over the shards (None: copied
    /// inline).
    pub host_copies: Option<&'a mut Vec<crate::xfer::HostWork>>,
    /// GPU staging for tcp frames (None without a GPU path).
    pub gpu: Option<&'a mut GpuWork>,
    /// Where served requests are counted, and under which path.
    pub metrics: &'a crate::metrics::ShardMetrics,
    pub shm: bool,
}

impl<'a> ShardSink<'a> {
    /// A sink for tcp connection `conn`: as `plain`, with GPU staging.
    pub fn tcp(cx: &'a mut Cx<'_>, conn: ConnId) -> ShardSink<'a> {
        ShardSink {
            gpu: cx.gpu.as_deref_mut(),
            ..ShardSink::plain_parts(cx.done, cx.inbox, cx.ipc_revoked, cx.metrics, conn)
        }
    }

    /// A sink for connection `conn` reporting into `cx`: completions,
    /// notifications and revocations only (no CUDA copies, no spread host
    /// copies, no GPU staging: what failing a connection's requests needs).
    pub fn plain(cx: &'a mut Cx<'_>, conn: ConnId) -> ShardSink<'a> {
        ShardSink::plain_parts(cx.done, cx.inbox, cx.ipc_revoked, cx.metrics, conn)
    }

    fn plain_parts(
        done: &'a mut Vec<(u32, Result<()>)>,
        inbox: &'a Inboxes,
        ipc_revoked: &'a mut Vec<(ConnId, u64)>,
        metrics: &'a crate::metrics::ShardMetrics,
        conn: ConnId,
    ) -> ShardSink<'a> {
        ShardSink {
            done,
            inbox,
            conn,
            ipc_revoked,
            gpu_reqs: None,
            host_copies: None,
            gpu: None,
            metrics,
            shm: false,
        }
    }
}

impl Sink for ShardSink<'_> {
    fn done(&mut self, slot: u32, result: Result<()>) {
        self.done.push((slot, result));
    }

    fn served(&mut self, write: bool, len: Option<u64>) {
        self.metrics.served(write, self.shm, len);
    }

    fn notify(&mut self, payload: Vec<u8>) -> std::result::Result<(), Vec<u8>> {
        self.inbox.deliver(self.conn, payload)
    }

    fn ipc_revoked(&mut self, alloc_base: u64) {
        self.ipc_revoked.push((self.conn, alloc_base));
    }

    fn bounce(&mut self, len: usize) -> Bounce {
        match &mut self.gpu {
            Some(g) => g.bounce(len),
            None => Bounce::Never,
        }
    }

    fn gpu_stage(&mut self, stage: Stage) {
        match &mut self.gpu {
            Some(g) => g.stage_tcp(self.conn, stage),
            // Unreachable: staging starts only after `bounce` gave a buffer.
            None => warn!(conn = %self.conn, "GPU staging without a GPU path: dropped"),
        }
    }

    fn host_copy(&mut self, req: crate::xfer::HostCopy) -> Result<(), crate::xfer::HostCopy> {
        match &mut self.host_copies {
            Some(v) => {
                v.push(crate::xfer::HostWork::One(req));
                Ok(())
            }
            None => Err(req),
        }
    }

    fn cma_batch(&mut self, batch: crate::xfer::CmaBatch) -> Result<(), crate::xfer::CmaBatch> {
        match &mut self.host_copies {
            Some(v) => {
                v.push(crate::xfer::HostWork::Cma(batch));
                Ok(())
            }
            None => Err(batch),
        }
    }

    fn gpu_copy(&mut self, req: GpuReq) -> bool {
        match &mut self.gpu_reqs {
            Some(v) if crate::gpu::cuda().is_ok() => {
                v.push(req);
                true
            }
            _ => false,
        }
    }
}

impl Source for GpuWork {
    fn poll(&mut self, cx: &mut Cx<'_>) -> usize {
        let n = if self.busy() { self.poll_events() } else { 0 };
        if n > 0 {
            // Copies held back while the batches that just ended ran.
            self.flush();
        }
        self.drain_into(cx.done, cx.gpu_replies);
        n
    }

    fn may_park(&self) -> Park {
        // CUDA events cannot wake an epoll wait.
        if self.busy() {
            Park::No
        } else {
            Park::Yes
        }
    }
}

/// What a `Cx` borrows, owned, for tests that poll a source alone.
#[cfg(test)]
pub(crate) struct CxParts {
    regions: RegionTable,
    updates: Receiver<RegionCmd>,
    _updates_tx: std::sync::mpsc::Sender<RegionCmd>,
    inbox: Inboxes,
    done: Vec<(u32, Result<()>)>,
    revoked: Vec<(ConnId, u64)>,
    reqs: Vec<GpuReq>,
    replies: Vec<(ConnId, u64, bool, Status)>,
    to_fail: Vec<(ConnRef, ConnFault)>,
    metrics: crate::metrics::ShardMetrics,
}

#[cfg(test)]
impl CxParts {
    /// The parts, and the receiving end of an inbox of `inbox_cap`
    /// notifications.
    pub fn new(inbox_cap: usize) -> (CxParts, Receiver<(ConnId, Vec<u8>)>) {
        let (tx, updates) = std::sync::mpsc::channel();
        let (inbox, notes, _ctl) = Inboxes::new(inbox_cap, Default::default());
        let parts = CxParts {
            regions: RegionTable::default(),
            updates,
            _updates_tx: tx,
            inbox,
            done: Vec::new(),
            revoked: Vec::new(),
            reqs: Vec::new(),
            replies: Vec::new(),
            to_fail: Vec::new(),
            metrics: Default::default(),
        };
        (parts, notes)
    }

    /// The regions peers may name.
    pub fn regions(&mut self) -> &mut RegionTable {
        &mut self.regions
    }

    /// Piece completions since the last call.
    pub fn take_done(&mut self, into: &mut Vec<(u32, Result<()>)>) {
        into.append(&mut self.done);
    }

    /// Connections found broken since the last call.
    pub fn take_failed(&mut self) -> Vec<(ConnRef, ConnFault)> {
        std::mem::take(&mut self.to_fail)
    }

    pub fn cx(&mut self) -> Cx<'_> {
        Cx {
            regions: &mut self.regions,
            updates: &self.updates,
            done: &mut self.done,
            inbox: &self.inbox,
            ipc_revoked: &mut self.revoked,
            gpu_reqs: &mut self.reqs,
            host_copies: None,
            gpu_replies: &mut self.replies,
            gpu: None,
            to_fail: &mut self.to_fail,
            metrics: &self.metrics,
        }
    }
}

#[cfg(test)]
mod inbox_tests {
    use super::*;

    /// The kind byte picks the inbox and comes off; a full inbox hands the
    /// payload back as it came; an unknown kind reaches nobody.
    #[test]
    fn notifications_are_routed_by_their_kind_byte() {
        let (boxes, app, ctl) = Inboxes::new(1, Default::default());
        let c = ConnId(3);
        assert_eq!(boxes.deliver(c, vec![crate::wire::NOTE_APP, 1, 2]), Ok(()));
        assert_eq!(boxes.deliver(c, vec![crate::wire::NOTE_CTL, 9]), Ok(()));
        assert_eq!(app.try_recv().unwrap(), (c, vec![1, 2]));
        assert_eq!(ctl.try_recv().unwrap(), (c, vec![9]));
        assert_eq!(boxes.deliver(c, vec![7, 7]), Ok(()));
        assert_eq!(boxes.deliver(c, vec![]), Ok(()));
        assert!(app.try_recv().is_err() && ctl.try_recv().is_err());
        boxes.deliver(c, vec![crate::wire::NOTE_CTL, 1]).unwrap();
        assert_eq!(
            boxes.deliver(c, vec![crate::wire::NOTE_CTL, 2]),
            Err(vec![crate::wire::NOTE_CTL, 2])
        );
        assert_eq!(ctl.try_recv().unwrap(), (c, vec![1]));
        // The wire carries the engine's eager messages (longer than an
        // application may send): an application's that long is dropped.
        let max = crate::wire::MAX_NOTIFY_BYTES;
        let mut long = vec![crate::wire::NOTE_APP];
        long.resize(2 + max, 5);
        assert_eq!(boxes.deliver(c, long), Ok(()));
        assert!(
            app.try_recv().is_err(),
            "an application's note past the bound"
        );
        let mut longest = vec![crate::wire::NOTE_APP];
        longest.resize(1 + max, 5);
        assert_eq!(boxes.deliver(c, longest), Ok(()));
        assert_eq!(app.try_recv().unwrap().1.len(), max);
    }
}

//! The shard: one thread's worth of engine, split by the state it owns.
//!
//! * `queue` (rx, parked): commands submitted by other threads, and those
//!   waiting for room on their own connection (one connection's full
//!   stream never holds up another's commands);
//! * `regions`: the registrations peers' requests are checked against;
//! * `dir` (`routes.rs`, `ConnRoutes`): which connection lives where, and why dead
//!   ones died;
//! * the event sources (`source.rs`): `tcp` (sockets, epoll, RDMA CQs),
//!   `local` (shared-memory rings, accept ring, fd passing) and `gpu`
//!   (CUDA copies and their events);
//! * `ledger` (`ledger.rs`): every op in flight and its one outcome;
//! * the planner (`plan.rs`) cuts ops into pieces.
//!
//! `poll` runs one pass: registration updates, commands, each source, the
//! glue between sources (CUDA copies for same-host requests, tcp frames
//! staged through bounce buffers), dead connections, and publishing.
//! `park` asks every source whether the shard may sleep.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::debug;

use super::completion::CompletionTable;
use super::gpu::GpuWork;
use super::ledger::OpLedger;
use super::local_side::LocalSide;
pub(crate) use super::local_side::{LocalInit, LocalSetup};
use super::queue::{Command, CopyJoin, RegionCmd, ShardHandle, WakeState};
use super::routes::ConnRoutes;
use super::source::{apply_region_updates, Carrier, ConnRef, Park, Source};
pub use super::spin::SpinStats;
use super::spin::{Next, LOADED_STALL_SHARE};
use super::tcp_side::{Liveness, TcpSide};
use crate::error::{ConnFault, ConnId, Error, Result};
use crate::region::RegionTable;
use crate::wire::Status;

/// Commands taken from the queue per `poll`, so one busy submitter cannot
/// starve the sockets.
const COMMANDS_PER_POLL: usize = 256;
/// How long a closing shard keeps sending what it accepted (`linger`).
const CLOSE_LINGER: Duration = Duration::from_secs(2);
/// Passes in a row with nothing to do after which a closing shard has
/// sent all it can.
const LINGER_IDLE_PASSES: u32 = 16;
/// All connections of a shard together park at most this many times
/// `sq_depth` commands (one connection at most `sq_depth`).
const PARKED_PER_DEPTH: usize = 8;
/// `poll` calls between looks at the clock for the timeout checks.
const TIMEOUT_CLOCK_EVERY: u32 = 64;
/// Connections whose timers came due that one check looks at at most (the
/// rest wait for the next check).
const MAX_DUE_PER_CHECK: usize = 256;
/// The longest a connection goes between looks (shorter with a short op
/// timeout: a quarter of it).
const MAX_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// The hot same-host connections (those polled every pass) are also looked
/// at this often: a crashed peer process is noticed only by looking (rings
/// do not close), and its requests should fail in milliseconds.
const HOT_LOCAL_CHECK: Duration = Duration::from_millis(10);

#[derive(Debug, Clone)]
pub(crate) struct ShardConfig {
    /// CUDA streams per device for IPC copies.
    pub gpu_streams: usize,
    /// Which way small GPU copies go (and the runner's idle span).
    pub gpu_copy: crate::gpu::copy::CopyWay,
    /// Pinned bounce memory for GPU memory on tcp.
    pub gpu_bounce_bytes: usize,
    pub spin: Duration,
    /// How much of the spin polls without yielding the core.
    pub spin_yield: Duration,
    /// Spinning idle passes after work without the pause hint.
    pub spin_eager_passes: u32,
    pub op_timeout: Duration,
    /// A tcp peer silent this long fails its connection (keepalive).
    pub liveness: Duration,
    /// An op in flight this long is reported stalled (once).
    pub stall: Duration,
    /// Connections idle this long are closed (None: never).
    pub idle_timeout: Option<Duration>,
    pub chunk_bytes: usize,
    pub sq_depth: usize,
    pub max_conn_inflight_ops: usize,
    /// The endpoint's codec threads (None: compression is off).
    pub codec: Option<Arc<super::codec_pool::LazyCodecPool>>,
    /// The endpoint's copy threads (None: one thread per copy).
    pub copy_pool: Option<Arc<super::copy_pool::LazyCopyPool>>,
}

/// One shard: its connections, its view of the registrations, and its loop.
/// In embedded mode the caller owns it and calls [`Shard::poll`].
pub struct Shard {
    id: usize,
    cfg: ShardConfig,
    /// The right to take from `wake.cmds` (this shard is its one reader).
    cmds: super::cmd_ring::Consumer,
    /// Commands that found no room on their connection, retried first on
    /// every pass; later commands for such a connection wait behind them,
    /// other connections' do not. One connection parks at most `sq_depth`,
    /// all together `PARKED_PER_DEPTH * sq_depth`.
    parked: super::backlog::Backlog<Command>,
    region_rx: Receiver<RegionCmd>,
    regions: RegionTable,
    wake: Arc<WakeState>,
    dir: ConnRoutes,
    tcp: TcpSide,
    local: LocalSide,
    /// When an idle pass parks.
    spin: super::spin::Spin,
    /// How hard the host's threads wait for cores (for the spin).
    pressure: crate::sys::CpuPressure,
    /// CUDA copies and opened IPC handles; made when a driver is present
    /// (or on the first IPC op).
    gpu: Option<GpuWork>,
    /// Every op this shard runs, its pieces and its one outcome.
    ledger: OpLedger,
    inbox: super::source::Inboxes,
    iter: u32,
    /// The clock as the ops of this pass were taken (read once per pass
    /// that submits: ~3 % of an embedded shard's time when read per op).
    pass_now: Option<Instant>,
    /// Notifications for a sibling whose queue was full.
    notes_out: Vec<super::completion::Note>,
    /// When each connection is next looked at by the timeout checks.
    timers: super::timers::Timers,
    /// Scratch for the connections due in a check.
    due: Vec<(ConnRef, ConnId)>,
    /// When the hot same-host connections were last looked at.
    hot_checked: Instant,
    /// When the ops in flight were last looked at for stalls.
    scanned: Instant,
    ipc_counters: Arc<crate::gpu::ipc::IpcCounters>,
    /// Connections found broken during a pass, dropped after it.
    to_fail: Vec<(ConnRef, ConnFault)>,
    /// (connection, allocation base) revocations heard on same-host rings.
    ipc_revoked: Vec<(ConnId, u64)>,
    /// Same-host requests for our memory that need a CUDA copy.
    gpu_reqs: Vec<crate::xfer::GpuReq>,
    /// Their answers once copied: (connection, op id, write, status).
    gpu_replies: Vec<(ConnId, u64, bool, Status)>,
    /// The other shards, which copy slices of large same-host copies.
    siblings: Vec<ShardHandle>,
    /// Large same-host copies requested this pass ...
    host_copies: Vec<crate::xfer::HostWork>,
    /// ... and those whose slices are under way: (slices left,
    /// connection, op id, write).
    copy_waits: Vec<(Arc<CopyJoin>, ConnId, u64, bool)>,
}

/// The context sources report into, borrowed from the shard's other
/// fields for one pass (`gpu`: the GPU work, unless it is the source).
/// Large same-host copies are shared (`host_copies`) where there are copy
/// threads or sibling shards.
macro_rules! cx {
    ($s:ident, $gpu:expr) => {
        $crate::reactor::source::Cx {
            regions: &mut $s.regions,
            updates: &$s.region_rx,
            done: &mut $s.ledger.done,
            inbox: &$s.inbox,
            ipc_revoked: &mut $s.ipc_revoked,
            gpu_reqs: &mut $s.gpu_reqs,
            gpu_replies: &mut $s.gpu_replies,
            host_copies: ($s.cfg.copy_pool.is_some() || !$s.siblings.is_empty())
                .then_some(&mut $s.host_copies),
            gpu: $gpu,
            to_fail: &mut $s.to_fail,
            metrics: &$s.ledger.metrics,
        }
    };
}

mod commands;
mod glue;
mod timeouts;

impl Shard {
    pub(crate) fn new(
        id: usize,
        cfg: ShardConfig,
        table: Arc<CompletionTable>,
        inbox: super::source::Inboxes,
        local_init: LocalInit,
        closed: mpsc::Sender<(ConnId, ConnFault)>,
        ipc_counters: Arc<crate::gpu::ipc::IpcCounters>,
    ) -> Result<(Shard, ShardHandle)> {
        let (mut tcp, waker) = TcpSide::new(id, Liveness::new(cfg.liveness, cfg.op_timeout))?;
        let local = LocalSide::new(id, local_init);
        for (fd, said) in local.wake_fds().into_iter().flatten() {
            tcp.watch_wake_fd(fd, said)?;
        }
        let (ring, cmds) = super::cmd_ring::CmdRing::new(cfg.sq_depth);
        let wake = Arc::new(WakeState {
            cmds: ring,
            regions_dirty: AtomicBool::new(false),
            bufs: Default::default(),
            waker,
            shutdown: AtomicBool::new(false),
        });
        if let Some(pool) = &cfg.codec {
            tcp.set_codec(pool.clone(), wake.clone());
        }
        let (rtx, region_rx) = mpsc::channel();
        let metrics = Arc::<crate::metrics::ShardMetrics>::default();
        let handle = ShardHandle {
            id,
            regions: rtx,
            wake: wake.clone(),
            metrics: metrics.clone(),
        };
        // With a driver, ready for GPU memory on tcp (no CUDA call yet).
        let gpu = crate::gpu::cuda().is_ok().then(|| {
            GpuWork::new(
                ipc_counters.clone(),
                cfg.gpu_streams,
                cfg.gpu_copy,
                cfg.chunk_bytes,
                cfg.gpu_bounce_bytes,
            )
        });
        let spin = super::spin::Spin::new(cfg.spin, cfg.spin_yield).eager(cfg.spin_eager_passes);
        let parked = super::backlog::Backlog::new(cfg.sq_depth, PARKED_PER_DEPTH * cfg.sq_depth);
        let shard = Shard {
            id,
            ledger: OpLedger::new(table, cfg.max_conn_inflight_ops, metrics),
            cfg,
            cmds,
            parked,
            region_rx,
            regions: RegionTable::default(),
            wake,
            dir: ConnRoutes::new(closed),
            tcp,
            local,
            spin,
            pressure: crate::sys::CpuPressure::new(),
            gpu,
            inbox,
            iter: 0,
            pass_now: None,
            notes_out: Vec::new(),
            timers: Default::default(),
            due: Vec::new(),
            hot_checked: Instant::now(),
            scanned: Instant::now(),
            ipc_counters,
            to_fail: Vec::new(),
            ipc_revoked: Vec::new(),
            gpu_reqs: Vec::new(),
            gpu_replies: Vec::new(),
            siblings: Vec::new(),
            host_copies: Vec::new(),
            copy_waits: Vec::new(),
        };
        Ok((shard, handle))
    }

    /// This shard's index in its endpoint (0..shards).
    pub fn id(&self) -> usize {
        self.id
    }

    /// The other shards of the endpoint (large same-host copies are cut
    /// into slices for them).
    pub(crate) fn set_siblings(&mut self, siblings: Vec<ShardHandle>) {
        self.siblings = siblings;
    }

    /// Connections this shard drives now.
    pub fn conn_count(&self) -> usize {
        self.tcp.conns.len() + self.local.conns.len()
    }

    /// Runs one pass of the loop; returns how much work it found (0: idle).
    pub fn poll(&mut self) -> usize {
        self.pass_now = None;
        let mut work = 0;
        if self.wake.regions_dirty.load(Ordering::Relaxed)
            && self.wake.regions_dirty.swap(false, Ordering::Acquire)
        {
            work += apply_region_updates(&mut self.regions, &self.region_rx);
        }
        if !self.regions.ipc_revoked.is_empty() {
            self.send_ipc_revocations();
        }
        work += self.drain_commands();
        if let Some(g) = &mut self.gpu {
            g.flush();
            g.drain_into(&mut self.ledger.done, &mut self.gpu_replies);
        }
        work += self.poll_sources();
        // Revocations a lazy region lookup picked up during the pass.
        if !self.regions.ipc_revoked.is_empty() {
            self.send_ipc_revocations();
        }
        // One doorbell ring per peer for all this pass pushed to it.
        self.local.ring_due();
        self.iter = self.iter.wrapping_add(1);
        if self.iter % TIMEOUT_CLOCK_EVERY == 0 {
            self.check_timeouts(Instant::now());
        }
        work + self.publish()
    }

    /// One pass over every event source, and the glue between them.
    fn poll_sources(&mut self) -> usize {
        let mut work = 0;
        {
            let mut cx = cx!(self, self.gpu.as_mut());
            let sources: [&mut dyn Source; 2] = [&mut self.tcp, &mut self.local];
            for s in sources {
                work += s.poll(&mut cx);
                // Copies staged by this source's frames start now.
                if let Some(g) = &mut cx.gpu {
                    g.flush();
                }
            }
        }
        work += self.fail_marked();
        if !self.host_copies.is_empty() {
            self.start_host_copies();
        }
        if !self.copy_waits.is_empty() {
            work += self.finish_host_copies();
        }
        if !self.ipc_revoked.is_empty() {
            self.apply_ipc_revocations();
        }
        if !self.gpu_reqs.is_empty() {
            self.start_gpu_reqs();
            if let Some(g) = &mut self.gpu {
                g.flush();
            }
        }
        if let Some(g) = &mut self.gpu {
            let mut cx = cx!(self, None);
            work += g.poll(&mut cx);
        }
        if !self.gpu_replies.is_empty() {
            self.send_gpu_replies();
        }
        if self
            .gpu
            .as_ref()
            .is_some_and(|g| !g.sends.is_empty() || !g.releases.is_empty())
        {
            self.deliver_tcp_staging();
        }
        work
    }

    /// Whether every source lets the shard sleep, and for how long.
    fn may_park(&self) -> Park {
        let gpu = self.gpu.as_ref().map_or(Park::Yes, |g| g.may_park());
        // Sibling shards finishing slices do not wake us.
        let copies = if self.copy_waits.is_empty() {
            Park::Yes
        } else {
            Park::No
        };
        self.tcp
            .may_park()
            .and(self.local.may_park())
            .and(gpu)
            .and(copies)
    }

    /// Sleeps until a socket, a submitter or `max` wakes it, unless work
    /// arrived in the meantime or a source cannot wake it.
    pub fn park(&mut self, max: Duration) {
        self.local.park_begin();
        self.wake.cmds.announce_park(&self.cmds);
        // One more pass after announcing the park: a submitter (or a local
        // peer) that did not see `parked` queued its item before it, so
        // this pass finds it (or sees it still being written: pending).
        let idle = self.poll() == 0 && !self.wake.cmds.pending(&self.cmds);
        let park = self.may_park();
        if idle && park != Park::No {
            let mut wait = max
                .min(self.cfg.op_timeout / 4)
                .max(Duration::from_millis(1));
            if let Park::Within(d) = park {
                wait = wait.min(d);
            }
            self.tcp.wait(wait);
        }
        self.wake.cmds.clear_park(&self.cmds);
        self.local.park_end();
        // A sender of descriptors came (its socket was ready): serve it
        // now; the passes' own timed look finds one epoll did not report.
        if self.tcp.take_said() {
            self.local.poll_fd_listener();
        }
        self.check_timeouts(Instant::now());
    }

    /// One step of a loop that owns a core: polls, and when the pass found
    /// nothing does what the spin policy (`spin.rs`) says: poll again,
    /// yield the core first, or park for up to `max`. Returns the work the
    /// poll found. The managed shard threads run this; an embedded caller
    /// may too.
    pub fn poll_or_park(&mut self, max: Duration) -> usize {
        let work = self.poll();
        if work > 0 {
            self.spin.busy();
            return work;
        }
        let pressure = &mut self.pressure;
        let loaded = || pressure.stalled_over(LOADED_STALL_SHARE, Instant::now());
        let (local, tcp) = (&self.local, &self.tcp);
        let awaiting = || local.awaiting_replies() || tcp.awaiting_replies();
        match self.spin.idle_pass(Instant::now, loaded, awaiting) {
            Next::Poll => {}
            Next::Spin => std::hint::spin_loop(),
            Next::Yield => {
                let before = Instant::now();
                std::thread::yield_now();
                let now = Instant::now();
                let idle_core = || crate::sys::runnable_over_cores().map(|over| !over);
                let switches = crate::sys::involuntary_switches;
                if self.spin.yielded(now - before, now, switches, idle_core) {
                    crate::sys::move_off_this_core();
                }
            }
            Next::Park => {
                let now = Instant::now();
                let pressure = &mut self.pressure;
                let loaded = || pressure.stalled_over(LOADED_STALL_SHARE, now);
                self.spin
                    .parking(crate::sys::involuntary_switches(), now, loaded);
                self.park(max);
                self.spin.woke();
                let m = &self.ledger.metrics;
                m.parks.set(self.spin.stats.parks);
                m.yields.set(self.spin.stats.yields);
            }
        }
        work
    }

    /// What the spin did since the shard started.
    pub fn spin_stats(&self) -> SpinStats {
        self.spin.stats
    }

    /// Drives the shard until the endpoint shuts down (managed mode), then
    /// sends what was accepted before it did (`linger`).
    pub(crate) fn run(mut self) {
        while !self.wake.shutdown.load(Ordering::Relaxed) {
            self.poll_or_park(Duration::from_millis(100));
        }
        self.linger();
    }

    /// Before the shard closes its connections: applies the commands still
    /// queued and sends what its streams and rings hold — a notification
    /// `send_notification` accepted, the `Fin` of a two-sided send that
    /// reported done — until nothing is left unsent and `LINGER_IDLE_PASSES`
    /// passes in a row find nothing to do, or `CLOSE_LINGER` has passed (a
    /// peer that stops reading holds a close that long at most; one that
    /// reads slowly is waited for). Without it, a process that exits right
    /// after its last send loses what that send's receiver waits for.
    pub(crate) fn linger(&mut self) {
        let end = Instant::now() + CLOSE_LINGER;
        let mut idle = 0;
        while idle < LINGER_IDLE_PASSES && Instant::now() < end {
            let work = self.poll();
            let unsent = self.wake.cmds.pending(&self.cmds)
                || !self.parked.is_empty()
                || self.tcp.has_unsent();
            if work > 0 {
                idle = 0;
            } else if unsent {
                // A peer not reading now: wait for room, not a spin.
                idle = 0;
                std::thread::sleep(Duration::from_micros(200));
            } else {
                idle += 1;
                std::thread::yield_now();
            }
        }
    }

    fn publish(&mut self) -> usize {
        let dir = &self.dir;
        let n = self.ledger.publish(|c| dir.contains(c));
        if n > 0 {
            crate::stage_trace::mark(crate::stage_trace::Stage::Published);
        }
        if !self.ledger.notes.is_empty() || !self.notes_out.is_empty() {
            self.send_notes();
        }
        n
    }

    /// Sends the notifications of ops that ended well: on this shard as a
    /// notification command, to a sibling through its queue (one that is
    /// full is tried again next pass; the notes are bounded by the ops in
    /// flight, each having at most one).
    fn send_notes(&mut self) {
        let mut notes = std::mem::take(&mut self.ledger.notes);
        notes.append(&mut self.notes_out);
        for note in notes {
            let super::completion::Note {
                conn,
                shard,
                payload,
            } = note;
            let cmd = Command::Notify {
                conn,
                payload,
                ticket: None,
            };
            if shard == self.id {
                self.take(cmd);
                continue;
            }
            let Some(h) = self.siblings.iter().find(|h| h.id == shard) else {
                continue;
            };
            match h.submit(cmd) {
                Ok(()) => {}
                Err((Error::QueueFull { .. }, Command::Notify { conn, payload, .. })) => {
                    self.ledger.metrics.notes_held.add(1);
                    self.notes_out.push(super::completion::Note {
                        conn,
                        shard,
                        payload,
                    })
                }
                Err(_) => {}
            }
        }
    }
}

/// The transport a connection lives on, and its index there.
fn route<'a>(
    tcp: &'a mut TcpSide,
    local: &'a mut LocalSide,
    at: ConnRef,
) -> (&'a mut dyn Carrier, usize) {
    match at {
        ConnRef::Tcp(i) => (tcp, i),
        ConnRef::Local(i) => (local, i),
    }
}

impl Drop for Shard {
    /// Fails whatever is still in flight or queued, so no waiter hangs.
    fn drop(&mut self) {
        debug!(shard = self.id, stats = ?self.spin.stats, "shard ends; its spin");
        let tcp = self.tcp.conns.iter().map(|(k, _)| ConnRef::Tcp(k));
        let local = self.local.conns.iter().map(|(k, _)| ConnRef::Local(k));
        let all: Vec<ConnRef> = tcp.chain(local).collect();
        for at in all {
            self.drop_at(
                at,
                ConnFault::Closed {
                    why: "the shard shut down",
                },
            );
        }
        let mut queued: Vec<Command> = self.parked.drain().collect();
        // Refused from now on (Error::Shutdown), so none is left behind.
        for mut c in self.wake.cmds.close(&mut self.cmds) {
            c.adopt();
            queued.push(c);
        }
        for c in queued {
            // With no connections left these fail every remaining piece.
            match c {
                Command::Op(op) => {
                    self.apply_op(op);
                }
                Command::Ops(ops) => {
                    for op in ops {
                        self.apply_op(op);
                    }
                }
                Command::Ipc(cmd) => self.apply_ipc(cmd),
                _ => {}
            }
        }
        if let Some(g) = &mut self.gpu {
            // Copies in flight read or write memory their ops still hold.
            g.finish_all(self.cfg.op_timeout);
            g.drain_into(&mut self.ledger.done, &mut self.gpu_replies);
            for (ts, _, _) in g.sends.drain(..) {
                self.ledger.done.push((ts.slot, Err(Error::Shutdown)));
            }
        }
        self.publish();
        self.regions.clear();
    }
}

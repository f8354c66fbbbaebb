//! The shard loop.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;
use tracing::{debug, info, warn};

use super::completion::CompletionTable;
use super::ledger::OpLedger;
use super::plan::{self, Route};
use super::queue::{Command, OpCmd, RegionCmd, ShardHandle, WakeState};
use crate::error::{ConnId, Error, OpKind, Result};
use crate::region::{Access, KeyRef, RegionSlice, RegionTable, Regions};
use crate::shm::fdpass::FdListener;
use crate::shm::local::{LocalConn, PeerMaps};
use crate::shm::object::ShmRing;
use crate::shm::ring::SLOT_PAYLOAD;
use crate::tcp::{Stream, StreamLimits};
use crate::wire::shm_msg::{Msg, MsgKind};
use crate::wire::Status;
use crate::xfer::Sink;

const WAKER: Token = Token(usize::MAX);
/// Commands taken from the queue per `poll`, so one busy submitter cannot
/// starve the sockets.
const COMMANDS_PER_POLL: usize = 256;
/// `poll` calls between looks at the fd-passing socket.
const FD_CHECK_EVERY: u32 = 4096;
/// A parked shard with same-host work wakes this often: shared-memory rings
/// cannot wake an epoll wait.
const LOCAL_PARK: Duration = Duration::from_millis(1);
const ACCEPT_RING_PARK: Duration = Duration::from_millis(10);
/// `poll` calls between checks for timed-out requests.
const TIMEOUT_CHECK_EVERY: u32 = 8192;
/// Dead connections remembered, so later calls on them get the error that
/// killed them; past this the memory is cleared.
const FAILED_MEMORY: usize = 4096;
/// Up to this many streams, `poll` tries every socket instead of asking
/// epoll (it still parks on epoll).
const DIRECT_POLL_MAX_STREAMS: usize = 4;
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
const KEEPALIVE_PROBES: u32 = 3;
/// Streams a connection may have (the handshake caps it too).
const MAX_STREAMS: usize = 64;

#[derive(Debug, Clone)]
pub(crate) struct ShardConfig {
    /// CUDA streams per device for IPC copies.
    pub gpu_streams: usize,
    /// Pinned bounce memory for GPU memory on tcp.
    pub gpu_bounce_bytes: usize,
    pub spin: Duration,
    pub op_timeout: Duration,
    pub chunk_bytes: usize,
    pub sq_depth: usize,
    pub max_conn_inflight_ops: usize,
}

struct Conn {
    id: ConnId,
    streams: Vec<Stream>,
    next: usize,
    /// RDMA queue pairs: ops whose windows carry a NIC key go here; the
    /// streams keep notifications and the rest.
    verbs: Option<Box<crate::verbs::Link>>,
}

/// Where a connection id lives in a shard.
#[derive(Clone, Copy)]
enum ConnRef {
    Tcp(usize),
    Local(usize),
}

/// What the shard that owns same-host connections also polls.
pub(crate) struct LocalSetup {
    /// CONNECT messages from local peers arrive here.
    pub accept_ring: ShmRing,
    /// Local peers share their memfd regions through this socket.
    pub fd_listener: FdListener,
    /// Forwards CONNECT messages (and their inline proof) to the endpoint's
    /// accept path.
    pub connects: SyncSender<(Msg, Vec<u8>)>,
}

/// One shard: its connections, its view of the registrations, and its loop.
/// In embedded mode the caller owns it and calls [`Shard::poll`].
pub struct Shard {
    id: usize,
    cfg: ShardConfig,
    rx: Receiver<Command>,
    region_rx: Receiver<RegionCmd>,
    wake: Arc<WakeState>,
    epoll: Poll,
    events: Events,
    conns: Slab<Conn>,
    local: Slab<LocalConn>,
    by_id: crate::sys::IntMap<ConnId, ConnRef>,
    local_setup: Option<LocalSetup>,
    peer_maps: PeerMaps,
    failed: HashMap<ConnId, String>,
    regions: RegionTable,
    /// Every op this shard runs, its pieces and its one outcome.
    ledger: OpLedger,
    stalled: Option<Command>,
    /// Connections found broken during a pass, dropped after it.
    to_fail: Vec<(ConnRef, String)>,
    inbox: SyncSender<(ConnId, Vec<u8>)>,
    iter: u32,
    stream_count: usize,
    /// Tells the endpoint which connections died, so it can forget them.
    closed: mpsc::Sender<ConnId>,
    /// CUDA IPC copies and opened handles; made on the first IPC op.
    gpu: Option<super::gpu::GpuWork>,
    ipc_counters: Arc<crate::gpu::ipc::IpcCounters>,
    /// (connection, allocation base) revocations heard on same-host rings.
    ipc_revoked: Vec<(ConnId, u64)>,
    /// Same-host requests for our memory that need a CUDA copy.
    gpu_reqs: Vec<crate::xfer::GpuReq>,
    /// Their answers once copied: (connection, op id, write, status).
    gpu_replies: Vec<(ConnId, u64, bool, Status)>,
}

/// Region lookups that first catch up on registrations the endpoint has
/// queued: a peer can only name a key after `register` returned, and the
/// update was queued before that, so a miss is retried once after draining.
struct LiveRegions<'a> {
    table: &'a mut RegionTable,
    updates: &'a Receiver<RegionCmd>,
    /// The connection whose requests are being checked.
    conn: ConnId,
}

impl Regions for LiveRegions<'_> {
    fn check(
        &mut self,
        key: KeyRef,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<RegionSlice, Status> {
        let conn = self.conn;
        match self.table.check(conn, key, addr, len, need) {
            Err(Status::UnknownKey) => {
                apply_region_updates(self.table, self.updates);
                self.table.check(conn, key, addr, len, need)
            }
            other => other,
        }
        .map(|(r, off)| {
            RegionSlice::new(r, off, len as usize).expect("the table checked the window")
        })
    }
}

fn apply_region_updates(table: &mut RegionTable, updates: &Receiver<RegionCmd>) -> usize {
    let mut n = 0;
    while let Ok(cmd) = updates.try_recv() {
        n += 1;
        match cmd {
            RegionCmd::Add(r) => table.insert(r.rkey, crate::region::Grant::whole(&r)),
            RegionCmd::Grant { rkey, grant } => table.insert(rkey, grant),
            RegionCmd::Remove(k) => table.remove(k),
        }
    }
    n
}

struct ShardSink<'a> {
    done: &'a mut Vec<(u32, Result<()>)>,
    inbox: &'a SyncSender<(ConnId, Vec<u8>)>,
    conn: ConnId,
    ipc_revoked: &'a mut Vec<(ConnId, u64)>,
    /// Same-host requests that need a CUDA copy (None on tcp: refused).
    gpu_reqs: Option<&'a mut Vec<crate::xfer::GpuReq>>,
    /// GPU staging for tcp frames (None without a GPU path).
    gpu: Option<&'a mut super::gpu::GpuWork>,
}

impl Sink for ShardSink<'_> {
    fn done(&mut self, slot: u32, result: Result<()>) {
        self.done.push((slot, result));
    }

    fn notify(&mut self, payload: Vec<u8>) -> Result<(), Vec<u8>> {
        match self.inbox.try_send((self.conn, payload)) {
            Ok(()) => Ok(()),
            Err(mpsc::TrySendError::Full((_, p))) => Err(p),
            // Nobody will ever read it: the endpoint is gone.
            Err(mpsc::TrySendError::Disconnected(_)) => Ok(()),
        }
    }

    fn ipc_revoked(&mut self, alloc_base: u64) {
        self.ipc_revoked.push((self.conn, alloc_base));
    }

    fn bounce(&mut self, len: usize) -> crate::xfer::Bounce {
        match &mut self.gpu {
            Some(g) => g.bounce(len),
            None => crate::xfer::Bounce::Never,
        }
    }

    fn gpu_stage(&mut self, stage: crate::xfer::Stage) {
        match &mut self.gpu {
            Some(g) => g.stage_tcp(self.conn, stage),
            // Unreachable: staging starts only after `bounce` gave a buffer.
            None => warn!(conn = %self.conn, "GPU staging without a GPU path: dropped"),
        }
    }

    fn gpu_copy(&mut self, req: crate::xfer::GpuReq) -> bool {
        match &mut self.gpu_reqs {
            Some(v) if crate::gpu::cuda().is_ok() => {
                v.push(req);
                true
            }
            _ => false,
        }
    }
}

impl Shard {
    pub(crate) fn new(
        id: usize,
        cfg: ShardConfig,
        table: Arc<CompletionTable>,
        inbox: SyncSender<(ConnId, Vec<u8>)>,
        local_setup: Option<LocalSetup>,
        closed: mpsc::Sender<ConnId>,
        ipc_counters: Arc<crate::gpu::ipc::IpcCounters>,
    ) -> Result<(Shard, ShardHandle)> {
        let epoll = Poll::new().map_err(|e| Error::io("epoll_create", e))?;
        let waker = Waker::new(epoll.registry(), WAKER).map_err(|e| Error::io("eventfd", e))?;
        let wake = Arc::new(WakeState {
            parked: AtomicBool::new(false),
            waker,
            shutdown: AtomicBool::new(false),
        });
        let (tx, rx) = mpsc::sync_channel(cfg.sq_depth);
        let (rtx, region_rx) = mpsc::channel();
        let max_conn_ops = cfg.max_conn_inflight_ops;
        let (cfg_gpu_streams, cfg_chunk, cfg_bounce) =
            (cfg.gpu_streams, cfg.chunk_bytes, cfg.gpu_bounce_bytes);
        let handle = ShardHandle {
            id,
            capacity: cfg.sq_depth,
            tx,
            regions: rtx,
            wake: wake.clone(),
        };
        let shard = Shard {
            id,
            cfg,
            rx,
            region_rx,
            wake,
            epoll,
            events: Events::with_capacity(64),
            conns: Slab::new(),
            local: Slab::new(),
            by_id: Default::default(),
            local_setup,
            peer_maps: PeerMaps::default(),
            failed: HashMap::new(),
            regions: RegionTable::default(),
            ledger: OpLedger::new(table, max_conn_ops),
            stalled: None,
            to_fail: Vec::new(),
            inbox,
            iter: 0,
            stream_count: 0,
            closed,
            // With a driver, ready for GPU memory on tcp (no CUDA call yet).
            gpu: crate::gpu::cuda().is_ok().then(|| {
                super::gpu::GpuWork::new(
                    ipc_counters.clone(),
                    cfg_gpu_streams,
                    cfg_chunk,
                    cfg_bounce,
                )
            }),
            ipc_counters,
            ipc_revoked: Vec::new(),
            gpu_reqs: Vec::new(),
            gpu_replies: Vec::new(),
        };
        Ok((shard, handle))
    }

    pub fn id(&self) -> usize {
        self.id
    }

    /// Connections this shard drives now.
    pub fn conn_count(&self) -> usize {
        self.conns.len() + self.local.len()
    }

    /// Runs one pass of the loop; returns how much work it found (0: idle).
    pub fn poll(&mut self) -> usize {
        if !self.conns.is_empty() && !self.direct_poll() {
            match self.epoll.poll(&mut self.events, Some(Duration::ZERO)) {
                Ok(()) => self.apply_events(),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => warn!(shard = self.id, "epoll_wait failed: {e}"),
            }
        }
        let mut work = apply_region_updates(&mut self.regions, &self.region_rx);
        work += self.drain_commands();
        if let Some(g) = &mut self.gpu {
            g.flush();
            g.drain_into(&mut self.ledger.done, &mut self.gpu_replies);
        }
        work += self.service_conns();
        work += self.service_local();
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
            if g.busy() {
                work += g.poll();
            }
            g.drain_into(&mut self.ledger.done, &mut self.gpu_replies);
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
        self.iter = self.iter.wrapping_add(1);
        if self.iter % FD_CHECK_EVERY == 0 {
            work += self.poll_fd_listener();
        }
        if self.iter % TIMEOUT_CHECK_EVERY == 0 {
            self.check_timeouts(Instant::now());
        }
        work + self.publish()
    }

    /// Sleeps until a socket, a submitter or `max` wakes it, unless work
    /// arrived in the meantime.
    pub fn park(&mut self, max: Duration) {
        self.wake.parked.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // One more pass after announcing the park: a submitter that did not
        // see `parked` queued its item before it, so this pass finds it.
        // Replies on shared-memory rings cannot wake an epoll wait: with
        // same-host requests outstanding, keep spinning instead.
        // Nor can GPU events or RDMA completion queues (polled, no channel).
        let awaiting_local = self.local.iter().any(|(_, c)| c.has_pending())
            || self.gpu.as_ref().is_some_and(|g| g.busy())
            || self
                .conns
                .iter()
                .any(|(_, c)| c.verbs.as_ref().is_some_and(|v| v.busy()));
        if self.poll() == 0 && !awaiting_local {
            let mut wait = max
                .min(self.cfg.op_timeout / 4)
                .max(Duration::from_millis(1));
            if !self.local.is_empty() {
                wait = wait.min(LOCAL_PARK);
            } else if self.local_setup.is_some() {
                wait = wait.min(ACCEPT_RING_PARK);
            }
            match self.epoll.poll(&mut self.events, Some(wait)) {
                Ok(()) => self.apply_events(),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => warn!(shard = self.id, "epoll_wait failed: {e}"),
            }
        }
        self.wake.parked.store(false, Ordering::SeqCst);
        self.poll_fd_listener();
        self.check_timeouts(Instant::now());
    }

    /// Drives the shard until the endpoint shuts down (managed mode).
    pub(crate) fn run(mut self) {
        let mut idle_since = Instant::now();
        while !self.wake.shutdown.load(Ordering::Relaxed) {
            if self.poll() > 0 {
                idle_since = Instant::now();
            } else if idle_since.elapsed() >= self.cfg.spin {
                self.park(Duration::from_millis(100));
                idle_since = Instant::now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// With few streams, trying each socket directly costs fewer syscalls
    /// (and less latency) than asking epoll which are ready first.
    fn direct_poll(&self) -> bool {
        self.stream_count <= DIRECT_POLL_MAX_STREAMS
    }

    /// Marks the streams epoll reported ready.
    fn apply_events(&mut self) {
        for ev in self.events.iter() {
            let t = ev.token();
            if t == WAKER {
                continue;
            }
            let (key, idx) = (t.0 / MAX_STREAMS, t.0 % MAX_STREAMS);
            let Some(s) = self.conns.get_mut(key).and_then(|c| c.streams.get_mut(idx)) else {
                continue;
            };
            if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                s.readable = true;
            }
            if ev.is_writable() || ev.is_write_closed() || ev.is_error() {
                s.writable = true;
            }
        }
    }

    fn drain_commands(&mut self) -> usize {
        let mut n = 0;
        if let Some(cmd) = self.stalled.take() {
            if let Some(back) = self.apply(cmd) {
                self.stalled = Some(back);
                return 0;
            }
            n += 1;
        }
        while n < COMMANDS_PER_POLL {
            match self.rx.try_recv() {
                Ok(cmd) => {
                    n += 1;
                    if let Some(back) = self.apply(cmd) {
                        self.stalled = Some(back);
                        break;
                    }
                }
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => break,
            }
        }
        n
    }

    fn conn_error(&self, conn: ConnId) -> Error {
        match self.failed.get(&conn) {
            Some(reason) => Error::ConnFailed {
                conn,
                reason: reason.clone(),
            },
            None => Error::UnknownConn { conn },
        }
    }

    /// Applies one command; hands it back if it cannot proceed yet.
    fn apply(&mut self, cmd: Command) -> Option<Command> {
        match cmd {
            Command::Op(op) => self.apply_op(op).map(Command::Op),
            Command::Ipc(cmd) => {
                self.apply_ipc(cmd);
                None
            }
            Command::RevokeIpc { alloc_base } => {
                for (_, lc) in self.local.iter_mut() {
                    if !lc.push_ipc_revoke(alloc_base) {
                        warn!(shard = self.id, conn = %lc.id, "IPC revocation dropped: ring full");
                    }
                }
                None
            }
            Command::AddConn {
                conn,
                streams,
                limits,
                verbs,
            } => {
                if let Err(e) = self.add_conn(conn, streams, limits, verbs) {
                    warn!(shard = self.id, %conn, "could not adopt connection: {e}");
                    self.remember_failed(conn, e.to_string());
                }
                None
            }
            Command::AddLocal(lc) => {
                let conn = lc.id;
                let idx = self.local.insert(*lc);
                self.by_id.insert(conn, ConnRef::Local(idx));
                debug!(shard = self.id, %conn, "same-host connection adopted");
                None
            }
            Command::RemoveConn(conn, ack) => {
                match self.by_id.get(&conn) {
                    Some(&ConnRef::Tcp(idx)) => {
                        self.drop_conn(idx, "removed by remove_remote".to_owned())
                    }
                    Some(&ConnRef::Local(idx)) => {
                        self.drop_local(idx, "removed by remove_remote".to_owned())
                    }
                    None => {}
                }
                self.failed.remove(&conn);
                if let Some(ack) = ack {
                    let _ = ack.try_send(());
                }
                None
            }
            Command::Notify { conn, payload } => {
                match self.by_id.get(&conn) {
                    Some(&ConnRef::Tcp(idx)) => {
                        let s = &mut self.conns[idx].streams[0];
                        if !s.can_notify() {
                            return Some(Command::Notify { conn, payload });
                        }
                        s.push_notify(payload);
                    }
                    Some(&ConnRef::Local(idx)) => {
                        if !self.local[idx].push_notify(&payload) {
                            return Some(Command::Notify { conn, payload });
                        }
                    }
                    None => {
                        warn!(shard = self.id, %conn, "notification for a connection that is gone: dropped")
                    }
                }
                None
            }
        }
    }

    fn apply_op(&mut self, mut op: OpCmd) -> Option<OpCmd> {
        let chunk = self.cfg.chunk_bytes;
        let target = self.by_id.get(&op.conn).copied();
        if target.is_none() && !op.counted {
            let err = self.conn_error(op.conn);
            self.ledger.fail(op.slot, err);
            return None;
        }
        // An op goes over RDMA when its connection has queue pairs and
        // every window carries the peer NIC's key; it then completes once.
        let via_verbs = match target {
            Some(ConnRef::Tcp(i)) => {
                self.conns[i].verbs.is_some()
                    && op.parts.as_slice().iter().all(|d| d.nic_rkey.is_some())
            }
            _ => false,
        };
        let route = match target {
            _ if via_verbs => Route::Verbs,
            Some(ConnRef::Local(_)) => Route::Local,
            _ => Route::Tcp,
        };
        let total = plan::pieces(
            route,
            op.parts.as_slice().iter().map(|d| d.local.len()),
            chunk,
        );
        if !op.counted {
            op.counted = true;
            if let Err(e) = self.ledger.open(op.slot, total, Some(op.conn)) {
                self.ledger.fail(op.slot, e);
                return None;
            }
        }
        let now = Instant::now();
        let idx = match target {
            None => {
                // Its connection died while the op waited for room.
                let err = self.conn_error(op.conn);
                self.ledger.fail_rest(op.slot, total - op.at.emitted, err);
                return None;
            }
            Some(ConnRef::Local(idx)) => {
                let lc = &mut self.local[idx];
                let descs = op.parts.as_slice();
                while op.at.desc < descs.len() {
                    let d = &descs[op.at.desc];
                    if !lc.push_request(
                        op.kind,
                        op.slot,
                        KeyRef {
                            rkey: d.rkey,
                            tag: d.tag,
                        },
                        d.remote_addr,
                        &d.local,
                        d.remote_device,
                        now,
                    ) {
                        return Some(op);
                    }
                    op.at.emitted += 1;
                    op.at.desc += 1;
                }
                return None;
            }
            Some(ConnRef::Tcp(idx)) if via_verbs => return self.post_verbs(idx, op),
            Some(ConnRef::Tcp(idx)) => idx,
        };
        let conn = &mut self.conns[idx];
        let descs = op.parts.as_slice();
        while op.at.desc < descs.len() {
            let d = &descs[op.at.desc];
            let n = op.at.frame_len(d.local.len(), chunk);
            let which = conn.next % conn.streams.len();
            let s = &mut conn.streams[which];
            if !s.can_request() {
                return Some(op);
            }
            let op_id = ((op.slot as u64) << 32) | op.at.emitted as u64;
            let local = d
                .local
                .sub(op.at.off, n)
                .expect("the planner stays inside the op's slice");
            let key = KeyRef {
                rkey: d.rkey,
                tag: d.tag,
            };
            if local.is_device() {
                // GPU memory goes through a pinned bounce buffer: a WRITE
                // chunk is sent once copied out (pipelined: later chunks copy
                // while earlier ones are on the wire); a READ lands in the
                // bounce buffer and is copied on before the op completes.
                let bounce = match self.gpu.as_mut().map(|g| g.bounce(n)) {
                    Some(crate::xfer::Bounce::Ready(b)) => b,
                    Some(crate::xfer::Bounce::Busy) => return Some(op),
                    _ => {
                        let e = Error::Unsupported {
                            what: "GPU memory on a tcp connection",
                            reason: "no pinned bounce buffer could be allocated (see the log)"
                                .into(),
                        };
                        self.ledger.fail_rest(op.slot, total - op.at.emitted, e);
                        return None;
                    }
                };
                let addr = d.remote_addr + op.at.off as u64;
                match op.kind {
                    OpKind::Write => {
                        let g = self.gpu.as_mut().expect("bounce came from it");
                        let send = super::gpu::TcpSend {
                            conn: op.conn,
                            stream: which,
                            slot: op.slot,
                            op_id,
                            key,
                            addr,
                            len: n,
                        };
                        g.stage_send(send, local, bounce);
                    }
                    OpKind::Read => {
                        let into = RegionSlice::new(&bounce, 0, n).expect("bounce fits a chunk");
                        s.push_request(OpKind::Read, op.slot, op_id, key, addr, into, now);
                        s.stage_last_read(local);
                    }
                }
                conn.next = conn.next.wrapping_add(1);
                op.at.advance(n, d.local.len());
                continue;
            }
            s.push_request(
                op.kind,
                op.slot,
                op_id,
                key,
                d.remote_addr + op.at.off as u64,
                local,
                now,
            );
            conn.next = conn.next.wrapping_add(1);
            op.at.advance(n, d.local.len());
        }
        None
    }

    /// Posts a whole op on the connection's RDMA queue pairs, or none of it
    /// (stalls) while their send queues lack room: an op completes once,
    /// when the last of its completions arrives.
    fn post_verbs(&mut self, idx: usize, op: OpCmd) -> Option<OpCmd> {
        let link = self.conns[idx]
            .verbs
            .as_mut()
            .expect("checked by the caller");
        let descs = op.parts.as_slice();
        let pieces: usize = descs
            .iter()
            .map(|d| link.pieces(d.local.len() as u64))
            .sum();
        if !link.has_room(pieces) {
            return Some(op);
        }
        for d in descs {
            match link.lkey(d.local.region()) {
                Ok(lkey) => link.add(
                    lkey,
                    d.local.addr(),
                    d.nic_rkey.expect("checked by the caller"),
                    d.remote_addr,
                    d.local.len() as u64,
                ),
                Err(e) => {
                    // Nothing of this op has been posted yet: drop the
                    // gathered parts by posting none.
                    link.discard();
                    link.fail_slot(op.slot, e, &mut self.ledger.done);
                    return None;
                }
            }
        }
        if let Err(e) = link.post(op.kind == OpKind::Write, op.slot) {
            link.fail_slot(op.slot, e, &mut self.ledger.done);
        }
        None
    }

    /// Starts a CUDA IPC op. It counts against its connection's in-flight
    /// limit like any op, and fails like one on an unknown connection.
    fn apply_ipc(&mut self, cmd: super::queue::IpcCmd) {
        let total = cmd.parts.len() as u32;
        if !self.by_id.contains_key(&cmd.conn) {
            let e = self.conn_error(cmd.conn);
            return self.ledger.fail(cmd.slot, e);
        }
        if let Err(e) = self.ledger.open(cmd.slot, total, Some(cmd.conn)) {
            return self.ledger.fail(cmd.slot, e);
        }
        self.gpu_work().start(cmd);
    }

    fn gpu_work(&mut self) -> &mut super::gpu::GpuWork {
        let counters = &self.ipc_counters;
        let streams = self.cfg.gpu_streams;
        let (bounce, bounce_bytes) = (self.cfg.chunk_bytes, self.cfg.gpu_bounce_bytes);
        self.gpu.get_or_insert_with(|| {
            super::gpu::GpuWork::new(counters.clone(), streams, bounce, bounce_bytes)
        })
    }

    /// Starts the CUDA copies same-host peers asked of our memory.
    fn start_gpu_reqs(&mut self) {
        // Taken and put back, so the vector keeps its capacity.
        let mut reqs = std::mem::take(&mut self.gpu_reqs);
        let g = self.gpu_work();
        for r in reqs.drain(..) {
            g.start_target(r);
        }
        self.gpu_reqs = reqs;
    }

    /// Releases gated tcp frames whose copies ended, and sends WRITE
    /// chunks that reached their bounce buffers (later, if the stream is
    /// full now).
    fn deliver_tcp_staging(&mut self) {
        let Some(g) = &mut self.gpu else { return };
        for (conn, stream, gate, ok) in g.releases.drain(..) {
            if let Some(&ConnRef::Tcp(i)) = self.by_id.get(&conn) {
                if let Some(s) = self.conns[i].streams.get_mut(stream as usize) {
                    s.release(gate, ok);
                }
            }
        }
        let now = Instant::now();
        let mut i = 0;
        while i < g.sends.len() {
            let (ts, bounce, r) = &g.sends[i];
            let stream = match self.by_id.get(&ts.conn) {
                Some(&ConnRef::Tcp(ci)) => self.conns[ci].streams.get_mut(ts.stream),
                _ => None,
            };
            match (r, stream, bounce) {
                (Ok(()), Some(s), Some(b)) => {
                    if !s.can_request() {
                        i += 1;
                        continue;
                    }
                    let from = RegionSlice::new(b, 0, ts.len).expect("bounce fits a chunk");
                    s.push_request(OpKind::Write, ts.slot, ts.op_id, ts.key, ts.addr, from, now);
                }
                (Err(e), _, _) => self.ledger.done.push((ts.slot, Err(e.duplicate()))),
                _ => {
                    let e = match self.failed.get(&ts.conn) {
                        Some(reason) => Error::ConnFailed {
                            conn: ts.conn,
                            reason: reason.clone(),
                        },
                        None => Error::UnknownConn { conn: ts.conn },
                    };
                    self.ledger.done.push((ts.slot, Err(e)));
                }
            }
            let _ = g.sends.swap_remove(i);
        }
    }

    fn send_gpu_replies(&mut self) {
        for (conn, op_id, write, status) in self.gpu_replies.drain(..) {
            if let Some(&ConnRef::Local(idx)) = self.by_id.get(&conn) {
                self.local[idx].finish_gpu(op_id, write, status);
            }
        }
    }

    /// Applies revocations heard on same-host rings to the IPC cache.
    fn apply_ipc_revocations(&mut self) {
        for (conn, base) in self.ipc_revoked.drain(..) {
            let Some(&ConnRef::Local(idx)) = self.by_id.get(&conn) else {
                continue;
            };
            if let Some(g) = &mut self.gpu {
                g.revoke(self.local[idx].peer_id, base);
            }
        }
    }

    fn add_conn(
        &mut self,
        conn: ConnId,
        streams: Vec<std::net::TcpStream>,
        limits: StreamLimits,
        verbs: Option<Box<crate::verbs::Link>>,
    ) -> Result<()> {
        if streams.is_empty() || streams.len() > MAX_STREAMS {
            return Err(Error::Unsupported {
                what: "connection",
                reason: format!("{} streams", streams.len()),
            });
        }
        let entry = self.conns.vacant_entry();
        let key = entry.key();
        let mut out = Vec::with_capacity(streams.len());
        for (i, s) in streams.into_iter().enumerate() {
            s.set_nonblocking(true)
                .map_err(|e| Error::io("fcntl(O_NONBLOCK)", e))?;
            // An idle connection whose peer vanished (half-open TCP) is found
            // by keepalive within ~16 s; busy ones by the op timeout first.
            let ka = socket2::TcpKeepalive::new()
                .with_time(KEEPALIVE_IDLE)
                .with_interval(KEEPALIVE_INTERVAL)
                .with_retries(KEEPALIVE_PROBES);
            socket2::SockRef::from(&s)
                .set_tcp_keepalive(&ka)
                .map_err(|e| Error::io("setsockopt(SO_KEEPALIVE)", e))?;
            let mut m = mio::net::TcpStream::from_std(s);
            self.epoll
                .registry()
                .register(
                    &mut m,
                    Token(key * MAX_STREAMS + i),
                    Interest::READABLE | Interest::WRITABLE,
                )
                .map_err(|e| Error::io("epoll_ctl", e))?;
            out.push(Stream::new(m, limits, i as u8));
        }
        self.stream_count += out.len();
        entry.insert(Conn {
            id: conn,
            streams: out,
            next: 0,
            verbs,
        });
        self.by_id.insert(conn, ConnRef::Tcp(key));
        debug!(shard = self.id, %conn, "connection adopted");
        Ok(())
    }

    fn remember_failed(&mut self, conn: ConnId, reason: String) {
        // The endpoint may be gone already; then nobody needs to know.
        let _ = self.closed.send(conn);
        self.ledger.forget_conn_if_idle(conn);
        if self.failed.len() >= FAILED_MEMORY {
            self.failed.clear();
        }
        self.failed.insert(conn, reason);
    }

    fn drop_conn(&mut self, idx: usize, reason: String) {
        let mut conn = self.conns.remove(idx);
        self.regions.revoke_conn(conn.id);
        self.stream_count -= conn.streams.len();
        self.by_id.remove(&conn.id);
        let err = Error::ConnFailed {
            conn: conn.id,
            reason,
        };
        let mut sink = ShardSink {
            done: &mut self.ledger.done,
            inbox: &self.inbox,
            conn: conn.id,
            ipc_revoked: &mut self.ipc_revoked,
            gpu_reqs: None,
            gpu: None,
        };
        for s in conn.streams.iter_mut() {
            s.fail_pending(&err, &mut sink);
            let _ = self.epoll.registry().deregister(&mut s.sock);
        }
        if let Some(v) = &mut conn.verbs {
            v.fail_all(&err, sink.done);
        }
        if let Error::ConnFailed { reason, .. } = err {
            self.remember_failed(conn.id, reason);
        }
    }

    fn drop_local(&mut self, idx: usize, reason: String) {
        let mut lc = self.local.remove(idx);
        self.regions.revoke_conn(lc.id);
        self.by_id.remove(&lc.id);
        let err = Error::ConnFailed {
            conn: lc.id,
            reason: reason.clone(),
        };
        let mut sink = ShardSink {
            done: &mut self.ledger.done,
            inbox: &self.inbox,
            conn: lc.id,
            ipc_revoked: &mut self.ipc_revoked,
            gpu_reqs: None,
            gpu: None,
        };
        lc.fail_pending(&err, &mut sink);
        let peer = lc.peer_id;
        let id = lc.id;
        drop(lc);
        // Forget the peer's shared memory once no connection to it is left.
        if !self.local.iter().any(|(_, c)| c.peer_id == peer) {
            self.peer_maps.retain(|(p, _), _| *p != peer);
            if let Some(g) = &mut self.gpu {
                g.revoke_owner(peer);
            }
        }
        self.remember_failed(id, reason);
    }

    fn poll_fd_listener(&mut self) -> usize {
        match &self.local_setup {
            Some(ls) => ls.fd_listener.poll(&mut self.peer_maps),
            None => 0,
        }
    }

    fn service_local(&mut self) -> usize {
        let mut work = 0;
        if let Some(ls) = &self.local_setup {
            let mut buf = [0u8; SLOT_PAYLOAD];
            while let Some(n) = ls.accept_ring.ring.pop(&mut buf) {
                work += 1;
                match Msg::decode(&buf[..n]) {
                    Ok((m, inline)) if m.kind == MsgKind::Connect => {
                        if ls.connects.try_send((m, inline.to_vec())).is_err() {
                            warn!(
                                shard = self.id,
                                "local CONNECT dropped: too many waiting for accept"
                            );
                        }
                    }
                    Ok((m, _)) => warn!(
                        shard = self.id,
                        "unexpected {:?} on the accept ring", m.kind
                    ),
                    Err(e) => warn!(shard = self.id, "bad message on the accept ring: {e}"),
                }
            }
        }
        if self.local.is_empty() {
            return work;
        }
        let mut regions = LiveRegions {
            table: &mut self.regions,
            updates: &self.region_rx,
            conn: ConnId(0),
        };
        for (idx, lc) in self.local.iter_mut() {
            regions.conn = lc.id;
            let mut sink = ShardSink {
                done: &mut self.ledger.done,
                inbox: &self.inbox,
                conn: lc.id,
                ipc_revoked: &mut self.ipc_revoked,
                gpu_reqs: Some(&mut self.gpu_reqs),
                gpu: None,
            };
            match lc.poll(&mut regions, &self.peer_maps, &mut sink) {
                Ok(w) => work += w,
                Err(reason) => self.to_fail.push((ConnRef::Local(idx), reason)),
            }
        }
        work + self.fail_marked()
    }

    fn service_conns(&mut self) -> usize {
        let mut work = 0;
        let direct = self.direct_poll();
        let mut regions = LiveRegions {
            table: &mut self.regions,
            updates: &self.region_rx,
            conn: ConnId(0),
        };
        for (idx, conn) in self.conns.iter_mut() {
            regions.conn = conn.id;
            if let Some(v) = &mut conn.verbs {
                match v.poll(&mut self.ledger.done) {
                    Ok(n) => work += n,
                    Err(reason) => {
                        self.to_fail.push((ConnRef::Tcp(idx), reason));
                        continue;
                    }
                }
            }
            let mut sink = ShardSink {
                done: &mut self.ledger.done,
                inbox: &self.inbox,
                conn: conn.id,
                ipc_revoked: &mut self.ipc_revoked,
                gpu_reqs: None,
                gpu: self.gpu.as_mut(),
            };
            for s in conn.streams.iter_mut() {
                if direct {
                    s.readable = true;
                    s.writable = true;
                }
                let step = (|| {
                    let mut w = s.flush()? as usize;
                    // One read's worth of frames per poll: replies go out and
                    // completions are published before the next read.
                    w += s.on_readable(&mut regions, &mut sink)? as usize;
                    if s.has_tx() {
                        w += s.flush()? as usize;
                    }
                    Ok::<usize, String>(w)
                })();
                match step {
                    Ok(w) => work += w,
                    Err(reason) => {
                        self.to_fail.push((ConnRef::Tcp(idx), reason));
                        break;
                    }
                }
            }
        }
        if let Some(g) = &mut self.gpu {
            g.flush();
        }
        work + self.fail_marked()
    }

    fn check_timeouts(&mut self, now: Instant) {
        let limit = self.cfg.op_timeout;
        let late = |t: Instant| now.duration_since(t) > limit;
        let timeout = || {
            format!(
                "no response to a request within {} ms (op timeout)",
                limit.as_millis()
            )
        };
        for (idx, conn) in self.conns.iter() {
            if conn
                .streams
                .iter()
                .filter_map(|s| s.oldest_pending())
                .any(late)
            {
                self.to_fail.push((ConnRef::Tcp(idx), timeout()));
            }
        }
        for (idx, lc) in self.local.iter() {
            if !lc.peer_alive() {
                self.to_fail.push((
                    ConnRef::Local(idx),
                    format!("peer process {} is gone", lc.peer_pid),
                ));
            } else if lc.oldest_pending().is_some_and(late) {
                self.to_fail.push((ConnRef::Local(idx), timeout()));
            }
        }
        self.fail_marked();
    }

    /// Drops the connections marked in `to_fail`, failing their requests;
    /// a warning if requests were lost, a note if the connection was idle.
    /// Returns how many were dropped.
    fn fail_marked(&mut self) -> usize {
        let mut to_fail = std::mem::take(&mut self.to_fail);
        let n = to_fail.len();
        for (at, reason) in to_fail.drain(..) {
            let (conn, busy) = match at {
                ConnRef::Tcp(i) => (
                    self.conns[i].id,
                    self.conns[i].streams.iter().any(|s| s.has_pending()),
                ),
                ConnRef::Local(i) => (self.local[i].id, self.local[i].has_pending()),
            };
            if busy {
                warn!(shard = self.id, %conn, "connection failed: {reason}");
            } else {
                info!(shard = self.id, %conn, "connection closed: {reason}");
            }
            match at {
                ConnRef::Tcp(i) => self.drop_conn(i, reason),
                ConnRef::Local(i) => self.drop_local(i, reason),
            }
        }
        self.to_fail = to_fail;
        n
    }

    fn publish(&mut self) -> usize {
        let by_id = &self.by_id;
        self.ledger.publish(|c| by_id.contains_key(&c))
    }
}

impl Drop for Shard {
    /// Fails whatever is still in flight or queued, so no waiter hangs.
    fn drop(&mut self) {
        let keys: Vec<usize> = self.conns.iter().map(|(k, _)| k).collect();
        for k in keys {
            self.drop_conn(k, "the shard shut down".to_owned());
        }
        let keys: Vec<usize> = self.local.iter().map(|(k, _)| k).collect();
        for k in keys {
            self.drop_local(k, "the shard shut down".to_owned());
        }
        let mut queued: Vec<Command> = self.stalled.take().into_iter().collect();
        while let Ok(c) = self.rx.try_recv() {
            queued.push(c);
        }
        for c in queued {
            // With no connections left these fail every remaining piece.
            match c {
                Command::Op(op) => {
                    self.apply_op(op);
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

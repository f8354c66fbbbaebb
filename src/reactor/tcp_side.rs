//! A shard's tcp connections as an event source: their streams (sockets
//! driven by the sans-IO stream engine), the epoll instance that says which
//! are ready (and that a parked shard sleeps in), and each connection's
//! RDMA queue pairs when it has them.
//!
//! A pass visits only the connections on the ready list: those epoll
//! reported, those the shard queued frames on (`mark`), and those that
//! left work for the next pass (bytes still readable, frames still
//! sendable, a stream blocked on the shard, RDMA completions owed). An idle
//! connection costs a pass nothing.

use std::io;
use std::time::Duration;

use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;
use tracing::warn;

use super::source::{ConnRef, Cx, LiveRegions, Park, ShardSink, Source};
use crate::error::{ConnFault, ConnId, Error, Result};
use crate::tcp::{Stream, StreamLimits};

pub(crate) const WAKER: Token = Token(usize::MAX);
/// Other descriptors whose readiness only ends a park (a doorbell's FIFO,
/// the fd-passing socket): their sources look at them on the next pass.
const WAKE_ONLY: Token = Token(usize::MAX - 1);
/// As `WAKE_ONLY`, and `wait` says it was ready (the fd-passing socket:
/// accepting on it after every park, ready or not, cost one failed
/// `accept4` per wake-up).
const WAKE_SAID: Token = Token(usize::MAX - 2);
/// Up to this many streams, `poll` tries every socket instead of asking
/// epoll (it still parks on epoll).
const DIRECT_POLL_MAX_STREAMS: usize = 4;
/// With more, the connections that moved bytes lately (at most this many)
/// are still tried directly each pass, so a busy connection among many
/// idle ones is served as if it were alone (no epoll round first) ...
const HOT_CONNS: usize = 4;
/// ... for this many passes after their last traffic; and while there are
/// such, epoll is asked only every `EPOLL_EVERY_HOT` passes.
const HOT_PASSES: u64 = 4096;
const EPOLL_EVERY_HOT: u64 = 4;
/// Keepalive probes a silent peer gets before its connection is failed.
const KEEPALIVE_PROBES: u32 = 3;

/// How a tcp data socket notices a peer that stopped answering: keepalive
/// probes after `idle` of silence, `interval` apart, and the kernel's
/// abort once `user_timeout` passed without an acknowledgement (with
/// keepalive on, Linux aborts on the user timeout, not on the probe
/// count). Within `FERRY_LIVENESS_MS` for an idle connection; a busy one
/// whose data goes unacknowledged, within the smaller of it and the op
/// timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Liveness {
    pub idle: Duration,
    pub interval: Duration,
    pub user_timeout: Duration,
}

impl Liveness {
    /// For a liveness bound `within` (at least 1 s: keepalive counts whole
    /// seconds) and the op timeout.
    pub fn new(within: Duration, op_timeout: Duration) -> Self {
        let within = within.max(Duration::from_secs(1));
        // Probes in the last half: the first after half the bound.
        let interval = (within / (2 * KEEPALIVE_PROBES)).max(Duration::from_secs(1));
        let idle = within
            .saturating_sub(interval * KEEPALIVE_PROBES)
            .max(Duration::from_secs(1));
        Liveness {
            idle,
            interval,
            user_timeout: within.min(op_timeout),
        }
    }
}
/// Streams a connection may have (the handshake caps it too).
const MAX_STREAMS: usize = 64;

pub(crate) struct Conn {
    pub id: ConnId,
    /// The id the application knows: the connection this is one lane of
    /// (a connection spread over shards), else `id`. Notifications,
    /// errors and per-connection windows use it.
    pub group: ConnId,
    pub streams: Vec<Stream>,
    /// The stream the next frame goes to (round-robin).
    pub next: usize,
    /// RDMA queue pairs: ops whose windows carry a NIC key go here; the
    /// streams keep notifications and the rest.
    pub verbs: Option<Box<crate::verbs::DynLink>>,
    /// When the connection last moved a byte (for the idle timeout).
    pub last_active: std::time::Instant,
    /// Shared with the other lanes of the connection (None: not spread).
    pub activity: Option<std::sync::Arc<crate::sys::Activity>>,
    /// On the ready list.
    queued: bool,
}

impl TcpSide {
    /// Who connection `idx` is with, for a report (a syscall: not for the
    /// hot path).
    pub fn peer_name(&self, idx: usize) -> String {
        let addr = self.conns.get(idx).and_then(|c| c.streams.first());
        match addr.map(|s| s.sock.peer_addr()) {
            Some(Ok(a)) => a.to_string(),
            Some(Err(e)) => format!("unknown ({e})"),
            None => "gone".to_string(),
        }
    }
}

impl Conn {
    /// Whether the next pass must visit it even if epoll says nothing.
    fn wants_turn(&self) -> bool {
        self.streams.iter().any(|s| s.wants_turn()) || self.verbs.as_ref().is_some_and(|v| v.busy())
    }
}

pub(crate) struct TcpSide {
    epoll: Poll,
    events: Events,
    /// A `said` descriptor was ready (`take_said`).
    said: bool,
    pub conns: Slab<Conn>,
    stream_count: usize,
    /// Connections the next pass visits (each at most once: `Conn::queued`).
    ready: Vec<usize>,
    /// The list being visited (kept for its allocation).
    visiting: Vec<usize>,
    /// Connections with RDMA queue pairs (their completion queues are
    /// polled, not signalled).
    verbs_conns: usize,
    /// The NIC event epoch this side last checked its links against.
    nic_epoch: u64,
    /// The completion queues this shard's links share (one per NIC),
    /// polled once per pass for all of them.
    cqs: Vec<std::sync::Arc<dyn crate::verbs::CqPoll>>,
    /// Connections the last pass visited (what a pass costs).
    pub visited: usize,
    /// Connections tried directly each pass: (slab index, until which pass).
    hot: Vec<(usize, u64)>,
    passes: u64,
    shard: usize,
    /// Keepalive and the user timeout of every data socket: a half-open
    /// peer is not kept for minutes.
    liveness: Liveness,
    /// The endpoint's codec threads and this shard's channel from them.
    codec: Option<super::codec_side::CodecSide>,
}

impl TcpSide {
    /// Whether any stream holds frames not yet written to its socket (a
    /// closing shard's `linger`; not on the hot path: it visits them all).
    pub fn has_unsent(&self) -> bool {
        self.conns
            .iter()
            .any(|(_, c)| c.streams.iter().any(|s| s.has_tx()))
    }

    /// Whether a request on a connection this side polls directly (the
    /// hot ones, or all of a few) waits for its reply. Bounded: at most
    /// `HOT_CONNS` or `DIRECT_POLL_MAX_STREAMS` connections are looked at.
    pub fn awaiting_replies(&self) -> bool {
        let pending = |c: &Conn| c.streams.iter().any(|s| s.has_pending());
        if self.direct_poll() {
            self.conns.iter().any(|(_, c)| pending(c))
        } else {
            self.hot
                .iter()
                .any(|&(i, _)| self.conns.get(i).is_some_and(pending))
        }
    }

    /// Polls the shard's shared completion queues once and hands each
    /// completion to the link its `wr_id` names (a link that is gone had
    /// its QPs' completions removed with them; one that is not is logged).
    fn poll_cqs(&mut self, cx: &mut Cx<'_>) -> usize {
        let mut work = 0;
        for cq in &self.cqs {
            let conns = &mut self.conns;
            let r = cq.poll(&mut |id, outcome, name| {
                let (_, link, _, _) = crate::verbs::plan::split_wr_id(id);
                match conns.get_mut(link as usize).and_then(|c| c.verbs.as_mut()) {
                    Some(v) => v.on_wc(id, outcome, name, cx.done),
                    None => tracing::debug!(link, "a completion for a link that is gone"),
                }
            });
            match r {
                Ok(n) => work += n,
                Err(reason) => {
                    // The queue is unusable: every link on it is done.
                    warn!(shard = self.shard, "{reason}");
                    for (i, c) in self.conns.iter() {
                        if c.verbs.is_some() {
                            cx.to_fail.push((ConnRef::Tcp(i), reason.clone()));
                        }
                    }
                }
            }
        }
        work
    }

    /// Links an asynchronous NIC event broke, with the reason: asked of
    /// every link only when the NICs' event epoch moved (so an idle link
    /// whose port went down fails too, which no completion would do).
    pub fn broken_links(&mut self, out: &mut Vec<(ConnRef, ConnFault)>) {
        if self.verbs_conns == 0 {
            return;
        }
        let Some(epoch) = self
            .conns
            .iter()
            .find_map(|(_, c)| c.verbs.as_ref().map(|v| v.nic_events()))
        else {
            return;
        };
        if epoch == self.nic_epoch {
            return;
        }
        self.nic_epoch = epoch;
        for (i, c) in self.conns.iter() {
            if let Some(why) = c.verbs.as_ref().and_then(|v| v.broken()) {
                out.push((ConnRef::Tcp(i), why));
            }
        }
    }

    /// The source and the waker submitters ring to end the shard's sleep.
    pub fn new(shard: usize, liveness: Liveness) -> Result<(TcpSide, Waker)> {
        let epoll = Poll::new().map_err(|e| Error::io("epoll_create", e))?;
        let waker = Waker::new(epoll.registry(), WAKER).map_err(|e| Error::io("eventfd", e))?;
        let side = TcpSide {
            epoll,
            events: Events::with_capacity(64),
            said: false,
            conns: Slab::new(),
            stream_count: 0,
            ready: Vec::new(),
            visiting: Vec::new(),
            verbs_conns: 0,
            nic_epoch: 0,
            cqs: Vec::new(),
            visited: 0,
            hot: Vec::with_capacity(HOT_CONNS),
            passes: 0,
            shard,
            liveness,
            codec: None,
        };
        Ok((side, waker))
    }

    /// Lets connections that agree to the codec pack their frames (on
    /// the endpoint's pool, which wakes the shard through `wake`).
    pub fn set_codec(
        &mut self,
        pool: std::sync::Arc<super::codec_pool::LazyCodecPool>,
        wake: std::sync::Arc<super::queue::WakeState>,
    ) {
        self.codec = Some(super::codec_side::CodecSide::new(pool, wake));
    }

    /// With few streams, trying each socket directly costs fewer syscalls
    /// (and less latency) than asking epoll which are ready first.
    fn direct_poll(&self) -> bool {
        self.stream_count <= DIRECT_POLL_MAX_STREAMS
    }

    /// Adds `fd` to the epoll set: its readiness ends a park (and, with
    /// `said`, is what `wait` returns).
    pub fn watch_wake_fd(&self, fd: i32, said: bool) -> Result<()> {
        let token = if said { WAKE_SAID } else { WAKE_ONLY };
        self.epoll
            .registry()
            .register(&mut mio::unix::SourceFd(&fd), token, Interest::READABLE)
            .map_err(|e| Error::io("epoll_ctl(ADD)", e))
    }

    /// Waits up to `timeout` for a socket or the waker (a parked shard).
    pub fn wait(&mut self, timeout: Duration) {
        match self.epoll.poll(&mut self.events, Some(timeout)) {
            Ok(()) => self.apply_events(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => warn!(shard = self.shard, "epoll_wait failed: {e}"),
        }
    }

    /// Whether a descriptor watched with `said` was ready since the last
    /// call (epoll reports each readiness once: edge-triggered).
    pub fn take_said(&mut self) -> bool {
        std::mem::take(&mut self.said)
    }

    /// Puts connection `idx` on the next pass's ready list (the shard
    /// calls it after queueing frames or posting work on it).
    pub fn mark(&mut self, idx: usize) {
        if let Some(c) = self.conns.get_mut(idx) {
            if !c.queued {
                c.queued = true;
                self.ready.push(idx);
            }
        }
    }

    /// Marks the streams epoll reported ready, and their connections.
    fn apply_events(&mut self) {
        for ev in self.events.iter() {
            let t = ev.token();
            if t == WAKE_SAID {
                self.said = true;
            }
            if t == WAKER || t == WAKE_ONLY || t == WAKE_SAID {
                continue;
            }
            let (key, idx) = (t.0 / MAX_STREAMS, t.0 % MAX_STREAMS);
            let Some(c) = self.conns.get_mut(key) else {
                continue;
            };
            let Some(s) = c.streams.get_mut(idx) else {
                continue;
            };
            if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                s.readable = true;
            }
            if ev.is_writable() || ev.is_write_closed() || ev.is_error() {
                s.writable = true;
            }
            if !c.queued {
                c.queued = true;
                self.ready.push(key);
            }
        }
    }

    /// Adopts a connection's sockets; returns its index.
    #[allow(clippy::too_many_arguments)]
    pub fn add(
        &mut self,
        conn: ConnId,
        group: ConnId,
        activity: Option<std::sync::Arc<crate::sys::Activity>>,
        streams: Vec<std::net::TcpStream>,
        limits: StreamLimits,
        verbs: Option<Box<crate::verbs::DynLink>>,
        macs: Vec<crate::tcp::Integrity>,
    ) -> Result<usize> {
        if !macs.is_empty() && macs.len() != streams.len() {
            return Err(Error::Unsupported {
                what: "connection",
                reason: format!("{} streams but {} MAC keys", streams.len(), macs.len()),
            });
        }
        let mut macs = macs.into_iter();
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
            // by keepalive within FERRY_LIVENESS_MS (`Liveness`).
            let ka = socket2::TcpKeepalive::new()
                .with_time(self.liveness.idle)
                .with_interval(self.liveness.interval)
                .with_retries(KEEPALIVE_PROBES);
            let sock = socket2::SockRef::from(&s);
            sock.set_tcp_keepalive(&ka)
                .map_err(|e| Error::io("setsockopt(SO_KEEPALIVE)", e))?;
            sock.set_tcp_user_timeout(Some(self.liveness.user_timeout))
                .map_err(|e| Error::io("setsockopt(TCP_USER_TIMEOUT)", e))?;
            let mut m = mio::net::TcpStream::from_std(s);
            self.epoll
                .registry()
                .register(
                    &mut m,
                    Token(key * MAX_STREAMS + i),
                    Interest::READABLE | Interest::WRITABLE,
                )
                .map_err(|e| Error::io("epoll_ctl", e))?;
            let mut s = Stream::new(m, limits, i as u8, macs.next());
            if limits.codec {
                if let Some(c) = &self.codec {
                    s.enable_pack(c.shared());
                }
            }
            out.push(s);
        }
        self.stream_count += out.len();
        self.verbs_conns += verbs.is_some() as usize;
        let mut verbs = verbs;
        if let Some(v) = &mut verbs {
            if key >= crate::verbs::plan::MAX_LINKS {
                return Err(Error::Unsupported {
                    what: "an RDMA connection",
                    reason: format!("the shard holds {key} connections; a wr_id names 2^20"),
                });
            }
            v.attach(key as u32);
            for cq in v.shared_cqs() {
                if !self.cqs.iter().any(|c| std::sync::Arc::ptr_eq(c, &cq)) {
                    self.cqs.push(cq);
                }
            }
        }
        entry.insert(Conn {
            id: conn,
            group,
            streams: out,
            next: 0,
            verbs,
            last_active: std::time::Instant::now(),
            activity,
            queued: false,
        });
        // A first turn: bytes may have arrived before the socket was ours.
        self.mark(key);
        Ok(key)
    }

    /// Takes connection `idx` out (its sockets leave epoll; they close
    /// when the returned value drops).
    /// Takes connection `idx` out of the side (its sockets out of epoll).
    fn take(&mut self, idx: usize) -> Conn {
        let mut conn = self.conns.remove(idx);
        self.stream_count -= conn.streams.len();
        self.verbs_conns -= conn.verbs.is_some() as usize;
        for s in conn.streams.iter_mut() {
            let _ = self.epoll.registry().deregister(&mut s.sock);
        }
        conn
    }
}

impl TcpSide {
    /// Fills the ready list for a pass: every connection when there are
    /// few streams (returns true: each socket is tried, no epoll call),
    /// else the hot ones and what epoll reports.
    fn gather_ready(&mut self) -> bool {
        let direct = self.direct_poll();
        if direct {
            // Few streams: every socket is tried (no epoll call).
            for (k, c) in self.conns.iter_mut() {
                if !c.queued {
                    c.queued = true;
                    self.ready.push(k);
                }
            }
        } else {
            let passes = self.passes;
            let conns = &self.conns;
            self.hot
                .retain(|&(i, until)| until > passes && conns.contains(i));
            for h in 0..self.hot.len() {
                self.mark(self.hot[h].0);
            }
            if self.hot.is_empty() || self.passes % EPOLL_EVERY_HOT == 0 {
                match self.epoll.poll(&mut self.events, Some(Duration::ZERO)) {
                    Ok(()) => self.apply_events(),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => warn!(shard = self.shard, "epoll_wait failed: {e}"),
                }
            }
        }
        direct
    }

    /// One visit to connection `idx`: its RDMA work, then each stream's
    /// writes and one read's worth of frames. Returns the work done.
    fn visit(
        &mut self,
        idx: usize,
        direct: bool,
        cx: &mut Cx<'_>,
        clock: &mut crate::sys::LazyClock,
    ) -> usize {
        let mut work = 0;
        let Some(conn) = self.conns.get_mut(idx) else {
            return 0;
        };
        conn.queued = false;
        let try_all = direct || self.hot.iter().any(|&(i, _)| i == idx);
        if let Some(v) = &mut conn.verbs {
            match v.poll(cx.done) {
                Ok(n) => work += n,
                Err(reason) => {
                    cx.to_fail.push((ConnRef::Tcp(idx), reason));
                    return work;
                }
            }
        }
        // Socket work only: RDMA completions do not make it active.
        let before = work;
        let mut regions = LiveRegions {
            table: cx.regions,
            updates: cx.updates,
            conn: conn.group,
        };
        let mut sink = ShardSink {
            done: cx.done,
            inbox: cx.inbox,
            conn: conn.group,
            ipc_revoked: cx.ipc_revoked,
            gpu_reqs: None,
            host_copies: None,
            gpu: cx.gpu.as_deref_mut(),
            metrics: cx.metrics,
            shm: false,
        };
        for s in conn.streams.iter_mut() {
            if try_all {
                s.readable = true;
                s.writable = true;
            }
            let step = (|| {
                let mut w = s.flush()? as usize;
                // One read's worth of frames per poll: replies go out and
                // completions are published before the next read.
                w += s.on_readable(&mut regions, &mut sink, clock)? as usize;
                if s.has_tx() {
                    w += s.flush()? as usize;
                }
                Ok::<usize, ConnFault>(w)
            })();
            // Jobs go out even if the stream just failed: their ends are
            // settled (a READ completes) whatever became of it.
            if s.has_codec_jobs() {
                if let Some(c) = self.codec.as_mut() {
                    c.hand_over(idx, conn.id, s);
                }
            }
            match step {
                Ok(w) => work += w,
                Err(reason) => {
                    cx.to_fail.push((ConnRef::Tcp(idx), reason));
                    break;
                }
            }
        }
        if work > before {
            conn.last_active = clock.now();
            if let Some(a) = &conn.activity {
                a.touch(conn.last_active);
            }
            if !direct {
                let until = self.passes + HOT_PASSES;
                match self.hot.iter().position(|&(i, _)| i == idx) {
                    Some(h) => self.hot[h].1 = until,
                    None if self.hot.len() < HOT_CONNS => self.hot.push((idx, until)),
                    None => {}
                }
            }
        }
        if conn.wants_turn() {
            conn.queued = true;
            self.ready.push(idx);
        }
        work
    }
}

impl Source for TcpSide {
    fn poll(&mut self, cx: &mut Cx<'_>) -> usize {
        if self.conns.is_empty() {
            return 0;
        }
        self.passes += 1;
        let mut work = 0;
        if self.codec.is_some() {
            work += self.apply_codec_done(cx);
        }
        let direct = self.gather_ready();
        if self.verbs_conns > 0 {
            work += self.poll_cqs(cx);
        }
        let mut clock = crate::sys::LazyClock::default();
        let mut visiting = std::mem::take(&mut self.visiting);
        std::mem::swap(&mut visiting, &mut self.ready);
        self.visited = visiting.len();
        for idx in visiting.drain(..) {
            work += self.visit(idx, direct, cx, &mut clock);
        }
        self.visiting = visiting;
        work
    }

    fn may_park(&self) -> Park {
        // Sockets wake epoll; RDMA completion queues do not (polled), and
        // work left for the next pass must not wait for an event.
        let io_left = self.ready.iter().any(|&i| {
            self.conns
                .get(i)
                .is_some_and(|c| c.streams.iter().any(|s| s.has_io()))
        });
        let verbs_owed = self.verbs_conns > 0
            && self
                .conns
                .iter()
                .any(|(_, c)| c.verbs.as_ref().is_some_and(|v| v.busy()));
        if io_left || verbs_owed {
            Park::No
        } else {
            Park::Yes
        }
    }
}

mod submit;
#[cfg(test)]
mod tests;

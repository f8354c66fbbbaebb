//! Accepting: the gate that runs incoming handshakes (its hooks: our hello,
//! the key, admission by per-address quota), the per-address slots, and
//! the queue of accepted connections `accept` reports.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::{Inner, Peer, MAX_ACCEPTED_QUEUE, MAX_VERBS_SETUPS};
use crate::error::{ConnId, Error, Result};
use crate::oob::gate::{Done, Gate, GateHooks};
use crate::oob::{self, IoBackend};
use crate::wire::Hello;

/// A handshake's place in its address's quota, given back on drop.
pub(crate) struct PeerSlot {
    counts: Arc<Mutex<HashMap<IpAddr, usize>>>,
    ip: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut pending = self.counts.lock().expect("lock");
        if let Some(n) = pending.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                pending.remove(&self.ip);
            }
        }
    }
}

/// The endpoint's side of the handshake gate.
pub(super) struct AcceptHooks<'a>(&'a Inner);

/// Incoming connections: the listener, its gate, and who accepts.
pub(super) struct Acceptor {
    pub(super) listener: TcpListener,
    /// Incoming handshakes, driven by whoever accepts.
    pub(super) gate: Mutex<Gate<PeerSlot>>,
    /// Ends the gate's wait early (a same-host CONNECT for the passive
    /// accept thread, or `stop_accept`).
    pub(super) gate_waker: Arc<mio::Waker>,
    /// Accepted connections not yet reported by `accept`.
    pub(super) queue: Mutex<VecDeque<(ConnId, Peer)>>,
    pub(super) queue_cv: Condvar,
    pub(super) passive: Mutex<Option<(Arc<AtomicBool>, JoinHandle<()>)>>,
    /// Handshakes under way per remote address (they count against its
    /// quota before their connection is adopted).
    pub(super) handshaking: Arc<Mutex<HashMap<IpAddr, usize>>>,
    /// RDMA setups of accepted connections under way.
    pub(super) verbs_setups: AtomicUsize,
}

impl Acceptor {
    pub(super) fn new(listener: TcpListener, gate: Gate<PeerSlot>) -> Self {
        Self {
            listener,
            gate_waker: gate.waker(),
            gate: Mutex::new(gate),
            queue: Mutex::new(VecDeque::new()),
            queue_cv: Condvar::new(),
            passive: Mutex::new(None),
            handshaking: Arc::new(Mutex::new(HashMap::new())),
            verbs_setups: AtomicUsize::new(0),
        }
    }
}

impl GateHooks for AcceptHooks<'_> {
    type Slot = PeerSlot;

    fn ours(&self) -> Hello {
        self.0.stream_hello()
    }

    fn key(&self) -> Option<&[u8]> {
        self.0.auth_key()
    }

    fn admit(&self, _theirs: &Hello, peer: SocketAddr) -> Result<PeerSlot> {
        self.0.check_conn_limit()?;
        self.0.reserve_peer_slot(peer.ip())
    }

    fn dialed(&self, conn_nonce: u64) -> Option<SocketAddr> {
        let conns = self.0.conns.live.lock().expect("lock");
        conns.values().find_map(|c| c.origin.dialed(conn_nonce))
    }
}

impl Inner {
    /// One remote address may hold at most `max_conns_per_peer` of our
    /// connections, handshakes under way included (it cannot take every
    /// slot). The slot is held until the returned guard drops, by which
    /// time an accepted connection is in `conns`.
    pub(super) fn reserve_peer_slot(&self, ip: IpAddr) -> Result<PeerSlot> {
        // The effective quota never exceeds the whole limit.
        let max = self.cfg.max_conns_per_peer.min(self.cfg.max_conns);
        let conns = self.conns.live.lock().expect("lock");
        let held = conns
            .values()
            .filter(|c| matches!(c.peer, Peer::Net(a) if a.ip() == ip))
            .count();
        let mut pending = self.accept.handshaking.lock().expect("lock");
        let n = pending.entry(ip).or_insert(0);
        if held + *n >= max {
            return Err(Error::LimitReached {
                limit: "FERRY_MAX_CONNS_PER_PEER",
                max,
            });
        }
        *n += 1;
        Ok(PeerSlot {
            counts: self.accept.handshaking.clone(),
            ip,
        })
    }

    /// Runs the handshake gate for up to `timeout`: accepts sockets and
    /// advances every handshake on one epoll loop (no thread per socket,
    /// so silent or slow clients cannot hold up the others). Finished
    /// connections land in `accepted`.
    pub(super) fn accept_step(self: &Arc<Self>, timeout: Duration) -> Result<()> {
        let done = match self.accept.gate.try_lock() {
            Ok(mut gate) => gate.step(&self.accept.listener, &AcceptHooks(self), timeout)?,
            Err(_) => {
                // Another thread drives the gate; its results reach `accepted`.
                std::thread::sleep(timeout.min(Duration::from_millis(1)));
                return Ok(());
            }
        };
        for d in done {
            self.finish_accepted(d);
        }
        Ok(())
    }

    /// Adopts a connection whose handshake finished. An RDMA setup (one
    /// more exchange with the peer) runs on a thread of its own, bounded,
    /// so a peer that stalls it holds up nobody else.
    pub(super) fn finish_accepted(self: &Arc<Self>, d: Done<PeerSlot>) {
        let peer = d.peer;
        if self.goes_local(&d.ours, &d.theirs) {
            // Both sides see the same hellos and decide alike: the peer now
            // comes through our accept ring instead.
            info!(%peer, "peer is on this host: expecting a same-host connection");
            return;
        }
        fn adopt(inner: &Arc<Inner>, d: Done<PeerSlot>) {
            let peer = d.peer;
            match inner.adopt(d.streams, &d.hellos, false, peer) {
                Ok(conn) => inner.push_accepted(conn, Peer::Net(peer)),
                Err(e) => warn!(%peer, "incoming connection failed: {e}"),
            }
            drop(d.slot);
        }
        if !self.wants_verbs(&d.ours, &d.theirs) {
            return adopt(self, d);
        }
        for s in &d.streams {
            // The verbs exchange runs on the control backend, whose calls
            // expect their socket mode (the shard sets its own after).
            let _ = s.set_nonblocking(self.me.backend == IoBackend::Epoll);
        }
        if self.accept.verbs_setups.fetch_add(1, Ordering::AcqRel) >= MAX_VERBS_SETUPS {
            self.accept.verbs_setups.fetch_sub(1, Ordering::AcqRel);
            warn!(%peer, "{MAX_VERBS_SETUPS} RDMA setups already under way; connection dropped");
            return;
        }
        let inner = self.clone();
        let spawned = std::thread::Builder::new()
            .name("ferry-verbs-setup".to_owned())
            .spawn(move || {
                adopt(&inner, d);
                inner.accept.verbs_setups.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            self.accept.verbs_setups.fetch_sub(1, Ordering::AcqRel);
            warn!(%peer, "spawn RDMA setup thread: {e}");
        }
    }

    pub(super) fn push_accepted(&self, conn: ConnId, peer: Peer) {
        let mut q = self.accept.queue.lock().expect("lock");
        if q.len() >= MAX_ACCEPTED_QUEUE {
            let (old, _) = q.pop_front().expect("non-empty");
            warn!(conn = %old, "nobody called accept(); forgetting the oldest accepted connection (it stays usable)");
        }
        q.push_back((conn, peer));
        self.accept.queue_cv.notify_all();
    }

    pub(super) fn accept_one(self: &Arc<Self>, timeout: Duration) -> Result<(ConnId, Peer)> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(got) = self.accept.queue.lock().expect("lock").pop_front() {
                return Ok(got);
            }
            let Some(left) = oob::remaining(deadline) else {
                return Err(Error::AcceptTimeout {
                    timeout_ms: oob::ms(timeout),
                });
            };
            // Short steps, so a connection whose handshake finished on its
            // own thread, or a same-host CONNECT, is answered promptly.
            self.accept_local_step();
            self.accept_step(left.min(Duration::from_millis(5)))?;
        }
    }

    pub(super) fn next_accepted(&self, timeout: Duration) -> Result<(ConnId, Peer)> {
        let deadline = Instant::now() + timeout;
        let mut q = self.accept.queue.lock().expect("lock");
        loop {
            if let Some(got) = q.pop_front() {
                return Ok(got);
            }
            let Some(left) = oob::remaining(deadline) else {
                return Err(Error::AcceptTimeout {
                    timeout_ms: oob::ms(timeout),
                });
            };
            q = self.accept.queue_cv.wait_timeout(q, left).expect("lock").0;
        }
    }
}

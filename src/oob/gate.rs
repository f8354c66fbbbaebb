//! The accepting side's handshakes, all on one epoll loop: no thread per
//! socket, so silent or slow sockets cost a slot and a few hundred bytes,
//! never a thread, and cannot starve the honest ones.
//!
//! Each accepted socket is non-blocking and owned by the accepting
//! handshake's sans-IO machine (`accept.rs`): read the `Hello`, wait for
//! the connection's other streams, send `HelloAck` (and our proof when a
//! secret is set), read the peer's proof, send `AuthOk`. A connection of N
//! streams is acknowledged only when all N have arrived (`admission.rs`,
//! which also counts sockets per address and picks whom to evict), so a
//! client never holds acks for a connection we dropped. This file is the
//! epoll loop that moves their bytes.
//!
//! Bounds, all ours: at most `max_pending` sockets in handshake, at most
//! `max_per_addr` from one address; a new socket over either bound evicts
//! one (of its address, else overall) together with its connection's other
//! streams: the oldest of those that have sent nothing, else the oldest. A socket must send its first bytes within `first_bytes`
//! and finish within `whole`. At most `accept_batch` sockets are accepted
//! per pass, and each pass also serves every ready socket, so a pending
//! handshake lives through at least `max_pending / accept_batch` passes of
//! newcomers before it can be evicted: a legitimate client (a few round
//! trips) finishes first even while an attacker reconnects as fast as it is
//! dropped.
//!
//! The gate multiplexes readiness with epoll on either control backend:
//! io_uring's gain on the control path is one-shot operations with linked
//! timeouts (connects), not readiness of many sockets.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use slab::Slab;
use tracing::debug;

use super::accept::{AcceptHs, Heard};
use super::admission::{eviction_scope, victim, Admission, Candidate, GroupKey};
use crate::error::{Error, Result};
use crate::wire::{ControlFrame, Hello};

use super::handshake::REJECT_PROTOCOL;

const LISTENER: Token = Token(usize::MAX);
const WAKE: Token = Token(usize::MAX - 1);

/// The gate's bounds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GateLimits {
    pub max_pending: usize,
    pub max_per_addr: usize,
    pub accept_batch: usize,
    /// A socket that sends nothing for this long is dropped.
    pub first_bytes: Duration,
    /// A handshake not finished in this time is dropped.
    pub whole: Duration,
}

/// What the endpoint decides for the gate.
pub(crate) trait GateHooks {
    /// Held from admission until the connection is adopted (a quota place).
    type Slot;
    /// Our `Hello` for one new stream (fresh auth nonce).
    fn ours(&self) -> Hello;
    fn key(&self) -> Option<&[u8]>;
    /// Called once per connection when all its streams have arrived, before
    /// any is acknowledged: `Err` refuses the connection with its text.
    fn admit(&self, theirs: &Hello, peer: SocketAddr) -> Result<Self::Slot>;
    /// The address we dialed the connection of nonce `conn_nonce` to, if
    /// one of ours has it (a vouch question, `Endpoint::vouch`).
    fn dialed(&self, conn_nonce: u64) -> Option<SocketAddr>;
}

/// A connection whose every stream finished its handshake.
pub(crate) struct Done<S> {
    /// The peer's `Hello` on stream 0 (its endpoint id, caps, limits).
    pub theirs: Hello,
    /// Our `Hello` on stream 0.
    pub ours: Hello,
    pub peer: SocketAddr,
    /// In stream order, non-blocking.
    pub streams: Vec<TcpStream>,
    /// Each stream's (our hello, the peer's), in stream order.
    pub hellos: Vec<(Hello, Hello)>,
    pub slot: S,
}

/// Counters, for logs and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GateStats {
    pub accepted: u64,
    pub evicted: u64,
    pub expired: u64,
    pub refused: u64,
    pub done: u64,
}

/// One accepted socket and its handshake.
struct Accepting {
    sock: TcpStream,
    peer: SocketAddr,
    since: Instant,
    hs: AcceptHs,
    group: Option<GroupKey>,
}

pub(crate) struct Gate<S> {
    poll: Poll,
    /// Ends a `step` early: something else for the accepting thread to do
    /// (a same-host CONNECT arrived).
    waker: std::sync::Arc<mio::Waker>,
    events: Events,
    listener_fd: i32,
    limits: GateLimits,
    socks: Slab<Accepting>,
    adm: Admission<S>,
    stats: GateStats,
    /// Sockets whose state changed outside an event and need a turn.
    kick: Vec<usize>,
    /// The last pass stopped at `accept_batch`: more may wait in the
    /// backlog (epoll is edge-triggered, so no new event says so).
    backlog: bool,
}

enum Next {
    Keep,
    Drop(&'static str),
}

impl<S> Gate<S> {
    /// Serves `listener` (set non-blocking here).
    pub fn new(listener: &TcpListener, limits: GateLimits) -> Result<Self> {
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("fcntl(O_NONBLOCK)", e))?;
        let poll = Poll::new().map_err(|e| Error::io("epoll_create", e))?;
        let fd = listener.as_raw_fd();
        poll.registry()
            .register(&mut SourceFd(&fd), LISTENER, Interest::READABLE)
            .map_err(|e| Error::io("epoll_ctl(listener)", e))?;
        let waker = std::sync::Arc::new(
            mio::Waker::new(poll.registry(), WAKE).map_err(|e| Error::io("eventfd", e))?,
        );
        Ok(Self {
            poll,
            waker,
            events: Events::with_capacity(256),
            listener_fd: fd,
            limits,
            socks: Slab::new(),
            adm: Admission::default(),
            stats: GateStats::default(),
            kick: Vec::new(),
            backlog: false,
        })
    }

    /// Wakes the thread in `step` (it returns early).
    pub fn waker(&self) -> std::sync::Arc<mio::Waker> {
        self.waker.clone()
    }

    #[cfg(test)]
    pub fn stats(&self) -> GateStats {
        self.stats
    }

    #[cfg(test)]
    pub fn pending(&self) -> usize {
        self.socks.len()
    }

    /// Runs for up to `timeout` (returning early once a connection is
    /// done) and returns the connections whose handshakes finished.
    pub fn step<H: GateHooks<Slot = S>>(
        &mut self,
        listener: &TcpListener,
        hooks: &H,
        timeout: Duration,
    ) -> Result<Vec<Done<S>>> {
        let deadline = Instant::now() + timeout;
        let mut done = Vec::new();
        loop {
            let now = Instant::now();
            let next = self.expire(now);
            let wait = if self.backlog || !self.kick.is_empty() {
                Duration::ZERO
            } else {
                next.map_or(deadline, |d| d.min(deadline))
                    .saturating_duration_since(now)
            };
            match self.poll.poll(&mut self.events, Some(wait)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("epoll_wait", e)),
            }
            let mut accept = std::mem::take(&mut self.backlog);
            let mut woken = false;
            let mut ready = std::mem::take(&mut self.kick);
            for ev in self.events.iter() {
                match ev.token() {
                    LISTENER => accept = true,
                    WAKE => woken = true,
                    t => ready.push(t.0),
                }
            }
            // Serve sockets already here before taking newcomers.
            for key in ready {
                self.turn(key, hooks, &mut done);
            }
            while let Some(key) = self.kick.pop() {
                self.turn(key, hooks, &mut done);
            }
            if accept {
                self.accept_some(listener);
            }
            if woken || !done.is_empty() || Instant::now() >= deadline {
                return Ok(done);
            }
        }
    }

    /// Drops the sockets past their deadline (first bytes, or the whole
    /// handshake); returns the earliest deadline of those left.
    fn expire(&mut self, now: Instant) -> Option<Instant> {
        let (first, whole) = (
            self.limits.first_bytes.min(self.limits.whole),
            self.limits.whole,
        );
        let mut next: Option<Instant> = None;
        let mut late = Vec::new();
        for (k, h) in self.socks.iter() {
            let due = h.since + if h.hs.heard() { whole } else { first };
            if due <= now {
                late.push(k);
            } else {
                next = Some(next.map_or(due, |n| n.min(due)));
            }
        }
        for k in late {
            if self.socks.contains(k) {
                self.stats.expired += 1;
                self.drop_with_group(k, "handshake deadline passed");
            }
        }
        next
    }

    fn accept_some(&mut self, listener: &TcpListener) {
        self.backlog = true;
        for _ in 0..self.limits.accept_batch {
            let (s, peer) = match listener.accept() {
                Ok(got) => got,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.backlog = false;
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                    // Out of descriptors: give the oldest one back, try later.
                    debug!("accept: {e}; evicting the oldest handshake");
                    if let Some(k) = self.oldest(None) {
                        self.stats.evicted += 1;
                        self.drop_with_group(k, "out of file descriptors");
                    }
                    return;
                }
                Err(e) => {
                    debug!("accept: {e}");
                    return;
                }
            };
            self.stats.accepted += 1;
            let ip = peer.ip();
            let victim = eviction_scope(
                self.adm.count_of(ip),
                self.socks.len(),
                self.limits.max_per_addr,
                self.limits.max_pending,
                ip,
            )
            .and_then(|scope| self.oldest(scope));
            if let Some(k) = victim {
                self.stats.evicted += 1;
                self.drop_with_group(k, "evicted by a newer handshake");
            }
            if s.set_nonblocking(true).is_err() || s.set_nodelay(true).is_err() {
                continue;
            }
            let entry = self.socks.vacant_entry();
            let key = entry.key();
            let fd = s.as_raw_fd();
            if self
                .poll
                .registry()
                .register(
                    &mut SourceFd(&fd),
                    Token(key),
                    Interest::READABLE | Interest::WRITABLE,
                )
                .is_err()
            {
                continue;
            }
            entry.insert(Accepting {
                sock: s,
                peer,
                since: Instant::now(),
                hs: AcceptHs::new(),
                group: None,
            });
            self.adm.arrived(ip);
            self.kick.push(key);
        }
    }

    /// The socket to evict (from `ip` only, if given): the oldest of those
    /// that have sent nothing yet, else the oldest.
    fn oldest(&self, ip: Option<IpAddr>) -> Option<usize> {
        let cands = self.socks.iter().map(|(key, h)| Candidate {
            key,
            ip: h.peer.ip(),
            heard: h.hs.heard(),
            since: h.since,
        });
        victim(cands, ip)
    }

    /// Gives socket `key` a turn: write what is queued, read what is due.
    fn turn<H: GateHooks<Slot = S>>(&mut self, key: usize, hooks: &H, done: &mut Vec<Done<S>>) {
        if !self.socks.contains(key) {
            return;
        }
        match self.io(key, hooks) {
            Next::Keep => {}
            Next::Drop(why) => {
                self.drop_with_group(key, why);
                return;
            }
        }
        if self.socks[key].hs.finished() {
            if self.socks[key].group.is_none() {
                // A vouch question, answered: nothing more on it.
                self.remove(key);
                return;
            }
            if let Some(d) = self.take_if_done(key) {
                self.stats.done += 1;
                done.push(d);
            }
        }
    }

    fn io<H: GateHooks<Slot = S>>(&mut self, key: usize, hooks: &H) -> Next {
        loop {
            let h = &mut self.socks[key];
            while !h.hs.to_send().is_empty() {
                match (&h.sock).write(h.hs.to_send()) {
                    Ok(n) => h.hs.sent(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Next::Keep,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => return Next::Drop("send failed"),
                }
            }
            if !h.hs.reading() {
                return Next::Keep;
            }
            let got = match (&h.sock).read(h.hs.rx_buf()) {
                Ok(0) => return Next::Drop("closed by the peer"),
                Ok(n) => h.hs.received(n, hooks.key()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Next::Keep,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return Next::Drop("receive failed"),
            };
            let joined = match got {
                Ok(Heard::Nothing) => Ok(()),
                Ok(Heard::Hello(theirs)) => self.join(key, theirs, hooks),
                Ok(Heard::Vouch {
                    conn_nonce,
                    challenge,
                }) => {
                    let dialed = hooks.dialed(conn_nonce);
                    let mac = hooks.key().map_or([0; 32], |k| {
                        crate::auth::vouch_mac(
                            k,
                            conn_nonce,
                            challenge,
                            &crate::wire::encode_dialed(dialed),
                        )
                    });
                    self.socks[key]
                        .hs
                        .answer(ControlFrame::Vouched { dialed, mac });
                    Ok(())
                }
                Err(why) => Err(why),
            };
            if let Err(why) = joined {
                self.refuse(key, &why);
                return Next::Drop("refused");
            }
        }
    }

    /// Files a stream under its connection; acknowledges the whole
    /// connection once every stream is here and it is admitted.
    fn join<H: GateHooks<Slot = S>>(
        &mut self,
        key: usize,
        theirs: Hello,
        hooks: &H,
    ) -> std::result::Result<(), String> {
        let peer = self.socks[key].peer;
        let socks = &self.socks;
        let whole = self
            .adm
            .join(key, &theirs, peer.ip(), |k| socks[k].peer.ip())?;
        let gk = (theirs.endpoint_id, theirs.conn_nonce);
        self.socks[key].group = Some(gk);
        let Some(members) = whole else {
            return Ok(());
        };
        let slot = match hooks.admit(&theirs, peer) {
            Ok(slot) => slot,
            Err(e) => {
                // Every stream hears why (the caller answers this one).
                let why = e.to_string();
                for &m in members.iter().filter(|&&m| m != key) {
                    self.refuse(m, &why);
                }
                return Err(why);
            }
        };
        self.adm.admitted(gk, slot);
        for m in members {
            self.socks[m].hs.acknowledge(hooks.ours(), hooks.key());
            if m != key {
                self.kick.push(m);
            }
        }
        Ok(())
    }

    /// Removes and returns the connection of `key` if every stream of it
    /// has finished.
    fn take_if_done(&mut self, key: usize) -> Option<Done<S>> {
        let gk = self.socks[key].group?;
        let g = self.adm.group(gk)?;
        let all = g
            .members
            .iter()
            .all(|m| m.is_some_and(|k| self.socks[k].hs.finished()));
        if !all {
            return None;
        }
        let g = self.adm.take(gk).expect("present");
        let mut streams = Vec::with_capacity(g.members.len());
        let mut hellos = Vec::with_capacity(g.members.len());
        let mut peer = None;
        for k in g.members.into_iter().flatten() {
            let h = self.remove(k);
            hellos.push((h.hs.ours().expect("sent"), h.hs.theirs().expect("read")));
            peer.get_or_insert(h.peer);
            streams.push(h.sock);
        }
        Some(Done {
            theirs: hellos[0].1,
            ours: hellos[0].0,
            peer: peer.expect("one stream"),
            streams,
            hellos,
            slot: g.slot.expect("admitted"),
        })
    }

    /// Best effort: tells the peer why, without waiting.
    fn refuse(&mut self, key: usize, why: &str) {
        self.stats.refused += 1;
        let h = &self.socks[key];
        debug!(peer = %h.peer, "handshake refused: {why}");
        let frame = ControlFrame::Error {
            code: REJECT_PROTOCOL,
            message: why.to_owned(),
        };
        let _ = (&h.sock).write(&frame.encode());
    }

    fn remove(&mut self, key: usize) -> Accepting {
        let h = self.socks.remove(key);
        let fd = h.sock.as_raw_fd();
        let _ = self.poll.registry().deregister(&mut SourceFd(&fd));
        self.adm.left(h.peer.ip());
        h
    }

    /// Drops socket `key` and the other streams of its connection.
    fn drop_with_group(&mut self, key: usize, why: &'static str) {
        let h = self.remove(key);
        debug!(peer = %h.peer, "handshake dropped: {why}");
        if let Some(g) = h.group.and_then(|gk| self.adm.take(gk)) {
            for k in g.members.into_iter().flatten() {
                if k != key && self.socks.contains(k) {
                    self.remove(k);
                }
            }
        }
    }
}

impl<S> Drop for Gate<S> {
    fn drop(&mut self) {
        let fd = self.listener_fd;
        let _ = self.poll.registry().deregister(&mut SourceFd(&fd));
    }
}

#[cfg(test)]
mod tests;

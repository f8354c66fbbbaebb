//! A shard's same-host connections as an event source: each connection's
//! pair of shared-memory rings, the endpoint's accept ring and fd-passing
//! socket (on shard 0, which owns them), and this shard's copy of the
//! peers' memfd memory mapped here (`shm/peers.rs`). Rings cannot wake an
//! epoll wait, so this source bounds how long the shard may sleep.
//!
//! Rings are polled, so a pass would cost every connection something;
//! instead only the hot ones (with anything under way, or traffic in the
//! last `COOL_AFTER`) are polled every pass. A quiet one is marked cold in
//! its ring's header, and its peer then rings the shard's doorbell
//! (`shm/bell.rs`) with each message: a pass looks at one word for all of
//! them, and the connections rung are hot again. The shard parks with
//! requests outstanding too: announcing the sleep marks every hot ring
//! cold for its length, so any message wakes it through the doorbell's
//! FIFO in its epoll set.
//!
//! Without a doorbell (one could not be made) quiet rings are polled one
//! every `COLD_EVERY_PASSES` passes, in turn, and a parked shard with
//! same-host connections wakes every `LOCAL_PARK`.

use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use slab::Slab;
use tracing::warn;

use super::plan::{self, Route};
use super::queue::OpCmd;
use super::source::{
    Carrier, ConnCheck, ConnRef, Cx, LiveRegions, Park, Removed, ShardSink, Source, SubmitCx,
};
use crate::error::{ConnFault, ConnId};
use crate::region::KeyRef;
use crate::shm::bell::{Bell, ACCEPT_BIT, BELL_BITS};
use crate::shm::cma::Cma;
use crate::shm::fdpass::FdListener;
use crate::shm::local::{LocalConn, PeerMaps};
use crate::shm::named_ring::ShmRing;
use crate::shm::peers::PeerShares;
use crate::shm::ring::SLOT_PAYLOAD;
use crate::wire::shm_msg::{Msg, MsgKind};

/// Without a doorbell, a parked shard with same-host connections wakes
/// this often (and with one, while fd-passing senders wait).
const LOCAL_PARK: Duration = Duration::from_millis(1);
/// Without a doorbell, a parked shard that owns the accept ring wakes this
/// often.
const ACCEPT_RING_PARK: Duration = Duration::from_millis(10);
/// Polls between looks at the clock for the fd-passing socket ...
const FD_CHECK_EVERY: u32 = 4096;
/// ... which a spinning shard looks at (an `accept4`) this often. (A
/// parked one is woken by it: it is in the epoll set.) Every 4096 passes
/// was every ~0.1 ms on 16 cores: a syscall that often lands on a round
/// trip now and then, in both processes of a same-host pair; a sender waits
/// for this look only once, when it first connects.
const FD_CHECK_INTERVAL: Duration = Duration::from_millis(2);
/// Passes between polls of a quiet connection (one, in turn). A look at a
/// quiet ring costs a TLB and cache miss or two (~0.3 µs): at this rate
/// they cost a pass ~0.1 µs on average however many there are.
const COLD_EVERY_PASSES: u32 = 4;
/// With a doorbell, quiet rings are still polled in turn, this rarely: a
/// peer that failed to ring costs a delay, not a lost message.
const COLD_EVERY_PASSES_RUNG: u32 = 256;
/// A connection with nothing under way cools (is polled in turn instead of
/// every pass) once it has seen no traffic for this many passes and ...
const COOL_AFTER_PASSES: u32 = 1024;
/// ... this long, so connections with steady traffic stay hot.
const COOL_AFTER: Duration = Duration::from_millis(10);

/// What the shard that owns same-host connections also polls.
pub(crate) struct LocalSetup {
    /// CONNECT messages from local peers arrive here.
    pub accept_ring: ShmRing,
    /// Local peers share their memfd regions through this socket.
    pub fd_listener: FdListener,
    /// Forwards CONNECT messages (and their inline proof) to the endpoint's
    /// accept path ...
    pub connects: SyncSender<(Msg, Vec<u8>)>,
    /// ... and wakes the thread running it.
    pub wake_accept: std::sync::Arc<mio::Waker>,
}

/// What a shard's same-host side starts with.
pub(crate) struct LocalInit {
    /// On the shard that owns them (shard 0): the accept ring and the
    /// fd-passing socket.
    pub setup: Option<LocalSetup>,
    /// The shard's doorbell (None: quiet rings are polled in turn).
    pub bell: Option<Bell>,
    /// The endpoint's same-host peers and their mapped memory.
    pub shares: Arc<PeerShares>,
}

#[cfg(test)]
impl LocalInit {
    /// A shard of its own: no accept ring, its own peer view.
    pub fn bare(bell: Option<Bell>) -> Self {
        Self {
            setup: None,
            bell,
            shares: Arc::default(),
        }
    }
}

pub(crate) struct LocalSide {
    pub conns: Slab<LocalConn>,
    setup: Option<LocalSetup>,
    /// Every shard's view of the peers (written on the control path) ...
    shares: Arc<PeerShares>,
    /// ... and this shard's copy of their maps, of generation `maps_gen`.
    pub peer_maps: PeerMaps,
    maps_gen: u64,
    polls: u32,
    /// When the spinning shard last looked at the fd-passing socket.
    fd_checked: Option<Instant>,
    shard: usize,
    /// Connections polled every pass.
    hot: Vec<usize>,
    /// Where the turn of the quiet connections stands (a slab index).
    cursor: usize,
    /// Rings the last pass looked at (what a pass costs).
    pub visited: usize,
    bell: Option<Bell>,
    /// Scratch for the bits taken from the doorbell.
    rung: Vec<u32>,
    /// Peers whose last connection on this shard ended (their IPC
    /// mappings here are closed by the shard's GPU work, then cleared).
    pub peers_gone: Vec<u64>,
}

impl LocalSide {
    pub fn new(shard: usize, init: LocalInit) -> Self {
        let LocalInit {
            setup,
            bell,
            shares,
        } = init;
        Self {
            conns: Slab::new(),
            setup,
            bell,
            rung: Vec::new(),
            peers_gone: Vec::new(),
            shares,
            peer_maps: PeerMaps::default(),
            maps_gen: 0,
            polls: 0,
            fd_checked: None,
            shard,
            hot: Vec::new(),
            cursor: 0,
            visited: 0,
        }
    }

    /// The doorbell's FIFO and the fd-passing socket: the shard's epoll set
    /// watches them, so a parked shard wakes for a rung ring or a sender.
    /// With each, whether the shard should say when it was ready (the
    /// socket: `poll_fd_listener` then).
    pub fn wake_fds(&self) -> [Option<(i32, bool)>; 2] {
        [
            self.bell.as_ref().map(|b| (b.fd(), false)),
            self.setup.as_ref().map(|s| (s.fd_listener.fd(), true)),
        ]
    }

    /// Takes a new connection in (hot: its first messages are near).
    pub fn add(&mut self, mut lc: LocalConn) -> usize {
        let idx = self.conns.vacant_key();
        let bit = idx as u64 + 1;
        if self.bell.is_some() && bit < u64::from(BELL_BITS) {
            lc.bell_bit = Some(bit as u32);
            lc.set_cold(false);
        }
        let idx = self.conns.insert(lc);
        self.heat(idx);
        idx
    }

    /// At the end of a pass: rings the doorbells of the peers that the
    /// pass pushed to quietly (hot connections push quietly; see
    /// `LocalConn::tx_push`).
    pub fn ring_due(&mut self) {
        for h in 0..self.hot.len() {
            self.ring_one(self.hot[h]);
        }
    }

    /// `ring_due` for connection `idx` alone (an op applied outside a pass).
    pub fn ring_one(&mut self, idx: usize) {
        if let Some(lc) = self.conns.get_mut(idx) {
            lc.ring_if_due();
        }
    }

    /// Before a sleep: the doorbell is told, and every ring polled until
    /// now is marked cold for its length. The caller then polls once more
    /// (messages that came before the marks were seen) before sleeping.
    pub fn park_begin(&mut self) {
        let Some(b) = &self.bell else { return };
        b.set_parked(true);
        for &i in &self.hot {
            if let Some(lc) = self.conns.get(i).filter(|lc| lc.hot) {
                lc.set_cold(true);
            }
        }
    }

    /// After the sleep (or the decision not to sleep): hot rings are polled
    /// again, unrung.
    pub fn park_end(&mut self) {
        let Some(b) = &self.bell else { return };
        b.set_parked(false);
        b.drain();
        for &i in &self.hot {
            if let Some(lc) = self.conns.get(i).filter(|lc| lc.hot) {
                lc.set_cold(false);
            }
        }
    }

    /// Makes the connections whose peers rang hot; returns how many.
    fn take_rung(&mut self) -> usize {
        let Some(b) = &self.bell else { return 0 };
        let mut rung = std::mem::take(&mut self.rung);
        let n = b.take(|bit| rung.push(bit));
        for bit in rung.drain(..) {
            // The accept ring is polled every pass anyway.
            if bit != ACCEPT_BIT {
                self.heat(bit as usize - 1);
            }
        }
        self.rung = rung;
        n
    }

    /// Gives the traffic the hot connections saw since the last call the
    /// time `now` (the timeout checks call it, every few passes): their
    /// `last_active` is then late by at most that long.
    pub fn settle_activity(&mut self, now: Instant) {
        for &i in &self.hot {
            if let Some(lc) = self.conns.get_mut(i) {
                lc.last_active(now);
            }
        }
    }

    /// Whether a request of ours waits for its reply on a same-host ring.
    pub fn awaiting_replies(&self) -> bool {
        self.hot
            .iter()
            .any(|&i| self.conns.get(i).is_some_and(|c| c.has_pending()))
    }

    /// The connections polled every pass (may name removed ones).
    pub fn hot(&self) -> &[usize] {
        &self.hot
    }

    /// Tells every connection's peer to close its mappings of our
    /// allocation at `alloc_base`; one that must wait for ring room is
    /// kept hot (polled) until it sent it.
    pub fn revoke_ipc(&mut self, alloc_base: u64) {
        let mut owing = Vec::new();
        for (i, lc) in self.conns.iter_mut() {
            lc.push_ipc_revoke(alloc_base);
            if lc.owes_revokes() {
                owing.push(i);
            }
        }
        for i in owing {
            self.heat(i);
        }
    }

    /// Polls connection `idx` every pass from now on (the shard calls it
    /// after queueing messages on it).
    pub fn heat(&mut self, idx: usize) {
        if let Some(lc) = self.conns.get_mut(idx) {
            lc.quiet_passes = 0;
            if !lc.hot {
                lc.hot = true;
                lc.set_cold(false);
                self.hot.push(idx);
            }
        }
    }

    /// Takes in the fds local peers sent (memfd regions to map).
    /// Only a peer with an established connection (on any shard) from that
    /// very process may share memory with us.
    pub fn poll_fd_listener(&mut self) -> usize {
        match &mut self.setup {
            Some(ls) => self.shares.poll_listener(&mut ls.fd_listener),
            None => 0,
        }
    }

    /// Whether `FD_CHECK_INTERVAL` passed since the last look (which this
    /// call then counts as made).
    fn fd_check_due(&mut self, clock: &mut crate::sys::LazyClock) -> bool {
        if self.setup.is_none() {
            return false;
        }
        let now = clock.now();
        if self
            .fd_checked
            .is_some_and(|t| now.saturating_duration_since(t) < FD_CHECK_INTERVAL)
        {
            return false;
        }
        self.fd_checked = Some(now);
        true
    }

    /// Refreshes this shard's copy of the peers' maps if they changed.
    fn refresh_maps(&mut self) {
        if self.shares.generation() != self.maps_gen {
            self.maps_gen = self.shares.copy_maps(&mut self.peer_maps);
        }
    }

    /// A connection of `peer` (process `pid`) on this shard ended: the
    /// endpoint forgets the peer's mapped memory once no connection to it
    /// is left on any shard (copies in flight hold their own reference to
    /// a mapping). Returns whether this shard has none left to it.
    pub fn conn_ended(&mut self, peer: u64, pid: u32) -> bool {
        self.shares.conn_down(peer, pid);
        self.refresh_maps();
        !self.conns.iter().any(|(_, c)| c.peer_id == peer)
    }

    fn poll_accept_ring(&mut self) -> usize {
        let Some(ls) = &self.setup else { return 0 };
        let mut work = 0;
        let mut buf = [0u8; SLOT_PAYLOAD];
        while let Some(n) = ls.accept_ring.ring.pop(&mut buf) {
            work += 1;
            match Msg::decode(&buf[..n]) {
                Ok((m, inline)) if m.kind == MsgKind::Connect => {
                    if ls.connects.try_send((m, inline.to_vec())).is_err() {
                        warn!(
                            shard = self.shard,
                            "local CONNECT dropped: too many waiting for accept"
                        );
                    } else {
                        let _ = ls.wake_accept.wake();
                    }
                }
                Ok((m, _)) => warn!(
                    shard = self.shard,
                    "unexpected {:?} on the accept ring", m.kind
                ),
                Err(e) => warn!(shard = self.shard, "bad message on the accept ring: {e}"),
            }
        }
        work
    }
}

impl Source for LocalSide {
    fn poll(&mut self, cx: &mut Cx<'_>) -> usize {
        let mut work = self.poll_accept_ring() + self.take_rung();
        self.polls = self.polls.wrapping_add(1);
        self.refresh_maps();
        let senders_waiting = self.setup.as_ref().is_some_and(|ls| ls.fd_listener.busy());
        let mut clock = crate::sys::LazyClock::default();
        if senders_waiting || (self.polls % FD_CHECK_EVERY == 0 && self.fd_check_due(&mut clock)) {
            work += self.poll_fd_listener();
        }
        // The hot ones, every pass; those quiet for long enough cool off.
        self.visited = self.hot.len();
        let mut i = 0;
        while i < self.hot.len() {
            let idx = self.hot[i];
            let Some(lc) = self.conns.get_mut(idx).filter(|lc| lc.hot) else {
                if let Some(lc) = self.conns.get_mut(idx) {
                    lc.ring_if_due();
                }
                self.hot.swap_remove(i);
                continue;
            };
            let w = poll_one(idx, lc, &self.peer_maps, cx);
            work += w;
            if w > 0 || lc.busy() {
                lc.quiet_passes = 0;
            } else {
                lc.quiet_passes = lc.quiet_passes.saturating_add(1);
                // With a doorbell, only a ring that has a bit on it cools.
                let can_cool = self.bell.is_none() || lc.bell_bit.is_some();
                if can_cool && lc.quiet_passes > COOL_AFTER_PASSES && {
                    let now = clock.now();
                    now.saturating_duration_since(lc.last_active(now)) > COOL_AFTER
                } {
                    // Marked cold first, then looked at once more: a
                    // message pushed before the peer saw the mark is
                    // found here, any later one rings.
                    lc.set_cold(true);
                    let w = poll_one(idx, lc, &self.peer_maps, cx);
                    if w == 0 {
                        // Leaves the list `ring_due` walks: ring now.
                        lc.ring_if_due();
                        lc.hot = false;
                        self.hot.swap_remove(i);
                        continue;
                    }
                    work += w;
                    lc.set_cold(false);
                    lc.quiet_passes = 0;
                }
            }
            i += 1;
        }
        // One quiet one every few passes, in turn (without a doorbell and
        // with few connections, each is looked at every pass: they are all
        // hot or cheap).
        let slots = self.conns.capacity();
        let cold_turn = if self.bell.is_some() {
            self.polls % COLD_EVERY_PASSES_RUNG == 0
        } else {
            slots <= 4 || self.polls % COLD_EVERY_PASSES == 0
        };
        if slots > 0 && cold_turn {
            for _ in 0..slots.min(4) {
                let idx = self.cursor % slots;
                self.cursor = self.cursor.wrapping_add(1);
                let Some(lc) = self.conns.get_mut(idx).filter(|lc| !lc.hot) else {
                    continue;
                };
                let w = poll_one(idx, lc, &self.peer_maps, cx);
                self.visited += 1;
                if w > 0 {
                    work += w;
                    self.heat(idx);
                }
                break;
            }
        }
        work
    }

    fn may_park(&self) -> Park {
        if self.bell.is_some() {
            // Every ring wakes the shard through the doorbell while it
            // sleeps, but some work only polling moves on.
            let mut park = Park::Yes;
            for lc in self.hot.iter().filter_map(|&i| self.conns.get(i)) {
                if lc.needs_polling() {
                    return Park::No;
                }
                if lc.owes_revokes() {
                    park = park.and(Park::Within(LOCAL_PARK));
                }
                if lc.bell_bit.is_none() {
                    park = Park::Within(LOCAL_PARK);
                }
            }
            if self.setup.as_ref().is_some_and(|s| s.fd_listener.busy()) {
                park = park.and(Park::Within(LOCAL_PARK));
            }
            return park;
        }
        // A connection with anything under way is hot.
        if self
            .hot
            .iter()
            .any(|&i| self.conns.get(i).is_some_and(|c| c.busy_with_ops()))
        {
            // Replies arrive on rings, which cannot wake an epoll wait.
            Park::No
        } else if !self.conns.is_empty() {
            Park::Within(LOCAL_PARK)
        } else if self.setup.is_some() {
            Park::Within(ACCEPT_RING_PARK)
        } else {
            Park::Yes
        }
    }
}

impl LocalSide {
    /// Who same-host connection `idx` is with, for a report.
    pub fn peer_name(&self, idx: usize) -> String {
        match self.conns.get(idx) {
            Some(lc) => format!("local endpoint {:016x} (pid {})", lc.peer_id, lc.peer_pid),
            None => "gone".to_string(),
        }
    }
}

/// Polls one connection's ring; returns the work it found (a failure goes
/// to `cx.to_fail`).
fn poll_one(idx: usize, lc: &mut LocalConn, peer_maps: &PeerMaps, cx: &mut Cx<'_>) -> usize {
    let mut regions = LiveRegions {
        table: cx.regions,
        updates: cx.updates,
        conn: lc.id,
    };
    let mut sink = ShardSink {
        done: cx.done,
        inbox: cx.inbox,
        conn: lc.id,
        ipc_revoked: cx.ipc_revoked,
        gpu_reqs: Some(cx.gpu_reqs),
        host_copies: cx.host_copies.as_deref_mut(),
        gpu: None,
        metrics: cx.metrics,
        shm: true,
    };
    match lc.poll(&mut regions, peer_maps, &mut Cma, &mut sink) {
        Ok(w) => {
            if w > 0 {
                lc.touch();
            }
            w
        }
        Err(reason) => {
            cx.to_fail.push((ConnRef::Local(idx), reason));
            0
        }
    }
}

impl Carrier for LocalSide {
    fn pieces(&self, _idx: usize, op: &OpCmd, chunk: usize) -> (u32, crate::metrics::Via) {
        let n = plan::pieces(
            Route::Local,
            op.parts.as_slice().iter().map(|d| d.local.len()),
            chunk,
        );
        (n, crate::metrics::Via::Shm)
    }

    fn submit(&mut self, idx: usize, mut op: OpCmd, cx: &mut SubmitCx<'_>) -> Option<OpCmd> {
        self.heat(idx);
        let lc = &mut self.conns[idx];
        let descs = op.parts.as_slice();
        // A WRITE of one request on this very connection carries its
        // notification: the target hands it over as the copy lands, a
        // reply and a notification's trip sooner.
        let table = cx.ledger.table();
        let mut note = (descs.len() == 1
            && op.at.desc == 0
            && op.kind == crate::error::OpKind::Write
            && lc.notes_ride())
        .then(|| table.take_note(op.slot))
        .flatten();
        if let Some(n) = note.take_if(|n| n.conn != lc.id) {
            table.put_note(op.slot, n);
        }
        while op.at.desc < descs.len() {
            let d = &descs[op.at.desc];
            let key = KeyRef {
                rkey: d.rkey,
                tag: d.tag,
            };
            let (kind, slot, now) = (op.kind, op.slot, cx.now);
            let riding = note.as_ref().map(|n| &n.payload[..]);
            let Some(rode) = lc.push_request(
                kind,
                slot,
                key,
                d.remote_addr,
                &d.local,
                d.remote_device,
                riding,
                now,
            ) else {
                if let Some(n) = note {
                    table.put_note(slot, n);
                }
                return Some(op);
            };
            if let Some(n) = note.take().filter(|_| !rode) {
                // Too long to ride: sent as the op ends, as before.
                table.put_note(slot, n);
            }
            op.at.emitted += 1;
            op.at.desc += 1;
        }
        None
    }

    fn notify(&mut self, idx: usize, payload: Vec<u8>) -> std::result::Result<(), Vec<u8>> {
        self.heat(idx);
        if self.conns[idx].push_notify(&payload) {
            Ok(())
        } else {
            Err(payload)
        }
    }

    fn conn_id(&self, idx: usize) -> ConnId {
        self.conns[idx].id
    }

    fn has_pending(&self, idx: usize) -> bool {
        self.conns[idx].has_pending()
    }

    fn check(
        &mut self,
        idx: usize,
        now: Instant,
        limit: Duration,
        seen: &mut Option<(u32, bool)>,
    ) -> ConnCheck {
        let lc = &mut self.conns[idx];
        let alive = match *seen {
            Some((pid, alive)) if pid == lc.peer_pid => alive,
            _ => {
                let alive = crate::sys::pid_alive(lc.peer_pid);
                *seen = Some((lc.peer_pid, alive));
                alive
            }
        };
        let oldest = lc.oldest_pending();
        let why = if !alive {
            Some(ConnFault::process_died())
        } else if oldest.is_some_and(|t| now.saturating_duration_since(t) > limit) {
            Some(ConnFault::Timeout {
                what: "a response to a request (FERRY_OP_TIMEOUT_MS)",
                timeout_ms: limit.as_millis() as u64,
            })
        } else {
            None
        };
        ConnCheck {
            why,
            busy: lc.has_pending(),
            last_active: lc.last_active(now),
            oldest,
        }
    }

    fn remove(&mut self, idx: usize, cause: &ConnFault, cx: &mut Cx<'_>) -> Removed {
        let mut lc = self.conns.remove(idx);
        let err = &crate::error::Error::ConnFailed {
            conn: lc.id,
            cause: cause.clone(),
        };
        lc.fail_pending(err, &mut ShardSink::plain(cx, lc.id));
        let (id, peer, pid) = (lc.id, lc.peer_id, lc.peer_pid);
        drop(lc);
        // The peer's shared memory is forgotten once no connection to it is
        // left; its IPC mappings on this shard once none is left here.
        if self.conn_ended(peer, pid) {
            self.peers_gone.push(peer);
        }
        Removed { id, group: id }
    }
}

#[cfg(test)]
mod tests;

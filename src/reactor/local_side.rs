//! A shard's same-host connections as an event source: each connection's
//! pair of shared-memory rings, the endpoint's accept ring and fd-passing
//! socket (on the shard that owns them), and the peers' memfd memory mapped
//! here. Rings cannot wake an epoll wait, so this source bounds how long
//! the shard may sleep.

use std::sync::mpsc::SyncSender;
use std::time::Duration;

use slab::Slab;
use tracing::warn;

use super::source::{ConnRef, Cx, LiveRegions, Park, ShardSink, Source};
use crate::shm::cma::Cma;
use crate::shm::fdpass::{FdListener, Sender};
use crate::shm::local::{LocalConn, PeerMaps};
use crate::shm::object::ShmRing;
use crate::shm::ring::SLOT_PAYLOAD;
use crate::wire::shm_msg::{Msg, MsgKind};

/// A parked shard with same-host connections wakes this often.
const LOCAL_PARK: Duration = Duration::from_millis(1);
/// A parked shard that owns the accept ring wakes this often.
const ACCEPT_RING_PARK: Duration = Duration::from_millis(10);
/// Polls between looks at the fd-passing socket.
const FD_CHECK_EVERY: u32 = 4096;

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

pub(crate) struct LocalSide {
    pub conns: Slab<LocalConn>,
    setup: Option<LocalSetup>,
    pub peer_maps: PeerMaps,
    polls: u32,
    shard: usize,
}

impl LocalSide {
    pub fn new(shard: usize, setup: Option<LocalSetup>) -> Self {
        Self {
            conns: Slab::new(),
            setup,
            peer_maps: PeerMaps::default(),
            polls: 0,
            shard,
        }
    }

    /// Takes in the fds local peers sent (memfd regions to map).
    pub fn poll_fd_listener(&mut self) -> usize {
        let conns = &self.conns;
        // Only a peer with an established connection from that very
        // process may share memory with us.
        let known = |s: Sender| {
            conns
                .iter()
                .any(|(_, c)| c.peer_id == s.id && c.peer_pid == s.pid)
        };
        match &mut self.setup {
            Some(ls) => ls.fd_listener.poll(&mut self.peer_maps, known),
            None => 0,
        }
    }

    /// Forgets a peer's mapped memory once no connection to it is left;
    /// returns whether it did.
    pub fn forget_peer_if_unused(&mut self, peer: u64) -> bool {
        if self.conns.iter().any(|(_, c)| c.peer_id == peer) {
            return false;
        }
        // Copies in flight hold their own reference to a mapping.
        self.peer_maps.retain(|(p, _), _| *p != peer);
        true
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
        let mut work = self.poll_accept_ring();
        self.polls = self.polls.wrapping_add(1);
        let senders_waiting = self.setup.as_ref().is_some_and(|ls| ls.fd_listener.busy());
        if senders_waiting || self.polls % FD_CHECK_EVERY == 0 {
            work += self.poll_fd_listener();
        }
        let mut clock = crate::sys::LazyClock::default();
        for (idx, lc) in self.conns.iter_mut() {
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
                gpu: None,
            };
            match lc.poll(&mut regions, &self.peer_maps, &mut Cma, &mut sink) {
                Ok(0) => {}
                Ok(w) => {
                    work += w;
                    lc.last_active = clock.now();
                }
                Err(reason) => cx.to_fail.push((ConnRef::Local(idx), reason)),
            }
        }
        work
    }

    fn may_park(&self) -> Park {
        if self.conns.iter().any(|(_, c)| c.has_pending()) {
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

//! The endpoint's same-host side: local connect/accept over the shared-
//! memory rings, and sharing `alloc_host` memory with local peers.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use tracing::{info, warn};

use super::table::{ConnInfo, Origin};
use super::{Inner, Peer};
use crate::error::{ConnFault, ConnId, Error, PathOff, Result};
use crate::reactor::Command;
use crate::region::{Backing, Region};
use crate::shm::bell::RemoteBell;
use crate::shm::cma::probe_cma;
use crate::shm::connect;
use crate::shm::fdpass::{self, Shared};
use crate::shm::local::LocalConn;
use crate::shm::named_ring::{accept_ring_name, pair_ring_name, ShmRing};
use crate::sys::{pid_alive, random_u64};
use crate::wire::shm_msg::Msg;

/// Slots of one connection direction's ring.
pub(crate) const PAIR_RING_SLOTS: usize = 1024;

fn refuse(what: &'static str, reason: String) -> Error {
    Error::Unsupported { what, reason }
}

/// What a refusal says (to the peer, in our error): its reason alone.
fn reason(f: &ConnFault) -> String {
    match f {
        ConnFault::Refused { why } => why.clone(),
        other => other.to_string(),
    }
}

/// The same-host side: the accept ring's CONNECTs, local peers, the
/// memory shared with them, and the doorbells.
pub(super) struct LocalSide {
    /// Why the same-host path is off, if it is.
    pub(super) note: Option<PathOff>,
    pub(super) connects: Mutex<Receiver<(Msg, Vec<u8>)>>,
    /// `alloc_host` regions (memfd-backed) by key, shared with local peers.
    pub(super) memfd_regions: Mutex<HashMap<u32, Weak<Region>>>,
    /// Endpoint ids of the local peers we share memory with.
    pub(super) peers: Mutex<HashSet<u64>>,
    /// Which shards have a doorbell (our rings into them name it in their
    /// header).
    pub(super) bell: Vec<bool>,
    /// Same-host peers and their mapped memory, for every shard.
    pub(super) shares: Arc<crate::shm::peers::PeerShares>,
    /// Local peers' doorbells we ring, shared by the rings into one shard.
    pub(super) bells: Mutex<HashMap<(u64, u32), Weak<RemoteBell>>>,
}

impl Inner {
    pub(crate) fn shm_ready(&self) -> bool {
        self.local.note.is_none()
    }

    /// Creates a ring that connection `conn`'s shard consumes, naming that
    /// shard's doorbell in its header.
    fn create_ring(&self, name: &str, conn: ConnId) -> Result<ShmRing> {
        let rx = ShmRing::create(name, PAIR_RING_SLOTS, random_u64())?;
        let shard = self.shard_of(conn).id;
        if self.local.bell.get(shard).copied().unwrap_or(false) {
            rx.ring.set_bell_home(self.me.id, shard as u32);
        }
        Ok(rx)
    }

    /// Opens the ring `name` that local endpoint `consumer` reads, with the
    /// doorbell its header names (opened once per peer shard).
    fn open_ring(&self, name: &str, consumer: u64) -> Result<ShmRing> {
        let mut ring = ShmRing::open(name)?;
        if let Some((owner, shard)) = ring.ring.bell_home() {
            if owner != consumer {
                return Err(refuse(
                    "a same-host connection",
                    format!(
                        "{name} names the doorbell of {owner:016x}, not its reader {consumer:016x}"
                    ),
                ));
            }
            let mut bells = self.local.bells.lock().expect("lock");
            let bell = match bells
                .get(&(owner, shard))
                .and_then(std::sync::Weak::upgrade)
            {
                Some(b) => b,
                None => {
                    bells.retain(|_, w| w.strong_count() > 0);
                    let b = Arc::new(RemoteBell::open(owner, shard)?);
                    bells.insert((owner, shard), Arc::downgrade(&b));
                    b
                }
            };
            ring.bell = Some(bell);
        }
        Ok(ring)
    }

    /// A same-host connection's id, on the next shard in turn: same-host
    /// connections are dealt over the shards by a count of their own (a
    /// same-host connect also spends ids on its tcp handshake, so ids
    /// alone would fall on the same shard every time).
    fn local_conn_id(&self) -> ConnId {
        let n = self.shards.shards.len() as u64;
        let shard = self.shards.next_local_shard.fetch_add(1, Ordering::Relaxed) % n;
        loop {
            let id = self.conns.next_id.fetch_add(1, Ordering::Relaxed);
            if id % n == shard {
                return ConnId(id);
            }
        }
    }

    fn my_shared_regions(&self) -> Vec<Shared> {
        let regions = self.local.memfd_regions.lock().expect("lock");
        regions
            .values()
            .filter_map(|w| w.upgrade())
            .filter_map(|r| match &r._backing {
                Backing::Memfd(m) => Some(Shared {
                    key: r.rkey,
                    len: r.len() as u64,
                    base: r.addr(),
                    fd: m.fd,
                }),
                _ => None,
            })
            .collect()
    }

    /// Sends our memfd regions to a local peer (best effort: without them
    /// the peer copies with process_vm_*).
    fn share_with(&self, peer: u64, regions: &[Shared]) {
        if regions.is_empty() {
            return;
        }
        if let Err(e) = fdpass::share(self.me.id, peer, regions, self.cfg.connect_timeout()) {
            warn!(
                peer = format_args!("{peer:016x}"),
                "sharing host memory with a local peer failed: {e}"
            );
        }
    }

    /// Shares a freshly allocated memfd region with every local peer.
    pub(crate) fn share_new_region(&self, r: &crate::region::Region) {
        let Backing::Memfd(m) = &r._backing else {
            return;
        };
        let peers: Vec<u64> = self
            .local
            .peers
            .lock()
            .expect("lock")
            .iter()
            .copied()
            .collect();
        let shared = [Shared {
            key: r.rkey,
            len: r.len() as u64,
            base: r.addr(),
            fd: m.fd,
        }];
        for p in peers {
            self.share_with(p, &shared);
        }
    }

    /// Connects to the endpoint `peer_id` on this host through its accept
    /// ring (the messages: `shm/connect.rs`); `via`: the address whose tcp
    /// handshake named it (what a vouch answer says we dialed).
    pub(crate) fn connect_local(&self, peer_id: u64, via: Option<SocketAddr>) -> Result<ConnId> {
        if let Some(why) = &self.local.note {
            return Err(refuse("a same-host connection", why.to_string()));
        }
        let deadline = Instant::now() + self.cfg.connect_timeout();
        let conn = self.local_conn_id();
        let rx = self.create_ring(&pair_ring_name(peer_id, self.me.id, conn.0 as u32), conn)?;
        let accept = self.open_ring(&accept_ring_name(peer_id), peer_id)?;
        if !pid_alive(accept.owner_pid()) {
            return Err(refuse(
                "a same-host connection",
                format!("peer process {} is gone", accept.owner_pid()),
            ));
        }
        let me = connect::this_side(self.me.id, conn.0 as u32, self.cfg.stream_inflight as u32);
        let nonce = random_u64();
        let (m, client_proof) = connect::connect_msg(&me, nonce, peer_id, self.auth_key());
        connect::push_msg(&accept, &m, &client_proof, deadline)?;
        let (ack, inline) = connect::await_msg(&rx, deadline, self.cfg.connect_timeout_ms)?;
        let peer = connect::check_ack(&ack, &inline, peer_id, self.me.id, nonce, self.auth_key())
            .map_err(|f| refuse("a same-host connection", reason(&f)))?;
        let tx = self.open_ring(&pair_ring_name(self.me.id, peer_id, conn.0 as u32), peer_id)?;
        let inflight = self.agreed_inflight(peer.inflight as usize);
        let mut lc = LocalConn::new(
            conn, peer_id, peer.pid, peer.conn, rx, tx, inflight, inflight,
        );
        lc.set_notes_ride(peer.features & connect::FEATURE_NOTES_RIDE != 0);
        // We serve the peer's requests by copying its memory: check we can.
        if let Err(f) = probe_cma(peer.pid, peer.canary) {
            lc.send_close();
            return Err(refuse("a same-host connection", reason(&f)));
        }
        self.share_with(peer_id, &self.my_shared_regions());
        self.local.peers.lock().expect("lock").insert(peer_id);
        let origin = Origin::Dialed { nonce, to: via };
        self.adopt_local(lc, (peer_id, peer.pid), origin, deadline)?;
        Ok(conn)
    }

    fn adopt_local(
        &self,
        lc: LocalConn,
        (peer_id, pid): (u64, u32),
        origin: Origin,
        deadline: Instant,
    ) -> Result<()> {
        let conn = lc.id;
        self.conns.live.lock().expect("lock").insert(
            conn,
            ConnInfo {
                verbs: false,
                outbox: Default::default(),
                origin,
                peer: Peer::Local {
                    endpoint_id: peer_id,
                    pid,
                },
            },
        );
        // Known before adopted: the peer may share its memory as soon as
        // its first request could arrive.
        self.local.shares.conn_up(peer_id, pid);
        if let Err(e) = self
            .shard_of(conn)
            .submit_blocking(Command::AddLocal(Box::new(lc)), deadline)
        {
            self.local.shares.conn_down(peer_id, pid);
            return Err(e);
        }
        info!(%conn, peer = format_args!("{peer_id:016x}"), pid, "same-host connection up");
        Ok(())
    }

    /// Answers the CONNECT messages shard 0 has forwarded.
    pub(crate) fn accept_local_step(self: &Arc<Self>) {
        loop {
            let (m, inline) = match self.local.connects.lock().expect("lock").try_recv() {
                Ok(got) => got,
                Err(_) => return,
            };
            if let Err(e) = self.answer_connect(&m, &inline) {
                warn!(
                    peer = format_args!("{:016x}", m.aux),
                    "local CONNECT failed: {e}"
                );
            }
        }
    }

    fn answer_connect(&self, m: &Msg, inline: &[u8]) -> Result<()> {
        let deadline = Instant::now() + self.cfg.connect_timeout();
        let peer_id = m.aux;
        // The connector made the ring we answer into.
        let tx = self.open_ring(&pair_ring_name(self.me.id, peer_id, m.conn), peer_id)?;
        let conn = self.local_conn_id();
        let me = connect::this_side(self.me.id, conn.0 as u32, self.cfg.stream_inflight as u32);
        let checked =
            connect::check_connect(m, inline, self.me.id, self.auth_key()).and_then(|peer| {
                self.check_conn_limit()
                    .map_err(|e| ConnFault::refused(e.to_string()))?;
                probe_cma(peer.pid, peer.canary)?;
                Ok(peer)
            });
        let peer = match checked {
            Ok(peer) => peer,
            Err(f) => {
                let why = reason(&f);
                let (ack, text) = connect::ack_msg(&me, Err(&why), None, peer_id);
                connect::push_msg(&tx, &ack, &text, deadline)?;
                return Err(refuse("a same-host connection", why));
            }
        };
        let rx = self.create_ring(&pair_ring_name(peer_id, self.me.id, m.conn), conn)?;
        let inflight = self.agreed_inflight(peer.inflight as usize);
        let mut lc = LocalConn::new(
            conn, peer_id, peer.pid, peer.conn, rx, tx, inflight, inflight,
        );
        lc.set_notes_ride(peer.features & connect::FEATURE_NOTES_RIDE != 0);
        // Adopt before answering, so the peer's first request finds us.
        let origin = Origin::Accepted { nonce: m.aux2 };
        self.adopt_local(lc, (peer_id, peer.pid), origin, deadline)?;
        let tx2 = self.open_ring(&pair_ring_name(self.me.id, peer_id, m.conn), peer_id)?;
        let (ack, server_proof) = connect::ack_msg(&me, Ok(m.aux2), self.auth_key(), peer_id);
        connect::push_msg(&tx2, &ack, &server_proof, deadline)?;
        self.share_with(peer_id, &self.my_shared_regions());
        self.local.peers.lock().expect("lock").insert(peer_id);
        self.push_accepted(
            conn,
            Peer::Local {
                endpoint_id: peer_id,
                pid: peer.pid,
            },
        );
        Ok(())
    }
}

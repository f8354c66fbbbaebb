//! Opening a tcp connection: the hello we send, the handshake on each
//! stream, the stream MACs, the RDMA link when both sides have a NIC, and
//! the adoption of the streams by the shards (connect and accept share it).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tracing::{info, warn};

use super::lanes::LANES_SHIFT;
use super::table::{ConnInfo, Origin};
use super::{Inner, Integrity, Peer, Transport};
use crate::error::{ConnId, Error, PathOff, Result};
use crate::oob::{handshake, Ctl};
use crate::reactor::Command;
use crate::sys::random_u64;
use crate::tcp::StreamLimits;
use crate::wire::{Hello, CAP_AUTH, CAP_INTEGRITY_FULL, CAP_SHM};

/// The NIC side: the NICs verbs would use, or why verbs is off
/// (connections then use tcp), and the opened NIC when it is on.
pub(crate) struct NicSide {
    pub(super) status: std::result::Result<Vec<String>, PathOff>,
    pub(crate) handle: Option<crate::verbs::NicHandle>,
}

impl Inner {
    pub(super) fn connect(&self, addr: SocketAddr) -> Result<ConnId> {
        self.check_conn_limit()?;
        let mut ctl = Ctl::new(self.me.backend)?;
        let timeout = self.cfg.connect_timeout();
        let ours = self.stream_hello();
        let (streams, hellos) = handshake::connect(&mut ctl, addr, ours, timeout, self.auth_key())?;
        let ack = hellos[0].1;
        if self.goes_local(&ours, &ack) {
            drop(streams);
            match self.connect_local(ack.endpoint_id, Some(addr)) {
                Ok(conn) => return Ok(conn),
                Err(e) if self.cfg.transport == Transport::Shm => return Err(e),
                Err(e) => {
                    warn!(%addr, "same-host connection failed, using tcp: {e}");
                    // The same offer without shared memory (authentication
                    // and the rest unchanged, so both sides decide alike).
                    let ours = self.stream_hello();
                    let plain = Hello {
                        caps: ours.caps & !CAP_SHM,
                        ..ours
                    };
                    let (streams, hellos) =
                        handshake::connect(&mut ctl, addr, plain, timeout, self.auth_key())?;
                    return self.adopt(streams, &hellos, true, addr);
                }
            }
        }
        if self.cfg.transport == Transport::Shm {
            return Err(Error::Unsupported {
                what: "FERRY_TRANSPORT=shm",
                reason: format!("{addr} is not a same-host endpoint with shared memory"),
            });
        }
        self.adopt(streams, &hellos, true, addr)
    }

    pub(super) fn stream_hello(&self) -> Hello {
        Hello {
            endpoint_id: self.me.id,
            caps: if self.nics.handle.is_some() {
                crate::wire::CAP_VERBS
            } else {
                0
            } | if self.shm_ready() { CAP_SHM } else { 0 }
                | if self.cfg.auth_key.is_some() {
                    CAP_AUTH
                } else {
                    0
                }
                | if self.cfg.integrity == Integrity::Full {
                    CAP_INTEGRITY_FULL
                } else {
                    0
                }
                | if self.cfg.compress == super::config::Compress::Off {
                    0
                } else {
                    crate::wire::CAP_CODEC
                },
            auth_nonce: random_u64(),
            host_token: self.me.host_token,
            conn_nonce: random_u64(),
            stream_idx: 0,
            stream_count: self.cfg.streams_per_conn,
            max_inflight: self.cfg.stream_inflight as u32,
        }
    }

    /// When both sides offer verbs, sets up the connection's RDMA queue
    /// pairs over its first stream (both sides send their info, then read
    /// the other's). `None`: the connection uses tcp only.
    pub(super) fn verbs_link(
        &self,
        s: &std::net::TcpStream,
        (ours, peer): (&Hello, &Hello),
        deadline: Instant,
        shard: usize,
    ) -> Result<Option<Box<crate::verbs::DynLink>>> {
        #[cfg(feature = "rdma")]
        {
            let Some(nic) = &self.nics.handle else {
                return Ok(None);
            };
            // Both hellos, as the accepting side decides (`wants_verbs`):
            // a hello sent without CAP_VERBS (a fallback handshake) means
            // no verbs on either side.
            if !ours.both_offer(peer, crate::wire::CAP_VERBS) {
                return Ok(None);
            }
            let ctl = std::cell::RefCell::new(Ctl::new(self.me.backend)?);
            let chunk = self.cfg.chunk_bytes.min(1 << 30) as u32;
            let link = crate::verbs::link::exchange(
                nic,
                &self.cfg.verbs(),
                chunk,
                shard,
                |f| ctl.borrow_mut().send_all(s, &f.encode(), deadline),
                || handshake::read_frame(&mut ctl.borrow_mut(), s, deadline),
            )?;
            Ok(link.map(|l| Box::new(l) as Box<crate::verbs::DynLink>))
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = (s, ours, peer, deadline, shard);
            Ok(None)
        }
    }

    /// Each stream's frame MACs when the connection is authenticated:
    /// keys from the secret and that stream's two handshake nonces.
    pub(super) fn stream_macs(
        &self,
        hellos: &[(Hello, Hello)],
        client: bool,
    ) -> Vec<crate::tcp::Integrity> {
        use crate::auth::{Direction, FrameKey};
        let Some(key) = self.auth_key() else {
            return Vec::new();
        };
        let full = hellos
            .iter()
            .any(|(o, t)| (o.caps | t.caps) & CAP_INTEGRITY_FULL != 0);
        hellos
            .iter()
            .map(|(ours, theirs)| {
                let (c, s) = if client {
                    (ours, theirs)
                } else {
                    (theirs, ours)
                };
                let k = |dir| {
                    FrameKey::derive(
                        key,
                        dir,
                        c.auth_nonce,
                        s.auth_nonce,
                        c.endpoint_id,
                        s.endpoint_id,
                    )
                };
                let (c2s, s2c) = (k(Direction::ClientToServer), k(Direction::ServerToClient));
                let (tx, rx) = if client { (c2s, s2c) } else { (s2c, c2s) };
                crate::tcp::Integrity { tx, rx, full }
            })
            .collect()
    }

    /// Takes a handshaken connection to its shard. `hellos`: each stream's
    /// (ours, theirs); `client`: we connected.
    pub(super) fn adopt(
        &self,
        streams: Vec<std::net::TcpStream>,
        hellos: &[(Hello, Hello)],
        client: bool,
        peer: SocketAddr,
    ) -> Result<ConnId> {
        let peer_hello = hellos[0].1;
        let mut macs = self.stream_macs(hellos, client);
        let agreed = self.agreed_inflight(peer_hello.max_inflight as usize);
        let limits = StreamLimits {
            own_max: agreed,
            peer_max: agreed,
            codec: hellos[0].0.both_offer(&peer_hello, crate::wire::CAP_CODEC),
        };
        let deadline = Instant::now() + self.cfg.connect_timeout();
        // Each side spreads its streams over its own shards: a stream's
        // requests are answered on that stream, so the two sides need not
        // split alike. A connection that may get queue pairs stays whole
        // (one set of QPs, one lane), and its id — so its shard — is known
        // first: its QPs post to that shard's shared completion queues.
        let may_verbs = self.nics.handle.is_some()
            && hellos[0].0.both_offer(&peer_hello, crate::wire::CAP_VERBS);
        let k = if may_verbs {
            1
        } else {
            self.lanes_for(streams.len())
        };
        let base = self.alloc_conn_ids(k);
        let shard = (base % self.shards.shards.len() as u64) as usize;
        let mut verbs =
            self.verbs_link(&streams[0], (&hellos[0].0, &peer_hello), deadline, shard)?;
        let conn = if k > 1 {
            ConnId(base | (k as u64) << LANES_SHIFT)
        } else {
            ConnId(base)
        };
        self.conns.live.lock().expect("lock").insert(
            conn,
            ConnInfo {
                peer: Peer::Net(peer),
                verbs: verbs.is_some(),
                outbox: Default::default(),
                origin: if client {
                    Origin::Dialed {
                        nonce: hellos[0].0.conn_nonce,
                        to: Some(peer),
                    }
                } else {
                    Origin::Accepted {
                        nonce: peer_hello.conn_nonce,
                    }
                },
            },
        );
        let total = streams.len();
        let mut streams = streams.into_iter();
        let activity = (k > 1).then(|| Arc::new(crate::sys::Activity::default()));
        for (i, (lane, shard)) in self.lanes(conn).enumerate() {
            let take = (i + 1) * total / k - i * total / k;
            let mine: Vec<_> = streams.by_ref().take(take).collect();
            let lane_macs = if macs.is_empty() {
                Vec::new()
            } else {
                macs.drain(..take).collect()
            };
            shard.submit_blocking(
                Command::AddConn {
                    conn: lane,
                    group: conn,
                    activity: activity.clone(),
                    streams: mine,
                    limits,
                    verbs: verbs.take(),
                    macs: lane_macs,
                },
                deadline,
            )?;
        }
        info!(%conn, %peer, streams = total, lanes = k, "connected");
        Ok(conn)
    }

    /// Whether accepting `theirs` leads to an RDMA exchange.
    pub(super) fn wants_verbs(&self, ours: &Hello, theirs: &Hello) -> bool {
        cfg!(feature = "rdma")
            && self.nics.handle.is_some()
            && ours.both_offer(theirs, crate::wire::CAP_VERBS)
    }

    /// Whether a handshake between `a` and `b` leads to the same-host path.
    pub(super) fn goes_local(&self, a: &Hello, b: &Hello) -> bool {
        a.caps & CAP_SHM != 0
            && b.caps & CAP_SHM != 0
            && a.host_token == b.host_token
            && a.host_token != 0
    }
}

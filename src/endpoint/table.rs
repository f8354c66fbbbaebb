//! The connection table: what the control side knows of each connection,
//! its limits, and the forgetting of those the shards saw die.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};

use super::lanes::lanes_of;
use super::{Inner, Peer};
use crate::error::{ConnFault, ConnId, Error, Result};
use crate::reactor::Command;

/// Dead connections whose cause is remembered (then the memory starts
/// over: a caller that asks that late gets `UnknownConn`).
const DEAD_MEMORY: usize = 4096;

/// The connection table: who is connected, and who died of what.
pub(super) struct ConnTable {
    pub(super) live: Mutex<HashMap<ConnId, ConnInfo>>,
    /// The connection `add_remote`/`connect` made to each address.
    pub(super) remotes: Mutex<HashMap<SocketAddr, ConnId>>,
    /// Connections the shards saw die, with why; moved to `dead` on the
    /// next control call.
    pub(super) closed: Mutex<Receiver<(ConnId, ConnFault)>>,
    /// Why each dead connection died, so every later call on it gets the
    /// same cause (until `remove_remote`); at most `DEAD_MEMORY` entries.
    pub(super) dead: Mutex<HashMap<ConnId, ConnFault>>,
    pub(super) next_id: AtomicU64,
}

impl ConnTable {
    /// Empty; `closed` hears of the connections the shards saw die.
    pub(super) fn new(closed: Receiver<(ConnId, ConnFault)>) -> Self {
        Self {
            live: Mutex::new(HashMap::new()),
            remotes: Mutex::new(HashMap::new()),
            closed: Mutex::new(closed),
            dead: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
        }
    }
}

/// A connection's record on the control side.
pub(super) struct ConnInfo {
    pub(super) peer: Peer,
    /// One-sided ops with NIC-keyed windows go over RDMA queue pairs.
    pub(super) verbs: bool,
    /// Its notifications accepted and not yet sent (`FERRY_NOTIFY_OUTBOX`).
    pub(super) outbox: Arc<AtomicUsize>,
    /// Who dialed it (what a vouch question asks).
    pub(super) origin: Origin,
}

/// Who dialed a connection, and the nonce both of its sides know it by
/// (the tcp handshake's `conn_nonce`, or the same-host CONNECT's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Origin {
    /// We did, to this address (`None`: by endpoint id, `connect_local`).
    Dialed { nonce: u64, to: Option<SocketAddr> },
    /// The peer did.
    Accepted { nonce: u64 },
}

impl Origin {
    /// Where we dialed the connection of nonce `nonce` to, if we did.
    pub(super) fn dialed(&self, nonce: u64) -> Option<SocketAddr> {
        match *self {
            Origin::Dialed { nonce: n, to } if n == nonce => to,
            _ => None,
        }
    }
}

impl Inner {
    /// Forgets connections the shards reported dead.
    pub(super) fn reap_closed(&self) {
        let gone: Vec<(ConnId, ConnFault)> =
            self.conns.closed.lock().expect("lock").try_iter().collect();
        if gone.is_empty() {
            return;
        }
        let mut conns = self.conns.live.lock().expect("lock");
        let mut causes = self.conns.dead.lock().expect("lock");
        let mut dead = Vec::with_capacity(gone.len());
        for (c, cause) in gone {
            // A live entry only: a connection removed here is not dead.
            if conns.remove(&c).is_some() {
                if causes.len() >= DEAD_MEMORY {
                    causes.clear();
                }
                // The first cause stays (a lane failed for it, the others
                // then close with "another lane failed").
                causes.entry(c).or_insert(cause);
            }
            dead.push(c);
        }
        drop((conns, causes));
        // One lane dead: the others go too (an op split over them could
        // not complete), without waiting.
        for &c in &dead {
            if lanes_of(c).1 > 1 {
                for (lane, shard) in self.lanes(c) {
                    let _ = shard.submit(Command::RemoveConn(
                        lane,
                        None,
                        "another lane of this connection failed",
                    ));
                }
            }
        }
        self.conns
            .remotes
            .lock()
            .expect("lock")
            .retain(|_, c| !dead.contains(c));
    }

    /// `Ok` while `conn` is live; else what every call on it gets (`gone`).
    pub(super) fn live(&self, conn: ConnId) -> Result<()> {
        if self.conns.live.lock().expect("lock").contains_key(&conn) {
            Ok(())
        } else {
            Err(self.gone(conn))
        }
    }

    /// The error for a call on `conn`, which is not live: the cause it
    /// died of, or that it is unknown.
    pub(super) fn gone(&self, conn: ConnId) -> Error {
        match self.conns.dead.lock().expect("lock").get(&conn) {
            Some(cause) => Error::ConnFailed {
                conn,
                cause: cause.clone(),
            },
            None => Error::UnknownConn { conn },
        }
    }

    /// Fails with `LimitReached` when no further connection may open.
    pub(crate) fn check_conn_limit(&self) -> Result<()> {
        self.reap_closed();
        if self.conns.live.lock().expect("lock").len() >= self.cfg.max_conns {
            return Err(Error::LimitReached {
                limit: "FERRY_MAX_CONNS",
                max: self.cfg.max_conns,
            });
        }
        Ok(())
    }
}

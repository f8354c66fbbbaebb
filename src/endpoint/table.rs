//! The connection table: what the control side knows of each connection,
//! its limits, and the forgetting of those the shards saw die.

use super::*;

/// A connection's record on the control side.
pub(super) struct ConnInfo {
    pub(super) peer: Peer,
    /// One-sided ops with NIC-keyed windows go over RDMA queue pairs.
    pub(super) verbs: bool,
}

impl Inner {
    /// Forgets connections the shards reported dead.
    pub(super) fn reap_closed(&self) {
        let dead: Vec<ConnId> = self.closed.lock().expect("lock").try_iter().collect();
        if dead.is_empty() {
            return;
        }
        let mut conns = self.conns.lock().expect("lock");
        for c in &dead {
            conns.remove(c);
        }
        drop(conns);
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
        self.remotes
            .lock()
            .expect("lock")
            .retain(|_, c| !dead.contains(c));
    }

    /// Fails with `LimitReached` when no further connection may open.
    pub(crate) fn check_conn_limit(&self) -> Result<()> {
        self.reap_closed();
        if self.conns.lock().expect("lock").len() >= self.cfg.max_conns {
            return Err(Error::LimitReached {
                limit: "FERRY_MAX_CONNS",
                max: self.cfg.max_conns,
            });
        }
        Ok(())
    }
}

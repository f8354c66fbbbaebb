//! A shard's connection routes: where each connection id lives (tcp or
//! same-host side, and its index there), and the reasons recent dead
//! connections died, so later calls on them get the error that killed them.

use std::collections::HashMap;
use std::sync::mpsc;

use super::source::ConnRef;
use crate::error::{ConnFault, ConnId, Error};
use crate::sys::IntMap;

/// Dead connections remembered; past this the memory is cleared.
const FAILED_MEMORY: usize = 4096;

pub(crate) struct ConnRoutes {
    by_id: IntMap<ConnId, ConnRef>,
    /// By the shard's id of the dead connection: the id the application
    /// knows it by (see `Conn::group`) and why it died.
    failed: HashMap<ConnId, (ConnId, ConnFault)>,
    /// Tells the endpoint which connections died, so it can forget them.
    closed: mpsc::Sender<(ConnId, ConnFault)>,
}

impl ConnRoutes {
    pub fn new(closed: mpsc::Sender<(ConnId, ConnFault)>) -> Self {
        Self {
            by_id: Default::default(),
            failed: HashMap::new(),
            closed,
        }
    }

    pub fn get(&self, conn: ConnId) -> Option<ConnRef> {
        self.by_id.get(&conn).copied()
    }

    pub fn contains(&self, conn: ConnId) -> bool {
        self.by_id.contains_key(&conn)
    }

    pub fn insert(&mut self, conn: ConnId, at: ConnRef) {
        self.by_id.insert(conn, at);
    }

    pub fn remove(&mut self, conn: ConnId) {
        self.by_id.remove(&conn);
    }

    /// Why calls on `conn` fail: the reason it died, or that it is unknown.
    pub fn error_of(&self, conn: ConnId) -> Error {
        match self.failed.get(&conn) {
            Some((group, cause)) => Error::ConnFailed {
                conn: *group,
                cause: cause.clone(),
            },
            None => Error::UnknownConn { conn },
        }
    }

    /// Records that `conn` (the application's `group`) died, and tells the
    /// endpoint.
    pub fn remember_failed(&mut self, conn: ConnId, group: ConnId, cause: ConnFault) {
        // The endpoint may be gone already; then nobody needs to know.
        let _ = self.closed.send((group, cause.clone()));
        if self.failed.len() >= FAILED_MEMORY {
            self.failed.clear();
        }
        self.failed.insert(conn, (group, cause));
    }

    /// Forgets a dead connection's reason (`remove_remote` was called).
    pub fn forget_failed(&mut self, conn: ConnId) {
        self.failed.remove(&conn);
    }
}

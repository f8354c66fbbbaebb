//! Notifications: sending them (the per-connection outbox bound), receiving
//! them, and the RDMA flush a notification from a verbs peer waits for.

use std::sync::atomic::Ordering;
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use tracing::warn;

use super::{Endpoint, Inner};
use crate::error::{ConnId, Error, Result};
use crate::reactor::{Command, NoteTicket};
use crate::wire::MAX_NOTIFY_BYTES;

/// # Notifications
///
/// Small messages to a peer's inbox, in order per connection, delivered or
/// refused at the call (`FERRY_NOTIFY_OUTBOX`).
impl Endpoint {
    /// Sends a small message (at most 4096 bytes) to the peer's inbox.
    ///
    /// `Ok`: it arrives, in order with this connection's others, or the
    /// connection fails (later calls get `ConnFailed` with the cause).
    /// [`Error::NotifyOutboxFull`]: the connection already holds
    /// `FERRY_NOTIFY_OUTBOX` notifications not yet sent (its peer is not
    /// reading); nothing was taken, try again later.
    pub fn send_notification(&self, conn: ConnId, msg: &[u8]) -> Result<()> {
        if msg.len() > MAX_NOTIFY_BYTES {
            return Err(Error::NotifyTooLong {
                len: msg.len(),
                max: MAX_NOTIFY_BYTES,
            });
        }
        // A connection the shards already saw die says so here, rather
        // than taking a notification it can no longer send.
        self.inner.reap_closed();
        // Counted from the call until its stream or ring takes it: past
        // the bound the call is refused, so nothing accepted is dropped.
        let ticket = {
            let conns = self.inner.conns.live.lock().expect("lock");
            let Some(info) = conns.get(&conn) else {
                drop(conns);
                return Err(self.inner.gone(conn));
            };
            let max = self.inner.cfg.notify_outbox;
            NoteTicket::take(&info.outbox, max).map_err(|queued| Error::NotifyOutboxFull {
                conn,
                queued,
                max,
            })?
        };
        let deadline = Instant::now() + self.inner.cfg.connect_timeout();
        // A connection spread over shards sends them on its first lane (in
        // order with each other; ops complete before they are reported).
        let (lane, shard) = self.inner.lanes(conn).next().expect("a lane");
        let mut payload = Vec::with_capacity(1 + msg.len());
        payload.push(crate::wire::NOTE_APP);
        payload.extend_from_slice(msg);
        shard.submit_blocking(
            Command::Notify {
                conn: lane,
                payload,
                ticket: Some(ticket),
            },
            deadline,
        )
    }

    /// Waits up to `timeout` for a notification from any peer.
    ///
    /// A notification from a connection that uses RDMA verbs first flushes
    /// the RDMA WRITEs into this endpoint's GPU memory
    /// ([`flush_rdma_writes`](Self::flush_rdma_writes)), so a kernel
    /// launched after it sees what the peer wrote before notifying (the
    /// peer must notify after its WRITE completed: notifications travel on
    /// tcp, not behind the WRITEs).
    pub fn recv_notification(&self, timeout: Duration) -> Result<(ConnId, Vec<u8>)> {
        let got = self
            .inner
            .mail
            .inbox
            .lock()
            .expect("lock")
            .recv_timeout(timeout);
        match got {
            Ok(n) => {
                self.inner.flush_for_notification(n.0);
                Ok(n)
            }
            Err(RecvTimeoutError::Timeout) => Err(Error::Timeout {
                what: "a notification",
                timeout_ms: timeout.as_millis() as u64,
            }),
            Err(RecvTimeoutError::Disconnected) => Err(Error::Shutdown),
        }
    }

    /// A notification if one is waiting (flushed as by `recv_notification`).
    pub fn try_recv_notification(&self) -> Option<(ConnId, Vec<u8>)> {
        let n = self
            .inner
            .mail
            .inbox
            .lock()
            .expect("lock")
            .try_recv()
            .ok()?;
        self.inner.flush_for_notification(n.0);
        Some(n)
    }

    /// Makes the RDMA WRITEs that NICs have completed into this endpoint's
    /// registered GPU memory visible to GPU work launched afterwards
    /// (`cuFlushGPUDirectRDMAWrites` on each GPU with registered memory).
    /// A verbs completion at the initiator says the target's NIC placed
    /// the bytes, not that the target's GPU sees them; call this before
    /// using data that arrived by RDMA without a notification (e.g. a
    /// polled flag). A no-op without registered GPU memory.
    pub fn flush_rdma_writes(&self) -> Result<()> {
        self.inner.flush_gpus()
    }
}

impl Inner {
    /// Before a notification from `conn` reaches the application: if
    /// `conn` uses verbs and GPU memory is registered here, flush the RDMA
    /// WRITEs into it (what the peer wrote before notifying is then
    /// visible to GPU work). A failed flush is logged: the notification
    /// itself is still delivered.
    pub(super) fn flush_for_notification(&self, conn: ConnId) {
        if self.gpus.registered.load(Ordering::Relaxed) == 0 || self.nics.handle.is_none() {
            return;
        }
        let verbs = self
            .conns
            .live
            .lock()
            .expect("lock")
            .get(&conn)
            .is_some_and(|c| c.verbs);
        if !verbs {
            return;
        }
        if let Err(e) = self.flush_gpus() {
            warn!(%conn, "flushing RDMA writes into GPU memory before a notification: {e}");
        }
    }

    /// `cuFlushGPUDirectRDMAWrites` on every GPU with registered memory.
    fn flush_gpus(&self) -> Result<()> {
        let mask = self.gpus.registered.load(Ordering::Relaxed);
        if mask == 0 {
            return Ok(());
        }
        let cuda = crate::gpu::cuda()?;
        (0..64)
            .filter(|i| mask & (1u64 << i) != 0)
            .try_for_each(|i| cuda.flush_rdma_writes(i))
    }
}

//! The public face of connections: connecting (`add_remote`, `connect`),
//! accepting, removing, and what a connection is (`peer`, `conn_status`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::{Endpoint, Mode, Peer, PASSIVE_ACCEPT_WAIT};
use crate::error::{ConnId, Error, Result};
use crate::reactor::Command;
use crate::wire::EndpointMetadata;

/// # Connections
///
/// Connecting (`add_remote`, `connect`), accepting, removing, and what
/// a connection is (`peer`, `conn_status`).
impl Endpoint {
    /// Connects to the endpoint listening at `addr`.
    pub fn connect(&self, addr: SocketAddr) -> Result<ConnId> {
        self.inner.connect(addr)
    }

    /// Connects to the endpoint that `metadata` (seed byte format) names,
    /// reusing the connection if one to that address exists.
    pub fn add_remote(&self, metadata: &[u8]) -> Result<ConnId> {
        let m = EndpointMetadata::decode(metadata)?;
        let addr = m.socket_addr();
        // A memoized connection that died is forgotten, so this reconnects.
        self.inner.reap_closed();
        if let Some(&c) = self.inner.conns.remotes.lock().expect("lock").get(&addr) {
            return Ok(c);
        }
        let c = self.inner.connect(addr)?;
        let mut remotes = self.inner.conns.remotes.lock().expect("lock");
        // Another thread may have raced us; keep the first, close ours.
        if let Some(&first) = remotes.get(&addr) {
            drop(remotes);
            let _ = self.remove_remote(c);
            return Ok(first);
        }
        remotes.insert(addr, c);
        Ok(c)
    }

    /// Closes a connection; its in-flight operations fail.
    pub fn remove_remote(&self, conn: ConnId) -> Result<()> {
        self.inner.reap_closed();
        let info = self.inner.conns.live.lock().expect("lock").remove(&conn);
        let Some(info) = info else {
            // A dead connection is forgotten: its cause goes with it.
            return match self.inner.conns.dead.lock().expect("lock").remove(&conn) {
                Some(_) => Ok(()),
                None => Err(Error::UnknownConn { conn }),
            };
        };
        self.inner
            .conns
            .remotes
            .lock()
            .expect("lock")
            .retain(|_, c| *c != conn);
        let deadline = Instant::now() + self.inner.cfg.connect_timeout();
        // Managed shards confirm, so that once this returns the connection
        // serves no further request (an embedded shard is polled by the
        // caller, who may be this thread: no waiting there).
        let managed = self.inner.cfg.mode == Mode::Managed;
        for (lane, shard) in self.inner.lanes(conn) {
            let (ack, done) = mpsc::sync_channel(1);
            shard.submit_blocking(
                Command::RemoveConn(lane, managed.then_some(ack), "removed by remove_remote"),
                deadline,
            )?;
            if managed {
                let left = deadline.saturating_duration_since(Instant::now());
                if done.recv_timeout(left).is_err() {
                    warn!(%conn, %lane, "shard did not confirm the removal in time");
                }
            }
        }
        info!(%conn, peer = %info.peer, "connection removed");
        Ok(())
    }

    /// Waits up to `timeout` for one incoming connection.
    /// A same-host peer (`Peer::Local`) connects over shared memory; a remote
    /// one over tcp.
    pub fn accept(&self, timeout: Duration) -> Result<(ConnId, Peer)> {
        if self.inner.accept.passive.lock().expect("lock").is_some() {
            return self.inner.next_accepted(timeout);
        }
        self.inner.accept_one(timeout)
    }

    /// Waits up to `timeout` for a same-host connection (the seed's
    /// `accept_local`); returns it with the peer's endpoint id and pid. Tcp
    /// connections that arrive meanwhile stay queued for [`accept`]. A
    /// same-host peer may come by `connect_local` (our id) or by
    /// `add_remote` (our metadata: its tcp handshake is answered here).
    ///
    /// [`accept`]: Endpoint::accept
    pub fn accept_local(&self, timeout: Duration) -> Result<(ConnId, u64, u32)> {
        let deadline = Instant::now() + timeout;
        loop {
            self.inner.accept_local_step();
            {
                let mut q = self.inner.accept.queue.lock().expect("lock");
                if let Some(i) = q.iter().position(|(_, p)| matches!(p, Peer::Local { .. })) {
                    if let Some((conn, Peer::Local { endpoint_id, pid })) = q.remove(i) {
                        return Ok((conn, endpoint_id, pid));
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(Error::AcceptTimeout {
                    timeout_ms: timeout.as_millis() as u64,
                });
            }
            // A same-host peer that found us by our metadata (`add_remote`)
            // handshakes over tcp first: drive those handshakes too (one
            // that ends on tcp is queued for `accept`).
            if self.inner.accept.passive.lock().expect("lock").is_some() {
                std::thread::sleep(Duration::from_micros(200));
            } else {
                self.inner.accept_step(Duration::from_millis(1))?;
            }
        }
    }

    /// Accepts connections in the background until [`stop_accept`]; they
    /// become usable as they arrive and are reported by [`accept`].
    ///
    /// [`stop_accept`]: Endpoint::stop_accept
    /// [`accept`]: Endpoint::accept
    pub fn start_passive_accept(&self) -> Result<()> {
        let mut p = self.inner.accept.passive.lock().expect("lock");
        if p.is_some() {
            return Ok(());
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (inner, stop2) = (self.inner.clone(), stop.clone());
        let t = std::thread::Builder::new()
            .name("ferry-accept".to_owned())
            .spawn(move || {
                while !stop2.load(Ordering::Relaxed) {
                    inner.accept_local_step();
                    // The gate's own deadlines end its wait when a handshake
                    // is due; same-host CONNECTs and stop_accept wake it. So
                    // an idle endpoint wakes this thread twice a second.
                    if let Err(e) = inner.accept_step(PASSIVE_ACCEPT_WAIT) {
                        warn!("passive accept: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            })
            .map_err(|e| Error::io("spawn accept thread", e))?;
        *p = Some((stop, t));
        Ok(())
    }

    /// Stops accepting in the background (`start_passive_accept`);
    /// connections made stay.
    pub fn stop_accept(&self) {
        let p = self.inner.accept.passive.lock().expect("lock").take();
        if let Some((stop, t)) = p {
            stop.store(true, Ordering::Relaxed);
            let _ = self.inner.accept.gate_waker.wake();
            let _ = t.join();
        }
    }
}

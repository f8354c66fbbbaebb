//! The public API, mirroring the seed's `Endpoint`: metadata, connections,
//! registration, advertisement, one-sided WRITE/READ (single, vectored,
//! async) and notifications. Only this module knows every other one.

mod config;
mod gpu;
mod local;
mod memory;
mod ops;
mod start;

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{info, warn};

pub use config::{Config, Integrity, Mode, Secret, Transport};
pub use memory::{MemoryRegion, MAX_WINDOWS};
pub use ops::Window;

use crate::error::{ConnId, Error, OpKind, Result};
use crate::oob::gate::{Done, Gate, GateHooks};
use crate::oob::handshake;
use crate::oob::{self, Ctl, IoBackend};
use crate::reactor::completion::CompletionTable;
use crate::reactor::{Command, OpCmd, OpDesc, OpParts, RegionCmd, Shard, ShardHandle, Transfer};
use crate::region::{Access, Backing, Region};
use crate::sys::random_u64;
use crate::tcp::StreamLimits;
use crate::wire::{
    EndpointMetadata, Hello, RemoteBuf, CAP_AUTH, CAP_INTEGRITY_FULL, CAP_SHM, MAX_NOTIFY_BYTES,
};

/// Sockets in handshake at once (the gate evicts the oldest beyond it).
/// How long the passive accept thread waits in the gate at most (it is
/// woken earlier for anything that needs it).
const PASSIVE_ACCEPT_WAIT: Duration = Duration::from_millis(500);
const MAX_PENDING_HANDSHAKES: usize = 1024;
/// Sockets in handshake from one address at once.
const MAX_HANDSHAKES_PER_ADDR: usize = 512;
/// Sockets the gate accepts per pass (see `oob/gate.rs` for why).
const ACCEPT_BATCH: usize = 32;
/// A new socket must send its first bytes within this (or the connect
/// timeout, if shorter).
const FIRST_BYTES_TIMEOUT: Duration = Duration::from_secs(1);
/// RDMA setups (after the handshake) running on threads of their own.
const MAX_VERBS_SETUPS: usize = 64;
/// Accepted connections waiting for `accept()` to report them.
const MAX_ACCEPTED_QUEUE: usize = 4096;

/// Builds an [`Endpoint`].
#[derive(Debug, Clone, Default)]
pub struct EndpointBuilder {
    config: Option<Config>,
}

impl EndpointBuilder {
    /// Uses `config` instead of `Config::from_env()`.
    pub fn config(mut self, config: Config) -> Self {
        self.config = Some(config);
        self
    }

    /// Gives the endpoint GPU `idx` (the seed's `Endpoint(gpu_idx)`): its
    /// PCI bus id goes into the metadata, and its streams do the IPC copies.
    /// `build` fails with `GpuOutOfRange` (naming the visible count) or
    /// `NoGpu` when there is no such GPU. Without it the endpoint is lazy:
    /// the first registered GPU pointer picks the device.
    pub fn gpu(mut self, idx: usize) -> Self {
        let mut c = match self.config.take() {
            Some(c) => c,
            None => Config::from_env().unwrap_or_default(),
        };
        c.gpu = Some(idx);
        self.config = Some(c);
        self
    }

    /// Binds the control listener, starts the shards (managed mode) and
    /// returns the endpoint.
    pub fn build(self) -> Result<Endpoint> {
        let cfg = match self.config {
            Some(c) => c,
            None => Config::from_env()?,
        };
        cfg.validate()?;
        Endpoint::start(cfg)
    }
}

/// Who is at the other end of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// Over the network (tcp), at this address.
    Net(SocketAddr),
    /// On this host, over shared memory.
    Local { endpoint_id: u64, pid: u32 },
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Net(a) => write!(f, "{a}"),
            Peer::Local { endpoint_id, pid } => {
                write!(f, "local endpoint {endpoint_id:016x} (pid {pid})")
            }
        }
    }
}

/// A connection's record on the control side.
struct ConnInfo {
    peer: Peer,
    /// One-sided ops with NIC-keyed windows go over RDMA queue pairs.
    verbs: bool,
}

pub(crate) struct Inner {
    pub(crate) cfg: Config,
    id: u64,
    backend: IoBackend,
    backend_note: Option<String>,
    listener: TcpListener,
    metadata: EndpointMetadata,
    shards: Vec<ShardHandle>,
    table: Arc<CompletionTable>,
    next_conn: AtomicU64,
    next_rkey: AtomicU32,
    conns: Mutex<HashMap<ConnId, ConnInfo>>,
    remotes: Mutex<HashMap<SocketAddr, ConnId>>,
    inbox: Mutex<Receiver<(ConnId, Vec<u8>)>>,
    /// Incoming handshakes, driven by whoever accepts.
    gate: Mutex<Gate<PeerSlot>>,
    /// Ends the gate's wait early (a same-host CONNECT for the passive
    /// accept thread, or `stop_accept`).
    gate_waker: Arc<mio::Waker>,
    accepted: Mutex<VecDeque<(ConnId, Peer)>>,
    accepted_cv: Condvar,
    passive: Mutex<Option<(Arc<AtomicBool>, JoinHandle<()>)>>,
    /// RDMA setups of accepted connections under way.
    verbs_setups: AtomicUsize,
    /// Why the same-host path is off, if it is.
    shm_note: Option<String>,
    /// The NICs verbs would use, or why verbs is off (connections use tcp).
    verbs: std::result::Result<Vec<String>, String>,
    /// The opened NIC when verbs is on.
    pub(crate) nic: Option<crate::verbs::NicHandle>,
    host_token: u64,
    local_connects: Mutex<Receiver<(crate::wire::shm_msg::Msg, Vec<u8>)>>,
    memfd_regions: Mutex<HashMap<u32, std::sync::Weak<Region>>>,
    local_peers: Mutex<std::collections::HashSet<u64>>,
    /// Turn of the lanes handed to threads for their small ops
    /// (`thread_lane`).
    next_lane: AtomicU64,
    /// The shard the next same-host connection goes to (mod the shards).
    next_local_shard: AtomicU64,
    /// GPUs (bit = ordinal, < 64) with memory registered here: an RDMA
    /// peer may write into them, so a notification from a verbs connection
    /// flushes them first (`flush_rdma_writes`).
    gpus_registered: AtomicU64,
    /// Which shards have a doorbell (our rings into them name it in their
    /// header).
    local_bell: Vec<bool>,
    /// Same-host peers and their mapped memory, for every shard.
    shares: Arc<crate::shm::peers::PeerShares>,
    /// Local peers' doorbells we ring, shared by the rings into one shard.
    bells: Mutex<HashMap<(u64, u32), std::sync::Weak<crate::shm::bell::RemoteBell>>>,
    /// Connections the shards saw die; forgotten on the next control call.
    closed: Mutex<Receiver<ConnId>>,
    /// Handshakes under way per remote address (they count against its
    /// quota before their connection is adopted).
    handshaking: Arc<Mutex<HashMap<IpAddr, usize>>>,
    /// Live registrations (for FERRY_MAX_REGISTRATIONS).
    pub(crate) registrations: Arc<AtomicUsize>,
    /// The endpoint's GPU ordinal, once given or picked (lazy mode).
    gpu: std::sync::OnceLock<i32>,
    ipc_counters: Arc<crate::gpu::ipc::IpcCounters>,
}

/// A handshake's place in its address's quota, given back on drop.
pub(crate) struct PeerSlot {
    counts: Arc<Mutex<HashMap<IpAddr, usize>>>,
    ip: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut pending = self.counts.lock().expect("lock");
        if let Some(n) = pending.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                pending.remove(&self.ip);
            }
        }
    }
}

/// A transfer engine endpoint: one control listener, N shards, and the
/// connections and registrations they serve.
pub struct Endpoint {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
    embedded: Mutex<Vec<Shard>>,
}

impl Endpoint {
    pub fn builder() -> EndpointBuilder {
        EndpointBuilder::default()
    }

    /// The endpoint's metadata (what a peer needs to connect).
    pub fn metadata(&self) -> &EndpointMetadata {
        &self.inner.metadata
    }

    /// The metadata in the seed's byte format.
    pub fn metadata_bytes(&self) -> Vec<u8> {
        self.inner.metadata.encode()
    }

    /// Random identity of this endpoint, sent in every handshake.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    pub fn config(&self) -> &Config {
        &self.inner.cfg
    }

    /// The control-path backend in use, and why io_uring was not, if not.
    pub fn io_backend(&self) -> (IoBackend, Option<&str>) {
        (self.inner.backend, self.inner.backend_note.as_deref())
    }

    /// Embedded mode: hands the shards to the caller, once. The caller must
    /// call [`Shard::poll`] on each, or nothing moves.
    pub fn take_shards(&self) -> Vec<Shard> {
        std::mem::take(&mut *self.embedded.lock().expect("lock"))
    }

    /// Who is at the other end of `conn` (and so which path it uses).
    pub fn peer(&self, conn: ConnId) -> Option<Peer> {
        self.inner
            .conns
            .lock()
            .expect("lock")
            .get(&conn)
            .map(|c| c.peer)
    }

    /// Whether `conn` has RDMA queue pairs (both sides had a usable NIC):
    /// its WRITEs and READs to windows advertised with a NIC key go over
    /// verbs.
    pub fn uses_verbs(&self, conn: ConnId) -> bool {
        self.inner
            .conns
            .lock()
            .expect("lock")
            .get(&conn)
            .is_some_and(|c| c.verbs)
    }

    /// Open connections (dead ones are forgotten first).
    pub fn conn_count(&self) -> usize {
        self.inner.reap_closed();
        self.inner.conns.lock().expect("lock").len()
    }

    /// Live registrations.
    pub fn registration_count(&self) -> usize {
        self.inner.registrations.load(Ordering::Acquire)
    }

    /// Operations in flight or completed but not yet reaped.
    pub fn inflight_ops(&self) -> usize {
        self.inner.table.in_use()
    }

    // ---- connections -------------------------------------------------

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
        if let Some(&c) = self.inner.remotes.lock().expect("lock").get(&addr) {
            return Ok(c);
        }
        let c = self.inner.connect(addr)?;
        let mut remotes = self.inner.remotes.lock().expect("lock");
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
        let info = self.inner.conns.lock().expect("lock").remove(&conn);
        let Some(info) = info else {
            return Err(Error::UnknownConn { conn });
        };
        self.inner
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
        if self.inner.passive.lock().expect("lock").is_some() {
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
                let mut q = self.inner.accepted.lock().expect("lock");
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
            if self.inner.passive.lock().expect("lock").is_some() {
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
        let mut p = self.inner.passive.lock().expect("lock");
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

    pub fn stop_accept(&self) {
        let p = self.inner.passive.lock().expect("lock").take();
        if let Some((stop, t)) = p {
            stop.store(true, Ordering::Relaxed);
            let _ = self.inner.gate_waker.wake();
            let _ = t.join();
        }
    }

    // ---- memory ------------------------------------------------------

    /// Registers a buffer the engine takes and keeps alive, with remote read
    /// and write allowed.
    pub fn register(&self, buf: impl Into<Box<[u8]>>) -> Result<MemoryRegion> {
        self.register_with(buf, Access::all())
    }

    pub fn register_with(&self, buf: impl Into<Box<[u8]>>, access: Access) -> Result<MemoryRegion> {
        let mut b: Box<[u8]> = buf.into();
        let (ptr, len) = (b.as_mut_ptr(), b.len());
        // SAFETY: the box is the backing: it lives as long as the region.
        unsafe { self.inner.add_region(ptr, len, access, Backing::Owned(b)) }
    }

    /// Allocates and registers `len` zeroed bytes.
    pub fn alloc(&self, len: usize) -> Result<MemoryRegion> {
        self.register(vec![0u8; len])
    }

    /// Allocates and registers `len` zeroed bytes of host memory in a memfd,
    /// shared with same-host peers so their transfers into or out of it are
    /// one memcpy (other memory is copied with process_vm_readv/writev).
    pub fn alloc_host(&self, len: usize) -> Result<MemoryRegion> {
        let m = crate::sys::MemfdBuf::new(len)?;
        let ptr = m.map.ptr();
        // SAFETY: the memfd mapping is the backing: it lives as long as the
        // region.
        let mr = unsafe {
            self.inner
                .add_region(ptr, len, Access::all(), Backing::Memfd(m))?
        };
        self.inner
            .memfd_regions
            .lock()
            .expect("lock")
            .insert(mr.rkey(), Arc::downgrade(&mr.inner));
        self.inner.share_new_region(&mr.inner);
        Ok(mr)
    }

    /// Connects over shared memory to the endpoint `peer_id` on this host
    /// (the seed's `connect_local`). `add_remote` does this by itself when
    /// the metadata names a same-host endpoint.
    pub fn connect_local(&self, peer_id: u64) -> Result<ConnId> {
        self.inner.connect_local(peer_id)
    }

    /// The RDMA NICs verbs would use here (best first), or why verbs is off.
    /// Without verbs, connections use tcp.
    pub fn verbs_status(&self) -> std::result::Result<&[String], &str> {
        self.inner.verbs.as_deref().map_err(String::as_str)
    }

    /// Whether same-host connections are possible, and if not, why.
    pub fn shm_status(&self) -> std::result::Result<(), &str> {
        match &self.inner.shm_note {
            None => Ok(()),
            Some(why) => Err(why),
        }
    }

    /// Registers several buffers (the seed's `regv`).
    pub fn regv(&self, bufs: Vec<Box<[u8]>>) -> Result<Vec<MemoryRegion>> {
        bufs.into_iter().map(|b| self.register(b)).collect()
    }

    /// Registers memory the caller owns.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be valid for reads and writes from now until
    /// the returned region has been deregistered (`deregister` returned, or
    /// the handle was dropped); peers may write it at any time meanwhile.
    pub unsafe fn register_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        // SAFETY: this function's contract is add_region's.
        unsafe { self.inner.add_region(ptr, len, access, Backing::Raw) }
    }

    /// Deregisters a region, waiting until no transfer still uses it.
    pub fn deregister(&self, mut mr: MemoryRegion) -> Result<()> {
        mr.retire(self.inner.cfg.op_timeout())
    }

    /// Describes `[offset, offset + len)` of `mr` for the peer on `conn`
    /// (the seed's `advertise(conn_id, …)`): the key works only on that
    /// connection, only inside that window, and is revoked when the
    /// connection is removed or dies, or `mr` is deregistered. For a key any
    /// connected peer may use until deregistration, see
    /// [`MemoryRegion::advertise`].
    pub fn advertise(
        &self,
        conn: ConnId,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
    ) -> Result<RemoteBuf> {
        let mut rb = mr.window(offset, len)?;
        if !self.inner.conns.lock().expect("lock").contains_key(&conn) {
            return Err(Error::UnknownConn { conn });
        }
        let (rkey, tag) = self
            .inner
            .grant_window(&mr.inner, rb.addr, len as u64, Some(conn))?;
        rb.rkey = rkey;
        rb.reserved[..8].copy_from_slice(&tag.to_le_bytes());
        Ok(rb)
    }

    /// Advertises several windows to the peer on `conn` (the seed's `advertisev`).
    pub fn advertisev(
        &self,
        conn: ConnId,
        windows: &[(&MemoryRegion, usize, usize)],
    ) -> Result<Vec<RemoteBuf>> {
        windows
            .iter()
            .map(|(m, o, l)| self.advertise(conn, m, *o, *l))
            .collect()
    }

    // ---- notifications -------------------------------------------------

    /// Sends a small message (at most 4096 bytes) to the peer's inbox.
    pub fn send_notification(&self, conn: ConnId, msg: &[u8]) -> Result<()> {
        if msg.len() > MAX_NOTIFY_BYTES {
            return Err(Error::NotifyTooLong {
                len: msg.len(),
                max: MAX_NOTIFY_BYTES,
            });
        }
        if !self.inner.conns.lock().expect("lock").contains_key(&conn) {
            return Err(Error::UnknownConn { conn });
        }
        let deadline = Instant::now() + self.inner.cfg.connect_timeout();
        // A connection spread over shards sends them on its first lane (in
        // order with each other; ops complete before they are reported).
        let (lane, shard) = self.inner.lanes(conn).next().expect("a lane");
        shard.submit_blocking(
            Command::Notify {
                conn: lane,
                payload: msg.to_vec(),
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
        let got = self.inner.inbox.lock().expect("lock").recv_timeout(timeout);
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
        let n = self.inner.inbox.lock().expect("lock").try_recv().ok()?;
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

/// One part of an op on a window. `same_host` says whether the
/// connection is a same-host one (asked only for GPU memory).
pub(super) fn desc(
    mr: &MemoryRegion,
    offset: usize,
    len: usize,
    remote: &RemoteBuf,
    same_host: &dyn Fn() -> bool,
) -> Result<OpDesc> {
    let local = mr.slice(offset, len)?;
    if mr.inner.mem.is_device() && same_host() {
        // A same-host target reaches GPU memory through its IPC handle;
        // export it now so that a failure is this call's error. Over tcp
        // and verbs nothing is exported: memory that cannot be (VMM,
        // cudaMallocAsync pools) still moves there.
        mr.inner.export_ipc()?;
    }
    if len > remote.size as usize {
        return Err(Error::RemoteTooSmall {
            len,
            remote_size: remote.size,
        });
    }
    Ok(OpDesc {
        local,
        remote_addr: remote.addr,
        rkey: remote.rkey,
        tag: remote.key_tag(),
        remote_device: remote.is_device(),
        nic_rkeys: remote.nic_rkeys(),
    })
}

/// A connection spread over shards has an id whose top byte is its lane
/// count (2..=255) and whose rest is its first lane's id; lane i is
/// `ConnId(base + i)`. Others have a zero top byte: one lane, themselves.
const LANES_SHIFT: u32 = 56;
const MAX_LANES: usize = 255;

fn lanes_of(conn: ConnId) -> (u64, usize) {
    let k = (conn.0 >> LANES_SHIFT) as usize;
    if k > 1 {
        (conn.0 & ((1 << LANES_SHIFT) - 1), k)
    } else {
        (conn.0, 1)
    }
}

impl Inner {
    /// Before a notification from `conn` reaches the application: if
    /// `conn` uses verbs and GPU memory is registered here, flush the RDMA
    /// WRITEs into it (what the peer wrote before notifying is then
    /// visible to GPU work). A failed flush is logged: the notification
    /// itself is still delivered.
    fn flush_for_notification(&self, conn: ConnId) {
        if self.gpus_registered.load(Ordering::Relaxed) == 0 || self.nic.is_none() {
            return;
        }
        let verbs = self
            .conns
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
        let mask = self.gpus_registered.load(Ordering::Relaxed);
        if mask == 0 {
            return Ok(());
        }
        let cuda = crate::gpu::cuda()?;
        (0..64)
            .filter(|i| mask & (1u64 << i) != 0)
            .try_for_each(|i| cuda.flush_rdma_writes(i))
    }

    /// Requests in flight per stream, both ways: the smaller of ours and
    /// the peer's declaration (both sides compute the same). Queues are
    /// sized by it, so a peer declaring 2^20 reserves nothing beyond our
    /// own `FERRY_STREAM_INFLIGHT`.
    pub(crate) fn agreed_inflight(&self, peer_declared: usize) -> usize {
        self.cfg.stream_inflight.min(peer_declared).max(1)
    }

    pub(crate) fn auth_key(&self) -> Option<&[u8]> {
        self.cfg.auth_key.as_ref().map(|k| k.bytes())
    }

    /// Forgets connections the shards reported dead.
    fn reap_closed(&self) {
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

    /// One remote address may hold at most `max_conns_per_peer` of our
    /// connections, handshakes under way included (it cannot take every
    /// slot). The slot is held until the returned guard drops, by which
    /// time an accepted connection is in `conns`.
    fn reserve_peer_slot(&self, ip: IpAddr) -> Result<PeerSlot> {
        // The effective quota never exceeds the whole limit.
        let max = self.cfg.max_conns_per_peer.min(self.cfg.max_conns);
        let conns = self.conns.lock().expect("lock");
        let held = conns
            .values()
            .filter(|c| matches!(c.peer, Peer::Net(a) if a.ip() == ip))
            .count();
        let mut pending = self.handshaking.lock().expect("lock");
        let n = pending.entry(ip).or_insert(0);
        if held + *n >= max {
            return Err(Error::LimitReached {
                limit: "FERRY_MAX_CONNS_PER_PEER",
                max,
            });
        }
        *n += 1;
        Ok(PeerSlot {
            counts: self.handshaking.clone(),
            ip,
        })
    }

    /// The shard that serves `conn` (for a connection spread over shards:
    /// its first lane's).
    fn shard_of(&self, conn: ConnId) -> &ShardHandle {
        let (base, _) = lanes_of(conn);
        &self.shards[(base % self.shards.len() as u64) as usize]
    }

    /// Each lane of `conn` (itself, unless spread over shards), with the
    /// shard that serves it.
    fn lanes(&self, conn: ConnId) -> impl Iterator<Item = (ConnId, &ShardHandle)> {
        let (base, k) = lanes_of(conn);
        let n = self.shards.len() as u64;
        (0..k as u64).map(move |i| (ConnId(base + i), &self.shards[((base + i) % n) as usize]))
    }

    /// How many lanes a new tcp connection of `streams` streams gets.
    fn lanes_for(&self, streams: usize) -> usize {
        let cap = if self.cfg.lanes == 0 {
            usize::MAX
        } else {
            self.cfg.lanes
        };
        streams.min(self.shards.len()).min(cap).clamp(1, MAX_LANES)
    }

    /// The lane (modulo a connection's count) this thread's small ops use:
    /// dealt round-robin to threads on their first op.
    fn thread_lane(&self) -> u64 {
        thread_local! {
            static LANE: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
        }
        LANE.with(|l| match l.get() {
            Some(lane) => lane,
            None => {
                let lane = self.next_lane.fetch_add(1, Ordering::Relaxed);
                l.set(Some(lane));
                lane
            }
        })
    }

    /// Ids for `k` lanes: `base..base + k`, with `base` a multiple of the
    /// shard count when k > 1, so lane i is served by shard i.
    fn alloc_conn_ids(&self, k: usize) -> u64 {
        if k <= 1 {
            return self.next_conn.fetch_add(1, Ordering::Relaxed);
        }
        let n = self.shards.len() as u64;
        let mut cur = self.next_conn.load(Ordering::Relaxed);
        loop {
            let base = cur.div_ceil(n) * n;
            match self.next_conn.compare_exchange_weak(
                cur,
                base + k as u64,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return base,
                Err(c) => cur = c,
            }
        }
    }

    pub(super) fn submit(&self, conn: ConnId, kind: OpKind, parts: OpParts) -> Result<Transfer> {
        let t = self.table.claim().ok_or(Error::TooManyInflight {
            max: self.table.capacity(),
        })?;
        let (base, k) = lanes_of(conn);
        if k > 1 {
            return self.submit_lanes(t, base, k, kind, parts);
        }
        let cmd = OpCmd {
            conn,
            kind,
            slot: t.slot(),
            parts,
            at: Default::default(),
            total: None,
        };
        match self.shard_of(conn).submit(Command::Op(cmd)) {
            Ok(()) => Ok(t),
            Err((e, _)) => {
                // Never submitted: complete it ourselves so the slot frees.
                self.table.complete(t.slot(), Ok(()));
                drop(t);
                Err(e)
            }
        }
    }

    /// Submits an op on a connection spread over `k` lanes: a large
    /// single op is cut into `k` contiguous pieces (at chunk boundaries),
    /// one per lane; a vectored one deals its pairs over the lanes; a
    /// small one goes whole to the calling thread's lane. The pieces complete
    /// into one slot (`CompletionTable::set_parts`).
    fn submit_lanes(
        &self,
        t: Transfer,
        base: u64,
        k: usize,
        kind: OpKind,
        parts: OpParts,
    ) -> Result<Transfer> {
        let slot = t.slot();
        let chunk = self.cfg.chunk_bytes as u64;
        let n = self.shards.len() as u64;
        let mut failed = None;
        let mut send = |lane_idx: u64, piece: OpParts| {
            let lane = base + lane_idx % k as u64;
            if failed.is_some() {
                // An earlier piece was refused: this one is never sent.
                self.table.complete(slot, Ok(()));
                return;
            }
            let cmd = OpCmd {
                conn: ConnId(lane),
                kind,
                slot,
                parts: piece,
                at: Default::default(),
                total: None,
            };
            if let Err((e, _)) = self.shards[(lane % n) as usize].submit(Command::Op(cmd)) {
                // Never submitted: its part is completed here, so the slot
                // frees once the pieces already sent end.
                self.table.complete(slot, Ok(()));
                failed = Some(e);
            }
        };
        match parts {
            OpParts::One(d) if d.len() >= 2 * chunk => {
                let total = d.len();
                let per = total.div_ceil(chunk).div_ceil(k as u64) * chunk;
                self.table.set_parts(slot, total.div_ceil(per) as u32);
                let mut off = 0;
                while off < total {
                    let len = per.min(total - off);
                    send(off / per, OpParts::One(d.piece(off, len)));
                    off += len;
                }
            }
            OpParts::Many(ds) if ds.len() > 1 => {
                let lanes = k.min(ds.len());
                let mut groups: Vec<Vec<_>> = (0..lanes).map(|_| Vec::new()).collect();
                for (i, d) in ds.into_iter().enumerate() {
                    groups[i % lanes].push(d);
                }
                self.table.set_parts(slot, lanes as u32);
                for (i, g) in groups.into_iter().enumerate() {
                    send(i as u64, OpParts::Many(g));
                }
            }
            // A small op: the calling thread's lane, so one thread's small
            // ops batch on one shard (and stay in order), while several
            // threads spread over the lanes.
            whole => send(self.thread_lane(), whole),
        }
        match failed {
            None => Ok(t),
            Some(e) => {
                drop(t);
                Err(e)
            }
        }
    }

    /// Registers `[ptr, ptr + len)`.
    ///
    /// # Safety
    /// The range stays valid for reads and writes until the region is
    /// dropped: `backing` holds it, or (`Backing::Raw`) the caller of
    /// `register_raw` promised so.
    unsafe fn add_region(
        self: &Arc<Self>,
        ptr: *mut u8,
        len: usize,
        access: Access,
        backing: Backing,
    ) -> Result<MemoryRegion> {
        if ptr.is_null() && len > 0 {
            return Err(Error::Unsupported {
                what: "registering a null pointer",
                reason: format!("len {len}"),
            });
        }
        let n = self.registrations.fetch_add(1, Ordering::AcqRel);
        if n >= self.cfg.max_registrations {
            self.registrations.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::LimitReached {
                limit: "FERRY_MAX_REGISTRATIONS",
                max: self.cfg.max_registrations,
            });
        }
        let mem = match crate::gpu::memory::classify(ptr as u64) {
            Ok(m) => m,
            Err(e) => {
                self.registrations.fetch_sub(1, Ordering::AcqRel);
                return Err(e);
            }
        };
        if let crate::gpu::MemKind::Device { ordinal, .. } = mem {
            // Lazy mode: the first GPU pointer picks the endpoint's GPU.
            let _ = self.gpu.set(ordinal);
            if (0..64).contains(&ordinal) {
                self.gpus_registered
                    .fetch_or(1 << ordinal, Ordering::Relaxed);
            }
        }
        let rkey = self.next_rkey.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `backing` holds the memory (owned buffers, memfds), or the
        // caller of `register_raw` promised to keep it valid until
        // deregistration; `classify` found it host or GPU memory.
        let r = Arc::new(unsafe {
            Region::from_raw(ptr, len, rkey, random_u64(), access, mem, backing)
        });
        // With a NIC, register it there now, on the caller's thread: the
        // pinning stays out of the shard loop, and a refusal (MEMLOCK) is
        // found once — the region's ops then go over tcp.
        let _ = crate::verbs::remote_keys(self.nic.as_ref(), &r);
        for s in &self.shards {
            s.region(RegionCmd::Add(r.clone()))?;
        }
        Ok(MemoryRegion {
            inner: r,
            ep: Arc::downgrade(self),
            live: true,
            windows: Default::default(),
        })
    }

    /// Mints a key for `[base, base + len)` of `region`: for one connection
    /// (on its shard) or for any (on every shard). It dies with the
    /// registration, and a scoped one with its connection.
    pub(crate) fn grant_window(
        &self,
        region: &Arc<Region>,
        base: u64,
        len: u64,
        conn: Option<ConnId>,
    ) -> Result<(u32, u64)> {
        let rkey = self.next_rkey.fetch_add(1, Ordering::Relaxed);
        let tag = random_u64();
        let grant = |conn| crate::region::Grant {
            region: region.clone(),
            tag,
            base,
            len,
            conn,
        };
        match conn {
            // Every lane's shard: requests may come on any of them.
            Some(c) => {
                for (_, shard) in self.lanes(c) {
                    shard.region(RegionCmd::Grant {
                        rkey,
                        grant: grant(Some(c)),
                    })?;
                }
            }
            None => {
                for s in &self.shards {
                    s.region(RegionCmd::Grant {
                        rkey,
                        grant: grant(None),
                    })?;
                }
            }
        }
        Ok((rkey, tag))
    }

    pub(crate) fn forget_region(&self, rkey: u32) {
        for s in &self.shards {
            let _ = s.region(RegionCmd::Remove(rkey));
        }
    }

    fn stream_hello(&self) -> Hello {
        Hello {
            endpoint_id: self.id,
            caps: if self.nic.is_some() {
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
                },
            auth_nonce: random_u64(),
            host_token: self.host_token,
            conn_nonce: random_u64(),
            stream_idx: 0,
            stream_count: self.cfg.streams_per_conn,
            max_inflight: self.cfg.stream_inflight as u32,
        }
    }

    fn connect(&self, addr: SocketAddr) -> Result<ConnId> {
        self.check_conn_limit()?;
        let mut ctl = Ctl::new(self.backend)?;
        let timeout = self.cfg.connect_timeout();
        let ours = self.stream_hello();
        let (streams, hellos) = handshake::connect(&mut ctl, addr, ours, timeout, self.auth_key())?;
        let ack = hellos[0].1;
        if self.goes_local(&ours, &ack) {
            drop(streams);
            match self.connect_local(ack.endpoint_id) {
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

    /// When both sides offer verbs, sets up the connection's RDMA queue
    /// pairs over its first stream (both sides send their info, then read
    /// the other's). `None`: the connection uses tcp only.
    fn verbs_link(
        &self,
        s: &std::net::TcpStream,
        (ours, peer): (&Hello, &Hello),
        deadline: Instant,
        shard: usize,
    ) -> Result<Option<Box<crate::verbs::Link>>> {
        #[cfg(feature = "rdma")]
        {
            let Some(nic) = &self.nic else {
                return Ok(None);
            };
            // Both hellos, as the accepting side decides (`wants_verbs`):
            // a hello sent without CAP_VERBS (a fallback handshake) means
            // no verbs on either side.
            if !ours.both_offer(peer, crate::wire::CAP_VERBS) {
                return Ok(None);
            }
            let ctl = std::cell::RefCell::new(Ctl::new(self.backend)?);
            let chunk = self.cfg.chunk_bytes.min(1 << 30) as u32;
            let link = crate::verbs::device::exchange(
                nic,
                &self.cfg.verbs(),
                chunk,
                shard,
                |f| ctl.borrow_mut().send_all(s, &f.encode(), deadline),
                || handshake::read_frame(&mut ctl.borrow_mut(), s, deadline),
            )?;
            Ok(link.map(|l| Box::new(l) as Box<crate::verbs::Link>))
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = (s, ours, peer, deadline, shard);
            Ok(None)
        }
    }

    /// Each stream's frame MACs when the connection is authenticated:
    /// keys from the secret and that stream's two handshake nonces.
    fn stream_macs(&self, hellos: &[(Hello, Hello)], client: bool) -> Vec<crate::tcp::Integrity> {
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
    fn adopt(
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
        };
        let deadline = Instant::now() + self.cfg.connect_timeout();
        // Each side spreads its streams over its own shards: a stream's
        // requests are answered on that stream, so the two sides need not
        // split alike. A connection that may get queue pairs stays whole
        // (one set of QPs, one lane), and its id — so its shard — is known
        // first: its QPs post to that shard's shared completion queues.
        let may_verbs =
            self.nic.is_some() && hellos[0].0.both_offer(&peer_hello, crate::wire::CAP_VERBS);
        let k = if may_verbs {
            1
        } else {
            self.lanes_for(streams.len())
        };
        let base = self.alloc_conn_ids(k);
        let shard = (base % self.shards.len() as u64) as usize;
        let mut verbs =
            self.verbs_link(&streams[0], (&hellos[0].0, &peer_hello), deadline, shard)?;
        let conn = if k > 1 {
            ConnId(base | (k as u64) << LANES_SHIFT)
        } else {
            ConnId(base)
        };
        self.conns.lock().expect("lock").insert(
            conn,
            ConnInfo {
                peer: Peer::Net(peer),
                verbs: verbs.is_some(),
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

    /// Runs the handshake gate for up to `timeout`: accepts sockets and
    /// advances every handshake on one epoll loop (no thread per socket,
    /// so silent or slow clients cannot hold up the others). Finished
    /// connections land in `accepted`.
    fn accept_step(self: &Arc<Self>, timeout: Duration) -> Result<()> {
        let done = match self.gate.try_lock() {
            Ok(mut gate) => gate.step(&self.listener, &AcceptHooks(self), timeout)?,
            Err(_) => {
                // Another thread drives the gate; its results reach `accepted`.
                std::thread::sleep(timeout.min(Duration::from_millis(1)));
                return Ok(());
            }
        };
        for d in done {
            self.finish_accepted(d);
        }
        Ok(())
    }

    /// Adopts a connection whose handshake finished. An RDMA setup (one
    /// more exchange with the peer) runs on a thread of its own, bounded,
    /// so a peer that stalls it holds up nobody else.
    fn finish_accepted(self: &Arc<Self>, d: Done<PeerSlot>) {
        let peer = d.peer;
        if self.goes_local(&d.ours, &d.theirs) {
            // Both sides see the same hellos and decide alike: the peer now
            // comes through our accept ring instead.
            info!(%peer, "peer is on this host: expecting a same-host connection");
            return;
        }
        fn adopt(inner: &Arc<Inner>, d: Done<PeerSlot>) {
            let peer = d.peer;
            match inner.adopt(d.streams, &d.hellos, false, peer) {
                Ok(conn) => inner.push_accepted(conn, Peer::Net(peer)),
                Err(e) => warn!(%peer, "incoming connection failed: {e}"),
            }
            drop(d.slot);
        }
        if !self.wants_verbs(&d.ours, &d.theirs) {
            return adopt(self, d);
        }
        for s in &d.streams {
            // The verbs exchange runs on the control backend, whose calls
            // expect their socket mode (the shard sets its own after).
            let _ = s.set_nonblocking(self.backend == IoBackend::Epoll);
        }
        if self.verbs_setups.fetch_add(1, Ordering::AcqRel) >= MAX_VERBS_SETUPS {
            self.verbs_setups.fetch_sub(1, Ordering::AcqRel);
            warn!(%peer, "{MAX_VERBS_SETUPS} RDMA setups already under way; connection dropped");
            return;
        }
        let inner = self.clone();
        let spawned = std::thread::Builder::new()
            .name("ferry-verbs-setup".to_owned())
            .spawn(move || {
                adopt(&inner, d);
                inner.verbs_setups.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            self.verbs_setups.fetch_sub(1, Ordering::AcqRel);
            warn!(%peer, "spawn RDMA setup thread: {e}");
        }
    }

    /// Whether accepting `theirs` leads to an RDMA exchange.
    fn wants_verbs(&self, ours: &Hello, theirs: &Hello) -> bool {
        cfg!(feature = "rdma")
            && self.nic.is_some()
            && ours.both_offer(theirs, crate::wire::CAP_VERBS)
    }

    fn push_accepted(&self, conn: ConnId, peer: Peer) {
        let mut q = self.accepted.lock().expect("lock");
        if q.len() >= MAX_ACCEPTED_QUEUE {
            let (old, _) = q.pop_front().expect("non-empty");
            warn!(conn = %old, "nobody called accept(); forgetting the oldest accepted connection (it stays usable)");
        }
        q.push_back((conn, peer));
        self.accepted_cv.notify_all();
    }

    /// Whether a handshake between `a` and `b` leads to the same-host path.
    fn goes_local(&self, a: &Hello, b: &Hello) -> bool {
        a.caps & CAP_SHM != 0
            && b.caps & CAP_SHM != 0
            && a.host_token == b.host_token
            && a.host_token != 0
    }

    fn accept_one(self: &Arc<Self>, timeout: Duration) -> Result<(ConnId, Peer)> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(got) = self.accepted.lock().expect("lock").pop_front() {
                return Ok(got);
            }
            let Some(left) = oob::remaining(deadline) else {
                return Err(Error::AcceptTimeout {
                    timeout_ms: oob::ms(timeout),
                });
            };
            // Short steps, so a connection whose handshake finished on its
            // own thread, or a same-host CONNECT, is answered promptly.
            self.accept_local_step();
            self.accept_step(left.min(Duration::from_millis(5)))?;
        }
    }

    fn next_accepted(&self, timeout: Duration) -> Result<(ConnId, Peer)> {
        let deadline = Instant::now() + timeout;
        let mut q = self.accepted.lock().expect("lock");
        loop {
            if let Some(got) = q.pop_front() {
                return Ok(got);
            }
            let Some(left) = oob::remaining(deadline) else {
                return Err(Error::AcceptTimeout {
                    timeout_ms: oob::ms(timeout),
                });
            };
            q = self.accepted_cv.wait_timeout(q, left).expect("lock").0;
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop_accept();
        for s in &self.inner.shards {
            s.wake.shutdown.store(true, Ordering::SeqCst);
            let _ = s.wake.waker.wake();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The endpoint's side of the handshake gate.
struct AcceptHooks<'a>(&'a Inner);

impl GateHooks for AcceptHooks<'_> {
    type Slot = PeerSlot;

    fn ours(&self) -> Hello {
        self.0.stream_hello()
    }

    fn key(&self) -> Option<&[u8]> {
        self.0.auth_key()
    }

    fn admit(&self, _theirs: &Hello, peer: SocketAddr) -> Result<PeerSlot> {
        self.0.check_conn_limit()?;
        self.0.reserve_peer_slot(peer.ip())
    }
}

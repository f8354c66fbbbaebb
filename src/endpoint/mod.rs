//! The public API, mirroring the seed's `Endpoint`: metadata, connections,
//! registration, advertisement, one-sided WRITE/READ (single, vectored,
//! async) and notifications. Only this module knows every other one.

mod accept;
mod batch;
mod config;
mod connect;
mod conns;
mod gpu;
pub mod gpu_registry;
mod lanes;
mod local;
mod memory;
mod notes;
mod observe;
mod ops;
mod prepared;
mod ready;
mod reg_cache;
mod start;
mod table;
mod two_sided;
mod vouch;

use accept::PeerSlot;
pub use batch::Batch;
pub use two_sided::MessageOp;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

pub use config::{Compress, Config, Integrity, Mode, Secret, Transport};
pub use memory::{MemoryRegion, MAX_WINDOWS};
pub use ops::Window;
pub use prepared::Prepared;
pub use reg_cache::{RegCacheStats, SharedRegion};

use crate::error::{ConnId, Error, PathOff, Result};
use crate::oob::IoBackend;
use crate::reactor::{RegionCmd, Shard};
use crate::region::{Access, Backing, Region};
use crate::sys::random_u64;
use crate::wire::{EndpointMetadata, RemoteBuf};

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
    Local {
        /// The peer endpoint's id.
        endpoint_id: u64,
        /// Its process.
        pid: u32,
    },
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

/// The endpoint's state, as parts that each hold their own locks, each
/// defined beside the code that uses it most: who we are (here), the
/// shards (`lanes.rs`), the connection table (`table.rs`), incoming
/// connections (`accept.rs`), notifications and messages
/// (`two_sided.rs`), the same-host side (`local.rs`), the NIC side
/// (`connect.rs`), the GPU side (`gpu.rs`), the registrations
/// (`memory.rs`).
pub(crate) struct Inner {
    pub(crate) cfg: Config,
    me: Me,
    shards: lanes::ShardSet,
    conns: table::ConnTable,
    accept: accept::Acceptor,
    mail: two_sided::Mail,
    local: local::LocalSide,
    pub(crate) nics: connect::NicSide,
    gpus: gpu::GpuSide,
    pub(crate) regs: memory::Registry,
}

/// Who this endpoint is to its peers.
struct Me {
    id: u64,
    metadata: EndpointMetadata,
    /// Same host and /dev/shm as a peer whose hello carries the same token.
    host_token: u64,
    /// The control path's I/O backend, and why it is not the preferred one.
    backend: IoBackend,
    backend_note: Option<PathOff>,
}
/// A transfer engine endpoint: one control listener, N shards, and the
/// connections and registrations they serve.
///
/// ```
/// # fn main() -> ferry::Result<()> {
/// let mut cfg = ferry::Config::default();
/// cfg.listen_addr = "127.0.0.1".parse().unwrap();
/// let ep = ferry::Endpoint::builder().config(cfg).build()?;
/// // What a peer needs to connect (send it over any channel).
/// let meta = ep.metadata_bytes();
/// assert_eq!(ferry::EndpointMetadata::decode(&meta)?.port, ep.metadata().port);
/// # Ok(()) }
/// ```
pub struct Endpoint {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
    embedded: Mutex<Vec<Shard>>,
}

/// # Making one, and what it is
///
/// [`Endpoint::builder`], its metadata and settings, its shards (embedded
/// mode), and counts of what it holds.
impl Endpoint {
    /// Starts building an endpoint (settings, GPU, mode).
    pub fn builder() -> EndpointBuilder {
        EndpointBuilder::default()
    }

    /// The endpoint's metadata (what a peer needs to connect).
    pub fn metadata(&self) -> &EndpointMetadata {
        &self.inner.me.metadata
    }

    /// The metadata in the seed's byte format.
    pub fn metadata_bytes(&self) -> Vec<u8> {
        self.inner.me.metadata.encode()
    }

    /// Random identity of this endpoint, sent in every handshake.
    pub fn id(&self) -> u64 {
        self.inner.me.id
    }

    /// The settings it runs with.
    pub fn config(&self) -> &Config {
        &self.inner.cfg
    }

    /// The control-path backend in use, and why io_uring was not, if not.
    pub fn io_backend(&self) -> (IoBackend, Option<&str>) {
        let note = self.inner.me.backend_note.as_ref();
        (self.inner.me.backend, note.map(|o| o.why.as_str()))
    }

    /// Embedded mode: hands the shards to the caller, once. The caller must
    /// call [`Shard::poll`] on each, or nothing moves.
    pub fn take_shards(&self) -> Vec<Shard> {
        std::mem::take(&mut *self.embedded.lock().expect("lock"))
    }

    /// Who is at the other end of `conn` (and so which path it uses).
    pub fn peer(&self, conn: ConnId) -> Option<Peer> {
        // A connection the shards saw die is unknown from then on.
        self.inner.reap_closed();
        self.inner
            .conns
            .live
            .lock()
            .expect("lock")
            .get(&conn)
            .map(|c| c.peer)
    }

    /// Who is at the other end while `conn` is live; else what every call
    /// on it gets: the cause it died of (`ConnFailed`, until
    /// `remove_remote`), or `UnknownConn`.
    pub fn conn_status(&self, conn: ConnId) -> Result<Peer> {
        self.peer(conn).ok_or_else(|| self.inner.gone(conn))
    }

    /// Whether `conn` has RDMA queue pairs (both sides had a usable NIC):
    /// its WRITEs and READs to windows advertised with a NIC key go over
    /// verbs.
    pub fn uses_verbs(&self, conn: ConnId) -> bool {
        self.inner
            .conns
            .live
            .lock()
            .expect("lock")
            .get(&conn)
            .is_some_and(|c| c.verbs)
    }

    /// Open connections (dead ones are forgotten first).
    pub fn conn_count(&self) -> usize {
        self.inner.reap_closed();
        self.inner.conns.live.lock().expect("lock").len()
    }

    /// Live registrations.
    pub fn registration_count(&self) -> usize {
        self.inner.regs.live.load(Ordering::Acquire)
    }

    /// Operations in flight or completed but not yet reaped.
    pub fn inflight_ops(&self) -> usize {
        self.inner.shards.table.in_use()
    }
}

/// # Memory
///
/// Registering memory (owned, borrowed or raw), deregistering it, and
/// advertising windows of it to peers.
impl Endpoint {
    /// Registers a buffer the engine takes and keeps alive, with remote read
    /// and write allowed.
    pub fn register(&self, buf: impl Into<Box<[u8]>>) -> Result<MemoryRegion> {
        self.register_with(buf, Access::all())
    }

    /// As `register`, with the access peers get (`Access`: read-only, say).
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
            .local
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
        self.inner.connect_local(peer_id, None)
    }

    /// The RDMA NICs verbs would use here (best first), or why verbs is off.
    /// Without verbs, connections use tcp.
    pub fn verbs_status(&self) -> std::result::Result<&[String], &str> {
        match &self.inner.nics.status {
            Ok(nics) => Ok(nics),
            Err(off) => Err(&off.why),
        }
    }

    /// Whether same-host connections are possible, and if not, why.
    pub fn shm_status(&self) -> std::result::Result<(), &str> {
        match &self.inner.local.note {
            None => Ok(()),
            Some(off) => Err(&off.why),
        }
    }

    /// What the codec did so far (`FERRY_COMPRESS`); None when it is off.
    pub fn compress_stats(&self) -> Option<crate::reactor::CompressStats> {
        self.inner.shards.codec.as_ref().map(|c| c.stats())
    }

    /// Registers several buffers (the seed's `regv`).
    pub fn regv(&self, bufs: Vec<Box<[u8]>>) -> Result<Vec<MemoryRegion>> {
        bufs.into_iter().map(|b| self.register(b)).collect()
    }

    /// Checks that `[ptr, ptr + len)` is memory this process can register
    /// with `access`: inside one GPU allocation (the driver's pointer
    /// attributes), or host memory mapped readable, and writable when
    /// anyone may write it (`/proc/self/maps`, read once per call). For
    /// the faces whose callers cannot be asked to prove it (Python, C)
    /// before `register_raw`; it cannot say the memory stays valid, which
    /// remains the caller's promise.
    pub fn check_range(&self, ptr: u64, len: usize, access: Access) -> Result<()> {
        let bad = |reason: String| Error::BadRange {
            addr: ptr,
            len,
            reason,
        };
        if ptr == 0 {
            return Err(bad("a null pointer".into()));
        }
        let end = ptr
            .checked_add(len as u64)
            .ok_or_else(|| bad("it runs past the end of the address space".into()))?;
        match crate::gpu::memory::classify(ptr)? {
            crate::gpu::MemKind::Device {
                alloc_base,
                alloc_len,
                ..
            } => {
                if end > alloc_base.saturating_add(alloc_len as u64) {
                    return Err(bad(format!(
                        "it runs past its GPU allocation [{alloc_base:#x}, +{alloc_len})"
                    )));
                }
                Ok(())
            }
            _ => {
                let write = access.intersects(Access::REMOTE_WRITE | Access::LOCAL_WRITE);
                crate::sys::range_mapped(ptr, len as u64, write).map_err(bad)
            }
        }
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

    /// Deregisters a shared handle to a registration (what
    /// [`Endpoint::release_shared`] hands back) once no call holds it any
    /// more — one submitting an operation may, for a moment — waiting up
    /// to `timeout` for that: the memory may be freed once this returns.
    /// `Err(Error::Timeout { what: "a region still held by a call", .. })`
    /// leaves it to be deregistered when the last holder lets go.
    pub fn deregister_when_free(
        &self,
        mut mr: std::sync::Arc<MemoryRegion>,
        timeout: std::time::Duration,
    ) -> Result<()> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if !memory::wait_until(deadline, || std::sync::Arc::strong_count(&mr) == 1) {
                return Err(Error::Timeout {
                    what: "a region still held by a call",
                    timeout_ms: timeout.as_millis() as u64,
                });
            }
            match std::sync::Arc::try_unwrap(mr) {
                Ok(mr) => return self.deregister(mr),
                // Taken again between the look and the unwrap: wait again.
                Err(still) => mr = still,
            }
        }
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
        self.inner.live(conn)?;
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
}

impl Inner {
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
        let n = self.regs.live.fetch_add(1, Ordering::AcqRel);
        if n >= self.cfg.max_registrations {
            self.regs.live.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::LimitReached {
                limit: "FERRY_MAX_REGISTRATIONS",
                max: self.cfg.max_registrations,
            });
        }
        let mem = match crate::gpu::memory::classify(ptr as u64) {
            Ok(m) => m,
            Err(e) => {
                self.regs.live.fetch_sub(1, Ordering::AcqRel);
                return Err(e);
            }
        };
        if let crate::gpu::MemKind::Device { ordinal, .. } = mem {
            // Lazy mode: the first GPU pointer picks the endpoint's GPU.
            let _ = self.gpus.ordinal.set(ordinal);
            if (0..64).contains(&ordinal) {
                self.gpus
                    .registered
                    .fetch_or(1 << ordinal, Ordering::Relaxed);
            }
        }
        let rkey = self.regs.next_rkey.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `backing` holds the memory (owned buffers, memfds), or the
        // caller of `register_raw` promised to keep it valid until
        // deregistration; `classify` found it host or GPU memory.
        let r = Arc::new(unsafe {
            Region::from_raw(ptr, len, rkey, random_u64(), access, mem, backing)
        });
        // With a NIC, register it there now, on the caller's thread: the
        // pinning stays out of the shard loop, and a refusal (MEMLOCK) is
        // found once — the region's ops then go over tcp.
        let _ = crate::verbs::remote_keys(self.nics.handle.as_ref(), &r);
        for s in &self.shards.shards {
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
        let rkey = self.regs.next_rkey.fetch_add(1, Ordering::Relaxed);
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
                for s in &self.shards.shards {
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
        for s in &self.shards.shards {
            // After the ops queued so far (they may hold borrowed slices).
            let after = s.wake.cmds.accepted();
            let _ = s.region(RegionCmd::Remove { rkey, after });
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop_accept();
        for s in &self.inner.shards.shards {
            s.wake.shutdown.store(true, Ordering::SeqCst);
            let _ = s.wake.waker.wake();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // Embedded shards send what they accepted too (`Shard::linger`).
        for s in self.embedded.get_mut().expect("lock").iter_mut() {
            s.linger();
        }
    }
}

//! The NICs of one endpoint (feature `rdma`): the opened devices (up to
//! four), each with its protection domain and port facts, memory
//! registrations on every NIC, the completion queues each shard shares
//! among its connections (one per NIC), and the NIC's async events (port
//! down, fatal queue pairs) read for every connection. One connection's
//! queue pairs and what it posts are `link.rs`.
//!
//! In CI this layer runs against the software NIC of `tools/softverbs`
//! (the real libibverbs ABI, RC semantics between processes); it has not
//! yet run against a hardware NIC (ARCHITECTURE.md: "first run on
//! hardware").

use std::sync::Arc;

use sideway::ibverbs::completion::GenericCompletionQueue;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::AccessFlags;

use super::plan::{self, WcOutcome};
use super::VerbsConfig;
use crate::error::PathOff;
use crate::error::{Error, Result};
use crate::wire::{NicAddr, LINK_ETHERNET, LINK_INFINIBAND};

/// Tells libibverbs the process may fork (registered pages are then kept
/// out of children: `madvise(MADV_DONTFORK)`), once, before the first
/// device opens: later it is refused. A libibverbs without it (or the
/// software NIC) answers harmlessly.
pub(crate) fn fork_init() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: no arguments; called before any device is opened by us.
        let r = unsafe { rdma_mummy_sys::ibv_fork_init() };
        if r != 0 {
            tracing::debug!(
                "ibv_fork_init: {}",
                std::io::Error::from_raw_os_error(r.abs())
            );
        }
    });
}

/// The NICs an endpoint uses, best first (1..=`MAX_NICS`).
pub struct NicSet {
    /// One completion queue per (shard, NIC), shared by every connection
    /// of that shard: the shard polls it once per pass, however many
    /// connections it carries. (First: dropped before the NICs.)
    pub(super) shared: std::sync::Mutex<std::collections::HashMap<(usize, usize), Arc<SharedCq>>>,
    /// The opened NICs, best first.
    pub nics: Vec<Nic>,
    pub(super) events: NicEvents,
}

/// A completion queue shared by one shard's connections on one NIC.
pub(crate) struct SharedCq {
    pub(super) cq: GenericCompletionQueue,
    /// Entries it holds.
    pub(super) cap: u32,
    /// Signalled WRs posted whose completion has not been polled: posting
    /// waits while another op could overrun the queue.
    pub(super) owed: std::sync::atomic::AtomicU32,
}

/// Entries of a shared completion queue (what one shard's connections on
/// one NIC may have signalled and not yet reaped).
const SHARED_CQ_ENTRIES: u32 = 1 << 16;

impl super::CqPoll for SharedCq {
    fn poll(
        &self,
        out: &mut dyn FnMut(u64, WcOutcome, &'static str),
    ) -> std::result::Result<usize, crate::error::ConnFault> {
        let poller = match self.cq.start_poll() {
            Ok(p) => p,
            Err(sideway::ibverbs::completion::PollCompletionQueueError::CompletionQueueEmpty) => {
                return Ok(0)
            }
            Err(e) => {
                return Err(crate::error::ConnFault::device(
                    "polling the completion queue",
                    format_args!("{e:?}"),
                ))
            }
        };
        let mut n = 0;
        for wc in poller {
            let st = wc.status();
            out(wc.wr_id(), plan::wc_outcome(st), plan::wc_status_name(st));
            n += 1;
        }
        // Flushed unsignalled WRs complete too (uncounted): never below 0.
        // One thread (the shard) posts and polls, so load-then-sub is exact.
        use std::sync::atomic::Ordering::Relaxed;
        let owed = self.owed.load(Relaxed);
        self.owed.store(owed.saturating_sub(n as u32), Relaxed);
        Ok(n)
    }
}

/// The NICs' asynchronous events (a port going down, a queue pair the NIC
/// moved to the error state — the responder's side of a bad request — a
/// device gone): drained by whichever shard asks first, at most every
/// `EVENTS_EVERY_MS`, without blocking. A fatal one advances `epoch`;
/// shards that see it move ask each of their links whether it is named
/// (`Link::broken`), even links with nothing in flight, which no
/// completion would ever fail.
pub(super) struct NicEvents {
    pub(super) epoch: std::sync::atomic::AtomicU64,
    pub(super) next_ms: std::sync::atomic::AtomicU64,
    pub(super) since: std::time::Instant,
    pub(super) state: std::sync::Mutex<EventState>,
}

#[derive(Default)]
pub(super) struct EventState {
    /// Queue pairs in error (bounded: cleared past `MAX_FATAL_QPS`, and of
    /// each link's QPs when that link fails).
    pub(super) fatal_qps: std::collections::HashSet<u32>,
    /// Per NIC (bit k): its port (or the device) is down.
    pub(super) down: u32,
}

const EVENTS_EVERY_MS: u64 = 50;
/// WRITEs of at most this many bytes of host memory are posted inline.
pub(super) const INLINE_MAX: u32 = 64;
const MAX_FATAL_QPS: usize = 4096;

impl NicSet {
    /// The set of `nics` (1..=`MAX_NICS`, else a panic), their async event
    /// descriptors made non-blocking (the shards poll them).
    pub fn new(nics: Vec<Nic>) -> NicSet {
        assert!(
            (1..=crate::wire::MAX_NICS).contains(&nics.len()),
            "1..=MAX_NICS NICs"
        );
        for nic in &nics {
            // SAFETY: the context is open for the NicSet's life; its
            // async_fd is libibverbs' descriptor, which we only make
            // non-blocking (ibv_get_async_event then answers EAGAIN).
            unsafe {
                let fd = (*nic.ctx.context().as_ptr()).async_fd;
                let fl = libc::fcntl(fd, libc::F_GETFL);
                if fl >= 0 {
                    libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
                }
            }
        }
        NicSet {
            nics,
            shared: Default::default(),
            events: NicEvents {
                epoch: Default::default(),
                next_ms: Default::default(),
                since: std::time::Instant::now(),
                state: Default::default(),
            },
        }
    }

    /// Drains the NICs' asynchronous events when due; returns the epoch
    /// (it moves when an event may have broken a link).
    pub fn poll_events(&self) -> u64 {
        use std::sync::atomic::Ordering;
        let ev = &self.events;
        let now = ev.since.elapsed().as_millis() as u64;
        let due = ev.next_ms.load(Ordering::Relaxed);
        if now < due
            || ev
                .next_ms
                .compare_exchange(
                    due,
                    now + EVENTS_EVERY_MS,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            return ev.epoch.load(Ordering::Acquire);
        }
        let Ok(mut st) = ev.state.try_lock() else {
            return ev.epoch.load(Ordering::Acquire);
        };
        let mut fatal = false;
        for (k, nic) in self.nics.iter().enumerate() {
            // Bounded: a NIC cannot hold us here forever.
            for _ in 0..64 {
                // SAFETY: a zeroed event is a valid out-parameter; the
                // context is open.
                let mut e: rdma_mummy_sys::ibv_async_event = unsafe { std::mem::zeroed() };
                // SAFETY: as above.
                if unsafe {
                    rdma_mummy_sys::ibv_get_async_event(nic.ctx.context().as_ptr(), &mut e)
                } != 0
                {
                    break;
                }
                // Read as an integer: a libibverbs newer than our headers
                // may send a type our enum lacks.
                // SAFETY: the field is a C enum (an int) written by
                // libibverbs.
                let kind = unsafe { std::ptr::addr_of!(e.event_type).cast::<u32>().read() };
                match kind {
                    // QP_FATAL, QP_REQ_ERR, QP_ACCESS_ERR.
                    1..=3 => {
                        // SAFETY: these events carry the QP.
                        let qp = unsafe { e.element.qp };
                        if !qp.is_null() {
                            // SAFETY: libibverbs' QP, alive until we
                            // destroy it (not before acking).
                            let qpn = unsafe { (*qp).qp_num };
                            tracing::warn!(
                                "RDMA {}: queue pair {qpn} in error (event {kind})",
                                nic.name
                            );
                            if st.fatal_qps.len() >= MAX_FATAL_QPS {
                                st.fatal_qps.clear();
                            }
                            st.fatal_qps.insert(qpn);
                            fatal = true;
                        }
                    }
                    // DEVICE_FATAL, PORT_ERR.
                    8 | 10 => {
                        tracing::warn!(
                            "RDMA {}: port down or device gone (event {kind})",
                            nic.name
                        );
                        st.down |= 1 << k;
                        fatal = true;
                    }
                    // PORT_ACTIVE.
                    9 => {
                        tracing::info!("RDMA {}: port active again", nic.name);
                        st.down &= !(1 << k);
                    }
                    _ => tracing::debug!("RDMA {}: async event {kind}", nic.name),
                }
                // SAFETY: the event came from ibv_get_async_event.
                unsafe { rdma_mummy_sys::ibv_ack_async_event(&mut e) };
            }
        }
        drop(st);
        if fatal {
            ev.epoch.fetch_add(1, Ordering::AcqRel);
        }
        ev.epoch.load(Ordering::Acquire)
    }

    /// NICs a connection with `n_qps` queue pairs stripes over.
    pub(super) fn used(&self, n_qps: usize) -> usize {
        self.nics.len().min(n_qps.max(1))
    }

    /// The completion queue `shard` shares on NIC `k` (made on first use).
    pub(super) fn shared_cq(&self, shard: usize, k: usize) -> Result<Arc<SharedCq>> {
        let mut m = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(cq) = m.get(&(shard, k)) {
            return Ok(cq.clone());
        }
        let cq = self.nics[k]
            .ctx
            .create_cq_builder()
            .setup_cqe(SHARED_CQ_ENTRIES)
            .build_ex()
            .map_err(|e| verbs_err("ibv_create_cq_ex", e))?;
        let cq = Arc::new(SharedCq {
            cq: GenericCompletionQueue::from(cq),
            cap: SHARED_CQ_ENTRIES,
            owed: Default::default(),
        });
        m.insert((shard, k), cq.clone());
        Ok(cq)
    }
}

/// The verbs flags of a registration's access rights.
pub(super) fn access_flags(a: crate::region::Access) -> AccessFlags {
    let m = super::plan::mr_access(a);
    let mut f = AccessFlags::LocalWrite;
    if m.remote_write {
        f |= AccessFlags::RemoteWrite;
    }
    if m.remote_read {
        f |= AccessFlags::RemoteRead;
    }
    f
}

pub(super) fn verbs_err(what: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Verbs {
        what,
        reason: e.to_string(),
    }
}

/// Names of the RDMA devices libibverbs sees. `Err` says why there are
/// none: libibverbs could not be loaded (rdma-mummy-sys answers every call
/// with EOPNOTSUPP then), or it lists no device.
pub fn device_names() -> std::result::Result<Vec<String>, crate::error::PathOff> {
    match DeviceList::new() {
        Ok(list) => {
            let v: Vec<String> = list.iter().map(|d| d.name()).collect();
            if v.is_empty() {
                Err("libibverbs lists no RDMA device".into())
            } else {
                Ok(v)
            }
        }
        Err(e) => {
            let sideway::ibverbs::device::GetDeviceListErrorKind::Ibverbs(io) = &e.0 else {
                return Err(PathOff::from(format!("ibv_get_device_list failed: {e}")));
            };
            // rdma-mummy-sys answers EOPNOTSUPP when its dlopen failed.
            if io.raw_os_error() == Some(libc::EOPNOTSUPP) {
                Err("libibverbs.so.1 could not be loaded".into())
            } else if io.raw_os_error() == Some(libc::ENOSYS) {
                Err("libibverbs is installed but the kernel has no RDMA support (ENOSYS)".into())
            } else {
                Err(PathOff::from(format!("ibv_get_device_list failed: {io}")))
            }
        }
    }
}

/// One opened NIC port.
pub struct Nic {
    /// Its libibverbs name (`mlx5_0`).
    pub name: String,
    pub(super) ctx: Arc<DeviceContext>,
    pub(super) pd: Arc<ProtectionDomain>,
    pub(super) port: u8,
    pub(super) gid_index: u32,
    pub(super) gid: [u8; 16],
    pub(super) lid: u16,
    pub(super) mtu: u8,
    pub(super) link_layer: u8,
    /// The device's READ caps: (`max_qp_rd_atom`, `max_qp_init_rd_atom`).
    pub(super) rd_atom: (i32, i32),
}

impl Nic {
    /// Opens NIC `name`'s port with `cfg` (its GID chosen, its PD made).
    pub fn open(name: &str, cfg: &VerbsConfig) -> Result<Nic> {
        let list = DeviceList::new().map_err(|e| verbs_err("ibv_get_device_list", e))?;
        let dev = list
            .iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| verbs_err("opening the RDMA device", format!("{name} is gone")))?;
        let ctx = dev.open().map_err(|e| verbs_err("ibv_open_device", e))?;
        let port = cfg.port;
        let pa = ctx
            .query_port(port)
            .map_err(|e| verbs_err("ibv_query_port", e))?;
        // An explicit index, else the best of the port's GID table
        // (RoCE v2, IPv4-mapped first: index 0 is RoCE v1's link-local GID
        // on mlx5, which routed fabrics never connect).
        let gid_index = cfg
            .gid_index
            .unwrap_or_else(|| super::nic::best_gid(&super::sysfs_root(), name, port).unwrap_or(0));
        let gid = ctx
            .query_gid(port, gid_index)
            .map_err(|e| verbs_err("ibv_query_gid", e))?;
        let g = gid.raw;
        let link_layer = match pa.link_layer() {
            LinkLayer::InfiniBand => LINK_INFINIBAND,
            _ => LINK_ETHERNET,
        };
        let dev = ctx
            .query_device()
            .map_err(|e| verbs_err("ibv_query_device_ex", e))?;
        let rd_atom = (dev.max_qp_rd_atom(), dev.max_qp_init_rd_atom());
        let pd = ctx.alloc_pd().map_err(|e| verbs_err("ibv_alloc_pd", e))?;
        Ok(Nic {
            name: name.to_owned(),
            rd_atom,
            pd,
            port,
            gid_index,
            gid: g,
            lid: pa.lid(),
            mtu: pa.active_mtu() as u8,
            link_layer,
            ctx,
        })
    }

    /// Registers `[ptr, ptr + len)` of host memory with the access `access`
    /// gives (`plan::mr_access`).
    ///
    /// # Safety
    /// The memory must stay valid until the returned region is dropped.
    pub unsafe fn reg_host(
        &self,
        ptr: u64,
        len: usize,
        access: crate::region::Access,
    ) -> Result<Arc<MemoryRegion>> {
        let access = access_flags(access);
        // Relaxed ordering first (PCIe writes may pass each other: what
        // GPU memory and busy root complexes need for full rate; a NIC or
        // kernel without it masks the optional bit, an older one refuses
        // it, and then the plain flags are used).
        // SAFETY: the caller's contract.
        unsafe {
            self.pd
                .reg_mr(ptr as usize, len, access | AccessFlags::RelaxedOrdering)
        }
        // SAFETY: as above.
        .or_else(|_| unsafe { self.pd.reg_mr(ptr as usize, len, access) })
        .map_err(|e| verbs_err("ibv_reg_mr", e))
    }

    /// Registers GPU memory through a dma-buf file descriptor of its
    /// allocation (`cuMemGetHandleForAddressRange`), `offset` bytes in.
    ///
    /// # Safety
    /// `fd` must be a dma-buf of the allocation holding `[iova, iova + len)`,
    /// alive until the returned region is dropped.
    pub unsafe fn reg_dmabuf(
        &self,
        fd: i32,
        offset: u64,
        iova: u64,
        len: usize,
        access: crate::region::Access,
    ) -> Result<Arc<MemoryRegion>> {
        let access = access_flags(access);
        // Relaxed ordering first, as in `reg_host`.
        // SAFETY: the caller's contract.
        unsafe {
            self.pd
                .reg_dmabuf_mr(offset, len, iova, fd, access | AccessFlags::RelaxedOrdering)
        }
        // SAFETY: as above.
        .or_else(|_| unsafe { self.pd.reg_dmabuf_mr(offset, len, iova, fd, access) })
        .map_err(|e| verbs_err("ibv_reg_dmabuf_mr", e))
    }

    /// Where this NIC's port is reached.
    pub(super) fn addr(&self) -> NicAddr {
        NicAddr {
            gid: self.gid,
            lid: self.lid,
            port: self.port,
            mtu: self.mtu,
            link_layer: self.link_layer,
        }
    }
}

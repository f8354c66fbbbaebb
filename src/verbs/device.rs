//! The verbs objects of one endpoint (feature `rdma`): the opened NICs
//! (up to four), each with its protection domain, memory registrations on
//! every NIC, and per peer a set of RC data queue pairs striped over the
//! NICs (queue pair `i` on NIC `i % n`) posting to completion queues each
//! shard shares among its connections (one per NIC),
//! connected from the peer's `VerbsInfo` (INIT → RTR → RTS, then both
//! sides confirm) and driven by `plan`: striped WRs posted as linked lists
//! (one doorbell per post), completions polled, never waited for.
//!
//! In CI this layer runs against the software NIC of `tools/softverbs`
//! (the real libibverbs ABI, RC semantics between processes); it has not
//! yet run against a hardware NIC (ARCHITECTURE.md: "first run on
//! hardware").

use std::sync::Arc;

use sideway::ibverbs::address::AddressHandleAttribute;
use sideway::ibverbs::completion::GenericCompletionQueue;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, SetInlineData,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::plan::{self, Piece, Post, WcOutcome};
use super::VerbsConfig;
use crate::error::{Error, Result};
use crate::region::RegionSlice;
use crate::wire::{NicAddr, NicKeys, VerbsInfo, LINK_ETHERNET, LINK_INFINIBAND};

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
    shared: std::sync::Mutex<std::collections::HashMap<(usize, usize), Arc<SharedCq>>>,
    pub nics: Vec<Nic>,
    events: NicEvents,
}

/// A completion queue shared by one shard's connections on one NIC.
pub(crate) struct SharedCq {
    cq: GenericCompletionQueue,
    /// Entries it holds.
    cap: u32,
    /// Signalled WRs posted whose completion has not been polled: posting
    /// waits while another op could overrun the queue.
    owed: std::sync::atomic::AtomicU32,
}

/// Entries of a shared completion queue (what one shard's connections on
/// one NIC may have signalled and not yet reaped).
const SHARED_CQ_ENTRIES: u32 = 1 << 16;

impl super::CqPoll for SharedCq {
    fn poll(
        &self,
        out: &mut dyn FnMut(u64, WcOutcome, &'static str),
    ) -> std::result::Result<usize, String> {
        let poller = match self.cq.start_poll() {
            Ok(p) => p,
            Err(sideway::ibverbs::completion::PollCompletionQueueError::CompletionQueueEmpty) => {
                return Ok(0)
            }
            Err(e) => return Err(format!("polling the completion queue: {e:?}")),
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
struct NicEvents {
    epoch: std::sync::atomic::AtomicU64,
    next_ms: std::sync::atomic::AtomicU64,
    since: std::time::Instant,
    state: std::sync::Mutex<EventState>,
}

#[derive(Default)]
struct EventState {
    /// Queue pairs in error (bounded: cleared past `MAX_FATAL_QPS`, and of
    /// each link's QPs when that link fails).
    fatal_qps: std::collections::HashSet<u32>,
    /// Per NIC (bit k): its port (or the device) is down.
    down: u32,
}

const EVENTS_EVERY_MS: u64 = 50;
/// WRITEs of at most this many bytes of host memory are posted inline.
const INLINE_MAX: u32 = 64;
const MAX_FATAL_QPS: usize = 4096;

impl NicSet {
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
    fn used(&self, n_qps: usize) -> usize {
        self.nics.len().min(n_qps.max(1))
    }

    /// The completion queue `shard` shares on NIC `k` (made on first use).
    fn shared_cq(&self, shard: usize, k: usize) -> Result<Arc<SharedCq>> {
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

    /// Creates `cfg.n_qps` RC queue pairs, queue pair `i` on NIC
    /// `i % used`, on the completion queues `shard` shares.
    pub fn data_qps(&self, cfg: &VerbsConfig, shard: usize) -> Result<DataQps> {
        let depth = cfg.qp_depth;
        let used = self.used(cfg.n_qps);
        let cqs = (0..used)
            .map(|k| self.shared_cq(shard, k))
            .collect::<Result<Vec<_>>>()?;
        let mut qps = Vec::with_capacity(cfg.n_qps);
        // Inline data if every NIC takes it; a NIC that refuses the QP
        // with it gets all of them again without.
        let mut inline_max = INLINE_MAX;
        'attempt: loop {
            qps.clear();
            for i in 0..cfg.n_qps {
                let (nic, cq) = (&self.nics[i % used], &cqs[i % used].cq);
                let qp = nic
                    .pd
                    .create_qp_builder()
                    .setup_max_send_wr(depth)
                    .setup_max_recv_wr(1)
                    .setup_max_send_sge(1)
                    .setup_max_inline_data(inline_max)
                    .setup_send_cq(cq.clone())
                    .setup_recv_cq(cq.clone())
                    .build_ex();
                match qp {
                    Ok(qp) => qps.push(qp),
                    Err(_) if inline_max > 0 => {
                        inline_max = 0;
                        continue 'attempt;
                    }
                    Err(e) => return Err(verbs_err("ibv_create_qp_ex", e)),
                }
            }
            break;
        }
        let psns = qps
            .iter()
            .map(|_| crate::sys::random_u32() & 0xff_ffff)
            .collect();
        Ok(DataQps {
            qps,
            inline_max,
            cqs,
            psns,
            pieces: Vec::new(),
            wrs: Vec::new(),
            signaled: Vec::new(),
            posts: Vec::new(),
        })
    }

    /// What the peer needs to connect to `qps`.
    pub fn info(&self, qps: &DataQps, cfg: &VerbsConfig) -> VerbsInfo {
        let used = &self.nics[..qps.cqs.len()];
        VerbsInfo {
            nics: used.iter().map(Nic::addr).collect(),
            sl: cfg.service_level,
            traffic_class: cfg.traffic_class,
            // What we accept: the peer sends at most this many READs
            // (the least any of our NICs takes).
            max_rd_atomic: used
                .iter()
                .map(|n| {
                    super::plan::read_depths(cfg.max_rd_atomic, n.rd_atom.0, n.rd_atom.1, u8::MAX).0
                })
                .min()
                .unwrap_or(1),
            qps: qps
                .qps
                .iter()
                .zip(&qps.psns)
                .map(|(q, &psn)| (q.qp_number(), psn))
                .collect(),
        }
    }
}

/// The verbs flags of a registration's access rights.
fn access_flags(a: crate::region::Access) -> AccessFlags {
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

fn verbs_err(what: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Verbs {
        what,
        reason: e.to_string(),
    }
}

/// Names of the RDMA devices libibverbs sees. `Err` says why there are
/// none: libibverbs could not be loaded (rdma-mummy-sys answers every call
/// with EOPNOTSUPP then), or it lists no device.
pub fn device_names() -> std::result::Result<Vec<String>, String> {
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
                return Err(format!("ibv_get_device_list failed: {e}"));
            };
            // rdma-mummy-sys answers EOPNOTSUPP when its dlopen failed.
            if io.raw_os_error() == Some(libc::EOPNOTSUPP) {
                Err("libibverbs.so.1 could not be loaded".into())
            } else if io.raw_os_error() == Some(libc::ENOSYS) {
                Err("libibverbs is installed but the kernel has no RDMA support (ENOSYS)".into())
            } else {
                Err(format!("ibv_get_device_list failed: {io}"))
            }
        }
    }
}

/// One opened NIC port.
pub struct Nic {
    pub name: String,
    ctx: Arc<DeviceContext>,
    pd: Arc<ProtectionDomain>,
    port: u8,
    gid_index: u32,
    gid: [u8; 16],
    lid: u16,
    mtu: u8,
    link_layer: u8,
    /// The device's READ caps: (`max_qp_rd_atom`, `max_qp_init_rd_atom`).
    rd_atom: (i32, i32),
}

impl Nic {
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
    fn addr(&self) -> NicAddr {
        NicAddr {
            gid: self.gid,
            lid: self.lid,
            port: self.port,
            mtu: self.mtu,
            link_layer: self.link_layer,
        }
    }
}

/// One peer's data queue pairs (`i` on NIC `i % cqs.len()`).
pub struct DataQps {
    qps: Vec<ExtendedQueuePair>,
    /// WRITEs up to this many bytes go inline (0: the NICs took none).
    inline_max: u32,
    /// The shard's shared completion queue on each NIC used.
    cqs: Vec<Arc<SharedCq>>,
    psns: Vec<u32>,
    // Reused plan buffers: posting allocates nothing once warm.
    pieces: Vec<Piece>,
    wrs: Vec<Piece>,
    signaled: Vec<bool>,
    posts: Vec<Post>,
}

/// One local slice and the remote window of a one-sided op, with the
/// keys of every NIC on both sides (a WR on queue pair `i` uses key
/// `i % n` of each).
pub struct Sge {
    pub lkeys: NicKeys,
    pub laddr: u64,
    pub rkeys: NicKeys,
    pub raddr: u64,
    /// The local memory is host memory (the CPU may read it: inline).
    pub host: bool,
}

/// sideway's `Drop` for queue pairs asserts that the destroy call
/// succeeded: a NIC that refuses one (a driver bug, a device gone) would
/// panic the shard that drops a connection's link. Each is dropped on its
/// own here, a refusal logged and its resources left to the process's
/// exit, and the shard goes on. (The shared completion queues live as long
/// as the endpoint's NICs.)
impl Drop for DataQps {
    fn drop(&mut self) {
        fn quietly<T>(what: &str, v: T) {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(v))).is_err() {
                tracing::error!(
                    "RDMA: destroying a {what} failed; it is left to the process's exit"
                );
            }
        }
        for qp in self.qps.drain(..) {
            quietly("queue pair", qp);
        }
    }
}

impl DataQps {
    /// INIT → RTR → RTS against the peer's queue pairs: ours `i` (on our
    /// NIC `i % ours`) to theirs `i` (on their NIC `i % theirs`).
    pub fn connect(&mut self, set: &NicSet, remote: &VerbsInfo, cfg: &VerbsConfig) -> Result<()> {
        if remote.qps.len() != self.qps.len() {
            return Err(verbs_err(
                "connecting queue pairs",
                format!(
                    "peer has {} data QPs, we have {}",
                    remote.qps.len(),
                    self.qps.len()
                ),
            ));
        }
        let used = self.cqs.len();
        for (i, qp) in self.qps.iter_mut().enumerate() {
            let nic = &set.nics[i % used];
            let peer = remote.nic_of(i);
            let grh = super::plan::address_plan(
                (nic.link_layer, nic.gid),
                (peer.link_layer, peer.gid, peer.lid),
            )
            .map_err(|e| verbs_err("connecting queue pairs", e))?;
            let mtu = Mtu::from(peer.mtu.min(nic.mtu) as u32);
            let (dest_rd, init_rd) = super::plan::read_depths(
                cfg.max_rd_atomic,
                nic.rd_atom.0,
                nic.rd_atom.1,
                remote.max_rd_atomic,
            );
            let (rqpn, rpsn) = remote.qps[i];
            let mut a = QueuePairAttribute::new();
            a.setup_state(QueuePairState::Init)
                .setup_pkey_index(0)
                .setup_port(nic.port)
                .setup_access_flags(
                    AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
                );
            qp.modify(&a).map_err(|e| verbs_err("QP to INIT", e))?;
            let mut ah = AddressHandleAttribute::new();
            ah.setup_port(nic.port)
                .setup_dest_lid(peer.lid)
                // Our own service level: the fabric's QoS is configured per
                // host, and a peer must not pick our lane.
                .setup_service_level(cfg.service_level);
            if grh {
                let gid = sideway::ibverbs::address::Gid { raw: peer.gid };
                // Our own traffic class (RoCE QoS: DSCP/ECN), flow label 0.
                ah.setup_grh(&gid, 0, nic.gid_index as u8, 64, cfg.traffic_class);
            }
            let mut a = QueuePairAttribute::new();
            a.setup_state(QueuePairState::ReadyToReceive)
                .setup_path_mtu(mtu)
                .setup_dest_qp_num(rqpn)
                .setup_rq_psn(rpsn)
                .setup_max_dest_read_atomic(dest_rd)
                .setup_min_rnr_timer(12)
                .setup_address_vector(&ah);
            qp.modify(&a).map_err(|e| verbs_err("QP to RTR", e))?;
            let mut a = QueuePairAttribute::new();
            a.setup_state(QueuePairState::ReadyToSend)
                .setup_sq_psn(self.psns[i])
                .setup_timeout(cfg.timeout)
                .setup_retry_cnt(cfg.retry_cnt)
                .setup_rnr_retry(7)
                .setup_max_read_atomic(init_rd);
            qp.modify(&a).map_err(|e| verbs_err("QP to RTS", e))?;
        }
        Ok(())
    }
}

/// The verbs side of one connection: its data QPs and what is in flight
/// on them. Lives in the shard that owns the connection.
pub(crate) struct Link {
    nic: Arc<NicSet>,
    /// NICs the peer's queue pairs are on.
    remote_nics: usize,
    qps: DataQps,
    cfg: VerbsConfig,
    chunk: u32,
    next_qp: usize,
    /// WRs posted and not yet retired, per QP (bounded by the QP depth).
    wr_out: Vec<u32>,
    /// Per op slot: completions still owed, and the first error seen. An op
    /// completes once (one `done` per slot) when its last one arrives.
    owed: plan::Owed,
    /// The parts of the op being built (reused).
    items: Vec<Sge>,
    /// Its index in its shard (`attach`), carried in every `wr_id` so that
    /// the shard routes completions of its shared queues here.
    id: u32,
    /// Set by the first error completion: the link is done.
    broken: Option<String>,
}

// SAFETY: the verbs objects are used by one shard at a time (they move with
// it); libibverbs handles are usable from any thread.
unsafe impl Send for Link {}

impl super::QpLink for Link {
    /// Can `n_pieces` more WRs go out without overrunning a send queue?
    fn has_room(&self, n_pieces: usize) -> bool {
        let per_qp = n_pieces.div_ceil(self.wr_out.len()) as u32 + 1;
        // The send queues, and the shared completion queues (at most one
        // completion per WR).
        self.wr_out.iter().all(|&o| o + per_qp <= self.cfg.qp_depth)
            && self.qps.cqs.iter().all(|c| {
                c.owed.load(std::sync::atomic::Ordering::Relaxed) as usize + n_pieces
                    <= c.cap as usize
            })
    }

    fn fits(&self, n_pieces: usize) -> bool {
        plan::fits_queues(n_pieces, self.wr_out.len(), self.cfg.qp_depth)
    }

    fn busy(&self) -> bool {
        !self.owed.is_empty()
    }

    /// WRs an op piece of `len` bytes becomes.
    fn pieces(&self, len: u64) -> usize {
        if len == 0 {
            1
        } else {
            len.div_ceil(self.chunk as u64) as usize
        }
    }

    /// The local registration's keys, registering `r` with the NICs on
    /// first use (the registration cache: one MR per NIC per registration,
    /// dropped with it).
    fn lkeys(&self, r: &crate::region::Region) -> Result<NicKeys> {
        super::keys_of(&self.nic, r).map(|(lkeys, _)| lkeys)
    }

    fn takes(&self, rkeys: &NicKeys) -> bool {
        rkeys.len() >= self.remote_nics
    }

    fn nic_events(&self) -> u64 {
        self.nic.poll_events()
    }

    fn broken(&self) -> Option<String> {
        let mut st = self
            .nic
            .events
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let used = self.qps.cqs.len();
        for k in 0..used {
            if st.down & (1 << k) != 0 {
                return Some(format!(
                    "the port of RDMA device {} is down (async event)",
                    self.nic.nics[k].name
                ));
            }
        }
        let mine: Vec<u32> = self.qps.qps.iter().map(|q| q.qp_number()).collect();
        if let Some(q) = mine.iter().find(|q| st.fatal_qps.contains(q)) {
            let why = format!("the NIC moved queue pair {q} to the error state (async event)");
            for q in &mine {
                st.fatal_qps.remove(q);
            }
            return Some(why);
        }
        None
    }

    /// Adds one part of an op (`len` bytes between `laddr` under `lkeys`
    /// and the peer's `raddr` under `rkeys`) to the op being built; `post`
    /// sends them all.
    fn add(&mut self, lkeys: NicKeys, local: &RegionSlice, rkeys: NicKeys, raddr: u64) {
        let (laddr, len) = (local.addr(), local.len() as u64);
        let host = !local.region().mem.is_device();
        let n_qps = self.wr_out.len();
        let item = self.items.len() as u32;
        let first = self.next_qp;
        self.next_qp = (first + self.pieces(len)) % n_qps;
        self.qps
            .pieces
            .extend(plan::stripe_item(item, len, self.chunk, n_qps, first));
        self.items.push(Sge {
            lkeys,
            laddr,
            rkeys,
            raddr,
            host,
        });
    }

    /// Forgets the parts gathered so far (the op failed before posting).
    fn discard(&mut self) {
        self.qps.pieces.clear();
        self.items.clear();
    }

    /// Posts the parts `add` gathered as op `slot`: all its WRs for one QP
    /// go as linked lists of at most `max_wr_per_post` (one doorbell each),
    /// so a vectored op rings each QP's doorbell once, not once per part.
    /// Returns the completions it will produce.
    fn post(&mut self, write: bool, slot: u32) -> Result<u32> {
        plan::batch(
            &self.qps.pieces,
            self.cfg.max_wr_per_post,
            self.cfg.signal_every,
            &mut self.qps.wrs,
            &mut self.qps.signaled,
            &mut self.qps.posts,
        );
        self.qps.pieces.clear();
        let mut signaled = 0u32;
        let mut retires = plan::retires(&self.qps.posts, &self.qps.signaled);
        let mut result = Ok(());
        for p in &self.qps.posts {
            let mut g = self.qps.qps[p.qp].start_post_send();
            let mut in_post = 0u32;
            for k in p.start..p.start + p.count {
                let w = self.qps.wrs[k];
                let it = &self.items[w.item as usize];
                let n = retires.next().expect("one per WR");
                let id = plan::wr_id(slot, self.id, p.qp, n);
                let flags = if self.qps.signaled[k] {
                    in_post += 1;
                    WorkRequestFlags::Signaled
                } else {
                    WorkRequestFlags::none()
                };
                let h = g.construct_wr(id, flags);
                // Queue pair p is on our NIC p % ours and their NIC
                // p % theirs: each side's key of that NIC.
                let (lkey, rkey) = (it.lkeys.for_qp(p.qp), it.rkeys.for_qp(p.qp));
                if write && it.host && w.len > 0 && w.len <= self.qps.inline_max {
                    // Small host-memory WRITEs go inline: the NIC takes the
                    // bytes with the WR (no DMA read of our memory, no
                    // lkey), which is most of an 8-byte op's latency.
                    let mut buf = [0u8; INLINE_MAX as usize];
                    let n = w.len as usize;
                    // SAFETY: the range lies in a live host registration
                    // the op holds; n <= INLINE_MAX bytes are copied.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            (it.laddr + w.off) as *const u8,
                            buf.as_mut_ptr(),
                            n,
                        )
                    };
                    h.setup_write(rkey, it.raddr + w.off)
                        .setup_inline_data(&buf[..n]);
                } else {
                    let h = if write {
                        h.setup_write(rkey, it.raddr + w.off)
                    } else {
                        h.setup_read(rkey, it.raddr + w.off)
                    };
                    // SAFETY: the local range lies in a registration the op
                    // holds (its OpCmd) until its completions arrive.
                    unsafe { h.setup_sge(lkey, it.laddr + w.off, w.len) };
                }
            }
            if let Err(e) = g.post() {
                // Nothing of this list went out; earlier lists did, and
                // their completions still arrive.
                result = Err(verbs_err("ibv_wr_complete (post)", e));
                break;
            }
            signaled += in_post;
            self.wr_out[p.qp] += p.count as u32;
            self.qps.cqs[p.qp % self.qps.cqs.len()]
                .owed
                .fetch_add(in_post, std::sync::atomic::Ordering::Relaxed);
        }
        self.items.clear();
        if signaled > 0 {
            self.owed.entry(slot).or_insert((0, None)).0 += signaled;
        }
        result.map(|()| signaled)
    }

    /// Records a failure of op `slot` found while posting; the op completes
    /// with it (now, if nothing of it is in flight).
    fn fail_slot(&mut self, slot: u32, err: Error, done: &mut Vec<(u32, Result<()>)>) {
        match self.owed.get_mut(&slot) {
            Some((n, e)) if *n > 0 => {
                e.get_or_insert(err);
            }
            _ => {
                self.owed.remove(&slot);
                done.push((slot, Err(err)));
            }
        }
    }

    /// Reports completions to `done`. `Err` (with the reason) after any
    /// error completion: the QPs are in the error state and every later WR
    /// would be flushed; the caller fails the link (`fail_all`), which
    /// ends every op still owed once.
    fn poll(&mut self, _done: &mut Vec<(u32, Result<()>)>) -> std::result::Result<usize, String> {
        match &self.broken {
            Some(reason) => Err(reason.clone()),
            None => Ok(0),
        }
    }

    fn attach(&mut self, id: u32) {
        self.id = id;
    }

    fn shared_cqs(&self) -> Vec<Arc<dyn super::CqPoll>> {
        self.qps
            .cqs
            .iter()
            .map(|c| c.clone() as Arc<dyn super::CqPoll>)
            .collect()
    }

    /// One completion the shard routed here (its `wr_id` names this link).
    fn on_wc(
        &mut self,
        id: u64,
        outcome: WcOutcome,
        name: &'static str,
        done: &mut Vec<(u32, Result<()>)>,
    ) {
        let (slot, _, qp, retires) = plan::split_wr_id(id);
        if let Some(o) = self.wr_out.get_mut(qp) {
            *o = o.saturating_sub(retires);
        }
        let r = match outcome {
            WcOutcome::Ok => Ok(()),
            WcOutcome::RemoteRefused => Err(Error::Verbs {
                what: "RDMA operation",
                reason: format!(
                    "{name}: the target's NIC refused it (unknown key, outside the registration, or not permitted)"
                ),
            }),
            WcOutcome::ConnBroken => Err(Error::Verbs {
                what: "RDMA operation",
                reason: name.to_owned(),
            }),
        };
        // Any error completion leaves an RC queue pair in error: the
        // link is done, and its ops end through `fail_all`.
        if r.is_err() {
            self.broken
                .get_or_insert_with(|| format!("RDMA completion {name}"));
        }
        plan::settle(&mut self.owed, slot, r, done);
    }

    /// The link is going away: every completion still owed fails with `err`.
    fn fail_all(&mut self, err: &Error, done: &mut Vec<(u32, Result<()>)>) {
        plan::fail_owed(&mut self.owed, err, done);
    }
}

/// Sets up this connection's verbs link over its first control stream:
/// both sides send their QP info (or a refusal), then read the other's,
/// then connect (INIT → RTR → RTS), then say whether that worked
/// (`VerbsReady`) and read the other's answer. Verbs is used only when both
/// are ready: neither side posts before the other is at RTR, and a side
/// whose setup failed never leaves the other on verbs. Any failure leaves
/// the connection on tcp (`None`) on both sides.
pub(crate) fn exchange(
    nic: &Arc<NicSet>,
    cfg: &VerbsConfig,
    chunk: u32,
    shard: usize,
    send: impl Fn(&crate::wire::ControlFrame) -> Result<()>,
    recv: impl Fn() -> Result<crate::wire::ControlFrame>,
) -> Result<Option<Link>> {
    use crate::wire::ControlFrame;
    let mine = nic.data_qps(cfg, shard);
    let frame = match &mine {
        Ok(q) => ControlFrame::Verbs(Some(nic.info(q, cfg))),
        Err(e) => {
            tracing::warn!("RDMA queue pairs could not be created, using tcp: {e}");
            ControlFrame::Verbs(None)
        }
    };
    send(&frame)?;
    let theirs = match recv()? {
        ControlFrame::Verbs(Some(v)) => v,
        ControlFrame::Verbs(None) => return Ok(None),
        other => {
            return Err(verbs_err(
                "the verbs exchange",
                format!("expected the peer's QP info, got {other:?}"),
            ))
        }
    };
    // We sent a refusal: both know verbs is off, no more frames.
    let Ok(mut qps) = mine else { return Ok(None) };
    // Both sent their info, so both wait for each other's answer.
    let connected = qps.connect(nic, &theirs, cfg).map(|()| qps);
    if let Err(e) = &connected {
        tracing::warn!("RDMA queue pairs did not connect, using tcp: {e}");
    }
    send(&ControlFrame::VerbsReady(connected.is_ok()))?;
    let peer_ready = match recv()? {
        ControlFrame::VerbsReady(r) => r,
        other => {
            return Err(verbs_err(
                "the verbs exchange",
                format!("expected the peer's ready answer, got {other:?}"),
            ))
        }
    };
    let Ok(qps) = connected else { return Ok(None) };
    if !peer_ready {
        tracing::warn!("the peer's RDMA queue pairs did not connect; using tcp");
        return Ok(None);
    }
    let n = qps.qps.len();
    Ok(Some(Link {
        nic: nic.clone(),
        remote_nics: theirs.nics.len(),
        qps,
        cfg: cfg.clone(),
        chunk,
        next_qp: 0,
        wr_out: vec![0; n],
        owed: Default::default(),
        items: Vec::new(),
        id: 0,
        broken: None,
    }))
}

//! The RDMA verbs path (feature `rdma`), the seed's default between hosts.
//!
//! * `nic`: which NIC, by PCIe distance to the endpoint's GPU (sysfs), or
//!   `FERRY_RDMA_DEV`;
//! * `plan`: chunking, striping over data QPs, doorbell batches with
//!   selective signalling, completion status mapping;
//! * `device` (with `rdma`): the NICs, PDs, MRs (host; GPU via dma-buf), shared
//!   CQs and NIC events; `link`: a connection's RC
//!   QPs connected from the peer's `wire::VerbsInfo`, posting and polling.
//!
//! `status()` says whether verbs can be used here and, if not, why; the
//! endpoint logs it and `ferry info` prints it. Connections use tcp
//! whenever verbs is off.

use crate::error::PathOff;

pub mod nic;
#[doc(hidden)]
pub mod plan;

#[cfg(feature = "rdma")]
pub mod device;
#[cfg(feature = "rdma")]
pub(crate) mod link;

/// The endpoint's opened NICs (none in a build without `rdma`).
#[cfg(feature = "rdma")]
pub(crate) type NicHandle = std::sync::Arc<device::NicSet>;
#[cfg(not(feature = "rdma"))]
pub(crate) type NicHandle = std::convert::Infallible;

/// A registration's memory regions, one per NIC of the endpoint (the
/// registration cache: one of these per `Region`, hung on its
/// `nic_attach` when it is made, dropped with it), and their keys, read
/// once: ops copy them, allocating nothing.
#[cfg(feature = "rdma")]
pub(crate) struct NicMrs {
    _mrs: Vec<std::sync::Arc<sideway::ibverbs::memory_region::MemoryRegion>>,
    lkeys: crate::wire::NicKeys,
    rkeys: crate::wire::NicKeys,
}

#[cfg(feature = "rdma")]
impl NicMrs {
    fn new(mrs: Vec<std::sync::Arc<sideway::ibverbs::memory_region::MemoryRegion>>) -> NicMrs {
        let keys = |f: fn(&sideway::ibverbs::memory_region::MemoryRegion) -> u32| {
            let mut k = [0u32; crate::wire::MAX_NICS];
            for (slot, m) in k.iter_mut().zip(&mrs) {
                *slot = f(m);
            }
            crate::wire::NicKeys::new(&k[..mrs.len()]).expect("1..=MAX_NICS NICs")
        };
        let (lkeys, rkeys) = (keys(|m| m.lkey()), keys(|m| m.rkey()));
        NicMrs {
            _mrs: mrs,
            lkeys,
            rkeys,
        }
    }
}

/// A connection's RDMA queue pairs as the shard drives them: the one seam
/// between builds with and without verbs. Only the `rdma` build implements
/// it (`link::Link`); elsewhere no value of it can exist, and the shard's
/// `Option<Link>` is always `None`.
pub(crate) trait QpLink: Send {
    /// Can `n_pieces` more work requests go out without overrunning a
    /// send queue?
    fn has_room(&self, n_pieces: usize) -> bool;
    /// Could `n_pieces` work requests ever go out (into empty queues)?
    fn fits(&self, n_pieces: usize) -> bool;
    /// Completions are outstanding (the shard must keep polling).
    fn busy(&self) -> bool;
    /// Work requests an op part of `len` bytes becomes.
    fn pieces(&self, len: u64) -> usize;
    /// The local registration's keys (one per NIC), registering it with
    /// the NICs on first use.
    fn lkeys(&self, r: &crate::region::Region) -> crate::error::Result<crate::wire::NicKeys>;
    /// Whether a window's keys reach every NIC the peer's queue pairs use.
    fn takes(&self, rkeys: &crate::wire::NicKeys) -> bool;
    /// Drains the NICs' asynchronous events when due (every link of an
    /// endpoint shares them); the epoch moves when one may have broken a
    /// link.
    fn nic_events(&self) -> u64;
    /// Why an asynchronous event broke this link (its port went down, the
    /// NIC moved one of its queue pairs to error), if one did.
    fn broken(&self) -> Option<crate::error::ConnFault>;
    /// Adds one part of the op being built: `local` (registered under
    /// `lkeys`; small WRITEs from host memory may go inline, read by the
    /// CPU at post time) to or from the peer's `raddr` under `rkeys`. The
    /// caller keeps `local`'s region alive until the op's completions are
    /// reaped (the NIC reads or writes it until then).
    fn add(
        &mut self,
        lkeys: crate::wire::NicKeys,
        local: &crate::region::RegionSlice,
        rkeys: crate::wire::NicKeys,
        raddr: u64,
    );
    /// Drops the parts gathered so far (posting none).
    fn discard(&mut self);
    /// Posts the gathered parts as op `slot`; all or nothing.
    fn post(&mut self, write: bool, slot: u32) -> crate::error::Result<u32>;
    /// Ends op `slot` with `err` (once).
    fn fail_slot(
        &mut self,
        slot: u32,
        err: crate::error::Error,
        done: &mut Vec<(u32, crate::error::Result<()>)>,
    );
    /// `Err` once a completion (or an event) said the queue pairs are
    /// dead. Completions themselves arrive through the shard's shared
    /// queues (`shared_cqs`, `on_wc`).
    fn poll(
        &mut self,
        done: &mut Vec<(u32, crate::error::Result<()>)>,
    ) -> Result<usize, crate::error::ConnFault>;
    /// Its index in its shard, carried in its `wr_id`s.
    fn attach(&mut self, id: u32);
    /// The completion queues it posts to (shared by the shard's links).
    fn shared_cqs(&self) -> Vec<std::sync::Arc<dyn CqPoll>>;
    /// One completion of its (from a shared queue).
    fn on_wc(
        &mut self,
        wr_id: u64,
        outcome: plan::WcOutcome,
        name: &'static str,
        done: &mut Vec<(u32, crate::error::Result<()>)>,
    );
    /// Fails every op in flight.
    fn fail_all(
        &mut self,
        err: &crate::error::Error,
        done: &mut Vec<(u32, crate::error::Result<()>)>,
    );
}

/// What a connection holds for its queue pairs.
pub(crate) type DynLink = dyn QpLink;

/// A completion queue a shard polls once per pass for all its links:
/// hands each completion's (`wr_id`, outcome, status name) to `out`.
pub(crate) trait CqPoll: Send + Sync {
    fn poll(
        &self,
        out: &mut dyn FnMut(u64, plan::WcOutcome, &'static str),
    ) -> Result<usize, crate::error::ConnFault>;
}

/// Opens the NICs to use (up to `cfg.max_nics`, best first), or says why
/// verbs is off. Returns every usable NIC's name, the opened ones first.
pub(crate) fn open_nic(
    gpu_bdf: Option<&str>,
    wanted: Option<&str>,
    cfg: &VerbsConfig,
) -> Result<(Vec<String>, Option<NicHandle>), PathOff> {
    let nics = status(gpu_bdf, wanted)?;
    #[cfg(feature = "rdma")]
    {
        // The best NICs that open: one that fails (a VF without
        // resources, a port gone) is skipped, and the reasons are kept.
        // libibverbs forks safely only when told so before the first
        // device opens (registrations are then kept out of children).
        device::fork_init();
        let mut why = Vec::new();
        let mut opened = Vec::new();
        for name in &nics {
            if opened.len() >= cfg.max_nics.clamp(1, crate::wire::MAX_NICS) {
                break;
            }
            match device::Nic::open(name, cfg) {
                Ok(nic) => opened.push(nic),
                Err(e) => why.push(format!("{name}: {e}")),
            }
        }
        if opened.is_empty() {
            return Err(PathOff::from(format!(
                "no RDMA device could be opened: {}",
                why.join("; ")
            )));
        }
        if !why.is_empty() {
            tracing::warn!("RDMA: skipped {}", why.join("; "));
        }
        let mut order: Vec<String> = opened.iter().map(|n| n.name.clone()).collect();
        let rest: Vec<String> = nics.into_iter().filter(|n| !order.contains(n)).collect();
        order.extend(rest);
        Ok((
            order,
            Some(std::sync::Arc::new(device::NicSet::new(opened))),
        ))
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = cfg;
        Ok((nics, None))
    }
}

/// `r`'s keys on the endpoint's NICs, (lkeys, rkeys): registered on first
/// use (host memory with `ibv_reg_mr`, GPU memory through a dma-buf of its
/// allocation), then read from the region's attachment. A refusal by any
/// NIC is remembered on the region: its ops then go over tcp, and
/// registration is not tried again.
#[cfg(feature = "rdma")]
pub(crate) fn keys_of(
    set: &device::NicSet,
    r: &crate::region::Region,
) -> crate::error::Result<(crate::wire::NicKeys, crate::wire::NicKeys)> {
    let attached = |a: &std::sync::Arc<dyn std::any::Any + Send + Sync>| {
        if let Some(m) = a.downcast_ref::<NicMrs>() {
            return Ok((m.lkeys, m.rkeys));
        }
        // It failed before (RLIMIT_MEMLOCK, no dma-buf, …): not retried on
        // every op; the region's ops go over tcp.
        let reason = a.downcast_ref::<NicRegFailed>().map_or_else(
            || format!("region {:#x} carries an unknown NIC attachment", r.addr()),
            |f| f.0.clone(),
        );
        Err(crate::error::Error::Unsupported {
            what: "RDMA registration",
            reason,
        })
    };
    if let Some(a) = r.nic_attach.get() {
        return attached(a);
    }
    let all: crate::error::Result<Vec<_>> =
        set.nics.iter().map(|nic| register_now(nic, r)).collect();
    let attach: std::sync::Arc<dyn std::any::Any + Send + Sync> = match all {
        Ok(mrs) => std::sync::Arc::new(NicMrs::new(mrs)),
        Err(e) => std::sync::Arc::new(NicRegFailed(e.to_string())),
    };
    attached(r.nic_attach.get_or_init(|| attach))
}

/// A registration the NIC refused, remembered on the region.
#[cfg(feature = "rdma")]
struct NicRegFailed(String);

#[cfg(feature = "rdma")]
fn register_now(
    nic: &device::Nic,
    r: &crate::region::Region,
) -> crate::error::Result<std::sync::Arc<sideway::ibverbs::memory_region::MemoryRegion>> {
    Ok(match r.mem {
        crate::gpu::MemKind::Device {
            ordinal,
            alloc_base,
            alloc_len,
        } => {
            // SAFETY: sysconf has no preconditions.
            let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
            let (base, len, off) = plan::dmabuf_span(alloc_base, alloc_len as u64, r.addr(), page);
            let via_dmabuf =
                crate::gpu::memory::dmabuf_fd(ordinal, base, len as usize).and_then(|fd| {
                    // SAFETY: the fd is a dma-buf of the allocation holding
                    // the region, which outlives the MR (dropped with the
                    // Region).
                    let mr = unsafe { nic.reg_dmabuf(fd, off, r.addr(), r.len(), r.access) };
                    // SAFETY: our fd; the MR holds its own reference to it.
                    unsafe { libc::close(fd) };
                    mr
                });
            match via_dmabuf {
                Ok(mr) => mr,
                // No dma-buf (an older driver, a NIC without it): the
                // device pointer itself, which nvidia-peermem pins.
                // SAFETY: the region's memory outlives the MR.
                Err(e) => unsafe { nic.reg_host(r.addr(), r.len(), r.access) }.map_err(|e2| {
                    crate::error::Error::Verbs {
                        what: "registering GPU memory with the NIC",
                        reason: format!("dma-buf: {e}; ibv_reg_mr on the device pointer: {e2}"),
                    }
                })?,
            }
        }
        // SAFETY: the region's memory outlives the MR (dropped with it).
        _ => unsafe { nic.reg_host(r.addr(), r.len(), r.access)? },
    })
}

/// The NIC rkeys of `r` for a `RemoteBuf` (one per NIC), registering it if
/// needed; `None` without a NIC (or when registration fails: the window
/// then works over tcp only, which the log says).
pub(crate) fn remote_keys(
    nic: Option<&NicHandle>,
    r: &crate::region::Region,
) -> Option<crate::wire::NicKeys> {
    #[cfg(feature = "rdma")]
    {
        let set = nic?;
        match keys_of(set, r) {
            Ok((_, rkeys)) => Some(rkeys),
            Err(e) => {
                tracing::warn!("RDMA registration of {:#x} failed; tcp only: {e}", r.addr());
                None
            }
        }
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = (nic, r);
        None
    }
}

/// Where libibverbs reads sysfs: `ibv_get_sysfs_path()` (rdma-core
/// answers `$SYSFS_PATH` or `/sys`; a software NIC answers its own tree),
/// `/sys` when libibverbs is absent. NIC choice and GID choice read the
/// same tree libibverbs does.
pub fn sysfs_root() -> std::path::PathBuf {
    #[cfg(feature = "rdma")]
    {
        // SAFETY: no arguments; the answer is NULL (rdma-mummy-sys without
        // libibverbs) or a NUL-terminated string that libibverbs keeps for
        // the process's lifetime.
        let p = unsafe { rdma_mummy_sys::ibv_get_sysfs_path() };
        if !p.is_null() {
            // SAFETY: checked non-NULL above; NUL-terminated by contract.
            let s = unsafe { std::ffi::CStr::from_ptr(p) };
            let s = s.to_string_lossy();
            if !s.is_empty() {
                return std::path::PathBuf::from(s.into_owned());
            }
        }
    }
    std::path::PathBuf::from("/sys")
}

/// Verbs settings (`FERRY_RDMA_*`).
#[derive(Debug, Clone)]
pub struct VerbsConfig {
    /// The NIC port (1 on every NIC we drive).
    pub port: u8,
    /// `FERRY_RDMA_GID_INDEX`; `None`: `nic::best_gid` picks one.
    pub gid_index: Option<u32>,
    /// `FERRY_RDMA_QPS`: data queue pairs per connection.
    pub n_qps: usize,
    /// `FERRY_RDMA_MAX_NICS`: NICs opened and striped over (1..=4).
    pub max_nics: usize,
    /// `FERRY_RDMA_QP_DEPTH`: work requests each data queue pair holds.
    pub qp_depth: u32,
    /// `FERRY_RDMA_SL`: the queue pairs' service level.
    pub service_level: u8,
    /// `FERRY_RDMA_TC`: the queue pairs' traffic class.
    pub traffic_class: u8,
    /// `FERRY_RDMA_MAX_RD_ATOMIC`: outstanding RDMA READs per QP.
    pub max_rd_atomic: u8,
    /// The QP's local ACK timeout exponent (4.096 µs × 2^timeout).
    pub timeout: u8,
    /// Retransmissions before a QP errors.
    pub retry_cnt: u8,
    /// Work requests chained into one post (one doorbell).
    pub max_wr_per_post: usize,
    /// Every this many work requests one is signalled (completes in the CQ).
    pub signal_every: usize,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        Self {
            port: 1,
            gid_index: None,
            n_qps: 4,
            max_nics: 4,
            qp_depth: 256,
            service_level: 0,
            traffic_class: 0,
            max_rd_atomic: 16,
            timeout: 14,
            retry_cnt: 7,
            max_wr_per_post: 32,
            signal_every: 16,
        }
    }
}

/// The NICs verbs would use here, best first, or why verbs is off.
pub fn status(gpu_bdf: Option<&str>, wanted: Option<&str>) -> Result<Vec<String>, PathOff> {
    #[cfg(not(feature = "rdma"))]
    {
        let _ = (gpu_bdf, wanted);
        Err("this build has no RDMA verbs path (built without the `rdma` feature)".into())
    }
    #[cfg(feature = "rdma")]
    {
        let names = device::device_names()?;
        let chosen = nic::choose(&sysfs_root(), gpu_bdf, wanted)?;
        let usable: Vec<String> = chosen
            .into_iter()
            .map(|n| n.name)
            .filter(|n| names.contains(n))
            .collect();
        if usable.is_empty() {
            return Err(PathOff::from(format!(
                "sysfs and libibverbs disagree: libibverbs lists {}",
                names.join(", ")
            )));
        }
        Ok(usable)
    }
}

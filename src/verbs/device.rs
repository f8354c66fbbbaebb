//! The verbs objects of one endpoint (feature `rdma`): the opened NIC, its
//! protection domain, memory registrations, and per peer a set of RC data
//! queue pairs sharing one completion queue, connected from the peer's
//! `VerbsInfo` (INIT → RTR → RTS) and driven by `plan`: striped WRs posted
//! as linked lists (one doorbell per post), completions polled, never
//! waited for.
//!
//! This layer has not run against a NIC: the machines this project has
//! carry none (see the issue notes). It is compiled and clippy-checked in
//! CI, and its inputs (NIC choice, plans, the exchanged info) are tested.

use std::sync::Arc;

use sideway::ibverbs::address::AddressHandleAttribute;
use sideway::ibverbs::completion::GenericCompletionQueue;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::plan::{self, Piece, Post, WcOutcome};
use super::VerbsConfig;
use crate::error::{Error, Result};
use crate::wire::{VerbsInfo, LINK_ETHERNET, LINK_INFINIBAND};

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
        let gid = ctx
            .query_gid(port, cfg.gid_index)
            .map_err(|e| verbs_err("ibv_query_gid", e))?;
        let g = gid.raw;
        let link_layer = match pa.link_layer() {
            LinkLayer::InfiniBand => LINK_INFINIBAND,
            _ => LINK_ETHERNET,
        };
        let pd = ctx.alloc_pd().map_err(|e| verbs_err("ibv_alloc_pd", e))?;
        Ok(Nic {
            name: name.to_owned(),
            pd,
            port,
            gid_index: cfg.gid_index,
            gid: g,
            lid: pa.lid(),
            mtu: pa.active_mtu() as u8,
            link_layer,
            ctx,
        })
    }

    /// Registers `[ptr, ptr + len)` of host memory for local and remote
    /// access.
    ///
    /// # Safety
    /// The memory must stay valid until the returned region is dropped.
    pub unsafe fn reg_host(&self, ptr: u64, len: usize) -> Result<Arc<MemoryRegion>> {
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead;
        // SAFETY: the caller's contract.
        unsafe { self.pd.reg_mr(ptr as usize, len, access) }.map_err(|e| verbs_err("ibv_reg_mr", e))
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
    ) -> Result<Arc<MemoryRegion>> {
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead;
        // SAFETY: the caller's contract.
        unsafe { self.pd.reg_dmabuf_mr(offset, len, iova, fd, access) }
            .map_err(|e| verbs_err("ibv_reg_dmabuf_mr", e))
    }

    /// Creates `n` RC queue pairs on one completion queue.
    pub fn data_qps(&self, cfg: &VerbsConfig) -> Result<DataQps> {
        let depth = cfg.qp_depth;
        let cq = self
            .ctx
            .create_cq_builder()
            .setup_cqe(depth * cfg.n_qps as u32)
            .build_ex()
            .map_err(|e| verbs_err("ibv_create_cq_ex", e))?;
        let cq = GenericCompletionQueue::from(cq);
        let mut qps = Vec::with_capacity(cfg.n_qps);
        for _ in 0..cfg.n_qps {
            let qp = self
                .pd
                .create_qp_builder()
                .setup_max_send_wr(depth)
                .setup_max_recv_wr(1)
                .setup_max_send_sge(1)
                .setup_send_cq(cq.clone())
                .setup_recv_cq(cq.clone())
                .build_ex()
                .map_err(|e| verbs_err("ibv_create_qp_ex", e))?;
            qps.push(qp);
        }
        let psns = qps
            .iter()
            .map(|_| crate::endpoint::random_u32() & 0xff_ffff)
            .collect();
        Ok(DataQps {
            qps,
            cq,
            psns,
            pieces: Vec::new(),
            wrs: Vec::new(),
            signaled: Vec::new(),
            posts: Vec::new(),
        })
    }

    /// What the peer needs to connect to `qps`.
    pub fn info(&self, qps: &DataQps, cfg: &VerbsConfig) -> VerbsInfo {
        VerbsInfo {
            gid: self.gid,
            lid: self.lid,
            port: self.port,
            mtu: self.mtu,
            link_layer: self.link_layer,
            sl: cfg.service_level,
            traffic_class: cfg.traffic_class,
            max_rd_atomic: cfg.max_rd_atomic,
            qps: qps
                .qps
                .iter()
                .zip(&qps.psns)
                .map(|(q, &psn)| (q.qp_number(), psn))
                .collect(),
        }
    }
}

/// One peer's data queue pairs.
pub struct DataQps {
    qps: Vec<ExtendedQueuePair>,
    cq: GenericCompletionQueue,
    psns: Vec<u32>,
    // Reused plan buffers: posting allocates nothing once warm.
    pieces: Vec<Piece>,
    wrs: Vec<Piece>,
    signaled: Vec<bool>,
    posts: Vec<Post>,
}

/// One local slice and the remote window of a one-sided op.
pub struct Sge {
    pub lkey: u32,
    pub laddr: u64,
    pub rkey: u32,
    pub raddr: u64,
}

impl DataQps {
    /// INIT → RTR → RTS against the peer's queue pairs.
    pub fn connect(&mut self, nic: &Nic, remote: &VerbsInfo, cfg: &VerbsConfig) -> Result<()> {
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
        let mtu = Mtu::from(remote.mtu.min(nic.mtu) as u32);
        for (i, qp) in self.qps.iter_mut().enumerate() {
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
                .setup_dest_lid(remote.lid)
                .setup_service_level(remote.sl);
            if remote.link_layer == LINK_ETHERNET || remote.gid != [0u8; 16] {
                let gid = sideway::ibverbs::address::Gid { raw: remote.gid };
                ah.setup_grh_dest_gid(&gid)
                    .setup_grh_src_gid_index(nic.gid_index as u8)
                    .setup_grh_hop_limit(64);
            }
            let mut a = QueuePairAttribute::new();
            a.setup_state(QueuePairState::ReadyToReceive)
                .setup_path_mtu(mtu)
                .setup_dest_qp_num(rqpn)
                .setup_rq_psn(rpsn)
                .setup_max_dest_read_atomic(cfg.max_rd_atomic)
                .setup_min_rnr_timer(12)
                .setup_address_vector(&ah);
            qp.modify(&a).map_err(|e| verbs_err("QP to RTR", e))?;
            let mut a = QueuePairAttribute::new();
            a.setup_state(QueuePairState::ReadyToSend)
                .setup_sq_psn(self.psns[i])
                .setup_timeout(cfg.timeout)
                .setup_retry_cnt(cfg.retry_cnt)
                .setup_rnr_retry(7)
                .setup_max_read_atomic(cfg.max_rd_atomic);
            qp.modify(&a).map_err(|e| verbs_err("QP to RTS", e))?;
        }
        Ok(())
    }

    /// Posts one op: `len` bytes striped in `chunk`-byte WRs over the QPs
    /// starting at `first_qp`, one linked list per QP (one doorbell each).
    /// Every WR carries `wr_id`; signalled ones produce completions.
    /// Returns how many completions the op will produce.
    #[allow(clippy::too_many_arguments)]
    pub fn post(
        &mut self,
        write: bool,
        sge: &Sge,
        len: u64,
        chunk: u32,
        first_qp: usize,
        wr_id: u64,
        cfg: &VerbsConfig,
    ) -> Result<usize> {
        self.pieces.clear();
        self.pieces
            .extend(plan::stripe(len, chunk, self.qps.len(), first_qp));
        plan::batch(
            &self.pieces,
            cfg.max_wr_per_post,
            cfg.signal_every,
            &mut self.wrs,
            &mut self.signaled,
            &mut self.posts,
        );
        let mut signaled = 0;
        for p in &self.posts {
            let mut g = self.qps[p.qp].start_post_send();
            for k in p.start..p.start + p.count {
                let w = self.wrs[k];
                let flags = if self.signaled[k] {
                    signaled += 1;
                    WorkRequestFlags::Signaled
                } else {
                    WorkRequestFlags::none()
                };
                let h = g.construct_wr(wr_id, flags);
                let h = if write {
                    h.setup_write(sge.rkey, sge.raddr + w.off)
                } else {
                    h.setup_read(sge.rkey, sge.raddr + w.off)
                };
                // SAFETY: the local range lies in a registration the op
                // holds until its completions arrive.
                unsafe { h.setup_sge(sge.lkey, sge.laddr + w.off, w.len) };
            }
            g.post()
                .map_err(|e| verbs_err("ibv_wr_complete (post)", e))?;
        }
        Ok(signaled)
    }

    /// Hands each completion's (wr_id, outcome, status name) to `out`;
    /// returns how many there were. Never blocks.
    pub fn poll(&self, mut out: impl FnMut(u64, WcOutcome, &'static str)) -> usize {
        let Ok(poller) = self.cq.start_poll() else {
            return 0;
        };
        let mut n = 0;
        for wc in poller {
            let st = wc.status();
            out(wc.wr_id(), plan::wc_outcome(st), plan::wc_status_name(st));
            n += 1;
        }
        n
    }
}

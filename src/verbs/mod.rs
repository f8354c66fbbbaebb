//! The RDMA verbs path (feature `rdma`), the seed's default between hosts.
//!
//! * `nic`: which NIC, by PCIe distance to the endpoint's GPU (sysfs), or
//!   `FERRY_RDMA_DEV`;
//! * `plan`: chunking, striping over data QPs, doorbell batches with
//!   selective signalling, completion status mapping;
//! * `device` (with `rdma`): the NIC, PD, MRs (host; GPU via dma-buf), RC
//!   QPs connected from the peer's `wire::VerbsInfo`, posting and polling.
//!
//! `status()` says whether verbs can be used here and, if not, why; the
//! endpoint logs it and `ferry info` prints it. Connections use tcp
//! whenever verbs is off.

pub mod nic;
pub mod plan;

#[cfg(feature = "rdma")]
pub mod device;

/// Verbs settings (`FERRY_RDMA_*`).
#[derive(Debug, Clone)]
pub struct VerbsConfig {
    pub port: u8,
    /// `FERRY_RDMA_GID_INDEX` (RoCE v2 GIDs usually sit at 1 or 3).
    pub gid_index: u32,
    pub n_qps: usize,
    pub qp_depth: u32,
    pub service_level: u8,
    pub traffic_class: u8,
    /// `FERRY_RDMA_MAX_RD_ATOMIC`: outstanding RDMA READs per QP.
    pub max_rd_atomic: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub max_wr_per_post: usize,
    pub signal_every: usize,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        Self {
            port: 1,
            gid_index: 0,
            n_qps: 4,
            qp_depth: 1024,
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
pub fn status(gpu_bdf: Option<&str>) -> Result<Vec<String>, String> {
    #[cfg(not(feature = "rdma"))]
    {
        let _ = gpu_bdf;
        Err("this build has no RDMA verbs path (built without the `rdma` feature)".into())
    }
    #[cfg(feature = "rdma")]
    {
        let names = device::device_names()?;
        let wanted = std::env::var("FERRY_RDMA_DEV").ok();
        let chosen = nic::choose(std::path::Path::new("/sys"), gpu_bdf, wanted.as_deref())?;
        let usable: Vec<String> = chosen
            .into_iter()
            .map(|n| n.name)
            .filter(|n| names.contains(n))
            .collect();
        if usable.is_empty() {
            return Err(format!(
                "sysfs and libibverbs disagree: libibverbs lists {}",
                names.join(", ")
            ));
        }
        Ok(usable)
    }
}

//! Starting an endpoint: each layer sets up its part — the control path's
//! listener and gate, the same-host side (accept ring, fd passing,
//! doorbells), the NIC, the shards — and `start` puts them together.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::{info, warn};

use super::{
    Config, Endpoint, Inner, Mode, PeerSlot, Transport, ACCEPT_BATCH, FIRST_BYTES_TIMEOUT,
    MAX_HANDSHAKES_PER_ADDR, MAX_PENDING_HANDSHAKES,
};
use crate::error::{Error, PathOff, Result};
use crate::oob;
use crate::oob::gate::{Gate, GateLimits};
use crate::reactor::completion::CompletionTable;
use crate::reactor::{LocalInit, LocalSetup, Shard, ShardConfig, ShardHandle};
use crate::shm::bell::Bell;
use crate::sys::{pin_to_core, primary_ipv4, random_u64};
use crate::wire::EndpointMetadata;

/// The control path's listener and the gate its handshakes run through.
fn control_path(cfg: &Config) -> Result<(TcpListener, Gate<PeerSlot>, SocketAddr)> {
    let listener = TcpListener::bind((cfg.listen_addr, cfg.listen_port))
        .map_err(|e| Error::io("bind control listener", e))?;
    let gate = Gate::new(
        &listener,
        GateLimits {
            max_pending: MAX_PENDING_HANDSHAKES,
            max_per_addr: MAX_HANDSHAKES_PER_ADDR,
            accept_batch: ACCEPT_BATCH,
            first_bytes: FIRST_BYTES_TIMEOUT.min(cfg.connect_timeout()),
            whole: cfg.connect_timeout(),
        },
    )?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::io("getsockname", e))?;
    Ok((listener, gate, local))
}

/// What peers are told: the address to reach us at, and our GPU's bus id.
fn own_metadata(cfg: &Config, local: SocketAddr) -> Result<EndpointMetadata> {
    let adv = cfg.advertise_addr.unwrap_or_else(|| {
        if local.ip().is_unspecified() {
            primary_ipv4().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
        } else {
            local.ip()
        }
    });
    let bus_id = match cfg.gpu {
        Some(i) => crate::gpu::cuda()?.device(i)?.bus_id.clone(),
        None => String::new(),
    };
    Ok(EndpointMetadata::new(adv, local.port(), &bus_id)?)
}

fn shard_config(
    cfg: &Config,
    codec: Option<Arc<crate::reactor::codec_pool::LazyCodecPool>>,
) -> ShardConfig {
    ShardConfig {
        spin: Duration::from_micros(cfg.spin_us),
        spin_yield: Duration::from_micros(cfg.spin_yield_us),
        spin_eager_passes: cfg.spin_eager_passes,
        op_timeout: cfg.op_timeout(),
        liveness: Duration::from_millis(cfg.liveness_ms),
        stall: cfg.stall(),
        idle_timeout: (cfg.idle_timeout_ms > 0).then(|| Duration::from_millis(cfg.idle_timeout_ms)),
        chunk_bytes: cfg.chunk_bytes,
        sq_depth: cfg.sq_depth,
        max_conn_inflight_ops: cfg.max_conn_inflight_ops,
        gpu_streams: cfg.gpu_streams,
        gpu_copy: crate::gpu::copy::CopyWay {
            way: cfg.gpu_copy,
            runner_idle: (cfg.gpu_runner_us > 0).then(|| Duration::from_micros(cfg.gpu_runner_us)),
            device_descs: cfg.gpu_device_descs,
        },
        copy_pool: crate::reactor::copy_pool::LazyCopyPool::new(cfg.copy_threads),
        gpu_bounce_bytes: cfg.gpu_bounce_bytes,
        codec,
    }
}

/// The endpoint's codec pool (not started yet), unless compression is off.
pub(super) fn codec_pool(cfg: &Config) -> Option<Arc<crate::reactor::codec_pool::LazyCodecPool>> {
    use crate::endpoint::config::Compress;
    use crate::tcp::PackMode;
    let mode = match cfg.compress {
        Compress::Off => return None,
        Compress::Auto => PackMode::Auto,
        Compress::On => PackMode::On,
    };
    Some(crate::reactor::codec_pool::LazyCodecPool::new(
        mode,
        cfg.compress_threads,
    ))
}

/// The same-host side: shard 0's accept ring and fd-passing socket, and
/// a doorbell per shard (same-host connections live on every shard); or
/// why there is none.
struct HostSide {
    setup: Option<LocalSetup>,
    bells: Vec<Option<Bell>>,
    off: Option<PathOff>,
}

fn host_side(
    cfg: &Config,
    id: u64,
    connects: SyncSender<(crate::wire::shm_msg::Msg, Vec<u8>)>,
    wake_accept: Arc<mio::Waker>,
) -> HostSide {
    let off = |why: String| HostSide {
        setup: None,
        bells: Vec::new(),
        off: Some(why.into()),
    };
    if cfg.transport == Transport::Tcp {
        return off("FERRY_TRANSPORT=tcp".to_owned());
    }
    crate::shm::object::sweep_stale();
    let accept_ring = match crate::shm::named_ring::ShmRing::create(
        &crate::shm::named_ring::accept_ring_name(id),
        256,
        random_u64(),
    ) {
        Ok(r) => r,
        Err(e) => return off(format!("cannot create a shared-memory ring: {e}")),
    };
    let fd_listener = match crate::shm::fdpass::FdListener::bind(id) {
        Ok(l) => l,
        Err(e) => return off(format!("cannot bind the fd-passing socket: {e}")),
    };
    let bells: Vec<Option<Bell>> = (0..cfg.shards)
        .map(|i| {
            Bell::create(id, i as u32)
                .map_err(|e| {
                    warn!(
                        shard = i,
                        "no doorbell for same-host rings ({e}): quiet rings are polled"
                    )
                })
                .ok()
        })
        .collect();
    if bells[0].is_some() {
        // CONNECT messages always ring: the accept ring is polled, but a
        // parked shard must wake for them.
        accept_ring.ring.set_bell_home(id, 0);
        accept_ring
            .ring
            .set_bell(crate::shm::bell::ACCEPT_BIT, true);
    }
    HostSide {
        setup: Some(LocalSetup {
            accept_ring,
            fd_listener,
            connects,
            wake_accept,
        }),
        bells,
        off: None,
    }
}

/// The RDMA NICs near our GPU, or why verbs is off.
fn nic_side(
    cfg: &Config,
    metadata: &EndpointMetadata,
) -> (
    std::result::Result<Vec<String>, PathOff>,
    Option<crate::verbs::NicHandle>,
) {
    match crate::verbs::open_nic(
        Some(metadata.gpu_bdf.as_str()),
        cfg.rdma_dev.as_deref(),
        &cfg.verbs(),
    ) {
        Ok((nics, nic)) => {
            info!(
                "RDMA verbs on {}: peers with verbs get queue pairs",
                nics.join(", ")
            );
            (Ok(nics), nic)
        }
        Err(why) => {
            info!("RDMA verbs off ({why}): connections use tcp");
            (Err(why), None)
        }
    }
}

/// What every shard shares.
struct ShardShared {
    table: Arc<CompletionTable>,
    inbox: crate::reactor::Inboxes,
    closed: mpsc::Sender<(crate::error::ConnId, crate::error::ConnFault)>,
    ipc_counters: Arc<crate::gpu::ipc::IpcCounters>,
    shares: Arc<crate::shm::peers::PeerShares>,
    codec: Option<Arc<crate::reactor::codec_pool::LazyCodecPool>>,
}

/// The shards and their handles; each can hand slices of a large
/// same-host copy to the others.
fn shard_set(
    cfg: &Config,
    mut host: HostSide,
    sh: &ShardShared,
) -> Result<(Vec<Shard>, Vec<ShardHandle>)> {
    let scfg = shard_config(cfg, sh.codec.clone());
    let mut bells = host.bells.into_iter();
    let mut shards = Vec::new();
    let mut handles = Vec::new();
    for i in 0..cfg.shards {
        let init = LocalInit {
            setup: if i == 0 { host.setup.take() } else { None },
            bell: bells.next().flatten(),
            shares: sh.shares.clone(),
        };
        let (s, h) = Shard::new(
            i,
            scfg.clone(),
            sh.table.clone(),
            sh.inbox.clone(),
            init,
            sh.closed.clone(),
            sh.ipc_counters.clone(),
        )?;
        shards.push(s);
        handles.push(h);
    }
    if handles.len() > 1 {
        for s in &mut shards {
            let others = handles.iter().filter(|h| h.id != s.id()).cloned();
            s.set_siblings(others.collect());
        }
    }
    Ok((shards, handles))
}

/// Managed mode: a thread per shard (pinned with `FERRY_PIN`, shard i on
/// the i-th core of the GPU's NUMA node first).
fn spawn_shards(inner: &Inner, shards: Vec<Shard>) -> Result<Vec<JoinHandle<()>>> {
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pin = inner.cfg.pin_cores;
    let order = if pin {
        crate::sys::machine_pin_order(Some(inner.me.metadata.gpu_bdf.as_str()))
    } else {
        Vec::new()
    };
    let mut threads = Vec::new();
    for s in shards {
        let id = s.id();
        let core = if order.is_empty() {
            id % ncpu
        } else {
            order[id % order.len()]
        };
        let t = std::thread::Builder::new()
            .name(format!("ferry-shard-{id}"))
            .spawn(move || {
                if pin {
                    pin_to_core(core);
                }
                s.run()
            })
            .map_err(|e| Error::io("spawn shard thread", e))?;
        threads.push(t);
    }
    Ok(threads)
}

impl Endpoint {
    pub(super) fn start(cfg: Config) -> Result<Endpoint> {
        let (backend, note) = oob::choose(cfg.io)?;
        if let Some(why) = &note {
            info!("control path uses {backend}: {why}");
        }
        let (listener, gate, local) = control_path(&cfg)?;
        let metadata = own_metadata(&cfg, local)?;
        let gpu = std::sync::OnceLock::new();
        if let Some(i) = cfg.gpu {
            let _ = gpu.set(i as i32);
        }
        let id = random_u64();
        let (connects_tx, connects_rx) = mpsc::sync_channel(64);
        let host = host_side(&cfg, id, connects_tx, gate.waker());
        let shm_note = host.off.clone();
        if let Some(why) = &shm_note {
            info!("same-host path off: {why}");
        }
        let (verbs, nic) = nic_side(&cfg, &metadata);
        // Empty without same-host support: no shard has a doorbell.
        let local_bell: Vec<bool> = host.bells.iter().map(Option::is_some).collect();
        let table = CompletionTable::new(cfg.max_inflight_ops);
        let (inboxes, inbox_rx, ctl_rx) =
            crate::reactor::Inboxes::new(cfg.inbox_depth, table.signal().clone());
        let (closed_tx, closed_rx) = mpsc::channel();
        let shared = ShardShared {
            table,
            inbox: inboxes,
            closed: closed_tx,
            ipc_counters: Arc::new(crate::gpu::ipc::IpcCounters::default()),
            shares: Arc::new(crate::shm::peers::PeerShares::default()),
            codec: codec_pool(&cfg),
        };
        let (shards, handles) = shard_set(&cfg, host, &shared)?;
        let inner = Arc::new(Inner {
            me: super::Me {
                id,
                metadata,
                host_token: crate::shm::object::host_token(),
                backend,
                backend_note: note.map(PathOff::from),
            },
            shards: super::lanes::ShardSet {
                shards: handles,
                table: shared.table,
                codec: shared.codec.clone(),
                next_lane: AtomicU64::new(0),
                next_local_shard: AtomicU64::new(0),
            },
            conns: super::table::ConnTable::new(closed_rx),
            accept: super::accept::Acceptor::new(listener, gate),
            mail: super::two_sided::Mail {
                inbox: Mutex::new(inbox_rx),
                messages: super::two_sided::Messages::new(ctl_rx),
            },
            local: super::local::LocalSide {
                note: shm_note,
                connects: Mutex::new(connects_rx),
                memfd_regions: Mutex::new(HashMap::new()),
                peers: Mutex::new(std::collections::HashSet::new()),
                bell: local_bell,
                shares: shared.shares,
                bells: Mutex::new(HashMap::new()),
            },
            nics: super::connect::NicSide {
                status: verbs,
                handle: nic,
            },
            gpus: super::gpu::GpuSide {
                ordinal: gpu,
                registered: AtomicU64::new(0),
                ipc_counters: shared.ipc_counters,
            },
            regs: super::memory::Registry::new(),
            cfg,
        });
        let (threads, embedded) = match inner.cfg.mode {
            Mode::Managed => (spawn_shards(&inner, shards)?, Vec::new()),
            Mode::Embedded => (Vec::new(), shards),
        };
        info!(id = inner.me.id, addr = %local, backend = %backend, shards = inner.cfg.shards, "endpoint started");
        Ok(Endpoint {
            inner,
            threads,
            embedded: Mutex::new(embedded),
        })
    }
}

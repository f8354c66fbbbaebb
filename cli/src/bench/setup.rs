//! Setting a run up: the environment both processes read, the target
//! process, this side's endpoint, connections and buffers.

use std::io::BufReader;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferry::{Config, ConnId, Endpoint, MemoryRegion, Mode, Shard, Transport};
use ferry_cli::testkit::{read_served, rss_kib};

use crate::child::{spawn_self, Peer};

use super::opts::Opts;
use ferry::AnyWindow;

/// What holding the idle connections cost.
pub(super) struct IdleCost {
    pub(super) n: usize,
    pub(super) open_s: f64,
    pub(super) here_kib_each: f64,
    pub(super) there_kib_each: f64,
}

/// Opens `n` more connections to the target and leaves them idle; returns
/// what they cost (time, and resident memory on each side).
pub(super) fn open_idle(
    ep: &Endpoint,
    mut shard: Option<&mut Shard>,
    meta: &[u8],
    n: usize,
    target_pid: u32,
) -> Result<Option<IdleCost>> {
    if n == 0 {
        return Ok(None);
    }
    let addr = ferry::EndpointMetadata::decode(meta)?.socket_addr();
    let (here0, there0) = (rss_kib(std::process::id()), rss_kib(target_pid));
    let t0 = Instant::now();
    for i in 0..n {
        // Held by the endpoint until it drops; nothing here uses them.
        ep.connect(addr)
            .with_context(|| format!("idle connection {} of {n}", i + 1))?;
        // The embedded shard takes each connection in as it comes.
        if let Some(s) = shard.as_deref_mut() {
            s.poll();
        }
    }
    let t_open = t0.elapsed();
    // Let the target settle (its accept loop, first polls).
    let settle = Instant::now();
    while settle.elapsed() < Duration::from_millis(300) {
        match shard.as_deref_mut() {
            Some(s) => {
                s.poll();
            }
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    }
    let (here1, there1) = (rss_kib(std::process::id()), rss_kib(target_pid));
    let per = |a: usize, b: usize| b.saturating_sub(a) as f64 / n as f64;
    Ok(Some(IdleCost {
        n,
        open_s: t_open.as_secs_f64(),
        here_kib_each: per(here0, here1),
        there_kib_each: per(there0, there1),
    }))
}

/// The variables both processes read (the target at start, we later).
pub(super) fn set_env(o: &Opts) {
    let target_transport = if o.transport == Transport::Tcp {
        "tcp"
    } else {
        "auto"
    };
    std::env::set_var("FERRY_TRANSPORT", target_transport);
    // Both processes read these (the target at start, we below).
    if let Some(n) = o.streams {
        std::env::set_var("FERRY_STREAMS", n.to_string());
    }
    if let Some(n) = o.shards {
        std::env::set_var("FERRY_SHARDS", n.to_string());
    }
    if o.idle_conns > 1 {
        // Room for them on both sides (the target counts them per peer).
        let room = (o.idle_conns + 64).to_string();
        for var in ["FERRY_MAX_CONNS", "FERRY_MAX_CONNS_PER_PEER"] {
            let now: usize = std::env::var(var)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            if now < o.idle_conns + 64 {
                std::env::set_var(var, &room);
            }
        }
    }
}

/// The target's GPU, when the run moves GPU memory.
pub(super) fn peer_gpu(o: &Opts) -> Result<Option<usize>> {
    Ok(match (o.ipc || o.device_gpu, o.peer_gpu) {
        (false, _) => None,
        (true, Some(g)) => Some(g),
        (true, None) => {
            let n = ferry::gpu::cuda()?.devices.len();
            Some(if n >= 2 { 1 } else { 0 })
        }
    })
}

/// Our shards and the target's each spin while idle; say so when they
/// outnumber the cores (they then give way: see the help's "Spinning").
pub(super) fn warn_spinners(o: &Opts) {
    let shards_each = o.shards.unwrap_or_else(|| {
        std::env::var("FERRY_SHARDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1)
    });
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if 2 * shards_each + o.contend > cores {
        eprintln!(
            "ferry bench: {} spinning shard threads and {} busy processes on {cores} cores: \
             a shard that finds its core shared parks as soon as it is idle",
            2 * shards_each,
            o.contend
        );
    }
}

/// The target: a `ferry serve` we start, or one found in the directory.
pub(super) fn start_target(
    o: &Opts,
    bytes: usize,
    peer_gpu: Option<usize>,
) -> Result<(ferry_cli::testkit::Served, u32, Option<Peer>)> {
    let mut serve_args = vec!["serve".to_owned(), "--bytes".into(), bytes.to_string()];
    if let Some(g) = peer_gpu {
        serve_args.extend(["--gpu".to_owned(), g.to_string()]);
    }
    let serve_args: Vec<&str> = serve_args.iter().map(String::as_str).collect();
    Ok(match &o.directory {
        Some((url, cluster, peer)) => (crate::dir::served_by_name(url, cluster, peer)?, 0, None),
        None => {
            let mut child = spawn_self(&serve_args)?;
            let target_pid = child.id();
            let mut out = BufReader::new(child.stdout.take().context("child stdout")?);
            let target = Peer(child);
            let served = read_served(&mut out).map_err(anyhow::Error::msg)?;
            (served, target_pid, Some(target))
        }
    })
}

/// This side's endpoint: one shard embedded in the benchmark loop, more
/// managed.
pub(super) fn own_endpoint(o: &Opts) -> Result<Endpoint> {
    let mut cfg = Config::from_env()?;
    cfg.listen_addr = "127.0.0.1".parse()?;
    // One shard: embedded, driven by the benchmark loop; more: managed.
    cfg.mode = if cfg.shards > 1 {
        Mode::Managed
    } else {
        Mode::Embedded
    };
    cfg.transport = o.transport;
    if o.ipc || o.device_gpu {
        cfg.gpu = Some(o.gpu);
    }
    Ok(Endpoint::builder().config(cfg).build()?)
}

/// The first connection and the further ones measured beside it
/// (--conns).
pub(super) fn more_conns(
    o: &Opts,
    ep: &Endpoint,
    shard: &mut Option<ferry::Shard>,
    conn: ConnId,
    served: &ferry_cli::testkit::Served,
) -> Result<Vec<ConnId>> {
    let mut conns = vec![conn];
    let addr = ferry::EndpointMetadata::decode(&served.meta)?.socket_addr();
    for i in 1..o.conns {
        conns.push(
            ep.connect(addr)
                .with_context(|| format!("connection {} of {}", i + 1, o.conns))?,
        );
        if let Some(s) = shard.as_mut() {
            s.poll();
        }
    }
    Ok(conns)
}

/// --transport verbs: every measured connection must have queue pairs.
pub(super) fn check_verbs(o: &Opts, ep: &Endpoint, conns: &[ConnId]) -> Result<()> {
    if o.verbs {
        if let Some(c) = conns.iter().find(|c| !ep.uses_verbs(**c)) {
            bail!(
                "--transport verbs: {c} has no RDMA queue pairs ({})",
                match ep.verbs_status() {
                    Ok(nics) => format!(
                        "this side uses {}; the target has no NIC, refused, or failed",
                        nics.join(", ")
                    ),
                    Err(why) => why.to_owned(),
                }
            );
        }
    }
    Ok(())
}

pub(super) fn transport_name(o: &Opts, shm: bool) -> &'static str {
    match (o.ipc, shm, o.device_gpu) {
        _ if o.verbs && o.device_gpu => "verbs-gpu",
        _ if o.verbs => "verbs",
        (true, _, _) => "ipc",
        (false, true, false) => "shm",
        (false, true, true) => "shm-gpu",
        (false, false, false) => "tcp",
        (false, false, true) => "tcp-gpu",
    }
}

/// Host memory for our side: memfd memory the target maps on the
/// same-host path, else an ordinary registration.
pub(super) fn host_buffer(ep: &Endpoint, shm: bool, bytes: usize) -> Result<MemoryRegion> {
    Ok(if shm {
        let m = ep.alloc_host(bytes)?;
        m.write_at(0, &vec![0x3cu8; bytes])?;
        m
    } else {
        ep.register(vec![0x3cu8; bytes])?
    })
}

/// Our buffer and the target's window.
pub(super) fn buffers(
    o: &Opts,
    ep: &Endpoint,
    shm: bool,
    bytes: usize,
    served: &ferry_cli::testkit::Served,
) -> Result<(MemoryRegion, AnyWindow)> {
    // Touch every page now, as an application's live buffers are: first-touch
    // page faults would otherwise be measured as transfer time. On the
    // same-host path the buffer is memfd memory the target maps.
    let local = if o.ipc && o.pinned {
        ep.alloc_pinned(bytes)?
    } else if o.ipc || o.device_gpu {
        let m = ep.alloc_gpu(bytes)?;
        let fill = vec![0x3cu8; bytes];
        m.write_at(0, &fill)?;
        m
    } else {
        host_buffer(ep, shm, bytes)?
    };
    let remote = if o.ipc {
        AnyWindow::Ipc(served.ipc.context("the target printed no IPCBUF line")?)
    } else if o.device_gpu {
        AnyWindow::Key(
            served
                .gpu_rbuf
                .context("the target printed no GRBUF line")?,
        )
    } else {
        AnyWindow::Key(served.rbuf)
    };
    Ok((local, remote))
}

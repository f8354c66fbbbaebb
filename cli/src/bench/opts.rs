//! `ferry bench`'s flags: the help text and the parser.

use anyhow::{bail, Context, Result};
use ferry::{OpKind, Transport};

use crate::args::{parse_size, Args};

pub const HELP: &str = "\
ferry bench: one-sided WRITE/READ throughput and latency over 127.0.0.1

Starts a target process (`ferry serve`), connects to it, and for each block
size and op keeps --batch operations in flight for --seconds, then prints
GB/s (1e9 B/s), ops/s and per-op latency percentiles. The initiator drives
its shard from the benchmark loop (embedded mode, busy-polling); the target
runs a managed shard.

Flags:
  --transport auto|tcp|shm|ipc|verbs
                         data path (default auto, which picks shm: the
                         target is a process on this host). ipc: CUDA IPC
                         write/read with an IpcBuf (the seed's write_ipc)
                         into the target's GPU memory
                         (needs a GPU; the one-op latency uses 4 KiB).
                         verbs: RDMA queue pairs between the two
                         processes through the NIC (a build with the
                         `rdma` feature and an RDMA NIC, or the software
                         NIC of tools/softverbs); an error if the
                         connection did not get queue pairs. --baseline
                         then measures plain TCP, as for tcp
  --gpu IDX              ipc: the initiator's GPU (default 0)
  --peer-gpu IDX         ipc: the target's GPU (default 1 if there are two
                         or more, else 0)
  --local gpu|pinned     ipc: the initiator's buffer: GPU memory (default)
                         or pinned host memory (host->GPU over IPC)
  --device host|gpu      tcp/shm: where both sides' buffers live (default
                         host). gpu: GPU memory on both sides (tcp stages
                         through pinned bounce buffers; shm copies with
                         CUDA); --baseline then measures the same path with
                         host buffers in the same run
  --op write|read|both|send
                         operations to measure (default both). send:
                         two-sided messages (send/recv) of each --sizes
                         block to the target and back (it echoes them),
                         p50/p99/p999 of the round trip, with a one-sided
                         WRITE round trip of the same block beside it (the
                         row's reference); no throughput points
  --sizes LIST           block sizes (default 4K,64K,1M,16M,64M)
  --batch N              operations in flight (default 32; capped so that
                         batch x block <= 1 GiB)
  --seconds S            measuring time per point (default 1)
  --latency              also 8-byte one-op round trips: p50/p99/p999 in us
  --baseline             also a reference measured in the same run, same
                         sizes, same memory footprint (blocks cycle through
                         as many distinct buffers as ferry's run), and
                         prints ferry's ratio to it. tcp: plain TCP
                         send/recv between two processes, as many streams
                         as --streams, a thread each (and a TCP
                         ping-pong for --latency); shm: memcpy (blocks of
                         1 MiB or more split over as many threads as share
                         ferry's copy: --shards or FERRY_COPY_THREADS,
                         whichever is more); for
                         --latency two threads of this process passing a
                         count through two cache lines, the floor under
                         any same-host round trip);
                         ipc: cuMemcpyAsync between the same two GPUs in
                         one process (the peer-copy rate), or pinned H2D
                         with --local pinned
  --rounds N             measure each point N times, alternating with the
                         baseline, and report medians (default 3 with
                         --baseline, else 1)
  --idle-conns N         hold N connections to the target in all: N-1
                         extra ones stay open and idle while the first is
                         measured (default 1). Raises FERRY_MAX_CONNS and
                         FERRY_MAX_CONNS_PER_PEER for both processes to fit,
                         and prints the resident memory they cost each side;
                         then leaves all of them idle for 1 s and prints the
                         CPU each side used meanwhile and the round trip of
                         the first 8-byte WRITE after it (--rounds times:
                         the median); with --baseline also the time to wake
                         a parked thread of this process after 1 s idle
                         (what a wake-up costs on this machine, measured
                         in the same run) and ferry's ratio to it
  --streams N            TCP streams per connection, both processes
                         (FERRY_STREAMS). A list (--streams 1,2,4,8) is a
                         scaling run: one run per count, each with as many
                         shards unless --shards is given; --plot then draws
                         GB/s against the count
  --shards N             shards in each process (FERRY_SHARDS); with more
                         than one the initiator's are managed threads, and
                         a connection's streams are spread over them
                         (FERRY_LANES). --baseline then measures as many
                         plain TCP streams as --streams, in parallel
  --conns N              measure over N connections to the target (each
                         on the next shard: with --shards, the work of many
                         peers), each keeping its share of --batch in
                         flight: an op that ends is replaced on its own
                         connection, and each connection's oldest op is
                         the one watched (one-op round trips: the next
                         connection in turn)
  --submit each|batch|queue
                         how the ops in flight are refilled: one call each
                         (default; with one shard, embedded in the
                         benchmark loop, write_async_on/read_async_on: the
                         shard applies the op in the call, no queue hop),
                         staged in an Endpoint::batch and queued together,
                         one queue push per shard per refill (batch), or
                         one write_async/read_async call each through the
                         shard's command queue even when it is embedded
                         (queue: what builds before write_async_on did)
  --burst N              with --submit batch: refill only once N ops of
                         --batch have ended, all N in one batch (default
                         a quarter of --batch): how an application posts a
                         list of blocks at once
  --threads N            submit from N threads (default 1), each keeping
                         --batch ops in flight on its own connection
                         (thread i on connection i mod --conns) and its own
                         share of the windows: the work of N independent
                         requesters. Needs managed shards (--shards > 1);
                         the rate is all threads' completions together
  --contend N            measure each point quiet and then with N busy
                         processes (`ferry busy`, one spinning thread each)
                         running beside the benchmark, alternating per
                         round; prints the loaded figures, the quiet ones
                         and their ratio (loaded / quiet). Not with
                         --baseline
  --plot FILE.svg         also draw GB/s against block size, ferry's WRITE
                         and READ and the run's reference (--baseline or
                         --contend's quiet figures, dashed), into FILE.svg
  --directory URL --peer NAME [--cluster C]
                         measure against the target published as NAME in
                         etcd at URL (`ferry serve --directory URL --name
                         NAME`; cluster default ferry) instead of
                         starting one; needs a build with the `directory`
                         feature
  --json                 one JSON object per line instead of a table
Spinning: the initiator's shards and each target shard poll for
FERRY_SPIN_YIELD_US after their last work, then yield their core each
idle pass up to FERRY_SPIN_US (1 ms while awaiting replies), then park;
on a loaded host (CPU pressure) they yield at once and park as soon as
they are preempted (README, reactor/spin.rs); with managed initiator shards (--shards > 1) the benchmark thread sleeps
on the oldest op instead of spinning. So the run has at most 2 x shards
spinning threads, and where that exceeds the cores they yield them.
Environment: FERRY_* variables apply to both processes (see the README).";

pub(super) struct Opts {
    pub(super) transport: Transport,
    pub(super) ipc: bool,
    /// `--transport verbs`: tcp connections that must carry queue pairs.
    pub(super) verbs: bool,
    pub(super) device_gpu: bool,
    pub(super) gpu: usize,
    pub(super) peer_gpu: Option<usize>,
    pub(super) pinned: bool,
    pub(super) ops: Vec<OpKind>,
    /// `--op send`: two-sided message round trips, not throughput points.
    pub(super) messages: bool,
    pub(super) sizes: Vec<usize>,
    pub(super) batch: usize,
    pub(super) seconds: f64,
    pub(super) latency: bool,
    pub(super) baseline: bool,
    pub(super) json: bool,
    pub(super) rounds: usize,
    pub(super) idle_conns: usize,
    pub(super) streams: Option<usize>,
    /// A scaling run: one run per count (`--streams 1,2,4,8`).
    pub(super) streams_list: Option<Vec<usize>>,
    pub(super) shards: Option<usize>,
    pub(super) conns: usize,
    /// `--threads`: submitting threads, each with its own batch.
    pub(super) threads: usize,
    /// `--submit batch`: refills go through `Endpoint::batch`, each of at
    /// least this many ops (`--burst`; 0: a quarter of the batch).
    pub(super) batched: Option<usize>,
    /// `--submit queue`: an embedded shard's ops go through its queue too.
    pub(super) queued: bool,
    pub(super) contend: usize,
    pub(super) plot: Option<String>,
    /// `--directory URL --peer NAME [--cluster C]`: measure against a
    /// published target instead of spawning one.
    pub(super) directory: Option<(String, String, String)>,
}

pub(super) fn parse(mut a: Args) -> Result<Opts> {
    let Path {
        transport,
        ipc,
        verbs,
        device_gpu,
        gpu,
        peer_gpu,
        pinned,
    } = parse_path(&mut a)?;
    let (ops, messages) = parse_ops(&mut a)?;
    let sizes = parse_sizes(
        &mut a,
        "4K,64K,1M,16M,64M",
        (u32::MAX as usize, "4 GiB - 1"),
    )?;
    let batch: usize = a.parsed("batch", 32)?;
    let seconds: f64 = a.parsed("seconds", 1.0)?;
    if batch == 0 || batch > 4096 {
        bail!("--batch {batch}: must be 1..=4096");
    }
    if !(seconds > 0.0 && seconds <= 600.0) {
        bail!("--seconds {seconds}: must be in (0, 600]");
    }
    let baseline = a.switch("baseline");
    let rounds: usize = a.parsed("rounds", if baseline { 3 } else { 1 })?;
    if rounds == 0 || rounds > 100 {
        bail!("--rounds {rounds}: must be 1..=100");
    }
    let idle_conns: usize = a.parsed("idle-conns", 1)?;
    if idle_conns == 0 || idle_conns > 100_000 {
        bail!("--idle-conns {idle_conns}: must be 1..=100000");
    }
    let contend: usize = a.parsed("contend", 0)?;
    if contend > 256 {
        bail!("--contend {contend}: must be 0..=256");
    }
    if contend > 0 && baseline {
        bail!("--contend and --baseline: pick one (each is the run's reference)");
    }
    let (streams_list, streams) = parse_streams(&mut a)?;
    let shards: Option<usize> = a.value("shards").map(|v| v.parse()).transpose()?;
    if shards.is_some_and(|n| n == 0 || n > 256) {
        bail!("--shards: must be 1..=256");
    }
    let (conns, threads, batched, queued) = parse_feeding(&mut a, shards)?;
    let local_only = baseline || idle_conns > 1 || contend > 0 || streams_list.is_some();
    let directory = parse_directory(&mut a, local_only)?;
    let o = Opts {
        directory,
        streams_list,
        conns,
        threads,
        batched,
        queued,
        streams,
        shards,
        plot: a.value("plot"),
        contend,
        idle_conns,
        transport,
        ipc,
        verbs,
        device_gpu,
        gpu,
        peer_gpu,
        pinned,
        ops,
        messages,
        sizes,
        batch,
        seconds,
        latency: a.switch("latency"),
        baseline,
        json: a.switch("json"),
        rounds,
    };
    a.finish()?;
    Ok(o)
}

/// `--op write|read|both|send` (default both); `send`: two-sided
/// messages (the flag that says so), with one-sided WRITEs beside them.
pub(super) fn parse_ops(a: &mut Args) -> Result<(Vec<OpKind>, bool)> {
    Ok(match a.value("op").as_deref().unwrap_or("both") {
        "write" => (vec![OpKind::Write], false),
        "read" => (vec![OpKind::Read], false),
        "both" => (vec![OpKind::Write, OpKind::Read], false),
        "send" => (vec![OpKind::Write], true),
        o => bail!("--op {o}: expected write, read, both or send"),
    })
}

/// `--sizes LIST` (default `default`), each 1 B to `max` (said as `max_said`).
pub(super) fn parse_sizes(
    a: &mut Args,
    default: &str,
    (max, max_said): (usize, &str),
) -> Result<Vec<usize>> {
    let sizes = a
        .value("sizes")
        .unwrap_or_else(|| default.into())
        .split(',')
        .map(parse_size)
        .collect::<Result<Vec<_>>>()?;
    if sizes.iter().any(|&s| s == 0 || s > max) {
        bail!("--sizes: each size must be between 1 B and {max_said}");
    }
    Ok(sizes)
}

/// How the ops are fed: `--conns`, `--threads`, `--submit`.
fn parse_feeding(
    a: &mut Args,
    shards: Option<usize>,
) -> Result<(usize, usize, Option<usize>, bool)> {
    let conns: usize = a.parsed("conns", 1)?;
    if conns == 0 || conns > 1024 {
        bail!("--conns {conns}: must be 1..=1024");
    }
    let threads: usize = a.parsed("threads", 1)?;
    if threads == 0 || threads > 256 {
        bail!("--threads {threads}: must be 1..=256");
    }
    if threads > 1 && shards.unwrap_or(1) < 2 {
        bail!(
            "--threads {threads}: needs managed shards (--shards 2 or more); one \
             embedded shard is driven by the one benchmark thread"
        );
    }
    let burst: Option<usize> = a.value("burst").map(|v| v.parse()).transpose()?;
    if burst.is_some_and(|n| n == 0 || n > 4096) {
        bail!("--burst: must be 1..=4096");
    }
    let submit = a.value("submit");
    let submit = submit.as_deref().unwrap_or("each");
    let batched = match submit {
        "batch" => Some(burst.unwrap_or(0)),
        "each" | "queue" if burst.is_some() => bail!("--burst: only with --submit batch"),
        "each" | "queue" => None,
        v => bail!("--submit {v}: expected each, batch or queue"),
    };
    Ok((conns, threads, batched, submit == "queue"))
}

/// What the run moves and over which path.
pub(super) struct Path {
    pub(super) transport: Transport,
    pub(super) ipc: bool,
    pub(super) verbs: bool,
    pub(super) device_gpu: bool,
    pub(super) gpu: usize,
    pub(super) peer_gpu: Option<usize>,
    pub(super) pinned: bool,
}

/// --transport, --device, --gpu, --peer-gpu, --local.
pub(super) fn parse_path(a: &mut Args) -> Result<Path> {
    let mut ipc = false;
    let mut verbs = false;
    let transport = match a.value("transport").as_deref().unwrap_or("auto") {
        "auto" => Transport::Auto,
        "tcp" => Transport::Tcp,
        "verbs" => {
            verbs = true;
            Transport::Tcp
        }
        "shm" => Transport::Shm,
        "ipc" => {
            ipc = true;
            Transport::Shm
        }
        t => bail!("--transport {t}: expected auto, tcp, shm, ipc or verbs"),
    };
    let gpu: usize = a.parsed("gpu", 0)?;
    let device_gpu = match a.value("device").as_deref().unwrap_or("host") {
        "host" => false,
        "gpu" if ipc => bail!("--device gpu: ipc always uses GPU memory; see --local"),
        "gpu" => true,
        d => bail!("--device {d}: expected host or gpu"),
    };
    let peer_gpu: Option<usize> = a.value("peer-gpu").map(|v| v.parse()).transpose()?;
    let pinned = match a.value("local").as_deref().unwrap_or("gpu") {
        "gpu" => false,
        "pinned" => true,
        l => bail!("--local {l}: expected gpu or pinned"),
    };
    Ok(Path {
        transport,
        ipc,
        verbs,
        device_gpu,
        gpu,
        peer_gpu,
        pinned,
    })
}

/// --streams: one count, or a list (a scaling run).
pub(super) fn parse_streams(a: &mut Args) -> Result<(Option<Vec<usize>>, Option<usize>)> {
    let arg = a.value("streams");
    let list = match arg.as_deref() {
        Some(v) if v.contains(',') => Some(
            v.split(',')
                .map(|n| n.trim().parse::<usize>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .context("--streams LIST")?,
        ),
        _ => None,
    };
    let one: Option<usize> = match (&list, arg) {
        (Some(_), _) | (_, None) => None,
        (None, Some(v)) => Some(v.parse().context("--streams")?),
    };
    if list
        .as_ref()
        .is_some_and(|l| l.iter().any(|&n| n == 0 || n > 64))
    {
        bail!("--streams: each must be 1..=64");
    }
    if one.is_some_and(|n| n == 0 || n > 64) {
        bail!("--streams: must be 1..=64");
    }
    Ok((list, one))
}

/// --directory URL --peer NAME [--cluster C]: a published target
/// (`local_only`: flags that start local processes were given).
pub(super) fn parse_directory(
    a: &mut Args,
    local_only: bool,
) -> Result<Option<(String, String, String)>> {
    Ok(match (a.value("directory"), a.value("peer")) {
        (Some(url), Some(peer)) => {
            let cluster = a.value("cluster").unwrap_or_else(|| "ferry".into());
            if local_only {
                bail!(
                    "--directory measures a published target: not with --baseline, \
                     --idle-conns, --contend or a --streams list (they start local processes)"
                );
            }
            Some((url, cluster, peer))
        }
        (None, None) => None,
        _ => bail!("--directory and --peer go together"),
    })
}

//! `ferry bench`: one-sided WRITE/READ throughput and latency between this
//! process (the initiator, driving its shard in embedded mode) and a target
//! process it spawns (`ferry serve`), optionally against raw TCP measured in
//! the same run.

use std::collections::VecDeque;
use std::io::{BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferry::{
    Config, ConnId, Endpoint, MemoryRegion, Mode, OpKind, RemoteBuf, Shard, Transfer, Transport,
};
use ferry_cli::testkit::{cpu_ns, read_served, rss_kib};

use crate::args::{fmt_size, parse_size, Args};
use crate::child::{spawn_self, Contenders, Peer};
use crate::raw;

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
  --op write|read|both   operations to measure (default both)
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
                         1 MiB or more split over --shards threads);
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
  --conns N              measure over N connections to the target, each
                         op on the next in turn (each connection on the
                         next shard: with --shards, the work of many peers)
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

struct Opts {
    transport: Transport,
    ipc: bool,
    /// `--transport verbs`: tcp connections that must carry queue pairs.
    verbs: bool,
    device_gpu: bool,
    gpu: usize,
    peer_gpu: Option<usize>,
    pinned: bool,
    ops: Vec<OpKind>,
    sizes: Vec<usize>,
    batch: usize,
    seconds: f64,
    latency: bool,
    baseline: bool,
    json: bool,
    rounds: usize,
    idle_conns: usize,
    streams: Option<usize>,
    /// A scaling run: one run per count (`--streams 1,2,4,8`).
    streams_list: Option<Vec<usize>>,
    shards: Option<usize>,
    conns: usize,
    /// `--threads`: submitting threads, each with its own batch.
    threads: usize,
    contend: usize,
    plot: Option<String>,
    /// `--directory URL --peer NAME [--cluster C]`: measure against a
    /// published target instead of spawning one.
    directory: Option<(String, String, String)>,
}

struct Row {
    transport: &'static str,
    op: &'static str,
    block: usize,
    batch: usize,
    gbps: f64,
    ops_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    baseline_gbps: Option<f64>,
    /// Median over rounds of ferry / baseline measured back to back.
    ratio: Option<f64>,
    baseline_p50_us: Option<f64>,
    /// What the baseline latencies are ("raw tcp ping-pong", "quiet").
    latency_ref: &'static str,
    baseline_p99_us: Option<f64>,
}

fn parse(mut a: Args) -> Result<Opts> {
    let Path {
        transport,
        ipc,
        verbs,
        device_gpu,
        gpu,
        peer_gpu,
        pinned,
    } = parse_path(&mut a)?;
    let ops = match a.value("op").as_deref().unwrap_or("both") {
        "write" => vec![OpKind::Write],
        "read" => vec![OpKind::Read],
        "both" => vec![OpKind::Write, OpKind::Read],
        o => bail!("--op {o}: expected write, read or both"),
    };
    let sizes = a
        .value("sizes")
        .unwrap_or_else(|| "4K,64K,1M,16M,64M".into())
        .split(',')
        .map(parse_size)
        .collect::<Result<Vec<_>>>()?;
    if sizes.iter().any(|&s| s == 0 || s > u32::MAX as usize) {
        bail!("--sizes: each size must be between 1 B and 4 GiB - 1");
    }
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
    let local_only = baseline || idle_conns > 1 || contend > 0 || streams_list.is_some();
    let directory = parse_directory(&mut a, local_only)?;
    let o = Opts {
        directory,
        streams_list,
        conns,
        threads,
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

/// What the run moves and over which path.
struct Path {
    transport: Transport,
    ipc: bool,
    verbs: bool,
    device_gpu: bool,
    gpu: usize,
    peer_gpu: Option<usize>,
    pinned: bool,
}

/// --transport, --device, --gpu, --peer-gpu, --local.
fn parse_path(a: &mut Args) -> Result<Path> {
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
fn parse_streams(a: &mut Args) -> Result<(Option<Vec<usize>>, Option<usize>)> {
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
fn parse_directory(a: &mut Args, local_only: bool) -> Result<Option<(String, String, String)>> {
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

/// What holding the idle connections cost.
struct IdleCost {
    n: usize,
    open_s: f64,
    here_kib_each: f64,
    there_kib_each: f64,
}

/// Opens `n` more connections to the target and leaves them idle; returns
/// what they cost (time, and resident memory on each side).
fn open_idle(
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

/// A number after `"key":` in one of the bench's JSON lines.
fn json_num(line: &str, key: &str) -> Option<f64> {
    let at = line.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = &line[at..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    rest[..end].trim().parse().ok()
}

/// A text after `"key":"` in one of the bench's JSON lines.
fn json_str<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(&format!("\"{key}\":\""))? + key.len() + 4;
    line[at..].split('"').next()
}

/// `--streams 1,2,4,8`: runs this benchmark once per count (as a child
/// `ferry bench --json`, so each gets a fresh target), prints each run's
/// rows with its count, and with --plot draws GB/s against the count.
fn scaling(o: &Opts, list: &[usize]) -> Result<()> {
    // Our flags again, less the ones each run sets.
    let argv: Vec<String> = std::env::args().skip(2).collect();
    let mut base = Vec::new();
    let mut i = 0;
    while i < argv.len() {
        let a = &argv[i];
        let name = a.trim_start_matches("--");
        let (name, inline) = match name.split_once('=') {
            Some((n, _)) => (n, true),
            None => (name, false),
        };
        let takes_value = !matches!(name, "json" | "latency" | "baseline");
        if matches!(name, "streams" | "plot" | "json") {
            i += if takes_value && !inline { 2 } else { 1 };
            continue;
        }
        base.push(a.clone());
        i += 1;
    }
    let exe = std::env::current_exe().context("finding the ferry executable")?;
    let mut plotted: Vec<crate::plot::Series> = Vec::new();
    if !o.json {
        println!(
            "{:>7} {:<6} {:>9} {:>9} {:>10} {:>7}",
            "streams", "op", "block", "GB/s", "base GB/s", "ratio"
        );
    }
    for &n in list {
        let mut cmd = Command::new(&exe);
        cmd.arg("bench")
            .args(&base)
            .args(["--streams", &n.to_string(), "--json"])
            .stdin(Stdio::null())
            .stderr(Stdio::inherit());
        if o.shards.is_none() {
            cmd.args(["--shards", &n.to_string()]);
        }
        let out = cmd
            .output()
            .context("running one count of the scaling run")?;
        if !out.status.success() {
            bail!("the run with --streams {n} failed: {}", out.status);
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if o.json {
                println!("{}", line.replacen('{', &format!("{{\"streams\":{n},"), 1));
            }
            let (Some(op), Some(block), Some(gbps)) = (
                json_str(line, "op"),
                json_num(line, "block_bytes"),
                json_num(line, "gbps"),
            ) else {
                continue;
            };
            let base_gbps = json_num(line, "baseline_gbps");
            if !o.json {
                println!(
                    "{n:>7} {op:<6} {:>9} {gbps:>9.3} {:>10} {:>7}",
                    fmt_size(block as usize),
                    base_gbps.map_or(String::new(), |b| format!("{b:.3}")),
                    base_gbps.map_or(String::new(), |b| format!("{:.2}", gbps / b)),
                );
            }
            let what = format!("{op} {}", fmt_size(block as usize));
            crate::plot::add_point(&mut plotted, format!("ferry {what}"), false, n, gbps);
            if let Some(b) = base_gbps {
                crate::plot::add_point(&mut plotted, format!("reference {what}"), true, n, b);
            }
        }
    }
    if let Some(path) = &o.plot {
        let axis = crate::plot::XAxis {
            name: "streams (= shards unless --shards)",
            label: |n| n.to_string(),
        };
        let title = "ferry bench scaling run".to_owned();
        std::fs::write(path, crate::plot::svg(&title, &axis, &plotted))
            .with_context(|| format!("writing {path}"))?;
        eprintln!("chart written to {path}");
    }
    Ok(())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn median(v: &[f64]) -> f64 {
    percentile(&sorted(v.to_vec()), 0.5)
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN latencies"));
    v
}

/// The target's window: a key for tcp/shm, or a CUDA IPC window.
enum Remote {
    Key(RemoteBuf),
    Ipc(ferry::IpcBuf),
}

impl Remote {
    fn size(&self) -> usize {
        match self {
            Remote::Key(r) => r.size as usize,
            Remote::Ipc(r) => r.len as usize,
        }
    }
}

/// The completions one measuring loop counts: those that end inside
/// [`warm_end`, `end`) (the pipeline is kept full from start to `end`, so
/// bytes queued before the window or drained after it never skew the rate).
struct Window {
    warm_end: Instant,
    end: Instant,
    first: Option<Instant>,
    last: Instant,
    count: u64,
    /// Per-op latencies in µs (at most the capacity given).
    lat: Vec<f64>,
}

impl Window {
    fn new(warm_end: Instant, end: Instant, lat_cap: usize) -> Window {
        Window {
            warm_end,
            end,
            first: None,
            last: warm_end,
            count: 0,
            lat: Vec::with_capacity(lat_cap),
        }
    }

    /// Pops the finished ops at the front of `inflight` (they finish in
    /// order), counting those that ended inside the window.
    fn reap(
        &mut self,
        inflight: &mut VecDeque<(Transfer, Instant)>,
        op: OpKind,
        size: usize,
    ) -> Result<()> {
        let mut done_now = None;
        while let Some((t, _)) = inflight.front_mut() {
            let Some(r) = t.poll() else { break };
            r.with_context(|| format!("{op} of {size} bytes"))?;
            let (_, started) = inflight.pop_front().expect("front");
            // One clock read per loop pass: reading it per op costs the
            // initiator a visible share of its time.
            let done = *done_now.get_or_insert_with(Instant::now);
            if done >= self.warm_end && done < self.end {
                if self.lat.len() < self.lat.capacity() {
                    self.lat.push((done - started).as_secs_f64() * 1e6);
                }
                self.first.get_or_insert(done);
                self.last = self.last.max(done);
                self.count += 1;
            }
        }
        Ok(())
    }

    /// Another loop's count, over the same window.
    fn merge(&mut self, mut o: Window) {
        if let Some(f) = o.first {
            self.first = Some(self.first.map_or(f, |x| x.min(f)));
        }
        self.last = self.last.max(o.last);
        self.count += o.count;
        self.lat.append(&mut o.lat);
    }

    /// (GB/s, ops/s) between the first and the last completion: the bytes
    /// of the ops completed after the first one, over that time.
    fn rate(&self, op: OpKind, size: usize, secs: f64) -> Result<(f64, f64)> {
        let Some(first) = self.first.filter(|_| self.count >= 2) else {
            bail!(
                "{op} of {}: fewer than 2 operations completed in {secs} s; use a longer --seconds",
                fmt_size(size)
            );
        };
        let window = (self.last - first).as_secs_f64().max(1e-9);
        let ops = (self.count - 1) as f64;
        Ok((ops * size as f64 / window / 1e9, ops / window))
    }
}

/// Starts one op of `size` bytes at `off` of both the local region and
/// the remote window, on connection `c`.
fn submit_on(
    ep: &Endpoint,
    c: ConnId,
    local: &MemoryRegion,
    remote: &Remote,
    op: OpKind,
    off: usize,
    size: usize,
) -> Result<Transfer> {
    Ok(match remote {
        Remote::Key(r) => {
            let rb = r.slice(off as u32, size as u32).context("remote window")?;
            match op {
                OpKind::Write => ep.write_async(c, local, off, size, &rb)?,
                OpKind::Read => ep.read_async(c, local, off, size, &rb)?,
            }
        }
        Remote::Ipc(r) => {
            let rb = r.slice(off as u64, size as u64).context("remote window")?;
            match op {
                OpKind::Write => ep.write_async(c, local, off, size, &rb)?,
                OpKind::Read => ep.read_async(c, local, off, size, &rb)?,
            }
        }
    })
}

struct Bench<'a> {
    ep: &'a Endpoint,
    /// The initiator's one embedded shard (None: managed shards, with
    /// --shards > 1).
    shard: Option<Shard>,
    /// The connections measured (--conns), used in turn.
    conns: Vec<ConnId>,
    turn: std::cell::Cell<usize>,
    local: MemoryRegion,
    remote: Remote,
    /// Bytes per one-op latency round trip.
    latency_bytes: usize,
    /// Submitting threads (`--threads`; > 1 only with managed shards).
    threads: usize,
}

impl Bench<'_> {
    fn submit(&self, op: OpKind, off: usize, size: usize) -> Result<Transfer> {
        let t = self.turn.get();
        self.turn.set(t.wrapping_add(1));
        let c = self.conns[t % self.conns.len()];
        submit_on(self.ep, c, &self.local, &self.remote, op, off, size)
    }

    /// Distinct `size`-byte windows the run cycles through.
    fn slots(&self, size: usize) -> usize {
        (self.local.len() / size)
            .min(self.remote.size() / size)
            .max(1)
    }

    /// Keeps `batch` ops of `size` in flight; returns (GB/s, ops/s, latencies in us, batch used).
    fn throughput(
        &mut self,
        op: OpKind,
        size: usize,
        batch: usize,
        secs: f64,
    ) -> Result<(f64, f64, Vec<f64>, usize)> {
        if self.threads > 1 && self.shard.is_none() {
            return self.threaded(op, size, batch, secs);
        }
        let slots = self.slots(size);
        let batch = batch.min(slots);
        // The pipeline is kept full from start to `end`; throughput counts
        // the operations that *complete* inside [warm_end, end], so bytes
        // queued before the window or drained after it never skew the rate.
        let warm = Duration::from_secs_f64((secs * 0.15).max(0.05));
        let t0 = Instant::now();
        let warm_end = t0 + warm;
        let end = warm_end + Duration::from_secs_f64(secs);
        let mut inflight: VecDeque<(Transfer, Instant)> = VecDeque::with_capacity(batch);
        let mut w = Window::new(warm_end, end, 1 << 20);
        let mut k = 0usize;
        loop {
            let now = Instant::now();
            if now < end {
                while inflight.len() < batch {
                    let t = self.submit(op, (k % slots) * size, size)?;
                    inflight.push_back((t, now));
                    k += 1;
                }
            } else if inflight.is_empty() {
                break;
            }
            // Like a managed shard: spin while busy, park when idle for a
            // while, so the kernel's own work (softirqs) gets a core.
            // With managed shards this thread sleeps on the oldest op (after
            // a short spin) instead of spinning beside them.
            match (&mut self.shard, inflight.front_mut()) {
                (Some(s), _) => {
                    s.poll_or_park(Duration::from_millis(1));
                }
                (None, Some((t, _))) => {
                    let _ = t.wait_timeout(Duration::from_millis(1));
                }
                (None, None) => {}
            }
            w.reap(&mut inflight, op, size)?;
        }
        let (gbps, ops) = w.rate(op, size, secs)?;
        Ok((gbps, ops, w.lat, batch))
    }

    /// `throughput` from `self.threads` threads (managed shards): thread
    /// `i` keeps `batch` ops in flight on connection `i mod conns`, over its
    /// own share of the windows; the rate counts every thread's
    /// completions inside the common window.
    fn threaded(
        &mut self,
        op: OpKind,
        size: usize,
        batch: usize,
        secs: f64,
    ) -> Result<(f64, f64, Vec<f64>, usize)> {
        let n = self.threads;
        let per = (self.slots(size) / n).max(1);
        let batch = batch.min(per);
        let warm = Duration::from_secs_f64((secs * 0.15).max(0.05));
        let warm_end = Instant::now() + warm;
        let end = warm_end + Duration::from_secs_f64(secs);
        let (ep, local, remote, conns) = (self.ep, &self.local, &self.remote, &self.conns);
        let results: Vec<Result<Window>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..n)
                .map(|i| {
                    sc.spawn(move || -> Result<Window> {
                        let c = conns[i % conns.len()];
                        let base = i * per;
                        let submit = |k: usize| {
                            submit_on(ep, c, local, remote, op, (base + k % per) * size, size)
                        };
                        let mut inflight: VecDeque<(Transfer, Instant)> =
                            VecDeque::with_capacity(batch);
                        let mut w = Window::new(warm_end, end, 1 << 16);
                        let mut k = 0usize;
                        loop {
                            let now = Instant::now();
                            if now < end {
                                while inflight.len() < batch {
                                    inflight.push_back((submit(k)?, now));
                                    k += 1;
                                }
                            } else if inflight.is_empty() {
                                break;
                            }
                            if let Some((t, _)) = inflight.front_mut() {
                                let _ = t.wait_timeout(Duration::from_millis(1));
                            }
                            w.reap(&mut inflight, op, size)?;
                        }
                        Ok(w)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("a thread panicked")))
                })
                .collect()
        });
        let mut all = Window::new(warm_end, end, 0);
        for r in results {
            all.merge(r?);
        }
        let (gbps, ops) = all.rate(op, size, secs)?;
        Ok((gbps, ops, all.lat, batch * n))
    }

    /// Leaves the connections idle for `secs` (the initiator parks like a
    /// managed shard), then times one 8-byte WRITE round trip. Returns each
    /// side's CPU use while idle (% of one core) and that round trip (us).
    fn idle_probe(&mut self, target_pid: u32, secs: f64) -> Result<(f64, f64, f64)> {
        let me = std::process::id();
        let (here0, there0) = (cpu_ns(me), cpu_ns(target_pid));
        let start = Instant::now();
        while start.elapsed().as_secs_f64() < secs {
            match &mut self.shard {
                Some(s) => {
                    s.poll_or_park(Duration::from_millis(100));
                }
                None => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        let wall_ns = start.elapsed().as_nanos() as f64;
        let (here1, there1) = (cpu_ns(me), cpu_ns(target_pid));
        let pct = |a: u64, b: u64| b.saturating_sub(a) as f64 / wall_ns * 100.0;
        let t = Instant::now();
        let mut tr = self.submit(OpKind::Write, 0, 8)?;
        let r = loop {
            // A waiter that spins but yields its core (as a shard's spin
            // does, and as the reference's waiter does): the peer we woke
            // may need this core.
            if let Some(s) = &mut self.shard {
                s.poll();
            }
            std::thread::yield_now();
            if let Some(r) = tr.poll() {
                break r;
            }
        };
        let rtt_us = t.elapsed().as_secs_f64() * 1e6;
        r?;
        Ok((pct(here0, here1), pct(there0, there1), rtt_us))
    }

    /// One op of `latency_bytes` at a time; returns latencies in us.
    fn latency(&mut self, op: OpKind, secs: f64) -> Result<Vec<f64>> {
        let end = Instant::now() + Duration::from_secs_f64(secs);
        let mut lat = Vec::with_capacity(1 << 20);
        let mut n = 0u64;
        while Instant::now() < end {
            let start = Instant::now();
            let mut t = self.submit(op, 0, self.latency_bytes)?;
            let r = loop {
                match &mut self.shard {
                    Some(s) => {
                        s.poll_or_park(Duration::from_millis(1));
                    }
                    None => {
                        let _ = t.wait_timeout(Duration::from_millis(1));
                    }
                }
                if let Some(r) = t.poll() {
                    break r;
                }
            };
            r?;
            n += 1;
            // The first few round trips warm caches and the peer's spin loop.
            if n > 100 && lat.len() < lat.capacity() {
                lat.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        Ok(lat)
    }
}

fn op_name(op: OpKind) -> &'static str {
    match op {
        OpKind::Write => "write",
        OpKind::Read => "read",
    }
}

fn print_row(r: &Row, json: bool) {
    if json {
        let mut s = format!(
            "{{\"transport\":\"{}\",\"op\":\"{}\",\"block_bytes\":{},\"batch\":{},",
            r.transport, r.op, r.block, r.batch
        );
        if !r.op.ends_with("_latency") {
            s += &format!("\"gbps\":{:.4},\"ops_per_s\":{:.0},", r.gbps, r.ops_per_s);
        }
        s += &format!(
            "\"p50_us\":{:.2},\"p99_us\":{:.2},\"p999_us\":{:.2}",
            r.p50_us, r.p99_us, r.p999_us
        );
        if let (Some(b), Some(ratio)) = (r.baseline_gbps, r.ratio) {
            s += &format!(",\"baseline_gbps\":{b:.4},\"ratio\":{ratio:.3}");
        }
        if let (Some(p50), Some(p99)) = (r.baseline_p50_us, r.baseline_p99_us) {
            s += &format!(",\"baseline_p50_us\":{p50:.2},\"baseline_p99_us\":{p99:.2}");
        }
        println!("{s}}}");
    } else if r.op.ends_with("_latency") {
        let base = match (r.baseline_p50_us, r.baseline_p99_us) {
            (Some(a), Some(b)) => format!("   {} p50 {a:.1} us, p99 {b:.1} us", r.latency_ref),
            _ => String::new(),
        };
        println!(
            "{:<14} {:>9}   p50 {:>7.1} us   p99 {:>7.1} us   p999 {:>7.1} us{base}",
            r.op,
            fmt_size(r.block),
            r.p50_us,
            r.p99_us,
            r.p999_us
        );
    } else {
        let base = match (r.baseline_gbps, r.ratio) {
            (Some(b), Some(ratio)) => format!("{b:>10.3} {ratio:>7.2}"),
            _ => String::new(),
        };
        println!(
            "{:<6} {:>9} {:>6} {:>9.3} {:>11.0} {:>10.1} {:>10.1}{base}",
            r.op,
            fmt_size(r.block),
            r.batch,
            r.gbps,
            r.ops_per_s,
            r.p50_us,
            r.p99_us
        );
    }
}

pub fn run(a: Args) -> Result<()> {
    let o = parse(a)?;
    if let Some(list) = &o.streams_list {
        return scaling(&o, list);
    }
    let max = *o.sizes.iter().max().expect("at least one size");
    // Every submitting thread gets its own `batch` windows.
    let bytes =
        (max.saturating_mul(o.batch).saturating_mul(o.threads)).clamp(max, (1usize << 30).max(max));
    eprintln!(
        "ferry bench: starting target process ({} registered)",
        fmt_size(bytes)
    );
    set_env(&o);
    let peer_gpu = peer_gpu(&o)?;
    warn_spinners(&o);
    let (served, target_pid, _target) = start_target(&o, bytes, peer_gpu)?;
    let ep = own_endpoint(&o)?;
    let mut shard = ep.take_shards().pop();
    let conn = ep.add_remote(&served.meta)?;
    let shm = matches!(ep.peer(conn), Some(ferry::Peer::Local { .. }));
    let idle = open_idle(
        &ep,
        shard.as_mut(),
        &served.meta,
        o.idle_conns - 1,
        target_pid,
    )?;
    let conns = more_conns(&o, &ep, &mut shard, conn, &served)?;
    check_verbs(&o, &ep, &conns)?;
    let transport = transport_name(&o, shm);
    let (local, remote) = buffers(&o, &ep, shm, bytes, &served)?;
    let mut b = Bench {
        ep: &ep,
        shard,
        conns,
        turn: Default::default(),
        local,
        remote,
        latency_bytes: if o.ipc { 4096 } else { 8 },
        threads: o.threads,
    };
    let mut reference = make_reference(&o, &ep, shm, bytes, &served, peer_gpu)?;
    if !o.json {
        print_header(&o, &ep, transport, shm);
    }
    if let Some(c) = idle {
        report_idle(&mut b, &o, target_pid, &c)?;
    }
    let plotted = measure_points(&mut b, &o, &mut reference, transport, shm)?;
    if let Some(path) = &o.plot {
        write_plot(&o, transport, path, &plotted)?;
    }
    if o.latency {
        measure_latency(&mut b, &o, &mut reference, transport)?;
    }
    Ok(())
}

/// The variables both processes read (the target at start, we later).
fn set_env(o: &Opts) {
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
fn peer_gpu(o: &Opts) -> Result<Option<usize>> {
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
fn warn_spinners(o: &Opts) {
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
fn start_target(
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
fn own_endpoint(o: &Opts) -> Result<Endpoint> {
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
fn more_conns(
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
fn check_verbs(o: &Opts, ep: &Endpoint, conns: &[ConnId]) -> Result<()> {
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

fn transport_name(o: &Opts, shm: bool) -> &'static str {
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
fn host_buffer(ep: &Endpoint, shm: bool, bytes: usize) -> Result<MemoryRegion> {
    Ok(if shm {
        let m = ep.alloc_host(bytes)?;
        m.write_at(0, &vec![0x3cu8; bytes])?;
        m
    } else {
        ep.register(vec![0x3cu8; bytes])?
    })
}

/// Our buffer and the target's window.
fn buffers(
    o: &Opts,
    ep: &Endpoint,
    shm: bool,
    bytes: usize,
    served: &ferry_cli::testkit::Served,
) -> Result<(MemoryRegion, Remote)> {
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
        Remote::Ipc(served.ipc.context("the target printed no IPCBUF line")?)
    } else if o.device_gpu {
        Remote::Key(
            served
                .gpu_rbuf
                .context("the target printed no GRBUF line")?,
        )
    } else {
        Remote::Key(served.rbuf)
    };
    Ok((local, remote))
}

/// The same-run reference (--baseline).
fn make_reference(
    o: &Opts,
    ep: &Endpoint,
    shm: bool,
    bytes: usize,
    served: &ferry_cli::testkit::Served,
    peer_gpu: Option<usize>,
) -> Result<Option<Reference>> {
    Ok(match (o.baseline, o.ipc, shm) {
        (false, _, _) => None,
        (true, false, _) if o.device_gpu => Some(Reference::Host(
            host_buffer(ep, shm, bytes)?,
            Remote::Key(served.rbuf),
        )),
        (true, true, _) => Some(Reference::Gpu(GpuRef::new(
            o.gpu,
            peer_gpu.unwrap_or(0),
            o.pinned,
        ))),
        (true, false, false) => Some(Reference::Tcp(raw::RawPeer::spawn(
            ep.config().streams_per_conn.into(),
        )?)),
        (true, false, true) => Some(Reference::Memcpy(
            Vec::new(),
            Vec::new(),
            o.shards.unwrap_or(1),
        )),
    })
}

fn print_header(o: &Opts, ep: &Endpoint, transport: &'static str, shm: bool) {
    let base = match (o.baseline, o.ipc, shm) {
        (false, _, _) if o.contend > 0 => " quiet GB/s  ratio",
        (false, _, _) => "",
        (true, false, _) if o.device_gpu => "  host GB/s  ratio",
        (true, true, _) if o.pinned => "   H2D GB/s  ratio",
        (true, true, _) => "  peer GB/s  ratio",
        (true, false, false) => "  raw GB/s   ratio",
        (true, false, true) => " memcpy GB/s  ratio",
    };
    println!(
        "transport {transport}, control path {}, {} round(s) of {} s per point{}{}",
        ep.io_backend().0,
        o.rounds,
        o.seconds,
        if o.rounds > 1 { " (medians)" } else { "" },
        if o.contend > 0 {
            format!(", with {} busy process(es) beside it", o.contend)
        } else {
            String::new()
        }
    );
    println!(
        "{:<6} {:>9} {:>6} {:>9} {:>11} {:>10} {:>10}{base}",
        "op", "block", "batch", "GB/s", "ops/s", "p50 us", "p99 us"
    );
}

/// The idle probe (--idle-conns): each round 1 s idle, then one round
/// trip; with --baseline, the machine's floor for waking a parked thread,
/// measured the same way right after (raw::wake_after_idle_us).
fn report_idle(b: &mut Bench<'_>, o: &Opts, target_pid: u32, c: &IdleCost) -> Result<()> {
    let (mut cpu_here, mut cpu_there, mut rtts, mut floors) = (0.0, 0.0, vec![], vec![]);
    for _ in 0..o.rounds {
        let (h, t, rtt) = b.idle_probe(target_pid, 1.0)?;
        cpu_here += h / o.rounds as f64;
        cpu_there += t / o.rounds as f64;
        rtts.push(rtt);
        if o.baseline {
            floors.push(crate::raw::wake_after_idle_us(Duration::from_secs(1))?);
        }
    }
    let rtt_us = median(&rtts);
    let floor_us = (!floors.is_empty()).then(|| median(&floors));
    if o.json {
        let floor = floor_us.map_or(String::new(), |f| {
            format!(",\"wake_floor_us\":{f:.1},\"ratio\":{:.3}", rtt_us / f)
        });
        println!(
            "{{\"idle_conns\":{},\"open_s\":{:.3},\"rss_kib_each\":{:.1},\"target_rss_kib_each\":{:.1},\
             \"idle_cpu_pct\":{cpu_here:.3},\"target_idle_cpu_pct\":{cpu_there:.3},\"rtt_after_idle_us\":{rtt_us:.1},\
             \"rounds\":{}{floor}}}",
            c.n, c.open_s, c.here_kib_each, c.there_kib_each, o.rounds
        );
    } else {
        println!(
            "idle connections: {} opened in {:.2} s; resident memory {:.1} KiB each here, \
             {:.1} KiB each at the target",
            c.n, c.open_s, c.here_kib_each, c.there_kib_each
        );
        let list = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "idle for 1 s: CPU {cpu_here:.2} % of a core here, {cpu_there:.2} % at the target; \
             then one 8-byte WRITE round trip took {rtt_us:.1} us{} ({} us)",
            if o.rounds > 1 { " (median)" } else { "" },
            list(&rtts)
        );
        if let Some(f) = floor_us {
            println!(
                "waking a parked thread of this process after 1 s idle took {f:.1} us ({} us): \
                 ferry {:.2}x that",
                list(&floors),
                rtt_us / f
            );
        }
    }

    Ok(())
}

/// Every (size, op) point, --rounds times: one row each; returns the
/// chart's series.
fn measure_points(
    b: &mut Bench<'_>,
    o: &Opts,
    reference: &mut Option<Reference>,
    transport: &'static str,
    shm: bool,
) -> Result<Vec<crate::plot::Series>> {
    let ref_name = match (o.baseline, o.ipc, shm) {
        _ if o.contend > 0 => "quiet",
        (false, _, _) => "",
        (true, false, _) if o.device_gpu => "host memory",
        (true, true, _) if o.pinned => "pinned H2D",
        (true, true, _) => "peer copy",
        (true, false, false) => "raw tcp",
        (true, false, true) => "memcpy",
    };
    let mut plotted: Vec<crate::plot::Series> = Vec::new();
    let total = o.sizes.len() * o.ops.len();
    let mut i = 0;
    for &size in &o.sizes {
        for &op in &o.ops {
            i += 1;
            let (mut gbps, mut opss, mut lat, mut base, mut ratios) =
                (vec![], vec![], vec![], vec![], vec![]);
            let mut batch = o.batch;
            for r in 0..o.rounds {
                eprintln!(
                    "[{i}/{total}] {} {} round {}/{} ...",
                    op_name(op),
                    fmt_size(size),
                    r + 1,
                    o.rounds
                );
                let quiet = if o.contend > 0 {
                    Some(b.throughput(op, size, o.batch, o.seconds)?.0)
                } else {
                    None
                };
                let busy = (o.contend > 0)
                    .then(|| Contenders::start(o.contend))
                    .transpose()?;
                let (g, ops_per_s, l, b_used) = b.throughput(op, size, o.batch, o.seconds)?;
                drop(busy);
                if let Some(q) = quiet {
                    base.push(q);
                    ratios.push(g / q);
                }
                batch = b_used;
                gbps.push(g);
                opss.push(ops_per_s);
                lat.extend(l);
                if let Some(Reference::Host(hl, hr)) = reference {
                    // The same path with host buffers, on the same connection.
                    std::mem::swap(&mut b.local, hl);
                    std::mem::swap(&mut b.remote, hr);
                    let host = b.throughput(op, size, o.batch, o.seconds);
                    std::mem::swap(&mut b.local, hl);
                    std::mem::swap(&mut b.remote, hr);
                    let host = host?.0;
                    base.push(host);
                    ratios.push(g / host);
                } else if let Some(p) = reference {
                    let raw = p.gbps(op == OpKind::Read, size, b.slots(size), o.seconds)?;
                    base.push(raw);
                    ratios.push(g / raw);
                }
            }
            let lat = sorted(lat);
            let name = |who: &str| format!("{who} {}", op_name(op));
            crate::plot::add_point(&mut plotted, name("ferry"), false, size, median(&gbps));
            if !base.is_empty() {
                crate::plot::add_point(&mut plotted, name(ref_name), true, size, median(&base));
            }
            print_row(
                &Row {
                    transport,
                    op: op_name(op),
                    block: size,
                    batch,
                    gbps: median(&gbps),
                    ops_per_s: median(&opss),
                    p50_us: percentile(&lat, 0.5),
                    p99_us: percentile(&lat, 0.99),
                    p999_us: percentile(&lat, 0.999),
                    baseline_gbps: (!base.is_empty()).then(|| median(&base)),
                    ratio: (!ratios.is_empty()).then(|| median(&ratios)),
                    baseline_p50_us: None,
                    latency_ref: "",
                    baseline_p99_us: None,
                },
                o.json,
            );
            std::io::stdout().flush()?;
        }
    }
    Ok(plotted)
}

fn write_plot(
    o: &Opts,
    transport: &'static str,
    path: &str,
    plotted: &[crate::plot::Series],
) -> Result<()> {
    let mut title = format!("ferry bench --transport {transport}");
    for (flag, v) in [
        ("streams", o.streams.unwrap_or(1)),
        ("shards", o.shards.unwrap_or(1)),
        ("conns", o.conns),
        ("threads", o.threads),
        ("contend", o.contend),
    ] {
        if v > usize::from(flag != "contend") {
            title += &format!(" --{flag} {v}");
        }
    }
    std::fs::write(
        path,
        crate::plot::svg(&title, &crate::plot::BLOCK_SIZE, plotted),
    )
    .with_context(|| format!("writing {path}"))?;
    eprintln!("chart written to {path}");

    Ok(())
}

/// The one-op round trips (--latency), with the raw ping-pong or the
/// quiet figures beside them.
fn measure_latency(
    b: &mut Bench<'_>,
    o: &Opts,
    reference: &mut Option<Reference>,
    transport: &'static str,
) -> Result<()> {
    for &op in &o.ops {
        let (mut p50, mut p99, mut p999, mut b50, mut b99) =
            (vec![], vec![], vec![], vec![], vec![]);
        for r in 0..o.rounds {
            eprintln!(
                "latency: {} {} round trips, round {}/{} ...",
                op_name(op),
                fmt_size(b.latency_bytes),
                r + 1,
                o.rounds
            );
            if o.contend > 0 {
                let quiet = sorted(b.latency(op, o.seconds)?);
                b50.push(percentile(&quiet, 0.5));
                b99.push(percentile(&quiet, 0.99));
            }
            let busy = (o.contend > 0)
                .then(|| Contenders::start(o.contend))
                .transpose()?;
            let lat = sorted(b.latency(op, o.seconds)?);
            drop(busy);
            p50.push(percentile(&lat, 0.5));
            p99.push(percentile(&lat, 0.99));
            p999.push(percentile(&lat, 0.999));
            if let Some(Reference::Tcp(p)) = reference {
                let base = sorted(p.ping_pong_us(o.seconds)?);
                b50.push(percentile(&base, 0.5));
                b99.push(percentile(&base, 0.99));
            }
        }
        print_row(
            &Row {
                transport,
                op: if op == OpKind::Write {
                    "write_latency"
                } else {
                    "read_latency"
                },
                block: b.latency_bytes,
                batch: 1,
                gbps: 0.0,
                ops_per_s: 0.0,
                p50_us: median(&p50),
                p99_us: median(&p99),
                p999_us: median(&p999),
                baseline_gbps: None,
                ratio: None,
                baseline_p50_us: (!b50.is_empty()).then(|| median(&b50)),
                latency_ref: if o.contend > 0 {
                    "quiet"
                } else {
                    "raw tcp ping-pong"
                },
                baseline_p99_us: (!b99.is_empty()).then(|| median(&b99)),
            },
            o.json,
        );
    }

    Ok(())
}

/// What ferry is compared with: raw TCP between two processes, or a
/// single-thread memcpy (for the same-host path).
enum Reference {
    Tcp(raw::RawPeer),
    /// Source, destination, threads sharing each copy.
    Memcpy(Vec<u8>, Vec<u8>, usize),
    Gpu(GpuRef),
    /// ferry itself with host buffers (for --device gpu).
    Host(MemoryRegion, Remote),
}

/// cuMemcpyAsync in this process between the benchmark's two GPUs (or
/// pinned host memory and the target's GPU): what CUDA IPC should reach.
struct GpuRef {
    gpu: usize,
    peer_gpu: usize,
    pinned: bool,
    /// (near buffer, far buffer), grown to the footprint a point needs.
    bufs: Option<(MemoryRegion, MemoryRegion)>,
    /// The endpoints that allocated the buffers (dropped after them).
    eps: Vec<Endpoint>,
}

impl GpuRef {
    fn new(gpu: usize, peer_gpu: usize, pinned: bool) -> Self {
        Self {
            gpu,
            peer_gpu,
            pinned,
            bufs: None,
            eps: Vec::new(),
        }
    }

    fn gbps(&mut self, reverse: bool, size: usize, slots: usize, secs: f64) -> Result<f64> {
        let need = size * slots;
        if self.bufs.as_ref().map_or(true, |(a, _)| a.len() < need) {
            self.bufs = None;
            let mk = |g: usize| -> Result<Endpoint> {
                let mut c = Config::from_env()?;
                c.listen_addr = "127.0.0.1".parse()?;
                c.mode = Mode::Embedded;
                c.transport = Transport::Tcp;
                c.gpu = Some(g);
                Ok(Endpoint::builder().config(c).build()?)
            };
            let near_ep = mk(self.gpu)?;
            let far_ep = mk(self.peer_gpu)?;
            let near = if self.pinned {
                near_ep.alloc_pinned(need)?
            } else {
                near_ep.alloc_gpu(need)?
            };
            let far = far_ep.alloc_gpu(need)?;
            self.bufs = Some((near, far));
            self.eps = vec![near_ep, far_ep];
        }
        let (near, far) = self.bufs.as_ref().expect("allocated");
        let (dst, src) = if reverse {
            (near.addr(), far.addr())
        } else {
            (far.addr(), near.addr())
        };
        // SAFETY: `near` and `far` are live GPU allocations of `need` =
        // size * slots bytes each, held in `self.bufs`.
        Ok(unsafe {
            ferry::gpu::memory::copy_throughput(self.gpu as i32, dst, src, size, slots, 32, secs)?
        })
    }
}

impl Reference {
    fn gbps(&mut self, reverse: bool, size: usize, slots: usize, secs: f64) -> Result<f64> {
        match self {
            Reference::Tcp(p) => p.stream_gbps(reverse, size, slots, secs),
            Reference::Gpu(g) => g.gbps(reverse, size, slots, secs),
            Reference::Host(..) => unreachable!("measured through the Bench itself"),
            Reference::Memcpy(src, dst, threads) => {
                // Page-aligned source and destination: glibc's memcpy slows
                // down ~15x here when the destination sits just past the
                // source modulo 4 KiB, and the reference must not.
                let need = size * slots + 4096;
                if src.len() < need {
                    *src = vec![0x5a; need];
                    *dst = vec![0xa5; need];
                }
                let (s0, d0) = (
                    src.as_ptr().align_offset(4096),
                    dst.as_ptr().align_offset(4096),
                );
                let (src, dst) = (&src[s0..s0 + size * slots], &mut dst[d0..d0 + size * slots]);
                // Each block is copied by `threads` threads at once, a
                // slice each, as ferry's shards share one large copy.
                let n = (*threads).clamp(1, size.div_ceil(4096));
                let part = size.div_ceil(n).next_multiple_of(64).min(size);
                let dur = Duration::from_secs_f64(secs);
                let start = Instant::now();
                let mut bytes = 0u64;
                let mut k = 0usize;
                while start.elapsed() < dur {
                    let off = (k % slots) * size;
                    let (s, d) = (&src[off..off + size], &mut dst[off..off + size]);
                    // Small blocks are one thread's (as in ferry, which
                    // spreads copies of 1 MiB or more).
                    if n == 1 || size < 1 << 20 {
                        d.copy_from_slice(s);
                    } else {
                        std::thread::scope(|sc| {
                            for (dc, sc_) in d.chunks_mut(part).zip(s.chunks(part)) {
                                sc.spawn(move || dc.copy_from_slice(sc_));
                            }
                        });
                    }
                    std::hint::black_box(&mut d[0]);
                    k += 1;
                    bytes += size as u64;
                }
                Ok(bytes as f64 / start.elapsed().as_secs_f64() / 1e9)
            }
        }
    }
}

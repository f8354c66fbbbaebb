//! `ferry bench`: one-sided WRITE/READ throughput and latency between this
//! process (the initiator, driving its shard in embedded mode) and a target
//! process it spawns (`ferry serve`), optionally against raw TCP measured in
//! the same run.

use std::collections::VecDeque;
use std::io::{BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferry::testkit::read_served;
use ferry::{
    Config, ConnId, Endpoint, MemoryRegion, Mode, OpKind, RemoteBuf, Shard, Transfer, Transport,
};

use crate::args::{fmt_size, parse_size, Args};
use crate::raw;

pub const HELP: &str = "\
ferry bench: one-sided WRITE/READ throughput and latency over 127.0.0.1

Starts a target process (`ferry serve`), connects to it, and for each block
size and op keeps --batch operations in flight for --seconds, then prints
GB/s (1e9 B/s), ops/s and per-op latency percentiles. The initiator drives
its shard from the benchmark loop (embedded mode, busy-polling); the target
runs a managed shard.

Flags:
  --transport auto|tcp|shm
                         data path (default auto, which picks shm: the
                         target is a process on this host)
  --op write|read|both   operations to measure (default both)
  --sizes LIST           block sizes (default 4K,64K,1M,16M,64M)
  --batch N              operations in flight (default 32; capped so that
                         batch x block <= 1 GiB)
  --seconds S            measuring time per point (default 1)
  --latency              also 8-byte one-op round trips: p50/p99/p999 in us
  --baseline             also a reference measured in the same run, same
                         sizes, same memory footprint (blocks cycle through
                         as many distinct buffers as ferry's run), and
                         prints ferry's ratio to it. tcp: plain one-stream
                         TCP send/recv between two processes (and a TCP
                         ping-pong for --latency); shm: single-thread memcpy
  --rounds N             measure each point N times, alternating with the
                         baseline, and report medians (default 3 with
                         --baseline, else 1)
  --json                 one JSON object per line instead of a table
Environment: FERRY_* variables apply to both processes (see the README).";

struct Opts {
    transport: Transport,
    ops: Vec<OpKind>,
    sizes: Vec<usize>,
    batch: usize,
    seconds: f64,
    latency: bool,
    baseline: bool,
    json: bool,
    rounds: usize,
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
    baseline_p99_us: Option<f64>,
}

fn parse(mut a: Args) -> Result<Opts> {
    let transport = match a.value("transport").as_deref().unwrap_or("auto") {
        "auto" => Transport::Auto,
        "tcp" => Transport::Tcp,
        "shm" => Transport::Shm,
        t => bail!("--transport {t}: expected auto, tcp or shm (the transports this build has)"),
    };
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
    let o = Opts {
        transport,
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

/// A child process that is killed if we return early.
pub struct Peer(pub Child);

impl Drop for Peer {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn spawn_self(args: &[&str]) -> Result<Child> {
    let exe = std::env::current_exe().context("finding the ferry executable")?;
    Command::new(exe)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("spawning ferry {}", args.join(" ")))
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

struct Bench<'a> {
    ep: &'a Endpoint,
    shard: Shard,
    conn: ConnId,
    local: MemoryRegion,
    remote: RemoteBuf,
    spin: Duration,
}

impl Bench<'_> {
    fn submit(&self, op: OpKind, off: usize, size: usize) -> Result<Transfer> {
        let rb = self
            .remote
            .slice(off as u32, size as u32)
            .context("remote window")?;
        Ok(match op {
            OpKind::Write => self
                .ep
                .write_async(self.conn, &self.local, off, size, &rb)?,
            OpKind::Read => self.ep.read_async(self.conn, &self.local, off, size, &rb)?,
        })
    }

    /// Distinct `size`-byte windows the run cycles through.
    fn slots(&self, size: usize) -> usize {
        (self.local.len() / size)
            .min(self.remote.size as usize / size)
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
        let slots = (self.local.len() / size)
            .min(self.remote.size as usize / size)
            .max(1);
        let batch = batch.min(slots);
        // The pipeline is kept full from start to `end`; throughput counts
        // the operations that *complete* inside [warm_end, end], so bytes
        // queued before the window or drained after it never skew the rate.
        let warm = Duration::from_secs_f64((secs * 0.15).max(0.05));
        let t0 = Instant::now();
        let warm_end = t0 + warm;
        let end = warm_end + Duration::from_secs_f64(secs);
        let mut inflight: VecDeque<(Transfer, Instant)> = VecDeque::with_capacity(batch);
        let mut lat = Vec::with_capacity(1 << 20);
        let mut k = 0usize;
        let (mut first_done, mut last_done, mut done_in_window) = (None, warm_end, 0u64);
        let mut idle_since = Instant::now();
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
            if self.shard.poll() > 0 {
                idle_since = Instant::now();
            } else if idle_since.elapsed() >= self.spin {
                self.shard.park(Duration::from_millis(1));
            }
            let mut done_now = None;
            while let Some((t, _)) = inflight.front_mut() {
                match t.poll() {
                    None => break,
                    Some(r) => {
                        r.with_context(|| format!("{op} of {size} bytes"))?;
                        let (_, started) = inflight.pop_front().expect("front");
                        // One clock read per loop pass: reading it per op
                        // costs the initiator a visible share of its time.
                        let done = *done_now.get_or_insert_with(Instant::now);
                        if done >= warm_end && done < end {
                            if lat.len() < lat.capacity() {
                                lat.push((done - started).as_secs_f64() * 1e6);
                            }
                            first_done.get_or_insert(done);
                            last_done = done;
                            done_in_window += 1;
                        }
                    }
                }
            }
        }
        // Rate between the first and last completion in the window: the
        // bytes of the ops completed after the first one, over that time.
        let Some(first) = first_done.filter(|_| done_in_window >= 2) else {
            bail!(
                "{op} of {}: fewer than 2 operations completed in {secs} s; use a longer --seconds",
                fmt_size(size)
            );
        };
        let window = (last_done - first).as_secs_f64().max(1e-9);
        let ops = (done_in_window - 1) as f64;
        let bytes = ops * size as f64;
        Ok((bytes / window / 1e9, ops / window, lat, batch))
    }

    /// One op of 8 bytes at a time; returns latencies in us.
    fn latency(&mut self, op: OpKind, secs: f64) -> Result<Vec<f64>> {
        let end = Instant::now() + Duration::from_secs_f64(secs);
        let mut lat = Vec::with_capacity(1 << 20);
        let mut n = 0u64;
        while Instant::now() < end {
            let start = Instant::now();
            let mut t = self.submit(op, 0, 8)?;
            let r = loop {
                self.shard.poll();
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
            (Some(a), Some(b)) => format!("   raw tcp ping-pong p50 {a:.1} us, p99 {b:.1} us"),
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
    let max = *o.sizes.iter().max().expect("at least one size");
    let bytes = (max.saturating_mul(o.batch)).clamp(max, (1usize << 30).max(max));
    eprintln!(
        "ferry bench: starting target process ({} registered)",
        fmt_size(bytes)
    );
    let target_transport = if o.transport == Transport::Tcp {
        "tcp"
    } else {
        "auto"
    };
    std::env::set_var("FERRY_TRANSPORT", target_transport);
    let mut child = spawn_self(&["serve", "--bytes", &bytes.to_string()])?;
    let mut out = BufReader::new(child.stdout.take().context("child stdout")?);
    let _target = Peer(child);
    let served = read_served(&mut out).map_err(anyhow::Error::msg)?;

    let mut cfg = Config::from_env()?;
    cfg.listen_addr = "127.0.0.1".parse()?;
    cfg.mode = Mode::Embedded;
    cfg.shards = 1;
    cfg.transport = o.transport;
    let ep = Endpoint::builder().config(cfg).build()?;
    let shard = ep.take_shards().pop().context("embedded shard")?;
    let conn = ep.add_remote(&served.meta)?;
    let shm = matches!(ep.peer(conn), Some(ferry::Peer::Local { .. }));
    let transport = if shm { "shm" } else { "tcp" };
    // Touch every page now, as an application's live buffers are: first-touch
    // page faults would otherwise be measured as transfer time. On the
    // same-host path the buffer is memfd memory the target maps.
    let local = if shm {
        let m = ep.alloc_host(bytes)?;
        m.write_at(0, &vec![0x3cu8; bytes])?;
        m
    } else {
        ep.register(vec![0x3cu8; bytes])?
    };
    let spin = Duration::from_micros(ep.config().spin_us);
    let mut b = Bench {
        ep: &ep,
        shard,
        conn,
        local,
        remote: served.rbuf,
        spin,
    };

    let mut reference = match (o.baseline, shm) {
        (false, _) => None,
        (true, false) => Some(Reference::Tcp(raw::RawPeer::spawn()?)),
        (true, true) => Some(Reference::Memcpy(Vec::new(), Vec::new())),
    };
    if !o.json {
        let base = match (o.baseline, shm) {
            (false, _) => "",
            (true, false) => "  raw GB/s   ratio",
            (true, true) => "memcpy GB/s  ratio",
        };
        println!(
            "transport {transport}, control path {}, {} round(s) of {} s per point{}",
            ep.io_backend().0,
            o.rounds,
            o.seconds,
            if o.rounds > 1 { " (medians)" } else { "" }
        );
        println!(
            "{:<6} {:>9} {:>6} {:>9} {:>11} {:>10} {:>10}{base}",
            "op", "block", "batch", "GB/s", "ops/s", "p50 us", "p99 us"
        );
    }
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
                let (g, ops_per_s, l, b_used) = b.throughput(op, size, o.batch, o.seconds)?;
                batch = b_used;
                gbps.push(g);
                opss.push(ops_per_s);
                lat.extend(l);
                if let Some(p) = &mut reference {
                    let raw = p.gbps(op == OpKind::Read, size, b.slots(size), o.seconds)?;
                    base.push(raw);
                    ratios.push(g / raw);
                }
            }
            let lat = sorted(lat);
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
                    baseline_p99_us: None,
                },
                o.json,
            );
            std::io::stdout().flush()?;
        }
    }
    if o.latency {
        for &op in &o.ops {
            let (mut p50, mut p99, mut p999, mut b50, mut b99) =
                (vec![], vec![], vec![], vec![], vec![]);
            for r in 0..o.rounds {
                eprintln!(
                    "latency: {} 8 B round trips, round {}/{} ...",
                    op_name(op),
                    r + 1,
                    o.rounds
                );
                let lat = sorted(b.latency(op, o.seconds)?);
                p50.push(percentile(&lat, 0.5));
                p99.push(percentile(&lat, 0.99));
                p999.push(percentile(&lat, 0.999));
                if let Some(Reference::Tcp(p)) = &mut reference {
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
                    block: 8,
                    batch: 1,
                    gbps: 0.0,
                    ops_per_s: 0.0,
                    p50_us: median(&p50),
                    p99_us: median(&p99),
                    p999_us: median(&p999),
                    baseline_gbps: None,
                    ratio: None,
                    baseline_p50_us: (!b50.is_empty()).then(|| median(&b50)),
                    baseline_p99_us: (!b99.is_empty()).then(|| median(&b99)),
                },
                o.json,
            );
        }
    }
    Ok(())
}

/// What ferry is compared with: raw TCP between two processes, or a
/// single-thread memcpy (for the same-host path).
enum Reference {
    Tcp(raw::RawPeer),
    Memcpy(Vec<u8>, Vec<u8>),
}

impl Reference {
    fn gbps(&mut self, reverse: bool, size: usize, slots: usize, secs: f64) -> Result<f64> {
        match self {
            Reference::Tcp(p) => p.stream_gbps(reverse, size, slots, secs),
            Reference::Memcpy(src, dst) => {
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
                let dur = Duration::from_secs_f64(secs);
                let start = Instant::now();
                let (mut k, mut bytes) = (0usize, 0u64);
                while start.elapsed() < dur {
                    let off = (k % slots) * size;
                    dst[d0 + off..d0 + off + size].copy_from_slice(&src[s0 + off..s0 + off + size]);
                    std::hint::black_box(&mut dst[d0 + off]);
                    k += 1;
                    bytes += size as u64;
                }
                Ok(bytes as f64 / start.elapsed().as_secs_f64() / 1e9)
            }
        }
    }
}

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
use ferry::{Config, ConnId, Endpoint, MemoryRegion, Mode, OpKind, RemoteBuf, Shard, Transfer};

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
  --transport auto|tcp   data path (default auto; this build has tcp)
  --op write|read|both   operations to measure (default both)
  --sizes LIST           block sizes (default 4K,64K,1M,16M,64M)
  --batch N              operations in flight (default 32; capped so that
                         batch x block <= 1 GiB)
  --seconds S            measuring time per point (default 1)
  --latency              also 8-byte one-op round trips: p50/p99/p999 in us
  --baseline             also plain one-stream TCP send/recv between two
                         processes (and a TCP ping-pong for --latency), same
                         sizes, same run; prints ferry's ratio to it
  --json                 one JSON object per line instead of a table
Environment: FERRY_* variables apply to both processes (see the README).";

struct Opts {
    ops: Vec<OpKind>,
    sizes: Vec<usize>,
    batch: usize,
    seconds: f64,
    latency: bool,
    baseline: bool,
    json: bool,
}

struct Row {
    op: &'static str,
    block: usize,
    batch: usize,
    gbps: f64,
    ops_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    baseline_gbps: Option<f64>,
    baseline_p50_us: Option<f64>,
    baseline_p99_us: Option<f64>,
}

fn parse(mut a: Args) -> Result<Opts> {
    let transport = a.value("transport").unwrap_or_else(|| "auto".into());
    if transport != "auto" && transport != "tcp" {
        bail!("--transport {transport}: this build has the tcp transport only (auto picks it)");
    }
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
    let o = Opts {
        ops,
        sizes,
        batch,
        seconds,
        latency: a.switch("latency"),
        baseline: a.switch("baseline"),
        json: a.switch("json"),
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
        let warm = Duration::from_secs_f64((secs * 0.15).max(0.05));
        let t0 = Instant::now();
        let warm_end = t0 + warm;
        let end = warm_end + Duration::from_secs_f64(secs);
        let mut inflight: VecDeque<(Transfer, Instant)> = VecDeque::with_capacity(batch);
        let mut lat = Vec::with_capacity(1 << 20);
        let (mut k, mut bytes, mut ops) = (0usize, 0u64, 0u64);
        let mut last_done = warm_end;
        loop {
            let now = Instant::now();
            if now < end {
                while inflight.len() < batch {
                    let t = self.submit(op, (k % slots) * size, size)?;
                    inflight.push_back((t, Instant::now()));
                    k += 1;
                }
            } else if inflight.is_empty() {
                break;
            }
            self.shard.poll();
            while let Some((t, _)) = inflight.front_mut() {
                match t.poll() {
                    None => break,
                    Some(r) => {
                        r.with_context(|| format!("{op} of {size} bytes"))?;
                        let (_, started) = inflight.pop_front().expect("front");
                        let done = Instant::now();
                        if started >= warm_end && started < end {
                            if lat.len() < lat.capacity() {
                                lat.push((done - started).as_secs_f64() * 1e6);
                            }
                            bytes += size as u64;
                            ops += 1;
                            last_done = done;
                        }
                    }
                }
            }
        }
        let window = (last_done - warm_end).as_secs_f64().max(1e-9);
        Ok((bytes as f64 / window / 1e9, ops as f64 / window, lat, batch))
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
            "{{\"transport\":\"tcp\",\"op\":\"{}\",\"block_bytes\":{},\"batch\":{},",
            r.op, r.block, r.batch
        );
        if !r.op.ends_with("_latency") {
            s += &format!("\"gbps\":{:.4},\"ops_per_s\":{:.0},", r.gbps, r.ops_per_s);
        }
        s += &format!(
            "\"p50_us\":{:.2},\"p99_us\":{:.2},\"p999_us\":{:.2}",
            r.p50_us, r.p99_us, r.p999_us
        );
        if let Some(b) = r.baseline_gbps {
            s += &format!(",\"baseline_gbps\":{b:.4},\"ratio\":{:.3}", r.gbps / b);
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
        let base = match r.baseline_gbps {
            Some(b) => format!("{:>10.3} {:>7.2}", b, r.gbps / b),
            None => String::new(),
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
    let mut child = spawn_self(&["serve", "--bytes", &bytes.to_string()])?;
    let mut out = BufReader::new(child.stdout.take().context("child stdout")?);
    let _target = Peer(child);
    let served = read_served(&mut out).map_err(anyhow::Error::msg)?;

    let mut cfg = Config::from_env()?;
    cfg.listen_addr = "127.0.0.1".parse()?;
    cfg.mode = Mode::Embedded;
    cfg.shards = 1;
    let ep = Endpoint::builder().config(cfg).build()?;
    let shard = ep.take_shards().pop().context("embedded shard")?;
    let conn = ep.add_remote(&served.meta)?;
    // Touch every page now, as an application's live buffers are: first-touch
    // page faults would otherwise be measured as transfer time.
    let local = ep.register(vec![0x3cu8; bytes])?;
    let mut b = Bench {
        ep: &ep,
        shard,
        conn,
        local,
        remote: served.rbuf,
    };

    let raw_peer = if o.baseline {
        Some(raw::RawPeer::spawn()?)
    } else {
        None
    };
    if !o.json {
        let base = if o.baseline { "  raw GB/s   ratio" } else { "" };
        println!("transport tcp, control path {}", ep.io_backend().0);
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
            eprintln!("[{i}/{total}] {} {} ...", op_name(op), fmt_size(size));
            let (gbps, ops_per_s, lat, batch) = b.throughput(op, size, o.batch, o.seconds)?;
            let lat = sorted(lat);
            let baseline_gbps = match &raw_peer {
                Some(p) => Some(p.stream_gbps(op == OpKind::Read, size, o.seconds)?),
                None => None,
            };
            print_row(
                &Row {
                    op: op_name(op),
                    block: size,
                    batch,
                    gbps,
                    ops_per_s,
                    p50_us: percentile(&lat, 0.5),
                    p99_us: percentile(&lat, 0.99),
                    p999_us: percentile(&lat, 0.999),
                    baseline_gbps,
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
            eprintln!("latency: {} 8 B round trips ...", op_name(op));
            let lat = sorted(b.latency(op, o.seconds)?);
            let base = match &raw_peer {
                Some(p) => Some(sorted(p.ping_pong_us(o.seconds)?)),
                None => None,
            };
            print_row(
                &Row {
                    op: if op == OpKind::Write {
                        "write_latency"
                    } else {
                        "read_latency"
                    },
                    block: 8,
                    batch: 1,
                    gbps: 0.0,
                    ops_per_s: 0.0,
                    p50_us: percentile(&lat, 0.5),
                    p99_us: percentile(&lat, 0.99),
                    p999_us: percentile(&lat, 0.999),
                    baseline_gbps: None,
                    baseline_p50_us: base.as_ref().map(|v| percentile(v, 0.5)),
                    baseline_p99_us: base.as_ref().map(|v| percentile(v, 0.99)),
                },
                o.json,
            );
        }
    }
    Ok(())
}

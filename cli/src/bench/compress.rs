//! `ferry bench --compress MODE`: payload throughput of typed memory over
//! tcp with the codec (issue 27) and without it, in the same run, over
//! loopback or a link shaped to `--link-gbit`.

use std::collections::VecDeque;
use std::io::BufReader;
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferry::codec::FloatType;
use ferry::{Compress, CompressStats, Config, ConnId, Endpoint, MemoryRegion, OpKind, Transport};
use ferry_cli::testkit::{cpu_ns, fnv64, read_served};

use crate::args::{fmt_size, Args};
use crate::child::spawn_self;

use super::link::{Link, OURS, THEIRS};

pub const HELP: &str = "\
ferry bench --compress off|auto|on --dtype T --data FILE|random [flags]

Moves one typed buffer (registered with --dtype) over tcp to a target
process, alternating each round between a connection that compresses
(--compress; the target runs with the same FERRY_COMPRESS) and one that
does not (FERRY_COMPRESS=off on this side), and prints payload GB/s of
both, their ratio, the compression ratio and the CPU each side used
(% of one core over the round), medians of --rounds.

  --dtype T              bf16, fp16, fp32, fp8 (e4m3), fp8-e5m2, bytes
  --data FILE|random     the bytes moved: a file of real tensor values of
                         that type (benches/fetch_weights.py makes them;
                         repeated to fill the buffer), or random bytes (what
                         does not compress: the bypass)
  --device host|gpu      where both sides' buffers live (default host;
                         gpu: GPU 0 of each process, staged through
                         pinned bounce buffers)
  --link-gbit N          run the target in a network namespace behind a
                         veth shaped by tc tbf to N Gbit/s each way (root)
  --op write|read|both   (default both)
  --sizes LIST           block sizes (default 64M)
  --inflight N           ops in flight (default 2)
  --seconds S            per round and side (default 2; at least 2 ops)
  --rounds N             (default 3)
Environment: FERRY_COMPRESS_THREADS (both processes), other FERRY_*.";

struct Opts {
    mode: Compress,
    dtype: FloatType,
    data: String,
    link_gbit: Option<f64>,
    gpu: bool,
    ops: Vec<OpKind>,
    sizes: Vec<usize>,
    inflight: usize,
    seconds: f64,
    rounds: usize,
}

fn parse(mode: &str, mut a: Args) -> Result<Opts> {
    let mode = match mode {
        "off" => Compress::Off,
        "auto" => Compress::Auto,
        "on" => Compress::On,
        m => bail!("--compress {m}: expected off, auto or on"),
    };
    let dt = a.value("dtype").context("--compress needs --dtype")?;
    let dtype = FloatType::parse(&dt).with_context(|| format!("--dtype {dt}: unknown type"))?;
    let data = a
        .value("data")
        .context("--compress needs --data FILE (real tensor bytes) or --data random")?;
    let link_gbit: Option<f64> = a.value("link-gbit").map(|v| v.parse()).transpose()?;
    if link_gbit.is_some_and(|g| !(0.001..=400.0).contains(&g)) {
        bail!("--link-gbit: must be in 0.001..=400");
    }
    let (ops, messages) = super::opts::parse_ops(&mut a)?;
    if messages {
        anyhow::bail!("--op send: not a compression benchmark (use ferry bench)");
    }
    let sizes = super::opts::parse_sizes(&mut a, "64M", (1 << 30, "1 GiB"))?;
    let o = Opts {
        mode,
        dtype,
        data,
        link_gbit,
        gpu: match a.value("device").as_deref().unwrap_or("host") {
            "host" => false,
            "gpu" => true,
            d => bail!("--device {d}: expected host or gpu"),
        },
        ops,
        sizes,
        inflight: a.parsed("inflight", 2)?,
        seconds: a.parsed("seconds", 2.0)?,
        rounds: a.parsed("rounds", 3)?,
    };
    if o.inflight == 0 || o.inflight > 64 || o.rounds == 0 || o.rounds > 100 {
        bail!("--inflight must be 1..=64 and --rounds 1..=100");
    }
    if !(o.seconds > 0.0 && o.seconds <= 600.0) {
        bail!("--seconds: must be in (0, 600]");
    }
    a.finish()?;
    Ok(o)
}

/// `len` bytes of `spec`: a file's bytes repeated, or random bytes.
pub(crate) fn load_data(spec: &str, len: usize) -> Result<Vec<u8>> {
    if spec == "random" {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        return Ok((0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect());
    }
    let file = std::fs::read(spec).with_context(|| format!("--data {spec}"))?;
    if file.is_empty() {
        bail!("--data {spec}: empty");
    }
    Ok(file.iter().copied().cycle().take(len).collect())
}

/// `ferry serve` with the buffer typed and filled from `--data`: here, or
/// in the link's far namespace.
fn start_target(o: &Opts, mode: &str, link: Option<&Link>, max: usize) -> Result<Child> {
    std::env::set_var("FERRY_TRANSPORT", "tcp");
    std::env::set_var("FERRY_COMPRESS", mode);
    let exe = std::env::current_exe()?;
    let exe = exe.to_str().context("executable path")?;
    let max_s = max.to_string();
    let mut serve = vec![
        "serve",
        "--bytes",
        &max_s,
        "--dtype",
        o.dtype.name(),
        "--data",
        &o.data,
        "--listen",
        if link.is_some() { THEIRS } else { "127.0.0.1" },
    ];
    if o.gpu {
        serve.extend(["--gpu", "0"]);
    }
    let child = match link {
        Some(l) => std::process::Command::new("ip")
            .args(["netns", "exec", &l.theirs, exe])
            .args(&serve)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .context("ip netns exec ferry serve")?,
        None => spawn_self(&serve)?,
    };
    Ok(child)
}

fn print_header(o: &Opts, mode: &str, data_len: usize) {
    let threads = std::env::var("FERRY_COMPRESS_THREADS").unwrap_or_else(|_| "default".into());
    println!(
        "ferry bench --compress {mode}: {} from {} ({}, {} memory), link {}, codec threads {threads}",
        o.dtype.name(),
        o.data,
        fmt_size(data_len),
        if o.gpu { "GPU" } else { "host" },
        o.link_gbit
            .map_or("loopback (unshaped)".to_owned(), |g| format!("{g} Gbit/s (tbf)")),
    );
    println!(
        "{:<6} {:>6} {:>10} {:>10} {:>7} {:>8} {:>18} {:>18}",
        "op", "size", "off GB/s", "GB/s", "ratio", "packed", "cpu% off us/them", "cpu% us/them"
    );
}

/// One side of the comparison: an endpoint, its connection to the target.
struct Side {
    ep: Endpoint,
    conn: ConnId,
}

fn endpoint(mode: Compress, listen: &str, gpu: bool) -> Result<Endpoint> {
    let mut cfg = Config::from_env()?;
    if gpu {
        cfg.gpu = Some(0);
    }
    cfg.listen_addr = listen.parse()?;
    cfg.transport = Transport::Tcp;
    cfg.compress = mode;
    Ok(Endpoint::builder().config(cfg).build()?)
}

/// What one round measured.
#[derive(Clone, Copy, Default)]
struct Round {
    gbps: f64,
    /// % of one core, this process and the target.
    cpu_ours: f64,
    cpu_theirs: f64,
    /// Payload bytes per wire byte of what went packed (1: none did).
    packing: f64,
}

fn packing(before: Option<CompressStats>, after: Option<CompressStats>, op: OpKind) -> f64 {
    let (Some(b), Some(a)) = (before, after) else {
        return 1.0;
    };
    let (raw, wire) = match op {
        OpKind::Write => (a.raw_bytes - b.raw_bytes, a.wire_bytes - b.wire_bytes),
        OpKind::Read => (
            a.unpacked_bytes - b.unpacked_bytes,
            a.unpacked_wire_bytes - b.unpacked_wire_bytes,
        ),
    };
    if wire == 0 {
        1.0
    } else {
        raw as f64 / wire as f64
    }
}

#[allow(clippy::too_many_arguments)]
fn measure(
    s: &Side,
    local: &MemoryRegion,
    win: &ferry::RemoteBuf,
    op: OpKind,
    size: usize,
    o: &Opts,
    target_pid: u32,
) -> Result<Round> {
    let (c0, t0, st0) = (
        cpu_ns(std::process::id()),
        cpu_ns(target_pid),
        s.ep.compress_stats(),
    );
    let start = Instant::now();
    let (mut moved, mut ops) = (0usize, 0usize);
    let mut q = VecDeque::new();
    let w = win.slice(0, size as u32).context("window")?;
    while start.elapsed().as_secs_f64() < o.seconds || ops < 2 {
        while q.len() < o.inflight {
            q.push_back(match op {
                OpKind::Write => s.ep.write_async(s.conn, local, 0, size, &w)?,
                OpKind::Read => s.ep.read_async(s.conn, local, 0, size, &w)?,
            });
        }
        q.pop_front().expect("one in flight").wait()?;
        moved += size;
        ops += 1;
    }
    for t in q.drain(..) {
        t.wait()?;
        moved += size;
    }
    let secs = start.elapsed().as_secs_f64();
    let core = |ns: u64| ns as f64 / 1e9 / secs * 100.0;
    Ok(Round {
        gbps: moved as f64 / secs / 1e9,
        cpu_ours: core(cpu_ns(std::process::id()) - c0),
        cpu_theirs: core(cpu_ns(target_pid).saturating_sub(t0)),
        packing: packing(st0, s.ep.compress_stats(), op),
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Asks the target for the fnv64 of `[0, len)` of its buffer.
fn target_hash(s: &Side, len: usize, gpu: bool) -> Result<u64> {
    let what = if gpu { "ghash" } else { "hash" };
    s.ep.send_notification(s.conn, format!("{what} 0 {len}").as_bytes())?;
    let (_, msg) = s.ep.recv_notification(Duration::from_secs(30))?;
    let text = String::from_utf8_lossy(&msg).into_owned();
    let hex = text.strip_prefix("hash ").context("target's hash reply")?;
    Ok(u64::from_str_radix(hex.trim(), 16)?)
}

pub fn run(mode: &str, a: Args) -> Result<()> {
    let o = parse(mode, a)?;
    let max = *o.sizes.iter().max().expect("a size");
    let data = load_data(&o.data, max)?;
    let link = o.link_gbit.map(Link::make).transpose()?;
    if let Some(l) = &link {
        l.enter()?;
    }
    let listen = if link.is_some() { OURS } else { "127.0.0.1" };
    let mut child = start_target(&o, mode, link.as_ref(), max)?;
    let target_pid = child.id();
    let mut out = BufReader::new(child.stdout.take().context("child stdout")?);
    let served = read_served(&mut out).map_err(anyhow::Error::msg)?;
    let side = |m| -> Result<Side> {
        let ep = endpoint(m, listen, o.gpu)?;
        let conn = ep.add_remote(&served.meta)?;
        Ok(Side { ep, conn })
    };
    let (plain, packed) = (side(Compress::Off)?, side(o.mode)?);
    let alloc = |ep: &Endpoint| -> Result<MemoryRegion> {
        let mr = if o.gpu {
            ep.alloc_gpu(max)?
        } else {
            ep.alloc(max)?
        };
        Ok(mr.with_dtype(o.dtype))
    };
    let (local, local_b) = (alloc(&plain.ep)?, alloc(&packed.ep)?);
    let window = if o.gpu {
        served.gpu_rbuf.context("the target has no GPU region")?
    } else {
        served.rbuf
    };
    local.write_at(0, &data)?;
    local_b.write_at(0, &data)?;
    print_header(&o, mode, data.len());
    for &op in &o.ops {
        for &size in &o.sizes {
            let (mut off, mut on) = (Vec::new(), Vec::new());
            for _ in 0..o.rounds {
                off.push(measure(&plain, &local, &window, op, size, &o, target_pid)?);
                on.push(measure(
                    &packed, &local_b, &window, op, size, &o, target_pid,
                )?);
            }
            let m = |v: &[Round], f: fn(&Round) -> f64| median(v.iter().map(f).collect());
            let (g_off, g_on) = (m(&off, |r| r.gbps), m(&on, |r| r.gbps));
            println!(
                "{:<6} {:>6} {:>10.3} {:>10.3} {:>7.2} {:>7.2}x {:>8.0}/{:<9.0} {:>8.0}/{:<9.0}",
                format!("{op:?}").to_lowercase(),
                fmt_size(size),
                g_off,
                g_on,
                g_on / g_off,
                m(&on, |r| r.packing),
                m(&off, |r| r.cpu_ours),
                m(&off, |r| r.cpu_theirs),
                m(&on, |r| r.cpu_ours),
                m(&on, |r| r.cpu_theirs),
            );
            if op == OpKind::Write {
                let want = fnv64(&data[..size]);
                if target_hash(&packed, size, o.gpu)? != want {
                    bail!("the target's bytes differ from what was written");
                }
            }
        }
    }
    if o.ops.contains(&OpKind::Read) {
        let mut got = vec![0u8; max];
        local_b.read_at(0, &mut got)?;
        if got != data {
            bail!("the bytes read differ from the target's");
        }
    }
    drop(child.stdin.take());
    let _ = child.wait();
    Ok(())
}

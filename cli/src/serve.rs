//! `ferry serve`: a target endpoint in its own process. It registers memory,
//! prints what a peer needs on stdout, accepts connections and answers a few
//! text notifications, until its stdin closes.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use ferry::{Access, Config, Endpoint};
use ferry_cli::testkit::{fill_pattern, fnv64, hex};

use crate::args::{parse_size, Args};

pub const HELP: &str = "\
ferry serve: run a target endpoint until stdin closes

Registers --bytes of memory filled with the test pattern (seed --seed),
plus a 4 KiB read-only and a 4 KiB write-only region, prints

  META <hex endpoint metadata>
  RBUF <hex RemoteBuf of the whole region>
  RBUF_RO <hex RemoteBuf>   RBUF_WO <hex RemoteBuf>
  IPCBUF <hex IpcBuf of the whole GPU region>   (with --gpu)
  GRBUF <hex RemoteBuf of the whole GPU region> (with --gpu)
  METRICS <address of the metrics listener>     (with --metrics)
  READY

and accepts connections in the background. Notifications it answers:
  hash OFF LEN      -> \"hash <fnv64 of the bytes, hex>\"
  fill OFF LEN SEED -> refills with the pattern, \"ok\"
  ghash OFF LEN / gfill OFF LEN SEED: the same on the GPU region
  drop-gpu          -> deregisters the GPU region, \"ok\"
  new-gpu           -> after drop-gpu: a new GPU region of --bytes (the
                       driver often hands back the same base; its bytes
                       are not set), \"ipcbuf <hex IpcBuf>\"
  echo TEXT         -> \"echo TEXT\"
  msg-echo COUNT LEN -> \"ok\", then receives up to COUNT two-sided
                       messages of at most LEN bytes and sends each back
                       (until an empty one, or a second without one)

Flags:
  --bytes SIZE     memory to register (default 64M; K/M/G suffixes)
  --seed N         pattern seed, 0-255 (default 0)
  --listen ADDR    address to listen on (default 127.0.0.1)
  --port N         port to listen on (default: FERRY_LISTEN_PORT, else any)
  --shards N       shards (default: FERRY_SHARDS, else 1)
  --dtype T        register the memory with value type T (bf16, fp16,
                   fp32, fp8, fp8-e5m2, bytes): peers may compress
                   what they move of it (FERRY_COMPRESS)
  --data FILE|random
                   fill the memory with FILE's bytes (repeated) or
                   random bytes instead of the pattern
  --gpu IDX        also allocate --bytes on GPU IDX, filled with the
                   pattern, advertised for CUDA IPC (IPCBUF line)
  --directory URL --name NAME [--cluster C]
                   also publish the endpoint in etcd at URL as NAME
                   (cluster default ferry), with windows main, ro, wo
                   (and ipc, gpu with --gpu), under a lease of --ttl
                   seconds (default 10) that this process keeps alive;
                   a NAME a live endpoint holds is refused unless
                   --replace (that endpoint then stops renewing it);
                   needs a build with the `directory` feature
  --metrics HOST:PORT
                   serve the endpoint's metrics there (GET /metrics,
                   the Prometheus text format; port 0 picks one, see
                   the METRICS line); `ferry stat HOST:PORT` reads them
SIGUSR1 prints a summary of the metrics (as `ferry stat`) to stderr.
Environment: every FERRY_* variable (see the README).";

/// The most `--bytes` may ask: what this machine has available now
/// (`/proc/meminfo` MemAvailable; the buffer is filled, so every page is
/// touched), and never more than 1 TiB.
fn check_bytes(bytes: usize, available: Option<usize>) -> Result<()> {
    const MAX_BYTES: usize = 1 << 40;
    let limit = available.map_or(MAX_BYTES, |a| a.min(MAX_BYTES));
    if bytes == 0 || bytes > limit {
        bail!(
            "--bytes {bytes}: must be 1..={limit} (the memory available here{})",
            if limit == MAX_BYTES {
                ", at most 1 TiB"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// MemAvailable from /proc/meminfo, in bytes.
fn available_memory() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_ascii_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// What the served memory holds: `--data`'s bytes, else the pattern.
fn contents(data: &Option<String>, bytes: usize, seed: u8) -> Result<Vec<u8>> {
    Ok(match data {
        Some(spec) => crate::bench::compress::load_data(spec, bytes)?,
        None => {
            let mut b = vec![0u8; bytes];
            fill_pattern(&mut b, 0, seed);
            b
        }
    })
}

pub fn run(mut a: Args) -> Result<()> {
    let bytes = parse_size(&a.value("bytes").unwrap_or_else(|| "64M".into()))?;
    check_bytes(bytes, available_memory())?;
    let seed: u8 = a.parsed("seed", 0)?;
    let listen = a.value("listen").unwrap_or_else(|| "127.0.0.1".into());
    let port: u16 = a.parsed("port", 0)?;
    let shards: Option<usize> = a
        .value("shards")
        .map(|v| v.parse())
        .transpose()
        .context("--shards")?;
    let replace = a.switch("replace");
    let directory = match (a.value("directory"), a.value("name")) {
        (Some(url), Some(name)) => Some((
            url,
            a.value("cluster").unwrap_or_else(|| "ferry".into()),
            name,
        )),
        _ if replace => bail!("--replace goes with --directory and --name"),
        (None, None) => None,
        _ => bail!("--directory and --name go together"),
    };
    let ttl = Duration::from_secs(a.parsed("ttl", 10u64)?);
    let dtype = match a.value("dtype") {
        Some(t) => Some(
            ferry::codec::FloatType::parse(&t).with_context(|| format!("--dtype {t}: unknown"))?,
        ),
        None => None,
    };
    let data = a.value("data");
    let metrics = a
        .value("metrics")
        .map(|m| crate::stat::bind(&m))
        .transpose()?;
    let gpu: Option<usize> = a
        .value("gpu")
        .map(|v| v.parse())
        .transpose()
        .context("--gpu")?;
    a.finish()?;
    let mut cfg = Config::from_env()?;
    cfg.listen_addr = listen
        .parse()
        .with_context(|| format!("--listen {listen}"))?;
    if port != 0 {
        cfg.listen_port = port;
    }
    if let Some(n) = shards {
        cfg.shards = n;
    }
    cfg.gpu = gpu;
    let ep = Endpoint::builder().config(cfg).build()?;
    let main = ep.register(contents(&data, bytes, seed)?)?;
    main.set_dtype(dtype);
    let ro = ep.register_with(vec![7u8; 4096], Access::REMOTE_READ)?;
    let wo = ep.register_with(vec![0u8; 4096], Access::REMOTE_WRITE)?;
    let gmr = match gpu {
        Some(_) => {
            let g = ep.alloc_gpu(bytes)?;
            g.write_at(0, &contents(&data, bytes, seed)?)?;
            g.set_dtype(dtype);
            Some(g)
        }
        None => None,
    };
    let rb =
        |m: &ferry::MemoryRegion| -> Result<String> { Ok(hex(&m.advertise(0, m.len())?.encode())) };
    ep.start_passive_accept()?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "META {}", hex(&ep.metadata_bytes()))?;
    writeln!(out, "RBUF {}", rb(&main)?)?;
    writeln!(out, "RBUF_RO {}", rb(&ro)?)?;
    writeln!(out, "RBUF_WO {}", rb(&wo)?)?;
    if let Some(g) = &gmr {
        writeln!(
            out,
            "IPCBUF {}",
            hex(&g.advertise_ipc(0, g.len())?.encode())
        )?;
        writeln!(out, "GRBUF {}", rb(g)?)?;
    }
    let windows = named_windows(&main, &ro, &wo, gmr.as_ref())?;
    let _published = match &directory {
        Some((url, cluster, name)) => Some(crate::dir::publish(
            &ep, url, cluster, name, ttl, replace, &windows,
        )?),
        None => None,
    };
    if let Some(l) = &metrics {
        writeln!(out, "METRICS {}", l.local_addr()?)?;
    }
    // Before READY: a SIGUSR1 sent as soon as READY is read must find the
    // handler (its default action ends the process; CI saw that).
    on_usr1_print_summary();
    writeln!(out, "READY")?;
    out.flush()?;
    drop(out);
    answer_and_scrape(&ep, metrics.as_ref(), &main, gmr, gpu, bytes)
}

/// The windows `--directory` publishes, by name.
fn named_windows(
    main: &ferry::MemoryRegion,
    ro: &ferry::MemoryRegion,
    wo: &ferry::MemoryRegion,
    gmr: Option<&ferry::MemoryRegion>,
) -> Result<Vec<(&'static str, Vec<u8>)>> {
    let mut windows = vec![
        ("main", main.advertise(0, main.len())?.encode().to_vec()),
        ("ro", ro.advertise(0, ro.len())?.encode().to_vec()),
        ("wo", wo.advertise(0, wo.len())?.encode().to_vec()),
    ];
    if let Some(g) = gmr {
        windows.push(("ipc", g.advertise_ipc(0, g.len())?.encode().to_vec()));
        windows.push(("gpu", g.advertise(0, g.len())?.encode().to_vec()));
    }
    Ok(windows)
}

/// Answers requests until stdin closes, and scrapes on the metrics
/// listener meanwhile (SIGUSR1, whose handler is in place already: a
/// summary on stderr).
fn answer_and_scrape(
    ep: &Endpoint,
    metrics: Option<&std::net::TcpListener>,
    main: &ferry::MemoryRegion,
    gmr: Option<ferry::MemoryRegion>,
    gpu: Option<usize>,
    bytes: usize,
) -> Result<()> {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        if let Some(l) = metrics {
            s.spawn(|| crate::stat::serve(l, ep, &stop));
        }
        let r = answer_until_stdin_closes(ep, main, gmr, gpu, bytes);
        stop.store(true, Ordering::Relaxed);
        r
    })
}

/// Set by SIGUSR1, taken by the answering loop.
static USR1: AtomicBool = AtomicBool::new(false);

extern "C" fn on_usr1(_: libc::c_int) {
    USR1.store(true, Ordering::Relaxed);
}

fn on_usr1_print_summary() {
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe { libc::signal(libc::SIGUSR1, on_usr1 as *const () as libc::sighandler_t) };
}

/// Answers requests on notifications (`answer`, and the GPU region's
/// `drop-gpu` / `new-gpu`) until stdin closes.
fn answer_until_stdin_closes(
    ep: &Endpoint,
    main: &ferry::MemoryRegion,
    mut gmr: Option<ferry::MemoryRegion>,
    gpu: Option<usize>,
    bytes: usize,
) -> Result<()> {
    let closed = Arc::new(AtomicBool::new(false));
    let c2 = closed.clone();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::stdin().lock().read_to_end(&mut sink);
        c2.store(true, Ordering::SeqCst);
    });
    while !closed.load(Ordering::SeqCst) {
        if USR1.swap(false, Ordering::Relaxed) {
            eprint!("{}", crate::stat::summary(&ep.metrics_text()));
        }
        let Ok((conn, msg)) = ep.recv_notification(Duration::from_millis(50)) else {
            continue;
        };
        if msg == b"drop-gpu" {
            let r = match gmr.take() {
                Some(g) => ep.deregister(g).map(|_| "ok".to_owned()),
                None => Ok("error no GPU region".to_owned()),
            };
            let reply = r.unwrap_or_else(|e| format!("error {e}"));
            let _ = ep.send_notification(conn, reply.as_bytes());
            continue;
        }
        if msg == b"new-gpu" {
            let reply = match (&gmr, gpu) {
                (Some(_), _) => "error the GPU region is still there (drop-gpu first)".to_owned(),
                (None, None) => "error no GPU (serve --gpu)".to_owned(),
                (None, Some(_)) => match ep
                    .alloc_gpu(bytes)
                    .and_then(|g| Ok((g.advertise_ipc(0, g.len())?, g)))
                {
                    Ok((ipc, g)) => {
                        gmr = Some(g);
                        format!("ipcbuf {}", hex(&ipc.encode()))
                    }
                    Err(e) => format!("error {e}"),
                },
            };
            let _ = ep.send_notification(conn, reply.as_bytes());
            continue;
        }
        if let Some(args) = msg.strip_prefix(b"msg-echo ") {
            // Answered first; then the echo runs here (no other request is
            // answered meanwhile) until its count or a quiet second.
            match parse_echo(args) {
                Ok((count, len)) => {
                    let _ = ep.send_notification(conn, b"ok");
                    if let Err(e) = echo_messages(ep, conn, count, len) {
                        eprintln!("ferry serve: msg-echo on {conn}: {e}");
                    }
                }
                Err(e) => {
                    let _ = ep.send_notification(conn, format!("error {e}").as_bytes());
                }
            }
            continue;
        }
        let reply = match answer(main, gmr.as_ref(), &msg) {
            Ok(r) => r,
            Err(e) => format!("error {e}"),
        };
        if let Err(e) = ep.send_notification(conn, reply.as_bytes()) {
            eprintln!("ferry serve: reply to {conn}: {e}");
        }
    }
    Ok(())
}

/// `COUNT LEN` of a `msg-echo` request (LEN at most 64 MiB).
fn parse_echo(args: &[u8]) -> Result<(usize, usize)> {
    let text = std::str::from_utf8(args)?;
    let w: Vec<&str> = text.split_whitespace().collect();
    let [count, len] = w[..] else {
        bail!("msg-echo COUNT LEN");
    };
    let (count, len): (usize, usize) = (count.parse()?, len.parse()?);
    if len == 0 || len > 64 << 20 {
        bail!("msg-echo: LEN {len} must be 1..=67108864");
    }
    Ok((count, len))
}

/// Receives up to `count` two-sided messages of at most `len` bytes on
/// `conn` and sends each back, until an empty one (echoed too: the end)
/// or a second without one.
fn echo_messages(ep: &Endpoint, conn: ferry::ConnId, count: usize, len: usize) -> Result<()> {
    let buf = ep.alloc(len)?;
    for _ in 0..count {
        let r = ep.recv_async(conn, &buf, 0, len)?;
        let n = match ep.wait_message(r, Duration::from_secs(1)) {
            Ok(n) => n,
            Err(ferry::Error::Timeout { .. }) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let s = ep.send_async(conn, &buf, 0, n)?;
        ep.wait_message(s, Duration::from_secs(10))?;
        if n == 0 {
            return Ok(());
        }
    }
    Ok(())
}

fn answer(
    main: &ferry::MemoryRegion,
    gpu: Option<&ferry::MemoryRegion>,
    msg: &[u8],
) -> Result<String> {
    let text = std::str::from_utf8(msg)?;
    let w: Vec<&str> = text.split_whitespace().collect();
    let num = |i: usize| -> Result<usize> { Ok(w.get(i).context("missing argument")?.parse()?) };
    let g = || gpu.context("no GPU region (serve --gpu)");
    // A peer names the range: check it against the region before
    // allocating anything of its size.
    let buf_for = |mr: &ferry::MemoryRegion, off: usize, len: usize| -> Result<Vec<u8>> {
        match off.checked_add(len) {
            Some(end) if end <= mr.len() => Ok(vec![0u8; len]),
            _ => bail!("range {off}+{len} outside the {}-byte region", mr.len()),
        }
    };

    match w.first().copied() {
        Some("ghash") => {
            let (off, len) = (num(1)?, num(2)?);
            let mut b = buf_for(g()?, off, len)?;
            g()?.read_at(off, &mut b)?;
            Ok(format!("hash {:016x}", fnv64(&b)))
        }
        Some("gfill") => {
            let (off, len, seed) = (num(1)?, num(2)?, num(3)?);
            let mut b = buf_for(g()?, off, len)?;
            fill_pattern(&mut b, off as u64, seed as u8);
            g()?.write_at(off, &b)?;
            Ok("ok".into())
        }
        Some("hash") => {
            let (off, len) = (num(1)?, num(2)?);
            let mut b = buf_for(main, off, len)?;
            main.read_at(off, &mut b)?;
            Ok(format!("hash {:016x}", fnv64(&b)))
        }
        Some("fill") => {
            let (off, len, seed) = (num(1)?, num(2)?, num(3)?);
            let mut b = buf_for(main, off, len)?;
            fill_pattern(&mut b, off as u64, seed as u8);
            main.write_at(off, &b)?;
            Ok("ok".into())
        }
        Some("echo") => Ok(text.to_owned()),
        _ => bail!("unknown request {text:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_past_the_available_memory_are_refused_with_the_limit() {
        assert!(check_bytes(64 << 20, Some(1 << 30)).is_ok());
        let e = check_bytes(usize::MAX, Some(1 << 30))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--bytes") && e.contains(&(1usize << 30).to_string()),
            "{e}"
        );
        assert!(check_bytes(0, Some(1 << 30)).is_err());
        let e = check_bytes(2 << 40, None).unwrap_err().to_string();
        assert!(e.contains("1 TiB"), "{e}");
        assert!(available_memory().is_some_and(|m| m > 0));
    }
}

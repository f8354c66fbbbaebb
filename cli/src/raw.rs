//! The raw TCP reference for `ferry bench --baseline`: as many TCP streams
//! as ferry's connection has (each on a thread of its own on both sides)
//! between this process and a `ferry raw-peer` child, moving the same block
//! sizes with plain blocking send/recv, and a spinning 8-byte ping-pong;
//! and the same-host round trip's floor (two threads, two cache lines).

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::child::{spawn_self, Peer};

const SINK: u8 = 0;
const SOURCE: u8 = 1;
const PING: u8 = 2;
/// mode u8 | block size u64 | blocks u64
const HDR: usize = 17;

pub struct RawPeer {
    _child: Peer,
    port: u16,
    /// Streams measured at once.
    streams: usize,
    /// One per stream, reused across measurements, so no run pays for
    /// first-touch faults.
    bufs: Vec<Vec<u8>>,
}

impl RawPeer {
    pub fn spawn(streams: usize) -> Result<RawPeer> {
        let mut child = spawn_self(&["raw-peer"])?;
        let mut out = BufReader::new(child.stdout.take().context("raw-peer stdout")?);
        let mut line = String::new();
        out.read_line(&mut line)?;
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .context("raw-peer did not print its port")?
            .parse()?;
        Ok(RawPeer {
            _child: Peer(child),
            port,
            streams: streams.max(1),
            bufs: Vec::new(),
        })
    }

    fn open(&self, mode: u8, size: usize, slots: usize) -> Result<TcpStream> {
        open(self.port, mode, size, slots)
    }

    /// GB/s of all the streams together moving `size`-byte blocks for
    /// `secs`, each on its own thread; `reverse` sends from the peer to us
    /// (the READ direction). The streams share the `slots` distinct blocks
    /// of ferry's run of the same point (its memory footprint), so that
    /// cache effects match.
    pub fn stream_gbps(
        &mut self,
        reverse: bool,
        size: usize,
        slots: usize,
        secs: f64,
    ) -> Result<f64> {
        let n = self.streams;
        let per = slots.div_ceil(n).max(1);
        self.bufs.resize_with(n, Vec::new);
        if n == 1 {
            return one_stream(self.port, &mut self.bufs[0], reverse, size, per, secs);
        }
        let port = self.port;
        let results: Vec<Result<f64>> = std::thread::scope(|sc| {
            let hs: Vec<_> = self
                .bufs
                .iter_mut()
                .map(|buf| sc.spawn(move || one_stream(port, buf, reverse, size, per, secs)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| bail!("a raw stream panicked")))
                .collect()
        });
        results.into_iter().sum()
    }

    /// Round trips of 8 bytes, both sides busy-polling; latencies in us.
    pub fn ping_pong_us(&mut self, secs: f64) -> Result<Vec<f64>> {
        let mut s = self.open(PING, 8, 1)?;
        s.set_nonblocking(true)?;
        let end = Instant::now() + Duration::from_secs_f64(secs);
        let mut lat = Vec::with_capacity(1 << 20);
        let mut n = 0u64;
        let mut msg = [0u8; 8];
        while Instant::now() < end {
            let t = Instant::now();
            spin_write(&mut s, &msg)?;
            spin_read(&mut s, &mut msg)?;
            n += 1;
            if n > 100 && lat.len() < lat.capacity() {
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        Ok(lat)
    }
}

fn open(port: u16, mode: u8, size: usize, slots: usize) -> Result<TcpStream> {
    let s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_nodelay(true)?;
    let mut hdr = [0u8; HDR];
    hdr[0] = mode;
    hdr[1..9].copy_from_slice(&(size as u64).to_le_bytes());
    hdr[9..].copy_from_slice(&(slots as u64).to_le_bytes());
    (&s).write_all(&hdr)?;
    // The peer answers once its buffers are ready, before timing starts.
    let mut ready = [0u8; 1];
    (&s).read_exact(&mut ready)?;
    Ok(s)
}

fn spin_read(s: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn spin_write(s: &mut TcpStream, buf: &[u8]) -> std::io::Result<()> {
    let mut put = 0;
    while put < buf.len() {
        match s.write(&buf[put..]) {
            Ok(n) => put += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `ferry raw-peer`: serves raw-TCP reference connections until stdin closes.
pub fn serve() -> Result<()> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    println!("PORT {}", l.local_addr()?.port());
    std::io::stdout().flush()?;
    std::thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        std::process::exit(0);
    });
    // A thread per connection: the multi-stream reference opens several
    // at once.
    for s in l.incoming() {
        let s = s?;
        std::thread::spawn(move || {
            if let Err(e) = serve_one(s) {
                eprintln!("raw-peer: {e:#}");
            }
        });
    }
    Ok(())
}

fn serve_one(mut s: TcpStream) -> Result<()> {
    s.set_nodelay(true)?;
    let mut hdr = [0u8; HDR];
    s.read_exact(&mut hdr)?;
    let size = u64::from_le_bytes(hdr[1..9].try_into().expect("8 bytes")) as usize;
    let slots = u64::from_le_bytes(hdr[9..].try_into().expect("8 bytes")) as usize;
    if size == 0 || slots == 0 || size.saturating_mul(slots) > 4 << 30 {
        bail!("{slots} blocks of {size} bytes");
    }
    let mut buf = vec![0xa5u8; size * slots];
    s.write_all(&[1])?;
    let mut k = 0;
    match hdr[0] {
        SINK => {
            let mut total = 0u64;
            loop {
                match s.read(&mut buf[(k % slots) * size..][..size])? {
                    0 => break,
                    n => total += n as u64,
                }
                k += 1;
            }
            s.write_all(&total.to_le_bytes())?;
        }
        SOURCE => loop {
            if s.write_all(&buf[(k % slots) * size..][..size]).is_err() {
                break;
            }
            k += 1;
        },
        PING => {
            s.set_nonblocking(true)?;
            let mut msg = [0u8; 8];
            while spin_read(&mut s, &mut msg).is_ok() {
                if spin_write(&mut s, &msg).is_err() {
                    break;
                }
            }
        }
        m => bail!("unknown mode {m}"),
    }
    Ok(())
}

/// GB/s of one stream moving `size`-byte blocks for `secs`, cycling
/// through `slots` blocks of `buf` (grown to fit); `reverse` sends from the
/// peer to us.
fn one_stream(
    port: u16,
    buf: &mut Vec<u8>,
    reverse: bool,
    size: usize,
    slots: usize,
    secs: f64,
) -> Result<f64> {
    if buf.len() < size * slots {
        *buf = vec![0x5au8; size * slots];
    }
    let dur = Duration::from_secs_f64(secs);
    let mut k = 0;
    if !reverse {
        let mut s = open(port, SINK, size, slots)?;
        let start = Instant::now();
        let mut sent = 0u64;
        while start.elapsed() < dur {
            s.write_all(&buf[(k % slots) * size..][..size])?;
            k += 1;
            sent += size as u64;
        }
        s.shutdown(Shutdown::Write)?;
        let mut ack = [0u8; 8];
        s.read_exact(&mut ack)?;
        let secs = start.elapsed().as_secs_f64();
        if u64::from_le_bytes(ack) != sent {
            bail!(
                "raw sink counted {} bytes, we sent {sent}",
                u64::from_le_bytes(ack)
            );
        }
        Ok(sent as f64 / secs / 1e9)
    } else {
        let mut s = open(port, SOURCE, size, slots)?;
        let start = Instant::now();
        let mut got = 0u64;
        while start.elapsed() < dur {
            // Read whole blocks, as a receiver of `size`-byte messages would.
            s.read_exact(&mut buf[(k % slots) * size..][..size])?;
            k += 1;
            got += size as u64;
        }
        let secs = start.elapsed().as_secs_f64();
        Ok(got as f64 / secs / 1e9)
    }
}

/// The reference for the idle probe (`--idle-conns` with `--baseline`): a
/// thread of this process parks in `epoll_wait` on an eventfd (100 ms
/// timeout, as a managed shard parks); after `idle` we ring it and spin
/// (yielding, as a shard spins) until it answers through an atomic.
/// Returns that round trip in µs: what waking a sleeper costs on this
/// machine now, with no engine in the way (it varies from run to run on a
/// VM by 2x or more, hence the same-run reference).
pub fn wake_after_idle_us(idle: Duration) -> Result<f64> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let owned = |fd: i32, what: &str| -> Result<OwnedFd> {
        if fd < 0 {
            bail!("{what}: {}", std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor just returned to us, owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    };
    // SAFETY: plain syscalls creating new descriptors.
    let efd = owned(
        unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) },
        "eventfd",
    )?;
    // SAFETY: as above.
    let ep = owned(
        unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) },
        "epoll_create1",
    )?;
    let (efd_raw, ep_raw) = (efd.as_raw_fd(), ep.as_raw_fd());
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: 0,
    };
    // SAFETY: live fds and a valid event.
    if unsafe { libc::epoll_ctl(ep_raw, libc::EPOLL_CTL_ADD, efd_raw, &mut ev) } < 0 {
        bail!("epoll_ctl: {}", std::io::Error::last_os_error());
    }
    let answered = Arc::new(AtomicBool::new(false));
    let a = answered.clone();
    let sleeper = std::thread::spawn(move || loop {
        let mut out = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: the fds stay open while this thread may run (joined
        // before they close, or leaked).
        let n = unsafe { libc::epoll_wait(ep_raw, &mut out, 1, 100) };
        if n < 0 && std::io::Error::last_os_error().kind() != ErrorKind::Interrupted {
            return;
        }
        if n > 0 {
            let mut v = 0u64;
            // SAFETY: reads 8 bytes into `v`.
            unsafe { libc::read(efd_raw, (&mut v as *mut u64).cast(), 8) };
            a.store(true, Ordering::Release);
            return;
        }
    });
    std::thread::sleep(idle);
    let t = Instant::now();
    let one = 1u64;
    // SAFETY: writes 8 bytes from `one`.
    unsafe { libc::write(efd_raw, (&one as *const u64).cast(), 8) };
    while !answered.load(Ordering::Acquire) {
        if t.elapsed() > Duration::from_secs(5) {
            // The sleeper may still use the fds: they stay open.
            std::mem::forget((efd, ep));
            bail!("the parked thread did not answer within 5 s");
        }
        std::thread::yield_now();
    }
    let us = t.elapsed().as_secs_f64() * 1e6;
    let _ = sleeper.join();
    Ok(us)
}

/// The same-host round trip's floor, for `--transport shm --latency
/// --baseline`: this thread stores a count in one cache line and spins
/// until another thread of this process, spinning on that line, echoes it
/// in a second line. Returns each round trip in µs (after 100 to warm
/// up): what moving a line to another core and back costs on this
/// machine now, under any same-host message (ferry's moves a request slot
/// and a reply slot, each at least one line, through rings in memory
/// shared between two processes; the hardware does not see the process
/// boundary).
pub fn line_ping_pong_us(secs: f64) -> Result<Vec<f64>> {
    use std::sync::atomic::{AtomicU64, Ordering};
    /// Apart from each other and from the adjacent-line prefetcher's pair.
    #[repr(align(128))]
    struct Line(AtomicU64);
    const STOP: u64 = u64::MAX;
    let (ping, pong) = (Line(AtomicU64::new(0)), Line(AtomicU64::new(0)));
    let mut lat = Vec::with_capacity(1 << 20);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let mut seen = 0;
            loop {
                let v = ping.0.load(Ordering::Acquire);
                if v == STOP {
                    return;
                }
                if v != seen {
                    pong.0.store(v, Ordering::Release);
                    seen = v;
                } else {
                    std::hint::spin_loop();
                }
            }
        });
        let end = Instant::now() + Duration::from_secs_f64(secs);
        let mut n = 0u64;
        // The echo thread ends only on STOP, stored below: each wait ends.
        while Instant::now() < end {
            n += 1;
            let t = Instant::now();
            ping.0.store(n, Ordering::Release);
            while pong.0.load(Ordering::Acquire) != n {
                std::hint::spin_loop();
            }
            if lat.len() < lat.capacity() {
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        ping.0.store(STOP, Ordering::Release);
    });
    // The first round trips warm the lines up: up to 100 are left out, but
    // never more than half, so a busy machine (where each round trip waits
    // for the echo thread to be scheduled) still gets a figure.
    let warm = (lat.len() / 2).min(100);
    lat.drain(..warm);
    if lat.is_empty() {
        bail!("the line ping-pong made no round trip in {secs} s");
    }
    Ok(lat)
}

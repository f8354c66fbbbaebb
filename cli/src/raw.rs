//! The raw TCP reference for `ferry bench --baseline`: one TCP stream
//! between this process and a `ferry raw-peer` child, moving the same block
//! sizes with plain blocking send/recv, and a spinning 8-byte ping-pong.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::bench::{spawn_self, Peer};

const SINK: u8 = 0;
const SOURCE: u8 = 1;
const PING: u8 = 2;
/// mode u8 | block size u64 | blocks u64
const HDR: usize = 17;

pub struct RawPeer {
    _child: Peer,
    port: u16,
    /// Reused across measurements, so no run pays for first-touch faults.
    buf: Vec<u8>,
}

impl RawPeer {
    pub fn spawn() -> Result<RawPeer> {
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
            buf: Vec::new(),
        })
    }

    fn open(&self, mode: u8, size: usize, slots: usize) -> Result<TcpStream> {
        let s = TcpStream::connect(("127.0.0.1", self.port))?;
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

    /// GB/s of one stream moving `size`-byte blocks for `secs`; `reverse`
    /// sends from the peer to us (the READ direction). Both sides cycle
    /// through `slots` distinct blocks, the memory footprint ferry's run of
    /// the same point had, so that cache effects match.
    pub fn stream_gbps(
        &mut self,
        reverse: bool,
        size: usize,
        slots: usize,
        secs: f64,
    ) -> Result<f64> {
        if self.buf.len() < size * slots {
            self.buf = vec![0x5au8; size * slots];
        }
        let dur = Duration::from_secs_f64(secs);
        let mut k = 0;
        if !reverse {
            let mut s = self.open(SINK, size, slots)?;
            let buf = &mut self.buf;
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
            let mut s = self.open(SOURCE, size, slots)?;
            let buf = &mut self.buf;
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
    let mut buf: Vec<u8> = Vec::new();
    for s in l.incoming() {
        let mut s = s?;
        s.set_nodelay(true)?;
        let mut hdr = [0u8; HDR];
        s.read_exact(&mut hdr)?;
        let size = u64::from_le_bytes(hdr[1..9].try_into().expect("8 bytes")) as usize;
        let slots = u64::from_le_bytes(hdr[9..].try_into().expect("8 bytes")) as usize;
        if size == 0 || slots == 0 || size.saturating_mul(slots) > 4 << 30 {
            bail!("raw-peer: {slots} blocks of {size} bytes");
        }
        if buf.len() < size * slots {
            buf = vec![0xa5u8; size * slots];
        }
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
            m => bail!("raw-peer: unknown mode {m}"),
        }
    }
    Ok(())
}

//! What ferry is compared with in the same run (--baseline).

use std::time::{Duration, Instant};

use anyhow::Result;
use ferry::{Config, Endpoint, MemoryRegion, Mode, Transport};

use crate::raw;

use super::opts::Opts;
use super::setup::host_buffer;
use ferry::AnyWindow;

/// The same-run reference (--baseline).
pub(super) fn make_reference(
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
            AnyWindow::Key(served.rbuf),
        )),
        (true, true, _) => Some(Reference::Gpu(GpuRef::new(
            o.gpu,
            peer_gpu.unwrap_or(0),
            o.pinned,
        ))),
        (true, false, false) => Some(Reference::Tcp(raw::RawPeer::spawn(
            ep.config().streams_per_conn.into(),
        )?)),
        // As many threads as share one of ferry's large copies.
        (true, false, true) => Some(Reference::Memcpy(
            Vec::new(),
            Vec::new(),
            o.shards.unwrap_or(1).max(Config::from_env()?.copy_share()),
        )),
    })
}

/// What ferry is compared with: raw TCP between two processes, or a
/// memcpy on as many threads as ferry's copy (for the same-host path).
pub(super) enum Reference {
    Tcp(raw::RawPeer),
    /// Source, destination, threads sharing each copy.
    Memcpy(Vec<u8>, Vec<u8>, usize),
    Gpu(GpuRef),
    /// ferry itself with host buffers (for --device gpu).
    Host(MemoryRegion, AnyWindow),
}

/// cuMemcpyAsync in this process between the benchmark's two GPUs (or
/// pinned host memory and the target's GPU): what CUDA IPC should reach.
pub(super) struct GpuRef {
    pub(super) gpu: usize,
    pub(super) peer_gpu: usize,
    pub(super) pinned: bool,
    /// (near buffer, far buffer), grown to the footprint a point needs.
    pub(super) bufs: Option<(MemoryRegion, MemoryRegion)>,
    /// The endpoints that allocated the buffers (dropped after them).
    pub(super) eps: Vec<Endpoint>,
}

impl GpuRef {
    pub(super) fn new(gpu: usize, peer_gpu: usize, pinned: bool) -> Self {
        Self {
            gpu,
            peer_gpu,
            pinned,
            bufs: None,
            eps: Vec::new(),
        }
    }

    pub(super) fn gbps(
        &mut self,
        reverse: bool,
        size: usize,
        slots: usize,
        secs: f64,
    ) -> Result<f64> {
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
    pub(super) fn gbps(
        &mut self,
        reverse: bool,
        size: usize,
        slots: usize,
        secs: f64,
    ) -> Result<f64> {
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

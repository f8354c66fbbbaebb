//! `MemoryRegion`: the application's handle to registered memory.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::Inner;
use crate::error::{Error, Result};
use crate::region::{Access, Region, RegionSlice};
use crate::wire::RemoteBuf;

/// Registered memory. Peers may WRITE into it or READ from it at any time
/// while it is registered and advertised, so its bytes can change under the
/// application, as with any DMA target: read them with [`read_at`] or through
/// the `unsafe` slice accessors.
///
/// Dropping the handle deregisters the region. Memory the engine owns
/// (from `register` / `alloc`) stays alive until the last in-flight use of
/// it ends; raw memory (`register_raw`) is waited for, so that the caller
/// may free it after `deregister` returns.
///
/// ```
/// # fn main() -> ferry::Result<()> {
/// # let mut cfg = ferry::Config::default();
/// # cfg.listen_addr = "127.0.0.1".parse().unwrap();
/// # let ep = ferry::Endpoint::builder().config(cfg).build()?;
/// let mr = ep.alloc(4096)?; // or ep.register(vec), or register_raw
/// mr.write_at(0, b"kv block")?;
/// let window = mr.advertise(0, 4096)?; // what a peer WRITEs to or READs from
/// let mut back = [0u8; 8];
/// mr.read_at(0, &mut back)?;
/// assert_eq!(&back, b"kv block");
/// # let _ = window;
/// # Ok(()) }
/// ```
///
/// [`read_at`]: MemoryRegion::read_at
pub struct MemoryRegion {
    pub(crate) inner: Arc<Region>,
    pub(crate) ep: Weak<Inner>,
    pub(crate) live: bool,
    /// Keys minted for parts of the registration by `advertise`: (offset,
    /// len) -> (rkey, tag). Re-advertising a window reuses its key, and
    /// there are at most `MAX_WINDOWS` of them.
    pub(crate) windows: std::sync::Mutex<Vec<(usize, usize, u32, u64)>>,
}

/// Distinct partial windows one registration may advertise with
/// `MemoryRegion::advertise` (each is a key in every shard's table).
pub const MAX_WINDOWS: usize = 1024;

/// Registrations: their keys and count, and the raw ones that may be
/// shared.
pub(crate) struct Registry {
    /// The next registration's key (random start, odd steps).
    pub(super) next_rkey: std::sync::atomic::AtomicU32,
    /// Live registrations (for FERRY_MAX_REGISTRATIONS).
    pub(crate) live: Arc<std::sync::atomic::AtomicUsize>,
    /// Raw registrations that may be shared (`reg_cache.rs`).
    pub(super) cache: super::reg_cache::RegCache,
}

impl Registry {
    pub(super) fn new() -> Self {
        Self {
            next_rkey: std::sync::atomic::AtomicU32::new((crate::sys::random_u64() as u32) | 1),
            live: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            cache: Default::default(),
        }
    }
}

/// How long a wait for shards to let go of something yields the CPU
/// before it sleeps: a running shard takes the command and drops its
/// references within microseconds; a sleep costs ~100-200 µs however soon
/// they go (deregistration was that slow: a Python `close` 200 µs).
const YIELD_FIRST: Duration = Duration::from_micros(50);

/// Waits until `done()` holds (true) or `deadline` passes (false):
/// yielding the CPU for `YIELD_FIRST`, then sleeping in 100 µs steps.
pub(crate) fn wait_until(deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if done() {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        if now.duration_since(start) < YIELD_FIRST {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

fn forget(ep: &Arc<Inner>, region: &Region) {
    ep.forget_region(region.rkey);
    if region
        .ipc_exported
        .load(std::sync::atomic::Ordering::Acquire)
    {
        ep.revoke_ipc(region.mem);
    }
    ep.regs
        .live
        .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.inner.addr()))
            .field("len", &self.inner.len())
            .field("rkey", &format_args!("{:#x}", self.inner.rkey))
            .field("access", &self.inner.access)
            .finish()
    }
}

impl MemoryRegion {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len() == 0
    }

    /// The address of its first byte (this process's).
    pub fn addr(&self) -> u64 {
        self.inner.addr()
    }

    /// The key its windows carry (what a peer's requests name).
    pub fn rkey(&self) -> u32 {
        self.inner.rkey
    }

    /// What peers (and this side's READs) may do with it.
    pub fn access(&self) -> Access {
        self.inner.access
    }

    /// Its first byte (host or GPU memory: check `MemKind` before reading).
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.ptr()
    }

    /// Says what the region's values are (the seed's `float_type`), so the
    /// network paths may compress them losslessly (`FERRY_COMPRESS`): its
    /// windows advertised from now on carry the type, a peer WRITing into
    /// one packs its frames for it, and READs of it are answered packed.
    /// `None` (the default) sends the bytes as they are. Only a hint: a
    /// wrong type costs ratio, never bytes.
    pub fn set_dtype(&self, dtype: Option<crate::codec::FloatType>) {
        self.inner.set_dtype(dtype);
    }

    /// The builder form of `set_dtype`.
    pub fn with_dtype(self, dtype: crate::codec::FloatType) -> Self {
        self.set_dtype(Some(dtype));
        self
    }

    /// The value type it was marked with for the codec, if any.
    pub fn dtype(&self) -> Option<crate::codec::FloatType> {
        self.inner.dtype()
    }

    pub(crate) fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.inner.len() => Ok(()),
            _ => Err(Error::OutOfRange {
                offset,
                len,
                region_len: self.inner.len(),
            }),
        }
    }

    /// `[offset, offset + len)` as a checked slice, or `OutOfRange`.
    pub(crate) fn slice(&self, offset: usize, len: usize) -> Result<RegionSlice> {
        self.check_range(offset, len)?;
        Ok(RegionSlice::new(&self.inner, offset, len).expect("range checked"))
    }

    /// As `slice`, holding no count: only for an op queued to a shard at
    /// once (`RegionSlice::borrowed`).
    pub(crate) fn slice_borrowed(&self, offset: usize, len: usize) -> Result<RegionSlice> {
        self.check_range(offset, len)?;
        Ok(RegionSlice::borrowed(&self.inner, offset, len).expect("range checked"))
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region:
    /// with the CPU from host memory, through the CUDA driver (a blocking
    /// copy) from GPU memory. Fails with `OutOfRange` outside the region.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len())?;
        // SAFETY: the range is inside the live region (checked above; the
        // `Arc<Region>` keeps it alive) and `dst` is ours for `dst.len()`.
        unsafe { self.copy_raw(dst.as_mut_ptr(), self.inner.ptr().add(offset), dst.len()) }
    }

    /// Copies `src` into the region at `offset` (host or GPU memory, as
    /// [`read_at`](Self::read_at)).
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len())?;
        // SAFETY: as in `read_at`, the other way.
        unsafe { self.copy_raw(self.inner.ptr().add(offset), src.as_ptr(), src.len()) }
    }

    /// One copy between this region and application memory.
    ///
    /// # Safety
    /// Both ranges are live for `len` bytes; one of them lies in this region.
    unsafe fn copy_raw(&self, dst: *mut u8, src: *const u8, len: usize) -> Result<()> {
        if self.inner.mem.is_device() {
            // The CPU cannot dereference device memory: the driver copies.
            // SAFETY: the caller's promise.
            return unsafe { crate::gpu::memory::copy_blocking(dst as u64, src as u64, len) };
        }
        // SAFETY: host memory, both ranges live (the caller's promise); a
        // concurrent remote write can change the bytes we copy, never their
        // validity (u8).
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        Ok(())
    }

    /// The region's bytes as a slice.
    ///
    /// # Safety
    /// The region must be host memory (`Endpoint::mem_kind` is not
    /// `Device`: the CPU cannot read GPU memory; this panics on it), and no
    /// peer may write to the region, and no local transfer may READ into
    /// it, while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        self.assert_host();
        // SAFETY: live host memory; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.inner.ptr(), self.inner.len()) }
    }

    /// The region's bytes as a mutable slice.
    ///
    /// # Safety
    /// As `as_slice`, and no peer may read the region or local transfer use
    /// it while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        self.assert_host();
        // SAFETY: as for `as_slice`.
        unsafe { std::slice::from_raw_parts_mut(self.inner.ptr(), self.inner.len()) }
    }

    fn assert_host(&self) {
        assert!(
            !self.inner.mem.is_device(),
            "a slice of GPU memory ({:?}) cannot be read by the CPU; use read_at/write_at",
            self.inner.mem
        );
    }

    /// Describes `[offset, offset + len)` with a key that any connected
    /// peer may use until deregistration, and that reaches exactly that
    /// window: the registration's own key for the whole of it, a key of the
    /// window's own for a part (minted once per distinct window, at most
    /// [`MAX_WINDOWS`](crate::endpoint::MAX_WINDOWS)). For a key scoped to
    /// one connection (revoked with it), use
    /// [`Endpoint::advertise`](crate::Endpoint::advertise).
    ///
    /// An RDMA NIC key in the window (verbs) is the registration's: the NIC
    /// enforces the registration's bounds, not the window's.
    pub fn advertise(&self, offset: usize, len: usize) -> Result<RemoteBuf> {
        let mut rb = self.window(offset, len)?;
        if offset == 0 && len == self.inner.len() {
            return Ok(rb);
        }
        let mut windows = self.windows.lock().expect("lock");
        let (rkey, tag) = match windows.iter().find(|w| (w.0, w.1) == (offset, len)) {
            Some(w) => (w.2, w.3),
            None => {
                if windows.len() >= MAX_WINDOWS {
                    return Err(Error::LimitReached {
                        limit: "windows per registration (MemoryRegion::advertise)",
                        max: MAX_WINDOWS,
                    });
                }
                let ep = self.ep.upgrade().ok_or(Error::Shutdown)?;
                let (rkey, tag) = ep.grant_window(&self.inner, rb.addr, len as u64, None)?;
                windows.push((offset, len, rkey, tag));
                (rkey, tag)
            }
        };
        rb.rkey = rkey;
        rb.reserved[..8].copy_from_slice(&tag.to_le_bytes());
        Ok(rb)
    }

    /// The `RemoteBuf` of `[offset, offset + len)` under the registration's
    /// own key (no key is minted).
    pub(crate) fn window(&self, offset: usize, len: usize) -> Result<RemoteBuf> {
        self.check_range(offset, len)?;
        let size = u32::try_from(len).map_err(|_| Error::Unsupported {
            what: "advertising more than 4 GiB - 1 in one RemoteBuf",
            reason: format!("len {len}"),
        })?;
        let mut reserved = [0u8; 32];
        reserved[..8].copy_from_slice(&self.inner.tag.to_le_bytes());
        if self.inner.mem.is_device() {
            reserved[8] |= crate::wire::REMOTE_FLAG_DEVICE;
        }
        let ep = self.ep.upgrade();
        let nic = ep.as_ref().and_then(|ep| ep.nics.handle.as_ref());
        let mut rb = RemoteBuf {
            addr: self.addr() + offset as u64,
            size,
            rkey: self.rkey(),
            nmsgs: 1,
            reserved,
            ..Default::default()
        };
        if let Some(keys) = crate::verbs::remote_keys(nic, &self.inner) {
            rb.set_nic_rkeys(&keys);
        }
        rb.set_dtype(self.inner.dtype().map(|d| d as u8));
        Ok(rb)
    }

    /// Removes the registration from every shard and waits (up to `timeout`)
    /// until no transfer uses the memory any more.
    pub(crate) fn retire(&mut self, timeout: Duration) -> Result<()> {
        if !self.live {
            return Ok(());
        }
        self.live = false;
        let Some(ep) = self.ep.upgrade() else {
            return Ok(());
        };
        forget(&ep, &self.inner);
        // Each shard table and each frame in flight holds a reference.
        if !wait_until(Instant::now() + timeout, || {
            Arc::strong_count(&self.inner) == 1
        }) {
            return Err(Error::Timeout {
                what: "in-flight transfers on a deregistered region",
                timeout_ms: timeout.as_millis() as u64,
            });
        }
        Ok(())
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        let timeout = self
            .ep
            .upgrade()
            .map_or(Duration::ZERO, |ep| ep.cfg.op_timeout());
        let owned = !matches!(self.inner._backing, crate::region::Backing::Raw);
        if owned {
            // The Arc keeps owned memory alive; no need to wait.
            if self.live {
                self.live = false;
                if let Some(ep) = self.ep.upgrade() {
                    forget(&ep, &self.inner);
                }
            }
        } else if let Err(e) = self.retire(timeout) {
            tracing::error!(
                rkey = self.inner.rkey,
                "dropping a raw region still in use: {e}"
            );
        }
    }
}

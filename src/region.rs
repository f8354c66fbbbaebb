//! Registered memory: the engine's record of a region, and the per-shard
//! table a target consults to check every remote request.

use crate::sys::IntMap;
use std::sync::Arc;

use bitflags::bitflags;

use crate::error::ConnId;
use crate::wire::Status;

bitflags! {
    /// What a peer may do to a registered region, and whether its owner
    /// may have it written: a local READ writes into its destination.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Access: u8 {
        /// Peers may WRITE into it.
        const REMOTE_WRITE = 1;
        /// Peers may READ from it.
        const REMOTE_READ = 2;
        /// The destination of this side's READs may be this region (not
        /// for memory its owner holds read-only, such as Python `bytes`).
        const LOCAL_WRITE = 4;
    }
}

/// Who keeps the region's bytes alive.
pub(crate) enum Backing {
    /// The engine owns the buffer; it is freed with the last `Arc<Region>`.
    Owned(#[allow(dead_code)] Box<[u8]>),
    /// The caller promised (in `register_raw`) to keep it alive until
    /// deregistration completes.
    Raw,
    /// A memfd mapping (`alloc_host`), shareable with local peers.
    Memfd(#[allow(dead_code)] crate::sys::MemfdBuf),
    /// GPU memory the engine allocated (`alloc_gpu`).
    Device(#[allow(dead_code)] crate::gpu::memory::DeviceBuf),
    /// Pinned host memory the engine allocated (`alloc_pinned`).
    Pinned(#[allow(dead_code)] crate::gpu::memory::PinnedBuf),
}

/// One registration. Shared by the endpoint's handle, each shard's table and
/// every frame that is reading or writing it, so the bytes outlive any use
/// the kernel is making of them.
pub(crate) struct Region {
    /// The range, fixed at creation (private: no code may point a region
    /// elsewhere; `from_raw` is the one way to name memory).
    ptr: *mut u8,
    len: usize,
    pub rkey: u32,
    /// Random; a request must carry it (from the advertised `RemoteBuf`).
    pub tag: u64,
    pub access: Access,
    /// Host, pinned host, or which GPU (from the driver at registration).
    pub mem: crate::gpu::MemKind,
    /// An IPC handle was handed out: deregistration tells local peers to
    /// close their mappings.
    pub ipc_exported: std::sync::atomic::AtomicBool,
    /// The allocation's CUDA IPC handle, exported on first need.
    pub ipc_handle: std::sync::OnceLock<[u8; 64]>,
    /// What a NIC layer attached to this registration (the verbs layer's
    /// memory region, registered on first use). Declared before the
    /// backing so it drops first: the NIC lets go of the pages before they
    /// are freed. Opaque here: the region layer knows no transport.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub nic_attach: std::sync::OnceLock<Arc<dyn std::any::Any + Send + Sync>>,
    /// The values' type for the codec (`FloatType` + 1; 0: none said):
    /// advertised in its windows, and what a READ of it is packed as.
    dtype: std::sync::atomic::AtomicU8,
    pub _backing: Backing,
}

// SAFETY: a Region is a pointer to memory that the engine (Owned) or the
// caller (Raw, by register_raw's contract) keeps valid; the engine only
// touches it through copies and syscalls, and concurrent access is the
// documented semantics of registered memory (as with any DMA target).
unsafe impl Send for Region {}
// SAFETY: see `Send`; shared references only read the immutable fields.
unsafe impl Sync for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Region {{ addr: {:#x}, len: {}, rkey: {:#x}, access: {:?} }}",
            self.addr(),
            self.len,
            self.rkey,
            self.access
        )
    }
}

impl Region {
    /// A region over `[ptr, ptr + len)`.
    ///
    /// # Safety
    /// The range is memory of this process (host, or GPU memory the driver
    /// gave out) that stays valid, at that address, until the region is
    /// dropped: held by `backing`, or by the caller of `register_raw` under
    /// its contract. Peers may write it when `access` allows.
    pub unsafe fn from_raw(
        ptr: *mut u8,
        len: usize,
        rkey: u32,
        tag: u64,
        access: Access,
        mem: crate::gpu::MemKind,
        backing: Backing,
    ) -> Region {
        Region {
            ptr,
            len,
            rkey,
            tag,
            access,
            mem,
            ipc_exported: Default::default(),
            ipc_handle: Default::default(),
            nic_attach: Default::default(),
            dtype: Default::default(),
            _backing: backing,
        }
    }

    /// The values' type, if the owner said one (`set_dtype`).
    pub fn dtype(&self) -> Option<crate::codec::FloatType> {
        let b = self.dtype.load(std::sync::atomic::Ordering::Relaxed);
        b.checked_sub(1).and_then(crate::codec::FloatType::from_u8)
    }

    pub fn set_dtype(&self, dtype: Option<crate::codec::FloatType>) {
        let b = dtype.map_or(0, |d| d as u8 + 1);
        self.dtype.store(b, std::sync::atomic::Ordering::Relaxed);
    }

    /// The first byte.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Bytes it spans.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// A pinned bounce buffer (GPU memory on tcp), never registered: no
    /// key names it. `len` is at most the buffer's.
    pub fn bounce(buf: crate::gpu::memory::PinnedBuf, len: usize) -> Region {
        assert!(
            len <= buf.len(),
            "a bounce region of {len} bytes over a {} byte buffer",
            buf.len()
        );
        Region {
            ptr: buf.ptr(),
            len,
            rkey: 0,
            tag: 0,
            access: Access::empty(),
            mem: crate::gpu::MemKind::Pinned,
            ipc_exported: Default::default(),
            ipc_handle: Default::default(),
            nic_attach: Default::default(),
            dtype: Default::default(),
            _backing: Backing::Pinned(buf),
        }
    }

    /// The CUDA IPC handle of this GPU region's allocation (exported once),
    /// marking the region so that deregistration revokes peers' mappings.
    pub fn export_ipc(&self) -> crate::error::Result<[u8; 64]> {
        let crate::gpu::MemKind::Device {
            ordinal,
            alloc_base,
            ..
        } = self.mem
        else {
            return Err(crate::error::Error::Unsupported {
                what: "CUDA IPC of host memory",
                reason: format!("region {:#x} is {:?}", self.addr(), self.mem),
            });
        };
        self.ipc_exported
            .store(true, std::sync::atomic::Ordering::Release);
        if let Some(h) = self.ipc_handle.get() {
            return Ok(*h);
        }
        let h = crate::gpu::ipc::export(ordinal, alloc_base)?;
        Ok(*self.ipc_handle.get_or_init(|| h))
    }
}

/// A checked part of a registration: `[off, off + len)` lies inside
/// `region`, proved once by the constructor. Code holding one may hand its
/// address to a syscall, a NIC or the GPU driver without checking again,
/// and the memory stays alive as long as the slice does. This is the one
/// currency for "local memory of an operation": raw pointers are derived
/// from it only at the syscall or driver call.
///
/// A slice is *borrowed* (holds no count of the region) only between a
/// submitter building an op and the op's shard taking it from its queue
/// (`borrowed`, `adopt`): the submitting thread then never writes the
/// region's count, which every completing shard also writes (with four
/// shards fed by one thread that line's trips were ~100 ns of each
/// submit, `perf` on 16 cores). What keeps the region alive meanwhile:
/// every shard's table holds it, and a shard drops its table's hold only
/// once it has taken every command queued before the deregistration
/// (`RegionCmd::Remove`'s `after`).
pub(crate) struct RegionSlice {
    region: std::mem::ManuallyDrop<Arc<Region>>,
    /// Holds a count of `region` (dropped with the slice); false only for
    /// a borrowed slice in a queued command.
    owned: bool,
    off: usize,
    len: usize,
}

impl Clone for RegionSlice {
    /// Always an owned slice (a count taken now).
    fn clone(&self) -> Self {
        RegionSlice {
            region: std::mem::ManuallyDrop::new(Arc::clone(&self.region)),
            owned: true,
            off: self.off,
            len: self.len,
        }
    }
}

impl Drop for RegionSlice {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: dropped once, here; an owned slice holds this count.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.region) };
        }
    }
}

impl std::fmt::Debug for RegionSlice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}[{}..+{}]", self.region, self.off, self.len)
    }
}

impl RegionSlice {
    /// `[off, off + len)` of `region`, or `None` if it does not fit.
    pub fn new(region: &Arc<Region>, off: usize, len: usize) -> Option<RegionSlice> {
        let end = off.checked_add(len)?;
        (end <= region.len).then(|| RegionSlice {
            region: std::mem::ManuallyDrop::new(region.clone()),
            owned: true,
            off,
            len,
        })
    }

    /// As `new`, holding no count: for an op queued to a shard at once,
    /// which `adopt`s it when it takes the op (see the type's note).
    pub fn borrowed(region: &Arc<Region>, off: usize, len: usize) -> Option<RegionSlice> {
        let end = off.checked_add(len)?;
        (end <= region.len).then(|| RegionSlice {
            // SAFETY: a second handle to the same allocation, never
            // dropped while `owned` is false (Drop above); `adopt` takes
            // the count it then stands for.
            region: std::mem::ManuallyDrop::new(unsafe { Arc::from_raw(Arc::as_ptr(region)) }),
            owned: false,
            off,
            len,
        })
    }

    /// Makes a borrowed slice owned (takes its count). The shard calls it
    /// on every op it takes from its queue, while its table still holds
    /// the region.
    pub fn adopt(&mut self) {
        if !self.owned {
            // SAFETY: the region is alive (the shard's table holds it until
            // every command queued before its deregistration is taken).
            unsafe { Arc::increment_strong_count(Arc::as_ptr(&self.region)) };
            self.owned = true;
        }
    }

    /// `[off, off + len)` of this slice, or `None` if it does not fit.
    pub fn sub(&self, off: usize, len: usize) -> Option<RegionSlice> {
        let end = off.checked_add(len)?;
        (end <= self.len).then(|| RegionSlice {
            region: std::mem::ManuallyDrop::new(Arc::clone(&self.region)),
            owned: true,
            off: self.off + off,
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// Where the slice starts in this process's address space.
    pub fn addr(&self) -> u64 {
        self.region.addr() + self.off as u64
    }

    /// The first byte's address, for a syscall or driver call. Valid for
    /// `len` bytes while this slice (which holds the region) lives.
    pub fn ptr(&self) -> *mut u8 {
        // In bounds by construction; wrapping_add keeps this safe code.
        self.region.ptr.wrapping_add(self.off)
    }

    pub fn is_device(&self) -> bool {
        self.region.mem.is_device()
    }
}

/// What a request must present: the key, and the tag that was advertised
/// with it (the `RemoteBuf`'s first 8 reserved bytes, random per key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyRef {
    pub rkey: u32,
    pub tag: u64,
}

/// Where a connection looks up the registration a request names (the
/// shard's table, seen from that connection).
pub(crate) trait Regions {
    /// As `RegionTable::check`, returning the window the request may touch.
    fn check(
        &mut self,
        key: KeyRef,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<RegionSlice, Status> {
        self.check_as(key, addr, len, need, false)
    }

    /// As `check`; `borrowed` as for `RegionTable::check_window_as` (the
    /// slice is valid until the table next changes, unless adopted).
    fn check_as(
        &mut self,
        key: KeyRef,
        addr: u64,
        len: u64,
        need: Access,
        borrowed: bool,
    ) -> Result<RegionSlice, Status>;
}

/// What a key opens: a window of a region, for any peer or for one
/// connection only.
pub(crate) struct Grant {
    pub region: Arc<Region>,
    pub tag: u64,
    /// First address and length of the window.
    pub base: u64,
    pub len: u64,
    /// `Some`: only this connection may use the key, and the key dies with it.
    pub conn: Option<ConnId>,
}

impl Grant {
    /// The whole region, for any peer.
    pub fn whole(region: &Arc<Region>) -> Grant {
        Grant {
            region: region.clone(),
            tag: region.tag,
            base: region.addr(),
            len: region.len as u64,
            conn: None,
        }
    }
}

/// The keys one shard honours.
#[derive(Default)]
pub(crate) struct RegionTable {
    by_key: IntMap<u32, Grant>,
    /// Removals waiting for the shard to take the commands queued before
    /// them: (key, position in the shard's queue).
    deferred: Vec<(u32, u64)>,
    /// Commands the shard has taken from its queue (set by the shard).
    taken: u64,
    /// Allocations of IPC-exported GPU memory this endpoint deregistered,
    /// which the shard has yet to tell its same-host peers about (filled
    /// by `RegionCmd::RevokeIpc`, drained by the shard after each update).
    pub ipc_revoked: Vec<u64>,
}

impl RegionTable {
    pub fn insert(&mut self, rkey: u32, g: Grant) {
        self.by_key.insert(rkey, g);
    }

    /// Removes `rkey` once the shard took `after` commands (at once if it
    /// did).
    pub fn remove_after(&mut self, rkey: u32, after: u64) {
        if self.taken >= after {
            self.remove(rkey);
        } else {
            self.deferred.push((rkey, after));
        }
    }

    /// The shard took `taken` commands in all: removals waiting for that
    /// happen now.
    pub fn commands_taken(&mut self, taken: u64) {
        self.taken = taken;
        if self.deferred.is_empty() {
            return;
        }
        let mut due = std::mem::take(&mut self.deferred);
        due.retain(|&(k, after)| {
            let now = taken >= after;
            if now {
                self.remove(k);
            }
            !now
        });
        self.deferred = due;
    }

    /// Removes a key; removing a registration's own key also removes every
    /// grant cut from it.
    pub fn remove(&mut self, rkey: u32) {
        if let Some(g) = self.by_key.remove(&rkey) {
            if g.region.rkey == rkey {
                self.by_key.retain(|_, other| other.region.rkey != rkey);
            }
        }
    }

    /// Drops every key granted to `conn` alone.
    pub fn revoke_conn(&mut self, conn: ConnId) {
        self.by_key.retain(|_, g| g.conn != Some(conn));
    }

    pub fn clear(&mut self) {
        self.by_key.clear();
    }

    /// Checks a remote request against the table: the key must name a live
    /// grant, carry its tag, come from a connection it was granted to,
    /// `[addr, addr + len)` must lie inside the window without wrapping,
    /// and the registration must permit `need`. A wrong tag or a foreign
    /// connection look exactly like an unknown key. Returns the region and
    /// the byte offset of `addr` within it.
    pub fn check(
        &self,
        conn: ConnId,
        key: KeyRef,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<(&Arc<Region>, usize), Status> {
        let g = self.by_key.get(&key.rkey).ok_or(Status::UnknownKey)?;
        // Compare without an early exit on the first differing byte.
        if (g.tag ^ key.tag) != 0 || g.conn.is_some_and(|c| c != conn) {
            return Err(Status::UnknownKey);
        }
        if !g.region.access.contains(need) {
            return Err(Status::AccessDenied);
        }
        let end = addr.checked_add(len).ok_or(Status::OutOfBounds)?;
        if addr < g.base || end > g.base + g.len {
            return Err(Status::OutOfBounds);
        }
        Ok((&g.region, (addr - g.region.addr()) as usize))
    }

    /// As `check`, handing back the window the request may touch;
    /// `borrowed`: the slice holds no count of the region
    /// (`RegionSlice::borrowed`): it is valid while this table holds the
    /// region, so until the table next changes, unless `adopt`ed. A
    /// same-host request copied while it is served needs no more, and with
    /// several shards serving one region the count's line went back and
    /// forth between them twice per request.
    pub fn check_window_as(
        &self,
        conn: ConnId,
        key: KeyRef,
        addr: u64,
        len: u64,
        need: Access,
        borrowed: bool,
    ) -> Result<RegionSlice, Status> {
        let (r, off) = self.check(conn, key, addr, len, need)?;
        let w = if borrowed {
            RegionSlice::borrowed(r, off, len as usize)
        } else {
            RegionSlice::new(r, off, len as usize)
        };
        Ok(w.expect("check proved the window"))
    }
}

/// A host region over `buf` for tests of the layers above (no endpoint).
#[cfg(test)]
pub(crate) fn test_region(buf: &mut [u8]) -> Arc<Region> {
    Arc::new(Region {
        ptr: buf.as_mut_ptr(),
        len: buf.len(),
        rkey: 7,
        tag: 0xfeed,
        access: Access::all(),
        mem: crate::gpu::MemKind::Host,
        ipc_exported: Default::default(),
        ipc_handle: Default::default(),
        nic_attach: Default::default(),
        dtype: Default::default(),
        _backing: Backing::Raw,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: ConnId = ConnId(1);

    fn table(buf: &mut [u8], access: Access) -> (RegionTable, u64, Arc<Region>) {
        let mut t = RegionTable::default();
        let r = Arc::new(Region {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            rkey: 7,
            tag: 0xfeed,
            access,
            mem: crate::gpu::MemKind::Host,
            ipc_exported: Default::default(),
            ipc_handle: Default::default(),
            nic_attach: Default::default(),
            dtype: Default::default(),
            _backing: Backing::Raw,
        });
        let base = r.addr();
        t.insert(7, Grant::whole(&r));
        (t, base, r)
    }

    fn k(rkey: u32, tag: u64) -> KeyRef {
        KeyRef { rkey, tag }
    }

    #[test]
    fn a_removal_waits_for_the_commands_queued_before_it() {
        let mut buf = vec![0u8; 100];
        let (mut t, base, r) = table(&mut buf, Access::REMOTE_WRITE);
        let w = Access::REMOTE_WRITE;
        // A borrowed slice holds no count; adopting it takes one.
        let mut s = RegionSlice::borrowed(&r, 10, 20).unwrap();
        assert_eq!(Arc::strong_count(&r), 2, "the handle and the table");
        s.adopt();
        s.adopt();
        assert_eq!(Arc::strong_count(&r), 3, "adopted once");
        drop(s);
        drop(RegionSlice::borrowed(&r, 0, 1).unwrap());
        assert_eq!(Arc::strong_count(&r), 2, "a borrowed slice drops nothing");
        assert!(RegionSlice::borrowed(&r, 90, 11).is_none());
        // Sent when the shard's queue had accepted 5 commands; it took 3.
        t.commands_taken(3);
        t.remove_after(7, 5);
        assert!(t.check(C, k(7, 0xfeed), base, 1, w).is_ok(), "still held");
        t.commands_taken(4);
        assert_eq!(Arc::strong_count(&r), 2);
        t.commands_taken(5);
        assert_eq!(Arc::strong_count(&r), 1, "the table let go");
        assert_eq!(
            t.check(C, k(7, 0xfeed), base, 1, w).unwrap_err(),
            Status::UnknownKey
        );
        // One the shard already passed goes at once.
        t.insert(7, Grant::whole(&r));
        t.remove_after(7, 5);
        assert_eq!(Arc::strong_count(&r), 1);
    }

    #[test]
    fn check_enforces_key_tag_bounds_access_and_overflow() {
        let mut buf = vec![0u8; 100];
        let (t, base, _) = table(&mut buf, Access::REMOTE_WRITE);
        let w = Access::REMOTE_WRITE;
        assert_eq!(t.check(C, k(7, 0xfeed), base, 100, w).unwrap().1, 0);
        assert_eq!(t.check(C, k(7, 0xfeed), base + 99, 1, w).unwrap().1, 99);
        assert_eq!(t.check(C, k(7, 0xfeed), base + 100, 0, w).unwrap().1, 100);
        assert_eq!(
            t.check(C, k(8, 0xfeed), base, 1, w).unwrap_err(),
            Status::UnknownKey
        );
        assert_eq!(
            t.check(C, k(7, 0xfeee), base, 1, w).unwrap_err(),
            Status::UnknownKey,
            "guessed tag"
        );
        assert_eq!(
            t.check(C, k(7, 0xfeed), base, 101, w).unwrap_err(),
            Status::OutOfBounds
        );
        assert_eq!(
            t.check(C, k(7, 0xfeed), base - 1, 1, w).unwrap_err(),
            Status::OutOfBounds
        );
        assert_eq!(
            t.check(C, k(7, 0xfeed), u64::MAX, 2, w).unwrap_err(),
            Status::OutOfBounds
        );
        assert_eq!(
            t.check(C, k(7, 0xfeed), base + 1, u64::MAX, w).unwrap_err(),
            Status::OutOfBounds
        );
        assert_eq!(
            t.check(C, k(7, 0xfeed), base, 1, Access::REMOTE_READ)
                .unwrap_err(),
            Status::AccessDenied
        );
    }

    #[test]
    fn grants_are_windowed_scoped_and_revoked() {
        let mut buf = vec![0u8; 100];
        let (mut t, base, r) = table(&mut buf, Access::all());
        let rd = Access::REMOTE_READ;
        t.insert(
            9,
            Grant {
                region: r.clone(),
                tag: 5,
                base: base + 10,
                len: 20,
                conn: Some(C),
            },
        );
        assert_eq!(t.check(C, k(9, 5), base + 10, 20, rd).unwrap().1, 10);
        assert_eq!(
            t.check(C, k(9, 5), base + 9, 2, rd).unwrap_err(),
            Status::OutOfBounds
        );
        assert_eq!(
            t.check(C, k(9, 5), base + 25, 6, rd).unwrap_err(),
            Status::OutOfBounds
        );
        assert_eq!(
            t.check(ConnId(2), k(9, 5), base + 10, 1, rd).unwrap_err(),
            Status::UnknownKey,
            "foreign"
        );
        t.revoke_conn(C);
        assert_eq!(
            t.check(C, k(9, 5), base + 10, 1, rd).unwrap_err(),
            Status::UnknownKey
        );
        t.insert(
            9,
            Grant {
                region: r.clone(),
                tag: 5,
                base,
                len: 1,
                conn: Some(C),
            },
        );
        t.remove(7);
        assert_eq!(
            t.check(C, k(9, 5), base, 1, rd).unwrap_err(),
            Status::UnknownKey,
            "dies with its region"
        );
    }
}

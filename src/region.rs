//! Registered memory: the engine's record of a region, and the per-shard
//! table a target consults to check every remote request.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

/// A multiply-shift hasher for the engine's small integer keys (rkeys,
/// connection ids): the hot-path tables need speed, not DoS resistance, and
/// their keys come from this process (a peer can only name them).
#[derive(Default, Clone, Copy)]
pub(crate) struct IntHasher(u64);

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64);
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

pub(crate) type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

use bitflags::bitflags;

use crate::wire::Status;

bitflags! {
    /// What a peer may do to a registered region.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Access: u8 {
        const REMOTE_WRITE = 1;
        const REMOTE_READ = 2;
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
    Memfd(#[allow(dead_code)] crate::shm::object::MemfdBuf),
}

/// One registration. Shared by the endpoint's handle, each shard's table and
/// every frame that is reading or writing it, so the bytes outlive any use
/// the kernel is making of them.
pub(crate) struct Region {
    pub ptr: *mut u8,
    pub len: usize,
    pub rkey: u32,
    pub access: Access,
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
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }
}

/// Where a stream looks up the registration a request names.
pub(crate) trait Regions {
    /// As `RegionTable::check`, returning a counted handle to the region.
    fn check(
        &mut self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<(Arc<Region>, usize), Status>;
}

impl Regions for RegionTable {
    fn check(
        &mut self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<(Arc<Region>, usize), Status> {
        RegionTable::check(self, rkey, addr, len, need).map(|(r, off)| (r.clone(), off))
    }
}

/// The registrations one shard knows, keyed by rkey.
#[derive(Default)]
pub(crate) struct RegionTable {
    by_key: IntMap<u32, Arc<Region>>,
}

impl RegionTable {
    pub fn insert(&mut self, r: Arc<Region>) {
        self.by_key.insert(r.rkey, r);
    }

    pub fn remove(&mut self, rkey: u32) {
        self.by_key.remove(&rkey);
    }

    pub fn clear(&mut self) {
        self.by_key.clear();
    }

    /// Checks a remote request against the table: the key must name a live
    /// registration, `[addr, addr + len)` must lie inside it without
    /// wrapping, and the registration must permit `need`. Returns the region
    /// and the byte offset of `addr` within it.
    pub fn check(
        &self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<(&Arc<Region>, usize), Status> {
        let r = self.by_key.get(&rkey).ok_or(Status::UnknownKey)?;
        if !r.access.contains(need) {
            return Err(Status::AccessDenied);
        }
        let base = r.addr();
        let end = addr.checked_add(len).ok_or(Status::OutOfBounds)?;
        if addr < base || end > base + r.len as u64 {
            return Err(Status::OutOfBounds);
        }
        Ok((r, (addr - base) as usize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(buf: &mut [u8], access: Access) -> (RegionTable, u64) {
        let mut t = RegionTable::default();
        let r = Region {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            rkey: 7,
            access,
            _backing: Backing::Raw,
        };
        let base = r.addr();
        t.insert(Arc::new(r));
        (t, base)
    }

    #[test]
    fn check_enforces_key_bounds_access_and_overflow() {
        let mut buf = vec![0u8; 100];
        let (t, base) = table(&mut buf, Access::REMOTE_WRITE);
        assert_eq!(t.check(7, base, 100, Access::REMOTE_WRITE).unwrap().1, 0);
        assert_eq!(
            t.check(7, base + 99, 1, Access::REMOTE_WRITE).unwrap().1,
            99
        );
        assert_eq!(
            t.check(7, base + 100, 0, Access::REMOTE_WRITE).unwrap().1,
            100
        );
        assert_eq!(
            t.check(8, base, 1, Access::REMOTE_WRITE).unwrap_err(),
            Status::UnknownKey
        );
        assert_eq!(
            t.check(7, base, 101, Access::REMOTE_WRITE).unwrap_err(),
            Status::OutOfBounds
        );
        assert_eq!(
            t.check(7, base - 1, 1, Access::REMOTE_WRITE).unwrap_err(),
            Status::OutOfBounds
        );
        assert_eq!(
            t.check(7, u64::MAX, 2, Access::REMOTE_WRITE).unwrap_err(),
            Status::OutOfBounds
        );
        assert_eq!(
            t.check(7, base + 1, u64::MAX, Access::REMOTE_WRITE)
                .unwrap_err(),
            Status::OutOfBounds
        );
        assert_eq!(
            t.check(7, base, 1, Access::REMOTE_READ).unwrap_err(),
            Status::AccessDenied
        );
    }
}

//! The registration cache, with UCCL's semantics: registering a range
//! that a live registration of the same access already holds — the same
//! buffer again, or a part of it — shares that registration (its keys, its
//! NIC registration: with verbs, a fresh one costs a driver call that grows
//! with the size) instead of making another; a partial overlap gets its
//! own. A shared registration ends with its last holder. Hits and misses
//! are counted. Every face that registers raw pointers (Python, C) goes
//! through it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::{Endpoint, MemoryRegion};
use crate::error::Result;
use crate::region::Access;

/// Registrations looked at, nearest start first, for one that holds a range.
const SCAN: usize = 64;

/// A part of a registration that may be shared with other holders; one
/// holder. Dropping it (or `Endpoint::release_shared`) lets go of it.
#[derive(Debug)]
pub struct SharedRegion {
    /// None only once released.
    mr: Option<Arc<MemoryRegion>>,
    offset: usize,
    len: usize,
}

impl SharedRegion {
    /// The whole registration (its keys, `advertise`, ops).
    pub fn region(&self) -> &Arc<MemoryRegion> {
        self.mr.as_ref().expect("held until dropped")
    }

    /// Where this part starts in the registration.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of this part's first byte.
    pub fn addr(&self) -> u64 {
        self.region().addr() + self.offset as u64
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        if let Some(mr) = self.mr.take() {
            if let Some(ep) = mr.ep.upgrade() {
                ep.regs.cache.release(&mr);
            }
        }
    }
}

/// Cache statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegCacheStats {
    /// Registrations served by a live one.
    pub hits: u64,
    /// Registrations made anew.
    pub misses: u64,
}

struct Entry {
    access: Access,
    mr: Weak<MemoryRegion>,
    holders: usize,
}

#[derive(Default)]
pub(crate) struct RegCache {
    /// (start address, rkey) -> the registration and how many hold it.
    live: Mutex<BTreeMap<(u64, u32), Entry>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl RegCache {
    /// A live registration with `access` that holds `[ptr, ptr + len)`.
    fn find(&self, ptr: u64, len: usize, access: Access) -> Option<SharedRegion> {
        let mut live = self.live.lock().expect("lock");
        let mut dead = Vec::new();
        let mut hit = None;
        for (&k, e) in live.range_mut(..=(ptr, u32::MAX)).rev().take(SCAN) {
            let Some(mr) = e.mr.upgrade() else {
                dead.push(k);
                continue;
            };
            let end = mr.addr().saturating_add(mr.len() as u64);
            let inside = ptr.checked_add(len as u64).is_some_and(|e| e <= end);
            if e.access == access && inside {
                e.holders += 1;
                hit = Some(SharedRegion {
                    offset: (ptr - mr.addr()) as usize,
                    len,
                    mr: Some(mr),
                });
                break;
            }
        }
        for k in dead {
            live.remove(&k);
        }
        hit
    }

    fn insert(&self, mr: &Arc<MemoryRegion>, access: Access) {
        let e = Entry {
            access,
            mr: Arc::downgrade(mr),
            holders: 1,
        };
        self.live
            .lock()
            .expect("lock")
            .insert((mr.addr(), mr.rkey()), e);
    }

    /// One holder of `mr` let go; true if it was the last (the entry is
    /// then gone: nobody new will share it).
    fn release(&self, mr: &MemoryRegion) -> bool {
        let mut live = self.live.lock().expect("lock");
        let k = (mr.addr(), mr.rkey());
        let Some(e) = live.get_mut(&k) else {
            return true;
        };
        e.holders = e.holders.saturating_sub(1);
        if e.holders > 0 {
            return false;
        }
        live.remove(&k);
        true
    }

    pub fn stats(&self) -> RegCacheStats {
        RegCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
        }
    }
}

/// # Shared raw registrations
///
/// The registration cache the C and Python faces use: the same range
/// registered again shares one registration.
impl Endpoint {
    /// Registers `[ptr, ptr + len)` through the registration cache: a live
    /// registration with the same access that holds the range is shared
    /// (see the module docs), else a new one is made once `check_range`
    /// found the range mapped with that access (a hit needs no check: the
    /// range lies in memory already checked and promised valid, so the
    /// maps are read only for new registrations).
    ///
    /// # Safety
    /// As `register_raw`: the range stays valid for reads and writes until
    /// every holder of the registration has dropped it.
    pub unsafe fn register_shared(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<SharedRegion> {
        let cache = &self.inner.regs.cache;
        if let Some(hit) = cache.find(ptr as u64, len, access) {
            cache.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(hit);
        }
        self.check_range(ptr as u64, len, access)?;
        // SAFETY: this function's contract is register_raw's.
        let mr = Arc::new(unsafe { self.register_raw(ptr, len, access) }?);
        cache.misses.fetch_add(1, Ordering::Relaxed);
        cache.insert(&mr, access);
        Ok(SharedRegion {
            mr: Some(mr),
            offset: 0,
            len,
        })
    }

    /// Lets go of one holder: the registration itself when it was the last
    /// holder (for the caller to deregister, waiting for its ops), else
    /// None.
    pub fn release_shared(&self, mut sh: SharedRegion) -> Option<Arc<MemoryRegion>> {
        let mr = sh.mr.take()?;
        self.inner.regs.cache.release(&mr).then_some(mr)
    }

    /// The registration cache's hits and misses so far.
    pub fn reg_cache_stats(&self) -> RegCacheStats {
        self.inner.regs.cache.stats()
    }
}

#[cfg(test)]
mod tests {
    use crate::{Access, Config, Endpoint};

    #[test]
    fn the_same_range_or_a_part_is_shared_an_overlap_is_not() {
        let cfg = Config {
            listen_addr: "127.0.0.1".parse().unwrap(),
            transport: crate::endpoint::Transport::Tcp,
            ..Default::default()
        };
        let ep = Endpoint::builder().config(cfg).build().unwrap();
        let mut buf = vec![0u8; 16384];
        let p = buf.as_mut_ptr();
        // SAFETY: `buf` outlives every registration below (dropped first).
        let reg = |off: usize, len: usize, access| unsafe {
            ep.register_shared(p.add(off), len, access).unwrap()
        };
        let a = reg(0, 8192, Access::all());
        let again = reg(0, 8192, Access::all());
        let part = reg(1024, 4096, Access::all());
        assert_eq!(again.region().rkey(), a.region().rkey());
        assert_eq!(part.region().rkey(), a.region().rkey());
        assert_eq!((part.offset(), part.len()), (1024, 4096));
        assert_eq!(part.addr(), a.addr() + 1024);
        // A partial overlap, another access: their own.
        let over = reg(4096, 8192, Access::all());
        assert_ne!(over.region().rkey(), a.region().rkey());
        let ro = reg(0, 8192, Access::REMOTE_READ);
        assert_ne!(ro.region().rkey(), a.region().rkey());
        assert_eq!(ep.registration_count(), 3);
        // Alive while any holder is: the last one ends it.
        let rkey = a.region().rkey();
        drop(a);
        assert!(ep.release_shared(again).is_none(), "part still holds it");
        assert_eq!(reg(0, 4, Access::all()).region().rkey(), rkey);
        drop(part);
        assert_eq!(ep.registration_count(), 2);
        let fresh = reg(0, 4, Access::all());
        assert_ne!(fresh.region().rkey(), rkey);
        let s = ep.reg_cache_stats();
        assert_eq!((s.hits, s.misses), (3, 4));
        drop((fresh, over, ro));
    }
}

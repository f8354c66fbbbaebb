//! CUDA IPC: exporting a handle for an allocation, and the importer's cache
//! of opened handles. The seed opens and closes a handle around every
//! operation (a millisecond-scale driver call); here a mapping is opened on
//! first use, kept per (owner endpoint, allocation), and closed when the
//! owner revokes it (deregistration), the owner goes away, or the endpoint
//! shuts down — never while a copy still uses it.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use cudarc::driver::sys as cu;

use super::driver::{check, cuda};
pub(crate) use super::kinds::IpcCounters;
pub use super::kinds::IpcStats;
use crate::error::Result;
use crate::wire::IpcBuf;

/// A cached mapping: (owner endpoint id, owner's allocation base).
pub(crate) type MapKey = (u64, u64);

/// The IPC handle of the allocation starting at `alloc_base` (device memory
/// of `ordinal`).
pub(crate) fn export(ordinal: i32, alloc_base: u64) -> Result<[u8; 64]> {
    let c = cuda()?;
    c.make_current(ordinal)?;
    // SAFETY: CUipcMemHandle is 64 plain bytes; zero is a valid value.
    let mut h: cu::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: writes the handle of a live cuMemAlloc allocation.
    check("cuIpcGetMemHandle", unsafe {
        cu::cuIpcGetMemHandle(&mut h, alloc_base)
    })?;
    Ok(h.reserved.map(|b| b as u8))
}

struct Mapping {
    /// The allocation's base in this process.
    base: u64,
    /// The device whose memory it is, by our ordinals (-1: not known).
    ordinal: i32,
    /// Bytes mapped, as the driver says (None: not known).
    len: Option<u64>,
    /// Copies using it now.
    users: u32,
    /// The handle it was opened from. An owner may free an allocation and
    /// get a new one at the same base; if its revocation never reached us
    /// (a ring that stayed full), the handle differs, and the old mapping
    /// must not serve the new allocation.
    handle: [u8; 64],
    /// Tells this mapping from a later one of the same key.
    id: u64,
}

/// What a copy holds while it uses a mapping: release it when it ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MapTicket {
    key: MapKey,
    id: u64,
}

/// Opens and closes other processes' handles: the CUDA driver (`Driver`),
/// or, in the cache's own tests, a record of the calls.
pub(crate) trait Handles {
    /// Maps the allocation behind `handle`; its base in this process.
    fn open(&mut self, handle: &[u8; 64]) -> Result<u64>;
    fn close(&mut self, base: u64);
    /// The device (by our ordinals) and the length of what is mapped at
    /// `base`, as the driver says (`None`: not known); device `current`'s
    /// context is current after.
    fn placed(&mut self, base: u64, current: i32) -> Result<(i32, Option<u64>)>;
    /// A window that names this very process: the device of the memory it
    /// names if that is the start of a live allocation here whose IPC
    /// handle is the window's and which holds the window's range, else why
    /// not (the window's claims are the peer's until the driver confirms
    /// them); device `current`'s context is current after.
    fn own(&mut self, b: &IpcBuf, current: i32) -> Result<i32>;
}

/// The refusal of a window whose claims the driver does not confirm.
fn unproven(reason: String) -> crate::error::Error {
    crate::error::Error::Unsupported {
        what: "a CUDA IPC window",
        reason,
    }
}

/// The CUDA driver's IPC calls (the current context's device).
pub(crate) struct Driver;

impl Handles for Driver {
    fn open(&mut self, handle: &[u8; 64]) -> Result<u64> {
        let h = cu::CUipcMemHandle {
            reserved: handle.map(|x| x as _),
        };
        let mut base: cu::CUdeviceptr = 0;
        // SAFETY: opens a handle another process exported; the cache
        // closes the mapping exactly once (revoke/retire/drop).
        check("cuIpcOpenMemHandle", unsafe {
            cu::cuIpcOpenMemHandle_v2(
                &mut base,
                h,
                cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        Ok(base)
    }

    fn placed(&mut self, base: u64, current: i32) -> Result<(i32, Option<u64>)> {
        let got = match super::memory::classify(base) {
            Ok(super::MemKind::Device {
                ordinal, alloc_len, ..
            }) => (ordinal, Some(alloc_len as u64)),
            _ => (-1, None),
        };
        cuda()?.make_current(current)?;
        Ok(got)
    }

    fn own(&mut self, b: &IpcBuf, current: i32) -> Result<i32> {
        let found = super::memory::classify(b.alloc_base);
        let r = match found {
            Ok(super::MemKind::Device {
                ordinal,
                alloc_base,
                alloc_len,
            }) if alloc_base == b.alloc_base
                && b.offset.checked_add(b.len).is_some_and(|end| end <= alloc_len as u64) =>
            {
                match export(ordinal, alloc_base) {
                    Ok(h) if h == b.handle => Ok(ordinal),
                    _ => Err(unproven(format!(
                        "it names allocation {:#x} of this process with another handle",
                        b.alloc_base
                    ))),
                }
            }
            _ => Err(unproven(format!(
                "it names [{:#x} + {}, +{}) of this process, which is no range of one of its allocations",
                b.alloc_base, b.offset, b.len
            ))),
        };
        cuda()?.make_current(current)?;
        r
    }

    fn close(&mut self, base: u64) {
        // SAFETY: `base` came from cuIpcOpenMemHandle and no copy uses it.
        let r = unsafe { cu::cuIpcCloseMemHandle(base) };
        if let Err(e) = check("cuIpcCloseMemHandle", r) {
            tracing::warn!("closing IPC mapping {base:#x}: {e}");
        }
    }
}

/// Whether `b`'s range lies in what `m` really maps: a window's offset and
/// length are its sender's claims, checked on decode only against the
/// allocation length it claims too.
fn fits(m: &Mapping, b: &IpcBuf) -> Result<()> {
    match (m.len, b.offset.checked_add(b.len)) {
        (None, Some(_)) => Ok(()),
        (Some(len), Some(end)) if end <= len => Ok(()),
        _ => Err(unproven(format!(
            "[{} , +{}) of allocation {:#x} is past the {:?} bytes its handle maps",
            b.offset, b.len, b.alloc_base, m.len
        ))),
    }
}

/// One shard's opened handles.
pub(crate) struct IpcCache<H: Handles = Driver> {
    handles: H,
    maps: HashMap<MapKey, Mapping>,
    /// Mappings replaced while copies still used them (revoked, or their
    /// key found with a new handle): closed when their last copy ends.
    /// At most one per copy in flight.
    retired: Vec<Mapping>,
    next_id: u64,
    counters: std::sync::Arc<IpcCounters>,
    my_pid: u32,
}

impl IpcCache<Driver> {
    pub fn new(counters: std::sync::Arc<IpcCounters>) -> Self {
        Self::with_handles(Driver, counters)
    }
}

impl<H: Handles> IpcCache<H> {
    pub fn with_handles(handles: H, counters: std::sync::Arc<IpcCounters>) -> Self {
        Self {
            handles,
            maps: HashMap::new(),
            retired: Vec::new(),
            next_id: 0,
            counters,
            my_pid: std::process::id(),
        }
    }

    /// The address in this process of `b`'s first byte, the mapping to
    /// release after the copy (`None` for memory of this same process,
    /// which needs no handle: CUDA refuses to open a process's own handles)
    /// and the device the memory is on by our ordinals (-1: not known).
    /// Device `current`'s context must be current, and is after.
    pub fn acquire(&mut self, b: &IpcBuf, current: i32) -> Result<(u64, Option<MapTicket>, i32)> {
        if b.owner_pid == self.my_pid {
            // Memory of this process, copied at its own address: only
            // once the driver confirms the window (a peer could otherwise
            // name any address of ours by claiming our pid).
            let ordinal = self.handles.own(b, current)?;
            self.counters.same_process.fetch_add(1, Ordering::Relaxed);
            return Ok((b.alloc_base + b.offset, None, ordinal));
        }
        let key = (b.owner_id, b.alloc_base);
        if let Some(m) = self.maps.get_mut(&key) {
            if m.handle == b.handle {
                fits(m, b)?;
                m.users += 1;
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
                return Ok((
                    m.base + b.offset,
                    Some(MapTicket { key, id: m.id }),
                    m.ordinal,
                ));
            }
            // Revoked, or a new allocation at the same base: retire the old
            // mapping before opening the new one.
            let old = self.maps.remove(&key).expect("present");
            self.retire(old);
        }
        let base = self.handles.open(&b.handle)?;
        self.counters.opens.fetch_add(1, Ordering::Relaxed);
        let id = self.next_id;
        self.next_id += 1;
        // Asked once per mapping: whether kernels of our GPU may touch it,
        // and how much is really mapped (the window's length is a claim).
        let (ordinal, len) = match self.handles.placed(base, current) {
            Ok(p) => p,
            Err(e) => {
                self.handles.close(base);
                return Err(e);
            }
        };
        let m = Mapping {
            base,
            ordinal,
            len,
            users: 1,
            handle: b.handle,
            id,
        };
        if let Err(e) = fits(&m, b) {
            self.handles.close(base);
            return Err(e);
        }
        self.maps.insert(key, m);
        Ok((base + b.offset, Some(MapTicket { key, id }), ordinal))
    }

    /// A copy that used `t` ended.
    pub fn release(&mut self, t: MapTicket) {
        if let Some(m) = self.maps.get_mut(&t.key).filter(|m| m.id == t.id) {
            // Kept open for the next copy until revoked.
            m.users = m.users.saturating_sub(1);
        } else if let Some(i) = self.retired.iter().position(|m| m.id == t.id) {
            let m = &mut self.retired[i];
            m.users = m.users.saturating_sub(1);
            if m.users == 0 {
                let m = self.retired.swap_remove(i);
                self.close(m.base);
            }
        }
    }

    /// The owner deregistered the allocation at `alloc_base`.
    pub fn revoke(&mut self, owner_id: u64, alloc_base: u64) {
        self.revoke_where(|k| *k == (owner_id, alloc_base));
    }

    /// The owner went away: close all of its mappings.
    pub fn revoke_owner(&mut self, owner_id: u64) {
        self.revoke_where(|k| k.0 == owner_id);
    }

    fn revoke_where(&mut self, pred: impl Fn(&MapKey) -> bool) {
        let keys: Vec<MapKey> = self.maps.keys().filter(|k| pred(k)).copied().collect();
        for k in keys {
            let m = self.maps.remove(&k).expect("present");
            self.retire(m);
        }
    }

    /// Closes a mapping no new copy may use: now if idle, else when its
    /// last copy ends.
    fn retire(&mut self, m: Mapping) {
        if m.users == 0 {
            self.close(m.base);
        } else {
            self.retired.push(m);
        }
    }

    /// Mappings open now (current and retired-but-busy).
    #[cfg(test)]
    fn open_count(&self) -> usize {
        self.maps.len() + self.retired.len()
    }

    fn close(&mut self, base: u64) {
        self.handles.close(base);
        self.counters.closes.fetch_add(1, Ordering::Relaxed);
    }
}

impl<H: Handles> Drop for IpcCache<H> {
    fn drop(&mut self) {
        let mut bases: Vec<u64> = self.maps.drain().map(|(_, m)| m.base).collect();
        bases.extend(self.retired.drain(..).map(|m| m.base));
        for b in bases {
            self.close(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what the cache opens and closes; each open maps a new base.
    #[derive(Default)]
    struct Record {
        open: Vec<(u64, [u8; 64])>,
        closed: Vec<u64>,
        next: u64,
        /// What the driver would say is mapped (None: not known).
        mapped_len: Option<u64>,
        /// The device of a same-process window the driver confirms (None:
        /// it does not).
        own: Option<i32>,
    }

    impl Handles for &mut Record {
        fn placed(&mut self, _base: u64, _current: i32) -> Result<(i32, Option<u64>)> {
            Ok((-1, self.mapped_len))
        }
        fn own(&mut self, b: &IpcBuf, _current: i32) -> Result<i32> {
            match self.own {
                Some(d) => Ok(d),
                None => Err(unproven(format!("no allocation at {:#x}", b.alloc_base))),
            }
        }
        fn open(&mut self, handle: &[u8; 64]) -> Result<u64> {
            self.next += 0x1_0000;
            self.open.push((self.next, *handle));
            Ok(self.next)
        }
        fn close(&mut self, base: u64) {
            assert!(
                self.open.iter().any(|(b, _)| *b == base),
                "closed {base:#x}, never opened"
            );
            assert!(!self.closed.contains(&base), "closed {base:#x} twice");
            self.closed.push(base);
        }
    }

    fn buf(owner: u64, base: u64, offset: u64, handle_byte: u8) -> IpcBuf {
        IpcBuf {
            owner_id: owner,
            owner_pid: std::process::id() + 1,
            alloc_base: base,
            offset,
            len: 8,
            handle: [handle_byte; 64],
            device: 0,
            host_token: 0,
            alloc_id: 0,
            alloc_len: 0,
        }
    }

    #[test]
    fn a_mapping_is_reused_until_revoked_and_closed_once_idle() {
        let mut rec = Record::default();
        let mut c = IpcCache::with_handles(&mut rec, Default::default());
        let (a, ta, _) = c.acquire(&buf(1, 0x7000, 16, 1), 0).unwrap();
        let (b, tb, _) = c.acquire(&buf(1, 0x7000, 32, 1), 0).unwrap();
        assert_eq!(b - a, 16, "one mapping serves both offsets");
        c.release(ta.unwrap());
        c.revoke(1, 0x7000);
        assert_eq!(c.open_count(), 1, "still used by the second copy");
        c.release(tb.unwrap());
        assert_eq!(c.open_count(), 0);
        // A revoked key opens afresh.
        let (_, t, _) = c.acquire(&buf(1, 0x7000, 0, 1), 0).unwrap();
        c.release(t.unwrap());
        drop(c);
        assert_eq!(rec.open.len(), 2);
        assert_eq!(rec.closed.len(), 2, "drop closes the cached mapping");
    }

    #[test]
    fn a_new_allocation_at_the_same_base_is_never_served_by_the_old_mapping() {
        // The owner freed its allocation and got a new one at the same
        // base, and its revocation was lost: the handle tells them apart.
        let mut rec = Record::default();
        let mut c = IpcCache::with_handles(&mut rec, Default::default());
        let (old, t_old, _) = c.acquire(&buf(1, 0x7000, 0, 1), 0).unwrap();
        let (new, t_new, _) = c.acquire(&buf(1, 0x7000, 0, 2), 0).unwrap();
        assert_ne!(old, new, "the new handle got its own mapping");
        assert_eq!(c.open_count(), 2, "the old one waits for its copy");
        // Releasing the old copy closes the old mapping, not the new one.
        c.release(t_old.unwrap());
        assert_eq!(c.open_count(), 1);
        let (again, t, _) = c.acquire(&buf(1, 0x7000, 0, 2), 0).unwrap();
        assert_eq!(again, new);
        c.release(t.unwrap());
        c.release(t_new.unwrap());
        drop(c);
        assert_eq!(rec.closed, vec![old, new]);
    }

    #[test]
    fn a_revoked_busy_mapping_replaced_by_a_new_one_keeps_both_counts_apart() {
        let mut rec = Record::default();
        let mut c = IpcCache::with_handles(&mut rec, Default::default());
        let (old, t_old, _) = c.acquire(&buf(1, 0x7000, 0, 1), 0).unwrap();
        c.revoke(1, 0x7000);
        let (new, t_new, _) = c.acquire(&buf(1, 0x7000, 0, 1), 0).unwrap();
        assert_ne!(old, new);
        // The new mapping stays open after the old copy's release, and the
        // old one closes then.
        c.release(t_old.unwrap());
        assert_eq!(c.open_count(), 1);
        c.revoke_owner(1);
        assert_eq!(c.open_count(), 1, "the new copy still runs");
        c.release(t_new.unwrap());
        assert_eq!(c.open_count(), 0);
        drop(c);
        assert_eq!(rec.closed, vec![old, new]);
    }

    #[test]
    fn own_process_memory_needs_no_handle() {
        let mut rec = Record::default();
        let mut c = IpcCache::with_handles(&mut rec, Default::default());
        let mut b = buf(1, 0x7000, 8, 1);
        b.owner_pid = std::process::id();
        b.device = 3;
        // Not confirmed by the driver (no allocation of ours there, or
        // another handle): refused, whatever the window says.
        assert!(c.acquire(&b, 0).is_err());
        drop(c);
        rec.own = Some(2);
        let mut c = IpcCache::with_handles(&mut rec, Default::default());
        // Confirmed: its device is the driver's, not the window's.
        assert_eq!(c.acquire(&b, 0).unwrap(), (0x7008, None, 2));
        drop(c);
        assert!(rec.open.is_empty());
    }

    #[test]
    fn a_window_past_what_its_handle_maps_is_refused_and_not_kept() {
        let mut rec = Record {
            mapped_len: Some(4096),
            ..Record::default()
        };
        let mut c = IpcCache::with_handles(&mut rec, Default::default());
        let mut b = buf(1, 0x7000, 4000, 1);
        b.len = 96;
        let (_, t, _) = c.acquire(&b, 0).unwrap();
        c.release(t.unwrap());
        // The same mapping, a window that claims more than it maps.
        b.len = 97;
        assert!(c.acquire(&b, 0).is_err());
        // A first window that does: the mapping is closed at once.
        let mut other = buf(2, 0x9000, 0, 2);
        other.len = 5000;
        assert!(c.acquire(&other, 0).is_err());
        assert_eq!(c.open_count(), 1);
        drop(c);
        assert_eq!(rec.closed.len(), 2, "{:?}", rec.closed);
    }
}

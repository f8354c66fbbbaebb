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
    /// Copies using it now.
    users: u32,
    /// The owner revoked it: close once `users` is 0.
    revoked: bool,
}

/// One shard's opened handles.
pub(crate) struct IpcCache {
    maps: HashMap<MapKey, Mapping>,
    counters: std::sync::Arc<IpcCounters>,
    my_pid: u32,
}

impl IpcCache {
    pub fn new(counters: std::sync::Arc<IpcCounters>) -> Self {
        Self {
            maps: HashMap::new(),
            counters,
            my_pid: std::process::id(),
        }
    }

    /// The address in this process of `b`'s first byte, and the mapping to
    /// release after the copy (`None` for memory of this same process,
    /// which needs no handle: CUDA refuses to open a process's own handles).
    /// `ordinal`'s context must be current.
    pub fn acquire(&mut self, b: &IpcBuf) -> Result<(u64, Option<MapKey>)> {
        if b.owner_pid == self.my_pid {
            self.counters.same_process.fetch_add(1, Ordering::Relaxed);
            return Ok((b.alloc_base + b.offset, None));
        }
        let key = (b.owner_id, b.alloc_base);
        if let Some(m) = self.maps.get_mut(&key) {
            if !m.revoked {
                m.users += 1;
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
                return Ok((m.base + b.offset, Some(key)));
            }
        }
        let h = cu::CUipcMemHandle {
            reserved: b.handle.map(|x| x as _),
        };
        let mut base: cu::CUdeviceptr = 0;
        // SAFETY: opens a handle another process exported; the mapping is
        // closed exactly once (release/revoke/drop).
        check("cuIpcOpenMemHandle", unsafe {
            cu::cuIpcOpenMemHandle_v2(
                &mut base,
                h,
                cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        self.counters.opens.fetch_add(1, Ordering::Relaxed);
        if let Some(old) = self.maps.insert(
            key,
            Mapping {
                base,
                users: 1,
                revoked: false,
            },
        ) {
            // A revoked mapping still in use: it is closed when its last
            // copy ends, and must not be found again, so close it now if
            // idle. (Busy revoked mappings of the same key cannot occur
            // twice: keys are owner allocations.)
            if old.users == 0 {
                self.close(old.base);
            }
        }
        Ok((base + b.offset, Some(key)))
    }

    /// A copy that used `key` ended.
    pub fn release(&mut self, key: MapKey) {
        if let Some(m) = self.maps.get_mut(&key) {
            m.users = m.users.saturating_sub(1);
            if m.revoked && m.users == 0 {
                let m = self.maps.remove(&key).expect("present");
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
            let m = self.maps.get_mut(&k).expect("present");
            m.revoked = true;
            if m.users == 0 {
                let m = self.maps.remove(&k).expect("present");
                self.close(m.base);
            }
        }
    }

    fn close(&self, base: u64) {
        // SAFETY: `base` came from cuIpcOpenMemHandle and no copy uses it.
        let r = unsafe { cu::cuIpcCloseMemHandle(base) };
        if let Err(e) = check("cuIpcCloseMemHandle", r) {
            tracing::warn!("closing IPC mapping {base:#x}: {e}");
        }
        self.counters.closes.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for IpcCache {
    fn drop(&mut self) {
        let bases: Vec<u64> = self.maps.drain().map(|(_, m)| m.base).collect();
        for b in bases {
            self.close(b);
        }
    }
}

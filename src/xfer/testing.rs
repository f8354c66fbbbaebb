//! Stand-ins the protocol engines' unit tests share: registered memory
//! the test owns, a region table seen from one connection, and a sink that
//! records what a transport reports. Real types underneath (`Region`,
//! `RegionTable`); nothing here replaces the code under test.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::error::{ConnId, Result};
use crate::region::{Access, Backing, KeyRef, Region, RegionSlice, RegionTable, Regions};
use crate::wire::Status;
use crate::xfer::Sink;

/// `len` zeroed bytes the engine owns, registered under `rkey` / `tag`.
pub(crate) fn owned_region(len: usize, rkey: u32, tag: u64) -> Arc<Region> {
    let mut b = vec![0u8; len].into_boxed_slice();
    let ptr = b.as_mut_ptr();
    // SAFETY: the box is the backing.
    Arc::new(unsafe {
        Region::from_raw(
            ptr,
            len,
            rkey,
            tag,
            Access::all(),
            crate::gpu::MemKind::Host,
            Backing::Owned(b),
        )
    })
}

/// The bytes of `r` at `[off, off + len)`.
pub(crate) fn bytes_of(r: &Region, off: usize, len: usize) -> &[u8] {
    assert!(off + len <= r.len());
    // SAFETY: in bounds of a live region; tests read it while no engine
    // writes (single-threaded).
    unsafe { std::slice::from_raw_parts(r.ptr().add(off), len) }
}

/// Writes `data` into `r` at `off`.
pub(crate) fn write_into(r: &Region, off: usize, data: &[u8]) {
    assert!(off + data.len() <= r.len());
    // SAFETY: in bounds of a live region (checked above), distinct from `data`.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), r.ptr().add(off), data.len()) };
}

/// A region table seen from one connection.
pub(crate) struct View<'a> {
    pub table: &'a RegionTable,
    pub conn: ConnId,
}

impl Regions for View<'_> {
    fn check_as(
        &mut self,
        key: KeyRef,
        addr: u64,
        len: u64,
        need: Access,
        borrowed: bool,
    ) -> std::result::Result<RegionSlice, Status> {
        self.table
            .check_window_as(self.conn, key, addr, len, need, borrowed)
    }
}

/// Records completions; holds up to `cap` notifications.
pub(crate) struct RecSink<'a> {
    pub done: &'a mut Vec<(u32, Result<()>)>,
    pub inbox: &'a mut VecDeque<Vec<u8>>,
    pub cap: usize,
}

impl Sink for RecSink<'_> {
    fn done(&mut self, slot: u32, result: Result<()>) {
        self.done.push((slot, result));
    }
    fn notify(&mut self, payload: Vec<u8>) -> std::result::Result<(), Vec<u8>> {
        if self.inbox.len() >= self.cap {
            return Err(payload);
        }
        self.inbox.push_back(payload);
        Ok(())
    }
}

//! The same-host path's one syscall on the data path: copies to and from
//! a peer process's memory that is not mapped here, with
//! `process_vm_readv/writev` (CMA). Probed at connect time: where the
//! kernel refuses it, the connection is refused and falls back to tcp.

use std::io;

use super::local::PeerMemory;
use crate::region::RegionSlice;

/// The driver's `PeerMemory`.
pub(crate) struct Cma;

impl PeerMemory for Cma {
    fn copy(&mut self, pid: u32, ours: &RegionSlice, addr: u64, from_peer: bool) -> io::Result<()> {
        // SAFETY: a checked slice of `len` live bytes, held for the call.
        unsafe { cma(pid, ours.ptr(), addr, ours.len(), from_peer) }
    }
}

/// Copies `len` bytes between our memory and the peer process's, with
/// process_vm_readv (`read_from_peer`) or process_vm_writev.
///
/// # Safety
/// `[local, local + len)` is live memory of this process for the call
/// (written when `read_from_peer`, read otherwise).
pub(crate) unsafe fn cma(
    pid: u32,
    local: *mut u8,
    remote: u64,
    len: usize,
    read_from_peer: bool,
) -> io::Result<()> {
    let mut done = 0;
    while done < len {
        let base = local.wrapping_add(done);
        let l = libc::iovec {
            iov_base: base as *mut _,
            iov_len: len - done,
        };
        let r = libc::iovec {
            iov_base: (remote + done as u64) as *mut _,
            iov_len: len - done,
        };
        // SAFETY: `l` lies in memory the caller checked and keeps alive; the
        // remote iovec is only dereferenced by the kernel, in the peer's
        // address space, with its own permission checks.
        let n = unsafe {
            if read_from_peer {
                libc::process_vm_readv(pid as i32, &l, 1, &r, 1, 0)
            } else {
                libc::process_vm_writev(pid as i32, &l, 1, &r, 1, 0)
            }
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::other("process_vm copied nothing"));
        }
        done += n as usize;
    }
    Ok(())
}

/// A word whose address a peer reads at connect time to learn whether
/// process_vm_readv works between the two processes.
pub(crate) static CMA_CANARY: u64 = 0x6665_7272_795f_636d;

/// Whether this process can read `pid`'s memory at `addr` (the peer's canary).
pub(crate) fn probe_cma(pid: u32, addr: u64) -> std::result::Result<(), String> {
    let mut v = 0u64;
    // SAFETY: `v` is 8 bytes of our stack, live for the call.
    match unsafe { cma(pid, &mut v as *mut u64 as *mut u8, addr, 8, true) } {
        Ok(()) if v == CMA_CANARY => Ok(()),
        Ok(()) => Err(format!(
            "read {v:#x} at the peer's canary, expected {CMA_CANARY:#x}"
        )),
        Err(e) => Err(format!("process_vm_readv of pid {pid}: {e}")),
    }
}

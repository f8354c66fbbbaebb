//! The same-host path's one syscall on the data path: copies to and from
//! a peer process's memory that is not mapped here, with
//! `process_vm_readv/writev` (CMA). Probed at connect time: where the
//! kernel refuses it, the connection is refused and falls back to tcp.

use std::io;

use super::local::PeerMemory;
use crate::error::ConnFault;
use crate::region::RegionSlice;
use crate::sys::syscall;

/// The driver's `PeerMemory`.
pub(crate) struct Cma;

/// Pairs per syscall (the kernel takes up to 1024): the iovecs live on
/// the stack, so a batch allocates nothing; a longer run takes a few calls.
const IOV_BATCH: usize = 64;

impl PeerMemory for Cma {
    fn copy(&mut self, pid: u32, ours: &RegionSlice, addr: u64, from_peer: bool) -> io::Result<()> {
        // SAFETY: a checked slice of `len` live bytes, held for the call.
        unsafe { cma(pid, ours.ptr(), addr, ours.len(), from_peer) }
    }

    fn copy_many<'a>(
        &mut self,
        pid: u32,
        pairs: impl Iterator<Item = (&'a RegionSlice, u64)>,
        from_peer: bool,
    ) -> io::Result<()> {
        let none = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        let (mut local, mut remote) = ([none; IOV_BATCH], [none; IOV_BATCH]);
        let (mut n, mut want) = (0, 0);
        for (ours, addr) in pairs {
            local[n] = libc::iovec {
                iov_base: ours.ptr().cast(),
                iov_len: ours.len(),
            };
            remote[n] = libc::iovec {
                iov_base: addr as *mut _,
                iov_len: ours.len(),
            };
            want += ours.len();
            n += 1;
            if n == IOV_BATCH {
                // SAFETY: the local iovecs are checked slices the caller
                // holds for the call.
                unsafe { cma_v(pid, &local[..n], &remote[..n], want, from_peer) }?;
                (n, want) = (0, 0);
            }
        }
        if n == 0 {
            return Ok(());
        }
        // SAFETY: as above.
        unsafe { cma_v(pid, &local[..n], &remote[..n], want, from_peer) }
    }
}

/// Copies every piece (our slice, the peer's address) of a run, all from
/// the peer when `from_peer`: in batches of syscalls, each piece on its own
/// where a batch fails, to learn which. Whether every piece was copied.
pub(crate) fn copy_run(pid: u32, pieces: &[(u64, RegionSlice, u64)], from_peer: bool) -> bool {
    let pairs = pieces.iter().map(|(_, ours, addr)| (ours, *addr));
    if Cma.copy_many(pid, pairs, from_peer).is_ok() {
        return true;
    }
    let mut all = true;
    for (_, ours, addr) in pieces {
        all &= Cma.copy(pid, ours, *addr, from_peer).is_ok();
    }
    all
}

/// One `process_vm_readv/writev` of `local.len()` pairs, `want` bytes in
/// all; a partial copy is an error (the caller retries op by op).
///
/// # Safety
/// Each local iovec is live memory of this process for the call (written
/// when `read_from_peer`); remote ones are only dereferenced by the kernel,
/// in the peer, with its own checks.
unsafe fn cma_v(
    pid: u32,
    local: &[libc::iovec],
    remote: &[libc::iovec],
    want: usize,
    read_from_peer: bool,
) -> io::Result<()> {
    let (l, r, n) = (
        local.as_ptr(),
        remote.as_ptr(),
        local.len() as libc::c_ulong,
    );
    // SAFETY: the caller's contract; `n` iovecs on both sides.
    let got = if read_from_peer {
        syscall!(process_vm_readv(pid as i32, l, n, r, n, 0))
    } else {
        syscall!(process_vm_writev(pid as i32, l, n, r, n, 0))
    }?;
    if got as usize != want {
        return Err(io::Error::other("process_vm copied part of a batch"));
    }
    Ok(())
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
        let n = if read_from_peer {
            syscall!(process_vm_readv(pid as i32, &l, 1, &r, 1, 0))
        } else {
            syscall!(process_vm_writev(pid as i32, &l, 1, &r, 1, 0))
        }?;
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
/// `Err`: the peer is refused (a same-host connection needs it).
pub(crate) fn probe_cma(pid: u32, addr: u64) -> std::result::Result<(), ConnFault> {
    let mut v = 0u64;
    // SAFETY: `v` is 8 bytes of our stack, live for the call.
    match unsafe { cma(pid, &mut v as *mut u64 as *mut u8, addr, 8, true) } {
        Ok(()) if v == CMA_CANARY => Ok(()),
        Ok(()) => Err(ConnFault::refused(format!(
            "read {v:#x} at the peer's canary, expected {CMA_CANARY:#x}"
        ))),
        Err(e) => Err(ConnFault::refused(format!(
            "process_vm_readv of pid {pid}: {e}"
        ))),
    }
}

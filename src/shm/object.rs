//! POSIX shared-memory objects (`/dev/shm/ferry-*`): creating, mapping and
//! removing them, and sweeping those whose owner died.

use std::ffi::CString;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

use std::sync::atomic::Ordering;

use super::ring::{Header, BELL_MAGIC, RING_MAGIC};
use crate::error::{Error, Result};
use crate::sys::{pid_alive, Mapping};

fn cname(name: &str) -> CString {
    CString::new(name).expect("ring names have no NUL")
}

/// Inode of this process's pid namespace (0 if unknown).
pub(crate) fn pid_ns() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid")
        .map(|m| m.ino())
        .unwrap_or(0)
}

/// The header of a ferry object in `map` (a ring or a doorbell page), if
/// it has one.
fn header_of(map: &Mapping) -> Option<&Header> {
    if map.len() < std::mem::size_of::<Header>() {
        return None;
    }
    // SAFETY: the mapping is page aligned and holds a whole header; every
    // field is an atomic.
    let h = unsafe { &*(map.ptr() as *const Header) };
    let magic = h.magic.load(Ordering::Acquire);
    (magic == RING_MAGIC || magic == BELL_MAGIC).then_some(h)
}

/// Whether the owner of the object in `map` is certainly gone: same pid
/// namespace as ours (else its pid means nothing here) and no such
/// process. An object with no valid header counts as gone too.
fn owner_gone(map: &Mapping) -> bool {
    header_of(map).map_or(true, |h| {
        h.pid_ns.load(Ordering::Relaxed) == pid_ns()
            && !pid_alive(h.owner_pid.load(Ordering::Relaxed))
    })
}

/// Removes the ferry objects in /dev/shm (rings, doorbells and their
/// FIFOs) whose owner process died without cleaning up. Returns how many
/// were removed.
pub(crate) fn sweep_stale() -> usize {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return 0;
    };
    let mut n = 0;
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("ferry-") {
            continue;
        }
        if let Some(base) = name.strip_suffix(".fifo") {
            // A doorbell's FIFO outlives its page only if its owner died
            // between making the two.
            if !std::path::Path::new(&format!("/dev/shm/{base}")).exists() {
                let _ = std::fs::remove_file(e.path());
            }
            continue;
        }
        let path = format!("/{name}");
        let Ok(map) = map_existing(&path) else {
            continue;
        };
        // Only objects with a header whose owner is gone: one still being
        // laid out has no magic yet.
        if header_of(&map).is_some() && owner_gone(&map) {
            let pid = header_of(&map).map_or(0, |h| h.owner_pid.load(Ordering::Relaxed));
            unlink(&path);
            let _ = std::fs::remove_file(format!("/dev/shm/{name}.fifo"));
            tracing::info!(
                name,
                pid,
                "removed an object left by a process that is gone"
            );
            n += 1;
        }
    }
    n
}

pub(crate) fn unlink(name: &str) {
    let c = cname(name);
    // SAFETY: valid name.
    unsafe { libc::shm_unlink(c.as_ptr()) };
}

/// Maps an existing object `name` whole.
pub(crate) fn map_existing(name: &str) -> Result<Mapping> {
    let c = cname(name);
    // SAFETY: valid name.
    let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
    if fd < 0 {
        return Err(Error::io("shm_open", io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just opened (checked above) and is ours.
    let guard = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: stat of an fd we hold into a zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(Error::io("fstat(shm)", io::Error::last_os_error()));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(Error::Unsupported {
            what: "opening a shared-memory object",
            reason: format!("{name} is not a regular file"),
        });
    }
    let map = Mapping::map_fd(fd, st.st_size as usize).map_err(|e| Error::io("mmap(shm)", e))?;
    drop(guard);
    Ok(map)
}

/// Creates the object `name` (mode 0600) of `len` zero bytes and maps it.
/// A leftover of the same name is re-created if its owner process is gone
/// or it has no valid header; one whose owner lives is an error.
pub(crate) fn create_mapping(name: &str, len: usize) -> Result<Mapping> {
    let c = cname(name);
    let mut retried = false;
    loop {
        // SAFETY: c is a valid NUL-terminated name.
        let fd = unsafe {
            libc::shm_open(
                c.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
                0o600,
            )
        };
        if fd < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EEXIST) && !retried {
                retried = true;
                match map_existing(name) {
                    Ok(old) if !owner_gone(&old) => {
                        let pid =
                            header_of(&old).map_or(0, |h| h.owner_pid.load(Ordering::Relaxed));
                        return Err(Error::Unsupported {
                            what: "creating a shared-memory object",
                            reason: format!("{name} is in use by live process {pid}"),
                        });
                    }
                    _ => {
                        tracing::warn!(name, "removing an object left by a process that is gone");
                        unlink(name);
                        continue;
                    }
                }
            }
            return Err(Error::io("shm_open(O_CREAT)", e));
        }
        // SAFETY: `fd` was just opened (checked above) and is ours.
        let guard = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: fd is ours; ftruncate sizes the new object.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            let e = io::Error::last_os_error();
            unlink(name);
            return Err(Error::io("ftruncate(shm)", e));
        }
        let map = Mapping::map_fd(fd, len).map_err(|e| {
            unlink(name);
            Error::io("mmap(shm)", e)
        })?;
        drop(guard);
        return Ok(map);
    }
}

/// Identifies this host, its /dev/shm and the calling thread's network
/// namespace: peers with the same token can reach each other's rings and
/// abstract Unix sockets (the latter are per network namespace). Zero if it
/// cannot be determined.
pub(crate) fn host_token() -> u64 {
    use std::os::unix::fs::MetadataExt;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let shm = std::fs::metadata("/dev/shm");
    let net = std::fs::metadata("/proc/thread-self/ns/net");
    let (Ok(shm), Ok(net)) = (shm, net) else {
        return 0;
    };
    if boot.is_empty() {
        return 0;
    }
    let mut h = crate::sys::fnv64(boot.trim().as_bytes());
    h ^= shm.dev().wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h ^= shm.ino().rotate_left(17);
    h ^= net
        .ino()
        .wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        .rotate_left(29);
    h.max(1)
}

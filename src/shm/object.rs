//! POSIX shared-memory objects (`/dev/shm/ferry-*`): creating, mapping and
//! removing them, and sweeping those whose owner died.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::ring::{Header, BELL_MAGIC, RING_MAGIC};
use crate::error::{Error, Result};
use crate::sys::{pid_alive, syscall, Mapping};

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

/// What a look at an existing object `/dev/shm/<name>` found, without
/// mapping it: another user (or a concurrent `ftruncate`) can shrink a
/// file under a mapping, and touching a page past its end is a SIGBUS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Peek {
    /// Not there, not a regular file, not ours, or unreadable: never
    /// touched (nor unlinked) by the sweep.
    NotOurs,
    /// Ours, but no ferry header (too short, or still being laid out).
    NoHeader,
    /// Ours, with a ring's or doorbell's header naming its owner.
    Owned { pid: u32, pid_ns: u64 },
}

impl Peek {
    /// Whether the owner is certainly gone: same pid namespace as ours
    /// (else its pid means nothing here) and no such process.
    fn owner_gone(self) -> bool {
        match self {
            Peek::Owned { pid, pid_ns: ns } => ns == pid_ns() && !pid_alive(pid),
            _ => false,
        }
    }
}

/// Looks at `name` (`/ferry-...`): opened read-only without following a
/// link, checked to be a regular file of our own user (`fstat` on the
/// opened descriptor), its header read with `pread`.
fn peek(name: &str) -> Peek {
    let c = cname(name);
    // SAFETY: valid name; glibc's shm_open adds O_NOFOLLOW.
    let fd = unsafe {
        libc::shm_open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Peek::NotOurs;
    }
    // SAFETY: `fd` was just opened (checked above) and is ours.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: stat of an fd we hold into a zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above; geteuid has no preconditions.
    let ours = unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0
        && st.st_mode & libc::S_IFMT == libc::S_IFREG
        && st.st_uid == unsafe { libc::geteuid() };
    if !ours {
        return Peek::NotOurs;
    }
    let mut raw = [0u8; std::mem::size_of::<Header>()];
    // SAFETY: reads into our own buffer of its length; a file shorter than
    // that (or shrunk meanwhile) gives a short count, never a fault.
    let n = unsafe { libc::pread(fd.as_raw_fd(), raw.as_mut_ptr().cast(), raw.len(), 0) };
    if n != raw.len() as isize {
        return Peek::NoHeader;
    }
    parse_header(&raw)
}

/// The owner a ring's or doorbell's header names (`Header`'s layout, read
/// as plain bytes: native-endian, as the owner wrote them).
fn parse_header(raw: &[u8]) -> Peek {
    use std::mem::offset_of;
    let u64_at = |o: usize| u64::from_ne_bytes(raw[o..o + 8].try_into().expect("8 bytes"));
    let u32_at = |o: usize| u32::from_ne_bytes(raw[o..o + 4].try_into().expect("4 bytes"));
    let magic = u64_at(offset_of!(Header, magic));
    if magic != RING_MAGIC && magic != BELL_MAGIC {
        return Peek::NoHeader;
    }
    Peek::Owned {
        pid: u32_at(offset_of!(Header, owner_pid)),
        pid_ns: u64_at(offset_of!(Header, pid_ns)),
    }
}

/// Whether `/dev/shm/<name>` is a FIFO of our own user (not following a
/// link).
fn our_fifo(name: &str) -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    std::fs::symlink_metadata(format!("/dev/shm/{name}"))
        .is_ok_and(|m| m.file_type().is_fifo() && m.uid() == me)
}

/// Removes the ferry objects in /dev/shm (rings, doorbells and their
/// FIFOs) of our own user whose owner process died without cleaning up.
/// Other users' objects are never opened for writing, mapped or removed.
/// Returns how many were removed.
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
            if our_fifo(&name) && !std::path::Path::new(&format!("/dev/shm/{base}")).exists() {
                let _ = std::fs::remove_file(e.path());
            }
            continue;
        }
        let path = format!("/{name}");
        // Only objects with a header whose owner is gone: one still being
        // laid out has no magic yet.
        let found = peek(&path);
        if found.owner_gone() {
            unlink(&path);
            if our_fifo(&format!("{name}.fifo")) {
                let _ = std::fs::remove_file(format!("/dev/shm/{name}.fifo"));
            }
            let Peek::Owned { pid, .. } = found else {
                unreachable!("only an owned object has a gone owner")
            };
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
    let fd = syscall!(shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0))
        .map_err(|e| Error::io("shm_open", e))?;
    // SAFETY: `fd` was just opened (checked above) and is ours.
    let guard = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: stat of an fd we hold into a zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    syscall!(fstat(fd, &mut st)).map_err(|e| Error::io("fstat(shm)", e))?;
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
        let flags = libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC;
        // SAFETY: c is a valid NUL-terminated name.
        let fd = match syscall!(shm_open(c.as_ptr(), flags, 0o600)) {
            Ok(fd) => fd,
            Err(e) => {
                if e.raw_os_error() == Some(libc::EEXIST) && !retried {
                    retried = true;
                    let refuse = |reason: String| Error::Unsupported {
                        what: "creating a shared-memory object",
                        reason: format!("{name} {reason}"),
                    };
                    let found = peek(name);
                    match found {
                        Peek::NotOurs => {
                            return Err(refuse(
                                "exists and is not a regular file of this user: left alone".into(),
                            ))
                        }
                        Peek::Owned { pid, .. } if !found.owner_gone() => {
                            return Err(refuse(format!("is in use by live process {pid}")))
                        }
                        _ => {
                            tracing::warn!(
                                name,
                                "removing an object left by a process that is gone"
                            );
                            unlink(name);
                            continue;
                        }
                    }
                }
                return Err(Error::io("shm_open(O_CREAT)", e));
            }
        };
        // SAFETY: `fd` was just opened (checked above) and is ours.
        let guard = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: fd is ours; ftruncate sizes the new object.
        if let Err(e) = syscall!(ftruncate(fd, len as libc::off_t)) {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Creates `/dev/shm<name>` (mode 0600) and returns it open.
    fn plant(name: &str) -> std::fs::File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(format!("/dev/shm{name}"))
            .unwrap()
    }

    /// A ring header naming `pid` in our pid namespace.
    fn header(pid: u32) -> Vec<u8> {
        use std::mem::offset_of;
        let mut raw = vec![0u8; std::mem::size_of::<Header>()];
        let m = offset_of!(Header, magic);
        raw[m..m + 8].copy_from_slice(&RING_MAGIC.to_ne_bytes());
        let p = offset_of!(Header, owner_pid);
        raw[p..p + 4].copy_from_slice(&pid.to_ne_bytes());
        let n = offset_of!(Header, pid_ns);
        raw[n..n + 8].copy_from_slice(&pid_ns().to_ne_bytes());
        raw
    }

    #[test]
    fn a_peek_reads_the_header_without_mapping() {
        use std::io::Write;
        let name = format!("/ferry-test-peek-{:x}", std::process::id());
        let mut f = plant(&name);
        assert_eq!(peek(&name), Peek::NoHeader, "empty");
        f.write_all(&header(std::process::id())).unwrap();
        assert_eq!(
            peek(&name),
            Peek::Owned {
                pid: std::process::id(),
                pid_ns: pid_ns()
            }
        );
        assert!(!peek(&name).owner_gone(), "we are alive");
        unlink(&name);
        assert_eq!(peek(&name), Peek::NotOurs, "gone");
    }

    /// The sweep reads headers with pread: a file shrunk and grown under
    /// it (as another process may, any time) cannot fault it. With the
    /// mapping it used before, this killed the process with SIGBUS.
    #[test]
    fn the_sweep_survives_objects_resized_under_it() {
        use std::os::unix::fs::FileExt;
        let name = format!("/ferry-test-resize-{:x}", std::process::id());
        let f = plant(&name);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s2 = stop.clone();
        let hdr = header(std::process::id());
        let resizer = std::thread::spawn(move || {
            while !s2.load(std::sync::atomic::Ordering::Relaxed) {
                f.set_len(0).unwrap();
                f.set_len(4096).unwrap();
                f.write_all_at(&hdr, 0).unwrap();
            }
        });
        let t0 = std::time::Instant::now();
        let mut sweeps = 0;
        while t0.elapsed() < std::time::Duration::from_millis(300) {
            sweep_stale();
            sweeps += 1;
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        resizer.join().unwrap();
        assert!(sweeps > 10, "{sweeps} sweeps");
        assert!(
            std::path::Path::new(&format!("/dev/shm{name}")).exists(),
            "a live owner's object stays"
        );
        unlink(&name);
    }

    /// Another user's object is never opened for writing, mapped or
    /// removed, whatever its header says.
    #[test]
    #[ignore = "needs root (plants an object owned by another user)"]
    fn the_sweep_leaves_another_users_object_alone() {
        use std::io::Write;
        use std::os::unix::fs::MetadataExt;
        let name = format!("/ferry-test-other-{:x}", std::process::id());
        let mut f = plant(&name);
        // A header whose owner is gone: ours would be removed.
        f.write_all(&header(0x7fff_fff0)).unwrap();
        std::os::unix::fs::fchown(&f, Some(65534), Some(65534)).unwrap();
        let path = format!("/dev/shm{name}");
        assert_eq!(std::fs::metadata(&path).unwrap().uid(), 65534);
        assert_eq!(peek(&name), Peek::NotOurs);
        sweep_stale();
        assert!(std::path::Path::new(&path).exists(), "not removed");
        let Err(e) = create_mapping(&name, 4096) else {
            panic!("created over another user's object");
        };
        assert!(e.to_string().contains("left alone"), "{e}");
        assert!(std::path::Path::new(&path).exists(), "not removed");
        std::fs::remove_file(&path).unwrap();
    }
}

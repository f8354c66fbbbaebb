//! POSIX shared-memory objects holding rings, and memfd-backed host memory.

use std::ffi::CString;
use std::io;

use std::sync::atomic::Ordering;

use super::bell::{RemoteBell, BELL_MAGIC};
use super::ring::{ring_bytes, Header, Ring, RingError, RING_MAGIC};
use crate::error::{Error, Result};
use crate::sys::{pid_alive, this_pid, Mapping};

struct Fd(i32);
impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: we own the descriptor.
        unsafe { libc::close(self.0) };
    }
}

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
    if map.len < std::mem::size_of::<Header>() {
        return None;
    }
    // SAFETY: the mapping is page aligned and holds a whole header; every
    // field is an atomic.
    let h = unsafe { &*(map.ptr as *const Header) };
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
    let guard = Fd(fd);
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
        let guard = Fd(fd);
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

/// A ring in a POSIX shared-memory object (`/dev/shm/<name>`).
pub(crate) struct ShmRing {
    pub ring: Ring,
    _map: Mapping,
    name: String,
    /// The creator (the ring's consumer) removes the object on drop.
    owner: bool,
    /// A producer's way to wake the consumer (see `bell.rs`).
    pub bell: Option<std::sync::Arc<RemoteBell>>,
}

impl ShmRing {
    /// Creates the ring `name` with mode 0600 (see `create_mapping` for a
    /// leftover of the same name).
    pub fn create(name: &str, capacity: usize, generation: u64) -> Result<ShmRing> {
        let map = create_mapping(name, ring_bytes(capacity))?;
        // SAFETY: a fresh (zero-filled: O_EXCL, then ftruncate) page-aligned
        // mapping of `ring_bytes(capacity)` bytes nobody else uses until the
        // magic is published by init.
        let ring = unsafe { Ring::init(map.ptr, capacity, this_pid(), pid_ns(), generation) };
        Ok(ShmRing {
            ring,
            _map: map,
            name: name.to_owned(),
            owner: true,
            bell: None,
        })
    }

    /// Opens an existing ring to produce into it.
    pub fn open(name: &str) -> Result<ShmRing> {
        let map = map_existing(name)?;
        // SAFETY: the mapping is page aligned and `len` long, and lives in the ShmRing.
        let ring =
            unsafe { Ring::attach(map.ptr, map.len) }.map_err(|reason| Error::Unsupported {
                what: "attaching a shared-memory ring",
                reason: format!("{name}: {reason}"),
            })?;
        Ok(ShmRing {
            ring,
            _map: map,
            name: name.to_owned(),
            owner: false,
            bell: None,
        })
    }

    /// Appends one message and, if the consumer stopped polling the ring,
    /// rings its doorbell.
    pub fn push(&self, msg: &[u8]) -> std::result::Result<(), RingError> {
        self.push_quiet(msg)?;
        self.ring_if_wanted();
        Ok(())
    }

    /// Appends one message without ringing: the caller rings with
    /// `ring_if_wanted` once it has pushed what it has (one wake-up for a
    /// pass's messages instead of one at the first of them).
    pub fn push_quiet(&self, msg: &[u8]) -> std::result::Result<(), RingError> {
        self.ring.push(msg)
    }

    /// Rings the consumer's doorbell if it stopped polling the ring (after
    /// `push_quiet`; a look at one flag when it polls).
    pub fn ring_if_wanted(&self) {
        if let Some(b) = &self.bell {
            if let Some(bit) = self.ring.bell_wanted() {
                b.ring(bit);
            }
        }
    }

    pub fn owner_pid(&self) -> u32 {
        self.ring
            .header()
            .owner_pid
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for ShmRing {
    fn drop(&mut self) {
        if self.owner {
            unlink(&self.name);
        }
    }
}

/// Names of the shared-memory objects ferry makes, so tests and tools can
/// find them: `/dev/shm/ferry-<sender id>-<receiver id>-<conn>`, and the
/// accept ring `/dev/shm/ferry-<id>`.
pub(crate) fn accept_ring_name(id: u64) -> String {
    format!("/ferry-{id:016x}")
}

/// One direction of one connection: the pair of endpoints, and the number
/// the connecting side gave the connection (two endpoints may hold several
/// connections, and a closing one may still be draining).
pub(crate) fn pair_ring_name(sender: u64, receiver: u64, conn: u32) -> String {
    format!("/ferry-{sender:016x}-{receiver:016x}-{conn:08x}")
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

    #[test]
    fn ring_object_is_0600_and_removed_on_drop() {
        use std::os::unix::fs::PermissionsExt;
        let name = format!("/ferry-test-{:x}", std::process::id());
        let r = ShmRing::create(&name, 8, 1).unwrap();
        let path = format!("/dev/shm{name}");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "mode {mode:o} lets others in");
        let p = ShmRing::open(&name).unwrap();
        p.ring.push(b"x").unwrap();
        assert_eq!(r.ring.len(), 1);
        assert!(
            ShmRing::create(&name, 8, 2).is_err(),
            "a live owner's ring is not taken over"
        );
        drop(p);
        drop(r);
        assert!(!std::path::Path::new(&path).exists());
    }

    #[test]
    fn stale_ring_of_a_dead_owner_is_recreated() {
        let name = format!("/ferry-test-stale-{:x}", std::process::id());
        let r = ShmRing::create(&name, 8, 1).unwrap();
        // Pretend the owner died: pid 0 is never alive.
        r.ring
            .header()
            .owner_pid
            .store(0, std::sync::atomic::Ordering::Relaxed);
        std::mem::forget(r);
        let fresh = ShmRing::create(&name, 8, 9).unwrap();
        assert_eq!(
            fresh
                .ring
                .header()
                .generation
                .load(std::sync::atomic::Ordering::Relaxed),
            9
        );
        assert_eq!(fresh.owner_pid(), std::process::id());
    }

    #[test]
    fn memfd_buffer_maps() {
        let m = crate::sys::MemfdBuf::new(1 << 20).unwrap();
        // SAFETY: the mapping is 1 MiB long.
        unsafe { *m.map.ptr.add(12345) = 7 };
        let again = Mapping::map_fd(m.fd, 1 << 20).unwrap();
        // SAFETY: same length, shared mapping of the same memfd.
        assert_eq!(unsafe { *again.ptr.add(12345) }, 7);
        assert_ne!(host_token(), 0);
    }

    /// Several producer processes push into one ring (a shared mapping they
    /// inherit); the consumer sees every message once, in order per
    /// producer. The children touch only the mapping (no allocation, no
    /// locks: safe after `fork` in a threaded test runner) and `_exit`.
    #[test]
    fn ring_under_several_producer_processes() {
        let name = format!("/ferry-stress-{:x}", std::process::id());
        let ring = ShmRing::create(&name, 64, 1).unwrap();
        let producers = 4u32;
        let per = 50_000u32;
        let mut kids = Vec::new();
        for p in 0..producers {
            // SAFETY: the child only pushes into the inherited shared
            // mapping (atomics and a memcpy) and leaves with `_exit`.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
            if pid == 0 {
                for i in 0..per {
                    let mut m = [0u8; 8];
                    m[..4].copy_from_slice(&p.to_le_bytes());
                    m[4..].copy_from_slice(&i.to_le_bytes());
                    while ring.ring.push(&m).is_err() {
                        std::hint::spin_loop();
                    }
                }
                // SAFETY: ends the child without running the parent's
                // destructors or atexit handlers.
                unsafe { libc::_exit(0) };
            }
            kids.push(pid);
        }
        let mut next = vec![0u32; producers as usize];
        let mut got = 0;
        let mut buf = [0u8; crate::shm::ring::SLOT_PAYLOAD];
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while got < producers * per {
            assert!(
                std::time::Instant::now() < deadline,
                "only {got} messages arrived"
            );
            match ring.ring.pop(&mut buf) {
                Some(n) => {
                    assert_eq!(n, 8);
                    let p = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
                    let i = u32::from_le_bytes(buf[4..8].try_into().unwrap());
                    assert_eq!(i, next[p], "producer {p} out of order");
                    next[p] += 1;
                    got += 1;
                }
                None => std::hint::spin_loop(),
            }
        }
        for pid in kids {
            let mut status = 0;
            // SAFETY: reaps a child of ours; `status` is ours to write.
            let r = unsafe { libc::waitpid(pid, &mut status, 0) };
            assert_eq!(r, pid);
            assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        }
        assert!(ring.ring.pop(&mut buf).is_none());
    }
}

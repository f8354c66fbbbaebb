//! A ring in a named POSIX shared-memory object, and the names ferry gives
//! them.

use super::bell::RemoteBell;
use super::object::{create_mapping, map_existing, pid_ns, unlink};
use super::ring::{ring_bytes, Ring, RingError};
use crate::error::{Error, Result};
use crate::sys::{this_pid, Mapping};

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
        let ring = unsafe { Ring::init(map.ptr(), capacity, this_pid(), pid_ns(), generation) };
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
            unsafe { Ring::attach(map.ptr(), map.len()) }.map_err(|reason| Error::Unsupported {
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

    /// A ring in a memfd (no name in /dev/shm), as its consumer's view and
    /// a producer's, each its own mapping of the same memory: what two
    /// processes see, for tests of the same-host transport in one process.
    #[cfg(test)]
    pub fn memfd_pair(capacity: usize) -> Result<(ShmRing, ShmRing)> {
        let len = ring_bytes(capacity);
        let buf = crate::sys::MemfdBuf::new(len)?;
        let map = |what| Mapping::map_fd(buf.fd, len).map_err(|e| Error::io(what, e));
        let (ours, theirs) = (map("mmap(ring)")?, map("mmap(ring)")?);
        // SAFETY: a fresh zero-filled page-aligned mapping of `len` bytes
        // that nobody uses before init returns.
        let ring = unsafe { Ring::init(ours.ptr(), capacity, this_pid(), pid_ns(), 1) };
        // SAFETY: the mapping is page aligned, `len` long, and kept below.
        let producer =
            unsafe { Ring::attach(theirs.ptr(), len) }.map_err(|reason| Error::Unsupported {
                what: "attaching a memfd ring",
                reason: reason.to_string(),
            })?;
        let view = |ring, map| ShmRing {
            ring,
            _map: map,
            name: String::new(),
            owner: false,
            bell: None,
        };
        Ok((view(ring, ours), view(producer, theirs)))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::object::host_token;
    use std::io;

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
        unsafe { *m.map.ptr().add(12345) = 7 };
        let again = Mapping::map_fd(m.fd, 1 << 20).unwrap();
        // SAFETY: same length, shared mapping of the same memfd.
        assert_eq!(unsafe { *again.ptr().add(12345) }, 7);
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

//! Doorbells: how a producer wakes a consumer that does not poll its ring.
//!
//! A shard polls the rings of its busy connections every pass and marks a
//! quiet one cold in the ring's header (`Ring::set_bell`). A producer that
//! pushes into a cold ring sets the ring's bit on the consumer shard's
//! doorbell page, and, if the shard announced it sleeps, writes a byte
//! into the doorbell's FIFO, which sits in the shard's epoll set. So a
//! pass looks at one word for all its quiet rings, not at each of them,
//! and a parked shard wakes as soon as a message arrives.
//!
//! The page is a POSIX shared-memory object beside the rings (mode 0600,
//! `/dev/shm/ferry-<id>-bell<shard>`), the FIFO the same name plus
//! `.fifo`. Layout, one 128-byte line each but the last:
//!
//! ```text
//! line 0   ring::Header with BELL_MAGIC (owner pid and pid namespace: the
//!          stale-object sweep reads them like a ring's)
//! line 1   parked: the consumer sleeps (or is about to) · rung: a bit was set
//! line 2   summary: bit w set when word w may hold bits (16 words)
//! then     BELL_BITS bits (1024 words), one per ring
//! ```
//!
//! Two Dekker pairs make a wake-up impossible to lose (every access below
//! is SeqCst or fenced): the consumer stores `cold` then looks at the ring,
//! a producer stores the message then looks at `cold`; the consumer stores
//! `parked` then looks at `rung`, a producer stores `rung` then looks at
//! `parked`. In each pair at least one side sees the other's store.
//!
//! Producers are processes of our own user (the objects are 0600): one that
//! sets bits it should not only makes us look at rings for nothing; one
//! that clears `parked` without writing the FIFO delays the shard's wake-up
//! to its next timer, as if it had not pushed at all.

use crate::sync::{fence, AtomicU32, AtomicU64, Ordering};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::object::{create_mapping, map_existing, pid_ns, unlink};
use super::ring::Header;
pub(crate) use super::ring::BELL_MAGIC;
use crate::error::{Error, Result};
use crate::sys::{syscall, this_pid, Mapping};

const BELL_VERSION: u32 = 1;
/// Rings one doorbell serves (per shard); connections past it are polled.
#[cfg(not(loom))]
pub const BELL_BITS: u32 = 1 << 16;
/// A model's page: two words, one summary word.
#[cfg(loom)]
pub const BELL_BITS: u32 = 128;
const WORDS: usize = BELL_BITS as usize / 64;
const SUMMARY_WORDS: usize = WORDS.div_ceil(64);
/// The accept ring's bit; connection `idx` of a shard has bit `idx + 1`.
pub const ACCEPT_BIT: u32 = 0;

#[repr(C, align(128))]
struct Flags {
    parked: AtomicU32,
    rung: AtomicU32,
}

#[repr(C, align(128))]
struct Summary([AtomicU64; SUMMARY_WORDS]);

#[repr(C)]
struct Page {
    header: Header,
    flags: Flags,
    summary: Summary,
    words: [AtomicU64; WORDS],
}

const PAGE_BYTES: usize = std::mem::size_of::<Page>();
#[cfg(not(loom))]
const _: () = assert!(PAGE_BYTES == 3 * 128 + WORDS * 8);

/// The protocol, on the page alone (the FIFO is the caller's).
impl Page {
    /// Consumer: calls `f` with each bit rung since the last call;
    /// returns how many. Costs one load when nothing was rung.
    fn take(&self, mut f: impl FnMut(u32)) -> usize {
        if self.flags.rung.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        // Cleared before the bits are taken: a bit set after this is
        // followed by another `rung`, seen next time.
        self.flags.rung.swap(0, Ordering::SeqCst);
        let mut n = 0;
        for (s, summary) in self.summary.0.iter().enumerate() {
            if summary.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut sw = summary.swap(0, Ordering::Acquire);
            while sw != 0 {
                let w = s * 64 + sw.trailing_zeros() as usize;
                sw &= sw - 1;
                let mut bits = self.words[w].swap(0, Ordering::Acquire);
                while bits != 0 {
                    f((w * 64) as u32 + bits.trailing_zeros());
                    bits &= bits - 1;
                    n += 1;
                }
            }
        }
        n
    }

    /// Consumer: announces a sleep or its end. The fence orders the
    /// announcement before the consumer's next `take` (the other half of
    /// `ring`'s fence): without it the look at `rung` may be served before
    /// the store is seen, and the wake-up lost (the loom model found that
    /// this page relied on a fence its caller happened to place).
    fn set_parked(&self, on: bool) {
        self.flags.parked.store(u32::from(on), Ordering::SeqCst);
        if on {
            fence(Ordering::SeqCst);
        }
    }

    /// Producer: sets `bit`; true when the caller must wake the consumer
    /// (it announced a sleep, and this producer is the one that cleared it).
    fn ring(&self, bit: u32) -> bool {
        if bit >= BELL_BITS {
            return false;
        }
        let w = (bit / 64) as usize;
        let m = 1u64 << (bit % 64);
        if self.words[w].load(Ordering::Relaxed) & m == 0 {
            self.words[w].fetch_or(m, Ordering::Release);
        }
        self.summary.0[w / 64].fetch_or(1 << (w % 64), Ordering::Release);
        self.flags.rung.swap(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // One producer per sleep writes the FIFO: whoever clears `parked`.
        self.flags.parked.load(Ordering::Relaxed) != 0
            && self.flags.parked.swap(0, Ordering::SeqCst) != 0
    }
}

/// The doorbell of shard `shard` of endpoint `id`.
pub(crate) fn bell_name(id: u64, shard: u32) -> String {
    format!("/ferry-{id:016x}-bell{shard}")
}

fn fifo_path(name: &str) -> CString {
    CString::new(format!("/dev/shm{name}.fifo")).expect("bell names have no NUL")
}

/// A mapping known to hold a whole doorbell page: only `new` makes one,
/// after checking the length (mmap gives page alignment).
struct PageMap(Mapping);

impl PageMap {
    fn new(map: Mapping) -> std::result::Result<PageMap, Mapping> {
        if map.len() >= PAGE_BYTES && map.ptr() as usize % std::mem::align_of::<Page>() == 0 {
            Ok(PageMap(map))
        } else {
            Err(map)
        }
    }

    fn page(&self) -> &Page {
        // SAFETY: `new` checked the mapping is aligned for and at least as
        // long as a Page, and the mapping lives as long as `self`; every
        // field of Page is an atomic, so shared references to memory other
        // processes write are sound.
        unsafe { &*(self.0.ptr() as *const Page) }
    }
}

/// A consumer shard's doorbell: it owns the page and the FIFO and removes
/// both on drop.
pub(crate) struct Bell {
    map: PageMap,
    fifo: OwnedFd,
    name: String,
}

impl Bell {
    pub fn create(id: u64, shard: u32) -> Result<Bell> {
        let name = bell_name(id, shard);
        let map = PageMap::new(create_mapping(&name, PAGE_BYTES)?).map_err(|m| {
            unlink(&name);
            Error::Unsupported {
                what: "creating a doorbell",
                reason: format!("a {} byte mapping at {:p}", m.len(), m.ptr()),
            }
        })?;
        let path = fifo_path(&name);
        // The page was created exclusively, so its name is ours: a FIFO of
        // that name is a dead owner's.
        // SAFETY: valid path.
        unsafe { libc::unlink(path.as_ptr()) };
        // SAFETY: valid path.
        if let Err(e) = syscall!(mkfifo(path.as_ptr(), 0o600)) {
            unlink(&name);
            return Err(Error::io("mkfifo(doorbell)", e));
        }
        // O_RDWR: the FIFO always has a writer (us), so it never reports
        // end-of-file and opening it never blocks.
        let flags = libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC;
        // SAFETY: valid path.
        let fd = match syscall!(open(path.as_ptr(), flags)) {
            Ok(fd) => fd,
            Err(e) => {
                // SAFETY: valid path.
                unsafe { libc::unlink(path.as_ptr()) };
                unlink(&name);
                return Err(Error::io("open(doorbell fifo)", e));
            }
        };
        let bell = Bell {
            map,
            // SAFETY: `fd` was just opened (checked above) and is ours.
            fifo: unsafe { OwnedFd::from_raw_fd(fd) },
            name,
        };
        let h = &bell.map.page().header;
        h.version.store(BELL_VERSION, Ordering::Relaxed);
        h.capacity.store(BELL_BITS, Ordering::Relaxed);
        h.owner_pid.store(this_pid(), Ordering::Relaxed);
        h.pid_ns.store(pid_ns(), Ordering::Relaxed);
        // Magic last: producers open only a page that is laid out.
        h.magic.store(BELL_MAGIC, Ordering::Release);
        Ok(bell)
    }

    /// The FIFO's read end, for the shard's epoll set.
    pub fn fd(&self) -> i32 {
        self.fifo.as_raw_fd()
    }

    /// Calls `f` with each bit rung since the last call; returns how many.
    /// Costs one load when nothing was rung.
    pub fn take(&self, f: impl FnMut(u32)) -> usize {
        self.map.page().take(f)
    }

    /// Announces a sleep (`true`; the caller then looks at its rings and
    /// `take`s once more before sleeping) or its end.
    pub fn set_parked(&self, on: bool) {
        self.map.page().set_parked(on);
    }

    /// Empties the FIFO (after a sleep). One read: producers write at most
    /// one byte per sleep.
    pub fn drain(&self) {
        let mut buf = [0u8; 64];
        // SAFETY: reading into a local buffer from our FIFO.
        unsafe { libc::read(self.fifo.as_raw_fd(), buf.as_mut_ptr() as *mut _, buf.len()) };
    }
}

impl Drop for Bell {
    fn drop(&mut self) {
        unlink(&self.name);
        let path = fifo_path(&self.name);
        // SAFETY: valid path; we made the FIFO.
        unsafe { libc::unlink(path.as_ptr()) };
    }
}

/// A producer's handle on a consumer shard's doorbell.
pub(crate) struct RemoteBell {
    map: PageMap,
    fifo: OwnedFd,
}

impl RemoteBell {
    pub fn open(id: u64, shard: u32) -> Result<RemoteBell> {
        let name = bell_name(id, shard);
        let refuse = |reason: String| Error::Unsupported {
            what: "opening a local peer's doorbell",
            reason: format!("{name}: {reason}"),
        };
        let map = PageMap::new(map_existing(&name)?)
            .map_err(|m| refuse(format!("{} bytes, want {PAGE_BYTES}", m.len())))?;
        let h = &map.page().header;
        if h.magic.load(Ordering::Acquire) != BELL_MAGIC
            || h.version.load(Ordering::Relaxed) != BELL_VERSION
        {
            return Err(refuse("not a doorbell of this version".into()));
        }
        let path = fifo_path(&name);
        // O_RDWR, not O_WRONLY: we are a reader of the FIFO too, so when its
        // owner dies a ring is a byte into a full-or-not pipe (EAGAIN at
        // worst), never EPIPE and the SIGPIPE that kills a C host.
        let flags = libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC;
        // SAFETY: valid path. O_NONBLOCK: never wait for a reader.
        let fd = syscall!(open(path.as_ptr(), flags))
            .map_err(|e| Error::io("open(doorbell fifo)", e))?;
        // SAFETY: `fd` was just opened (checked above) and is ours.
        let fifo = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: stat of an fd we hold into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFIFO {
            return Err(refuse("the doorbell's FIFO is not a FIFO".into()));
        }
        Ok(RemoteBell { map, fifo })
    }

    /// Sets `bit` and wakes the consumer if it sleeps.
    pub fn ring(&self, bit: u32) {
        if self.map.page().ring(bit) {
            // SAFETY: one byte from a constant into our FIFO handle. A full
            // FIFO (EAGAIN) already holds a wake-up.
            unsafe { libc::write(self.fifo.as_raw_fd(), [1u8].as_ptr() as *const _, 1) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::fd_readable as readable;

    fn test_id(tag: u64) -> u64 {
        (u64::from(std::process::id()) << 20) ^ tag ^ 0xbe11_0000_0000_0000
    }

    #[test]
    fn bits_rung_are_taken_once_and_only_a_sleeper_is_woken() {
        let id = test_id(1);
        let bell = Bell::create(id, 3).unwrap();
        let remote = RemoteBell::open(id, 3).unwrap();
        assert_eq!(bell.take(|_| panic!("nothing rung")), 0);
        for bit in [0, 1, 63, 64, 4095, 4096, BELL_BITS - 1, 1, 64] {
            remote.ring(bit);
        }
        remote.ring(BELL_BITS); // out of range: ignored
        let mut got = Vec::new();
        assert_eq!(bell.take(|b| got.push(b)), 7);
        got.sort_unstable();
        assert_eq!(got, [0, 1, 63, 64, 4095, 4096, BELL_BITS - 1]);
        assert_eq!(bell.take(|_| panic!("taken twice")), 0);
        assert!(!readable(bell.fd(), 0), "awake: no byte in the FIFO");
        bell.set_parked(true);
        remote.ring(9);
        remote.ring(10);
        assert!(readable(bell.fd(), 5000), "a sleeper is woken");
        bell.drain();
        assert!(!readable(bell.fd(), 0), "one byte per sleep, drained");
        assert_eq!(bell.take(|_| {}), 2);
        // The page and the FIFO go with the bell.
        let page_path = format!("/dev/shm{}", bell_name(id, 3));
        drop(bell);
        assert!(!std::path::Path::new(&page_path).exists());
        assert!(!std::path::Path::new(&format!("{page_path}.fifo")).exists());
        assert!(RemoteBell::open(id, 3).is_err());
    }

    /// A producer rings while the consumer is going to sleep: the consumer
    /// either takes the bit before sleeping or is woken from its sleep,
    /// never sleeps through it (a lost wake-up would hit the 10 s wait).
    #[test]
    fn a_ring_racing_a_park_is_never_lost() {
        let id = test_id(2);
        let bell = Bell::create(id, 0).unwrap();
        let rounds = if cfg!(miri) { 10 } else { 3000 };
        let (go_tx, go_rx) = std::sync::mpsc::channel::<u32>();
        let producer = std::thread::spawn(move || {
            let remote = RemoteBell::open(id, 0).unwrap();
            while let Ok(r) = go_rx.recv() {
                // Vary where the ring lands in the consumer's park.
                for _ in 0..(r % 7) * 50 {
                    std::hint::spin_loop();
                }
                remote.ring(r % 64);
            }
        });
        let (mut taken_first, mut woken) = (0, 0);
        for r in 0..rounds {
            go_tx.send(r).unwrap();
            bell.set_parked(true);
            if bell.take(|_| {}) > 0 {
                taken_first += 1;
            } else {
                assert!(
                    readable(bell.fd(), 10_000),
                    "round {r}: slept through a ring"
                );
                woken += 1;
                // The bit is there once the FIFO says so.
                let mut n = bell.take(|_| {});
                while n == 0 {
                    n = bell.take(|_| {});
                }
            }
            bell.set_parked(false);
            bell.drain();
        }
        drop(go_tx);
        producer.join().unwrap();
        assert_eq!(taken_first + woken, rounds);
    }
}

/// The doorbell with a ring under loom (`--cfg loom`): the real `push`,
/// `bell_wanted`, `set_bell`, `ring`, `take` and `set_parked`, with the
/// FIFO modelled by a notification that is remembered until taken (as a
/// byte in a FIFO is).
#[cfg(all(test, loom))]
mod loom_models {
    use super::*;
    use crate::shm::ring::model::ModelRing;
    use crate::shm::ring::SLOT_PAYLOAD;
    use loom::sync::Notify;
    use std::sync::Arc;

    fn page() -> Page {
        Page {
            header: Header::for_model(),
            flags: Flags {
                parked: AtomicU32::new(0),
                rung: AtomicU32::new(0),
            },
            summary: Summary(std::array::from_fn(|_| AtomicU64::new(0))),
            words: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    const BIT: u32 = 70;

    /// A producer pushes while the consumer turns the ring cold and goes
    /// to sleep: the message is always seen, by the consumer's look after
    /// going cold or through the bell, and a sleep always ends (a lost
    /// wake-up is a deadlock loom reports).
    #[test]
    fn loom_no_wake_up_is_lost() {
        loom::model(|| {
            let ring = Arc::new(ModelRing::new(2));
            let page = Arc::new(page());
            let fifo = Arc::new(Notify::new());
            let producer = {
                let (ring, page, fifo) = (ring.clone(), page.clone(), fifo.clone());
                loom::thread::spawn(move || {
                    ring.ring.push(b"m").unwrap();
                    if let Some(bit) = ring.ring.bell_wanted() {
                        if page.ring(bit) {
                            fifo.notify();
                        }
                    }
                })
            };
            let mut out = [0u8; SLOT_PAYLOAD];
            // The pass that finds the ring quiet marks it cold, then looks
            // once more.
            ring.ring.set_bell(BIT, true);
            let mut got = ring.ring.pop(&mut out).is_some();
            let mut take = |got: &mut bool| {
                page.take(|b| {
                    assert_eq!(b, BIT);
                    assert!(
                        ring.ring.pop(&mut out).is_some() || *got,
                        "rung, nothing there"
                    );
                    *got = true;
                });
            };
            while !got {
                // Park: announce, one more pass, sleep, end.
                page.set_parked(true);
                take(&mut got);
                if !got {
                    fifo.wait();
                }
                page.set_parked(false);
                take(&mut got);
            }
            producer.join().unwrap();
        });
    }
}

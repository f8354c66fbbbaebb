//! Where a same-host round trip's time goes: each stage of the last op
//! stamps the time it was reached (`CLOCK_MONOTONIC`, ns), in a page both
//! processes of a pair map, and `ferry bench --latency` prints the gaps
//! between stages.
//!
//! Built only with the `stage-trace` feature (off by default): without it
//! `mark` is an empty inline function and no call site costs anything. A
//! diagnostic build, not a production one: with it each mark is a clock
//! read (~20 ns), and the page is shared with whoever the environment
//! names. The page is the file `FERRY_STAGE_TRACE` names (created 0600,
//! opened without following links, used only if it is a regular file of
//! our own user), else one private to the process.
//!
//! Only the latest op's stamps are kept: meaningful while one op is in
//! flight at a time (the latency loop), where each stage is reached once
//! per round trip in order.

/// The stages of a same-host WRITE or READ, in the order a round trip
/// reaches them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum Stage {
    /// The application is about to submit (the bench marks it).
    Submit,
    /// The submit call returned (the bench).
    Submitted,
    /// The initiator's shard took the op's command from its queue.
    CmdTaken,
    /// The request is in the peer's ring.
    RequestOut,
    /// The target's shard took the request from its ring.
    RequestIn,
    /// The reply is in the initiator's ring.
    ReplyOut,
    /// The initiator's shard took the reply from its ring.
    ReplyIn,
    /// The initiator's shard published the op's completion.
    Published,
    /// The application saw the completion (the bench).
    Seen,
}

impl Stage {
    /// Every stage, in the order an op reaches them.
    pub const ALL: [Stage; 9] = [
        Stage::Submit,
        Stage::Submitted,
        Stage::CmdTaken,
        Stage::RequestOut,
        Stage::RequestIn,
        Stage::ReplyOut,
        Stage::ReplyIn,
        Stage::Published,
        Stage::Seen,
    ];
}

/// Whether this build stamps stages.
pub const ENABLED: bool = cfg!(feature = "stage-trace");

#[cfg(not(feature = "stage-trace"))]
mod imp {
    use super::Stage;
    /// Nothing: this build stamps no stage.
    #[inline(always)]
    pub fn mark(_: Stage) {}
    /// 0: this build stamps no stage.
    pub fn get(_: Stage) -> u64 {
        0
    }
    /// Nothing to share: this build stamps no stage.
    pub fn attach(_: &std::path::Path) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(feature = "stage-trace")]
mod imp {
    use super::Stage;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    use std::path::Path;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;

    const PAGE: usize = 4096;
    const SLOTS: usize = Stage::ALL.len();

    /// The stamps: a shared page's first words, or a static of our own.
    static STAMPS: OnceLock<&'static [AtomicU64; SLOTS]> = OnceLock::new();
    static LOCAL: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];

    fn map(path: &Path) -> std::io::Result<&'static [AtomicU64; SLOTS]> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)?;
        let meta = f.metadata()?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if !meta.file_type().is_file() || meta.uid() != me {
            return Err(std::io::Error::other(format!(
                "{}: not a regular file of uid {me}",
                path.display()
            )));
        }
        if meta.len() < PAGE as u64 {
            f.set_len(PAGE as u64)?;
        }
        let map = crate::sys::Mapping::map_fd(f.as_raw_fd(), PAGE)?;
        let p = map.ptr();
        // Mapped for the rest of the process: the stamps are 'static.
        std::mem::forget(map);
        // SAFETY: the page is mapped for the rest of the process (never
        // unmapped), page-aligned and at least SLOTS words long, and only
        // ever accessed through atomics (another process writing it races
        // benignly: a stamp is a u64).
        Ok(unsafe { &*(p as *const [AtomicU64; SLOTS]) })
    }

    fn stamps() -> &'static [AtomicU64; SLOTS] {
        STAMPS.get_or_init(|| {
            let shared = std::env::var_os("FERRY_STAGE_TRACE").and_then(|p| {
                map(Path::new(&p))
                    .map_err(|e| tracing::warn!("stage trace: {e}; stamps stay in this process"))
                    .ok()
            });
            shared.unwrap_or(&LOCAL)
        })
    }

    fn now_ns() -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid timespec to fill; CLOCK_MONOTONIC always exists.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }

    /// Stamps the time stage `s` was reached.
    #[inline]
    pub fn mark(s: Stage) {
        stamps()[s as usize].store(now_ns(), Ordering::Relaxed);
    }

    /// The last stamp of stage `s`, ns of `CLOCK_MONOTONIC` (0: never).
    pub fn get(s: Stage) -> u64 {
        stamps()[s as usize].load(Ordering::Relaxed)
    }

    /// Uses the page at `path` from now on (before any mark).
    pub fn attach(path: &Path) -> std::io::Result<()> {
        let m = map(path)?;
        STAMPS
            .set(m)
            .map_err(|_| std::io::Error::other("stage trace already in use"))
    }
}

/// Shares the stamps through the file at `path` (created if absent);
/// children find it through `FERRY_STAGE_TRACE`.
pub use imp::attach;
/// The last stamp of stage `s`, ns of `CLOCK_MONOTONIC` (0: never).
pub use imp::get;
/// Stamps the time stage `s` was reached (nothing without the feature).
pub use imp::mark;

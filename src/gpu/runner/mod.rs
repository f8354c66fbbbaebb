//! One small copy without a launch: a kernel that stays resident for a
//! while after each copy and takes the next from pinned memory.
//!
//! A lone small copy's time is almost all fixed cost: on an H100 any
//! asynchronous copy or kernel took ~9.3 µs from the call to the host
//! seeing its end, however its end was learnt (event, stream sync, a
//! stream-written flag), while the GPU itself needs well under a
//! microsecond for 4 KiB (`benches/gather_probe.py --completion`,
//! docs/benchmarks-log.md; 13.1 µs on an H200, where the runner, already
//! resident, took 4.5). The runner takes the driver off that path:
//! one block of `THREADS` threads polls a word in pinned host memory;
//! the shard writes the copy's descriptor and then the word, and the
//! runner copies and writes a done word back, which the shard's loop
//! reads with a plain load. The runner reads the descriptor in the same
//! round trip over the bus as the word (a read of host memory from the
//! GPU takes about a microsecond), not after it: each descriptor word
//! carries a tag of its copy (the low byte of `seq`), and one read before
//! the shard stored it (the last copy's) is read again after the word,
//! which the shard stored last (one more round trip, as before). No
//! launch is made per copy, and no driver call while the kernel serves:
//! its end event is queried when a copy is posted only if the kernel has
//! begun ending (`quit` set), and once in 64 looks while a copy is in
//! flight (to see a kernel that failed).
//!
//! It must not hold the GPU: a device-wide synchronisation (the
//! application's `cudaDeviceSynchronize`, a `cudaFree`) waits for every
//! kernel, this one too. So it ends itself when it has been idle for
//! `idle_ns` or alive for `life_ns`, and the next copy launches it again
//! (one launch's cost). Ending races the next copy; the two sides settle
//! it as Dekker's algorithm does: the runner stores `quit`, fences, and
//! looks at `go` once more; the shard stores `go`, fences, and reads
//! `quit`. At least one sees the other: either the runner serves the copy,
//! or the shard knows it might not have (`quit` set) and waits for the
//! kernel's end (its event) before launching it again for that copy,
//! unless the copy's done word shows up first. No copy is served twice and
//! none is lost.
//!
//! The control block, one pinned page the GPU reaches at its host
//! address (unified addressing):
//!
//! | offset | word | writer |
//! |---|---|---|
//! | 0 | `seq` in the low 32 bits, `len` in the high (u64): a new `seq` is a copy to make; `len` `STOP` ends the runner | shard |
//! | 16 | `dst`, `src` (u64 each), each with its copy's `seq` mod 256 in its top byte | shard, before the word at 0 |
//! | 64 | `done` (u32): the last `seq` copied | runner |
//! | 68 | `quit` (u32): 1 while it is ending | runner (the shard clears it before a launch) |

use std::time::Duration;

use cudarc::driver::sys as cu;

use super::driver::{check, cuda};
use super::gather::load_entry;
use super::memory::PinnedBuf;
use crate::error::Result;
use crate::sync::{fence, AtomicU32, AtomicU64, Ordering};

mod ptx;
pub(crate) use ptx::PTX;

/// Copies of at most this many bytes may go to the runner: one block
/// moves them (16 KiB in four passes of its threads).
pub(crate) const RUNNER_MAX_BYTES: usize = 64 << 10;
/// The bits of an address the descriptor carries; the top byte is its
/// copy's tag (module doc).
const ADDR_MASK: u64 = (1 << 56) - 1;

/// Whether the runner can be given these addresses (each fits under its
/// tag: every user-space address on x86-64 and aarch64 does).
pub(crate) fn reaches(dst: u64, src: u64) -> bool {
    (dst | src) <= ADDR_MASK
}

/// A descriptor word: `addr` with `seq`'s tag.
fn tagged(addr: u64, seq: u32) -> u64 {
    addr | (u64::from(seq & 0xFF) << 56)
}

/// Threads of the runner's one block.
const THREADS: u32 = 256;
/// `len` of the word at 0 that tells the runner to end.
const STOP: u64 = 0xFFFF_FFFF;
/// How long the runner lives at most, in idle spans: a device-wide
/// synchronisation waits at most this long for it.
const LIFE_PER_IDLE: u64 = 20;

const GO: usize = 0;
const DESC: usize = 16;
const DONE: usize = 64;
const QUIT: usize = 68;

/// The control block, at the offsets the kernel reads and writes.
#[repr(C, align(128))]
pub(crate) struct Ctl {
    /// `seq | len << 32`: a new `seq` is a copy to make (`len` `STOP`:
    /// end). Written last, after the descriptor.
    go: AtomicU64,
    _pad0: u64,
    dst: AtomicU64,
    src: AtomicU64,
    _pad1: [u64; 4],
    /// The last `seq` copied (the kernel's).
    done: AtomicU32,
    /// 1 while the kernel is ending (the kernel's; cleared before a launch).
    quit: AtomicU32,
}

#[cfg(not(loom))]
const _: () = {
    assert!(std::mem::offset_of!(Ctl, go) == GO);
    assert!(std::mem::offset_of!(Ctl, dst) == DESC);
    assert!(std::mem::offset_of!(Ctl, src) == DESC + 8);
    assert!(std::mem::offset_of!(Ctl, done) == DONE);
    assert!(std::mem::offset_of!(Ctl, quit) == QUIT);
    assert!(std::mem::size_of::<Ctl>() <= 4096);
};

impl Ctl {
    #[cfg(test)]
    fn new() -> Self {
        Self {
            go: AtomicU64::new(0),
            _pad0: 0,
            dst: AtomicU64::new(0),
            src: AtomicU64::new(0),
            _pad1: [0; 4],
            done: AtomicU32::new(0),
            quit: AtomicU32::new(0),
        }
    }
}

/// Starts the runner's kernel and sees it end: the driver's (`Launcher`)
/// or, in the tests, a thread that runs the kernel's loop.
pub(crate) trait Kernel {
    /// Launches the kernel over `ctl`; it copies every `seq` after `last`.
    fn launch(&mut self, ctl: &Ctl, last: u32) -> Result<()>;
    /// Whether the last kernel launched has ended (an error: it failed).
    fn ended(&mut self) -> Result<bool>;
}

/// What the one copy in flight is waiting for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flight {
    /// The runner will copy it (it saw `go`, or had not begun ending).
    Sure(u32),
    /// The runner was ending when it was posted: it copies it, or its
    /// kernel ends without it and is launched again for it.
    Unsure(u32),
}

/// The shard's half of the protocol (module doc), apart from the driver.
#[derive(Debug, Default)]
pub(crate) struct Host {
    /// The last `seq` posted.
    seq: u32,
    /// A kernel was launched and its end not yet seen.
    live: bool,
    flight: Option<Flight>,
    /// Looks at a sure copy's done word since its kernel's event was last
    /// queried.
    looks: u32,
}

/// A sure copy's kernel ends without it only by failing: its event (a
/// driver call) is queried once in this many looks at the done word, not
/// on every pass of the shard's loop.
const LOOKS_PER_QUERY: u32 = 64;

impl Host {
    /// Whether a copy could start now (none is in flight).
    pub fn free(&self) -> bool {
        self.flight.is_none()
    }

    fn launch(&mut self, ctl: &Ctl, k: &mut impl Kernel, last: u32) -> Result<()> {
        ctl.quit.store(0, Ordering::Relaxed);
        k.launch(ctl, last)?;
        self.live = true;
        Ok(())
    }

    /// Posts a copy of `len` bytes from `src` to `dst`, launching the
    /// kernel if none is running. Must be `free`.
    pub fn start(
        &mut self,
        ctl: &Ctl,
        k: &mut impl Kernel,
        dst: u64,
        src: u64,
        len: usize,
    ) -> Result<()> {
        debug_assert!(self.free() && (len as u64) < STOP);
        if !reaches(dst, src) {
            return Err(crate::error::Error::Unsupported {
                what: "the GPU copy runner",
                reason: format!("addresses {dst:#x} and {src:#x} do not fit under its tag"),
            });
        }
        // A kernel that has not begun ending (`quit` clear) is serving, or
        // failed, which a look at its event during the copy finds (`poll`):
        // its event is queried here only when it may have ended, so a copy
        // to a resident runner posts without a driver call.
        if self.live && ctl.quit.load(Ordering::Relaxed) != 0 && k.ended()? {
            self.live = false;
        }
        let seq = self.seq.wrapping_add(1);
        ctl.dst.store(tagged(dst, seq), Ordering::Relaxed);
        ctl.src.store(tagged(src, seq), Ordering::Relaxed);
        ctl.go
            .store(u64::from(seq) | ((len as u64) << 32), Ordering::Release);
        self.seq = seq;
        if !self.live {
            self.launch(ctl, k, seq.wrapping_sub(1))?;
            self.flight = Some(Flight::Sure(seq));
            return Ok(());
        }
        // Dekker's half on this side (module doc): the store of `go`
        // before the load of `quit`, against the kernel's store of `quit`
        // before its last load of `go`.
        fence(Ordering::SeqCst);
        let ending = ctl.quit.load(Ordering::Relaxed) != 0;
        self.flight = Some(if ending {
            Flight::Unsure(seq)
        } else {
            Flight::Sure(seq)
        });
        Ok(())
    }

    /// The copy in flight: `Some` once it ended (and the host is free).
    pub fn poll(&mut self, ctl: &Ctl, k: &mut impl Kernel) -> Option<Result<()>> {
        let flight = self.flight?;
        let (Flight::Sure(seq) | Flight::Unsure(seq)) = flight;
        if ctl.done.load(Ordering::Acquire) == seq {
            self.flight = None;
            return Some(Ok(()));
        }
        if flight == Flight::Sure(seq) {
            self.looks += 1;
            if self.looks < LOOKS_PER_QUERY {
                return None;
            }
            self.looks = 0;
        }
        match k.ended() {
            Ok(false) => return None,
            Ok(true) => self.live = false,
            Err(e) => {
                self.flight = None;
                self.live = false;
                return Some(Err(e));
            }
        }
        // The kernel ended: it copied this one (its done word came after
        // our first look), or it never saw it.
        if ctl.done.load(Ordering::Acquire) == seq {
            self.flight = None;
            return Some(Ok(()));
        }
        if flight == Flight::Sure(seq) {
            self.flight = None;
            return Some(Err(crate::error::Error::Unsupported {
                what: "the GPU copy runner",
                reason: format!("its kernel ended without copy {seq}"),
            }));
        }
        match self.launch(ctl, k, seq.wrapping_sub(1)) {
            Ok(()) => {
                self.flight = Some(Flight::Sure(seq));
                None
            }
            Err(e) => {
                self.flight = None;
                Some(Err(e))
            }
        }
    }

    /// Tells a running kernel to end (it finishes the copy in flight, if
    /// it saw it). True if one may be running.
    fn stop(&mut self, ctl: &Ctl) -> bool {
        if self.live {
            let seq = self.seq.wrapping_add(1);
            ctl.go
                .store(u64::from(seq) | (STOP << 32), Ordering::Release);
        }
        self.live
    }
}

/// The driver's side: the kernel loaded in a device's context, the stream
/// it runs on and the event recorded after each launch.
struct Launcher {
    module: cu::CUmodule,
    func: cu::CUfunction,
    stream: cu::CUstream,
    /// Recorded after each launch: fired once that kernel has ended.
    ended: cu::CUevent,
    idle_ns: u64,
}

impl Kernel for Launcher {
    fn launch(&mut self, ctl: &Ctl, last: u32) -> Result<()> {
        let mut ctl = ctl as *const Ctl as u64;
        let mut last = last;
        let mut idle = self.idle_ns;
        let mut life = self.idle_ns.saturating_mul(LIFE_PER_IDLE);
        let mut params = [
            (&mut ctl as *mut u64).cast::<std::ffi::c_void>(),
            (&mut last as *mut u32).cast(),
            (&mut idle as *mut u64).cast(),
            (&mut life as *mut u64).cast(),
        ];
        // SAFETY: the kernel's four parameters, read during the call; it
        // reads and writes only the control block (pinned, freed only after
        // the runner waited for its stream) and the ranges posted to it.
        check("cuLaunchKernel", unsafe {
            cu::cuLaunchKernel(
                self.func,
                1,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                self.stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?;
        // SAFETY: our event and stream, in the current context.
        let r = check("cuEventRecord", unsafe {
            cu::cuEventRecord(self.ended, self.stream)
        });
        if r.is_err() {
            // Without its event the kernel's end cannot be seen: wait for
            // it (it ends within its idle span, after any copy posted), so
            // the caller may let the memory go.
            // SAFETY: our stream.
            unsafe { cu::cuStreamSynchronize(self.stream) };
        }
        r
    }

    fn ended(&mut self) -> Result<bool> {
        // SAFETY: our event, recorded after our last launch (or never: it
        // then reads as fired).
        let r = unsafe { cu::cuEventQuery(self.ended) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuEventQuery", r).map(|()| true)
    }
}

/// The control block in its pinned page.
fn ctl_of(page: &PinnedBuf) -> &Ctl {
    debug_assert!(page.len() >= std::mem::size_of::<Ctl>());
    // SAFETY: the page is 4 096 bytes, page-aligned (more than Ctl's 128),
    // zeroed at allocation (every word 0: a valid Ctl) and borrowed as long
    // as the result; the kernel writes only `done` and `quit`, whole words.
    unsafe { &*page.ptr().cast::<Ctl>() }
}

/// A device's runner: its kernel (launched on demand), control block and
/// the one copy it may have in flight. Owned by one copier.
pub(crate) struct Runner {
    ordinal: i32,
    host: Host,
    launcher: Launcher,
    ctl: PinnedBuf,
}

// SAFETY: driver handles usable from any thread, and pinned memory owned
// here; a runner is used by the one shard that owns its copier.
unsafe impl Send for Runner {}

impl Runner {
    /// Loads the runner into device `ordinal`'s context (left current);
    /// its kernel ends after `idle` without a copy.
    pub fn load(ordinal: i32, idle: Duration) -> Result<Self> {
        // Allocates in another context first.
        let ctl = PinnedBuf::new(4096)?;
        cuda()?.make_current(ordinal)?;
        let (module, func) = load_entry(PTX, c"ferry_runner")?;
        let mut launcher = Launcher {
            module,
            func,
            stream: std::ptr::null_mut(),
            ended: std::ptr::null_mut(),
            idle_ns: idle.as_nanos().clamp(1_000, 1_000_000_000) as u64,
        };
        // SAFETY: a stream and an event in the current context. The stream
        // is non-blocking: it must not order itself with the legacy stream.
        // (Dropping `launcher` on failure frees what was made.)
        check("cuStreamCreate", unsafe {
            cu::cuStreamCreate(
                &mut launcher.stream,
                cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        })?;
        // SAFETY: as above; no timing.
        check("cuEventCreate", unsafe {
            cu::cuEventCreate(
                &mut launcher.ended,
                cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            )
        })?;
        Ok(Self {
            ordinal,
            host: Host::default(),
            launcher,
            ctl,
        })
    }

    /// Whether a copy could start now (none is in flight).
    pub fn free(&self) -> bool {
        self.host.free()
    }

    /// Posts a copy of `len` (≤ `RUNNER_MAX_BYTES`) bytes from `src` to
    /// `dst`, launching the kernel if it is not running. The runner must
    /// be `free`; its context must be current.
    ///
    /// # Safety
    /// Both ranges must be memory the runner's kernel may touch (device
    /// memory it reaches, or `cuMemHostAlloc` memory) and stay valid until
    /// `poll` reports the copy ended (or, on an error here, until the
    /// runner is dropped).
    pub unsafe fn start(&mut self, dst: u64, src: u64, len: usize) -> Result<()> {
        debug_assert!(len <= RUNNER_MAX_BYTES);
        self.host
            .start(ctl_of(&self.ctl), &mut self.launcher, dst, src, len)
    }

    /// The copy in flight: `Some` once it ended (and the runner is free).
    /// A kernel launched again for it needs its device's context current.
    pub fn poll(&mut self) -> Option<Result<()>> {
        let mut k = Current(&mut self.launcher, self.ordinal);
        self.host.poll(ctl_of(&self.ctl), &mut k)
    }
}

/// A launcher that makes its device's context current before a launch
/// (`poll` may launch again from a pass where another device's is).
struct Current<'a>(&'a mut Launcher, i32);

impl Kernel for Current<'_> {
    fn launch(&mut self, ctl: &Ctl, last: u32) -> Result<()> {
        cuda()?.make_current(self.1)?;
        self.0.launch(ctl, last)
    }

    fn ended(&mut self) -> Result<bool> {
        self.0.ended()
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        // SAFETY: waits for our kernel (told to stop by the runner, or
        // ending by itself within its idle span), then destroys our
        // handles (null ones were never made).
        unsafe {
            if !self.stream.is_null() {
                cu::cuStreamSynchronize(self.stream);
            }
            if !self.ended.is_null() {
                cu::cuEventDestroy_v2(self.ended);
            }
            if !self.stream.is_null() {
                cu::cuStreamDestroy_v2(self.stream);
            }
            cu::cuModuleUnload(self.module);
        }
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        if cuda().and_then(|c| c.make_current(self.ordinal)).is_err() {
            return;
        }
        self.host.stop(ctl_of(&self.ctl));
        // The launcher's drop waits for the kernel; then `ctl` is freed
        // (fields drop in order: host, launcher, ctl).
    }
}

#[cfg(test)]
mod tests;

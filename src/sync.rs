//! The atomics and cells of the code that the loom models check
//! (`RUSTFLAGS="--cfg loom" cargo test --release --lib loom`, run by
//! `.ci/run`): std's in every real build, loom's under `--cfg loom`, so
//! the models run the real completion table, ring, doorbell, wake flag and
//! GPU copy runner handshake, not copies of them.
//!
//! Only those modules use this one; the rest of the crate uses std's
//! atomics directly.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize};
pub(crate) use std::sync::atomic::Ordering;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize};

/// A cell whose accesses the models check for data races. std's
/// `UnsafeCell` behind loom's interface (`with`, `with_mut`), so the same
/// code compiles both ways and costs nothing in a real build.
#[cfg(loom)]
pub(crate) use loom::cell::UnsafeCell;

#[cfg(not(loom))]
#[derive(Debug)]
#[repr(transparent)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    pub(crate) const fn new(v: T) -> Self {
        Self(std::cell::UnsafeCell::new(v))
    }

    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

/// Where a model lets another thread run: a spin or a sleep in a real
/// build is a yield in a model (loom explores what runs meanwhile).
#[cfg(loom)]
pub(crate) fn model_yield() {
    loom::thread::yield_now();
}

/// A hint to bring `p`'s cache line to this core for reading (x86
/// PREFETCHT0; nothing elsewhere, in a model and under miri).
#[inline(always)]
pub(crate) fn prefetch_read(p: *const u8) {
    #[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
    // SAFETY: a prefetch is a hint: it never faults, whatever the address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
    }
    #[cfg(not(all(target_arch = "x86_64", not(loom), not(miri))))]
    let _ = p;
}

/// A hint to bring `p`'s cache line to this core for writing (x86
/// PREFETCHW; a NOP on cores without it, nothing elsewhere, in a model
/// and under miri): for a line another core read or wrote last, fetched
/// while the caller does other work before it stores there. (Not
/// `_mm_prefetch::<_MM_HINT_ET0>`: without the `prfchw` target feature
/// that compiles to a read prefetch.)
#[inline(always)]
pub(crate) fn prefetch_write(p: *const u8) {
    #[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
    // SAFETY: PREFETCHW is a hint: it never faults, whatever the address,
    // and changes no register, flag or memory.
    unsafe {
        std::arch::asm!("prefetchw [{0}]", in(reg) p, options(nostack, preserves_flags, readonly))
    };
    #[cfg(not(all(target_arch = "x86_64", not(loom), not(miri))))]
    let _ = p;
}

/// A value alone on its cache lines (128 bytes: a line and the one the
/// adjacent-line prefetcher pulls with it), for the atomics that one side
/// writes and the other reads.
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

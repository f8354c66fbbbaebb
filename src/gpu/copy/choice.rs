//! Which way a batch of small copies goes — the gather kernel or the
//! copy engine — learnt from the batches themselves.

use std::time::Duration;

use super::GpuCopy;

/// The two ways a batch of small eligible copies can go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Way {
    /// `cuMemcpyBatchAsync` (or one `cuMemcpyAsync` per copy).
    Engine,
    /// The gather kernel.
    Kernel,
}

/// Which way is faster here, learnt from the batches themselves. The
/// kernel wins by far where the GPU runs this process's work alone (one
/// launch for the batch, every copy in parallel); where another process's
/// context shares the GPU without MPS, every kernel waits for a context
/// switch and the copy engine wins (measured on one H200 shared by the
/// two processes of `ferry bench`: 0.32 against 0.64 GB/s at 4 KiB; with
/// MPS the kernel gave 1.03). So each way keeps a moving average of the
/// time from issue to completion per copy, the faster one takes the
/// batches, and every `EXPLORE_EVERY`-th batch goes the other way so a
/// change (a neighbour that comes or goes) is seen.
#[derive(Debug, Default)]
pub(super) struct Choice {
    /// Nanoseconds per copy, per way (index `Way as usize`); None: no
    /// sample yet.
    ns_per_copy: [Option<f64>; 2],
    batches: u64,
    kernel_off: bool,
    /// Set by `FERRY_GPU_COPY`: this way, never measured against the other.
    forced: Option<Way>,
}

/// One batch in this many goes the way that is not the faster one.
const EXPLORE_EVERY: u64 = 32;
/// Weight of a new sample in the moving average.
const SAMPLE_WEIGHT: f64 = 0.25;

impl Choice {
    pub(super) fn forced(way: GpuCopy) -> Self {
        let forced = match way {
            GpuCopy::Auto => None,
            GpuCopy::Kernel => Some(Way::Kernel),
            GpuCopy::Engine => Some(Way::Engine),
        };
        Self {
            forced,
            ..Self::default()
        }
    }

    pub(super) fn pick(&mut self) -> Way {
        self.batches += 1;
        if self.kernel_off {
            return Way::Engine;
        }
        if let Some(way) = self.forced {
            return way;
        }
        let [engine, kernel] = self.ns_per_copy;
        let (Some(e), Some(k)) = (engine, kernel) else {
            // Each way is tried before either is trusted.
            return if kernel.is_none() {
                Way::Kernel
            } else {
                Way::Engine
            };
        };
        let best = if k <= e { Way::Kernel } else { Way::Engine };
        // The other way is tried so that its cost to the batches stays
        // near 1/EXPLORE_EVERY of theirs: the slower it is, the rarer (the
        // engine ran 4 KiB x 32 at ten times the kernel's time per copy).
        let slower = (k.max(e) / k.min(e).max(1.0)).clamp(1.0, 64.0) as u64;
        if self.batches % (EXPLORE_EVERY * slower) == 0 {
            match best {
                Way::Kernel => Way::Engine,
                Way::Engine => Way::Kernel,
            }
        } else {
            best
        }
    }

    /// A batch of `count` copies that went `way` took `took`.
    pub(super) fn took(&mut self, way: Way, took: Duration, count: usize) {
        let sample = took.as_nanos() as f64 / count.max(1) as f64;
        let avg = &mut self.ns_per_copy[way as usize];
        *avg = Some(match *avg {
            Some(a) => a + SAMPLE_WEIGHT * (sample - a),
            None => sample,
        });
    }

    /// Whether only the engine may run copies (forced, or no kernel).
    pub(super) fn engine_only(&self) -> bool {
        self.kernel_off || self.forced == Some(Way::Engine)
    }

    /// The kernel cannot load here: always the engine.
    pub(super) fn no_kernel(&mut self) {
        self.kernel_off = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_faster_way_takes_the_batches_and_the_other_is_still_tried() {
        let mut c = Choice::default();
        // Both tried first.
        assert_eq!(c.pick(), Way::Kernel);
        c.took(Way::Kernel, Duration::from_micros(64), 32);
        assert_eq!(c.pick(), Way::Engine);
        c.took(Way::Engine, Duration::from_micros(32), 32);
        // The engine is faster (1 µs a copy against 2): most batches go there.
        let picks: Vec<Way> = (0..64).map(|_| c.pick()).collect();
        let kernel = picks.iter().filter(|&&w| w == Way::Kernel).count();
        assert!(
            (1..=3).contains(&kernel),
            "{kernel} of 64 explored the kernel"
        );
        // The kernel gets faster (the neighbour left): it takes over.
        for _ in 0..8 {
            c.took(Way::Kernel, Duration::from_micros(8), 32);
        }
        let picks: Vec<Way> = (0..64).map(|_| c.pick()).collect();
        let engine = picks.iter().filter(|&&w| w == Way::Engine).count();
        assert!(
            (1..=3).contains(&engine),
            "{engine} of 64 explored the engine"
        );
        // Without a kernel, always the engine.
        c.no_kernel();
        assert!((0..100).all(|_| c.pick() == Way::Engine));
    }

    #[test]
    fn a_forced_way_is_kept_whatever_it_measures() {
        let mut k = Choice::forced(GpuCopy::Kernel);
        let mut e = Choice::forced(GpuCopy::Engine);
        for _ in 0..4 {
            k.took(Way::Kernel, Duration::from_micros(640), 32);
            k.took(Way::Engine, Duration::from_micros(1), 32);
            e.took(Way::Engine, Duration::from_micros(640), 32);
            e.took(Way::Kernel, Duration::from_micros(1), 32);
        }
        assert!((0..100).all(|_| k.pick() == Way::Kernel));
        assert!((0..100).all(|_| e.pick() == Way::Engine));
        // A kernel that cannot load still gives way to the engine.
        k.no_kernel();
        assert_eq!(k.pick(), Way::Engine);
    }
}

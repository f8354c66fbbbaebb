//! The clock an op's end is read with: the CPU's time-stamp counter where
//! it is invariant, scaled by a rate measured against `Instant` (~12 ns a
//! read here, where `Instant::now()` is ~34: the end of every op is on
//! the same-host round trip's path in an embedded shard), else `Instant`.
//!
//! The rate is measured from the readings the shard takes anyway (its
//! timeout checks, at least every second while it runs): over the first
//! 50 ms it uses `Instant`, then the counter, re-anchored every 10 s so a
//! rate error of a part per million stays below 10 µs.

use std::time::{Duration, Instant};

/// Below this window the rate is not yet trusted.
const MIN_WINDOW: Duration = Duration::from_millis(50);
/// A new anchor after this long.
const REBASE: Duration = Duration::from_secs(10);

/// A shard's clock for op ends (one owner: no sharing).
#[derive(Debug)]
pub(crate) struct OpClock {
    /// An `Instant` and the counter read together.
    base: Instant,
    base_tsc: u64,
    /// ns per count; 0 while unmeasured (or no usable counter).
    ns_per_tick: f64,
    usable: bool,
}

impl Default for OpClock {
    fn default() -> Self {
        let usable = invariant_tsc();
        OpClock {
            base: Instant::now(),
            base_tsc: if usable { tsc() } else { 0 },
            ns_per_tick: 0.0,
            usable,
        }
    }
}

impl OpClock {
    /// Measures the rate against `now` (an `Instant` the caller just read).
    pub fn calibrate(&mut self, now: Instant) {
        if !self.usable {
            return;
        }
        let t = tsc();
        let window = now.saturating_duration_since(self.base);
        if window < MIN_WINDOW || t <= self.base_tsc {
            return;
        }
        self.ns_per_tick = window.as_nanos() as f64 / (t - self.base_tsc) as f64;
        if window >= REBASE {
            (self.base, self.base_tsc) = (now, t);
        }
    }

    /// The time now.
    #[inline]
    pub fn now(&self) -> Instant {
        if self.ns_per_tick > 0.0 {
            let ticks = tsc().saturating_sub(self.base_tsc);
            self.base + Duration::from_nanos((ticks as f64 * self.ns_per_tick) as u64)
        } else {
            Instant::now()
        }
    }
}

#[cfg(all(target_arch = "x86_64", not(miri)))]
#[inline]
fn tsc() -> u64 {
    // SAFETY: RDTSC has no preconditions (it is not trapped in user mode
    // where `invariant_tsc` found the kernel itself clocking by it).
    unsafe { std::arch::x86_64::_rdtsc() }
}

#[cfg(not(all(target_arch = "x86_64", not(miri))))]
fn tsc() -> u64 {
    0
}

/// Whether the counter ticks at one rate on every core, through sleep
/// states (`constant_tsc`, `nonstop_tsc`), and the kernel clocks by it
/// (it did not find it unstable). Read once per process.
fn invariant_tsc() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        if cfg!(not(all(target_arch = "x86_64", not(miri)))) {
            return false;
        }
        let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let flags = flags.lines().find(|l| l.starts_with("flags")).unwrap_or("");
        let has = |f: &str| flags.split_whitespace().any(|x| x == f);
        let source = std::fs::read_to_string(
            "/sys/devices/system/clocksource/clocksource0/current_clocksource",
        )
        .unwrap_or_default();
        has("constant_tsc") && has("nonstop_tsc") && source.trim() == "tsc"
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counter_clock_agrees_with_instant() {
        let mut c = OpClock::default();
        std::thread::sleep(Duration::from_millis(60));
        c.calibrate(Instant::now());
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(20));
            let (a, b) = (Instant::now(), c.now());
            let off = if b > a { b - a } else { a - b };
            assert!(off < Duration::from_micros(200), "{off:?} apart");
        }
    }
}

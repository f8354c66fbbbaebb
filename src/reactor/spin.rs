//! When an idle shard stops spinning and parks.
//!
//! Spinning buys latency only while the spinning thread owns its core: a
//! reply that lands during the spin is seen one pass later instead of one
//! wake-up later. On a core shared with other busy threads the spin is
//! what gets preempted: the kernel runs someone else for a time slice
//! (milliseconds) while the reply waits, and the spin has burnt the share
//! the thread needed to serve it. Each idle pass of a spin yields the core
//! (`sched_yield`: ~1 us when nobody else wants it): a peer thread we just
//! woke is usually queued on our own core (wake-affine placement) and
//! would wait there for the next tick while we spin for its reply (4 ms
//! measured on the 2-core machine: the idle round trip's whole cost before
//! the yield). A sleeper, in contrast, is woken with
//! priority (it used less than its share). Worse, the thread a spinner
//! waits for may be waiting for the spinner's core. So a shard spins after
//! its last work for at most `FERRY_SPIN_US`, and not at all for a while
//! once it sees that its core is shared: the kernel preempted it since the
//! last park (its involuntary context switches grew), or two idle passes
//! in a row lie further apart than any idle pass takes (a pass with
//! nothing to do costs microseconds; a pass that copies may take
//! milliseconds, so only idle ones count).

use std::time::{Duration, Instant};

/// An idle pass ending this long after the previous idle pass means the
/// thread did not run in between.
const PREEMPTED_GAP: Duration = Duration::from_micros(200);
/// After a preemption, no spinning for this long ...
const CALM_AFTER_PREEMPTION: Duration = Duration::from_millis(100);
/// Involuntary switches are counted over windows at least this long ...
const SWITCH_WINDOW: Duration = Duration::from_millis(10);
/// ... and this many per second mean a shared core. A thread that owns its
/// core still sees some (a woken peer thread or kernel work preempts it:
/// ~300–1700/s measured on the 2-core machine, busy-polling); one sharing
/// its core with a busy process sees ~30 000/s.
const SHARED_CORE_SWITCHES_PER_S: u64 = 5000;

#[derive(Debug)]
pub(crate) struct Spin {
    /// The configured spin.
    max: Duration,
    /// Until when the shard parks as soon as it is idle.
    no_spin_until: Option<Instant>,
    /// When the passes stopped finding work (None: the last one found some).
    idle_since: Option<Instant>,
    /// When the last idle pass ended.
    last_idle_pass: Option<Instant>,
    /// Preemptions seen (for tests and stats).
    pub preemptions: u64,
    /// The thread's involuntary context switches when the current window
    /// began, and when it began.
    switches: u64,
    window_start: Option<Instant>,
}

impl Spin {
    pub fn new(max: Duration) -> Self {
        Self {
            max,
            no_spin_until: None,
            idle_since: None,
            last_idle_pass: None,
            preemptions: 0,
            switches: 0,
            window_start: None,
        }
    }

    /// Before a park: `switches` is the thread's involuntary context switch
    /// count now; at a rate past `SHARED_CORE_SWITCHES_PER_S` over the
    /// last window, the core is shared.
    pub fn parking(&mut self, switches: u64, now: Instant) {
        let Some(start) = self.window_start else {
            self.window_start = Some(now);
            self.switches = switches;
            return;
        };
        let span = now.saturating_duration_since(start);
        if span < SWITCH_WINDOW {
            return;
        }
        let per_s = switches.saturating_sub(self.switches) as f64 / span.as_secs_f64();
        if per_s > SHARED_CORE_SWITCHES_PER_S as f64 {
            self.preempted(now);
        }
        self.window_start = Some(now);
        self.switches = switches;
    }

    fn preempted(&mut self, now: Instant) {
        self.preemptions += 1;
        self.no_spin_until = Some(now + CALM_AFTER_PREEMPTION);
    }

    /// After a pass that found work.
    pub fn busy(&mut self) {
        self.idle_since = None;
        self.last_idle_pass = None;
    }

    /// After a pass that found nothing, ending at `now`: whether to park.
    pub fn idle(&mut self, now: Instant) -> bool {
        if let Some(prev) = self.last_idle_pass {
            if now.saturating_duration_since(prev) > PREEMPTED_GAP {
                self.preempted(now);
            }
        }
        self.last_idle_pass = Some(now);
        let since = *self.idle_since.get_or_insert(now);
        let spin = match self.no_spin_until {
            Some(t) if now < t => Duration::ZERO,
            _ => self.max,
        };
        now.saturating_duration_since(since) >= spin
    }

    /// The shard slept (a sleep is not a preemption); the next idle period
    /// starts afresh.
    pub fn woke(&mut self) {
        self.busy();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Spin {
        fn should_park(&mut self, work: usize, now: Instant) -> bool {
            if work > 0 {
                self.busy();
                return false;
            }
            self.idle(now)
        }
    }

    #[test]
    fn spins_while_idle_then_parks() {
        let t0 = Instant::now();
        let mut s = Spin::new(Duration::from_micros(50));
        assert!(!s.should_park(3, t0));
        assert!(!s.should_park(0, t0 + Duration::from_micros(1)));
        assert!(!s.should_park(0, t0 + Duration::from_micros(40)));
        assert!(
            !s.should_park(1, t0 + Duration::from_micros(45)),
            "work resets"
        );
        assert!(!s.should_park(0, t0 + Duration::from_micros(60)));
        assert!(s.should_park(0, t0 + Duration::from_micros(111)));
        s.woke();
        assert!(!s.should_park(0, t0 + Duration::from_millis(5)));
        assert_eq!(s.preemptions, 0, "a sleep is no preemption");
    }

    #[test]
    fn a_preempted_spin_stops_spinning_for_a_while() {
        let t0 = Instant::now();
        let us = Duration::from_micros;
        let mut s = Spin::new(us(50));
        assert!(!s.should_park(0, t0));
        // The next idle pass ends 3 ms later: the thread did not run.
        assert!(s.should_park(0, t0 + us(3000)));
        assert_eq!(s.preemptions, 1);
        s.woke();
        // While calm: parks at the first idle pass.
        assert!(s.should_park(0, t0 + us(3100)));
        s.woke();
        // A slow pass that did work is no preemption.
        assert!(!s.should_park(5, t0 + CALM_AFTER_PREEMPTION + us(4000)));
        assert!(!s.should_park(0, t0 + CALM_AFTER_PREEMPTION + us(9000)));
        assert_eq!(s.preemptions, 1);
        // Calm over: spins again.
        assert!(!s.should_park(0, t0 + CALM_AFTER_PREEMPTION + us(9010)));
        assert!(s.should_park(0, t0 + CALM_AFTER_PREEMPTION + us(9070)));
        // Involuntary switches at a rate a shared core shows: calm again;
        // at an owned core's rate: not.
        let t1 = t0 + CALM_AFTER_PREEMPTION + us(9070);
        s.parking(100, t1);
        s.woke();
        assert_eq!(s.preemptions, 1, "the first count is only a start");
        s.parking(110, t1 + us(5000));
        assert_eq!(s.preemptions, 1, "a window is 10 ms at least");
        s.parking(115, t1 + us(20_000));
        s.woke();
        assert_eq!(s.preemptions, 1, "750/s: an owned core");
        assert!(!s.should_park(0, t1 + us(20_010)));
        s.woke();
        s.parking(115 + 600, t1 + us(40_000));
        s.woke();
        assert_eq!(s.preemptions, 2, "30 000/s: a shared core");
        assert!(
            s.should_park(0, t1 + us(40_100)),
            "parks at once while calm"
        );
    }
}

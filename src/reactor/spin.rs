//! What an idle shard does next: spin, yield its core, or park. One policy,
//! in one place.
//!
//! Spinning buys latency only while the spinning thread owns its core: a
//! message that lands during the spin is seen one pass later instead of
//! one wake-up later. So an idle shard, in order:
//!
//! 1. **spins** with a pause hint between passes (`spin_loop`) for
//!    `FERRY_SPIN_YIELD_US`: a reply that lands now is seen in tens of
//!    nanoseconds. A `sched_yield` here costs a syscall (~0.3–1 µs in a
//!    VM), and a message that arrives during it waits for it: yielding on
//!    every idle pass took the 2-core same-host round trip from 0.8 to
//!    1.5 µs at p50 (A/B in docs/benchmarks-log.md). The first
//!    `FERRY_SPIN_EAGER_PASSES` spinning passes after work skip the hint:
//!    a reply is likeliest then, and the hint (~25 ns on the 2-core
//!    machine, up to ~140 cycles on other x86 cores) delays its discovery
//!    by part of itself each pass — 0.565 → 0.52 µs at p50 of the 2-core
//!    same-host round trip (12 rounds; docs/benchmarks-log.md). Past them the hint
//!    stays, for the sibling hyperthread and for power;
//! 2. then **yields** its core on each idle pass, up to `FERRY_SPIN_US`
//!    after its last work: a peer thread we just woke is often queued on
//!    our own core (the kernel's wake-affine placement) and would wait
//!    there for the next tick (4 ms measured on the 2-core machine) while
//!    we spin for its reply; now it waits at most the yield delay;
//! 3. then **parks** (epoll, woken by sockets, submitters and doorbells) —
//!    unless it waits for replies (same-host or tcp) on a host that is not
//!    loaded: then it goes on yielding, up to `AWAIT_MAX`. A reply rings
//!    the doorbell (or socket) of a parked shard, and the kernel puts the
//!    thread it wakes on the waker's core (wake-affine), beside a spinner;
//!    each such park in a busy exchange risks the two sharing one core
//!    (below). A reply later than `AWAIT_MAX` is worth a wake-up.
//!
//! A yield that returns late (`SLOW_YIELD`) says another thread ran on our
//! core meanwhile — if the thread's involuntary switches moved (a yield
//! that hands the core over counts as one); a late yield without one is
//! the virtual machine's host taking the core, and is ignored: holding the
//! yields for it took the 2-core same-host round trip's p99 from 2.9 to
//! 4.0 µs (A/B in docs/benchmarks-log.md). Often the thread that ran is the peer we
//! wait for: a thread woken from a park is placed on its waker's core
//! (wake-affine), and two spinners on one core with the other idle hand
//! it back and forth at each yield — a round trip then takes two spins'
//! yield delays (47 µs measured, in 2–8 %
//! of the 2-core machine's samples of a same-host latency run, against
//! under 0.2 % before the doorbells). So for `SHARED_HOLD` after a late
//! yield every idle pass yields at once, and when yields keep coming back
//! late while the host has a core for every runnable thread, the shard
//! moves itself to another core (`sys::move_off_this_core`, at most every
//! `MOVE_EVERY`), which the kernel's balancer would do only at its next
//! tick or later.
//!
//! And it parks at once for a while ("calm") once it has evidence that its
//! core is wanted by other busy threads: the kernel preempted it while it
//! spun (two idle passes further apart than an idle pass takes, or
//! involuntary context switches at a shared core's rate) *and* the host's
//! threads are waiting for cores (CPU pressure: `sys::CpuPressure`, looked
//! at every 10 ms while the shard is awake). Preemptions alone prove
//! little: a virtual machine's host takes the core now and then, and the
//! peer thread we serve, woken onto our core, preempts us too — parking
//! then only adds a wake-up to its next message (the 2-core same-host
//! round trip's p99 went from 2 to 50–350 µs that way: the switch-rate
//! detector fired 40–100 times in a 3-second run, each calm parking every
//! idle pass, and each park's wake-up preempting the other side in turn).
//! A competing process, in contrast, keeps threads waiting (over 50 % of
//! the time with one busy thread more than cores, 1–2 % without). On such
//! a loaded host an idle pass also yields at once instead of spinning
//! first. The calm starts at 1 ms and doubles with each confirmed
//! preemption that comes within 100 ms of the last calm's end, up to
//! 100 ms: a host that stays loaded gets the long calm within a few
//! preemptions, a stray one costs 1 ms of parking.

use std::time::{Duration, Instant};

/// An idle pass ending this long after the previous idle pass means the
/// thread did not run in between.
const PREEMPTED_GAP: Duration = Duration::from_micros(200);
/// The first calm after a preemption ...
const CALM_MIN: Duration = Duration::from_millis(1);
/// ... doubling up to this while preemptions keep coming ...
const CALM_MAX: Duration = Duration::from_millis(100);
/// ... where "keep coming" means within this long of the last calm's end
/// (later, the next calm starts at `CALM_MIN`). Longer than the switch
/// window: on a loaded host the next evidence often comes from the next
/// window, not the next pass; shorter than the 0.3–1 s between stray
/// preemptions on the quiet 2-core machine.
const CALM_MEMORY: Duration = Duration::from_millis(100);
/// Idle passes between looks at the clock: a pass with nothing to do costs
/// ~0.2 µs on the 2-core machine and a clock read ~30 ns of it; every
/// threshold here is tens of µs or more.
const CLOCK_STRIDE: u32 = 4;
/// The host's CPU pressure is looked at this often while the shard is
/// awake; between, its last answer stands.
const PROBE_EVERY: Duration = Duration::from_millis(10);
/// Threads waiting for a core more than this share of the time, over two
/// looks in a row, mean a loaded host. Measured over 10 ms windows on the
/// 2-core machine: with one busy thread more than cores, 80 % of windows
/// are past 0.3 (median 0.39); quiet, with two spinning threads and a
/// sampler, 7 % (median 0.01): a thread woken now and then waits for a
/// core for a moment.
pub(crate) const LOADED_STALL_SHARE: f64 = 0.25;
/// A shard awaiting replies yields instead of parking for at most this long
/// after its last work.
const AWAIT_MAX: Duration = Duration::from_millis(1);
/// A yield that takes this long let another thread run on our core (one
/// that finds nobody takes ~0.6 µs on the 2-core machine).
const SLOW_YIELD: Duration = Duration::from_micros(10);
/// After a late yield, idle passes yield at once for this long ...
const SHARED_HOLD: Duration = Duration::from_millis(1);
/// ... and a shard moves itself off a shared core after this many late
/// yields in a row, each within the hold of the last (two spinners on one
/// core hand it over at every yield; a thread that wakes now and then
/// beside us makes one late yield at a time) ...
const LATE_STREAK_TO_MOVE: u32 = 3;
/// ... at most this often.
const MOVE_EVERY: Duration = Duration::from_millis(10);
/// Involuntary switches are counted over windows at least this long ...
const SWITCH_WINDOW: Duration = Duration::from_millis(10);
/// ... and this many per second mean a shared core. A thread that owns its
/// core still sees some (a woken peer thread or kernel work preempts it:
/// ~300–1700/s measured on the 2-core machine, busy-polling); one sharing
/// its core with a busy process sees ~30 000/s.
const SHARED_CORE_SWITCHES_PER_S: u64 = 5000;

/// What an idle shard does after a pass that found nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Poll again at once, no pause hint: the first idle passes after
    /// work (`FERRY_SPIN_EAGER_PASSES`), when a reply is likeliest.
    Poll,
    /// Poll again at once (after a pause hint).
    Spin,
    /// Yield the core, then poll again.
    Yield,
    /// Sleep until woken.
    Park,
}

/// What the spin did, for `ferry bench` and tests (counts since start).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpinStats {
    /// Passes that found no work.
    pub idle_passes: u64,
    /// Of those, spinning ones right after work that polled again without
    /// the pause hint.
    pub eager_passes: u64,
    /// Idle passes that yielded the core.
    pub yields: u64,
    /// Times the shard decided to park (each may still find work in the
    /// last pass before the sleep).
    pub parks: u64,
    /// Of those, parks at once because of a calm.
    pub calm_parks: u64,
    /// Preemptions seen: idle passes too far apart ...
    pub gap_preemptions: u64,
    /// ... and windows of involuntary switches at a shared core's rate
    /// (both counted only on a loaded host).
    pub switch_preemptions: u64,
    /// Preemptions on a host that was not loaded (ignored).
    pub unconfirmed: u64,
    /// Looks at the host's CPU pressure that found it loaded.
    pub loaded_probes: u64,
    /// Yields that came back late because another thread ran on our core.
    pub slow_yields: u64,
    /// Times the shard moved itself off a shared core.
    pub moves: u64,
    /// Yields that came back late with no other thread run on our core
    /// (the virtual machine's host took it): ignored.
    pub unswitched_yields: u64,
}

#[derive(Debug)]
pub(crate) struct Spin {
    /// Spin, then yield, for this long after the last work ...
    max: Duration,
    /// ... yielding only after this much of it.
    yield_after: Duration,
    /// Spinning idle passes after work that skip the pause hint, and how
    /// many are left since the last work.
    eager: u32,
    eager_left: u32,
    /// Until when the shard parks as soon as it is idle, and how long that
    /// calm was.
    calm_until: Option<Instant>,
    calm: Duration,
    /// When the passes stopped finding work (None: the last one found some).
    idle_since: Option<Instant>,
    /// When the last idle pass ended.
    last_idle_pass: Option<Instant>,
    /// The thread's involuntary context switches when the current window
    /// began, and when it began.
    switches: u64,
    window_start: Option<Instant>,
    /// Idle passes left before the clock is read again, and the answer
    /// they repeat meanwhile (never `Park`).
    unclocked: u32,
    last: Next,
    stride: u32,
    /// When the host's CPU pressure was last looked at, and whether it was
    /// loaded then.
    probed: Option<Instant>,
    loaded: bool,
    /// Whether the last look alone found the host loaded.
    last_look: bool,
    /// Until when idle passes yield at once (a yield came back late).
    shared_until: Option<Instant>,
    /// When the shard last moved itself to another core.
    moved: Option<Instant>,
    /// Late yields in a row, each within the hold of the one before.
    late_streak: u32,
    /// The thread's involuntary switches at the last late yield.
    late_switches: u64,
    pub stats: SpinStats,
}

impl Spin {
    pub fn new(max: Duration, yield_after: Duration) -> Self {
        Self {
            max,
            yield_after,
            eager: 0,
            eager_left: 0,
            calm_until: None,
            calm: Duration::ZERO,
            idle_since: None,
            last_idle_pass: None,
            switches: 0,
            window_start: None,
            unclocked: 0,
            last: Next::Spin,
            stride: CLOCK_STRIDE,
            probed: None,
            loaded: false,
            last_look: false,
            shared_until: None,
            moved: None,
            late_streak: 0,
            late_switches: 0,
            stats: SpinStats::default(),
        }
    }

    /// The first `passes` spinning idle passes after work poll again
    /// without the pause hint (`FERRY_SPIN_EAGER_PASSES`).
    pub fn eager(mut self, passes: u32) -> Self {
        self.eager = passes;
        self
    }

    /// Before a park: `switches` is the thread's involuntary context switch
    /// count now; at a rate past `SHARED_CORE_SWITCHES_PER_S` over the
    /// last window, the core may be shared (`loaded`: as for `idle_pass`).
    pub fn parking(&mut self, switches: u64, now: Instant, loaded: impl FnOnce() -> Option<bool>) {
        self.probe(now, loaded);
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
        if per_s > SHARED_CORE_SWITCHES_PER_S as f64 && self.confirmed() {
            self.stats.switch_preemptions += 1;
            self.preempted(now);
        }
        self.window_start = Some(now);
        self.switches = switches;
    }

    /// Looks at the host's CPU pressure if the last look is `PROBE_EVERY`
    /// old (an unknown answer counts as not loaded); loaded twice in a row
    /// is loaded.
    fn probe(&mut self, now: Instant, loaded: impl FnOnce() -> Option<bool>) {
        if self
            .probed
            .is_some_and(|t| now.saturating_duration_since(t) < PROBE_EVERY)
        {
            return;
        }
        self.probed = Some(now);
        let look = loaded().unwrap_or(false);
        self.loaded = look && self.last_look;
        self.last_look = look;
        if self.loaded {
            self.stats.loaded_probes += 1;
        }
    }

    /// Whether a preemption counts: only on a loaded host.
    fn confirmed(&mut self) -> bool {
        if !self.loaded {
            self.stats.unconfirmed += 1;
        }
        self.loaded
    }

    /// Starts a calm: twice the last one if that ended recently, else the
    /// shortest.
    fn preempted(&mut self, now: Instant) {
        let recent = self.calm_until.is_some_and(|end| now < end + CALM_MEMORY);
        self.calm = if recent {
            (self.calm * 2).clamp(CALM_MIN, CALM_MAX)
        } else {
            CALM_MIN
        };
        self.calm_until = Some(now + self.calm);
    }

    /// After a pass that found work.
    pub fn busy(&mut self) {
        self.idle_since = None;
        self.last_idle_pass = None;
        self.unclocked = 0;
        self.eager_left = self.eager;
    }

    /// After a pass that found nothing: what to do next. Reads the clock
    /// (`now`) only every few passes, repeating its last answer between;
    /// `loaded` says whether the host's threads are waiting for cores
    /// (None: not known), called at most every `PROBE_EVERY`.
    /// `awaiting` says whether the shard waits for replies, asked only when
    /// the spin is over.
    pub fn idle_pass(
        &mut self,
        now: impl FnOnce() -> Instant,
        loaded: impl FnOnce() -> Option<bool>,
        awaiting: impl FnOnce() -> bool,
    ) -> Next {
        let next = if self.unclocked > 0 {
            self.unclocked -= 1;
            self.stats.idle_passes += 1;
            if self.last == Next::Yield {
                self.stats.yields += 1;
            }
            self.last
        } else {
            let next = self.idle(now(), loaded, awaiting);
            if next != Next::Park {
                self.unclocked = self.stride - 1;
            }
            self.last = next;
            next
        };
        if next == Next::Spin && self.eager_left > 0 {
            self.eager_left -= 1;
            self.stats.eager_passes += 1;
            return Next::Poll;
        }
        next
    }

    /// After a pass that found nothing, ending at `now`: what to do next.
    fn idle(
        &mut self,
        now: Instant,
        loaded: impl FnOnce() -> Option<bool>,
        awaiting: impl FnOnce() -> bool,
    ) -> Next {
        self.stats.idle_passes += 1;
        self.probe(now, loaded);
        if let Some(prev) = self.last_idle_pass {
            if now.saturating_duration_since(prev) > PREEMPTED_GAP && self.confirmed() {
                self.stats.gap_preemptions += 1;
                self.preempted(now);
            }
        }
        self.last_idle_pass = Some(now);
        let idle = now.saturating_duration_since(*self.idle_since.get_or_insert(now));
        if self.calm_until.is_some_and(|t| now < t) {
            self.stats.parks += 1;
            self.stats.calm_parks += 1;
            Next::Park
        } else if idle >= self.max && (self.loaded || idle >= AWAIT_MAX || !awaiting()) {
            self.stats.parks += 1;
            Next::Park
        } else if idle >= self.yield_after
            || self.loaded
            || self.shared_until.is_some_and(|t| now < t)
        {
            self.stats.yields += 1;
            Next::Yield
        } else {
            Next::Spin
        }
    }

    /// After a yield that took `took`, ending at `now`: whether to move off
    /// this core (`switches`: the thread's involuntary context switch count
    /// now, asked of late yields only (a syscall); `idle_core`: whether the
    /// host has a core for every runnable thread, asked only when it
    /// matters).
    pub fn yielded(
        &mut self,
        took: Duration,
        now: Instant,
        switches: impl FnOnce() -> u64,
        idle_core: impl FnOnce() -> Option<bool>,
    ) -> bool {
        if took < SLOW_YIELD {
            return false;
        }
        // Late, but no thread of this host ran on our core since the last
        // late yield (the count of involuntary switches, which a yield that
        // hands the core over moves, did not): the virtual machine's host
        // took the core. Nothing to hand over to, and holding the yields
        // would only put a syscall in the path of the next message.
        let n = switches();
        if std::mem::replace(&mut self.late_switches, n) == n {
            self.stats.unswitched_yields += 1;
            return false;
        }
        self.stats.slow_yields += 1;
        // Another late yield within the hold: the core stays shared.
        if self.shared_until.is_some_and(|t| now < t) {
            self.late_streak += 1;
        } else {
            self.late_streak = 1;
        }
        self.shared_until = Some(now + SHARED_HOLD);
        // The clock was read: the repeated answer must not outlive it.
        self.unclocked = 0;
        let may_move = self
            .moved
            .map_or(true, |t| now.saturating_duration_since(t) >= MOVE_EVERY);
        if self.late_streak >= LATE_STREAK_TO_MOVE
            && may_move
            && !self.loaded
            && idle_core() == Some(true)
        {
            self.late_streak = 0;
            self.moved = Some(now);
            self.stats.moves += 1;
            return true;
        }
        false
    }

    /// The shard slept (a sleep is not a preemption); the next idle period
    /// starts afresh.
    pub fn woke(&mut self) {
        self.busy();
    }
}

#[cfg(test)]
mod tests;

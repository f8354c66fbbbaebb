use super::*;

const fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

impl Spin {
    /// One pass on a quiet host (no thread waits for a core).
    fn after(&mut self, work: usize, now: Instant) -> Option<Next> {
        self.after_on(false, work, now)
    }

    /// One pass on a loaded host (threads wait for cores).
    fn loaded_after(&mut self, work: usize, now: Instant) -> Option<Next> {
        self.after_on(true, work, now)
    }

    fn after_on(&mut self, loaded: bool, work: usize, now: Instant) -> Option<Next> {
        // As if the look before this one said the same.
        self.last_look = loaded;
        if work > 0 {
            self.busy();
            return None;
        }
        Some(self.idle(now, || Some(loaded), || false))
    }
}

#[test]
fn the_clock_is_read_every_few_idle_passes() {
    let t0 = Instant::now();
    let mut s = Spin::new(us(50), us(10));
    let mut reads = 0;
    let mut at = |t| {
        reads += 1;
        t
    };
    assert_eq!(s.idle_pass(|| at(t0), || Some(false), || false), Next::Spin);
    for _ in 1..CLOCK_STRIDE {
        assert_eq!(
            s.idle_pass(|| at(t0 + us(30)), || Some(false), || false),
            Next::Spin,
            "repeated"
        );
    }
    assert_eq!(
        s.idle_pass(|| at(t0 + us(30)), || Some(false), || false),
        Next::Yield
    );
    for _ in 1..CLOCK_STRIDE {
        assert_eq!(
            s.idle_pass(|| at(t0 + us(90)), || Some(false), || false),
            Next::Yield,
            "repeated"
        );
    }
    assert_eq!(
        s.idle_pass(|| at(t0 + us(90)), || Some(false), || false),
        Next::Park
    );
    assert_eq!(
        s.idle_pass(|| at(t0 + us(91)), || Some(false), || false),
        Next::Park,
        "a park is never repeated unclocked"
    );
    assert_eq!(s.stats.idle_passes, 2 + 2 * CLOCK_STRIDE as u64);
    assert_eq!(s.stats.yields, CLOCK_STRIDE as u64);
    s.busy();
    assert_eq!(
        s.idle_pass(|| at(t0 + us(200)), || Some(false), || false),
        Next::Spin,
        "work: the clock at once"
    );
    assert_eq!(reads, 5);
}

#[test]
fn the_first_spinning_passes_after_work_skip_the_pause_and_never_a_yield_or_park() {
    let t0 = Instant::now();
    let mut s = Spin::new(us(50), us(10)).eager(6);
    let pass = |s: &mut Spin, t: Instant| s.idle_pass(|| t, || Some(false), || false);
    assert_eq!(pass(&mut s, t0), Next::Spin, "no work yet: nothing eager");
    s.busy();
    for i in 0..6 {
        assert_eq!(pass(&mut s, t0 + us(1)), Next::Poll, "pass {i}");
    }
    for _ in 0..CLOCK_STRIDE {
        assert_eq!(pass(&mut s, t0 + us(2)), Next::Spin, "then the hint");
    }
    assert_eq!(s.stats.eager_passes, 6);
    s.busy();
    assert_eq!(pass(&mut s, t0 + us(3)), Next::Poll, "work starts it over");
    // Past the spin it yields, eager passes left or not (the clock is
    // read again after the unclocked passes).
    for _ in 1..CLOCK_STRIDE {
        assert_eq!(pass(&mut s, t0 + us(4)), Next::Poll);
    }
    assert_eq!(pass(&mut s, t0 + us(20)), Next::Yield);
    // A loaded host yields at once after work: no eager pass then.
    let mut s = Spin::new(us(50), us(10)).eager(6);
    s.last_look = true;
    s.busy();
    assert_eq!(s.idle_pass(|| t0, || Some(true), || false), Next::Yield);
    assert_eq!(s.stats.eager_passes, 0);
}

#[test]
fn spins_then_yields_then_parks() {
    let t0 = Instant::now();
    let mut s = Spin::new(us(50), us(10));
    assert_eq!(s.after(3, t0), None);
    assert_eq!(s.after(0, t0 + us(1)), Some(Next::Spin));
    assert_eq!(s.after(0, t0 + us(9)), Some(Next::Spin));
    assert_eq!(s.after(0, t0 + us(12)), Some(Next::Yield));
    assert_eq!(s.after(0, t0 + us(40)), Some(Next::Yield));
    assert_eq!(s.after(1, t0 + us(45)), None, "work resets");
    assert_eq!(s.after(0, t0 + us(46)), Some(Next::Spin));
    assert_eq!(s.after(0, t0 + us(60)), Some(Next::Yield));
    assert_eq!(s.after(0, t0 + us(97)), Some(Next::Park));
    s.woke();
    assert_eq!(s.after(0, t0 + us(5000)), Some(Next::Spin));
    assert_eq!(s.stats.gap_preemptions, 0, "a sleep is no preemption");
    assert_eq!(s.stats.yields, 3);
    assert_eq!(s.stats.parks, 1);
}

#[test]
fn yield_after_zero_yields_at_once_and_past_the_spin_never() {
    let t0 = Instant::now();
    let mut always = Spin::new(us(50), Duration::ZERO);
    assert_eq!(always.after(0, t0), Some(Next::Yield));
    let mut never = Spin::new(us(50), us(50));
    assert_eq!(never.after(0, t0), Some(Next::Spin));
    assert_eq!(never.after(0, t0 + us(49)), Some(Next::Spin));
    assert_eq!(never.after(0, t0 + us(50)), Some(Next::Park));
}

#[test]
fn a_stray_preemption_calms_for_a_millisecond_only() {
    let t0 = Instant::now();
    let mut s = Spin::new(us(50), us(10));
    assert_eq!(s.loaded_after(0, t0), Some(Next::Yield));
    // The next idle pass ends 3 ms later: the thread did not run.
    assert_eq!(s.loaded_after(0, t0 + us(3000)), Some(Next::Park));
    assert_eq!(s.stats.gap_preemptions, 1);
    s.woke();
    // While calm: parks at the first idle pass.
    assert_eq!(s.loaded_after(0, t0 + us(3500)), Some(Next::Park));
    s.woke();
    // A slow pass that did work is no preemption.
    assert_eq!(s.loaded_after(5, t0 + us(3700)), None);
    // 1 ms later the calm is over: spins again (yielding: the host is loaded).
    assert_eq!(s.loaded_after(0, t0 + us(4100)), Some(Next::Yield));
    assert_eq!(s.stats.calm_parks, 2);
    assert_eq!(s.stats.gap_preemptions, 1);
}

#[test]
fn preemptions_that_keep_coming_lengthen_the_calm_to_its_cap() {
    let t0 = Instant::now();
    let mut s = Spin::new(us(50), us(10));
    let mut t = t0;
    let mut calms = Vec::new();
    for _ in 0..12 {
        // A gap, right as the last calm ends.
        assert_eq!(s.loaded_after(0, t), Some(Next::Yield));
        t += us(500);
        assert_eq!(s.loaded_after(0, t), Some(Next::Park));
        s.woke();
        calms.push(s.calm);
        t = s.calm_until.unwrap();
    }
    assert_eq!(calms[0], CALM_MIN);
    assert_eq!(calms[1], CALM_MIN * 2);
    assert_eq!(calms[2], CALM_MIN * 4);
    assert_eq!(*calms.last().unwrap(), CALM_MAX);
    // Quiet for long after: the next calm is short again.
    t += CALM_MAX + CALM_MEMORY;
    assert_eq!(s.loaded_after(0, t), Some(Next::Yield));
    assert_eq!(s.loaded_after(0, t + us(500)), Some(Next::Park));
    assert_eq!(s.calm, CALM_MIN);
}

#[test]
fn preemptions_calm_only_on_a_loaded_host() {
    let t0 = Instant::now();
    let mut s = Spin::new(us(50_000), us(10));
    assert_eq!(s.idle(t0, || Some(false), || false), Next::Spin);
    // A gap, but no thread waits for a core: the peer we serve, or the
    // hypervisor, took ours for a moment. No calm: the spin goes on
    // (yielding, 3 ms after its last work).
    assert_eq!(
        s.idle(t0 + us(3000), || unreachable!(), || false),
        Next::Yield
    );
    assert_eq!(s.stats.gap_preemptions, 0);
    assert_eq!(s.stats.unconfirmed, 1);
    // The pressure is looked at again 10 ms later: loaded, but once is
    // not enough; 10 ms later again, loaded twice in a row: an idle
    // pass yields at once, and a gap starts a calm.
    assert_eq!(
        s.idle(t0 + PROBE_EVERY, || Some(true), || false),
        Next::Yield
    );
    assert_eq!(s.stats.loaded_probes, 0);
    let t0 = t0 + PROBE_EVERY;
    s.busy();
    assert_eq!(
        s.idle(t0 + PROBE_EVERY, || Some(true), || false),
        Next::Yield
    );
    assert_eq!(
        s.idle(t0 + PROBE_EVERY + us(1), || unreachable!(), || false),
        Next::Yield
    );
    assert_eq!(
        s.idle(t0 + PROBE_EVERY + us(2000), || unreachable!(), || false),
        Next::Park
    );
    assert_eq!(s.stats.gap_preemptions, 1);
    assert_eq!(s.stats.loaded_probes, 1);
    // Not known counts as not loaded.
    s.woke();
    let later = t0 + PROBE_EVERY * 5;
    assert_eq!(s.idle(later, || None, || false), Next::Spin);
    // The switch rate is confirmed the same way.
    let mut s = Spin::new(us(50), us(10));
    s.parking(0, t0, || Some(false));
    s.parking(1000, t0 + us(20_000), || Some(false));
    assert_eq!((s.stats.switch_preemptions, s.stats.unconfirmed), (0, 1));
}

#[test]
fn late_yields_yield_at_once_then_move_off_a_shared_core() {
    let t0 = Instant::now();
    let mut s = Spin::new(us(50_000), us(20));
    // Every late yield below switched: the count moves each time.
    let count = std::cell::Cell::new(0u64);
    let moved = || {
        count.set(count.get() + 1);
        count.get()
    };
    assert_eq!(s.after(0, t0), Some(Next::Spin));
    // A quick yield changes nothing.
    assert!(!s.yielded(us(1), t0, || unreachable!(), || unreachable!()));
    assert_eq!(s.after(0, t0 + us(1)), Some(Next::Spin));
    // A late one: yield at once for a while, but one is not enough to
    // move.
    assert!(!s.yielded(us(40), t0 + us(50), moved, || unreachable!()));
    assert_eq!(s.stats.slow_yields, 1);
    s.busy();
    assert_eq!(s.after(0, t0 + us(60)), Some(Next::Yield));
    // Two more within the hold, with a free core on the host: move.
    assert!(!s.yielded(us(40), t0 + us(100), moved, || unreachable!()));
    assert!(s.yielded(us(40), t0 + us(200), moved, || Some(true)));
    assert_eq!(s.stats.moves, 1);
    // Not again within MOVE_EVERY, nor without a free core.
    assert!(!s.yielded(us(40), t0 + us(400), moved, || unreachable!()));
    let later = t0 + MOVE_EVERY + us(400);
    assert!(
        !s.yielded(us(40), later, moved, || unreachable!()),
        "first after the hold ended"
    );
    assert!(!s.yielded(us(40), later + us(10), moved, || unreachable!()));
    assert!(!s.yielded(us(40), later + us(20), moved, || Some(false)));
    assert!(s.yielded(us(40), later + us(30), moved, || Some(true)));
    // The hold ends: spinning first again.
    s.busy();
    let quiet = later + SHARED_HOLD * 2;
    assert_eq!(s.after(0, quiet), Some(Next::Spin));
}

#[test]
fn late_yields_without_a_switch_are_not_a_shared_core() {
    let t0 = Instant::now();
    let mut s = Spin::new(us(50), us(10));
    // Late yields, but nobody ran on our core (the VM's host took it):
    // no hold, no streak, no move, however many.
    for i in 0..10 {
        assert!(!s.yielded(us(40), t0 + us(50 * i), || 0, || unreachable!()));
    }
    assert_eq!((s.stats.slow_yields, s.stats.unswitched_yields), (0, 10));
    s.busy();
    assert_eq!(s.after(0, t0 + us(600)), Some(Next::Spin), "no hold");
    // One that did switch starts the hold as before.
    assert!(!s.yielded(us(40), t0 + us(700), || 1, || unreachable!()));
    s.busy();
    assert_eq!(s.after(0, t0 + us(710)), Some(Next::Yield));
}

#[test]
fn awaiting_replies_yields_past_the_spin_unless_loaded() {
    let t0 = Instant::now();
    let mut s = Spin::new(us(50), us(10));
    assert_eq!(s.idle(t0, || Some(false), || unreachable!()), Next::Spin);
    assert_eq!(s.idle(t0 + us(60), || unreachable!(), || true), Next::Yield);
    assert_eq!(s.idle(t0 + us(90), || unreachable!(), || false), Next::Park);
    // Not past AWAIT_MAX.
    s.woke();
    let t1 = t0 + us(1000);
    assert_eq!(s.idle(t1, || unreachable!(), || true), Next::Spin);
    assert_eq!(
        s.idle(t1 + us(900), || unreachable!(), || true),
        Next::Yield
    );
    let end = t1 + AWAIT_MAX;
    assert_eq!(s.idle(end, || Some(false), || unreachable!()), Next::Park);
    // On a loaded host it parks (a reply rings the doorbell).
    let mut s = Spin::new(us(50), us(10));
    s.last_look = true;
    assert_eq!(s.idle(t0, || Some(true), || unreachable!()), Next::Yield);
    assert_eq!(
        s.idle(t0 + us(60), || unreachable!(), || unreachable!()),
        Next::Park
    );
}

#[test]
fn switch_rate_tells_a_shared_core_from_an_owned_one() {
    let t1 = Instant::now();
    let mut s = Spin::new(us(50), us(10));
    s.parking(100, t1, || Some(true));
    assert_eq!(s.stats.switch_preemptions, 0, "the first count is a start");
    s.parking(110, t1 + us(5000), || Some(true));
    assert_eq!(s.stats.switch_preemptions, 0, "a window is 10 ms at least");
    s.parking(115, t1 + us(20_000), || Some(true));
    assert_eq!(s.stats.switch_preemptions, 0, "750/s: an owned core");
    s.woke();
    assert_eq!(s.loaded_after(0, t1 + us(20_010)), Some(Next::Yield));
    s.parking(115 + 600, t1 + us(40_000), || Some(true));
    assert_eq!(s.stats.switch_preemptions, 1, "30 000/s: a shared core");
    s.woke();
    assert_eq!(
        s.loaded_after(0, t1 + us(40_100)),
        Some(Next::Park),
        "parks at once while calm"
    );
}

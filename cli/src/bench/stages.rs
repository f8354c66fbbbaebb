//! The gaps between the stages of each measured round trip, when the
//! library stamps them (`--features stage-trace`; `ferry::stage_trace`).
//! Each round trip counts the stages stamped after its own start, so one
//! a transport does not reach (tcp has no ring stages) is left out rather
//! than taken from an earlier op.

use ferry::stage_trace::{self, Stage};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The shared page's file: made by the bench, named to its target process.
static PAGE: OnceLock<PathBuf> = OnceLock::new();

/// With the feature, shares the stamps through a file of our own that the
/// target process is told of (`child_env`). Without it, nothing.
pub fn start() {
    if !stage_trace::ENABLED {
        return;
    }
    let path = std::env::temp_dir().join(format!("ferry-stages-{}", std::process::id()));
    match stage_trace::attach(&path) {
        Ok(()) => {
            let _ = PAGE.set(path);
        }
        Err(e) => eprintln!("stage trace: {e}; the target's stages are not seen"),
    }
}

/// The variable a spawned target needs to stamp into our page.
pub fn child_env() -> Option<(&'static str, &'static PathBuf)> {
    PAGE.get().map(|p| ("FERRY_STAGE_TRACE", p))
}

/// Removes the page's file.
pub fn finish() {
    if let Some(p) = PAGE.get() {
        let _ = std::fs::remove_file(p);
    }
}

/// Gaps (ns) per pair of consecutive stages seen.
#[derive(Default)]
pub struct Gaps(Vec<((Stage, Stage), Vec<u64>)>);

impl Gaps {
    /// After a round trip: the stamps from its `Submit` on, in the order
    /// they were made (an op applied in the submit call, `write_async_on`,
    /// goes out before the call returns; through the queue, after).
    pub fn record(&mut self) {
        if !stage_trace::ENABLED {
            return;
        }
        let t0 = stage_trace::get(Stage::Submit);
        let mut seen = [(0u64, Stage::Submit); Stage::ALL.len()];
        let mut n = 0;
        for s in Stage::ALL.into_iter().skip(1) {
            let t = stage_trace::get(s);
            if t >= t0 {
                seen[n] = (t, s);
                n += 1;
            }
        }
        let seen = &mut seen[..n];
        seen.sort_unstable_by_key(|&(t, s)| (t, s as usize));
        let mut prev = (t0, Stage::Submit);
        for &(t, s) in seen.iter() {
            let key = (prev.1, s);
            let gap = t - prev.0;
            match self.0.iter_mut().find(|(k, _)| *k == key) {
                Some((_, v)) => v.push(gap),
                None => self.0.push((key, vec![gap])),
            }
            prev = (t, s);
        }
    }

    /// One line per pair: p50, p90, p99 and how many round trips had it.
    /// Pairs in under 1 % of round trips (a thread preempted between a
    /// step and its stamp puts stamps out of order now and then) are
    /// counted, not printed.
    pub fn print(&mut self) {
        let most = self.0.iter().map(|(_, v)| v.len()).max().unwrap_or(0);
        let (mut rare, mut rare_trips) = (0, 0);
        for ((a, b), v) in self.0.iter_mut() {
            if v.len() * 100 < most {
                rare += 1;
                rare_trips += v.len();
                continue;
            }
            v.sort_unstable();
            let q = |f: f64| v[((v.len() - 1) as f64 * f) as usize];
            eprintln!(
                "stage {:>26} p50 {:6} ns  p90 {:6}  p99 {:6}  ({} round trips)",
                format!("{a:?} -> {b:?}"),
                q(0.5),
                q(0.9),
                q(0.99),
                v.len()
            );
        }
        if rare > 0 {
            eprintln!("stage: {rare} rarer orders of stages left out ({rare_trips} round trips)");
        }
    }
}

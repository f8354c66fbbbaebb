//! Who runs the shards of a C endpoint (`FERRY_DRIVE`).
//!
//! `threads` (the default): ferry's managed mode, one thread per shard.
//!
//! `caller`: the shards are the endpoint's embedded ones, each behind a
//! lock. A caller that posts or polls (`ferry_post`, `ferry_transfer_poll`,
//! `ferry_recv_notification` without a wait, ...) runs one pass of every
//! shard it can lock, on its own thread; one helper thread per shard runs
//! them whenever no caller has for `CALLER_HOLD` (and parks as a managed
//! shard would), so transfers and notifications still progress with nobody
//! polling — noticed within `NAP_MAX` at worst, the helper's longest nap
//! while callers are busy. A caller that waits hands the shards to the
//! helpers at once.
//!
//! Why: an application that polls in a loop (NIXL's users do) keeps a core
//! busy; with managed shards its post and its completion each cross to a
//! shard thread, and on a host with fewer cores than busy threads each
//! crossing is a wake-up (tens of µs on the 2-core machine, against ~1 µs
//! for the same op run by the polling thread itself; BENCHMARKS.md).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use engine::{Endpoint, Shard};

/// A caller that ran the shards this recently is taken to go on doing so:
/// the helpers stay off the locks (and off the cores) meanwhile.
const CALLER_HOLD: Duration = Duration::from_micros(100);
/// While callers keep running the shards, a helper's naps double up to
/// this (each nap is a wake-up: at 10 kHz they cost a 2-core host ~10 % of
/// a core); it is also how late a helper may notice that callers stopped.
const NAP_MAX: Duration = Duration::from_micros(800);
/// The longest a helper parks in one go (a submit or a peer wakes it
/// sooner; this bounds how late it notices the endpoint closing).
const HELPER_PARK: Duration = Duration::from_millis(10);

/// An endpoint and, in `caller` mode, what drives its shards.
pub(crate) struct Engine {
    pub(crate) ep: Endpoint,
    pub(crate) drive: Option<Arc<Driver>>,
}

impl std::ops::Deref for Engine {
    type Target = Endpoint;
    fn deref(&self) -> &Endpoint {
        &self.ep
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(d) = &self.drive {
            d.stop();
        }
    }
}

impl Engine {
    /// Runs the shards on this thread if it can (caller mode).
    pub(crate) fn assist(&self) {
        if let Some(d) = &self.drive {
            d.assist();
        }
    }

    /// Before a blocking wait: the helpers take over at once.
    pub(crate) fn hand_over(&self) {
        if let Some(d) = &self.drive {
            d.hand_over();
        }
    }
}

pub(crate) struct Driver {
    shards: Vec<Mutex<Shard>>,
    epoch: Instant,
    /// When a caller last ran the shards (ns since `epoch`; 0: handed over).
    last_caller_ns: AtomicU64,
    stop: AtomicBool,
    helpers: Mutex<Vec<JoinHandle<()>>>,
    /// The helpers, to wake from a nap (`hand_over`).
    threads: Mutex<Vec<std::thread::Thread>>,
}

impl Driver {
    /// Takes `ep`'s embedded shards and starts their helpers.
    pub(crate) fn start(ep: &Endpoint) -> std::io::Result<Arc<Self>> {
        let d = Arc::new(Driver {
            shards: ep.take_shards().into_iter().map(Mutex::new).collect(),
            epoch: Instant::now(),
            last_caller_ns: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            helpers: Mutex::new(Vec::new()),
            threads: Mutex::new(Vec::new()),
        });
        for i in 0..d.shards.len() {
            let me = d.clone();
            let t = std::thread::Builder::new()
                .name(format!("ferry-drive-{i}"))
                .spawn(move || me.helper(i))?;
            d.threads.lock().expect("lock").push(t.thread().clone());
            d.helpers.lock().expect("lock").push(t);
        }
        Ok(d)
    }

    fn now_ns(&self) -> u64 {
        // At least 1: 0 means "handed over".
        (self.epoch.elapsed().as_nanos() as u64).max(1)
    }

    fn assist(&self) {
        self.last_caller_ns.store(self.now_ns(), Ordering::Relaxed);
        for s in &self.shards {
            if let Ok(mut g) = s.try_lock() {
                g.poll();
            }
        }
    }

    fn hand_over(&self) {
        self.last_caller_ns.store(0, Ordering::Relaxed);
        // A helper napping while callers were busy takes over now, not
        // at the end of its nap.
        for t in self.threads.lock().expect("lock").iter() {
            t.unpark();
        }
    }

    fn helper(&self, i: usize) {
        // Sleeps of tens of µs: without this a sleep is 50 µs late.
        // SAFETY: prctl with an integer argument; no memory is passed.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000u64) };
        let hold = CALLER_HOLD.as_nanos() as u64;
        let mut nap = hold;
        while !self.stop.load(Ordering::Relaxed) {
            let last = self.last_caller_ns.load(Ordering::Relaxed);
            let since = self.now_ns().saturating_sub(last);
            if last != 0 && since < hold {
                std::thread::park_timeout(Duration::from_nanos(nap.max(hold - since)));
                nap = (nap * 2).min(NAP_MAX.as_nanos() as u64);
                continue;
            }
            nap = hold;
            match self.shards[i].try_lock() {
                Ok(mut g) => {
                    g.poll_or_park(HELPER_PARK);
                }
                Err(_) => std::thread::yield_now(),
            }
        }
    }

    fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.lock().expect("lock").iter() {
            t.unpark();
        }
        for t in self.helpers.lock().expect("lock").drain(..) {
            let _ = t.join();
        }
    }
}

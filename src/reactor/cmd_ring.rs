//! A shard's command queue: bounded, many submitters, one shard, with the
//! shard's "I am going to sleep" bit in the same word the submitters
//! advance.
//!
//! Why not `std::sync::mpsc::sync_channel`: a submitter feeding several
//! managed shards spent ~40 % of its time in the channel's send and the
//! fence after it (`perf` on the 16-core machine, 4 shards, 4 KiB ops):
//! the send loaded the slot's stamp (a line the shard wrote last: a miss
//! that stalls), and the park check after it needed a full fence, which
//! waited for the message's stores to reach the cache. Here a push is one
//! compare-and-swap on the tail (which also reads the park bit: no fence
//! of its own) and plain stores into the slot, which complete in the
//! background; room is checked against a copy of the shard's head that
//! submitters refresh only when the ring looks full.
//!
//! The tail word: position << 2 | CLOSED | PARKED. The shard sets PARKED
//! (a read-modify-write, so ordered against every push) before its last
//! look at its queues; a push that finds it set wakes the shard. A push
//! after the shard closed the ring is refused, atomically with its
//! reservation, so the closing shard's drain sees every accepted command.

use std::mem::MaybeUninit;

use crate::sync::{fence, prefetch_write, AtomicU64, Ordering, Padded, UnsafeCell};

const LINE: usize = 64;

const PARKED: u64 = 1;
const CLOSED: u64 = 2;
const POS_SHIFT: u32 = 2;

struct Slot<T> {
    /// `pos + 1` once the value for `pos` is written (a slot is reused
    /// every `slots.len()` positions).
    seq: AtomicU64,
    val: UnsafeCell<MaybeUninit<T>>,
}

/// Why a push was refused; the value comes back with it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PushError {
    Full,
    Closed,
}

pub(crate) struct CmdRing<T> {
    slots: Box<[Slot<T>]>,
    /// At most this many values are queued (`slots.len()` is the next
    /// power of two).
    depth: u64,
    tail: Padded<AtomicU64>,
    /// The next position the shard reads; only the shard writes it.
    head: Padded<AtomicU64>,
    /// Submitters' view of `head`, refreshed when the ring looks full.
    head_seen: Padded<AtomicU64>,
}

// SAFETY: a slot's value is written by the one submitter that reserved its
// position and read by the one consumer after it saw `seq` (Release /
// Acquire); values move between threads, so T must be Send.
unsafe impl<T: Send> Sync for CmdRing<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Send for CmdRing<T> {}

/// The right to take from a ring: one exists per ring (made with it), so
/// one thread at a time consumes.
pub(crate) struct Consumer {
    _private: (),
}

impl<T> CmdRing<T> {
    /// A ring holding at most `depth` (≥ 1) values, and its one consumer.
    pub fn new(depth: usize) -> (CmdRing<T>, Consumer) {
        let depth = depth.max(1);
        let n = depth.next_power_of_two();
        let slots = (0..n)
            .map(|_| Slot {
                seq: AtomicU64::new(0),
                val: UnsafeCell::new(MaybeUninit::uninit()),
            })
            .collect();
        let ring = CmdRing {
            slots,
            depth: depth as u64,
            tail: Padded(AtomicU64::new(0)),
            head: Padded(AtomicU64::new(0)),
            head_seen: Padded(AtomicU64::new(0)),
        };
        (ring, Consumer { _private: () })
    }

    /// The most values it holds.
    pub fn depth(&self) -> usize {
        self.depth as usize
    }

    fn slot(&self, pos: u64) -> &Slot<T> {
        &self.slots[(pos as usize) & (self.slots.len() - 1)]
    }

    /// Asks this core's cache for the slot the next push will fill, for
    /// writing, while the submitter still checks and builds its command.
    /// A push's stores go to lines the shard read on the ring's last lap;
    /// each waits for its line to come over from the shard's core, and the
    /// op's later stores queue behind it (a submitter feeding four managed
    /// shards stalled there: `perf`, docs/benchmarks-log.md). Asked for here, the
    /// lines travel meanwhile. All of them, the first (with `seq`, which an
    /// idle shard polls) too: measured, it is the one that saves the most.
    /// A hint: another submitter may take the position, and then nothing
    /// is lost but a fetch.
    pub fn prepare_push(&self) {
        let pos = self.tail.load(Ordering::Relaxed) >> POS_SHIFT;
        let first = self.slot(pos) as *const Slot<T> as *const u8;
        let len = std::mem::size_of::<Slot<T>>();
        let mut off = 0;
        while off < len {
            prefetch_write(first.wrapping_add(off));
            off += LINE;
        }
        // The slot need not start on a line: its last byte's line too.
        prefetch_write(first.wrapping_add(len - 1));
    }

    /// Queues `v`. `Ok(true)`: the consumer announced a park and must be
    /// woken. A full or closed ring hands `v` back.
    pub fn push(&self, v: T) -> Result<bool, (PushError, T)> {
        let mut t = self.tail.load(Ordering::Relaxed);
        let pos = loop {
            if t & CLOSED != 0 {
                return Err((PushError::Closed, v));
            }
            let pos = t >> POS_SHIFT;
            // Acquire, here and below: the consumer's reads of the slots it
            // passed happen before our write into one of them (through
            // whichever submitter refreshed `head_seen`; loom found the
            // race a Relaxed load leaves).
            if pos.saturating_sub(self.head_seen.load(Ordering::Acquire)) >= self.depth {
                // Looks full: look at the consumer's own head.
                let h = self.head.load(Ordering::Acquire);
                self.head_seen.fetch_max(h, Ordering::AcqRel);
                // (A stale `t` may lie behind it: the CAS below fails then.)
                if pos.saturating_sub(h) >= self.depth {
                    return Err((PushError::Full, v));
                }
            }
            // SeqCst: ordered against the consumer's park announcement
            // (also a read-modify-write of this word).
            match self.tail.compare_exchange_weak(
                t,
                t + (1 << POS_SHIFT),
                Ordering::SeqCst,
                Ordering::Relaxed,
            ) {
                Ok(_) => break pos,
                Err(cur) => t = cur,
            }
        };
        // The position is ours: nobody else writes this slot until the
        // consumer moved past it (room was checked against its head,
        // read with Acquire after its last read of this slot).
        let s = self.slot(pos);
        // SAFETY: as above; the consumer reads it only after `seq` says so.
        s.val.with_mut(|p| unsafe { (*p).write(v) });
        s.seq.store(pos + 1, Ordering::Release);
        Ok(t & PARKED != 0)
    }

    /// The next value, if its submitter finished writing it.
    pub fn pop(&self, _c: &mut Consumer) -> Option<T> {
        let h = self.head.load(Ordering::Relaxed);
        let s = self.slot(h);
        if s.seq.load(Ordering::Acquire) != h + 1 {
            return None;
        }
        // SAFETY: `seq` (Acquire) says the value for `h` is written; we
        // are the one consumer, and we take it once (head moves on).
        let v = s.val.with(|p| unsafe { (*p).assume_init_read() });
        self.head.store(h + 1, Ordering::Release);
        Some(v)
    }

    /// Whether positions were taken that the consumer has not read (some
    /// may still be being written: the consumer must look again, not
    /// sleep).
    pub fn pending(&self, _c: &Consumer) -> bool {
        self.tail.load(Ordering::SeqCst) >> POS_SHIFT != self.head.load(Ordering::Relaxed)
    }

    /// How many values were ever accepted (the next one's position):
    /// `taken` reaches it once the consumer took all of them.
    pub fn accepted(&self) -> u64 {
        self.tail.load(Ordering::SeqCst) >> POS_SHIFT
    }

    /// How many values the consumer took.
    pub fn taken(&self, _c: &Consumer) -> u64 {
        self.head.load(Ordering::Relaxed)
    }

    /// The consumer is about to sleep; it looks at its queues (this one
    /// with `pending`) after this.
    pub fn announce_park(&self, _c: &Consumer) {
        self.tail.fetch_or(PARKED, Ordering::SeqCst);
    }

    /// The consumer is awake.
    pub fn clear_park(&self, _c: &Consumer) {
        self.tail.fetch_and(!PARKED, Ordering::SeqCst);
    }

    /// For other wakers (their own queue written first): must the
    /// consumer be woken?
    pub fn park_wanted(&self) -> bool {
        fence(Ordering::SeqCst);
        self.tail.load(Ordering::SeqCst) & PARKED != 0
    }

    /// Refuses further pushes; returns every value accepted before,
    /// waiting for submitters still writing theirs.
    pub fn close(&self, c: &mut Consumer) -> Vec<T> {
        let t = self.tail.fetch_or(CLOSED, Ordering::SeqCst);
        let end = t >> POS_SHIFT;
        let mut out = Vec::new();
        while self.head.load(Ordering::Relaxed) != end {
            match self.pop(c) {
                Some(v) => out.push(v),
                // A submitter between its reservation and its store.
                None => {
                    #[cfg(loom)]
                    crate::sync::model_yield();
                    #[cfg(not(loom))]
                    std::thread::yield_now();
                }
            }
        }
        out
    }
}

impl<T> Drop for CmdRing<T> {
    fn drop(&mut self) {
        // Values written and not taken (the consumer never closed).
        let end = self.tail.load(Ordering::Relaxed) >> POS_SHIFT;
        let mut h = self.head.load(Ordering::Relaxed);
        while h != end {
            let s = self.slot(h);
            if s.seq.load(Ordering::Acquire) == h + 1 {
                // SAFETY: written (seq) and never taken; we own the ring.
                s.val.with_mut(|p| unsafe { (*p).assume_init_drop() });
            }
            h += 1;
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn bounded_in_order_and_hands_back_what_does_not_fit() {
        let (r, mut c) = CmdRing::new(3);
        for i in 0..3 {
            assert_eq!(r.push(i), Ok(false));
        }
        // Warming the next slot of a full ring (the one the consumer has
        // yet to read) is only a hint: nothing moves.
        r.prepare_push();
        assert_eq!(r.push(9), Err((PushError::Full, 9)));
        assert_eq!(r.pop(&mut c), Some(0));
        assert_eq!(r.push(3), Ok(false));
        assert_eq!(r.push(9), Err((PushError::Full, 9)));
        for i in 1..4 {
            assert_eq!(r.pop(&mut c), Some(i));
        }
        assert_eq!(r.pop(&mut c), None);
        assert!(!r.pending(&c));
        // Many laps over the 4 slots.
        for i in 0..100 {
            r.prepare_push();
            r.push(i).unwrap();
            r.push(i + 1000).unwrap();
            assert_eq!(r.pop(&mut c), Some(i));
            assert_eq!(r.pop(&mut c), Some(i + 1000));
        }
    }

    #[test]
    fn a_push_after_a_park_announcement_says_wake() {
        let (r, mut c) = CmdRing::new(4);
        r.announce_park(&c);
        assert!(r.park_wanted());
        assert_eq!(r.push(1), Ok(true));
        assert!(r.pending(&c));
        r.clear_park(&c);
        assert!(!r.park_wanted());
        assert_eq!(r.push(2), Ok(false));
        assert_eq!(r.pop(&mut c), Some(1));
        assert_eq!(r.pop(&mut c), Some(2));
    }

    #[test]
    fn close_returns_what_was_accepted_and_refuses_the_rest() {
        let (r, mut c) = CmdRing::new(4);
        r.push(1).unwrap();
        r.push(2).unwrap();
        assert_eq!(r.close(&mut c), vec![1, 2]);
        assert_eq!(r.push(3), Err((PushError::Closed, 3)));
    }

    #[test]
    fn values_left_in_a_dropped_ring_are_dropped_once() {
        let live = Arc::new(());
        {
            let (r, mut c) = CmdRing::new(8);
            for _ in 0..5 {
                r.push(live.clone()).unwrap();
            }
            drop(r.pop(&mut c));
            assert_eq!(Arc::strong_count(&live), 5);
        }
        assert_eq!(Arc::strong_count(&live), 1);
    }

    #[test]
    fn many_submitters_one_consumer_lose_nothing() {
        let (r, mut c) = CmdRing::new(16);
        let r = Arc::new(r);
        let per = 20_000u64;
        let hs: Vec<_> = (0..3u64)
            .map(|t| {
                let r = r.clone();
                std::thread::spawn(move || {
                    for i in 0..per {
                        let mut v = t << 32 | i;
                        loop {
                            // The hint, racing the other submitters for
                            // the same position: it changes nothing.
                            r.prepare_push();
                            match r.push(v) {
                                Ok(_) => break,
                                Err((PushError::Full, back)) => {
                                    v = back;
                                    std::thread::yield_now();
                                }
                                Err((e, _)) => panic!("{e:?}"),
                            }
                        }
                    }
                })
            })
            .collect();
        let mut next = [0u64; 3];
        let mut got = 0;
        while got < 3 * per {
            if let Some(v) = r.pop(&mut c) {
                let (t, i) = ((v >> 32) as usize, v & 0xffff_ffff);
                assert_eq!(i, next[t], "each submitter's values in order");
                next[t] += 1;
                got += 1;
            }
        }
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(r.pop(&mut c), None);
    }
}

/// The park handshake and the slot hand-over under loom (`--cfg loom`).
#[cfg(all(test, loom))]
mod loom_models {
    use super::*;
    use loom::sync::Notify;
    use std::sync::Arc as StdArc;

    #[test]
    fn loom_a_push_always_wakes_a_parking_consumer() {
        loom::model(|| {
            let (r, mut c) = CmdRing::new(2);
            let r = loom::sync::Arc::new(r);
            let waker = loom::sync::Arc::new(Notify::new());
            let p = {
                let (r, waker) = (r.clone(), waker.clone());
                loom::thread::spawn(move || {
                    if r.push(7u32).unwrap() {
                        waker.notify();
                    }
                })
            };
            // The shard: a pass found nothing; park.
            let v = loop {
                if let Some(v) = r.pop(&mut c) {
                    break v;
                }
                r.announce_park(&c);
                if let Some(v) = r.pop(&mut c) {
                    r.clear_park(&c);
                    break v;
                }
                if r.pending(&c) {
                    // Reserved, still being written: look again.
                    loom::thread::yield_now();
                } else {
                    waker.wait();
                }
                r.clear_park(&c);
            };
            assert_eq!(v, 7);
            p.join().unwrap();
        });
    }

    #[test]
    fn loom_two_submitters_wrapping_a_one_slot_ring() {
        loom::model(|| {
            let (r, mut c) = CmdRing::new(1);
            let r = loom::sync::Arc::new(r);
            let hs: Vec<_> = [2u32, 1]
                .into_iter()
                .enumerate()
                .map(|(p, n)| {
                    let r = r.clone();
                    loom::thread::spawn(move || {
                        let mut sent = Vec::new();
                        for i in 0..n {
                            let v = (p as u32) << 8 | i;
                            // A full ring: one retry, later.
                            let ok = match r.push(StdArc::new(v)) {
                                Ok(_) => true,
                                Err((_, back)) => {
                                    loom::thread::yield_now();
                                    r.push(back).is_ok()
                                }
                            };
                            if ok {
                                sent.push(v);
                            }
                        }
                        sent
                    })
                })
                .collect();
            let mut got = Vec::new();
            if let Some(v) = r.pop(&mut c) {
                got.push(*v);
            }
            let sent: Vec<Vec<u32>> = hs.into_iter().map(|h| h.join().unwrap()).collect();
            while let Some(v) = r.pop(&mut c) {
                got.push(*v);
            }
            for (p, sent) in sent.iter().enumerate() {
                let mine: Vec<u32> = got
                    .iter()
                    .copied()
                    .filter(|v| (v >> 8) as usize == p)
                    .collect();
                assert_eq!(&mine, sent, "submitter {p}: lost, repeated or reordered");
            }
        });
    }
}

//! The completion table: a fixed array of slots, one per operation in
//! flight, shared by the threads that submit and the shard that completes.
//!
//! Claiming a slot is a compare-and-swap, completing one is a store and (only
//! if someone sleeps on it) a futex wake; nothing allocates. A `Transfer`
//! names its slot; dropping one that is still in flight detaches it, and the
//! shard frees the slot when the operation ends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::sync::{
    prefetch_write, AtomicBool, AtomicU32, AtomicUsize, Ordering, Padded, UnsafeCell,
};

const FREE: u32 = 0;
const PENDING: u32 = 1;
const DONE: u32 = 2;
/// A thread sleeps in `futex_wait` on this slot.
const WAITER: u32 = 4;
/// The `Transfer` was dropped; whoever completes the op frees the slot.
const DETACHED: u32 = 8;
/// A completer owns `result` (set by the CAS that admits exactly one).
const COMPLETING: u32 = 16;

/// Spins before a waiter sleeps: long enough to catch a loopback round trip
/// without a syscall, short enough not to burn a core on slow ops.
#[cfg(not(loom))]
const SPIN_ITERS: u32 = 20_000;
/// A model explores the sleep instead (after one spin).
#[cfg(loom)]
const SPIN_ITERS: u32 = 1;

/// One cache line per slot: neighbouring slots belong to ops on different
/// shards, which complete them while the submitter claims the next;
/// sharing lines made claims cache misses (claim was a third of the
/// submitting thread's time with four shards on the 16-core machine,
/// `perf`). 64 bytes (checked below): the error is boxed.
#[repr(align(64))]
struct Slot {
    state: AtomicU32,
    /// Parts still to complete when the op was split over shards (0: not
    /// split; `complete` ends it at once).
    parts: AtomicU32,
    /// A part failed and its error is in `result` (the first one wins).
    erred: AtomicBool,
    /// Written by the completer while the state is PENDING, read by the
    /// owner only after it observed DONE (Acquire): never both at once.
    /// Boxed: an error is rare, and the slot then fits one cache line.
    result: UnsafeCell<Option<Box<Error>>>,
    /// A notification to send once the op ended well: written by the owner
    /// before the op is submitted, taken by the one completer that ends it.
    note: UnsafeCell<Option<Box<Note>>>,
    /// The owner's submission failed: the completer drops the note.
    note_cancelled: AtomicBool,
}

/// A notification for the peer, sent by a shard once its op ended well:
/// on `conn` (the connection's first lane), which shard `shard` serves;
/// `payload` is the wire's (kind byte first).
#[derive(Debug)]
pub(crate) struct Note {
    pub conn: crate::error::ConnId,
    pub shard: usize,
    pub payload: Vec<u8>,
}

/// What one completion call did: whether it ended its op (`Some`, with
/// the kind of the op's failure if it failed), and the op's notification
/// to send when it ended well.
#[derive(Default)]
pub(crate) struct Ending {
    pub ended: Option<Option<crate::error::FailureKind>>,
    pub note: Option<Box<Note>>,
}

// One slot, one cache line (the error is boxed, the note too).
#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Slot>() == 64);

pub(crate) struct CompletionTable {
    slots: Box<[Slot]>,
    /// Written by submitters on every claim: on a line of its own, away
    /// from `slots` (read by every completing shard) and from the `Arc`'s
    /// counts (changed by every `Transfer`).
    hint: Padded<AtomicUsize>,
    /// The endpoint's completion fd (raised after each op is published).
    signal: Arc<super::signal::Signal>,
}

// SAFETY: `result` is accessed under the state protocol above, which hands
// exclusive access between threads with Release/Acquire ordering.
unsafe impl Sync for CompletionTable {}
// SAFETY: as for Sync; the Error inside is Send.
unsafe impl Send for CompletionTable {}

impl CompletionTable {
    pub fn new(capacity: usize) -> Arc<Self> {
        let slots = (0..capacity)
            .map(|_| Slot {
                state: AtomicU32::new(FREE),
                parts: AtomicU32::new(0),
                erred: AtomicBool::new(false),
                result: UnsafeCell::new(None),
                note: UnsafeCell::new(None),
                note_cancelled: AtomicBool::new(false),
            })
            .collect();
        Arc::new(Self {
            slots,
            hint: Padded(AtomicUsize::new(0)),
            signal: Arc::default(),
        })
    }

    /// The completion fd the endpoint's ends raise (shared with its
    /// notification inboxes).
    pub fn signal(&self) -> &Arc<super::signal::Signal> {
        &self.signal
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Slots currently claimed (in flight or completed but not reaped).
    pub fn in_use(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.state.load(Ordering::Relaxed) != FREE)
            .count()
    }

    /// Asks for the slot the next claim will most likely take (the one at
    /// the hint), for writing, while the caller checks its op: the shard
    /// that ended the slot's last op wrote its line (and freed it, if its
    /// transfer was dropped), and the shards completing its neighbours'
    /// ops pull it along with theirs.
    pub fn prepare_claim(&self) {
        let j = self.hint.load(Ordering::Relaxed);
        if let Some(s) = self.slots.get(j) {
            prefetch_write(&s.state as *const AtomicU32 as *const u8);
        }
    }

    /// Claims a free slot, or `None` when all are in use.
    pub fn claim(self: &Arc<Self>) -> Option<Transfer> {
        let n = self.slots.len();
        // Only a hint: a plain load and store (not a read-modify-write)
        // keeps concurrent claimers apart well enough; the CAS decides.
        let start = self.hint.load(Ordering::Relaxed);
        let start = if start >= n { 0 } else { start };
        for i in 0..n {
            let j = if start + i >= n {
                start + i - n
            } else {
                start + i
            };
            let st = &self.slots[j].state;
            if st.load(Ordering::Relaxed) == FREE
                && st
                    .compare_exchange(FREE, PENDING, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                self.hint.store(j + 1, Ordering::Relaxed);
                self.slots[j].parts.store(0, Ordering::Relaxed);
                self.slots[j].erred.store(false, Ordering::Relaxed);
                self.slots[j].note_cancelled.store(false, Ordering::Relaxed);
                return Some(Transfer {
                    table: self.clone(),
                    idx: j as u32,
                    reaped: None,
                });
            }
        }
        None
    }

    /// Splits the operation in `idx` into `n` parts (each submitted to
    /// its own shard): it then ends when `complete` has been called once
    /// per part, with the first error any part had. The owner calls it
    /// before submitting any part.
    pub fn set_parts(&self, idx: u32, n: u32) {
        if n > 1 {
            self.slots[idx as usize].parts.store(n, Ordering::Relaxed);
        }
    }

    /// Attaches `note` to the op in `idx`: the completer that ends it well
    /// hands it back (`complete_noting`). The owner calls it after the
    /// claim and before submitting any part.
    pub fn set_note(&self, idx: u32, note: Note) {
        // SAFETY: the op is claimed and not yet submitted: no completer
        // can reach the slot until a part is queued (after this returns,
        // the queue's synchronization publishes the write).
        unsafe {
            self.slots[idx as usize]
                .note
                .with_mut(|n| *n = Some(Box::new(note)))
        };
    }

    /// Takes the note of the op in `idx` for the shard that sends it
    /// riding in the op's one request (the target delivers it once the
    /// copy landed): then the completer finds none. Only for an op not
    /// split in parts (that shard is its only completer) and whose note
    /// was not withdrawn; called before the request goes out.
    pub fn take_note(&self, idx: u32) -> Option<Box<Note>> {
        let slot = &self.slots[idx as usize];
        if slot.parts.load(Ordering::Acquire) != 0 || slot.note_cancelled.load(Ordering::Acquire) {
            return None;
        }
        // SAFETY: the owner wrote the note before submitting and never
        // touches it again; the op is whole and its request not out, so
        // its completer (the calling shard) is not reading it.
        unsafe { slot.note.with_mut(|p| (*p).take()) }
    }

    /// Puts back a note `take_note` took when it could not ride after all
    /// (same caller, same moment: the request did not go out with it).
    pub fn put_note(&self, idx: u32, note: Box<Note>) {
        // SAFETY: as for `take_note`.
        unsafe { self.slots[idx as usize].note.with_mut(|p| *p = Some(note)) };
    }

    /// The owner could not submit the op whole: its note is never sent.
    pub fn cancel_note(&self, idx: u32) {
        self.slots[idx as usize]
            .note_cancelled
            .store(true, Ordering::Release);
    }

    /// As `complete`; also hands back the op's note when this call ended it
    /// well (the caller sends it), and whether this call ended the op
    /// (`Some`: the last part of a split op, or a whole one) with the kind
    /// of its failure, if it failed.
    pub fn complete_noting(&self, idx: u32, outcome: Result<()>) -> Ending {
        let mut ending = Ending::default();
        self.complete_into(idx, outcome, &mut ending);
        ending
    }

    /// Records the outcome of the operation in `idx` (of one part of a
    /// split one: the last part's call ends it). Returns `false` (and
    /// changes nothing) if the slot has no operation in flight or another
    /// completion got there first: only the first completion of a claim
    /// counts, so no caller can race the owner's read of the result.
    pub fn complete(&self, idx: u32, outcome: Result<()>) -> bool {
        self.complete_into(idx, outcome, &mut Ending::default())
    }

    fn complete_into(&self, idx: u32, outcome: Result<()>, ending: &mut Ending) -> bool {
        let slot = &self.slots[idx as usize];
        if slot.parts.load(Ordering::Acquire) != 0 {
            if slot.state.load(Ordering::Relaxed) & (DONE | COMPLETING) != 0 {
                return false;
            }
            if let Err(e) = outcome {
                if !slot.erred.swap(true, Ordering::AcqRel) {
                    // SAFETY: the `erred` swap admits one writer; the owner
                    // reads only after DONE, which the last part publishes
                    // after its AcqRel decrement below (ordered after this).
                    unsafe { slot.result.with_mut(|r| *r = Some(Box::new(e))) };
                }
            }
            if slot.parts.fetch_sub(1, Ordering::AcqRel) != 1 {
                return true;
            }
            // The last part: publish with the error kept (if any).
            return self.finish(slot, None, ending);
        }
        self.finish(slot, Some(outcome.err()), ending)
    }

    /// Ends the op in `slot`, storing `result` unless it is `None` (a split
    /// op's parts stored theirs).
    fn finish(&self, slot: &Slot, result: Option<Option<Error>>, ending: &mut Ending) -> bool {
        let mut s = slot.state.load(Ordering::Relaxed);
        loop {
            if s & PENDING == 0 || s & (DONE | COMPLETING) != 0 {
                return false;
            }
            match slot.state.compare_exchange_weak(
                s,
                s | COMPLETING,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(cur) => s = cur,
            }
        }
        let ok = match &result {
            Some(r) => r.is_none(),
            None => !slot.erred.load(Ordering::Acquire),
        };
        if let Some(r) = result {
            // SAFETY: our CAS set COMPLETING, which admits one completer;
            // the owner does not touch `result` until it sees DONE below.
            unsafe { slot.result.with_mut(|p| *p = r.map(Box::new)) };
        }
        ending.ended = Some(match ok {
            true => None,
            // SAFETY: as above: the one completer, before DONE.
            false => unsafe { slot.result.with(|p| (*p).as_ref().map(|e| e.kind())) },
        });
        // SAFETY: as for `result`: the one completer; the owner wrote the
        // note before submitting and never touches it again.
        let n = unsafe { slot.note.with_mut(|p| (*p).take()) };
        if ok && !slot.note_cancelled.load(Ordering::Acquire) {
            ending.note = n;
        }
        s |= COMPLETING;
        loop {
            if s & DETACHED != 0 {
                // SAFETY: nobody will ever read this result; we own it again.
                unsafe { slot.result.with_mut(|p| *p = None) };
                slot.state.store(FREE, Ordering::Release);
                return true;
            }
            match slot.state.compare_exchange_weak(
                s,
                DONE | (s & WAITER),
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(cur) => s = cur,
            }
        }
        #[cfg(not(loom))]
        self.signal.raise();
        if s & WAITER != 0 {
            futex_wake(&slot.state);
        }
        true
    }
}

/// An operation in flight. Poll it, wait for it, or drop it (the operation
/// still runs to completion; only its result is discarded).
///
/// ```
/// # fn main() -> ferry::Result<()> {
/// # let mut cfg = ferry::Config::default();
/// # cfg.listen_addr = "127.0.0.1".parse().unwrap();
/// # let target = ferry::Endpoint::builder().config(cfg.clone()).build()?;
/// # let initiator = ferry::Endpoint::builder().config(cfg).build()?;
/// # target.start_passive_accept()?;
/// # let window = target.alloc(4096)?.advertise(0, 4096)?;
/// # let conn = initiator.add_remote(&target.metadata_bytes())?;
/// let src = initiator.register(vec![7u8; 4096])?;
/// let mut t = initiator.write_async(conn, &src, 0, 4096, &window)?;
/// while t.poll().is_none() {
///     // other work; `t.wait()` blocks instead
/// }
/// # Ok(()) }
/// ```
pub struct Transfer {
    table: Arc<CompletionTable>,
    idx: u32,
    reaped: Option<Result<()>>,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("slot", &self.idx)
            .field("done", &self.reaped.is_some())
            .finish()
    }
}

impl Transfer {
    pub(crate) fn slot(&self) -> u32 {
        self.idx
    }

    fn state(&self) -> &AtomicU32 {
        &self.table.slots[self.idx as usize].state
    }

    fn try_reap(&mut self) -> bool {
        if self.reaped.is_some() {
            return true;
        }
        if self.state().load(Ordering::Acquire) & DONE == 0 {
            return false;
        }
        let slot = &self.table.slots[self.idx as usize];
        // SAFETY: DONE was observed with Acquire; the completer is finished
        // with `result` and nobody else reads it.
        let err = unsafe { slot.result.with_mut(|p| (*p).take()) }.map(|b| *b);
        slot.state.store(FREE, Ordering::Release);
        self.reaped = Some(err.map_or(Ok(()), Err));
        true
    }

    fn result_copy(&self) -> Result<()> {
        match self.reaped.as_ref().expect("reaped") {
            Ok(()) => Ok(()),
            Err(e) => Err(e.duplicate()),
        }
    }

    /// `None` while in flight; the outcome once done (and on every later call).
    pub fn poll(&mut self) -> Option<Result<()>> {
        self.try_reap().then(|| self.result_copy())
    }

    /// Whether it has ended (its outcome is then `poll`'s).
    pub fn is_done(&mut self) -> bool {
        self.try_reap()
    }

    /// Withdraws the notification attached to this transfer
    /// (`Endpoint::transfer_notify_async`) if it was not handed to its
    /// connection yet: a caller cancelling the transfer. The data ops
    /// already under way run to their end; only the note is dropped.
    pub fn withdraw_note(&self) {
        // Not reaped: the slot is still this transfer's (only `try_reap`,
        // which needs `&mut self`, frees it), so the flag cannot reach an
        // op that reused the slot.
        if self.reaped.is_none() {
            self.table.cancel_note(self.idx);
        }
    }

    /// Blocks until the operation ends. Needs a shard that is being polled:
    /// a managed one, or an embedded one driven by another thread.
    pub fn wait(mut self) -> Result<()> {
        loop {
            match self.wait_timeout(Duration::from_secs(3600)) {
                Err(Error::Timeout {
                    what: "transfer", ..
                }) => continue,
                other => return other,
            }
        }
    }

    /// Waits up to `timeout`; `Err(Error::Timeout)` leaves the transfer in
    /// flight, so it can be waited on again.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut spins = 0u32;
        loop {
            if self.try_reap() {
                return self.result_copy();
            }
            if spins < SPIN_ITERS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Err(Error::Timeout {
                    what: "transfer",
                    timeout_ms: timeout.as_millis() as u64,
                });
            };
            let st = self.state();
            let s = st.load(Ordering::Acquire);
            if s & DONE != 0 {
                continue;
            }
            if s & WAITER == 0
                && st
                    .compare_exchange(s, s | WAITER, Ordering::Relaxed, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            futex_wait(st, s | WAITER, left);
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if self.reaped.is_some() {
            return;
        }
        let st = self.state();
        let mut s = st.load(Ordering::Acquire);
        loop {
            if s & DONE != 0 {
                self.try_reap();
                return;
            }
            match st.compare_exchange_weak(s, s | DETACHED, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(cur) => s = cur,
            }
        }
    }
}

#[cfg(not(loom))]
fn futex_wait(a: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT reads the u32 at a valid, aligned address and
    // sleeps only while it equals `expected`; `ts` outlives the call.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            a.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

#[cfg(not(loom))]
fn futex_wake(a: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address as a key.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            a.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
        );
    }
}

/// A model's futex: a sleep that may end spuriously (as a real one may),
/// and the wake it needs is the loop around it.
#[cfg(loom)]
fn futex_wait(a: &AtomicU32, expected: u32, _timeout: Duration) {
    if a.load(Ordering::SeqCst) == expected {
        crate::sync::model_yield();
    }
}

#[cfg(loom)]
fn futex_wake(_a: &AtomicU32) {}

#[cfg(test)]
mod tests;

/// The one-completer protocol under loom (`--cfg loom`): every
/// interleaving of the owner, completers and a dropped transfer.
#[cfg(all(test, loom))]
mod loom_models {
    use super::*;
    use loom::thread;

    /// The owner waits while another thread completes: it sees that
    /// outcome, and the slot is free after.
    #[test]
    fn loom_complete_while_the_owner_waits() {
        loom::model(|| {
            let t = CompletionTable::new(1);
            let tr = t.claim().unwrap();
            let idx = tr.slot();
            let t2 = t.clone();
            let h = thread::spawn(move || assert!(t2.complete(idx, Err(Error::Shutdown))));
            assert!(matches!(tr.wait(), Err(Error::Shutdown)));
            h.join().unwrap();
            assert_eq!(t.in_use(), 0);
        });
    }

    /// Two completers race: exactly one counts, and the owner reads its
    /// outcome.
    #[test]
    fn loom_one_completer_wins() {
        loom::model(|| {
            let t = CompletionTable::new(1);
            let mut tr = t.claim().unwrap();
            let idx = tr.slot();
            let hs: Vec<_> = [Ok(()), Err(Error::Shutdown)]
                .into_iter()
                .map(|r| {
                    let t = t.clone();
                    thread::spawn(move || t.complete(idx, r))
                })
                .collect();
            let won: Vec<bool> = hs.into_iter().map(|h| h.join().unwrap()).collect();
            assert_eq!(won.iter().filter(|w| **w).count(), 1, "{won:?}");
            let r = tr.poll().expect("done after both");
            assert_eq!(r.is_ok(), won[0]);
        });
    }

    /// A transfer dropped while its op completes: whichever comes first,
    /// the slot ends free exactly once and can be claimed again.
    #[test]
    fn loom_drop_races_completion() {
        loom::model(|| {
            let t = CompletionTable::new(1);
            let tr = t.claim().unwrap();
            let idx = tr.slot();
            let t2 = t.clone();
            let h = thread::spawn(move || t2.complete(idx, Ok(())));
            drop(tr);
            assert!(h.join().unwrap());
            assert_eq!(t.in_use(), 0);
            assert!(t.claim().is_some());
        });
    }

    /// An op split in two parts on two threads, one failing: the owner
    /// sees that failure once both ended, never before.
    #[test]
    fn loom_split_parts_keep_the_error() {
        loom::model(|| {
            let t = CompletionTable::new(1);
            let tr = t.claim().unwrap();
            let idx = tr.slot();
            t.set_parts(idx, 2);
            let hs: Vec<_> = [Ok(()), Err(Error::Shutdown)]
                .into_iter()
                .map(|r| {
                    let t = t.clone();
                    thread::spawn(move || assert!(t.complete(idx, r)))
                })
                .collect();
            assert!(matches!(tr.wait(), Err(Error::Shutdown)));
            for h in hs {
                h.join().unwrap();
            }
            assert_eq!(t.in_use(), 0);
        });
    }
}

//! A bounded multi-producer single-consumer ring of fixed-size slots, laid
//! out so it can live in memory shared between processes.
//!
//! A producer claims position `p` by a CAS on `enqueue`, fills the slot and
//! publishes it by storing the slot's `seq = p + 1` (Release); the consumer
//! takes it when `seq == p + 1` (Acquire) and frees it by advancing
//! `dequeue` past it (Release). A producer finds room by comparing `p` with
//! the `dequeue` it saw last, and reads `dequeue` again only when that says
//! full: a push touches no line the consumer wrote since the last lap. (In
//! Vyukov's queue, which this was, the consumer frees a slot by writing its
//! `seq` and a producer reads that first: a cache miss on the line before
//! every message, on the round trip's critical path, twice per round trip;
//! docs/benchmarks-log.md has the A/B.) A full ring hands the message back:
//! back-pressure. `enqueue` and `dequeue` sit on separate cache lines, away
//! from the header, so producers and the consumer do not false-share.
//!
//! `Ring` works over any suitably aligned memory; `ShmRing` (in `object.rs`)
//! puts one in a POSIX shared-memory object. The unit tests run the same
//! code on heap memory, under Miri too.

use crate::sync::{fence, AtomicU32, AtomicU64, Ordering, UnsafeCell};
use crate::wire::DecodeError;

pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"FRYRING1");
/// The magic of a doorbell page (`bell.rs`), which starts with the same
/// header: the stale-object sweep tells ferry's objects by these two.
pub const BELL_MAGIC: u64 = u64::from_le_bytes(*b"FRYBELL1");
pub const SLOT_BYTES: usize = 256;
/// Bytes of message a slot holds.
pub const SLOT_PAYLOAD: usize = SLOT_BYTES - 16;
// The message codec (in `wire`) is sized for exactly this payload.
const _: () = assert!(SLOT_PAYLOAD == crate::wire::SHM_SLOT_PAYLOAD);
const LINE: usize = 128;
/// 4: the consumer frees slots by `dequeue` alone (a producer of version 3
/// would wait for a `seq` it no longer writes), and a slot's `seq` is
/// stored as it is (nobody reads it before a message is published, so
/// zero memory is empty without the offset); 3: the header names the
/// consumer's doorbell (`bell_*`); 2: slot
/// sequence numbers are stored less the slot index (zero memory is an empty
/// ring); 1 stored them as they are.
const RING_VERSION: u32 = 4;

/// `Header::bell`: the consumer does not poll the ring now; a producer
/// rings the doorbell after each push.
pub const BELL_COLD: u64 = 1 << 63;
/// `Header::bell`: the low 32 bits name the ring's bit on the doorbell.
pub const BELL_VALID: u64 = 1 << 62;

/// The first bytes of the mapping: what the ring is and who owns it.
#[repr(C, align(128))]
pub struct Header {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub slot_bytes: AtomicU32,
    pub capacity: AtomicU32,
    /// Process that created the ring and is its only consumer.
    pub owner_pid: AtomicU32,
    /// Random per creation: a reader that cached a ring can tell it was
    /// re-created.
    pub generation: AtomicU64,
    /// The owner's pid namespace (inode of /proc/self/ns/pid): its pid only
    /// means something to processes in the same namespace.
    pub pid_ns: AtomicU64,
    /// Whose doorbell wakes the consumer (endpoint id; 0: none) ...
    pub bell_owner: AtomicU64,
    /// ... and which of its shards (set before anyone opens the ring).
    pub bell_shard: AtomicU32,
    _pad: u32,
    /// `BELL_COLD | BELL_VALID | bit`, written by the consumer (see
    /// `shm/bell.rs`); read by producers after each push.
    pub bell: AtomicU64,
}

#[repr(C, align(128))]
struct Cursor(AtomicU64);

/// The three lines before the slots.
#[repr(C)]
struct Top {
    header: Header,
    enqueue: Cursor,
    dequeue: Cursor,
}

#[repr(C)]
struct Slot {
    seq: AtomicU64,
    len: AtomicU32,
    _pad: u32,
    /// Written by the producer that won the slot, read by the consumer
    /// once the slot's seq says so (a model checks that no access races).
    data: UnsafeCell<[u8; SLOT_PAYLOAD]>,
}

// The layout other processes see (a model's atomics are larger).
#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Slot>() == SLOT_BYTES);
#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Header>() == LINE);
#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Top>() == 3 * LINE);

/// Asks for the slot's second cache line while its first (the `seq`) is
/// looked at: a message of a header and a few inline bytes spans both,
/// and without this the second is fetched only once the `seq` was seen,
/// one more transfer from the producer's core, in series. While no message
/// comes it hits the consumer's own cache (a cycle).
#[inline]
fn prefetch_second_line(slot: *const Slot) {
    // In bounds: a slot is SLOT_BYTES (256) long.
    crate::sync::prefetch_read((slot as *const u8).wrapping_add(64));
}

/// Bytes a ring of `capacity` slots occupies.
pub const fn ring_bytes(capacity: usize) -> usize {
    3 * LINE + capacity * SLOT_BYTES
}

/// What went wrong with a ring's memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RingError {
    Full,
    TooLong { len: usize, max: usize },
}

/// A view of a ring in memory this value does not own.
pub struct Ring {
    top: *const Top,
    /// `capacity` slots.
    slots: *mut Slot,
    capacity: u64,
    /// This process's last look at `dequeue`: positions below it are free.
    /// Never ahead of the real one (only loaded values are stored), so
    /// stale means "fuller than it is" and costs a fresh look, no more.
    head_seen: AtomicU64,
}

// SAFETY: every access to the shared memory goes through atomics or through
// slot payloads handed between threads by the seq protocol.
unsafe impl Send for Ring {}
// SAFETY: as above; producers on several threads is the design.
unsafe impl Sync for Ring {}

impl Ring {
    /// Lays out a fresh ring in `base`. Only the header is written: the
    /// slots' zero bytes already mean "empty" (see `seq`), so a ring's
    /// pages become resident only as messages reach them and an idle
    /// connection's rings cost a page each.
    ///
    /// # Safety
    /// `base` must be 128-byte aligned, valid for `ring_bytes(capacity)`
    /// bytes, zeroed (fresh shared memory is), and not in use by anyone else
    /// yet. `capacity` is a power of two, at least 2 (Vyukov's scheme, which
    /// this was, could not tell "full" from "free" in one slot; the loom
    /// model caught a second producer overwriting the first's message).
    pub unsafe fn init(
        base: *mut u8,
        capacity: usize,
        owner_pid: u32,
        pid_ns: u64,
        generation: u64,
    ) -> Ring {
        assert!(
            capacity.is_power_of_two() && capacity >= 2,
            "{capacity} slots"
        );
        // SAFETY: the caller's contract covers the three lines and the slots.
        let r = unsafe { Ring::at(base, capacity as u64) };
        r.lay_out(owner_pid, pid_ns, generation);
        r
    }

    /// The view of `capacity` slots at `base`.
    ///
    /// # Safety
    /// `base` is 128-byte aligned and valid for `ring_bytes(capacity)`.
    unsafe fn at(base: *mut u8, capacity: u64) -> Ring {
        Ring {
            top: base as *const Top,
            // SAFETY: the slots follow the three lines, inside the range.
            slots: unsafe { base.add(std::mem::size_of::<Top>()) } as *mut Slot,
            capacity,
            head_seen: AtomicU64::new(0),
        }
    }

    /// Writes the header of a fresh ring, magic last.
    fn lay_out(&self, owner_pid: u32, pid_ns: u64, generation: u64) {
        let h = self.header();
        h.version.store(RING_VERSION, Ordering::Relaxed);
        h.slot_bytes.store(SLOT_BYTES as u32, Ordering::Relaxed);
        h.capacity.store(self.capacity as u32, Ordering::Relaxed);
        h.owner_pid.store(owner_pid, Ordering::Relaxed);
        h.generation.store(generation, Ordering::Relaxed);
        h.pid_ns.store(pid_ns, Ordering::Relaxed);
        self.enqueue().store(0, Ordering::Relaxed);
        self.dequeue().store(0, Ordering::Relaxed);
        // Magic last: a ring is valid only once fully laid out.
        h.magic.store(RING_MAGIC, Ordering::Release);
    }

    /// Views an existing ring, checking its header against `len` bytes.
    ///
    /// # Safety
    /// `base` must be 128-byte aligned and valid for `len` bytes for as long
    /// as the returned value lives.
    pub unsafe fn attach(base: *mut u8, len: usize) -> Result<Ring, DecodeError> {
        let what = "ring header";
        if len < ring_bytes(1) {
            return Err(DecodeError::BadLength {
                what: "ring mapping",
                len,
                expected: "at least a one-slot ring",
            });
        }
        // SAFETY: len covers the header, per the check above.
        let h = unsafe { &*(base as *const Header) };
        if h.magic.load(Ordering::Acquire) != RING_MAGIC {
            return Err(DecodeError::Invalid {
                what,
                reason: "no ring magic (not a ferry ring, or not yet laid out)".into(),
            });
        }
        let (v, sb, cap) = (
            h.version.load(Ordering::Relaxed),
            h.slot_bytes.load(Ordering::Relaxed),
            h.capacity.load(Ordering::Relaxed),
        );
        if v != RING_VERSION
            || sb as usize != SLOT_BYTES
            || !cap.is_power_of_two()
            || cap < 2
            || ring_bytes(cap as usize) > len
        {
            return Err(DecodeError::Invalid {
                what,
                reason: format!("version {v}, slot {sb} B, {cap} slots in a {len}-byte mapping"),
            });
        }
        // SAFETY: the header's capacity fits `len` (checked above).
        Ok(unsafe { Ring::at(base, u64::from(cap)) })
    }

    fn top(&self) -> &Top {
        // SAFETY: `at`'s contract: the three lines are in bounds. All
        // their fields are atomics.
        unsafe { &*self.top }
    }

    pub fn header(&self) -> &Header {
        &self.top().header
    }

    fn enqueue(&self) -> &AtomicU64 {
        &self.top().enqueue.0
    }

    fn dequeue(&self) -> &AtomicU64 {
        &self.top().dequeue.0
    }

    /// The slot for `pos`, as a raw pointer: the fields are reached by
    /// projection (atomics, and the payload's cell).
    fn slot_ptr(&self, pos: u64) -> *mut Slot {
        let i = (pos & (self.capacity - 1)) as usize;
        // SAFETY: i < capacity slots, all in bounds (`at`).
        unsafe { self.slots.add(i) }
    }

    /// The slot's sequence number: `p + 1` for the message at position `p`
    /// last published in it. Never 0 then, so all-zero memory is a ring
    /// whose every slot is empty.
    fn seq(&self, pos: u64) -> &AtomicU64 {
        // SAFETY: a reference to the atomic field alone, inside the mapping.
        unsafe { &*std::ptr::addr_of!((*self.slot_ptr(pos)).seq) }
    }

    fn len_of(&self, pos: u64) -> &AtomicU32 {
        // SAFETY: as for `seq`.
        unsafe { &*std::ptr::addr_of!((*self.slot_ptr(pos)).len) }
    }

    fn slot_data(&self, pos: u64) -> &UnsafeCell<[u8; SLOT_PAYLOAD]> {
        // SAFETY: a reference to the cell only: its bytes may change under
        // it (another process), which a cell allows.
        unsafe { &*std::ptr::addr_of!((*self.slot_ptr(pos)).data) }
    }

    pub fn capacity(&self) -> usize {
        self.capacity as usize
    }

    /// Names the doorbell that wakes this ring's consumer (the consumer
    /// calls it before the ring's name is given to anyone).
    pub fn set_bell_home(&self, owner: u64, shard: u32) {
        let h = self.header();
        h.bell_shard.store(shard, Ordering::Relaxed);
        h.bell_owner.store(owner, Ordering::Release);
    }

    /// The doorbell named in the header: (endpoint id, shard).
    pub fn bell_home(&self) -> Option<(u64, u32)> {
        let h = self.header();
        let owner = h.bell_owner.load(Ordering::Acquire);
        (owner != 0).then(|| (owner, h.bell_shard.load(Ordering::Relaxed)))
    }

    /// Consumer: gives the ring bit `bit` on the doorbell and says whether
    /// it is polled (`cold == false`) or must be rung. Going cold is
    /// ordered before the consumer's next look at the slots (SeqCst), so a
    /// message pushed meanwhile is either seen by that look or rung.
    pub fn set_bell(&self, bit: u32, cold: bool) {
        let v = BELL_VALID | bit as u64 | if cold { BELL_COLD } else { 0 };
        self.header().bell.store(v, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Producer, after a push: the doorbell bit to ring, if the consumer
    /// stopped polling. The fence orders the push before the look at the
    /// flag (the other half of `set_bell`'s ordering).
    pub fn bell_wanted(&self) -> Option<u32> {
        fence(Ordering::SeqCst);
        let v = self.header().bell.load(Ordering::Relaxed);
        (v & (BELL_COLD | BELL_VALID) == BELL_COLD | BELL_VALID).then_some(v as u32)
    }

    /// Appends one message; `Err(Full)` hands back nothing was written.
    pub fn push(&self, msg: &[u8]) -> Result<(), RingError> {
        if msg.len() > SLOT_PAYLOAD {
            return Err(RingError::TooLong {
                len: msg.len(),
                max: SLOT_PAYLOAD,
            });
        }
        let enq = self.enqueue();
        let mut pos = enq.load(Ordering::Relaxed);
        loop {
            // Acquire (here and below): the consumer's copy out of the slot
            // we are about to fill happened before it advanced `dequeue`,
            // also when another thread of ours made that look.
            if pos.wrapping_sub(self.head_seen.load(Ordering::Acquire)) >= self.capacity {
                let head = self.dequeue().load(Ordering::Acquire);
                self.head_seen.store(head, Ordering::Release);
                // (A `dequeue` past `pos`, which only a hostile consumer
                // writes, wraps to full: its ring, its loss.)
                if pos.wrapping_sub(head) >= self.capacity {
                    let cur = enq.load(Ordering::Relaxed);
                    if cur == pos {
                        return Err(RingError::Full);
                    }
                    // Another producer moved on meanwhile: look again.
                    pos = cur;
                    continue;
                }
            }
            match enq.compare_exchange_weak(pos, pos + 1, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break,
                Err(cur) => pos = cur,
            }
        }
        // SAFETY: winning the CAS for `pos`, with `dequeue` past
        // `pos - capacity` (the last lap's message in this slot was taken),
        // gives this producer the slot until it publishes seq = pos + 1;
        // msg fits the payload.
        unsafe {
            self.slot_data(pos)
                .with_mut(|d| std::ptr::copy_nonoverlapping(msg.as_ptr(), d as *mut u8, msg.len()))
        };
        self.len_of(pos).store(msg.len() as u32, Ordering::Relaxed);
        self.seq(pos).store(pos + 1, Ordering::Release);
        Ok(())
    }

    /// Takes the oldest message into `out` (which must hold `SLOT_PAYLOAD`
    /// bytes) and returns its length. Only the ring's one consumer may call it.
    pub fn pop(&self, out: &mut [u8; SLOT_PAYLOAD]) -> Option<usize> {
        let deq = self.dequeue();
        let pos = deq.load(Ordering::Relaxed);
        prefetch_second_line(self.slot_ptr(pos));
        if self.seq(pos).load(Ordering::Acquire) != pos + 1 {
            return None;
        }
        // A hostile producer can write any length; never read past the slot.
        let len = (self.len_of(pos).load(Ordering::Relaxed) as usize).min(SLOT_PAYLOAD);
        // SAFETY: seq == pos + 1 (Acquire) means the producer finished
        // writing; the slot is ours until `dequeue` passes it.
        unsafe {
            self.slot_data(pos)
                .with(|d| std::ptr::copy_nonoverlapping(d as *const u8, out.as_mut_ptr(), len))
        };
        // Release: the copy above happens before a producer refills it.
        deq.store(pos + 1, Ordering::Release);
        Some(len)
    }

    /// Messages published and not yet taken (approximate under concurrency).
    pub fn len(&self) -> usize {
        let e = self.enqueue().load(Ordering::Relaxed);
        let d = self.dequeue().load(Ordering::Relaxed);
        e.saturating_sub(d) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::{alloc_zeroed, dealloc, Layout};
    use std::sync::Arc;

    struct Heap {
        ptr: *mut u8,
        layout: Layout,
    }
    // SAFETY: test-only owner of a heap block shared through Ring's atomics.
    unsafe impl Send for Heap {}
    // SAFETY: as above.
    unsafe impl Sync for Heap {}
    impl Drop for Heap {
        fn drop(&mut self) {
            // SAFETY: allocated with this layout in `heap_ring`.
            unsafe { dealloc(self.ptr, self.layout) }
        }
    }

    fn heap_ring(cap: usize) -> (Arc<Heap>, Ring) {
        let layout = Layout::from_size_align(ring_bytes(cap), 128).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        // SAFETY: fresh, aligned, large enough.
        let r = unsafe { Ring::init(ptr, cap, 1, 0, 2) };
        (Arc::new(Heap { ptr, layout }), r)
    }

    #[test]
    fn fifo_full_and_wrap() {
        let (_h, r) = heap_ring(4);
        let mut out = [0u8; SLOT_PAYLOAD];
        assert!(r.pop(&mut out).is_none());
        for round in 0..5u8 {
            for i in 0..4u8 {
                r.push(&[round, i, 9]).unwrap();
            }
            assert_eq!(r.push(&[0]), Err(RingError::Full));
            assert_eq!(r.len(), 4);
            for i in 0..4u8 {
                assert_eq!(r.pop(&mut out), Some(3));
                assert_eq!(&out[..3], &[round, i, 9]);
            }
        }
        assert_eq!(r.len(), 0);
        assert!(matches!(
            r.push(&[0; SLOT_PAYLOAD + 1]),
            Err(RingError::TooLong { .. })
        ));
    }

    /// The producer finds room by `dequeue`, which the consumer's process
    /// can scribble on: past `enqueue` reads as full (no slot of an unread
    /// message is overwritten, nothing is written out of bounds); a
    /// consumer that takes messages makes room again after a full look.
    #[test]
    fn room_comes_from_dequeue_and_a_scribbled_one_is_full() {
        let (_h, r) = heap_ring(4);
        let mut out = [0u8; SLOT_PAYLOAD];
        for i in 0..4u8 {
            r.push(&[i]).unwrap();
        }
        assert_eq!(r.push(&[9]), Err(RingError::Full));
        assert_eq!(r.pop(&mut out), Some(1));
        assert_eq!(out[0], 0);
        // The cached head said full; the fresh look finds one slot.
        r.push(&[4]).unwrap();
        assert_eq!(r.push(&[9]), Err(RingError::Full));
        r.dequeue().store(u64::MAX / 2, Ordering::Relaxed);
        assert_eq!(r.push(&[9]), Err(RingError::Full));
        r.dequeue().store(1, Ordering::Relaxed);
        for want in 1..=4u8 {
            assert_eq!(r.pop(&mut out), Some(1));
            assert_eq!(out[0], want);
        }
        assert!(r.pop(&mut out).is_none());
    }

    #[test]
    fn attach_checks_the_header() {
        let (h, r) = heap_ring(8);
        // SAFETY: the heap block is alive and ring_bytes(8) long.
        let again = unsafe { Ring::attach(h.ptr, ring_bytes(8)) }.unwrap();
        r.push(b"hi").unwrap();
        let mut out = [0u8; SLOT_PAYLOAD];
        assert_eq!(again.pop(&mut out), Some(2));
        // SAFETY: as above; a short length must be refused.
        assert!(unsafe { Ring::attach(h.ptr, ring_bytes(4)) }.is_err());
        // A one-slot ring (a peer's header may say so) would let two
        // producers share a slot.
        r.header().capacity.store(1, Ordering::Relaxed);
        // SAFETY: as above.
        assert!(unsafe { Ring::attach(h.ptr, ring_bytes(8)) }.is_err());
        r.header().capacity.store(8, Ordering::Relaxed);
        r.header().magic.store(0, Ordering::Relaxed);
        // SAFETY: as above.
        assert!(unsafe { Ring::attach(h.ptr, ring_bytes(8)) }.is_err());
    }

    #[test]
    fn many_producers_one_consumer_lose_nothing() {
        let (h, r) = heap_ring(16);
        let r = Arc::new(r);
        let producers = 4;
        let per = if cfg!(miri) { 50 } else { 20_000 };
        let hs: Vec<_> = (0..producers)
            .map(|p| {
                let (r, _h) = (r.clone(), h.clone());
                std::thread::spawn(move || {
                    for i in 0..per as u32 {
                        let mut m = [0u8; 8];
                        m[..4].copy_from_slice(&(p as u32).to_le_bytes());
                        m[4..].copy_from_slice(&i.to_le_bytes());
                        while r.push(&m).is_err() {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        let mut next = vec![0u32; producers];
        let mut out = [0u8; SLOT_PAYLOAD];
        let mut got = 0;
        while got < producers * per {
            if let Some(n) = r.pop(&mut out) {
                assert_eq!(n, 8);
                let p = u32::from_le_bytes(out[..4].try_into().unwrap()) as usize;
                let i = u32::from_le_bytes(out[4..8].try_into().unwrap());
                assert_eq!(i, next[p], "producer {p}'s messages stay in order");
                next[p] += 1;
                got += 1;
            } else {
                std::thread::yield_now();
            }
        }
        for t in hs {
            t.join().unwrap();
        }
        assert_eq!(r.len(), 0);
    }
}

/// Heap storage for a ring built from a model's atomics (which cannot be
/// laid over raw memory): the models run the real `push`/`pop` on it.
#[cfg(all(test, loom))]
pub(crate) mod model {
    use super::*;

    impl Header {
        pub(crate) fn for_model() -> Header {
            Header {
                magic: AtomicU64::new(0),
                version: AtomicU32::new(0),
                slot_bytes: AtomicU32::new(0),
                capacity: AtomicU32::new(0),
                owner_pid: AtomicU32::new(0),
                generation: AtomicU64::new(0),
                pid_ns: AtomicU64::new(0),
                bell_owner: AtomicU64::new(0),
                bell_shard: AtomicU32::new(0),
                _pad: 0,
                bell: AtomicU64::new(0),
            }
        }
    }

    pub(crate) struct ModelRing {
        _top: Box<Top>,
        _slots: Box<[Slot]>,
        pub ring: Ring,
    }

    // SAFETY: the ring is Sync (its protocol hands slots between threads);
    // the boxes are only its storage, touched through it.
    unsafe impl Sync for ModelRing {}

    impl ModelRing {
        pub(crate) fn new(capacity: usize) -> ModelRing {
            let top = Box::new(Top {
                header: Header::for_model(),
                enqueue: Cursor(AtomicU64::new(0)),
                dequeue: Cursor(AtomicU64::new(0)),
            });
            let mut slots: Box<[Slot]> = (0..capacity)
                .map(|_| Slot {
                    seq: AtomicU64::new(0),
                    len: AtomicU32::new(0),
                    _pad: 0,
                    data: UnsafeCell::new([0; SLOT_PAYLOAD]),
                })
                .collect();
            let ring = Ring {
                top: &*top,
                slots: slots.as_mut_ptr(),
                capacity: capacity as u64,
                head_seen: AtomicU64::new(0),
            };
            ring.lay_out(1, 0, 2);
            ModelRing {
                _top: top,
                _slots: slots,
                ring,
            }
        }
    }
}

#[cfg(all(test, loom))]
mod loom_models {
    use super::model::ModelRing;
    use super::*;
    use std::sync::Arc;

    fn take(r: &Ring, got: &mut Vec<[u8; 3]>) -> bool {
        let mut out = [0u8; SLOT_PAYLOAD];
        let Some(n) = r.pop(&mut out) else {
            return false;
        };
        assert_eq!(n, 3);
        got.push(out[..3].try_into().unwrap());
        true
    }

    /// Two producers (two messages and one) and the consumer on a ring of
    /// two slots: every message arrives once and whole, each producer's in
    /// its order; a full ring refuses instead of overwriting, and a slot is
    /// reused after a lap.
    #[test]
    fn loom_two_producers_one_consumer() {
        loom::model(|| {
            let r = Arc::new(ModelRing::new(2));
            let producers: Vec<_> = [2u8, 1]
                .into_iter()
                .enumerate()
                .map(|(p, n)| {
                    let r = r.clone();
                    loom::thread::spawn(move || {
                        let mut sent = Vec::new();
                        for i in 0..n {
                            // A full ring is back-pressure: one retry, later.
                            let msg = [p as u8, i, (p as u8 * 16 + i) ^ 0x5A];
                            if r.ring.push(&msg).is_ok()
                                || (crate::sync::model_yield(), r.ring.push(&msg)).1.is_ok()
                            {
                                sent.push(i);
                            }
                        }
                        sent
                    })
                })
                .collect();
            let mut got = Vec::new();
            take(&r.ring, &mut got);
            let sent: Vec<Vec<u8>> = producers.into_iter().map(|h| h.join().unwrap()).collect();
            while take(&r.ring, &mut got) {}
            for m in &got {
                assert_eq!(m[2], (m[0] * 16 + m[1]) ^ 0x5A, "a torn message: {m:?}");
            }
            for (p, sent) in sent.iter().enumerate() {
                let mine: Vec<u8> = got
                    .iter()
                    .filter(|m| usize::from(m[0]) == p)
                    .map(|m| m[1])
                    .collect();
                assert_eq!(&mine, sent, "producer {p}: lost, repeated or reordered");
            }
        });
    }
}

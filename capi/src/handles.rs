//! The handles the C face gives out (`ferry_endpoint *`, `ferry_region *`,
//! `ferry_transfer *`, `ferry_message *`, `ferry_config *`): not addresses
//! but generation-checked slot numbers, so a handle released twice, used
//! after its release, or never given out is `FERRY_ERR_INVALID` instead of
//! a read of freed memory.
//!
//! A handle's value is `(generation << 32) | (slot + 1)` (never NULL). A
//! slot's generation moves on when its handle is released, so an old value
//! no longer matches; slots live in chunks that are never freed, so looking
//! one up is always a read of live memory. A lookup is two atomic loads
//! and a compare; taking and giving back a slot is a lock-free stack (its head
//! tagged against ABA). What this cannot catch is a handle used on one
//! thread while another releases it (the release may free what the use is
//! reading): that stays the caller's contract, as for any C handle.

use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};

const CHUNK_SLOTS: usize = 1024;
const MAX_CHUNKS: usize = 4096;
/// Live handles of one kind at most (4 Mi).
const MAX_SLOTS: usize = CHUNK_SLOTS * MAX_CHUNKS;

struct Slot<T> {
    /// The generation a live handle of this slot carries.
    gen: AtomicU32,
    /// The value while the slot is live; null while free.
    value: AtomicPtr<T>,
    /// The next free slot + 1 (0: none) while this one is on the free stack.
    next_free: AtomicU32,
}

/// The slots of one kind of handle.
pub(crate) struct Table<T> {
    chunks: [AtomicPtr<Slot<T>>; MAX_CHUNKS],
    /// Slots ever handed out (the ones below are in chunks that exist).
    used: AtomicU32,
    /// The free stack's head: (tag << 32) | (slot + 1); 0 in the low half:
    /// empty.
    free: AtomicU64,
}

impl<T> Table<T> {
    pub(crate) const fn new() -> Self {
        Table {
            chunks: [const { AtomicPtr::new(null_mut()) }; MAX_CHUNKS],
            used: AtomicU32::new(0),
            free: AtomicU64::new(0),
        }
    }

    fn slot(&self, idx: usize) -> Option<&Slot<T>> {
        let chunk = self.chunks.get(idx / CHUNK_SLOTS)?.load(Ordering::Acquire);
        if chunk.is_null() {
            return None;
        }
        // SAFETY: a non-null chunk points to CHUNK_SLOTS slots that are
        // never freed (leaked on purpose: handles may outlive anything).
        Some(unsafe { &*chunk.add(idx % CHUNK_SLOTS) })
    }

    /// Slot `idx`, its chunk made if it is the first of it.
    fn slot_made(&self, idx: usize) -> &Slot<T> {
        let cell = &self.chunks[idx / CHUNK_SLOTS];
        if cell.load(Ordering::Acquire).is_null() {
            let fresh: Box<[Slot<T>]> = (0..CHUNK_SLOTS)
                .map(|_| Slot {
                    gen: AtomicU32::new(0),
                    value: AtomicPtr::new(null_mut()),
                    next_free: AtomicU32::new(0),
                })
                .collect();
            let p = Box::into_raw(fresh) as *mut Slot<T>;
            if cell
                .compare_exchange(null_mut(), p, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                // Another thread made it first: ours goes.
                // SAFETY: `p` is the box made above, never shared.
                drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, CHUNK_SLOTS)) });
            }
        }
        self.slot(idx).expect("the chunk exists now")
    }

    fn pop_free(&self) -> Option<usize> {
        let mut head = self.free.load(Ordering::Acquire);
        loop {
            let top = head as u32;
            if top == 0 {
                return None;
            }
            let next = self
                .slot(top as usize - 1)?
                .next_free
                .load(Ordering::Relaxed);
            let tag = (head >> 32).wrapping_add(1);
            match self.free.compare_exchange_weak(
                head,
                (tag << 32) | u64::from(next),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(top as usize - 1),
                Err(now) => head = now,
            }
        }
    }

    fn push_free(&self, idx: usize, slot: &Slot<T>) {
        let mut head = self.free.load(Ordering::Acquire);
        loop {
            slot.next_free.store(head as u32, Ordering::Relaxed);
            let tag = (head >> 32).wrapping_add(1);
            match self.free.compare_exchange_weak(
                head,
                (tag << 32) | (idx as u64 + 1),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }

    /// Takes a slot for `value`; its handle, or `None` when `MAX_SLOTS`
    /// are live.
    pub(crate) fn insert(&self, value: T) -> Option<*mut T> {
        let idx = match self.pop_free() {
            Some(i) => i,
            None => {
                let i = self.used.fetch_add(1, Ordering::AcqRel) as usize;
                if i >= MAX_SLOTS {
                    self.used.fetch_sub(1, Ordering::AcqRel);
                    return None;
                }
                i
            }
        };
        let slot = self.slot_made(idx);
        slot.value
            .store(Box::into_raw(Box::new(value)), Ordering::Release);
        let gen = slot.gen.load(Ordering::Acquire);
        Some(((u64::from(gen) << 32) | (idx as u64 + 1)) as usize as *mut T)
    }

    fn decode(&self, h: *const T) -> Option<(usize, &Slot<T>, u32)> {
        let v = h as usize as u64;
        let idx = (v as u32).checked_sub(1)? as usize;
        Some((idx, self.slot(idx)?, (v >> 32) as u32))
    }

    /// The value of a live handle; `None` for a released, foreign or
    /// made-up one.
    pub(crate) fn get(&self, h: *const T) -> Option<&T> {
        let (_, slot, gen) = self.decode(h)?;
        if slot.gen.load(Ordering::Acquire) != gen {
            return None;
        }
        let p = slot.value.load(Ordering::Acquire);
        // SAFETY: the generation matched, so `p` is the live box of this
        // handle (null: being given out or back). It stays alive until the
        // handle is released, which the caller does not do meanwhile.
        unsafe { p.as_ref() }
    }

    /// Ends a live handle and hands back its value; `None` (nothing done)
    /// for one already released, foreign or made up.
    pub(crate) fn remove(&self, h: *const T) -> Option<Box<T>> {
        let (idx, slot, gen) = self.decode(h)?;
        slot.gen
            .compare_exchange(
                gen,
                gen.wrapping_add(1),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .ok()?;
        let p = slot.value.swap(null_mut(), Ordering::AcqRel);
        self.push_free(idx, slot);
        // SAFETY: `p` was made by `Box::into_raw` in `insert`; winning the
        // generation's compare-exchange makes this the one release of it.
        (!p.is_null()).then(|| unsafe { Box::from_raw(p) })
    }
}

/// A kind of handle and its table.
pub(crate) trait Handled: Sized + Send + Sync + 'static {
    fn table() -> &'static Table<Self>;
}

macro_rules! handled {
    ($($t:ty => $table:ident),* $(,)?) => {$(
        static $table: Table<$t> = Table::new();
        impl Handled for $t {
            fn table() -> &'static Table<$t> {
                &$table
            }
        }
    )*};
}

handled!(
    crate::endpoint::ferry_config => CONFIGS,
    crate::endpoint::ferry_endpoint => ENDPOINTS,
    crate::endpoint::ferry_region => REGIONS,
    crate::msg::ferry_message => MESSAGES,
    crate::prepared::ferry_prepared => PREPARED,
    crate::xfer::ferry_transfer => TRANSFERS,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_twice_foreign_or_made_up_handles_are_refused() {
        let t: Table<String> = Table::new();
        let a = t.insert("a".into()).unwrap();
        assert_eq!(t.get(a).unwrap(), "a");
        assert_eq!(*t.remove(a).unwrap(), "a");
        assert!(t.get(a).is_none(), "used after release");
        assert!(t.remove(a).is_none(), "released twice");
        // The slot is reused under a new generation: the old handle stays dead.
        let b = t.insert("b".into()).unwrap();
        assert_ne!(a, b);
        assert!(t.get(a).is_none());
        assert_eq!(t.get(b).unwrap(), "b");
        for made_up in [1usize, 0xdead_beef, usize::MAX, 8 << 32 | 5] {
            assert!(t.get(made_up as *const String).is_none());
            assert!(t.remove(made_up as *const String).is_none());
        }
        assert!(t.get(std::ptr::null()).is_none());
    }

    #[test]
    fn threads_take_and_give_back_slots_without_losing_any() {
        let t: &'static Table<u64> = Box::leak(Box::new(Table::new()));
        let threads: Vec<_> = (0..4)
            .map(|k| {
                std::thread::spawn(move || {
                    for i in 0..20_000u64 {
                        let h = t.insert(k * 1_000_000 + i).unwrap();
                        assert_eq!(*t.get(h).unwrap(), k * 1_000_000 + i);
                        assert_eq!(*t.remove(h).unwrap(), k * 1_000_000 + i);
                    }
                })
            })
            .collect();
        for th in threads {
            th.join().unwrap();
        }
        // Every slot went back: at most one per thread was ever made.
        assert!(t.used.load(Ordering::Relaxed) <= 4 + 4);
    }
}

//! Eager messages into a bounce buffer the receiver owns (`CtlMsg::Grant`,
//! `Landed`, `Released`; `wire::msg`): the slots each side keeps and what
//! a receiver does with a message that landed, apart from the I/O
//! (`landing.rs`).
//!
//! Why: a receiver that posts each receive only once the last one ended
//! (UCCL's benchmark, any request/response loop) makes every message wait
//! for its offer's trip to the sender and the sender's pickup. With a
//! grant, a sender WRITEs a message that fits a slot at once (`Landed`
//! rides on the WRITE), and the receiver copies it out of the slot when
//! the receive for its number is posted: the offer's trip leaves the
//! chain. Same-host peers only, where a slot's WRITE is one copy: host
//! memory past the inline eager bound (slots of the receiver's memfd
//! memory, `FERRY_MSG_BOUNCE_SLOTS`) and GPU memory (slots of the
//! receive's GPU, `FERRY_MSG_BOUNCE_GPU_SLOTS`, off by default). Either is
//! a key window: the receiver's shard makes the copy into the slot, so
//! only the receiver's process runs GPU copies for the connection.
//!
//! What a send promises is unchanged: it ends once the receiver said what
//! becomes of the message (its offer showing a buffer the message fills,
//! or its `Ack`), never on the WRITE alone. So a message too long for its
//! buffer fails both sides (`TooLarge`), and one whose buffer is of the
//! other memory kind is sent again the usual way (`Again`).

use std::collections::BTreeMap;

use crate::endpoint::MemoryRegion;
use crate::region::RegionSlice;
use crate::wire::RemoteBuf;

/// A GPU slot: UCCL's small messages (4 KiB to 64 KiB) fit.
pub(super) const GPU_SLOT_BYTES: u32 = 64 << 10;
/// A host slot: past the inline bound (`MAX_EAGER_SAME_HOST`), a slot is
/// a second memcpy, cheap up to here against the offer's round trip.
pub(super) const HOST_SLOT_BYTES: u32 = 16 << 10;
/// Bounce memory of each kind one endpoint grants, all connections
/// together (with the default 16 slots, 64 connections' GPU slots and 256
/// connections' host slots); past it receives are offered as before.
pub(super) const MAX_BOUNCE_BYTES: usize = 64 << 20;

/// What a receiver does with a message of `len` bytes in a slot of kind
/// `slot_device` for a receive of `max` bytes of kind `dest_device` (the
/// sender decides the same from the offer's window, so both sides agree).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Copied in: the receive and the send end well.
    Take,
    /// Longer than the buffer: both fail (`MessageTooLarge`).
    TooLarge,
    /// The buffer is the other kind of memory: the sender sends it again
    /// into the offered buffer (`Again`).
    Again,
}

pub(super) fn verdict(max: u64, dest_device: bool, slot_device: bool, len: usize) -> Verdict {
    if dest_device != slot_device {
        Verdict::Again
    } else if len as u64 > max {
        Verdict::TooLarge
    } else {
        Verdict::Take
    }
}

/// The mask of slots `0..slots` (at most 64: `MAX_BOUNCE_SLOTS`).
fn all(slots: u16) -> u64 {
    if slots >= 64 {
        u64::MAX
    } else {
        (1u64 << slots) - 1
    }
}

/// The sender's side: the receiver's grant and which slots are free.
pub(super) struct Granted {
    window: RemoteBuf,
    slots: u16,
    slot_bytes: u32,
    /// Bit k: slot k is free (not written since the receiver released it).
    free: u64,
    device: bool,
}

impl Granted {
    /// A grant as decoded (`CtlMsg::decode` checked that its slots fit its
    /// window and number at most 64).
    pub(super) fn new(slots: u16, slot_bytes: u32, window: RemoteBuf) -> Granted {
        let device = window.is_device();
        Granted {
            window,
            slots,
            slot_bytes,
            free: all(slots),
            device,
        }
    }

    /// Whether the slots are GPU memory.
    pub(super) fn device(&self) -> bool {
        self.device
    }

    /// Whether a message of `len` bytes of this kind of memory goes into a
    /// slot (an empty one goes the usual way: it moves nothing).
    pub(super) fn fits(&self, len: usize, device: bool) -> bool {
        len > 0 && len <= self.slot_bytes as usize && device == self.device
    }

    /// A free slot, taken, and its window.
    pub(super) fn take(&mut self) -> Option<(u16, RemoteBuf)> {
        let k = self.free.trailing_zeros();
        if k >= u32::from(self.slots) {
            return None;
        }
        let w = (self.window).slice(k * self.slot_bytes, self.slot_bytes)?;
        self.free &= !(1u64 << k);
        Some((k as u16, w))
    }

    /// Slot `slot` may be written again; `false` if it was not taken (a
    /// claim of the peer's that changes nothing).
    pub(super) fn release(&mut self, slot: u16) -> bool {
        if slot >= self.slots || self.free & (1u64 << slot) != 0 {
            return false;
        }
        self.free |= 1u64 << slot;
        true
    }
}

/// A message in a slot: where and how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Landing {
    pub(super) slot: u16,
    pub(super) len: u32,
}

/// A sender's claim that a message landed in a slot, refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum BadLanding {
    #[error("{len} bytes in slot {slot}, past the grant of {slots} slots of {slot_bytes} bytes")]
    Outside {
        slot: u16,
        len: u32,
        slots: u16,
        slot_bytes: u32,
    },
    #[error("slot {slot} still holds a message")]
    Busy { slot: u16 },
}

/// Which of a receiver's slots hold a message, and the checks on a
/// sender's claim that one landed.
#[derive(Debug)]
pub(super) struct SlotUse {
    slots: u16,
    slot_bytes: u32,
    /// Bit k: slot k holds a message not yet released.
    busy: u64,
}

impl SlotUse {
    pub(super) fn new(slots: u16, slot_bytes: u32) -> SlotUse {
        SlotUse {
            slots: slots.min(64),
            slot_bytes,
            busy: 0,
        }
    }

    /// The peer says `len` bytes landed in `slot`: checked (a slot we
    /// granted, not holding a message, `len` within it) and marked busy.
    pub(super) fn land(&mut self, slot: u16, len: u32) -> Result<Landing, BadLanding> {
        if slot >= self.slots || len > self.slot_bytes {
            let (slots, slot_bytes) = (self.slots, self.slot_bytes);
            return Err(BadLanding::Outside {
                slot,
                len,
                slots,
                slot_bytes,
            });
        }
        if self.busy & (1u64 << slot) != 0 {
            return Err(BadLanding::Busy { slot });
        }
        self.busy |= 1u64 << slot;
        Ok(Landing { slot, len })
    }

    /// Slot `slot` is free again.
    pub(super) fn release(&mut self, slot: u16) {
        if slot < self.slots {
            self.busy &= !(1u64 << slot);
        }
    }

    /// Where landing `l`'s bytes start in the bounce memory.
    fn offset(&self, l: Landing) -> usize {
        l.slot as usize * self.slot_bytes as usize
    }
}

/// The receiver's side: its bounce memory for one connection, the slots
/// holding messages, and those that came before their receive.
pub(super) struct Bounce {
    /// The slots' memory (a host slot's window is scoped to the
    /// connection: it goes with it).
    mr: MemoryRegion,
    pub(super) slots: SlotUse,
    /// Messages that landed before their receive was posted, by number
    /// (at most one per slot: bounded by the grant).
    pub(super) held: BTreeMap<u64, Landing>,
}

impl Bounce {
    pub(super) fn new(mr: MemoryRegion, slots: u16, slot_bytes: u32) -> Bounce {
        assert!(
            mr.len() >= slots as usize * slot_bytes as usize,
            "the slots fit the memory"
        );
        Bounce {
            mr,
            slots: SlotUse::new(slots, slot_bytes),
            held: BTreeMap::new(),
        }
    }

    pub(super) fn device(&self) -> bool {
        self.mr.inner.mem.is_device()
    }

    /// The memory it holds.
    pub(super) fn bytes(&self) -> usize {
        self.mr.len()
    }

    /// The bytes of landing `l` (checked by `SlotUse::land`), as a slice
    /// of the bounce memory.
    pub(super) fn slice(&self, l: Landing) -> RegionSlice {
        (self.mr)
            .slice(self.slots.offset(l), l.len as usize)
            .expect("a landing lies in its slot (land)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_window(device: bool) -> RemoteBuf {
        let mut r = RemoteBuf {
            addr: 0x10_0000,
            size: 4 * 1024,
            rkey: 9,
            ..Default::default()
        };
        if device {
            r.reserved[8] |= crate::wire::REMOTE_FLAG_DEVICE;
        }
        r
    }

    /// A sender takes each slot once until the receiver releases it; the
    /// slot's window is its part of the grant; a release of a slot not
    /// taken, or past the grant, changes nothing.
    #[test]
    fn slots_are_taken_once_until_released() {
        let mut g = Granted::new(4, 1024, key_window(false));
        assert!(!g.device());
        assert!(g.fits(1024, false) && !g.fits(1025, false));
        assert!(!g.fits(0, false), "an empty message goes the usual way");
        assert!(!g.fits(8, true), "GPU memory goes into GPU slots only");
        let mut seen = Vec::new();
        while let Some((k, r)) = g.take() {
            assert_eq!((r.addr, r.size), (0x10_0000 + 1024 * u64::from(k), 1024));
            seen.push(k);
        }
        assert_eq!(seen, [0, 1, 2, 3]);
        assert!(!g.release(4), "past the grant");
        assert!(g.release(2));
        assert!(!g.release(2), "released twice");
        assert_eq!(g.take().map(|(k, _)| k), Some(2));
        assert!(g.take().is_none());
        assert!(Granted::new(1, 8, key_window(true)).device());
    }

    /// Both sides decide alike: the other kind of memory first (sent
    /// again), then the length.
    #[test]
    fn the_verdict_looks_at_the_kind_then_the_length() {
        assert_eq!(verdict(100, true, true, 100), Verdict::Take);
        assert_eq!(verdict(100, true, true, 101), Verdict::TooLarge);
        assert_eq!(verdict(100, false, true, 10), Verdict::Again);
        assert_eq!(verdict(0, false, true, 10), Verdict::Again);
        assert_eq!(verdict(10, false, false, 10), Verdict::Take);
        assert_eq!(verdict(9, false, false, 10), Verdict::TooLarge);
    }

    /// A sender's claim that a message landed is checked against the
    /// grant (slot, length) and the slot's use (one message until it is
    /// released).
    #[test]
    fn a_landing_must_fit_the_grant_and_a_free_slot() {
        let mut u = SlotUse::new(4, 100);
        assert_eq!(u.land(3, 100), Ok(Landing { slot: 3, len: 100 }));
        assert_eq!(u.offset(Landing { slot: 3, len: 1 }), 300);
        assert_eq!(u.land(3, 1), Err(BadLanding::Busy { slot: 3 }));
        assert!(u.land(4, 1).is_err(), "past the slots");
        assert!(u.land(0, 101).is_err(), "past a slot's bytes");
        assert!(u.land(u16::MAX, 0).is_err());
        u.release(3);
        assert!(u.land(3, 0).is_ok(), "free again");
        u.release(60);
        assert_eq!(SlotUse::new(100, 1).slots, 64, "at most 64 slots");
    }
}

//! A shard's counters: written by that shard's thread alone, read by
//! anyone (`Endpoint::metrics` sums the shards).
//!
//! One writer per counter, so an update is a load and a store, not a
//! locked read-modify-write: no shared atomic on the hot path, no line
//! bouncing between shards (each shard's block is its own allocation,
//! aligned to a cache line). A reader sees each counter whole (a relaxed
//! load), though not all of them at one instant.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{Via, DURATION_BOUNDS_NS, FAILURE_KINDS, VIAS};
use crate::error::{FailureKind, OpKind};

/// A counter with one writer.
#[derive(Debug, Default)]
pub(crate) struct Cell(AtomicU64);

impl Cell {
    /// Adds `n` (only the owning shard calls it).
    #[inline]
    pub fn add(&self, n: u64) {
        let v = self.0.load(Ordering::Relaxed);
        self.0.store(v.wrapping_add(n), Ordering::Relaxed);
    }

    /// Sets it (a gauge the owner recomputes).
    #[inline]
    pub fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Ops' durations: a count per bucket (not cumulative) and their sum.
#[derive(Debug, Default)]
pub(crate) struct Histo {
    /// One per bound of `DURATION_BOUNDS_NS`, then the overflow bucket.
    pub buckets: [Cell; DURATION_BOUNDS_NS.len() + 1],
    pub sum_ns: Cell,
}

impl Histo {
    #[inline]
    pub fn observe(&self, d: Duration) {
        let ns = d.as_nanos().min(u64::MAX as u128) as u64;
        let at = DURATION_BOUNDS_NS
            .iter()
            .position(|&b| ns <= b)
            .unwrap_or(DURATION_BOUNDS_NS.len());
        self.buckets[at].add(1);
        self.sum_ns.add(ns);
    }
}

/// The index of an op kind in the counters.
pub(crate) fn op_idx(kind: OpKind) -> u8 {
    match kind {
        OpKind::Write => 0,
        OpKind::Read => 1,
    }
}

/// One shard's counters.
#[derive(Debug, Default)]
#[repr(align(64))]
pub(crate) struct ShardMetrics {
    /// Ops this endpoint started that ended: [op][via][ok, failed].
    pub ops: [[[Cell; 2]; VIAS]; 2],
    /// Their bytes (each part of an op split over shards counts its own).
    pub bytes: [[Cell; VIAS]; 2],
    /// How long they took, from the shard taking them to their outcome.
    pub duration: [Histo; 2],
    /// Failed ops by the kind of their failure.
    pub failures: [Cell; FAILURE_KINDS],
    /// Peers' requests this shard served, by op, path (tcp, shm) and
    /// whether they passed our checks: [op][0 tcp, 1 shm][ok, refused].
    pub served: [[[Cell; 2]; 2]; 2],
    /// The bytes of the ones that passed.
    pub served_bytes: [[Cell; 2]; 2],
    /// Connections this shard dropped, by the kind of their fault.
    pub conn_failures: [Cell; FAILURE_KINDS],
    /// Commands that found no room on their connection and waited.
    pub parked: Cell,
    /// Notifications held back because the peer's shard queue was full.
    pub notes_held: Cell,
    /// Ops reported stalled (in flight past the stall threshold).
    pub stalls: Cell,
    /// Ops in flight on this shard, and the age of its oldest, as of its
    /// last timeout check (µs; 0 when none).
    pub in_flight: Cell,
    pub oldest_us: Cell,
    /// The shard's idle loop: passes that yielded the core, and parks.
    pub yields: Cell,
    pub parks: Cell,
}

impl ShardMetrics {
    /// Counts an op that ended.
    #[inline]
    pub fn op_ended(&self, op: usize, via: Via, err: Option<FailureKind>, took: Duration) {
        self.ops[op][via as usize][err.is_some() as usize].add(1);
        self.duration[op].observe(took);
        if let Some(k) = err {
            self.failures[super::failure_idx(k)].add(1);
        }
    }

    /// Counts a peer's request: `len` bytes when it passed our checks.
    #[inline]
    pub fn served(&self, write: bool, shm: bool, len: Option<u64>) {
        let op = if write { 0 } else { 1 };
        self.served[op][shm as usize][len.is_none() as usize].add(1);
        if let Some(n) = len {
            self.served_bytes[op][shm as usize].add(n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duration_lands_in_the_first_bucket_that_holds_it() {
        let h = Histo::default();
        h.observe(Duration::from_micros(10));
        h.observe(Duration::from_micros(11));
        h.observe(Duration::from_secs(100));
        assert_eq!(h.buckets[0].get(), 1, "10 µs is the first bound");
        assert_eq!(h.buckets[1].get(), 1);
        assert_eq!(
            h.buckets[DURATION_BOUNDS_NS.len()].get(),
            1,
            "past the last"
        );
        assert_eq!(h.sum_ns.get(), 100_000_021_000);
    }
}

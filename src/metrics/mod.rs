//! What an operator scrapes: counts of ops, bytes, failures, connections
//! and the engine's own pressure points, as a snapshot
//! ([`Endpoint::metrics`](crate::Endpoint::metrics)) and as the
//! Prometheus text format ([`render`]), which a service serves from its
//! own HTTP server (the library runs none; `ferry serve --metrics ADDR`
//! does, for the command-line tool).
//!
//! Counted per shard by the shard's thread alone and summed on read
//! (`cells.rs`), so counting costs the hot path a load and a store per
//! counter, with no lock and no shared atomic. What is counted where:
//!
//! * ops this endpoint started, when they end (`ferry_ops_total`,
//!   `ferry_bytes_total{role="initiator"}`, `ferry_op_duration_seconds`,
//!   `ferry_op_failures_total`): by the shard's ledger. An op split over
//!   shards (lanes) counts once, its bytes once in all; ops refused before
//!   any shard took them (a bad range, a full queue) are the call's error
//!   and are not counted;
//! * peers' requests this endpoint served (`ferry_requests_served_total`,
//!   `ferry_bytes_total{role="target"}`): where a shard checks them — tcp
//!   frames and same-host requests. A large tcp op reaches the target as
//!   many frames, so requests are not ops; their bytes are exact. RDMA and
//!   CUDA IPC ops never reach the target's CPU and are not seen there.

mod cells;
mod clock;
mod text;

use std::time::Duration;

pub(crate) use cells::{op_idx, ShardMetrics};
pub(crate) use clock::OpClock;
pub use text::{render, CONTENT_TYPE};

use crate::error::{FailureKind, OpKind};

/// The path an op or request went by (the `transport` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Via {
    /// Kernel TCP.
    Tcp,
    /// RDMA queue pairs (beside a tcp connection).
    Rdma,
    /// Same-host shared-memory rings.
    Shm,
    /// CUDA IPC (the initiator copies GPU memory itself).
    Ipc,
}

pub(crate) const VIAS: usize = 4;
const ALL_VIAS: [Via; VIAS] = [Via::Tcp, Via::Rdma, Via::Shm, Via::Ipc];

impl Via {
    /// The label's value.
    pub fn name(self) -> &'static str {
        match self {
            Via::Tcp => "tcp",
            Via::Rdma => "rdma",
            Via::Shm => "shm",
            Via::Ipc => "ipc",
        }
    }
}

/// The upper bounds of `ferry_op_duration_seconds`' buckets, in ns: from
/// a same-host round trip (~10 µs) to the op timeout's range.
pub const DURATION_BOUNDS_NS: [u64; 16] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    1_000_000_000,
    10_000_000_000,
];

pub(crate) const FAILURE_KINDS: usize = 8;
const ALL_FAILURES: [FailureKind; FAILURE_KINDS] = [
    FailureKind::Invalid,
    FailureKind::Timeout,
    FailureKind::Busy,
    FailureKind::Remote,
    FailureKind::Disconnected,
    FailureKind::PeerTimeout,
    FailureKind::PeerMisbehaved,
    FailureKind::Other,
];

pub(crate) fn failure_idx(k: FailureKind) -> usize {
    ALL_FAILURES
        .iter()
        .position(|&f| f == k)
        .unwrap_or(FAILURE_KINDS - 1)
}

/// The `cause` label of a failure kind.
pub fn failure_name(k: FailureKind) -> &'static str {
    match k {
        FailureKind::Invalid => "invalid",
        FailureKind::Timeout => "timeout",
        FailureKind::Busy => "busy",
        FailureKind::Remote => "remote",
        FailureKind::Disconnected => "disconnected",
        FailureKind::PeerTimeout => "peer_timeout",
        FailureKind::PeerMisbehaved => "peer_misbehaved",
        _ => "other",
    }
}

/// Ops of one kind on one path that this endpoint started and that ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpRow {
    /// WRITE or READ.
    pub op: OpKind,
    /// The path it went by.
    pub via: Via,
    /// Ended well.
    pub ok: u64,
    /// Ended with an error.
    pub failed: u64,
    /// Bytes of these ops (failed ones included: what was asked).
    pub bytes: u64,
}

/// Peers' requests of one kind on one path that this endpoint served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServedRow {
    /// The peer's WRITE (bytes in) or READ (bytes out).
    pub op: OpKind,
    /// tcp or shm.
    pub via: Via,
    /// Passed our checks (key, bounds, access) and were served.
    pub ok: u64,
    /// Refused by them.
    pub refused: u64,
    /// Bytes of the served ones.
    pub bytes: u64,
}

/// Durations of one kind of op: a count per bucket of
/// [`DURATION_BOUNDS_NS`] (not cumulative; the last one past the last
/// bound) and their sum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Histogram {
    /// WRITE or READ.
    pub op: OpKind,
    /// Ops per bucket: `DURATION_BOUNDS_NS.len() + 1` of them.
    pub counts: Vec<u64>,
    /// Their durations summed.
    pub sum_ns: u64,
}

impl Histogram {
    /// Ops observed.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }
}

/// A snapshot of one endpoint's counters (summed over its shards; each
/// counter read whole, not all at one instant).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Metrics {
    /// Every op kind on every path, zeros included.
    pub ops: Vec<OpRow>,
    /// Every op kind on the paths whose requests a shard serves (tcp, shm).
    pub served: Vec<ServedRow>,
    /// Per op kind.
    pub op_duration: Vec<Histogram>,
    /// Failed ops by the kind of their failure.
    pub failures: Vec<(FailureKind, u64)>,
    /// Connections dropped by the shards, by the kind of their fault.
    pub conn_failures: Vec<(FailureKind, u64)>,
    /// Connections open now, by path (tcp with RDMA queue pairs: rdma).
    pub connections: Vec<(Via, u64)>,
    /// Ops in flight (claimed completion slots, not yet reaped).
    pub ops_in_flight: u64,
    /// The age of the oldest op in flight, as of the shards' last timeout
    /// check (at most a second old).
    pub oldest_op_age: Duration,
    /// Ops reported stalled: in flight past `FERRY_STALL_MS`.
    pub stalled_ops: u64,
    /// Live registrations.
    pub registrations: u64,
    /// Registrations the registration cache served from a live one ...
    pub reg_cache_hits: u64,
    /// ... and those it made anew.
    pub reg_cache_misses: u64,
    /// The float codec: bytes of the chunks it packed here and of their
    /// frames (zeros while compression is off) ...
    pub packed_raw_bytes: u64,
    /// ... (their frames' bytes) ...
    pub packed_wire_bytes: u64,
    /// ... and of the peers' packed frames it unpacked here ...
    pub unpacked_raw_bytes: u64,
    /// ... (those frames' bytes).
    pub unpacked_wire_bytes: u64,
    /// CUDA IPC handles opened (cache misses) ...
    pub ipc_opens: u64,
    /// ... and ops that found their mapping open.
    pub ipc_hits: u64,
    /// Two-sided messages sent into a peer's bounce slots ...
    pub bounced_out: u64,
    /// ... and received out of ours (copied into their buffers).
    pub bounced_in: u64,
    /// Commands that found their connection's stream or ring full and
    /// waited (back-pressure from a peer that reads slowly).
    pub parked_commands: u64,
    /// Notifications held back because their shard's queue was full.
    pub held_notifications: u64,
    /// The shards' idle loops: passes that yielded the core ...
    pub shard_yields: u64,
    /// ... and times they parked (slept until woken).
    pub shard_parks: u64,
}

impl Metrics {
    /// Sums the shards' counters; the endpoint fills in the rest.
    pub(crate) fn from_shards<'a>(shards: impl Iterator<Item = &'a ShardMetrics> + Clone) -> Self {
        let sum = |f: &dyn Fn(&ShardMetrics) -> u64| shards.clone().map(f).sum::<u64>();
        let mut m = Metrics::default();
        for (o, op) in [OpKind::Write, OpKind::Read].into_iter().enumerate() {
            for (v, via) in ALL_VIAS.into_iter().enumerate() {
                m.ops.push(OpRow {
                    op,
                    via,
                    ok: sum(&|s| s.ops[o][v][0].get()),
                    failed: sum(&|s| s.ops[o][v][1].get()),
                    bytes: sum(&|s| s.bytes[o][v].get()),
                });
            }
            for (p, via) in [Via::Tcp, Via::Shm].into_iter().enumerate() {
                m.served.push(ServedRow {
                    op,
                    via,
                    ok: sum(&|s| s.served[o][p][0].get()),
                    refused: sum(&|s| s.served[o][p][1].get()),
                    bytes: sum(&|s| s.served_bytes[o][p].get()),
                });
            }
            m.op_duration.push(Histogram {
                op,
                counts: (0..=DURATION_BOUNDS_NS.len())
                    .map(|b| sum(&|s| s.duration[o].buckets[b].get()))
                    .collect(),
                sum_ns: sum(&|s| s.duration[o].sum_ns.get()),
            });
        }
        for (i, k) in ALL_FAILURES.into_iter().enumerate() {
            m.failures.push((k, sum(&|s| s.failures[i].get())));
            m.conn_failures
                .push((k, sum(&|s| s.conn_failures[i].get())));
        }
        m.oldest_op_age =
            Duration::from_micros(shards.clone().map(|s| s.oldest_us.get()).max().unwrap_or(0));
        m.stalled_ops = sum(&|s| s.stalls.get());
        m.parked_commands = sum(&|s| s.parked.get());
        m.held_notifications = sum(&|s| s.notes_held.get());
        m.shard_yields = sum(&|s| s.yields.get());
        m.shard_parks = sum(&|s| s.parks.get());
        m
    }

    /// All paths, each with its count of open connections.
    pub(crate) fn count_connections(&mut self, vias: impl Iterator<Item = Via>) {
        let mut n = [0u64; VIAS];
        for v in vias {
            n[v as usize] += 1;
        }
        self.connections = ALL_VIAS.into_iter().zip(n).collect();
    }
}

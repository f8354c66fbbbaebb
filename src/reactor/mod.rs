//! The per-core shard: one thread's worth of engine.
//!
//! A shard owns a set of connections and runs everything they need in one
//! run-to-completion loop (`Shard::poll`): it applies registration updates,
//! takes submitted operations from its bounded queue, writes queued frames,
//! reads and serves incoming frames, and publishes completions. Nothing in
//! the loop takes a lock or allocates per operation.
//!
//! * **managed** mode: the endpoint starts one thread per shard that polls,
//!   spins when idle (`spin.rs`: polls for `spin_yield_us`, then yields
//!   its core each pass up to `spin_us`; parks at once for a while after
//!   it finds its core shared), then parks in `epoll_wait`
//!   until a socket, a doorbell or a submitter (through an eventfd
//!   `Waker`) wakes it;
//! * **embedded** mode: the caller owns each `Shard` and calls `poll()` (or
//!   `poll_or_park()`, the managed loop's step) from its own loop; the
//!   engine starts no shard thread (only the codec threads, once a tcp
//!   chunk is packed or unpacked: `codec_pool.rs`; `FERRY_COMPRESS=off`
//!   for none).

mod backlog;
mod cmd_ring;
pub(crate) mod codec_pool;
mod codec_side;
pub(crate) mod completion;
pub(crate) mod copy_pool;
mod gpu;
mod ledger;
#[cfg(test)]
mod local_pair;
mod local_side;
mod plan;
mod queue;
mod routes;
mod shard;
pub(crate) mod signal;
mod source;
mod spin;
mod tcp_side;
mod timers;

pub use codec_pool::CompressStats;
pub use completion::Transfer;
pub(crate) use queue::{
    Command, IpcCmd, IpcDesc, IpcParts, IpcPlan, NoteTicket, OpCmd, OpDesc, OpParts, PlannedPiece,
    RegionCmd, ShardHandle, MAX_BATCH,
};
pub(crate) use shard::{LocalInit, LocalSetup, ShardConfig};
pub use shard::{Shard, SpinStats};
pub(crate) use source::Inboxes;

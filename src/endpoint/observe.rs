//! What an operator sees of an endpoint: its metrics, summed over the
//! shards' counters and the control side's tables.

use super::{Endpoint, Peer};
use crate::metrics::{Metrics, Via};

/// # Metrics
///
/// Counts an operator scrapes (see [`crate::metrics`]).
impl Endpoint {
    /// A snapshot of the endpoint's counters: ops, bytes, durations and
    /// failures, peers' requests served, connections, registrations, the
    /// caches, back-pressure and the shards' idle loops. Sums each shard's
    /// counters (no lock on their side); takes the connection table's lock
    /// once.
    pub fn metrics(&self) -> Metrics {
        let inner = &self.inner;
        let shards = inner.shards.shards.iter().map(|h| &*h.metrics);
        let mut m = Metrics::from_shards(shards);
        inner.reap_closed();
        {
            let live = inner.conns.live.lock().expect("lock");
            m.count_connections(live.values().map(|c| match (c.peer, c.verbs) {
                (Peer::Local { .. }, _) => Via::Shm,
                (Peer::Net(_), true) => Via::Rdma,
                (Peer::Net(_), false) => Via::Tcp,
            }));
        }
        m.ops_in_flight = inner.shards.table.in_use() as u64;
        m.registrations = self.registration_count() as u64;
        let cache = self.reg_cache_stats();
        (m.reg_cache_hits, m.reg_cache_misses) = (cache.hits, cache.misses);
        let c = self.compress_stats().unwrap_or_default();
        (m.packed_raw_bytes, m.packed_wire_bytes) = (c.raw_bytes, c.wire_bytes);
        (m.unpacked_raw_bytes, m.unpacked_wire_bytes) = (c.unpacked_bytes, c.unpacked_wire_bytes);
        let ipc = self.ipc_stats();
        (m.ipc_opens, m.ipc_hits) = (ipc.opens, ipc.hits);
        (m.bounced_out, m.bounced_in) = self.bounced();
        m
    }

    /// [`Endpoint::metrics`] in the Prometheus text format, for a
    /// service's own `GET /metrics` (content type
    /// [`crate::metrics::CONTENT_TYPE`]).
    pub fn metrics_text(&self) -> String {
        crate::metrics::render(&self.metrics())
    }
}

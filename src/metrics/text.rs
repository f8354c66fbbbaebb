//! The Prometheus text exposition format (version 0.0.4) of a
//! [`Metrics`] snapshot: `# HELP` and `# TYPE` per family, one sample per
//! line, label values from fixed sets (nothing a peer chose is printed).

use std::fmt::Write;

use super::{failure_name, Metrics, DURATION_BOUNDS_NS};
use crate::error::OpKind;

/// The content type of [`render`]'s text, for an HTTP response.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

fn op_name(op: OpKind) -> &'static str {
    match op {
        OpKind::Write => "write",
        OpKind::Read => "read",
    }
}

/// Bytes leave this endpoint's memory on an initiator's WRITE and a
/// target's READ; they enter it otherwise.
fn direction(op: OpKind, initiator: bool) -> &'static str {
    if (op == OpKind::Write) == initiator {
        "out"
    } else {
        "in"
    }
}

struct Out(String);

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                let sep = if i == 0 { "" } else { "," };
                let _ = write!(self.0, "{sep}{k}=\"{v}\"");
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {value}");
    }

    fn gauge(&mut self, name: &str, help: &str, value: impl std::fmt::Display) {
        self.family(name, "gauge", help);
        self.sample(name, &[], value);
    }

    fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.family(name, "counter", help);
        self.sample(name, &[], value);
    }
}

/// `m` in the Prometheus text format, ready to serve as `GET /metrics`
/// (with [`CONTENT_TYPE`]).
pub fn render(m: &Metrics) -> String {
    let mut o = Out(String::with_capacity(8192));
    ops(&mut o, m);
    duration(&mut o, m);
    o.family(
        "ferry_op_failures_total",
        "counter",
        "Ops this endpoint started that failed, by the kind of failure.",
    );
    for &(k, n) in &m.failures {
        o.sample("ferry_op_failures_total", &[("cause", failure_name(k))], n);
    }
    o.family(
        "ferry_connections",
        "gauge",
        "Connections open now, by path.",
    );
    for &(via, n) in &m.connections {
        o.sample(
            "ferry_connections",
            &[("transport", via.name()), ("state", "up")],
            n,
        );
    }
    o.family(
        "ferry_connection_failures_total",
        "counter",
        "Connections dropped by the engine, by the kind of fault.",
    );
    for &(k, n) in &m.conn_failures {
        o.sample(
            "ferry_connection_failures_total",
            &[("cause", failure_name(k))],
            n,
        );
    }
    gauges(&mut o, m);
    o.0
}

fn ops(o: &mut Out, m: &Metrics) {
    o.family(
        "ferry_ops_total",
        "counter",
        "Ops this endpoint started that ended, by outcome.",
    );
    for r in &m.ops {
        for (result, n) in [("ok", r.ok), ("failed", r.failed)] {
            let labels = [
                ("op", op_name(r.op)),
                ("transport", r.via.name()),
                ("result", result),
            ];
            o.sample("ferry_ops_total", &labels, n);
        }
    }
    o.family(
        "ferry_requests_served_total",
        "counter",
        "Peers' requests this endpoint's shards checked, by outcome (a large tcp op is many requests).",
    );
    for r in &m.served {
        for (result, n) in [("ok", r.ok), ("refused", r.refused)] {
            let labels = [
                ("op", op_name(r.op)),
                ("transport", r.via.name()),
                ("result", result),
            ];
            o.sample("ferry_requests_served_total", &labels, n);
        }
    }
    o.family(
        "ferry_bytes_total",
        "counter",
        "Bytes of ops: started here (role initiator) or served for peers (role target); direction is out of or into this endpoint's memory.",
    );
    let started = m.ops.iter().map(|r| (r.op, r.via, r.bytes, true));
    let served = m.served.iter().map(|r| (r.op, r.via, r.bytes, false));
    for (op, via, bytes, initiator) in started.chain(served) {
        let labels = [
            ("op", op_name(op)),
            ("transport", via.name()),
            ("direction", direction(op, initiator)),
            ("role", if initiator { "initiator" } else { "target" }),
        ];
        o.sample("ferry_bytes_total", &labels, bytes);
    }
}

fn duration(o: &mut Out, m: &Metrics) {
    const NAME: &str = "ferry_op_duration_seconds";
    o.family(
        NAME,
        "histogram",
        "How long ops this endpoint started took, from their shard taking them to their outcome.",
    );
    for h in &m.op_duration {
        let op = op_name(h.op);
        let mut cumulative = 0u64;
        for (i, n) in h.counts.iter().enumerate() {
            cumulative += n;
            let le = match DURATION_BOUNDS_NS.get(i) {
                Some(&ns) => format!("{}", ns as f64 / 1e9),
                None => "+Inf".to_string(),
            };
            let bucket = format!("{NAME}_bucket");
            o.sample(&bucket, &[("op", op), ("le", &le)], cumulative);
        }
        o.sample(&format!("{NAME}_sum"), &[("op", op)], h.sum_ns as f64 / 1e9);
        o.sample(&format!("{NAME}_count"), &[("op", op)], cumulative);
    }
}

fn gauges(o: &mut Out, m: &Metrics) {
    o.gauge(
        "ferry_ops_in_flight",
        "Ops in flight (completion slots claimed and not yet reaped).",
        m.ops_in_flight,
    );
    o.gauge(
        "ferry_oldest_op_age_seconds",
        "Age of the oldest op in flight as of the last timeout check (at most a second old).",
        m.oldest_op_age.as_secs_f64(),
    );
    o.counter(
        "ferry_stalled_ops_total",
        "Ops reported in flight past FERRY_STALL_MS.",
        m.stalled_ops,
    );
    o.gauge(
        "ferry_registrations",
        "Live memory registrations.",
        m.registrations,
    );
    let cache = [("hit", m.reg_cache_hits), ("miss", m.reg_cache_misses)];
    o.family(
        "ferry_reg_cache_lookups_total",
        "counter",
        "Registration cache lookups, by result.",
    );
    for (result, n) in cache {
        o.sample("ferry_reg_cache_lookups_total", &[("result", result)], n);
    }
    o.family(
        "ferry_compress_bytes_total",
        "counter",
        "Bytes through the float codec: raw and on the wire, packed here (out) or unpacked here (in).",
    );
    for (dir, form, n) in [
        ("out", "raw", m.packed_raw_bytes),
        ("out", "wire", m.packed_wire_bytes),
        ("in", "raw", m.unpacked_raw_bytes),
        ("in", "wire", m.unpacked_wire_bytes),
    ] {
        let labels = [("direction", dir), ("form", form)];
        o.sample("ferry_compress_bytes_total", &labels, n);
    }
    o.counter(
        "ferry_ipc_handle_opens_total",
        "CUDA IPC handles opened (cache misses).",
        m.ipc_opens,
    );
    o.counter(
        "ferry_ipc_handle_hits_total",
        "CUDA IPC ops that found their mapping open.",
        m.ipc_hits,
    );
    o.family(
        "ferry_messages_bounced_total",
        "counter",
        "Two-sided messages sent eagerly into a same-host receiver's bounce slots (out) or taken out of ours (in).",
    );
    for (dir, n) in [("out", m.bounced_out), ("in", m.bounced_in)] {
        o.sample("ferry_messages_bounced_total", &[("direction", dir)], n);
    }
    o.family(
        "ferry_backpressure_total",
        "counter",
        "Times work waited for room, by queue: a connection's stream or ring (parked), a shard's queue (notification).",
    );
    for (queue, n) in [
        ("parked", m.parked_commands),
        ("notification", m.held_notifications),
    ] {
        o.sample("ferry_backpressure_total", &[("queue", queue)], n);
    }
    o.counter(
        "ferry_shard_yields_total",
        "Idle passes of the shards that yielded the core.",
        m.shard_yields,
    );
    o.counter(
        "ferry_shard_parks_total",
        "Times the shards parked (slept until woken).",
        m.shard_parks,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{Histogram, OpRow, Via};

    #[test]
    fn every_sample_belongs_to_a_family_declared_before_it() {
        let mut m = Metrics::default();
        m.ops.push(OpRow {
            op: OpKind::Write,
            via: Via::Tcp,
            ok: 3,
            failed: 1,
            bytes: 4096,
        });
        let mut counts = vec![0; DURATION_BOUNDS_NS.len() + 1];
        counts[0] = 2;
        counts[3] = 1;
        m.op_duration.push(Histogram {
            op: OpKind::Write,
            counts,
            sum_ns: 1_500_000,
        });
        let text = render(&m);
        let mut declared = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                declared.insert(rest.split(' ').next().unwrap().to_string());
                continue;
            }
            if line.starts_with('#') {
                continue;
            }
            let name = line.split(['{', ' ']).next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| declared.contains(*f)))
                .unwrap_or(name);
            assert!(declared.contains(family), "{line}");
        }
        assert!(
            text.contains("ferry_ops_total{op=\"write\",transport=\"tcp\",result=\"failed\"} 1\n")
        );
        assert!(text.contains(
            "ferry_bytes_total{op=\"write\",transport=\"tcp\",direction=\"out\",role=\"initiator\"} 4096\n"
        ));
        assert!(text.contains("ferry_op_duration_seconds_bucket{op=\"write\",le=\"0.00001\"} 2\n"));
        assert!(text.contains("ferry_op_duration_seconds_bucket{op=\"write\",le=\"0.0001\"} 3\n"));
        assert!(text.contains("ferry_op_duration_seconds_bucket{op=\"write\",le=\"+Inf\"} 3\n"));
        assert!(text.contains("ferry_op_duration_seconds_count{op=\"write\"} 3\n"));
        assert!(text.contains("ferry_op_duration_seconds_sum{op=\"write\"} 0.0015\n"));
    }
}

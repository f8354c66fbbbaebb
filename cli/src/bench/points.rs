//! The measured points: throughput per (size, op), and one-op latency.

use std::io::Write;

use anyhow::Result;
use ferry::OpKind;

use crate::args::fmt_size;
use crate::child::Contenders;

use super::measure::{median, percentile, sorted, Bench};
use super::opts::Opts;
use super::reference::Reference;
use super::report::{op_name, print_row, Row};

/// Every (size, op) point, --rounds times: one row each; returns the
/// chart's series.
pub(super) fn measure_points(
    b: &mut Bench<'_>,
    o: &Opts,
    reference: &mut Option<Reference>,
    transport: &'static str,
    shm: bool,
) -> Result<Vec<crate::plot::Series>> {
    let ref_name = match (o.baseline, o.ipc, shm) {
        _ if o.contend > 0 => "quiet",
        (false, _, _) => "",
        (true, false, _) if o.device_gpu => "host memory",
        (true, true, _) if o.pinned => "pinned H2D",
        (true, true, _) => "peer copy",
        (true, false, false) => "raw tcp",
        (true, false, true) => "memcpy",
    };
    let mut plotted: Vec<crate::plot::Series> = Vec::new();
    let total = o.sizes.len() * o.ops.len();
    let mut i = 0;
    for &size in &o.sizes {
        for &op in &o.ops {
            i += 1;
            let (mut gbps, mut opss, mut lat, mut base, mut ratios) =
                (vec![], vec![], vec![], vec![], vec![]);
            let mut batch = o.batch;
            let mut submit_ns = vec![];
            for r in 0..o.rounds {
                eprintln!(
                    "[{i}/{total}] {} {} round {}/{} ...",
                    op_name(op),
                    fmt_size(size),
                    r + 1,
                    o.rounds
                );
                let quiet = if o.contend > 0 {
                    Some(b.throughput(op, size, o.batch, o.seconds)?.gbps)
                } else {
                    None
                };
                let busy = (o.contend > 0)
                    .then(|| Contenders::start(o.contend))
                    .transpose()?;
                let m = b.throughput(op, size, o.batch, o.seconds)?;
                let (g, ops_per_s, l, b_used) = (m.gbps, m.ops_per_s, m.lat, m.batch);
                submit_ns.extend(m.submit_ns);
                drop(busy);
                if let Some(q) = quiet {
                    base.push(q);
                    ratios.push(g / q);
                }
                batch = b_used;
                gbps.push(g);
                opss.push(ops_per_s);
                lat.extend(l);
                if let Some(Reference::Host(hl, hr)) = reference {
                    // The same path with host buffers, on the same connection.
                    std::mem::swap(&mut b.local, hl);
                    std::mem::swap(&mut b.remote, hr);
                    let host = b.throughput(op, size, o.batch, o.seconds);
                    std::mem::swap(&mut b.local, hl);
                    std::mem::swap(&mut b.remote, hr);
                    let host = host?.gbps;
                    base.push(host);
                    ratios.push(g / host);
                } else if let Some(p) = reference {
                    let raw = p.gbps(op == OpKind::Read, size, b.slots(size), o.seconds)?;
                    base.push(raw);
                    ratios.push(g / raw);
                }
            }
            let lat = sorted(lat);
            let name = |who: &str| format!("{who} {}", op_name(op));
            crate::plot::add_point(&mut plotted, name("ferry"), false, size, median(&gbps));
            if !base.is_empty() {
                crate::plot::add_point(&mut plotted, name(ref_name), true, size, median(&base));
            }
            print_row(
                &Row {
                    transport,
                    op: op_name(op),
                    block: size,
                    batch,
                    gbps: median(&gbps),
                    ops_per_s: median(&opss),
                    p50_us: percentile(&lat, 0.5),
                    p99_us: percentile(&lat, 0.99),
                    p999_us: percentile(&lat, 0.999),
                    baseline_gbps: (!base.is_empty()).then(|| median(&base)),
                    ratio: (!ratios.is_empty()).then(|| median(&ratios)),
                    baseline_p50_us: None,
                    reference: ref_name,
                    baseline_p99_us: None,
                    submit_ns: (!submit_ns.is_empty()).then(|| median(&submit_ns)),
                },
                o.json,
            );
            std::io::stdout().flush()?;
        }
    }
    Ok(plotted)
}

/// Two-sided message round trips of each size (`--op send`), with the
/// one-sided WRITE round trip of the same block as the row's reference.
pub(super) fn measure_messages(b: &mut Bench<'_>, o: &Opts, transport: &'static str) -> Result<()> {
    for &size in &o.sizes {
        let (mut p50, mut p99, mut p999, mut w50, mut w99) =
            (vec![], vec![], vec![], vec![], vec![]);
        for r in 0..o.rounds {
            eprintln!(
                "messages: {} send/recv round trips, round {}/{} ...",
                fmt_size(size),
                r + 1,
                o.rounds
            );
            let keep = std::mem::replace(&mut b.latency_bytes, size);
            let write = b.latency(OpKind::Write, o.seconds);
            b.latency_bytes = keep;
            let write = sorted(write?);
            w50.push(percentile(&write, 0.5));
            w99.push(percentile(&write, 0.99));
            let lat = sorted(b.message_latency(size, o.seconds)?);
            p50.push(percentile(&lat, 0.5));
            p99.push(percentile(&lat, 0.99));
            p999.push(percentile(&lat, 0.999));
        }
        print_row(
            &Row {
                transport,
                op: "send_latency",
                block: size,
                batch: 1,
                gbps: 0.0,
                ops_per_s: 0.0,
                p50_us: median(&p50),
                p99_us: median(&p99),
                p999_us: median(&p999),
                baseline_gbps: None,
                ratio: None,
                baseline_p50_us: Some(median(&w50)),
                reference: "one-sided write",
                baseline_p99_us: Some(median(&w99)),
                submit_ns: None,
            },
            o.json,
        );
    }
    Ok(())
}

/// The one-op round trips (--latency), with the raw TCP ping-pong, the
/// cache-line ping-pong (shm) or the quiet figures beside them.
pub(super) fn measure_latency(
    b: &mut Bench<'_>,
    o: &Opts,
    reference: &mut Option<Reference>,
    transport: &'static str,
) -> Result<()> {
    for &op in &o.ops {
        let (mut p50, mut p99, mut p999, mut b50, mut b99) =
            (vec![], vec![], vec![], vec![], vec![]);
        for r in 0..o.rounds {
            eprintln!(
                "latency: {} {} round trips, round {}/{} ...",
                op_name(op),
                fmt_size(b.latency_bytes),
                r + 1,
                o.rounds
            );
            if o.contend > 0 {
                let quiet = sorted(b.latency(op, o.seconds)?);
                b50.push(percentile(&quiet, 0.5));
                b99.push(percentile(&quiet, 0.99));
            }
            let busy = (o.contend > 0)
                .then(|| Contenders::start(o.contend))
                .transpose()?;
            let lat = sorted(b.latency(op, o.seconds)?);
            drop(busy);
            p50.push(percentile(&lat, 0.5));
            p99.push(percentile(&lat, 0.99));
            p999.push(percentile(&lat, 0.999));
            let base = match reference {
                Some(Reference::Tcp(p)) => Some(p.ping_pong_us(o.seconds)?),
                // (With --contend the quiet figures are the reference.)
                Some(Reference::Memcpy(..)) if o.contend == 0 => {
                    Some(crate::raw::line_ping_pong_us(o.seconds)?)
                }
                _ => None,
            };
            if let Some(base) = base {
                let base = sorted(base);
                b50.push(percentile(&base, 0.5));
                b99.push(percentile(&base, 0.99));
            }
        }
        print_row(
            &Row {
                transport,
                op: if op == OpKind::Write {
                    "write_latency"
                } else {
                    "read_latency"
                },
                block: b.latency_bytes,
                batch: 1,
                gbps: 0.0,
                ops_per_s: 0.0,
                p50_us: median(&p50),
                p99_us: median(&p99),
                p999_us: median(&p999),
                baseline_gbps: None,
                ratio: None,
                baseline_p50_us: (!b50.is_empty()).then(|| median(&b50)),
                reference: match reference {
                    _ if o.contend > 0 => "quiet",
                    Some(Reference::Memcpy(..)) => "cache-line ping-pong",
                    _ => "raw tcp ping-pong",
                },
                baseline_p99_us: (!b99.is_empty()).then(|| median(&b99)),
                submit_ns: None,
            },
            o.json,
        );
    }

    Ok(())
}

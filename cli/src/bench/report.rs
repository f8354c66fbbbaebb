//! Printing what was measured: rows (a table or JSON), the header, the
//! idle probe's lines, the chart.

use std::time::Duration;

use anyhow::{Context, Result};
use ferry::{Endpoint, OpKind};

use crate::args::fmt_size;

use super::measure::{median, Bench};
use super::opts::Opts;
use super::setup::IdleCost;

pub(super) struct Row {
    pub(super) transport: &'static str,
    pub(super) op: &'static str,
    pub(super) block: usize,
    pub(super) batch: usize,
    pub(super) gbps: f64,
    pub(super) ops_per_s: f64,
    pub(super) p50_us: f64,
    pub(super) p99_us: f64,
    pub(super) p999_us: f64,
    pub(super) baseline_gbps: Option<f64>,
    /// Median over rounds of ferry / baseline measured back to back.
    pub(super) ratio: Option<f64>,
    pub(super) baseline_p50_us: Option<f64>,
    /// What the baseline is ("raw tcp", "memcpy", "peer copy", … for
    /// throughput; "raw tcp ping-pong", "cache-line ping-pong", "quiet"
    /// for latency); empty without one.
    pub(super) reference: &'static str,
    pub(super) baseline_p99_us: Option<f64>,
    /// ns per op the submitting thread spent submitting (JSON only).
    pub(super) submit_ns: Option<f64>,
}

pub(super) fn op_name(op: OpKind) -> &'static str {
    match op {
        OpKind::Write => "write",
        OpKind::Read => "read",
    }
}

pub(super) fn print_row(r: &Row, json: bool) {
    if json {
        let mut s = format!(
            "{{\"transport\":\"{}\",\"op\":\"{}\",\"block_bytes\":{},\"batch\":{},",
            r.transport, r.op, r.block, r.batch
        );
        if !r.op.ends_with("_latency") {
            s += &format!("\"gbps\":{:.4},\"ops_per_s\":{:.0},", r.gbps, r.ops_per_s);
        }
        s += &format!(
            "\"p50_us\":{:.2},\"p99_us\":{:.2},\"p999_us\":{:.2}",
            r.p50_us, r.p99_us, r.p999_us
        );
        if let (Some(b), Some(ratio)) = (r.baseline_gbps, r.ratio) {
            s += &format!(",\"baseline_gbps\":{b:.4},\"ratio\":{ratio:.3}");
        }
        if r.baseline_gbps.is_some() || r.baseline_p50_us.is_some() {
            s += &format!(",\"reference\":\"{}\"", r.reference);
        }
        if let (Some(p50), Some(p99)) = (r.baseline_p50_us, r.baseline_p99_us) {
            s += &format!(",\"baseline_p50_us\":{p50:.2},\"baseline_p99_us\":{p99:.2}");
        }
        if let Some(ns) = r.submit_ns {
            s += &format!(",\"submit_ns\":{ns:.0}");
        }
        println!("{s}}}");
    } else if r.op.ends_with("_latency") {
        let base = match (r.baseline_p50_us, r.baseline_p99_us) {
            (Some(a), Some(b)) => format!("   {} p50 {a:.1} us, p99 {b:.1} us", r.reference),
            _ => String::new(),
        };
        println!(
            "{:<14} {:>9}   p50 {:>7.1} us   p99 {:>7.1} us   p999 {:>7.1} us{base}",
            r.op,
            fmt_size(r.block),
            r.p50_us,
            r.p99_us,
            r.p999_us
        );
    } else {
        let base = match (r.baseline_gbps, r.ratio) {
            (Some(b), Some(ratio)) => format!("{b:>10.3} {ratio:>7.2}"),
            _ => String::new(),
        };
        println!(
            "{:<6} {:>9} {:>6} {:>9.3} {:>11.0} {:>10.1} {:>10.1}{base}",
            r.op,
            fmt_size(r.block),
            r.batch,
            r.gbps,
            r.ops_per_s,
            r.p50_us,
            r.p99_us
        );
    }
}

pub(super) fn print_header(o: &Opts, ep: &Endpoint, transport: &'static str, shm: bool) {
    let base = match (o.baseline, o.ipc, shm) {
        (false, _, _) if o.contend > 0 => " quiet GB/s  ratio",
        (false, _, _) => "",
        (true, false, _) if o.device_gpu => "  host GB/s  ratio",
        (true, true, _) if o.pinned => "   H2D GB/s  ratio",
        (true, true, _) => "  peer GB/s  ratio",
        (true, false, false) => "  raw GB/s   ratio",
        (true, false, true) => " memcpy GB/s  ratio",
    };
    println!(
        "transport {transport}, control path {}, {} round(s) of {} s per point{}{}",
        ep.io_backend().0,
        o.rounds,
        o.seconds,
        if o.rounds > 1 { " (medians)" } else { "" },
        if o.contend > 0 {
            format!(", with {} busy process(es) beside it", o.contend)
        } else {
            String::new()
        }
    );
    println!(
        "{:<6} {:>9} {:>6} {:>9} {:>11} {:>10} {:>10}{base}",
        "op", "block", "batch", "GB/s", "ops/s", "p50 us", "p99 us"
    );
}

/// The idle probe (--idle-conns): each round 1 s idle, then one round
/// trip; with --baseline, the machine's floor for waking a parked thread,
/// measured the same way right after (raw::wake_after_idle_us).
pub(super) fn report_idle(
    b: &mut Bench<'_>,
    o: &Opts,
    target_pid: u32,
    c: &IdleCost,
) -> Result<()> {
    let (mut cpu_here, mut cpu_there, mut rtts, mut floors) = (0.0, 0.0, vec![], vec![]);
    for _ in 0..o.rounds {
        let (h, t, rtt) = b.idle_probe(target_pid, 1.0)?;
        cpu_here += h / o.rounds as f64;
        cpu_there += t / o.rounds as f64;
        rtts.push(rtt);
        if o.baseline {
            floors.push(crate::raw::wake_after_idle_us(Duration::from_secs(1))?);
        }
    }
    let rtt_us = median(&rtts);
    let floor_us = (!floors.is_empty()).then(|| median(&floors));
    if o.json {
        let floor = floor_us.map_or(String::new(), |f| {
            format!(",\"wake_floor_us\":{f:.1},\"ratio\":{:.3}", rtt_us / f)
        });
        println!(
            "{{\"idle_conns\":{},\"open_s\":{:.3},\"rss_kib_each\":{:.1},\"target_rss_kib_each\":{:.1},\
             \"idle_cpu_pct\":{cpu_here:.3},\"target_idle_cpu_pct\":{cpu_there:.3},\"rtt_after_idle_us\":{rtt_us:.1},\
             \"rounds\":{}{floor}}}",
            c.n, c.open_s, c.here_kib_each, c.there_kib_each, o.rounds
        );
    } else {
        println!(
            "idle connections: {} opened in {:.2} s; resident memory {:.1} KiB each here, \
             {:.1} KiB each at the target",
            c.n, c.open_s, c.here_kib_each, c.there_kib_each
        );
        let list = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "idle for 1 s: CPU {cpu_here:.2} % of a core here, {cpu_there:.2} % at the target; \
             then one 8-byte WRITE round trip took {rtt_us:.1} us{} ({} us)",
            if o.rounds > 1 { " (median)" } else { "" },
            list(&rtts)
        );
        if let Some(f) = floor_us {
            println!(
                "waking a parked thread of this process after 1 s idle took {f:.1} us ({} us): \
                 ferry {:.2}x that",
                list(&floors),
                rtt_us / f
            );
        }
    }

    Ok(())
}

pub(super) fn write_plot(
    o: &Opts,
    transport: &'static str,
    path: &str,
    plotted: &[crate::plot::Series],
) -> Result<()> {
    let mut title = format!("ferry bench --transport {transport}");
    for (flag, v) in [
        ("streams", o.streams.unwrap_or(1)),
        ("shards", o.shards.unwrap_or(1)),
        ("conns", o.conns),
        ("threads", o.threads),
        ("contend", o.contend),
    ] {
        if v > usize::from(flag != "contend") {
            title += &format!(" --{flag} {v}");
        }
    }
    std::fs::write(
        path,
        crate::plot::svg(&title, &crate::plot::BLOCK_SIZE, plotted),
    )
    .with_context(|| format!("writing {path}"))?;
    eprintln!("chart written to {path}");

    Ok(())
}

//! `ferry bench`: one-sided WRITE/READ throughput and latency between this
//! process (the initiator, driving its shard in embedded mode) and a target
//! process it spawns (`ferry serve`), optionally against raw TCP measured in
//! the same run.

pub(crate) mod compress;
mod link;
mod measure;
mod opts;
mod points;
mod reference;
mod report;
mod scaling;
mod setup;
pub(crate) mod stages;

use anyhow::Result;

use crate::args::{fmt_size, Args};

use measure::Bench;
use opts::parse;
pub use opts::HELP;
use points::{measure_latency, measure_messages, measure_points};
use reference::make_reference;
use report::{print_header, report_idle, write_plot};
use scaling::scaling;
use setup::{
    buffers, check_verbs, more_conns, open_idle, own_endpoint, peer_gpu, set_env, start_target,
    transport_name, warn_spinners,
};

pub fn run(a: Args) -> Result<()> {
    stages::start();
    let r = run_bench(a);
    stages::finish();
    r
}

fn run_bench(mut a: Args) -> Result<()> {
    if let Some(mode) = a.value("compress") {
        return compress::run(&mode, a);
    }
    let o = parse(a)?;
    if let Some(list) = &o.streams_list {
        return scaling(&o, list);
    }
    let max = *o.sizes.iter().max().expect("at least one size");
    // Every submitting thread gets its own `batch` windows.
    let bytes =
        (max.saturating_mul(o.batch).saturating_mul(o.threads)).clamp(max, (1usize << 30).max(max));
    eprintln!(
        "ferry bench: starting target process ({} registered)",
        fmt_size(bytes)
    );
    set_env(&o);
    let peer_gpu = peer_gpu(&o)?;
    warn_spinners(&o);
    let (served, target_pid, _target) = start_target(&o, bytes, peer_gpu)?;
    let ep = own_endpoint(&o)?;
    let mut shard = ep.take_shards().pop();
    let conn = ep.add_remote(&served.meta)?;
    let shm = matches!(ep.peer(conn), Some(ferry::Peer::Local { .. }));
    let idle = open_idle(
        &ep,
        shard.as_mut(),
        &served.meta,
        o.idle_conns - 1,
        target_pid,
    )?;
    let conns = more_conns(&o, &ep, &mut shard, conn, &served)?;
    check_verbs(&o, &ep, &conns)?;
    let transport = transport_name(&o, shm);
    let (local, remote) = buffers(&o, &ep, shm, bytes, &served)?;
    let mut b = Bench {
        ep: &ep,
        shard: std::cell::RefCell::new(shard),
        conns,
        turn: Default::default(),
        local,
        remote,
        latency_bytes: if o.ipc { 4096 } else { 8 },
        threads: o.threads,
        batched: o.batched,
        queued: o.queued,
    };
    let mut reference = make_reference(&o, &ep, shm, bytes, &served, peer_gpu)?;
    if !o.json {
        print_header(&o, &ep, transport, shm);
    }
    if let Some(c) = idle {
        report_idle(&mut b, &o, target_pid, &c)?;
    }
    if o.messages {
        return measure_messages(&mut b, &o, transport);
    }
    let plotted = measure_points(&mut b, &o, &mut reference, transport, shm)?;
    if let Some(path) = &o.plot {
        write_plot(&o, transport, path, &plotted)?;
    }
    if o.latency {
        measure_latency(&mut b, &o, &mut reference, transport)?;
    }
    Ok(())
}

//! `ferry info`: what works on this machine.

use anyhow::Result;
use ferry::oob;

use crate::args::Args;

pub const HELP: &str = "\
ferry info: which transports and control-path backends are usable here

For each one that is not usable, says why. No flags.";

pub fn run(a: Args) -> Result<()> {
    a.finish()?;
    let cfg = ferry::Config::from_env();
    match &cfg {
        Ok(_) => println!("config          ok (FERRY_* variables parsed)"),
        Err(e) => println!("config          error: {e}"),
    }
    println!("transports:");
    println!("  tcp           usable: kernel TCP, the default network path");
    let wanted = cfg.as_ref().ok().and_then(|c| c.rdma_dev.clone());
    match ferry::verbs::status(None, wanted.as_deref()) {
        Ok(nics) => {
            println!(
                "  verbs (rdma)  usable: {} (best first; peers with verbs get RDMA queue pairs)",
                nics.join(", ")
            );
            let vc = cfg.as_ref().map(|c| c.verbs()).unwrap_or_default();
            for line in nic_lines(&nics, &vc) {
                println!("    {line}");
            }
        }
        Err(why) => println!("  verbs (rdma)  not usable: {why}; connections use tcp"),
    }
    match ferry::gpu::driver::status() {
        Ok(c) => {
            println!(
                "  cuda-ipc      usable: {} GPU(s){}",
                c.devices.len(),
                if c.has_batch_copy {
                    ", batched copies (cuMemcpyBatchAsync)"
                } else {
                    ""
                }
            );
            for d in &c.devices {
                println!(
                    "                GPU {}: {} at {}",
                    d.ordinal, d.name, d.bus_id
                );
            }
        }
        Err(why) => println!("  cuda-ipc      not usable: {why}"),
    }
    match ferry::probe_shm() {
        Ok(()) => println!(
            "  shm           usable: same-host peers (rings in /dev/shm, memfd host memory)"
        ),
        Err(why) => println!("  shm           not usable: {why}"),
    }
    println!("control path:");
    match oob::probe_uring() {
        Ok(()) => println!("  io_uring      usable"),
        Err(why) => println!("  io_uring      not usable: {why}"),
    }
    println!("  epoll         usable (fallback, or FERRY_IO=epoll)");
    if let Ok(c) = cfg {
        match oob::choose(c.io) {
            Ok((b, None)) => println!("  selected      {b}"),
            Ok((b, Some(why))) => println!("  selected      {b} ({why})"),
            Err(e) => println!("  selected      none: {e}"),
        }
    }
    Ok(())
}

/// One line per NIC: port state, link layer, and the GID the endpoint
/// would use and why (FERRY_RDMA_GID_INDEX, or the best of the table).
fn nic_lines(nics: &[String], vc: &ferry::verbs::VerbsConfig) -> Vec<String> {
    use ferry::verbs::nic;
    let sysfs = ferry::verbs::sysfs_root();
    nics.iter()
        .map(|name| {
            let (state, link) = nic::port_facts(&sysfs, name, vc.port);
            let gid = match (vc.gid_index, nic::best_gid_choice(&sysfs, name, vc.port)) {
                (Some(i), _) => format!("GID index {i} (FERRY_RDMA_GID_INDEX)"),
                (None, Some(c)) => format!(
                    "GID index {} {} ({}: {})",
                    c.index,
                    c.text(),
                    if c.kind.is_empty() { "IB" } else { &c.kind },
                    c.reason()
                ),
                (None, None) => "GID index 0 (no GID table in sysfs)".to_owned(),
            };
            format!(
                "{name} port {}: {}, {}, {gid}",
                vc.port,
                state.as_deref().unwrap_or("state unknown"),
                link.as_deref().unwrap_or("link layer unknown"),
            )
        })
        .collect()
}

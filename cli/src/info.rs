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
        Ok(nics) => println!(
            "  verbs (rdma)  usable: {} (first is used; peers with verbs get RDMA queue pairs)",
            nics.join(", ")
        ),
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

//! `--link-gbit`: a link that is really that slow. Two network namespaces
//! joined by a veth pair (198.18.1.0/24, from the benchmarking range),
//! each end shaped by a `tc tbf` qdisc to the rate; this process moves its
//! threads' future into one, the target runs in the other. Needs root and
//! iproute2; everything is removed when the `Link` drops.

use std::os::fd::AsRawFd;
use std::process::Command;

use anyhow::{bail, Context, Result};

pub(crate) const OURS: &str = "198.18.1.1";
pub(crate) const THEIRS: &str = "198.18.1.2";

pub(crate) struct Link {
    pub ours: String,
    pub theirs: String,
}

fn run(cmd: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .with_context(|| format!("running {cmd} (iproute2)"))?;
    if !out.status.success() {
        bail!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Link {
    /// Two namespaces and a veth pair shaped to `gbit` each way.
    pub fn make(gbit: f64) -> Result<Link> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            bail!("--link-gbit needs root (network namespaces and tc)");
        }
        let id = std::process::id();
        let l = Link {
            ours: format!("ferry-bench-a-{id}"),
            theirs: format!("ferry-bench-b-{id}"),
        };
        let (va, vb) = (format!("fba{id}"), format!("fbb{id}"));
        run("ip", &["netns", "add", &l.ours])?;
        run("ip", &["netns", "add", &l.theirs])?;
        run(
            "ip",
            &["link", "add", &va, "type", "veth", "peer", "name", &vb],
        )?;
        // One millisecond of the rate per burst, at least what one
        // segmentation-offloaded packet (64 KiB) needs.
        let rate = format!("{}mbit", (gbit * 1000.0).round() as u64);
        let burst = format!("{}", ((gbit * 1e9 / 8.0 / 1000.0) as u64).max(96 << 10));
        for (ns, dev, addr) in [(&l.ours, &va, OURS), (&l.theirs, &vb, THEIRS)] {
            run("ip", &["link", "set", dev, "netns", ns])?;
            run(
                "ip",
                &["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev],
            )?;
            run("ip", &["-n", ns, "link", "set", dev, "up"])?;
            run("ip", &["-n", ns, "link", "set", "lo", "up"])?;
            let tbf = [
                "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", &rate, "burst",
                &burst, "latency", "50ms",
            ];
            run("tc", &tbf)?;
        }
        Ok(l)
    }

    /// Moves the calling thread, and the threads it starts from now on,
    /// into our end's namespace.
    pub fn enter(&self) -> Result<()> {
        let f = std::fs::File::open(format!("/var/run/netns/{}", self.ours))?;
        // SAFETY: setns on a namespace fd we hold; it changes this thread.
        let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        if r != 0 {
            bail!("setns: {}", std::io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        let _ = run("ip", &["netns", "del", &self.ours]);
        let _ = run("ip", &["netns", "del", &self.theirs]);
    }
}

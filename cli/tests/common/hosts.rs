//! Several hosts on one machine: network namespaces joined by a veth pair
//! (198.18.0.0/24 from the benchmarking range, fd77::/64 ULA), which exist
//! only while a test holds them. Needs root and iproute2.

use std::os::fd::AsRawFd;
use std::process::Command;

pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two namespaces and the veth pair between them; removed on drop.
pub struct Hosts {
    pub a: String,
    pub b: String,
    /// Host a's end of the veth pair.
    dev_a: String,
}

impl Hosts {
    /// Two fresh hosts; the caller must be root (network namespaces).
    pub fn make_as_root() -> Hosts {
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        assert_eq!(euid, 0, "network namespaces need root");
        Hosts::make().expect("network namespaces and a veth pair")
    }

    pub fn make() -> Result<Hosts, String> {
        // Tests of one process run at once: each pair of its own.
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = std::process::id();
        // Interface names: at most 15 bytes.
        let (va, vb) = (format!("fa{id}x{n}"), format!("fb{id}x{n}"));
        let h = Hosts {
            a: format!("ferry-a-{id}-{n}"),
            b: format!("ferry-b-{id}-{n}"),
            dev_a: va.clone(),
        };
        ip(&["netns", "add", &h.a])?;
        ip(&["netns", "add", &h.b])?;
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        ip(&["link", "set", &va, "netns", &h.a])?;
        ip(&["link", "set", &vb, "netns", &h.b])?;
        for (ns, dev, v4, v6) in [
            (&h.a, &va, "198.18.0.1/24", "fd77::1/64"),
            (&h.b, &vb, "198.18.0.2/24", "fd77::2/64"),
        ] {
            ip(&["-n", ns, "addr", "add", v4, "dev", dev])?;
            ip(&["-n", ns, "-6", "addr", "add", v6, "dev", dev, "nodad"])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(h)
    }

    /// Shapes what host a sends to `rate` (tc's token bucket: a slow
    /// link, not a dead one). `netem` delays would be closer to a long
    /// path, but kernels without `sch_netem` (this CI's) refuse it.
    pub fn shape_a(&self, rate: &str) {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.a, "tc", "qdisc", "add", "dev"])
            .args([&self.dev_a, "root", "tbf", "rate", rate])
            .args(["burst", "16kbit", "latency", "1s"])
            .output()
            .expect("tc");
        assert!(
            out.status.success(),
            "tc: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn link_a(&self, up: bool) {
        ip(&[
            "-n",
            &self.a,
            "link",
            "set",
            &self.dev_a,
            if up { "up" } else { "down" },
        ])
        .unwrap();
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}

/// Moves the calling thread (only) into namespace `ns`.
pub fn enter(ns: &str) {
    let f = std::fs::File::open(format!("/var/run/netns/{ns}")).unwrap();
    // SAFETY: setns on a namespace fd we hold; it affects this thread only.
    let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
}

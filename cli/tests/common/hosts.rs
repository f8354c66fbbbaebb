//! Several hosts on one machine: network namespaces joined by a veth pair
//! (198.18.0.0/24 from the benchmarking range, fd77::/64 ULA), which exist
//! only while a test holds them. Needs root and iproute2. `Delayed`
//! joins them instead by two TUN devices and a forwarder in this process
//! that holds every packet for a fixed time: a long path, where the
//! kernel has no `sch_netem` to delay a veth.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// Two namespaces joined by a point-to-point link (198.18.0.1 in `a`,
/// 198.18.0.2 in `b`) that delays every packet by `delay` each way: two
/// TUN devices, one per namespace, and for each direction a thread that
/// reads packets and one that writes them out `delay` later, in order.
/// Removed (threads stopped, namespaces deleted) on drop.
pub struct Delayed {
    pub a: String,
    pub b: String,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Delayed {
    pub fn make_as_root(delay: Duration) -> Delayed {
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        assert_eq!(euid, 0, "network namespaces need root");
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let id = std::process::id();
        let mut d = Delayed {
            a: format!("ferry-da-{id}-{n}"),
            b: format!("ferry-db-{id}-{n}"),
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
        };
        ip(&["netns", "add", &d.a]).unwrap();
        ip(&["netns", "add", &d.b]).unwrap();
        let (ta, tb) = (format!("ta{id}x{n}"), format!("tb{id}x{n}"));
        let fa = Arc::new(tun_in(&d.a, &ta));
        let fb = Arc::new(tun_in(&d.b, &tb));
        for (ns, dev, me, peer) in [
            (&d.a, &ta, "198.18.0.1", "198.18.0.2"),
            (&d.b, &tb, "198.18.0.2", "198.18.0.1"),
        ] {
            ip(&["-n", ns, "addr", "add", me, "peer", peer, "dev", dev]).unwrap();
            ip(&["-n", ns, "link", "set", dev, "up"]).unwrap();
            ip(&["-n", ns, "link", "set", "lo", "up"]).unwrap();
        }
        for (from, to) in [(fa.clone(), fb.clone()), (fb, fa)] {
            let (tx, rx) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
            let stop = d.stop.clone();
            d.threads.push(std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                while !stop.load(Ordering::Relaxed) {
                    let mut pfd = libc::pollfd {
                        fd: from.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: one pollfd we own, for at most 50 ms.
                    if unsafe { libc::poll(&mut pfd, 1, 50) } <= 0 {
                        continue;
                    }
                    // SAFETY: reads into our buffer, at most its length.
                    let n =
                        unsafe { libc::read(from.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                    if n > 0
                        && tx
                            .send((Instant::now() + delay, buf[..n as usize].to_vec()))
                            .is_err()
                    {
                        return;
                    }
                }
            }));
            d.threads.push(std::thread::spawn(move || {
                // Ends when the reader (the sender) is gone.
                for (at, packet) in rx {
                    std::thread::sleep(at.saturating_duration_since(Instant::now()));
                    // SAFETY: writes one packet from our buffer. A
                    // packet the device refuses is lost, as on a wire.
                    let _ = unsafe {
                        libc::write(to.as_raw_fd(), packet.as_ptr().cast(), packet.len())
                    };
                }
            }));
        }
        d
    }
}

impl Drop for Delayed {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}

/// A TUN device `dev` (IP packets, no header) made in namespace `ns`.
fn tun_in(ns: &str, dev: &str) -> OwnedFd {
    let (ns, dev) = (ns.to_string(), dev.to_string());
    // A thread of its own enters the namespace: the device is made there.
    std::thread::spawn(move || {
        enter(&ns);
        // SAFETY: opens a device file; the fd is checked below.
        let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        assert!(fd >= 0, "/dev/net/tun: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh fd of ours.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // struct ifreq: the name (16 bytes), then the flags (a short).
        let mut ifr = [0u8; 40];
        ifr[..dev.len()].copy_from_slice(dev.as_bytes());
        let flags = (libc::IFF_TUN | libc::IFF_NO_PI) as u16;
        ifr[16..18].copy_from_slice(&flags.to_ne_bytes());
        const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
        // SAFETY: TUNSETIFF reads and writes one ifreq, which `ifr` is.
        let r = unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, ifr.as_mut_ptr()) };
        assert_eq!(r, 0, "TUNSETIFF: {}", std::io::Error::last_os_error());
        fd
    })
    .join()
    .unwrap()
}

//! The out-of-band control path: connect, accept and the handshake on a new
//! socket, all with deadlines.
//!
//! Two backends do the same work. io_uring is preferred: a connect or accept
//! is one submission linked to a timeout, so a dead address costs no thread
//! and no polling. Many container runtimes refuse io_uring (seccomp answers
//! `EPERM`, older kernels `ENOSYS`); then, or when `FERRY_IO=epoll`, the same
//! calls run over mio/epoll. The choice is logged and shown by `ferry info`.
//!
//! The control path is not the data path: it may block its caller (with a
//! deadline) and allocates freely.

mod accept;
mod admission;
mod epoll;
pub(crate) mod gate;
pub(crate) mod handshake;
mod uring;

use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Which mechanism the control path uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoBackend {
    /// io_uring: one-shot operations with linked timeouts.
    Uring,
    /// epoll readiness and non-blocking calls (where io_uring is refused,
    /// as in many containers).
    Epoll,
}

impl std::fmt::Display for IoBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IoBackend::Uring => "io_uring",
            IoBackend::Epoll => "epoll",
        })
    }
}

/// What the caller asked for (`FERRY_IO`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoPreference {
    /// io_uring where it works, else epoll (the default).
    Auto,
    /// io_uring or an error.
    Uring,
    /// epoll, even where io_uring works.
    Epoll,
}

/// Probes io_uring once: `Ok(())` if a ring can be created here, else why not.
pub fn probe_uring() -> std::result::Result<(), String> {
    match io_uring::IoUring::new(4) {
        Ok(_) => Ok(()),
        Err(e) => Err(match e.raw_os_error() {
            Some(libc::EPERM) => {
                "io_uring_setup refused with EPERM (seccomp or io_uring_disabled)".to_owned()
            }
            Some(libc::ENOSYS) => {
                "io_uring_setup is not implemented by this kernel (ENOSYS)".to_owned()
            }
            _ => format!("io_uring_setup failed: {e}"),
        }),
    }
}

/// Resolves a preference to a backend, with the reason io_uring was not used.
pub fn choose(pref: IoPreference) -> Result<(IoBackend, Option<String>)> {
    match pref {
        IoPreference::Epoll => Ok((IoBackend::Epoll, Some("FERRY_IO=epoll".to_owned()))),
        IoPreference::Uring => match probe_uring() {
            Ok(()) => Ok((IoBackend::Uring, None)),
            Err(why) => Err(Error::Unsupported {
                what: "FERRY_IO=uring",
                reason: why,
            }),
        },
        IoPreference::Auto => match probe_uring() {
            Ok(()) => Ok((IoBackend::Uring, None)),
            Err(why) => Ok((IoBackend::Epoll, Some(why))),
        },
    }
}

/// One control-path worker: blocking calls with deadlines over one backend.
pub(crate) enum Ctl {
    Uring(Box<uring::UringCtl>),
    Epoll(epoll::EpollCtl),
}

impl Ctl {
    pub fn new(backend: IoBackend) -> Result<Ctl> {
        Ok(match backend {
            IoBackend::Uring => Ctl::Uring(Box::new(uring::UringCtl::new()?)),
            IoBackend::Epoll => Ctl::Epoll(epoll::EpollCtl::new()?),
        })
    }

    pub fn connect(&mut self, addr: SocketAddr, timeout: Duration) -> Result<TcpStream> {
        let s = match self {
            Ctl::Uring(c) => c.connect(addr, timeout),
            Ctl::Epoll(c) => c.connect(addr, timeout),
        }?;
        s.set_nodelay(true)
            .map_err(|e| Error::io("setsockopt(TCP_NODELAY)", e))?;
        Ok(s)
    }

    pub fn send_all(&mut self, s: &TcpStream, buf: &[u8], deadline: Instant) -> Result<()> {
        match self {
            Ctl::Uring(c) => c.send_all(s.as_raw_fd(), buf, deadline),
            Ctl::Epoll(c) => c.send_all(s, buf, deadline),
        }
    }

    pub fn recv_exact(&mut self, s: &TcpStream, buf: &mut [u8], deadline: Instant) -> Result<()> {
        match self {
            Ctl::Uring(c) => c.recv_exact(s.as_raw_fd(), buf, deadline),
            Ctl::Epoll(c) => c.recv_exact(s, buf, deadline),
        }
    }
}

pub(crate) fn remaining(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
}

pub(crate) fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

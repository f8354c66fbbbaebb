//! Control-path calls on io_uring: each operation is submitted linked to a
//! `LINK_TIMEOUT`, so the kernel cancels it when the deadline passes.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types, IoUring};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::{ms, remaining};
use crate::error::{Error, Result};

pub(crate) struct UringCtl {
    ring: IoUring,
}

const OP: u64 = 1;
const TIMER: u64 = 2;

impl UringCtl {
    pub fn new() -> Result<Self> {
        Ok(Self {
            ring: IoUring::new(8).map_err(|e| Error::io("io_uring_setup", e))?,
        })
    }

    /// Submits `sqe` linked to a timeout and returns the operation's result:
    /// `Ok(n)` for a non-negative result, `Err(ETIME-like)` if it timed out.
    fn run(&mut self, sqe: squeue::Entry, timeout: Duration) -> io::Result<i32> {
        let ts = types::Timespec::new()
            .sec(timeout.as_secs())
            .nsec(timeout.subsec_nanos());
        let op = sqe.flags(squeue::Flags::IO_LINK).user_data(OP);
        let timer = opcode::LinkTimeout::new(&ts).build().user_data(TIMER);
        // SAFETY: the entries reference `ts` and buffers owned by our caller,
        // all of which outlive this function, and we wait below for both
        // completions before returning, so the kernel is done with them.
        unsafe {
            let mut sq = self.ring.submission();
            sq.push(&op)
                .map_err(|_| io::Error::other("io_uring submission queue full"))?;
            sq.push(&timer)
                .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        }
        let mut op_res = None;
        let mut seen = 0;
        while seen < 2 {
            match self.ring.submit_and_wait(2 - seen) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            for cqe in self.ring.completion() {
                seen += 1;
                if cqe.user_data() == OP {
                    op_res = Some(cqe.result());
                }
            }
        }
        match op_res {
            Some(r) if r >= 0 => Ok(r),
            Some(r) if -r == libc::ECANCELED => Err(io::Error::from(io::ErrorKind::TimedOut)),
            Some(r) => Err(io::Error::from_raw_os_error(-r)),
            None => Err(io::Error::other("io_uring lost a completion")),
        }
    }

    pub fn connect(&mut self, addr: SocketAddr, timeout: Duration) -> Result<TcpStream> {
        let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| Error::io("socket", e))?;
        let sa = SockAddr::from(addr);
        let sqe = opcode::Connect::new(types::Fd(fd_of(&sock)), sa.as_ptr() as *const _, sa.len())
            .build();
        match self.run(sqe, timeout) {
            Ok(_) => Ok(sock.into()),
            Err(e) if e.kind() == io::ErrorKind::TimedOut => Err(Error::ConnectTimeout {
                addr,
                timeout_ms: ms(timeout),
            }),
            Err(e) => Err(Error::Connect { addr, source: e }),
        }
    }

    pub fn send_all(&mut self, fd: RawFd, mut buf: &[u8], deadline: Instant) -> Result<()> {
        while !buf.is_empty() {
            let left = remaining(deadline).ok_or(Error::Timeout {
                what: "handshake send",
                timeout_ms: 0,
            })?;
            let sqe = opcode::Send::new(types::Fd(fd), buf.as_ptr(), buf.len() as u32)
                .flags(libc::MSG_NOSIGNAL)
                .build();
            match self.run(sqe, left) {
                Ok(n) => buf = &buf[n as usize..],
                Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                    return Err(Error::Timeout {
                        what: "handshake send",
                        timeout_ms: ms(left),
                    })
                }
                Err(e) => return Err(Error::io("send (io_uring)", e)),
            }
        }
        Ok(())
    }

    pub fn recv_exact(&mut self, fd: RawFd, buf: &mut [u8], deadline: Instant) -> Result<()> {
        let mut got = 0;
        while got < buf.len() {
            let left = remaining(deadline).ok_or(Error::Timeout {
                what: "handshake reply",
                timeout_ms: 0,
            })?;
            let rest = &mut buf[got..];
            let sqe =
                opcode::Recv::new(types::Fd(fd), rest.as_mut_ptr(), rest.len() as u32).build();
            match self.run(sqe, left) {
                Ok(0) => {
                    return Err(Error::io(
                        "recv (io_uring)",
                        io::ErrorKind::UnexpectedEof.into(),
                    ))
                }
                Ok(n) => got += n as usize,
                Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                    return Err(Error::Timeout {
                        what: "handshake reply",
                        timeout_ms: ms(left),
                    })
                }
                Err(e) => return Err(Error::io("recv (io_uring)", e)),
            }
        }
        Ok(())
    }
}

fn fd_of(s: &Socket) -> RawFd {
    use std::os::fd::AsRawFd;
    s.as_raw_fd()
}

//! Control-path calls on mio/epoll, for where io_uring is refused. Sockets
//! are non-blocking; each call waits for readiness with the time left.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::{ms, remaining};
use crate::error::{Error, Result};

pub(crate) struct EpollCtl {
    poll: Poll,
    events: Events,
}

impl EpollCtl {
    pub fn new() -> Result<Self> {
        Ok(Self {
            poll: Poll::new().map_err(|e| Error::io("epoll_create", e))?,
            events: Events::with_capacity(4),
        })
    }

    /// Waits until `fd` is ready for `interest` or the timeout passes;
    /// returns whether it became ready.
    fn wait(&mut self, fd: i32, interest: Interest, timeout: Duration) -> io::Result<bool> {
        let mut src = SourceFd(&fd);
        self.poll
            .registry()
            .register(&mut src, Token(0), interest)?;
        let res = loop {
            match self.poll.poll(&mut self.events, Some(timeout)) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => break other,
            }
        };
        let ready = !self.events.is_empty();
        self.poll.registry().deregister(&mut src)?;
        res.map(|_| ready)
    }

    pub fn connect(&mut self, addr: SocketAddr, timeout: Duration) -> Result<TcpStream> {
        let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| Error::io("socket", e))?;
        sock.set_nonblocking(true)
            .map_err(|e| Error::io("fcntl(O_NONBLOCK)", e))?;
        match sock.connect(&SockAddr::from(addr)) {
            Ok(()) => return Ok(sock.into()),
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
            Err(e) => return Err(Error::Connect { addr, source: e }),
        }
        let ready = self
            .wait(sock.as_raw_fd(), Interest::WRITABLE, timeout)
            .map_err(|e| Error::io("epoll_wait", e))?;
        if !ready {
            return Err(Error::ConnectTimeout {
                addr,
                timeout_ms: ms(timeout),
            });
        }
        if let Some(e) = sock
            .take_error()
            .map_err(|e| Error::io("getsockopt(SO_ERROR)", e))?
        {
            return Err(Error::Connect { addr, source: e });
        }
        Ok(sock.into())
    }

    pub fn send_all(&mut self, s: &TcpStream, mut buf: &[u8], deadline: Instant) -> Result<()> {
        let mut w = s;
        while !buf.is_empty() {
            match w.write(buf) {
                Ok(n) => buf = &buf[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let left = remaining(deadline).ok_or(Error::Timeout {
                        what: "handshake send",
                        timeout_ms: 0,
                    })?;
                    self.wait(s.as_raw_fd(), Interest::WRITABLE, left)
                        .map_err(|e| Error::io("epoll_wait", e))?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("send", e)),
            }
        }
        Ok(())
    }

    pub fn recv_exact(&mut self, s: &TcpStream, buf: &mut [u8], deadline: Instant) -> Result<()> {
        let mut r = s;
        let mut got = 0;
        while got < buf.len() {
            match r.read(&mut buf[got..]) {
                Ok(0) => return Err(Error::io("recv", io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let left = remaining(deadline).ok_or(Error::Timeout {
                        what: "handshake reply",
                        timeout_ms: 0,
                    })?;
                    self.wait(s.as_raw_fd(), Interest::READABLE, left)
                        .map_err(|e| Error::io("epoll_wait", e))?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("recv", e)),
            }
        }
        Ok(())
    }
}

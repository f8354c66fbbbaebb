//! One tcp data stream's I/O: a non-blocking socket driven by its
//! protocol engine (`proto.rs`). The only syscalls of the tcp data path
//! are here: `writev` of what the engine offers, `readv` into where it says.

use std::io;
use std::os::fd::AsRawFd;

use super::proto::{Step, StreamLimits, StreamProto, MAX_IOV};
use crate::error::ConnFault;
use crate::region::Regions;
use crate::sys::{syscall, LazyClock};
use crate::xfer::Sink;

pub(crate) struct Stream {
    pub sock: mio::net::TcpStream,
    /// Readiness learned from epoll (edge-triggered), cleared when a
    /// syscall says EAGAIN: an idle stream costs no syscall per poll.
    pub readable: bool,
    pub writable: bool,
    /// The engine stopped on the shard (a full inbox, no bounce buffer):
    /// buffered frames wait for a later pass, whatever epoll says.
    blocked: bool,
    proto: StreamProto,
}

impl std::ops::Deref for Stream {
    type Target = StreamProto;
    fn deref(&self) -> &StreamProto {
        &self.proto
    }
}

impl std::borrow::Borrow<StreamProto> for Stream {
    fn borrow(&self) -> &StreamProto {
        &self.proto
    }
}

impl std::borrow::BorrowMut<StreamProto> for Stream {
    fn borrow_mut(&mut self) -> &mut StreamProto {
        &mut self.proto
    }
}

impl std::ops::DerefMut for Stream {
    fn deref_mut(&mut self) -> &mut StreamProto {
        &mut self.proto
    }
}

impl Stream {
    pub fn new(
        sock: mio::net::TcpStream,
        limits: StreamLimits,
        idx: u8,
        mac: Option<super::proto::Integrity>,
    ) -> Self {
        Self {
            sock,
            readable: true,
            writable: true,
            blocked: false,
            proto: StreamProto::new(limits, idx, mac),
        }
    }

    /// Whether the next pass must give it a turn without an event: bytes
    /// may still be readable, frames sendable, or it is blocked on the shard.
    pub fn wants_turn(&self) -> bool {
        self.has_io() || self.blocked
    }

    /// Whether it has socket work now (not only waiting on the shard).
    pub fn has_io(&self) -> bool {
        self.readable || (self.writable && self.proto.tx_ready())
    }

    /// Writes queued frames until the socket would block. Returns whether
    /// any byte was written.
    pub fn flush(&mut self) -> Result<bool, ConnFault> {
        let fd = self.sock.as_raw_fd();
        let mut progress = false;
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; MAX_IOV];
        while self.writable && self.proto.tx_ready() {
            let n_iov = self.proto.tx_iovecs(&mut iov);
            // sendmsg, not writev: MSG_NOSIGNAL makes a peer that went away
            // an EPIPE here instead of a SIGPIPE that kills a C host.
            // SAFETY: a zeroed msghdr is valid (no name, no control).
            let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
            mh.msg_iov = iov.as_mut_ptr();
            mh.msg_iovlen = n_iov as _;
            // SAFETY: the engine's iovecs point into frame headers it owns
            // and payloads its frames hold alive (`RegionSlice`s, owned
            // buffers); nothing changes them before `on_sent`.
            let n = match syscall!(sendmsg(fd, &mh, libc::MSG_NOSIGNAL)) {
                Ok(n) => n,
                Err(e) => match e.kind() {
                    io::ErrorKind::WouldBlock => {
                        self.writable = false;
                        if let Some(m) = self.proto.link_meter() {
                            m.blocked(std::time::Instant::now());
                        }
                        return Ok(progress);
                    }
                    io::ErrorKind::Interrupted => continue,
                    _ => return Err(ConnFault::from_io("send", &e)),
                },
            };
            progress = true;
            self.proto.on_sent(n as usize);
            if let Some(m) = self.proto.link_meter() {
                m.sent(n as usize, std::time::Instant::now());
            }
        }
        if !self.proto.tx_ready() {
            if let Some(m) = self.proto.link_meter() {
                m.drained();
            }
        }
        Ok(progress)
    }

    /// Reads and handles frames until the socket would block (or the engine
    /// is blocked on the shard). Returns whether anything happened; `Err`
    /// means the stream is broken.
    pub fn on_readable(
        &mut self,
        regions: &mut impl Regions,
        sink: &mut impl Sink,
        clock: &mut LazyClock,
    ) -> Result<bool, ConnFault> {
        let fd = self.sock.as_raw_fd();
        let mut progress = false;
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 2];
        self.blocked = false;
        loop {
            // Frames already buffered are handled even when the socket is dry.
            match self.proto.step(regions, sink)? {
                Step::Progress => {
                    progress = true;
                    continue;
                }
                Step::Blocked => {
                    self.blocked = true;
                    return Ok(progress);
                }
                Step::NeedBytes => {}
            }
            if !self.readable {
                return Ok(progress);
            }
            // Between frames, hand back what this read brought (replies to
            // send, completions to publish) before the next read: that read
            // is usually EAGAIN, and someone is waiting.
            if progress && self.proto.at_frame_boundary() {
                return Ok(progress);
            }
            let n_iov = self.proto.rx_iovecs(&mut iov);
            // SAFETY: the engine's iovecs are a payload destination it holds
            // alive (a checked `RegionSlice`) and its own buffer.
            let n = match syscall!(readv(fd, iov.as_ptr(), n_iov as libc::c_int)) {
                Ok(n) => n,
                Err(e) => match e.kind() {
                    io::ErrorKind::WouldBlock => {
                        self.readable = false;
                        return Ok(progress);
                    }
                    io::ErrorKind::Interrupted => continue,
                    _ => return Err(ConnFault::from_io("receive", &e)),
                },
            };
            if n == 0 {
                return Err(ConnFault::closed_by_peer());
            }
            progress = true;
            self.proto.on_received(n as usize, clock.now());
        }
    }
}

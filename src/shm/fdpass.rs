//! Passing memfd descriptors between local endpoints over an abstract Unix
//! socket (`@ferry-<id>`, SOCK_SEQPACKET), so the target of a transfer can
//! map the initiator's `alloc_host` memory and copy with one memcpy.
//!
//! One message: `sender id u64 | count u32 | 0 u32` then `count` entries of
//! `key u32 | 0 u32 | len u64 | base u64`, with `count` descriptors attached
//! (SCM_RIGHTS). The receiver answers one byte once it has mapped them.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use super::local::{PeerMap, PeerMaps};
use crate::sys::{cvt, Mapping};

/// Regions per message (and descriptors per SCM_RIGHTS).
pub const MAX_PER_MSG: usize = 64;
const ENTRY: usize = 24;
const HEAD: usize = 16;

pub(crate) struct Shared {
    pub key: u32,
    pub len: u64,
    pub base: u64,
    pub fd: i32,
}

fn sockaddr(id: u64) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: sockaddr_un is plain bytes.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let name = format!("ferry-{id:016x}");
    // Abstract namespace: a leading NUL, no file on disk, gone with the socket.
    for (i, b) in name.bytes().enumerate() {
        a.sun_path[i + 1] = b as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
    (a, len as libc::socklen_t)
}

/// Owns a descriptor a call just returned (`cvt` let only valid ones by).
fn own(fd: RawFd) -> OwnedFd {
    // SAFETY: `fd` was just returned open by the kernel to this process and
    // nothing else holds it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// A blocking call on socket `fd`, made again when a signal interrupted
/// it, with the socket's timeouts cut to what is left before `deadline`
/// (a retry must not start the whole timeout again: a stream of signals
/// would hold us without end). EINTR comes from a handler installed
/// without SA_RESTART (the application's), and even with no handler from
/// a stop and continue of the process while the socket has a timeout
/// (signal(7)); it was seen here on a loaded machine while waiting for the
/// ack, and failed the share (the peer then fell back to copying through
/// the kernel).
fn restart(fd: i32, deadline: Instant, mut call: impl FnMut() -> isize) -> io::Result<isize> {
    loop {
        match cvt(call()) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            done => return done,
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        // Never a zero timeval: that means no timeout at all.
        set_timeout(fd, left.max(Duration::from_micros(1)));
    }
}

fn set_timeout(fd: i32, t: Duration) {
    let tv = libc::timeval {
        tv_sec: t.as_secs() as libc::time_t,
        tv_usec: t.subsec_micros() as libc::suseconds_t,
    };
    for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        // SAFETY: setsockopt with a timeval of the right size.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                &tv as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
    }
}

/// Regions one local peer may have mapped here at once.
pub const MAX_PEER_MAPS: usize = 1024;
/// Bytes of one local peer's memory mapped here at most (address space,
/// not RSS: a sparse memfd costs address space all the same).
pub const MAX_PEER_MAPPED_BYTES: u64 = 1 << 40;
/// Senders accepted whose message has not arrived (or names a connection
/// not adopted yet); past this the oldest is dropped.
const MAX_PENDING: usize = 16;
/// How long a pending sender may wait.
const PENDING_DEADLINE: Duration = Duration::from_secs(5);

/// Who sent a message: the endpoint id it claims and the process the
/// kernel vouches for (SO_PEERCRED).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sender {
    pub id: u64,
    pub pid: u32,
}

/// An accepted sender not served yet.
struct Pending {
    sock: OwnedFd,
    pid: u32,
    deadline: Instant,
    /// The message, once read (it may name a connection the shard has not
    /// adopted yet).
    msg: Option<Received>,
}

/// A message read off the socket: its claimed sender, entries and fds.
struct Received {
    sender: u64,
    entries: Vec<(u32, u64, u64)>,
    fds: Vec<OwnedFd>,
}

/// The receiving end, polled by the shard that owns local connections.
/// Only processes of our own user may connect (SO_PEERCRED), and only
/// regions of a peer with an established connection from that very
/// process are mapped; nothing here blocks.
pub(crate) struct FdListener {
    fd: OwnedFd,
    pending: Vec<Pending>,
    uid: u32,
}

impl FdListener {
    pub fn bind(id: u64) -> io::Result<FdListener> {
        // SAFETY: plain socket creation.
        let fd = own(cvt(unsafe {
            libc::socket(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        })?);
        let (a, len) = sockaddr(id);
        // SAFETY: `a` is a valid sockaddr_un of `len` bytes.
        cvt(unsafe { libc::bind(fd.as_raw_fd(), &a as *const _ as *const libc::sockaddr, len) })?;
        // SAFETY: listening on our socket.
        cvt(unsafe { libc::listen(fd.as_raw_fd(), 64) })?;
        Ok(FdListener {
            fd,
            pending: Vec::new(),
            // SAFETY: geteuid has no preconditions.
            uid: unsafe { libc::geteuid() },
        })
    }

    /// Takes new senders and serves pending ones: maps what a known peer
    /// shares into `maps`. `known(sender)`: a connection to endpoint
    /// `sender.id` from process `sender.pid` exists. Returns how many
    /// regions were mapped.
    pub fn poll(&mut self, maps: &mut PeerMaps, known: impl Fn(Sender) -> bool) -> usize {
        self.accept_new();
        let now = Instant::now();
        let mut n = 0;
        let mut i = 0;
        while i < self.pending.len() {
            let p = &mut self.pending[i];
            if p.msg.is_none() {
                match read_message(p.sock.as_raw_fd()) {
                    Ok(Some(m)) => p.msg = Some(m),
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!("fd passing from pid {}: {e}", p.pid);
                        self.pending.swap_remove(i);
                        continue;
                    }
                }
            }
            let ready = p.msg.as_ref().map(|m| Sender {
                id: m.sender,
                pid: p.pid,
            });
            match ready {
                Some(sender) if known(sender) => {
                    let p = self.pending.swap_remove(i);
                    let m = p.msg.expect("read");
                    match map_all(sender, m, maps) {
                        Ok(k) => {
                            n += k;
                            // SAFETY: one byte from a local buffer.
                            unsafe {
                                libc::send(
                                    p.sock.as_raw_fd(),
                                    [1u8].as_ptr() as *const _,
                                    1,
                                    libc::MSG_NOSIGNAL,
                                )
                            };
                        }
                        Err(e) => {
                            tracing::warn!("fd passing from pid {}: refused: {e}", sender.pid)
                        }
                    }
                    continue;
                }
                _ if now >= p.deadline => {
                    tracing::warn!(
                        "fd passing from pid {}: no message from a connected peer in time",
                        p.pid
                    );
                    self.pending.swap_remove(i);
                    continue;
                }
                _ => i += 1,
            }
        }
        n
    }

    /// The listening socket (readable when a sender connects).
    pub fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// Whether senders wait to be served (the shard then polls often).
    pub fn busy(&self) -> bool {
        !self.pending.is_empty()
    }

    fn accept_new(&mut self) {
        loop {
            // SAFETY: accept on our listening socket; no address wanted.
            let c = unsafe {
                libc::accept4(
                    self.fd.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                )
            };
            if c < 0 {
                return;
            }
            let c = own(c);
            let Some((pid, uid)) = peer_cred(c.as_raw_fd()) else {
                continue;
            };
            if uid != self.uid {
                tracing::warn!(
                    "fd passing: refused pid {pid} of uid {uid} (ours is {})",
                    self.uid
                );
                continue;
            }
            if self.pending.len() >= MAX_PENDING {
                self.pending.remove(0);
            }
            self.pending.push(Pending {
                sock: c,
                pid,
                deadline: Instant::now() + PENDING_DEADLINE,
                msg: None,
            });
        }
    }
}

/// The connecting process's pid and uid, as the kernel saw them.
fn peer_cred(fd: i32) -> Option<(u32, u32)> {
    // SAFETY: ucred is plain data.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt into a ucred of the right size.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut _ as *mut libc::c_void,
            &mut len,
        )
    };
    (r == 0 && cred.pid > 0).then_some((cred.pid as u32, cred.uid))
}

/// A message header for one data iovec and a control buffer.
fn msghdr(iov: &mut libc::iovec, ctl: &mut [u8]) -> libc::msghdr {
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.as_mut_ptr() as *mut _;
    mh.msg_controllen = ctl.len() as _;
    mh
}

/// Reads one message (without blocking: `None` until it is there).
fn read_message(fd: i32) -> io::Result<Option<Received>> {
    let mut data = [0u8; HEAD + MAX_PER_MSG * ENTRY];
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space =
        unsafe { libc::CMSG_SPACE((MAX_PER_MSG * std::mem::size_of::<i32>()) as u32) } as usize;
    let mut ctl = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr() as *mut _,
        iov_len: data.len(),
    };
    let mut mh = msghdr(&mut iov, &mut ctl);
    // SAFETY: every pointer in mh refers to live local buffers.
    let got = unsafe { libc::recvmsg(fd, &mut mh, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    let got = match cvt(got) {
        Ok(got) => got,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut fds = Vec::new();
    // SAFETY: walking the control buffer the kernel filled, with its macros.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&mh);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let n = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<i32>();
                let p = libc::CMSG_DATA(c) as *const i32;
                for i in 0..n {
                    fds.push(own(std::ptr::read_unaligned(p.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&mh, c);
        }
    }
    let got = got as usize;
    if got < HEAD {
        return Err(io::Error::other(format!("fd message of {got} bytes")));
    }
    let sender = u64::from_le_bytes(data[..8].try_into().expect("8"));
    let count = u32::from_le_bytes(data[8..12].try_into().expect("4")) as usize;
    if count > MAX_PER_MSG || got != HEAD + count * ENTRY || fds.len() != count {
        return Err(io::Error::other(format!(
            "fd message: {count} entries, {got} bytes, {} descriptors",
            fds.len()
        )));
    }
    let entries = (0..count)
        .map(|i| {
            let e = &data[HEAD + i * ENTRY..HEAD + (i + 1) * ENTRY];
            (
                u32::from_le_bytes(e[..4].try_into().expect("4")),
                u64::from_le_bytes(e[8..16].try_into().expect("8")),
                u64::from_le_bytes(e[16..24].try_into().expect("8")),
            )
        })
        .collect();
    Ok(Some(Received {
        sender,
        entries,
        fds,
    }))
}

/// Maps every region of a message from a known peer, or none: a region
/// already mapped is never replaced, and the peer's count and bytes stay
/// within `MAX_PEER_MAPS` / `MAX_PEER_MAPPED_BYTES`.
fn map_all(sender: Sender, m: Received, maps: &mut PeerMaps) -> io::Result<usize> {
    let (mut count, mut bytes) = (0usize, 0u64);
    for ((peer, _), pm) in maps.iter() {
        if *peer == sender.id {
            count += 1;
            bytes += pm.map.len() as u64;
        }
    }
    let mut seen = Vec::with_capacity(m.entries.len());
    for &(key, len, _) in &m.entries {
        if maps.contains_key(&(sender.id, key)) || seen.contains(&key) {
            return Err(io::Error::other(format!(
                "region {key:#x} is mapped already (a mapping is never replaced)"
            )));
        }
        seen.push(key);
        count += 1;
        bytes = bytes.saturating_add(len);
    }
    if count > MAX_PEER_MAPS {
        return Err(io::Error::other(format!(
            "peer would have {count} regions mapped, more than MAX_PEER_MAPS ({MAX_PEER_MAPS})"
        )));
    }
    if bytes > MAX_PEER_MAPPED_BYTES {
        return Err(io::Error::other(format!(
            "peer would have {bytes} bytes mapped, more than MAX_PEER_MAPPED_BYTES ({MAX_PEER_MAPPED_BYTES})"
        )));
    }
    let mut mapped = Vec::with_capacity(m.entries.len());
    for (&(key, len, base), fd) in m.entries.iter().zip(&m.fds) {
        // Map no more than the object really holds.
        // SAFETY: fstat of a descriptor we received into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 || (st.st_size as u64) < len {
            return Err(io::Error::other(format!(
                "shared region {key:#x}: object smaller than {len} bytes"
            )));
        }
        mapped.push((key, base, Mapping::map_fd(fd.as_raw_fd(), len as usize)?));
    }
    let n = mapped.len();
    for (key, base, map) in mapped {
        maps.insert(
            (sender.id, key),
            PeerMap {
                map: std::sync::Arc::new(map),
                base,
            },
        );
    }
    Ok(n)
}

/// Shares `regions` with the local endpoint `peer`, waiting for its ack.
pub(crate) fn share(me: u64, peer: u64, regions: &[Shared], timeout: Duration) -> io::Result<()> {
    for chunk in regions.chunks(MAX_PER_MSG) {
        // SAFETY: plain socket creation.
        let fd = own(cvt(unsafe {
            libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0)
        })?);
        set_timeout(fd.as_raw_fd(), timeout);
        let deadline = Instant::now() + timeout;
        let (a, len) = sockaddr(peer);
        // SAFETY: valid address of `len` bytes.
        cvt(unsafe {
            libc::connect(fd.as_raw_fd(), &a as *const _ as *const libc::sockaddr, len)
        })?;
        let mut data = Vec::with_capacity(HEAD + chunk.len() * ENTRY);
        data.extend_from_slice(&me.to_le_bytes());
        data.extend_from_slice(&(chunk.len() as u32).to_le_bytes());
        data.extend_from_slice(&0u32.to_le_bytes());
        for r in chunk {
            data.extend_from_slice(&r.key.to_le_bytes());
            data.extend_from_slice(&0u32.to_le_bytes());
            data.extend_from_slice(&r.len.to_le_bytes());
            data.extend_from_slice(&r.base.to_le_bytes());
        }
        let fds: Vec<i32> = chunk.iter().map(|r| r.fd).collect();
        let bytes = fds.len() * std::mem::size_of::<i32>();
        // SAFETY: size computations.
        let space = unsafe { libc::CMSG_SPACE(bytes as u32) } as usize;
        let mut ctl = vec![0u8; space];
        let mut iov = libc::iovec {
            iov_base: data.as_mut_ptr() as *mut _,
            iov_len: data.len(),
        };
        let mh = msghdr(&mut iov, &mut ctl);
        // SAFETY: the control buffer has room for one SCM_RIGHTS header and
        // `fds`; all pointers are to live local buffers.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&mh);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c) as *mut i32, fds.len());
        }
        // SAFETY: `mh` points at the live buffers above.
        restart(fd.as_raw_fd(), deadline, || unsafe {
            libc::sendmsg(fd.as_raw_fd(), &mh, libc::MSG_NOSIGNAL)
        })?;
        let mut ack = [0u8; 1];
        // SAFETY: one byte into a local buffer.
        let n = restart(fd.as_raw_fd(), deadline, || unsafe {
            libc::recv(fd.as_raw_fd(), ack.as_mut_ptr() as *mut _, 1, 0)
        });
        match n {
            Ok(1) => {}
            Ok(_) => {
                return Err(io::Error::other(
                    "peer closed without acknowledging shared regions (it did not know \
                     this endpoint's connection, or could not map a region: its log says which)",
                ))
            }
            Err(e) => {
                return Err(io::Error::other(format!(
                    "peer did not acknowledge shared regions: {e}"
                )))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;

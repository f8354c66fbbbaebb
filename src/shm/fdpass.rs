//! Passing memfd descriptors between local endpoints over an abstract Unix
//! socket (`@ferry-<id>`, SOCK_SEQPACKET), so the target of a transfer can
//! map the initiator's `alloc_host` memory and copy with one memcpy.
//!
//! One message: `sender id u64 | count u32 | 0 u32` then `count` entries of
//! `key u32 | 0 u32 | len u64 | base u64`, with `count` descriptors attached
//! (SCM_RIGHTS). The receiver answers one byte once it has mapped them.

use std::io;
use std::time::Duration;

use super::local::{PeerMap, PeerMaps};
use crate::sys::Mapping;

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

struct Fd(i32);
impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: we own the descriptor.
        unsafe { libc::close(self.0) };
    }
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
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

/// The receiving end, polled by the shard that owns local connections.
pub(crate) struct FdListener {
    fd: Fd,
}

impl FdListener {
    pub fn bind(id: u64) -> io::Result<FdListener> {
        // SAFETY: plain socket creation.
        let fd = Fd(cvt(unsafe {
            libc::socket(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        })?);
        let (a, len) = sockaddr(id);
        // SAFETY: `a` is a valid sockaddr_un of `len` bytes.
        cvt(unsafe { libc::bind(fd.0, &a as *const _ as *const libc::sockaddr, len) })?;
        // SAFETY: listening on our socket.
        cvt(unsafe { libc::listen(fd.0, 64) })?;
        Ok(FdListener { fd })
    }

    /// Takes every pending sender, maps what each shares into `maps`.
    /// Returns how many regions were mapped.
    pub fn poll(&self, maps: &mut PeerMaps) -> usize {
        let mut n = 0;
        loop {
            // SAFETY: accept on our listening socket; no address wanted.
            let c = unsafe {
                libc::accept4(
                    self.fd.0,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC,
                )
            };
            if c < 0 {
                return n;
            }
            let c = Fd(c);
            // The sender writes right after connecting; a short timeout
            // bounds what a stuck local process can cost the shard.
            set_timeout(c.0, Duration::from_millis(100));
            match receive(c.0, maps) {
                Ok(k) => {
                    n += k;
                    // SAFETY: one byte from a local buffer.
                    unsafe { libc::send(c.0, [1u8].as_ptr() as *const _, 1, libc::MSG_NOSIGNAL) };
                }
                Err(e) => tracing::warn!("fd passing: {e}"),
            }
        }
    }
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

fn receive(fd: i32, maps: &mut PeerMaps) -> io::Result<usize> {
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
    let got = unsafe { libc::recvmsg(fd, &mut mh, libc::MSG_CMSG_CLOEXEC) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
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
                    fds.push(Fd(std::ptr::read_unaligned(p.add(i))));
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
    for (i, fd) in fds.iter().enumerate() {
        let e = &data[HEAD + i * ENTRY..HEAD + (i + 1) * ENTRY];
        let key = u32::from_le_bytes(e[..4].try_into().expect("4"));
        let len = u64::from_le_bytes(e[8..16].try_into().expect("8"));
        let base = u64::from_le_bytes(e[16..24].try_into().expect("8"));
        // Map no more than the object really holds.
        // SAFETY: fstat of a descriptor we received into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.0, &mut st) } != 0 || (st.st_size as u64) < len {
            return Err(io::Error::other(format!(
                "shared region {key:#x}: object smaller than {len} bytes"
            )));
        }
        let map = Mapping::map_fd(fd.0, len as usize)?;
        maps.insert(
            (sender, key),
            PeerMap {
                map: std::sync::Arc::new(map),
                base,
            },
        );
    }
    Ok(count)
}

/// Shares `regions` with the local endpoint `peer`, waiting for its ack.
pub(crate) fn share(me: u64, peer: u64, regions: &[Shared], timeout: Duration) -> io::Result<()> {
    for chunk in regions.chunks(MAX_PER_MSG) {
        // SAFETY: plain socket creation.
        let fd = Fd(cvt(unsafe {
            libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0)
        })?);
        set_timeout(fd.0, timeout);
        let (a, len) = sockaddr(peer);
        // SAFETY: valid address of `len` bytes.
        cvt(unsafe { libc::connect(fd.0, &a as *const _ as *const libc::sockaddr, len) })?;
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
            if libc::sendmsg(fd.0, &mh, libc::MSG_NOSIGNAL) < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        let mut ack = [0u8; 1];
        // SAFETY: one byte into a local buffer.
        let n = unsafe { libc::recv(fd.0, ack.as_mut_ptr() as *mut _, 1, 0) };
        if n != 1 {
            return Err(io::Error::other(format!(
                "peer did not acknowledge shared regions: {}",
                io::Error::last_os_error()
            )));
        }
    }
    Ok(())
}

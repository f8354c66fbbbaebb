//! The state of one tcp data stream and the syscalls that move it.

use std::collections::VecDeque;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Instant;

use crate::error::{Error, OpKind, Result};
use crate::region::{Access, KeyRef, Region, Regions};
use crate::wire::{DataHeader, DataKind, Status, DATA_HEADER_LEN};

const HDR: usize = DATA_HEADER_LEN;
/// Receive buffer for headers (and payload bytes that share their read).
const RBUF_BYTES: usize = 256 * 1024;
/// iovecs gathered into one `writev`.
const MAX_IOV: usize = 64;
/// Notifications queued for sending per stream.
pub(crate) const NOTIFY_QUEUE: usize = 64;

/// Where a stream reports what it finished.
pub(crate) trait Sink {
    /// One request frame of operation `slot` ended.
    fn done(&mut self, slot: u32, result: Result<()>);
    /// A notification arrived; hand it back if the inbox is full.
    fn notify(&mut self, payload: Vec<u8>) -> Result<(), Vec<u8>>;
    /// The peer deregistered IPC-exported GPU memory at `alloc_base`.
    fn ipc_revoked(&mut self, _alloc_base: u64) {}
    /// Takes a same-host request that needs a CUDA copy; `false` when this
    /// sink cannot (the request is then refused with `DeviceMemory`).
    fn gpu_copy(&mut self, _req: crate::shm::local::GpuReq) -> bool {
        false
    }
    /// A pinned bounce buffer of at least `len` bytes, for GPU memory on
    /// the tcp path.
    fn bounce(&mut self, _len: usize) -> Bounce {
        Bounce::Never
    }
    /// Starts the CUDA copy a staged frame needs (see `Stage`).
    fn gpu_stage(&mut self, _stage: Stage) {}
}

/// What `Sink::bounce` found.
pub(crate) enum Bounce {
    Ready(Arc<Region>),
    /// All in use: try again once some copy or send finishes.
    Busy,
    /// No GPU path here: GPU memory cannot go over tcp.
    Never,
}

/// A CUDA copy between GPU memory and a bounce buffer for a tcp frame.
/// With `gate` set it releases that gated frame of stream `stream` when
/// done (a WriteAck after the bounce→GPU copy, a ReadResp after GPU→bounce);
/// with `gate` 0 it completes one frame of op `slot` (a READ that landed in
/// a bounce buffer, copied on into GPU memory).
pub(crate) struct Stage {
    pub stream: u8,
    pub gate: u64,
    pub slot: u32,
    pub dst: u64,
    pub src: u64,
    pub len: usize,
    /// The GPU region and the bounce buffer, alive until the copy ends.
    pub keep: Arc<Region>,
    pub keep2: Arc<Region>,
}

/// Per-stream bounds, fixed at connection time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StreamLimits {
    /// Requests we keep outstanding at most.
    pub own_max: usize,
    /// Requests the peer declared it keeps outstanding at most.
    pub peer_max: usize,
}

enum Keep {
    None,
    Region(#[allow(dead_code)] Arc<Region>),
    Bytes(#[allow(dead_code)] Vec<u8>),
}

struct TxFrame {
    hdr: [u8; HDR],
    payload: *const u8,
    len: usize,
    class: FrameClass,
    /// Holds the payload's memory alive until the kernel has copied it.
    _keep: Keep,
    /// Non-zero: not to be sent until `release(gate)` (its payload is being
    /// staged from GPU memory, or its ack waits for a copy into it).
    gate: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum FrameClass {
    Request,
    Response,
    Notify,
}

/// A request sent and not yet answered (the shm path uses it too).
pub(crate) struct PendingOp {
    pub slot: u32,
    pub kind: OpKind,
    /// Local memory: the source of a WRITE, the destination of a READ.
    pub dst: *mut u8,
    pub len: usize,
    pub rkey: u32,
    pub addr: u64,
    pub sent_at: Instant,
    /// Keeps the local memory alive while the peer reads from or writes to it.
    pub _keep: Arc<Region>,
    /// A READ received into a bounce buffer (`dst`) goes on into this GPU
    /// address of this region before the op completes.
    pub post: Option<(u64, Arc<Region>)>,
}

impl PendingOp {
    /// The operation's result, given the status its target answered.
    pub fn outcome(&self, status: Status) -> Result<()> {
        if status == Status::Ok {
            return Ok(());
        }
        Err(Error::Remote {
            op: self.kind,
            status,
            rkey: self.rkey,
            addr: self.addr,
            len: self.len as u64,
        })
    }
}

/// On tcp a request also has the op id its response must echo.
struct Pending {
    op_id: u64,
    op: PendingOp,
}

impl std::ops::Deref for Pending {
    type Target = PendingOp;
    fn deref(&self) -> &PendingOp {
        &self.op
    }
}

enum After {
    Ack {
        op_id: u64,
        status: Status,
    },
    ReadDone,
    /// A WRITE into GPU memory landed in a bounce buffer: copy it on, then
    /// acknowledge.
    AckStaged {
        op_id: u64,
        gpu_dst: u64,
        gpu: Arc<Region>,
        bounce: Arc<Region>,
        len: usize,
    },
}

enum Rx {
    Header,
    Payload {
        dst: *mut u8,
        left: usize,
        then: After,
        _keep: Option<Arc<Region>>,
    },
    Discard {
        left: usize,
        then: After,
    },
    Notify {
        buf: Vec<u8>,
        want: usize,
    },
    NotifyBlocked(Vec<u8>),
}

pub(crate) struct Stream {
    pub sock: mio::net::TcpStream,
    /// Readiness learned from epoll (edge-triggered), cleared when a
    /// syscall says EAGAIN: an idle stream costs no syscall per poll.
    pub readable: bool,
    pub writable: bool,
    limits: StreamLimits,
    tx: VecDeque<TxFrame>,
    /// Bytes of `tx.front()` already written.
    head_sent: usize,
    notify_queued: usize,
    pending: VecDeque<Pending>,
    /// Requests received from the peer whose response is not yet written.
    peer_owed: usize,
    rbuf: Box<[u8]>,
    rs: usize,
    re: usize,
    rx: Rx,
    /// This stream's index in its connection (names it in `Stage`).
    idx: u8,
    next_gate: u64,
}

// SAFETY: the raw pointers in a stream's frames, pending requests and
// receive state point into registered regions that the same structures keep
// alive through `Arc<Region>` (or into buffers they own); moving the stream
// to another thread moves those owners with it.
unsafe impl Send for Stream {}

enum Read {
    Got(usize),
    WouldBlock,
}

impl Stream {
    pub fn new(sock: mio::net::TcpStream, limits: StreamLimits, idx: u8) -> Self {
        Self {
            sock,
            readable: true,
            writable: true,
            limits,
            tx: VecDeque::with_capacity(limits.own_max + limits.peer_max + NOTIFY_QUEUE),
            head_sent: 0,
            notify_queued: 0,
            pending: VecDeque::with_capacity(limits.own_max),
            peer_owed: 0,
            rbuf: vec![0u8; RBUF_BYTES].into_boxed_slice(),
            rs: 0,
            re: 0,
            rx: Rx::Header,
            idx,
            next_gate: 1,
        }
    }

    pub fn can_request(&self) -> bool {
        self.pending.len() < self.limits.own_max
    }

    pub fn can_notify(&self) -> bool {
        self.notify_queued < NOTIFY_QUEUE
    }

    pub fn has_tx(&self) -> bool {
        !self.tx.is_empty()
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    pub fn oldest_pending(&self) -> Option<Instant> {
        self.pending.front().map(|p| p.sent_at)
    }

    /// Queues one request frame. The caller checked `can_request`, and for a
    /// WRITE that `[src, src + len)` lies in `keep`; for a READ the same of
    /// the destination.
    #[allow(clippy::too_many_arguments)]
    pub fn push_request(
        &mut self,
        kind: OpKind,
        slot: u32,
        op_id: u64,
        key: KeyRef,
        addr: u64,
        local: *mut u8,
        len: usize,
        keep: &Arc<Region>,
        now: Instant,
    ) {
        let rkey = key.rkey;
        debug_assert!(self.can_request());
        let (dk, payload, plen) = match kind {
            OpKind::Write => (DataKind::WriteReq, local as *const u8, len),
            OpKind::Read => (DataKind::ReadReq, std::ptr::null(), 0),
        };
        let hdr = DataHeader::request(dk, key.rkey, key.tag, op_id, addr, len as u64).encode();
        self.tx.push_back(TxFrame {
            hdr,
            payload,
            len: plen,
            class: FrameClass::Request,
            _keep: Keep::None,
            gate: 0,
        });
        let op = PendingOp {
            slot,
            kind,
            dst: local,
            len,
            rkey,
            addr,
            sent_at: now,
            _keep: keep.clone(),
            post: None,
        };
        self.pending.push_back(Pending { op_id, op });
    }

    pub fn push_notify(&mut self, payload: Vec<u8>) {
        debug_assert!(self.can_notify());
        let hdr = DataHeader::request(DataKind::Notify, 0, 0, 0, 0, payload.len() as u64).encode();
        let (ptr, len) = (payload.as_ptr(), payload.len());
        self.notify_queued += 1;
        self.tx.push_back(TxFrame {
            hdr,
            payload: ptr,
            len,
            class: FrameClass::Notify,
            _keep: Keep::Bytes(payload),
            gate: 0,
        });
    }

    /// The READ just queued lands in a bounce buffer and goes on into GPU
    /// memory at `gpu_dst` (in `keep`) before the op completes.
    pub fn stage_last_read(&mut self, gpu_dst: u64, keep: Arc<Region>) {
        if let Some(p) = self.pending.back_mut() {
            p.op.post = Some((gpu_dst, keep));
        }
    }

    fn push_response(&mut self, hdr: DataHeader, payload: *const u8, keep: Keep) {
        self.push_response_gated(hdr, payload, keep, 0);
    }

    fn push_response_gated(&mut self, hdr: DataHeader, payload: *const u8, keep: Keep, gate: u64) {
        let len = hdr.payload_len() as usize;
        // Room is guaranteed: responses never exceed the peer's declared
        // in-flight limit, which `take_request` enforces.
        self.tx.push_back(TxFrame {
            hdr: hdr.encode(),
            payload,
            len,
            class: FrameClass::Response,
            _keep: keep,
            gate,
        });
    }

    fn new_gate(&mut self) -> u64 {
        let g = self.next_gate;
        self.next_gate += 1;
        g
    }

    /// A staged copy for gated frame `gate` ended: the frame may go. If the
    /// copy failed, the response says so instead (and carries no payload).
    /// Frames behind it wait: responses stay in request order.
    pub fn release(&mut self, gate: u64, ok: bool) {
        let Some(f) = self.tx.iter_mut().find(|f| f.gate == gate) else {
            return;
        };
        f.gate = 0;
        if !ok {
            if let Ok(h) = DataHeader::decode(&f.hdr) {
                f.hdr = DataHeader::response(h.kind, Status::DeviceMemory, h.op_id, 0).encode();
                f.payload = std::ptr::null();
                f.len = 0;
                f._keep = Keep::None;
            }
        }
    }

    /// Fails every outstanding request of this stream.
    pub fn fail_pending(&mut self, err: &Error, sink: &mut impl Sink) {
        for p in self.pending.drain(..) {
            sink.done(p.slot, Err(err.duplicate()));
        }
    }

    /// Writes queued frames until the socket would block. Returns whether
    /// any byte was written.
    pub fn flush(&mut self) -> Result<bool, String> {
        let fd = self.sock.as_raw_fd();
        let mut progress = false;
        while self.writable && self.tx.front().is_some_and(|f| f.gate == 0) {
            let empty = libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            };
            let mut iov = [empty; MAX_IOV];
            let mut n_iov = 0;
            let mut skip = self.head_sent;
            for f in self.tx.iter() {
                if n_iov + 2 > MAX_IOV || f.gate != 0 {
                    break;
                }
                if skip < HDR {
                    iov[n_iov] = libc::iovec {
                        iov_base: f.hdr[skip..].as_ptr() as *mut _,
                        iov_len: HDR - skip,
                    };
                    n_iov += 1;
                    skip = 0;
                } else {
                    skip -= HDR;
                }
                if f.len > skip {
                    // SAFETY: `skip < f.len`, so the pointer stays inside the payload.
                    let base = unsafe { f.payload.add(skip) };
                    iov[n_iov] = libc::iovec {
                        iov_base: base as *mut _,
                        iov_len: f.len - skip,
                    };
                    n_iov += 1;
                }
                skip = 0;
            }
            // SAFETY: every iovec points into a frame header we own or a
            // payload kept alive by the frame's `_keep` / pending entry; the
            // frames stay queued (not moved: VecDeque does not reallocate,
            // its capacity is never exceeded) until the call returns.
            let n = unsafe { libc::writev(fd, iov.as_ptr(), n_iov as libc::c_int) };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock => {
                        self.writable = false;
                        return Ok(progress);
                    }
                    io::ErrorKind::Interrupted => continue,
                    _ => return Err(format!("send failed: {e}")),
                }
            }
            progress = true;
            let mut n = n as usize;
            while n > 0 {
                let f = self
                    .tx
                    .front()
                    .expect("bytes written belong to queued frames");
                let left = HDR + f.len - self.head_sent;
                if n < left {
                    self.head_sent += n;
                    break;
                }
                n -= left;
                self.head_sent = 0;
                let f = self.tx.pop_front().expect("front exists");
                match f.class {
                    FrameClass::Response => self.peer_owed -= 1,
                    FrameClass::Notify => self.notify_queued -= 1,
                    FrameClass::Request => {}
                }
            }
        }
        Ok(progress)
    }

    fn read(&mut self, dst: Option<(*mut u8, usize)>) -> Result<Read, String> {
        let fd = self.sock.as_raw_fd();
        if self.rs == self.re {
            self.rs = 0;
            self.re = 0;
        } else if self.re == self.rbuf.len() {
            self.rbuf.copy_within(self.rs..self.re, 0);
            self.re -= self.rs;
            self.rs = 0;
        }
        let spare = &mut self.rbuf[self.re..];
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 2];
        let mut n_iov = 0;
        let mut first = 0;
        if let Some((p, len)) = dst {
            iov[0] = libc::iovec {
                iov_base: p as *mut _,
                iov_len: len,
            };
            n_iov = 1;
            first = len;
        }
        iov[n_iov] = libc::iovec {
            iov_base: spare.as_mut_ptr() as *mut _,
            iov_len: spare.len(),
        };
        n_iov += 1;
        loop {
            // SAFETY: `dst` is registered memory the caller checked to hold
            // `len` bytes and keeps alive; `spare` is our own buffer.
            let n = unsafe { libc::readv(fd, iov.as_ptr(), n_iov as libc::c_int) };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock => {
                        self.readable = false;
                        return Ok(Read::WouldBlock);
                    }
                    io::ErrorKind::Interrupted => continue,
                    _ => return Err(format!("receive failed: {e}")),
                }
            }
            if n == 0 {
                return Err("peer closed the connection".to_owned());
            }
            let n = n as usize;
            self.re += n.saturating_sub(first);
            return Ok(Read::Got(n.min(first)));
        }
    }

    /// Reads and handles frames until the socket would block. Returns
    /// whether anything happened; `Err` means the stream is broken.
    pub fn on_readable(
        &mut self,
        regions: &mut impl Regions,
        sink: &mut impl Sink,
    ) -> Result<bool, String> {
        let mut progress = false;
        loop {
            // Frames already buffered are handled even when the socket is dry.
            if !self.readable && self.re - self.rs < HDR && matches!(self.rx, Rx::Header) {
                return Ok(progress);
            }
            match &mut self.rx {
                Rx::Header => {
                    if self.re - self.rs < HDR {
                        // Hand back what this read brought (replies to send,
                        // completions to publish) before the next read: that
                        // read is usually EAGAIN, and someone is waiting.
                        if progress {
                            return Ok(progress);
                        }
                        match self.read(None)? {
                            Read::WouldBlock => return Ok(progress),
                            Read::Got(_) => {
                                progress = true;
                                continue;
                            }
                        }
                    }
                    let h = DataHeader::decode(&self.rbuf[self.rs..self.rs + HDR])
                        .map_err(|e| e.to_string())?;
                    self.rs += HDR;
                    if !self.on_header(h, regions, sink)? {
                        return Ok(progress);
                    }
                    progress = true;
                }
                Rx::Payload { dst, left, .. } => {
                    let avail = self.re - self.rs;
                    let n = avail.min(*left);
                    if n > 0 {
                        // SAFETY: `dst` has `left` writable bytes (checked when the
                        // state was entered); the source is our buffer.
                        unsafe {
                            std::ptr::copy_nonoverlapping(self.rbuf[self.rs..].as_ptr(), *dst, n)
                        };
                        self.rs += n;
                        // SAFETY: n <= left, so this stays within the destination.
                        *dst = unsafe { dst.add(n) };
                        *left -= n;
                    }
                    if *left > 0 {
                        let target = (*dst, *left);
                        match self.read(Some(target))? {
                            Read::WouldBlock => return Ok(progress),
                            Read::Got(got) => {
                                progress = true;
                                if let Rx::Payload { dst, left, .. } = &mut self.rx {
                                    // SAFETY: got <= left.
                                    *dst = unsafe { dst.add(got) };
                                    *left -= got;
                                }
                            }
                        }
                        continue;
                    }
                    let Rx::Payload { then, .. } = std::mem::replace(&mut self.rx, Rx::Header)
                    else {
                        unreachable!()
                    };
                    self.finish(then, sink);
                }
                Rx::Discard { left, .. } => {
                    let n = (self.re - self.rs).min(*left);
                    self.rs += n;
                    *left -= n;
                    if *left > 0 {
                        match self.read(None)? {
                            Read::WouldBlock => return Ok(progress),
                            Read::Got(_) => progress = true,
                        }
                        continue;
                    }
                    let Rx::Discard { then, .. } = std::mem::replace(&mut self.rx, Rx::Header)
                    else {
                        unreachable!()
                    };
                    self.finish(then, sink);
                }
                Rx::Notify { buf, want } => {
                    let n = (self.re - self.rs).min(*want - buf.len());
                    buf.extend_from_slice(&self.rbuf[self.rs..self.rs + n]);
                    self.rs += n;
                    if buf.len() < *want {
                        match self.read(None)? {
                            Read::WouldBlock => return Ok(progress),
                            Read::Got(_) => progress = true,
                        }
                        continue;
                    }
                    let Rx::Notify { buf, .. } = std::mem::replace(&mut self.rx, Rx::Header) else {
                        unreachable!()
                    };
                    if let Err(back) = sink.notify(buf) {
                        self.rx = Rx::NotifyBlocked(back);
                        return Ok(progress);
                    }
                    progress = true;
                }
                Rx::NotifyBlocked(_) => {
                    let Rx::NotifyBlocked(buf) = std::mem::replace(&mut self.rx, Rx::Header) else {
                        unreachable!()
                    };
                    if let Err(back) = sink.notify(buf) {
                        // The inbox is full: leave the socket unread, which
                        // pushes back on the sender through TCP.
                        self.rx = Rx::NotifyBlocked(back);
                        return Ok(progress);
                    }
                    progress = true;
                }
            }
        }
    }

    fn take_request(&mut self) -> Result<(), String> {
        if self.peer_owed >= self.limits.peer_max {
            return Err(format!(
                "peer sent more than its declared {} requests in flight",
                self.limits.peer_max
            ));
        }
        self.peer_owed += 1;
        Ok(())
    }

    /// Handles one header. `Ok(false)`: it needs a bounce buffer and none
    /// is free; the header is put back, to be read again later.
    fn on_header(
        &mut self,
        h: DataHeader,
        regions: &mut impl Regions,
        sink: &mut impl Sink,
    ) -> Result<bool, String> {
        match h.kind {
            DataKind::WriteReq => {
                self.take_request()?;
                let then_ok = |status| After::Ack {
                    op_id: h.op_id,
                    status,
                };
                let found = regions.check(
                    KeyRef {
                        rkey: h.rkey,
                        tag: h.tag,
                    },
                    h.addr,
                    h.len,
                    Access::REMOTE_WRITE,
                );
                self.rx = match found {
                    Ok((r, off)) if r.mem.is_device() => {
                        let len = h.len as usize;
                        match sink.bounce(len) {
                            Bounce::Ready(b) => Rx::Payload {
                                dst: b.ptr,
                                left: len,
                                then: After::AckStaged {
                                    op_id: h.op_id,
                                    gpu_dst: r.addr() + off as u64,
                                    gpu: r,
                                    bounce: b.clone(),
                                    len,
                                },
                                _keep: Some(b),
                            },
                            Bounce::Busy => return Ok(self.unread_request()),
                            Bounce::Never => Rx::Discard {
                                left: len,
                                then: then_ok(Status::DeviceMemory),
                            },
                        }
                    }
                    Ok((r, off)) => Rx::Payload {
                        // SAFETY: `check` proved [off, off + len) lies inside the region.
                        dst: unsafe { r.ptr.add(off) },
                        left: h.len as usize,
                        then: then_ok(Status::Ok),
                        _keep: Some(r),
                    },
                    Err(status) => Rx::Discard {
                        left: h.len as usize,
                        then: then_ok(status),
                    },
                };
            }
            DataKind::ReadReq => {
                self.take_request()?;
                match regions.check(
                    KeyRef {
                        rkey: h.rkey,
                        tag: h.tag,
                    },
                    h.addr,
                    h.len,
                    Access::REMOTE_READ,
                ) {
                    Ok((r, off)) if r.mem.is_device() => {
                        let len = h.len as usize;
                        match sink.bounce(len) {
                            Bounce::Ready(b) => {
                                // Sent once the GPU→bounce copy is done.
                                let gate = self.new_gate();
                                let hdr = DataHeader::response(
                                    DataKind::ReadResp,
                                    Status::Ok,
                                    h.op_id,
                                    h.len,
                                );
                                self.push_response_gated(hdr, b.ptr, Keep::Region(b.clone()), gate);
                                sink.gpu_stage(Stage {
                                    stream: self.idx,
                                    gate,
                                    slot: 0,
                                    dst: b.addr(),
                                    src: r.addr() + off as u64,
                                    len,
                                    keep: r,
                                    keep2: b,
                                });
                            }
                            Bounce::Busy => return Ok(self.unread_request()),
                            Bounce::Never => {
                                let hdr = DataHeader::response(
                                    DataKind::ReadResp,
                                    Status::DeviceMemory,
                                    h.op_id,
                                    0,
                                );
                                self.push_response(hdr, std::ptr::null(), Keep::None);
                            }
                        }
                    }
                    Ok((r, off)) => {
                        // SAFETY: `check` proved [off, off + len) lies inside the region.
                        let src = unsafe { r.ptr.add(off) };
                        let hdr =
                            DataHeader::response(DataKind::ReadResp, Status::Ok, h.op_id, h.len);
                        self.push_response(hdr, src, Keep::Region(r));
                    }
                    Err(status) => {
                        let hdr = DataHeader::response(DataKind::ReadResp, status, h.op_id, 0);
                        self.push_response(hdr, std::ptr::null(), Keep::None);
                    }
                }
            }
            DataKind::Notify => {
                self.rx = Rx::Notify {
                    buf: Vec::with_capacity(h.len as usize),
                    want: h.len as usize,
                };
            }
            DataKind::WriteAck | DataKind::ReadResp => {
                let p = self
                    .pending
                    .front()
                    .ok_or_else(|| format!("{:?} with no request outstanding", h.kind))?;
                let want = if p.kind == OpKind::Write {
                    DataKind::WriteAck
                } else {
                    DataKind::ReadResp
                };
                if p.op_id != h.op_id || h.kind != want {
                    return Err(format!(
                        "response {:?} for op {:#x}, but the oldest request is {} op {:#x}",
                        h.kind, h.op_id, p.kind, p.op_id
                    ));
                }
                if h.kind == DataKind::ReadResp && h.status == Status::Ok {
                    if h.len != p.len as u64 {
                        return Err(format!(
                            "READ response carries {} bytes, {} were asked",
                            h.len, p.len
                        ));
                    }
                    self.rx = Rx::Payload {
                        dst: p.dst,
                        left: p.len,
                        then: After::ReadDone,
                        _keep: None,
                    };
                    return Ok(true);
                }
                let p = self.pending.pop_front().expect("front exists");
                sink.done(p.slot, p.outcome(h.status));
            }
        }
        Ok(true)
    }

    /// Puts back the request header just taken (no bounce buffer free).
    fn unread_request(&mut self) -> bool {
        self.rs -= HDR;
        self.peer_owed -= 1;
        false
    }

    fn finish(&mut self, then: After, sink: &mut impl Sink) {
        match then {
            After::Ack { op_id, status } => {
                let hdr = DataHeader::response(DataKind::WriteAck, status, op_id, 0);
                self.push_response(hdr, std::ptr::null(), Keep::None);
            }
            After::ReadDone => {
                let p = self
                    .pending
                    .pop_front()
                    .expect("a READ response matched the front request");
                match p.op.post {
                    // Landed in a bounce buffer: on into GPU memory first.
                    Some((gpu_dst, gpu)) => sink.gpu_stage(Stage {
                        stream: self.idx,
                        gate: 0,
                        slot: p.op.slot,
                        dst: gpu_dst,
                        src: p.op.dst as u64,
                        len: p.op.len,
                        keep: gpu,
                        keep2: p.op._keep,
                    }),
                    None => sink.done(p.slot, Ok(())),
                }
            }
            After::AckStaged {
                op_id,
                gpu_dst,
                gpu,
                bounce,
                len,
            } => {
                let gate = self.new_gate();
                let hdr = DataHeader::response(DataKind::WriteAck, Status::Ok, op_id, 0);
                self.push_response_gated(hdr, std::ptr::null(), Keep::None, gate);
                sink.gpu_stage(Stage {
                    stream: self.idx,
                    gate,
                    slot: 0,
                    dst: gpu_dst,
                    src: bounce.addr(),
                    len,
                    keep: gpu,
                    keep2: bounce,
                });
            }
        }
    }
}

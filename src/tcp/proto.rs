//! The protocol of one tcp data stream, with no I/O: a state machine that
//! takes received bytes, time and copy completions in, and says what to
//! send and where the next bytes should land.
//!
//! The driver (`stream.rs`, or the `Pair` harness in tests) calls, in any
//! interleaving:
//!
//! * `push_request` / `push_notify` to queue frames (after `can_request` /
//!   `can_notify`), `release` when a staged GPU copy of a gated frame ends;
//! * `tx_iovecs` to learn what may be written now (frames in order, a gated
//!   frame and everything behind it held back), then `on_sent(n)` with the
//!   number of bytes the socket took;
//! * `rx_iovecs` to learn where received bytes go (the rest of a payload's
//!   destination first, then the header buffer), then `on_received(n)`;
//! * `step` to handle what is buffered, one unit at a time, until it says
//!   `NeedBytes` (read more) or `Blocked` (the shard must make room first:
//!   a full inbox, or no bounce buffer free);
//! * `oldest_pending` for the op timeout, `fail_pending` when the stream
//!   dies.
//!
//! Every memory range it hands out lies in a `RegionSlice` it holds, so the
//! pointers in `tx_iovecs` / `rx_iovecs` stay valid until the next call
//! that takes `&mut self`.
//!
//! On an authenticated connection (`Integrity`) every frame header is
//! followed by a 16-byte tag over its sequence number and the header, so a
//! relay can neither inject, replay, reorder nor alter a frame's header
//! (its key, address, length, op id): the frame fails verification before
//! anything acts on it and the connection dies. In `full` mode a frame with
//! a payload also ends with a tag over the payload, checked before the op
//! completes (a READ's data) or is acknowledged (a WRITE's).

use std::collections::VecDeque;
use std::time::Instant;

use crate::auth::{ct_eq, FrameKey, Tag, TAG_LEN};
use crate::error::{Error, OpKind};
use crate::region::{Access, KeyRef, RegionSlice, Regions};
use crate::wire::{DataHeader, DataKind, Status, DATA_HEADER_LEN};
use crate::xfer::{Bounce, PendingOp, Sink, Stage};

const HDR: usize = DATA_HEADER_LEN;
/// Receive buffer for headers (and payload bytes that share their read).
pub(crate) const RBUF_BYTES: usize = 256 * 1024;
/// iovecs gathered into one `writev`.
pub(crate) const MAX_IOV: usize = 64;
/// Notifications queued for sending per stream.
pub(crate) const NOTIFY_QUEUE: usize = 64;

/// Frame MACs of one stream of an authenticated connection.
#[derive(Clone, Debug)]
pub(crate) struct Integrity {
    /// Tags the frames we send.
    pub tx: FrameKey,
    /// Checks the frames we receive.
    pub rx: FrameKey,
    /// Payloads too, not only headers.
    pub full: bool,
}

/// Domain labels, so a header tag and a payload tag of one frame differ.
const TAG_HEADER: &[u8] = b"H";
const TAG_PAYLOAD: &[u8] = b"P";

/// Writes a frame's tags (no-op without integrity). A gated frame is
/// sealed when released, once its payload is final.
fn seal(mac: &Option<Integrity>, f: &mut TxFrame) {
    let Some(m) = mac else {
        return;
    };
    let tag = m.tx.tag(f.seq, &[TAG_HEADER, &f.hdr[..HDR]]);
    f.hdr[HDR..].copy_from_slice(&tag);
    let (p, len) = f.payload.ptr_len();
    if m.full && len > 0 {
        // SAFETY: the payload is host memory (GPU payloads are staged into
        // host bounce buffers first) that the frame keeps alive.
        let bytes = unsafe { std::slice::from_raw_parts(p, len) };
        f.trailer = m.tx.tag(f.seq, &[TAG_PAYLOAD, bytes]);
    }
}

/// Per-stream bounds, fixed at connection time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StreamLimits {
    /// Requests we keep outstanding at most.
    pub own_max: usize,
    /// Requests the peer declared it keeps outstanding at most.
    pub peer_max: usize,
}

/// What a frame's payload is, and what keeps it alive until it is sent.
enum TxPayload {
    None,
    Slice(RegionSlice),
    Bytes(Vec<u8>),
}

impl TxPayload {
    fn ptr_len(&self) -> (*const u8, usize) {
        match self {
            TxPayload::None => (std::ptr::null(), 0),
            TxPayload::Slice(s) => (s.ptr(), s.len()),
            TxPayload::Bytes(b) => (b.as_ptr(), b.len()),
        }
    }
}

struct TxFrame {
    /// The header, then its tag when the stream has integrity.
    hdr: [u8; HDR + TAG_LEN],
    payload: TxPayload,
    /// The payload's tag (`full` integrity, frames with a payload).
    trailer: Tag,
    /// This frame's number among the frames we send on the stream.
    seq: u64,
    class: FrameClass,
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

/// On tcp a request also has the op id its response must echo.
struct Pending {
    op_id: u64,
    op: PendingOp,
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
        gpu: RegionSlice,
        bounce: RegionSlice,
    },
}

enum Rx {
    Header,
    /// Payload bytes go into `into`; `done` of them have arrived.
    Payload {
        into: RegionSlice,
        done: usize,
        then: After,
    },
    Discard {
        left: usize,
        then: After,
        /// The tag of the bytes passing by (`full` integrity).
        run: Option<crate::auth::TagRun>,
    },
    Notify {
        buf: Vec<u8>,
        want: usize,
    },
    NotifyBlocked(Vec<u8>),
    /// A payload is in; its tag (`full` integrity) must match `expected`
    /// before `then` happens.
    Trailer {
        expected: Tag,
        then: Then,
    },
}

/// What follows a checked payload.
enum Then {
    Finish(After),
    Deliver(Vec<u8>),
}

/// What `step` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Handled a unit (a header, a finished payload, a notification).
    Progress,
    /// Needs more bytes from the peer.
    NeedBytes,
    /// Cannot go on until the shard makes room (inbox full, no bounce
    /// buffer free); reading more would only buffer what cannot be handled.
    Blocked,
}

pub(crate) struct StreamProto {
    limits: StreamLimits,
    tx: VecDeque<TxFrame>,
    /// Bytes of `tx.front()` already sent.
    head_sent: usize,
    notify_queued: usize,
    pending: VecDeque<Pending>,
    /// Requests received from the peer whose response is not yet sent.
    peer_owed: usize,
    rbuf: Box<[u8]>,
    rs: usize,
    re: usize,
    rx: Rx,
    /// This stream's index in its connection (names it in `Stage`).
    idx: u8,
    next_gate: u64,
    /// When bytes last arrived (`on_received`'s clock).
    last_rx: Option<Instant>,
    mac: Option<Integrity>,
    /// Numbers of the next frame we send and the next we receive.
    tx_seq: u64,
    rx_seq: u64,
}

// SAFETY: the only raw pointers a StreamProto makes are derived on demand
// from the `RegionSlice`s and buffers it owns; moving it to another thread
// moves those owners with it.
unsafe impl Send for StreamProto {}

const EMPTY_IOV: libc::iovec = libc::iovec {
    iov_base: std::ptr::null_mut(),
    iov_len: 0,
};

/// The key a request header names.
fn key_of(h: &DataHeader) -> KeyRef {
    KeyRef {
        rkey: h.rkey,
        tag: h.tag,
    }
}

impl StreamProto {
    pub fn new(limits: StreamLimits, idx: u8, mac: Option<Integrity>) -> Self {
        Self {
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
            last_rx: None,
            mac,
            tx_seq: 0,
            rx_seq: 0,
        }
    }

    /// Bytes of a header on the wire (with its tag, if any).
    fn hdr_len(&self) -> usize {
        HDR + if self.mac.is_some() { TAG_LEN } else { 0 }
    }

    /// Bytes of a payload tag after a payload of `len` bytes.
    fn trailer_len(&self, len: usize) -> usize {
        match &self.mac {
            Some(m) if m.full && len > 0 => TAG_LEN,
            _ => 0,
        }
    }

    /// Queues a frame; numbers it, and tags it unless it is gated (then
    /// `release` does, once its payload is final).
    fn push_frame(&mut self, hdr: [u8; HDR], payload: TxPayload, class: FrameClass, gate: u64) {
        let mut full = [0u8; HDR + TAG_LEN];
        full[..HDR].copy_from_slice(&hdr);
        let mut f = TxFrame {
            hdr: full,
            payload,
            trailer: [0; TAG_LEN],
            seq: self.tx_seq,
            class,
            gate,
        };
        self.tx_seq += 1;
        if gate == 0 {
            seal(&self.mac, &mut f);
        }
        self.tx.push_back(f);
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

    /// Whether the front frame may be sent now (queued and not gated).
    pub fn tx_ready(&self) -> bool {
        self.tx.front().is_some_and(|f| f.gate == 0)
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    #[cfg(test)]
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    pub fn oldest_pending(&self) -> Option<Instant> {
        self.pending.front().map(|p| p.op.sent_at)
    }

    /// Queues one request frame for `local` (the source of a WRITE, the
    /// destination of a READ). The caller checked `can_request`.
    #[allow(clippy::too_many_arguments)]
    pub fn push_request(
        &mut self,
        kind: OpKind,
        slot: u32,
        op_id: u64,
        key: KeyRef,
        addr: u64,
        local: RegionSlice,
        now: Instant,
    ) {
        debug_assert!(self.can_request());
        let len = local.len();
        let (dk, payload) = match kind {
            OpKind::Write => (DataKind::WriteReq, TxPayload::Slice(local.clone())),
            OpKind::Read => (DataKind::ReadReq, TxPayload::None),
        };
        let hdr = DataHeader::request(dk, key.rkey, key.tag, op_id, addr, len as u64).encode();
        self.push_frame(hdr, payload, FrameClass::Request, 0);
        let op = PendingOp {
            slot,
            kind,
            local,
            rkey: key.rkey,
            addr,
            sent_at: now,
            post: None,
        };
        self.pending.push_back(Pending { op_id, op });
    }

    pub fn push_notify(&mut self, payload: Vec<u8>) {
        debug_assert!(self.can_notify());
        let hdr = DataHeader::request(DataKind::Notify, 0, 0, 0, 0, payload.len() as u64).encode();
        self.notify_queued += 1;
        self.push_frame(hdr, TxPayload::Bytes(payload), FrameClass::Notify, 0);
    }

    /// The READ just queued lands in a bounce buffer and goes on into GPU
    /// memory `gpu` before the op completes.
    pub fn stage_last_read(&mut self, gpu: RegionSlice) {
        if let Some(p) = self.pending.back_mut() {
            p.op.post = Some(gpu);
        }
    }

    fn push_response(&mut self, hdr: DataHeader, payload: TxPayload, gate: u64) {
        // Room is guaranteed: responses never exceed the peer's declared
        // in-flight limit, which `take_request` enforces.
        self.push_frame(hdr.encode(), payload, FrameClass::Response, gate);
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
            if let Ok(h) = DataHeader::decode(&f.hdr[..HDR]) {
                f.hdr[..HDR].copy_from_slice(
                    &DataHeader::response(h.kind, Status::DeviceMemory, h.op_id, 0).encode(),
                );
                f.payload = TxPayload::None;
            }
        }
        seal(&self.mac, f);
    }

    /// Fails every outstanding request of this stream.
    pub fn fail_pending(&mut self, err: &Error, sink: &mut impl Sink) {
        for p in self.pending.drain(..) {
            sink.done(p.op.slot, Err(err.duplicate()));
        }
    }

    /// Fills `iov` with the bytes that may be sent now, in order (up to a
    /// gated frame); returns how many entries it used. The pointers stay
    /// valid until the next call that takes `&mut self`.
    pub fn tx_iovecs(&self, iov: &mut [libc::iovec]) -> usize {
        let hdr_len = self.hdr_len();
        let mut n_iov = 0;
        let mut skip = self.head_sent;
        for f in self.tx.iter() {
            if n_iov + 3 > iov.len() || f.gate != 0 {
                break;
            }
            let (p, len) = f.payload.ptr_len();
            let trailer = &f.trailer[..self.trailer_len(len)];
            for (base, seg_len) in [
                (f.hdr.as_ptr(), hdr_len),
                (p, len),
                (trailer.as_ptr(), trailer.len()),
            ] {
                if skip >= seg_len {
                    skip -= seg_len;
                    continue;
                }
                iov[n_iov] = libc::iovec {
                    // In bounds: skip < seg_len.
                    iov_base: base.wrapping_add(skip) as *mut _,
                    iov_len: seg_len - skip,
                };
                n_iov += 1;
                skip = 0;
            }
        }
        n_iov
    }

    /// `n` bytes of what `tx_iovecs` offered were sent: frames wholly sent
    /// leave the queue (and their payload's memory is let go).
    pub fn on_sent(&mut self, mut n: usize) {
        while n > 0 {
            let f = self.tx.front().expect("bytes sent belong to queued frames");
            let len = f.payload.ptr_len().1;
            let left = self.hdr_len() + len + self.trailer_len(len) - self.head_sent;
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

    /// Whether the receive state sits between frames (the driver hands
    /// back what it has before reading again there).
    pub fn at_frame_boundary(&self) -> bool {
        matches!(self.rx, Rx::Header)
    }

    /// Where the next received bytes go: the rest of a payload's
    /// destination (when one is being received), then the free part of the
    /// header buffer. Returns how many entries of `iov` it filled. The
    /// pointers stay valid until the next call that takes `&mut self`.
    pub fn rx_iovecs(&mut self, iov: &mut [libc::iovec; 2]) -> usize {
        if self.rs == self.re {
            self.rs = 0;
            self.re = 0;
        } else if self.re == self.rbuf.len() {
            self.rbuf.copy_within(self.rs..self.re, 0);
            self.re -= self.rs;
            self.rs = 0;
        }
        let mut n_iov = 0;
        if let Rx::Payload { into, done, .. } = &self.rx {
            if *done < into.len() {
                iov[0] = libc::iovec {
                    // In bounds: done < len.
                    iov_base: into.ptr().wrapping_add(*done) as *mut _,
                    iov_len: into.len() - done,
                };
                n_iov = 1;
            }
        }
        let spare = &mut self.rbuf[self.re..];
        iov[n_iov] = libc::iovec {
            iov_base: spare.as_mut_ptr() as *mut _,
            iov_len: spare.len(),
        };
        for e in iov.iter_mut().skip(n_iov + 1) {
            *e = EMPTY_IOV;
        }
        n_iov + 1
    }

    /// Whether a frame has begun arriving and stopped: bytes of it are
    /// here (or being received into its destination) and none came for
    /// longer than `limit`. A peer that sends half a frame and goes quiet
    /// holds our memory; the connection fails instead.
    pub fn inbound_stalled(&self, now: Instant, limit: std::time::Duration) -> bool {
        // Waiting on the peer, not on ourselves: a partial header, or a
        // payload or notification not yet whole. (A header put back for
        // want of a bounce buffer, or a notification held for a full inbox,
        // waits on this side.)
        let mid_frame = match &self.rx {
            Rx::Header => (1..self.hdr_len()).contains(&(self.re - self.rs)),
            Rx::NotifyBlocked(_) => false,
            Rx::Payload { .. } | Rx::Discard { .. } | Rx::Notify { .. } | Rx::Trailer { .. } => {
                true
            }
        };
        mid_frame
            && self
                .last_rx
                .is_some_and(|t| now.saturating_duration_since(t) > limit)
    }

    /// `n` bytes landed where the last `rx_iovecs` said, in order, at `now`.
    pub fn on_received(&mut self, n: usize, now: Instant) {
        self.last_rx = Some(now);
        let mut n = n;
        if let Rx::Payload { into, done, .. } = &mut self.rx {
            let got = n.min(into.len() - *done);
            *done += got;
            n -= got;
        }
        debug_assert!(self.re + n <= self.rbuf.len());
        self.re += n;
    }

    /// Copies `bytes` as if received (tests and harnesses that have bytes
    /// rather than a socket); returns how many it took.
    #[cfg(test)]
    pub fn receive_bytes(&mut self, bytes: &[u8], now: Instant) -> usize {
        let mut iov = [EMPTY_IOV; 2];
        let n_iov = self.rx_iovecs(&mut iov);
        let mut taken = 0;
        for v in &iov[..n_iov] {
            let n = v.iov_len.min(bytes.len() - taken);
            // SAFETY: `rx_iovecs` gave `v` as `iov_len` writable bytes (a
            // held region slice or our buffer), distinct from `bytes`.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes[taken..].as_ptr(), v.iov_base as *mut u8, n)
            };
            taken += n;
        }
        self.on_received(taken, now);
        taken
    }

    /// Handles one unit of what is buffered. `Err` means the peer broke the
    /// protocol (the stream, and its connection, are dead).
    pub fn step(
        &mut self,
        regions: &mut impl Regions,
        sink: &mut impl Sink,
    ) -> Result<Step, String> {
        match self.rx {
            Rx::Header => self.step_header(regions, sink),
            Rx::Payload { .. } => self.step_payload(sink),
            Rx::Discard { .. } => self.step_discard(sink),
            Rx::Trailer { .. } => self.step_trailer(sink),
            Rx::Notify { .. } => self.step_notify(sink),
            Rx::NotifyBlocked(_) => self.step_blocked(sink),
        }
    }

    /// A frame header: checked (its MAC too), then acted on.
    fn step_header(
        &mut self,
        regions: &mut impl Regions,
        sink: &mut impl Sink,
    ) -> Result<Step, String> {
        let hdr_len = self.hdr_len();
        if self.re - self.rs < hdr_len {
            return Ok(Step::NeedBytes);
        }
        let raw = &self.rbuf[self.rs..self.rs + hdr_len];
        if let Some(m) = &self.mac {
            let want = m.rx.tag(self.rx_seq, &[TAG_HEADER, &raw[..HDR]]);
            if !ct_eq(&want, &raw[HDR..]) {
                return Err(format!(
                    "frame {} failed authentication (injected, replayed or altered on the path)",
                    self.rx_seq
                ));
            }
        }
        let h = DataHeader::decode(&raw[..HDR]).map_err(|e| e.to_string())?;
        self.rs += hdr_len;
        self.rx_seq += 1;
        if !self.on_header(h, regions, sink)? {
            return Ok(Step::Blocked);
        }
        Ok(Step::Progress)
    }

    /// Payload landing straight in its destination.
    fn step_payload(&mut self, sink: &mut impl Sink) -> Result<Step, String> {
        let Rx::Payload { into, done, .. } = &mut self.rx else {
            unreachable!("step dispatches on the state")
        };
        let n = (self.re - self.rs).min(into.len() - *done);
        if n > 0 {
            // SAFETY: `into` holds `len` writable bytes alive, and
            // `done + n <= len`; the source is our own buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.rbuf[self.rs..].as_ptr(),
                    into.ptr().add(*done),
                    n,
                )
            };
            self.rs += n;
            *done += n;
        }
        if *done < into.len() {
            return Ok(Step::NeedBytes);
        }
        let Rx::Payload { then, into, .. } = std::mem::replace(&mut self.rx, Rx::Header) else {
            unreachable!()
        };
        if let Some(m) = self.mac.as_ref().filter(|m| m.full && into.len() > 0) {
            // SAFETY: `into` is host memory (a window or a bounce
            // buffer) we hold, and its bytes have all arrived.
            let bytes = unsafe { std::slice::from_raw_parts(into.ptr(), into.len()) };
            let expected = m.rx.tag(self.rx_seq - 1, &[TAG_PAYLOAD, bytes]);
            self.rx = Rx::Trailer {
                expected,
                then: Then::Finish(then),
            };
            return Ok(Step::Progress);
        }
        self.finish(then, sink);
        Ok(Step::Progress)
    }

    /// Payload of a refused WRITE, read and dropped (the stream stays in step).
    fn step_discard(&mut self, sink: &mut impl Sink) -> Result<Step, String> {
        let Rx::Discard { left, run, .. } = &mut self.rx else {
            unreachable!("step dispatches on the state")
        };
        let n = (self.re - self.rs).min(*left);
        if let Some(r) = run {
            r.update(&self.rbuf[self.rs..self.rs + n]);
        }
        self.rs += n;
        *left -= n;
        if *left > 0 {
            return Ok(Step::NeedBytes);
        }
        let Rx::Discard { then, run, .. } = std::mem::replace(&mut self.rx, Rx::Header) else {
            unreachable!()
        };
        match run {
            Some(r) => {
                self.rx = Rx::Trailer {
                    expected: r.finish(),
                    then: Then::Finish(then),
                }
            }
            None => self.finish(then, sink),
        }
        Ok(Step::Progress)
    }

    /// The MAC trailer after a payload.
    fn step_trailer(&mut self, sink: &mut impl Sink) -> Result<Step, String> {
        let Rx::Trailer { expected, .. } = &mut self.rx else {
            unreachable!("step dispatches on the state")
        };
        if self.re - self.rs < TAG_LEN {
            return Ok(Step::NeedBytes);
        }
        if !ct_eq(&expected[..], &self.rbuf[self.rs..self.rs + TAG_LEN]) {
            return Err(format!(
                "the payload of frame {} failed authentication (altered on the path)",
                self.rx_seq - 1
            ));
        }
        self.rs += TAG_LEN;
        let Rx::Trailer { then, .. } = std::mem::replace(&mut self.rx, Rx::Header) else {
            unreachable!()
        };
        match then {
            Then::Finish(after) => {
                self.finish(after, sink);
                Ok(Step::Progress)
            }
            Then::Deliver(buf) => self.deliver(buf, sink),
        }
    }

    /// A notification's bytes.
    fn step_notify(&mut self, sink: &mut impl Sink) -> Result<Step, String> {
        let Rx::Notify { buf, want } = &mut self.rx else {
            unreachable!("step dispatches on the state")
        };
        let n = (self.re - self.rs).min(*want - buf.len());
        buf.extend_from_slice(&self.rbuf[self.rs..self.rs + n]);
        self.rs += n;
        if buf.len() < *want {
            return Ok(Step::NeedBytes);
        }
        let Rx::Notify { buf, .. } = std::mem::replace(&mut self.rx, Rx::Header) else {
            unreachable!()
        };
        if let Some(m) = self.mac.as_ref().filter(|m| m.full && !buf.is_empty()) {
            self.rx = Rx::Trailer {
                expected: m.rx.tag(self.rx_seq - 1, &[TAG_PAYLOAD, &buf]),
                then: Then::Deliver(buf),
            };
            return Ok(Step::Progress);
        }
        self.deliver(buf, sink)
    }

    /// A notification waiting for room in the inbox.
    fn step_blocked(&mut self, sink: &mut impl Sink) -> Result<Step, String> {
        let Rx::NotifyBlocked(buf) = std::mem::replace(&mut self.rx, Rx::Header) else {
            unreachable!()
        };
        self.deliver(buf, sink)
    }

    fn deliver(&mut self, buf: Vec<u8>, sink: &mut impl Sink) -> Result<Step, String> {
        match sink.notify(buf) {
            Ok(()) => Ok(Step::Progress),
            Err(back) => {
                // The inbox is full: stop reading, which pushes back on
                // the sender through TCP.
                self.rx = Rx::NotifyBlocked(back);
                Ok(Step::Blocked)
            }
        }
    }

    fn take_request(&mut self) -> Result<(), String> {
        if self.peer_owed >= self.limits.peer_max {
            return Err(format!(
                "peer sent more than the agreed {} requests in flight",
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
            DataKind::WriteReq => self.on_write_req(&h, regions, sink),
            DataKind::ReadReq => self.on_read_req(&h, regions, sink),
            DataKind::Notify => {
                self.rx = Rx::Notify {
                    buf: Vec::with_capacity(h.len as usize),
                    want: h.len as usize,
                };
                Ok(true)
            }
            DataKind::WriteAck | DataKind::ReadResp => self.on_response(&h, sink),
        }
    }

    /// A peer's WRITE: its payload goes to the checked window (through a
    /// bounce buffer for GPU memory), or is read and dropped with a refusal.
    /// False: no bounce buffer now, the header is put back.
    fn on_write_req(
        &mut self,
        h: &DataHeader,
        regions: &mut impl Regions,
        sink: &mut impl Sink,
    ) -> Result<bool, String> {
        let key = key_of(h);
        self.take_request()?;
        let then_ok = |status| After::Ack {
            op_id: h.op_id,
            status,
        };
        let len = h.len as usize;
        self.rx = match regions.check(key, h.addr, h.len, Access::REMOTE_WRITE) {
            Ok(w) if w.is_device() => match sink.bounce(len) {
                Bounce::Ready(b) => {
                    let into = RegionSlice::new(&b, 0, len).expect("bounce fits len");
                    Rx::Payload {
                        into: into.clone(),
                        done: 0,
                        then: After::AckStaged {
                            op_id: h.op_id,
                            gpu: w,
                            bounce: into,
                        },
                    }
                }
                Bounce::Busy => return Ok(self.unread_request()),
                Bounce::Never => Rx::Discard {
                    left: len,
                    then: then_ok(Status::DeviceMemory),
                    run: self.payload_run(len),
                },
            },
            Ok(w) => Rx::Payload {
                into: w,
                done: 0,
                then: then_ok(Status::Ok),
            },
            Err(status) => Rx::Discard {
                left: len,
                then: then_ok(status),
                run: self.payload_run(len),
            },
        };

        Ok(true)
    }

    /// A peer's READ: the checked window's bytes are queued as the
    /// response (staged through a bounce buffer for GPU memory), or a
    /// refusal. False: no bounce buffer now, the header is put back.
    fn on_read_req(
        &mut self,
        h: &DataHeader,
        regions: &mut impl Regions,
        sink: &mut impl Sink,
    ) -> Result<bool, String> {
        let key = key_of(h);
        self.take_request()?;
        let len = h.len as usize;
        let refuse = |status| DataHeader::response(DataKind::ReadResp, status, h.op_id, 0);
        match regions.check(key, h.addr, h.len, Access::REMOTE_READ) {
            Ok(w) if w.is_device() => match sink.bounce(len) {
                Bounce::Ready(b) => {
                    let out = RegionSlice::new(&b, 0, len).expect("bounce fits len");
                    // Sent once the GPU→bounce copy is done.
                    let gate = self.new_gate();
                    let hdr = DataHeader::response(DataKind::ReadResp, Status::Ok, h.op_id, h.len);
                    self.push_response(hdr, TxPayload::Slice(out.clone()), gate);
                    sink.gpu_stage(Stage {
                        stream: self.idx,
                        gate,
                        slot: 0,
                        dst: out,
                        src: w,
                    });
                }
                Bounce::Busy => return Ok(self.unread_request()),
                Bounce::Never => {
                    self.push_response(refuse(Status::DeviceMemory), TxPayload::None, 0)
                }
            },
            Ok(w) => {
                let hdr = DataHeader::response(DataKind::ReadResp, Status::Ok, h.op_id, h.len);
                self.push_response(hdr, TxPayload::Slice(w), 0);
            }
            Err(status) => self.push_response(refuse(status), TxPayload::None, 0),
        }

        Ok(true)
    }

    /// A response to our oldest request: it must match it; a READ's
    /// payload then lands in the op's memory.
    fn on_response(&mut self, h: &DataHeader, sink: &mut impl Sink) -> Result<bool, String> {
        let p = self
            .pending
            .front()
            .ok_or_else(|| format!("{:?} with no request outstanding", h.kind))?;
        let want = if p.op.kind == OpKind::Write {
            DataKind::WriteAck
        } else {
            DataKind::ReadResp
        };
        if p.op_id != h.op_id || h.kind != want {
            return Err(format!(
                "response {:?} for op {:#x}, but the oldest request is {} op {:#x}",
                h.kind, h.op_id, p.op.kind, p.op_id
            ));
        }
        if h.kind == DataKind::ReadResp && h.status == Status::Ok {
            if h.len != p.op.local.len() as u64 {
                return Err(format!(
                    "READ response carries {} bytes, {} were asked",
                    h.len,
                    p.op.local.len()
                ));
            }
            self.rx = Rx::Payload {
                into: p.op.local.clone(),
                done: 0,
                then: After::ReadDone,
            };
            return Ok(true);
        }
        let p = self.pending.pop_front().expect("front exists");
        sink.done(p.op.slot, p.op.outcome(h.status));

        Ok(true)
    }

    /// Puts back the request header just taken (no bounce buffer free).
    fn unread_request(&mut self) -> bool {
        self.rs -= self.hdr_len();
        self.rx_seq -= 1;
        self.peer_owed -= 1;
        false
    }

    /// The running tag of a payload that is received but thrown away
    /// (`full` integrity: its tag is still checked).
    fn payload_run(&self, len: usize) -> Option<crate::auth::TagRun> {
        let m = self.mac.as_ref().filter(|m| m.full && len > 0)?;
        let mut r = m.rx.start(self.rx_seq - 1);
        r.update(TAG_PAYLOAD);
        Some(r)
    }

    fn finish(&mut self, then: After, sink: &mut impl Sink) {
        match then {
            After::Ack { op_id, status } => {
                let hdr = DataHeader::response(DataKind::WriteAck, status, op_id, 0);
                self.push_response(hdr, TxPayload::None, 0);
            }
            After::ReadDone => {
                let p = self
                    .pending
                    .pop_front()
                    .expect("a READ response matched the front request");
                match p.op.post {
                    // Landed in a bounce buffer: on into GPU memory first.
                    Some(gpu) => sink.gpu_stage(Stage {
                        stream: self.idx,
                        gate: 0,
                        slot: p.op.slot,
                        dst: gpu,
                        src: p.op.local,
                    }),
                    None => sink.done(p.op.slot, Ok(())),
                }
            }
            After::AckStaged { op_id, gpu, bounce } => {
                let gate = self.new_gate();
                let hdr = DataHeader::response(DataKind::WriteAck, Status::Ok, op_id, 0);
                self.push_response(hdr, TxPayload::None, gate);
                sink.gpu_stage(Stage {
                    stream: self.idx,
                    gate,
                    slot: 0,
                    dst: gpu,
                    src: bounce,
                });
            }
        }
    }
}

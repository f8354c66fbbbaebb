//! What a stream receives: where the next bytes land, and the step that
//! handles one buffered unit at a time (header, payload, trailer,
//! notification), with the responses to our requests.

use std::time::Instant;

use super::pack::Unpack;
use super::{After, Rx, Step, StreamProto, Then, TxPayload, EMPTY_IOV, HDR};
use crate::auth::{ct_eq, TAG_LEN};
use crate::error::{ConnFault, OpKind};
use crate::region::Regions;
use crate::wire::{DataHeader, DataKind, Status};
use crate::xfer::{Sink, Stage};

use super::integrity::{TAG_HEADER, TAG_PAYLOAD};

impl StreamProto {
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
        match &mut self.rx {
            Rx::Payload { into, done, .. } if *done < into.len() => {
                iov[0] = libc::iovec {
                    // In bounds: done < len.
                    iov_base: into.ptr().wrapping_add(*done) as *mut _,
                    iov_len: into.len() - *done,
                };
                n_iov = 1;
            }
            Rx::Packed { buf, done, .. } if *done < buf.len() => {
                iov[0] = libc::iovec {
                    iov_base: buf[*done..].as_mut_ptr() as *mut _,
                    iov_len: buf.len() - *done,
                };
                n_iov = 1;
            }
            _ => {}
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
            Rx::Payload { .. }
            | Rx::Discard { .. }
            | Rx::Notify { .. }
            | Rx::Trailer { .. }
            | Rx::Packed { .. } => true,
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
        let room = match &mut self.rx {
            Rx::Payload { into, done, .. } => Some((into.len(), done)),
            Rx::Packed { buf, done, .. } => Some((buf.len(), done)),
            _ => None,
        };
        if let Some((len, done)) = room {
            let got = n.min(len - *done);
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
    ) -> Result<Step, ConnFault> {
        match self.rx {
            Rx::Header => self.step_header(regions, sink),
            Rx::Payload { .. } => self.step_payload(sink),
            Rx::Discard { .. } => self.step_discard(sink),
            Rx::Trailer { .. } => self.step_trailer(sink),
            Rx::Notify { .. } => self.step_notify(sink),
            Rx::NotifyBlocked(_) => self.step_blocked(sink),
            Rx::Packed { .. } => self.step_packed(),
        }
    }

    /// A frame header: checked (its MAC too), then acted on.
    pub(super) fn step_header(
        &mut self,
        regions: &mut impl Regions,
        sink: &mut impl Sink,
    ) -> Result<Step, ConnFault> {
        let hdr_len = self.hdr_len();
        if self.re - self.rs < hdr_len {
            return Ok(Step::NeedBytes);
        }
        let raw = &self.rbuf[self.rs..self.rs + hdr_len];
        if let Some(m) = &self.mac {
            let want = m.rx.tag(self.rx_seq, &[TAG_HEADER, &raw[..HDR]]);
            if !ct_eq(&want, &raw[HDR..]) {
                return Err(ConnFault::Integrity {
                    what: format!(
                        "frame {} failed authentication (injected, replayed or altered on the path)",
                        self.rx_seq
                    ),
                });
            }
        }
        let h =
            DataHeader::decode(&raw[..HDR]).map_err(|e| ConnFault::misbehaved(e.to_string()))?;
        self.rs += hdr_len;
        self.rx_seq += 1;
        if !self.on_header(h, regions, sink)? {
            return Ok(Step::Blocked);
        }
        Ok(Step::Progress)
    }

    /// Payload landing straight in its destination.
    pub(super) fn step_payload(&mut self, sink: &mut impl Sink) -> Result<Step, ConnFault> {
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

    /// A packed payload arriving into its buffer; whole, it is decoded.
    pub(super) fn step_packed(&mut self) -> Result<Step, ConnFault> {
        let Rx::Packed { buf, done, .. } = &mut self.rx else {
            unreachable!("step dispatches on the state")
        };
        let n = (self.re - self.rs).min(buf.len() - *done);
        buf[*done..*done + n].copy_from_slice(&self.rbuf[self.rs..self.rs + n]);
        self.rs += n;
        *done += n;
        if *done < buf.len() {
            return Ok(Step::NeedBytes);
        }
        let Rx::Packed {
            buf,
            dst,
            then,
            held,
            ..
        } = std::mem::replace(&mut self.rx, Rx::Header)
        else {
            unreachable!()
        };
        if let Some(m) = self.mac.as_ref().filter(|m| m.full) {
            self.rx = Rx::Trailer {
                expected: m.rx.tag(self.rx_seq - 1, &[TAG_PAYLOAD, &buf]),
                then: Then::Unpack(buf, dst, then, held),
            };
            return Ok(Step::Progress);
        }
        self.unpack(buf, dst, then, held);
        Ok(Step::Progress)
    }

    /// Payload of a refused WRITE, read and dropped (the stream stays in step).
    pub(super) fn step_discard(&mut self, sink: &mut impl Sink) -> Result<Step, ConnFault> {
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
    pub(super) fn step_trailer(&mut self, sink: &mut impl Sink) -> Result<Step, ConnFault> {
        let Rx::Trailer { expected, .. } = &mut self.rx else {
            unreachable!("step dispatches on the state")
        };
        if self.re - self.rs < TAG_LEN {
            return Ok(Step::NeedBytes);
        }
        if !ct_eq(&expected[..], &self.rbuf[self.rs..self.rs + TAG_LEN]) {
            return Err(ConnFault::Integrity {
                what: format!(
                    "the payload of frame {} failed authentication (altered on the path)",
                    self.rx_seq - 1
                ),
            });
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
            Then::Unpack(buf, dst, then, held) => {
                self.unpack(buf, dst, then, held);
                Ok(Step::Progress)
            }
        }
    }

    /// A notification's bytes.
    pub(super) fn step_notify(&mut self, sink: &mut impl Sink) -> Result<Step, ConnFault> {
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
    pub(super) fn step_blocked(&mut self, sink: &mut impl Sink) -> Result<Step, ConnFault> {
        let Rx::NotifyBlocked(buf) = std::mem::replace(&mut self.rx, Rx::Header) else {
            unreachable!()
        };
        self.deliver(buf, sink)
    }

    pub(super) fn deliver(
        &mut self,
        buf: Vec<u8>,
        sink: &mut impl Sink,
    ) -> Result<Step, ConnFault> {
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

    pub(super) fn take_request(&mut self) -> Result<(), ConnFault> {
        if self.peer_owed >= self.limits.peer_max {
            return Err(ConnFault::misbehaved(format!(
                "peer sent more than the agreed {} requests in flight",
                self.limits.peer_max
            )));
        }
        self.peer_owed += 1;
        Ok(())
    }

    /// Handles one header. `Ok(false)`: it needs a bounce buffer and none
    /// is free; the header is put back, to be read again later.
    pub(super) fn on_header(
        &mut self,
        h: DataHeader,
        regions: &mut impl Regions,
        sink: &mut impl Sink,
    ) -> Result<bool, ConnFault> {
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

    /// A response to our oldest request: it must match it; a READ's
    /// payload then lands in the op's memory.
    pub(super) fn on_response(
        &mut self,
        h: &DataHeader,
        sink: &mut impl Sink,
    ) -> Result<bool, ConnFault> {
        let p = self.pending.front().ok_or_else(|| {
            ConnFault::misbehaved(format!("{:?} with no request outstanding", h.kind))
        })?;
        let want = if p.op.kind == OpKind::Write {
            DataKind::WriteAck
        } else {
            DataKind::ReadResp
        };
        if p.op_id != h.op_id || h.kind != want {
            return Err(ConnFault::misbehaved(format!(
                "response {:?} for op {:#x}, but the oldest request is {} op {:#x}",
                h.kind, h.op_id, p.op.kind, p.op_id
            )));
        }
        if h.kind == DataKind::ReadResp && h.status == Status::Ok {
            if h.len != p.op.local.len() as u64 {
                return Err(ConnFault::misbehaved(format!(
                    "READ response carries {} bytes, {} were asked",
                    h.len,
                    p.op.local.len()
                )));
            }
            if h.packed_len != 0 {
                let dst = p.op.local.clone();
                if !self.take_packed(h, dst, Unpack::Read)? {
                    return Ok(self.unread_header());
                }
                return Ok(true);
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
    pub(super) fn unread_request(&mut self) -> bool {
        self.peer_owed -= 1;
        self.unread_header()
    }

    /// Puts back the header just taken, to be handled again later.
    pub(super) fn unread_header(&mut self) -> bool {
        self.rs -= self.hdr_len();
        self.rx_seq -= 1;
        false
    }

    pub(super) fn finish(&mut self, then: After, sink: &mut impl Sink) {
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

//! What a stream sends: requests, notifications and responses queued as
//! frames, gated frames held until their staged copy ends, and the iovecs
//! of what may be written now.

use std::time::Instant;

use super::{FrameClass, Pending, Rx, StreamProto, TxFrame, TxPayload, HDR};
use crate::auth::TAG_LEN;
use crate::error::OpKind;
use crate::region::{KeyRef, RegionSlice};
use crate::wire::{DataHeader, DataKind, Status};
use crate::xfer::PendingOp;

use super::integrity::seal;

impl StreamProto {
    /// Queues a frame; numbers it, and tags it unless it is gated (then
    /// `release` does, once its payload is final).
    pub(super) fn push_frame(
        &mut self,
        hdr: [u8; HDR],
        payload: TxPayload,
        class: FrameClass,
        gate: u64,
    ) {
        let mut full = [0u8; HDR + TAG_LEN];
        full[..HDR].copy_from_slice(&hdr);
        let mut f = TxFrame {
            hdr: full,
            payload,
            pack_after: None,
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
        self.push_request_gated(kind, (slot, op_id), (key, addr), local, now, 0);
    }

    /// `push_request`, the frame held back until `release(gate)` when
    /// `gate` is not 0 (its payload is being packed).
    pub(super) fn push_request_gated(
        &mut self,
        kind: OpKind,
        (slot, op_id): (u32, u64),
        (key, addr): (KeyRef, u64),
        local: RegionSlice,
        now: Instant,
        gate: u64,
    ) {
        debug_assert!(self.can_request());
        let len = local.len();
        let (dk, payload) = match kind {
            OpKind::Write => (DataKind::WriteReq, TxPayload::Slice(local.clone())),
            OpKind::Read => (DataKind::ReadReq, TxPayload::None),
        };
        let hdr = DataHeader::request(dk, key.rkey, key.tag, op_id, addr, len as u64).encode();
        self.push_frame(hdr, payload, FrameClass::Request, gate);
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

    pub(super) fn push_response(&mut self, hdr: DataHeader, payload: TxPayload, gate: u64) {
        // Room is guaranteed: responses never exceed the peer's declared
        // in-flight limit, which `take_request` enforces.
        self.push_frame(hdr.encode(), payload, FrameClass::Response, gate);
    }

    pub(super) fn new_gate(&mut self) -> u64 {
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
        // Marked by `pack_after_stage`: its payload is in host memory now,
        // so it goes to the codec, still gated.
        if let (true, Some(d), TxPayload::Slice(src)) = (ok, f.pack_after.take(), &f.payload) {
            let src = src.clone();
            self.encode_job(gate, d, src);
            return;
        }
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
            if let TxPayload::Packed(buf) = f.payload {
                self.reuse(buf);
            }
        }
    }

    /// Whether the receive state sits between frames (the driver hands
    /// back what it has before reading again there).
    pub fn at_frame_boundary(&self) -> bool {
        matches!(self.rx, Rx::Header)
    }
}

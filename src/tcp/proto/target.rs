//! The target's side: a peer's WRITE request checked against our regions
//! and its payload received in place, a peer's READ request checked and
//! answered from our memory.

use super::pack::{self, PackChoice};
use super::{After, Rx, StreamProto, TxPayload};
use crate::error::ConnFault;
use crate::region::{Access, KeyRef, RegionSlice, Regions};
use crate::wire::{DataHeader, DataKind, Status};
use crate::xfer::{Bounce, Sink, Stage};

/// The key a request header names.
pub(super) fn key_of(h: &DataHeader) -> KeyRef {
    KeyRef {
        rkey: h.rkey,
        tag: h.tag,
    }
}

impl StreamProto {
    /// A peer's WRITE: its payload goes to the checked window (through a
    /// bounce buffer for GPU memory), or is read and dropped with a refusal.
    /// False: no bounce buffer now, the header is put back.
    pub(super) fn on_write_req(
        &mut self,
        h: &DataHeader,
        regions: &mut impl Regions,
        sink: &mut impl Sink,
    ) -> Result<bool, ConnFault> {
        let key = key_of(h);
        self.take_request()?;
        let then_ok = |status| After::Ack {
            op_id: h.op_id,
            status,
        };
        let len = h.len as usize;
        let wire = h.payload_len() as usize;
        let checked = regions.check(key, h.addr, h.len, Access::REMOTE_WRITE);
        // Counted once the request is taken (not when it is put back).
        let verdict = checked.as_ref().ok().map(|_| h.len);
        if h.packed_len != 0 {
            // Decoded into host memory, or into a bounce buffer and copied
            // on into GPU memory (the ack waits for both).
            let into = match checked {
                Ok(w) if w.is_device() => match sink.bounce(len) {
                    Bounce::Ready(b) => {
                        let bounce = RegionSlice::new(&b, 0, len).expect("bounce fits len");
                        let then = pack::Unpack::AckStaged {
                            op_id: h.op_id,
                            gpu: w,
                        };
                        Ok((bounce, then))
                    }
                    Bounce::Busy => return Ok(self.unread_request()),
                    Bounce::Never => Err(Status::DeviceMemory),
                },
                Ok(w) => Ok((w, pack::Unpack::Ack { op_id: h.op_id })),
                Err(status) => Err(status),
            };
            return match into {
                Ok((dst, then)) => match self.take_packed(h, dst, then)? {
                    true => {
                        sink.served(true, verdict);
                        Ok(true)
                    }
                    false => Ok(self.unread_request()),
                },
                Err(status) => {
                    self.rx = Rx::Discard {
                        left: wire,
                        then: then_ok(status),
                        run: self.payload_run(wire),
                    };
                    sink.served(true, None);
                    Ok(true)
                }
            };
        }
        self.rx = match checked {
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
        let refused = matches!(self.rx, Rx::Discard { .. });
        sink.served(true, verdict.filter(|_| !refused));
        Ok(true)
    }

    /// A peer's READ: the checked window's bytes are queued as the
    /// response (staged through a bounce buffer for GPU memory), or a
    /// refusal. False: no bounce buffer now, the header is put back.
    pub(super) fn on_read_req(
        &mut self,
        h: &DataHeader,
        regions: &mut impl Regions,
        sink: &mut impl Sink,
    ) -> Result<bool, ConnFault> {
        let key = key_of(h);
        self.take_request()?;
        let len = h.len as usize;
        let refuse = |status| DataHeader::response(DataKind::ReadResp, status, h.op_id, 0);
        // Counted once the request is taken (not when it is put back).
        let mut verdict = Some(h.len);
        match regions.check(key, h.addr, h.len, Access::REMOTE_READ) {
            Ok(w) if w.is_device() => match sink.bounce(len) {
                Bounce::Ready(b) => {
                    let out = RegionSlice::new(&b, 0, len).expect("bounce fits len");
                    // Sent once the GPU→bounce copy is done.
                    let gate = self.new_gate();
                    let hdr = DataHeader::response(DataKind::ReadResp, Status::Ok, h.op_id, h.len);
                    self.push_response(hdr, TxPayload::Slice(out.clone()), gate);
                    // Packed, if it should be, once copied out.
                    if let PackChoice::Pack(d) = self.pack_choice(w.region().dtype(), len) {
                        self.pack_after_stage(gate, d);
                    }
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
                    verdict = None;
                    self.push_response(refuse(Status::DeviceMemory), TxPayload::None, 0)
                }
            },
            Ok(w) => match self.respond_packed(h.op_id, &w) {
                Some(true) => {}
                Some(false) => {
                    let hdr = DataHeader::response(DataKind::ReadResp, Status::Ok, h.op_id, h.len);
                    self.push_response(hdr, TxPayload::Slice(w), 0);
                }
                None => return Ok(self.unread_request()),
            },
            Err(status) => {
                verdict = None;
                self.push_response(refuse(status), TxPayload::None, 0)
            }
        }
        sink.served(false, verdict);
        Ok(true)
    }
}

//! The tcp data path's fixed 40-byte frame header.
//!
//! ```text
//! 0 kind u8 | 1 status u8 | 2 flags u16 | 4 rkey u32 | 8 op_id u64
//! 16 addr u64 | 24 len u64 | 32 tag u64                     (little-endian)
//! ```
//!
//! `flags` bit 0 (`FLAG_PACKED`, only on a `WriteReq` or an `Ok`
//! `ReadResp`, only between peers that both offered `CAP_CODEC`): the
//! payload is a frame of the float-aware codec (`crate::codec`), not the
//! bytes. `len` then holds two u32s: the low half is the bytes the frame
//! decodes to (what the request moves, checked as ever), the high half the
//! frame's own length on the wire (at most `MAX_PACKED_FRAME` and not more
//! than the decoded length: no peer makes us buffer more than that).
//!
//! `tag` is the random half of a key (the advertised `RemoteBuf`'s first 8
//! reserved bytes); requests carry it, everything else carries 0.
//!
//! ```text
//! ```
//!
//! Requests (`WriteReq` + `len` payload bytes, `ReadReq`, `Notify` + payload)
//! flow from initiator to target; responses (`WriteAck`, `ReadResp` + `len`
//! payload bytes when the status is `Ok`) flow back in request order.

use super::cursor::{DecodeError, Reader};

pub const DATA_HEADER_LEN: usize = 40;
/// Largest payload one request or response frame may carry. `RemoteBuf`
/// sizes are u32, so no honest frame is larger.
pub const MAX_FRAME_PAYLOAD: u64 = u32::MAX as u64;
/// `flags` bit: the payload is a codec frame (see the module doc).
pub const FLAG_PACKED: u16 = 1;
/// The longest codec frame a peer may send: each one is buffered whole
/// before it is decoded, so this (times the frames in decoding) is what a
/// peer can make us hold.
pub const MAX_PACKED_FRAME: u32 = 16 << 20;
/// Largest notification an application may send.
pub const MAX_NOTIFY_BYTES: usize = 4096;
/// Largest notification payload on the wire: one kind byte
/// ([`NOTE_APP`] or [`NOTE_CTL`]) and the message: the engine's eager
/// two-sided messages (`wire::msg`) are the longest. An application's
/// longer than [`MAX_NOTIFY_BYTES`] is dropped on arrival
/// (`reactor::source::Inboxes`).
pub const MAX_NOTIFY_WIRE_BYTES: usize =
    1 + super::msg::EAGER_HEADER_LEN + super::msg::MAX_EAGER_BYTES;
const _: () = assert!(MAX_NOTIFY_WIRE_BYTES > MAX_NOTIFY_BYTES);
/// A notification's first byte: the application's message follows (it
/// reaches `recv_notification`) ...
pub const NOTE_APP: u8 = 0;
/// ... or the engine's own (two-sided send/recv: `wire::msg`), which never
/// reaches the application's inbox.
pub const NOTE_CTL: u8 = 1;

const WHAT: &str = "data frame header";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DataKind {
    WriteReq = 1,
    ReadReq = 2,
    Notify = 3,
    WriteAck = 0x81,
    ReadResp = 0x82,
}

impl DataKind {
    pub fn is_response(self) -> bool {
        (self as u8) & 0x80 != 0
    }
}

/// Outcome a target reports for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Status {
    Ok = 0,
    /// No live registration has this key.
    UnknownKey = 1,
    /// The range does not lie inside the registration.
    OutOfBounds = 2,
    /// The registration does not allow this kind of access.
    AccessDenied = 3,
    /// (Same-host path) the target could not reach the initiator's memory.
    PeerMemory = 4,
    /// The registration is GPU memory, which this path cannot reach.
    DeviceMemory = 5,
}

impl Status {
    pub fn from_u8(v: u8) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::UnknownKey,
            2 => Status::OutOfBounds,
            3 => Status::AccessDenied,
            4 => Status::PeerMemory,
            5 => Status::DeviceMemory,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DataHeader {
    pub kind: DataKind,
    pub status: Status,
    pub rkey: u32,
    pub op_id: u64,
    pub addr: u64,
    pub len: u64,
    pub tag: u64,
    /// Non-zero: the payload is a codec frame of this many bytes, which
    /// decodes to `len` (`FLAG_PACKED`).
    pub packed_len: u32,
}

impl DataHeader {
    pub fn request(kind: DataKind, rkey: u32, tag: u64, op_id: u64, addr: u64, len: u64) -> Self {
        Self {
            kind,
            status: Status::Ok,
            rkey,
            op_id,
            addr,
            len,
            tag,
            packed_len: 0,
        }
    }

    pub fn response(kind: DataKind, status: Status, op_id: u64, len: u64) -> Self {
        Self {
            kind,
            status,
            rkey: 0,
            op_id,
            addr: 0,
            len,
            tag: 0,
            packed_len: 0,
        }
    }

    /// The same header for a payload packed into a `packed_len`-byte codec
    /// frame.
    pub fn packed(self, packed_len: u32) -> Self {
        Self { packed_len, ..self }
    }

    /// Bytes of payload that follow this header on the wire.
    pub fn payload_len(&self) -> u64 {
        match self.kind {
            _ if self.packed_len != 0 => self.packed_len as u64,
            DataKind::WriteReq | DataKind::Notify | DataKind::ReadResp => self.len,
            DataKind::ReadReq | DataKind::WriteAck => 0,
        }
    }

    pub fn encode(&self) -> [u8; DATA_HEADER_LEN] {
        let mut b = [0u8; DATA_HEADER_LEN];
        b[0] = self.kind as u8;
        b[1] = self.status as u8;
        let (flags, len) = if self.packed_len != 0 {
            (FLAG_PACKED, (self.packed_len as u64) << 32 | self.len)
        } else {
            (0, self.len)
        };
        b[2..4].copy_from_slice(&flags.to_le_bytes());
        b[4..8].copy_from_slice(&self.rkey.to_le_bytes());
        b[8..16].copy_from_slice(&self.op_id.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..32].copy_from_slice(&len.to_le_bytes());
        b[32..40].copy_from_slice(&self.tag.to_le_bytes());
        b
    }

    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(buf, WHAT);
        let kind_byte = r.u8()?;
        let kind = match kind_byte {
            1 => DataKind::WriteReq,
            2 => DataKind::ReadReq,
            3 => DataKind::Notify,
            0x81 => DataKind::WriteAck,
            0x82 => DataKind::ReadResp,
            got => return Err(DecodeError::UnknownKind { what: WHAT, got }),
        };
        let status_byte = r.u8()?;
        let status = Status::from_u8(status_byte)
            .ok_or_else(|| invalid(format!("unknown status {status_byte}")))?;
        let flags = r.u16_le()?;
        let mut h = DataHeader {
            kind,
            status,
            rkey: r.u32_le()?,
            op_id: r.u64_le()?,
            addr: r.u64_le()?,
            len: r.u64_le()?,
            tag: r.u64_le()?,
            packed_len: 0,
        };
        r.finish()?;
        if flags & !FLAG_PACKED != 0 {
            return Err(invalid(format!("unknown flags {flags:#06x}")));
        }
        if flags & FLAG_PACKED != 0 {
            check_packed(&mut h)?;
        }
        let cap = if kind == DataKind::Notify {
            MAX_NOTIFY_WIRE_BYTES as u64
        } else {
            MAX_FRAME_PAYLOAD
        };
        if h.len > cap {
            return Err(DecodeError::TooLong {
                what: WHAT,
                len: h.len,
                max: cap,
            });
        }
        if !kind.is_response() && status != Status::Ok {
            return Err(invalid(format!("{kind:?} carries status {status:?}")));
        }
        if (kind.is_response() || kind == DataKind::Notify) && h.tag != 0 {
            return Err(invalid(format!("{kind:?} carries a key tag")));
        }
        if kind.is_response() && (h.rkey != 0 || h.addr != 0) {
            return Err(invalid(format!(
                "{kind:?} carries rkey {} addr {:#x}",
                h.rkey, h.addr
            )));
        }
        if (kind == DataKind::WriteAck || status != Status::Ok) && h.len != 0 && kind.is_response()
        {
            return Err(invalid(format!(
                "{kind:?} with status {status:?} carries len {}",
                h.len
            )));
        }
        if kind == DataKind::Notify && (h.rkey != 0 || h.addr != 0) {
            return Err(invalid(format!(
                "Notify carries rkey {} addr {:#x}",
                h.rkey, h.addr
            )));
        }
        Ok(h)
    }
}

/// Splits a packed frame's `len` into its two halves and checks them.
fn check_packed(h: &mut DataHeader) -> Result<(), DecodeError> {
    let ok_kind =
        h.kind == DataKind::WriteReq || (h.kind == DataKind::ReadResp && h.status == Status::Ok);
    if !ok_kind {
        return Err(invalid(format!(
            "{:?} with status {:?} marked packed",
            h.kind, h.status
        )));
    }
    let (packed, decoded) = ((h.len >> 32) as u32, h.len & u32::MAX as u64);
    if packed == 0 || packed > MAX_PACKED_FRAME || packed as u64 > decoded {
        return Err(invalid(format!(
            "a packed frame of {packed} bytes for {decoded} (at most {MAX_PACKED_FRAME}, \
             and not more than it decodes to)"
        )));
    }
    h.len = decoded;
    h.packed_len = packed;
    Ok(())
}

fn invalid(reason: String) -> DecodeError {
    DecodeError::Invalid { what: WHAT, reason }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testrng::Rng;

    #[test]
    fn round_trips_each_kind() {
        let hs = [
            DataHeader::request(DataKind::WriteReq, 5, 0xabc, 9, 0x1000, 4096),
            DataHeader::request(DataKind::ReadReq, 5, u64::MAX, 10, 0x1000, 1 << 30),
            DataHeader::request(DataKind::Notify, 0, 0, 11, 0, 12),
            DataHeader::response(DataKind::WriteAck, Status::OutOfBounds, 9, 0),
            DataHeader::response(DataKind::ReadResp, Status::Ok, 10, 1 << 30),
        ];
        for h in hs {
            assert_eq!(DataHeader::decode(&h.encode()).unwrap(), h);
        }
    }

    #[test]
    fn rejects_bad_fields() {
        let good = DataHeader::request(DataKind::WriteReq, 1, 2, 1, 1, 1).encode();
        let mut b = good;
        b[0] = 7;
        assert!(matches!(
            DataHeader::decode(&b),
            Err(DecodeError::UnknownKind { got: 7, .. })
        ));
        let mut b = good;
        b[2] = 2;
        assert!(DataHeader::decode(&b).is_err(), "unknown flag");
        let mut b = good;
        b[1] = 2;
        assert!(DataHeader::decode(&b).is_err(), "requests carry no status");
        let over = MAX_NOTIFY_WIRE_BYTES as u64 + 1;
        let n = DataHeader::request(DataKind::Notify, 0, 0, 1, 0, over).encode();
        assert!(matches!(
            DataHeader::decode(&n),
            Err(DecodeError::TooLong { len, max, .. })
                if len == over && max == MAX_NOTIFY_WIRE_BYTES as u64
        ));
        let r = DataHeader::response(DataKind::ReadResp, Status::UnknownKey, 1, 8).encode();
        assert!(
            DataHeader::decode(&r).is_err(),
            "error responses carry no payload"
        );
        assert!(DataHeader::decode(&good[..39]).is_err());
        let mut b = DataHeader::response(DataKind::WriteAck, Status::Ok, 1, 0).encode();
        b[32] = 1;
        assert!(DataHeader::decode(&b).is_err(), "responses carry no tag");
    }

    #[test]
    fn packed_frames_round_trip_and_are_bounded() {
        let w = DataHeader::request(DataKind::WriteReq, 5, 7, 9, 0x1000, 4 << 20).packed(3 << 20);
        let back = DataHeader::decode(&w.encode()).unwrap();
        assert_eq!(back, w);
        assert_eq!(back.payload_len(), 3 << 20);
        let r = DataHeader::response(DataKind::ReadResp, Status::Ok, 10, 100).packed(60);
        assert_eq!(DataHeader::decode(&r.encode()).unwrap().payload_len(), 60);
        // More packed than decoded (a peer making us buffer more than the
        // request moves), past the bound, or on a frame with no data.
        for bad in [
            DataHeader::request(DataKind::WriteReq, 5, 7, 9, 0, 100).packed(101),
            DataHeader::request(DataKind::WriteReq, 5, 7, 9, 0, u32::MAX as u64)
                .packed(MAX_PACKED_FRAME + 1),
            DataHeader::request(DataKind::ReadReq, 5, 7, 9, 0, 100).packed(50),
            DataHeader::response(DataKind::WriteAck, Status::Ok, 9, 0).packed(1),
        ] {
            assert!(DataHeader::decode(&bad.encode()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn random_bytes_never_panic_and_round_trip() {
        let mut rng = Rng(11);
        for _ in 0..50000 {
            let mut b = rng.bytes(40);
            b[0] = [1u8, 2, 3, 0x81, 0x82, 9][rng.below(6) as usize];
            b[1] = rng.below(5) as u8;
            b[2] = rng.below(2) as u8;
            b[3] = 0;
            if rng.below(2) == 0 {
                b[4..8].fill(0);
                b[16..24].fill(0);
                b[24..32].copy_from_slice(&rng.below(5000).to_le_bytes());
                b[32..40].fill(0);
            }
            if let Ok(h) = DataHeader::decode(&b) {
                assert_eq!(h.encode().to_vec(), b);
            }
        }
    }
}

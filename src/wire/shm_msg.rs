//! Messages on the shared-memory rings: a fixed 64-byte header and up to
//! `MAX_INLINE` bytes of inline payload, in one ring slot.
//!
//! ```text
//! 0 kind u8 | 1 status u8 | 2 inline_len u16 | 4 conn u32 | 8 op_id u64
//! 16 rkey u32 | 20 src_key u32 | 24 addr u64 | 32 len u64 | 40 src_addr u64
//! 48 aux u64 | 56 aux2 u64 | 64 inline[inline_len]            (little-endian)
//! ```
//!
//! Sans-IO and strict like every codec here: a peer process is not trusted.

use super::cursor::DecodeError;
use super::data::Status;

/// Bytes of one shared-memory ring slot's payload (the ring's slot is 256
/// bytes with a 16-byte sequence and length).
pub const SLOT_PAYLOAD: usize = 240;
pub const MSG_HEADER: usize = 64;
pub const MAX_INLINE: usize = SLOT_PAYLOAD - MSG_HEADER;
const WHAT: &str = "shm ring message";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum MsgKind {
    /// conn = connector's conn number, addr = connector pid, aux = its
    /// endpoint id, aux2 = nonce, src_key = stream inflight limit.
    Connect = 1,
    /// status Ok or refused; same fields for the acceptor.
    ConnectAck = 2,
    /// The sender closes the connection.
    Close = 3,
    WriteReq = 4,
    ReadReq = 5,
    /// A notification fragment; status 1 means more fragments follow.
    Notify = 6,
    /// addr = base of a GPU allocation the sender deregistered: close any
    /// CUDA IPC mapping of it.
    IpcRevoke = 7,
    WriteAck = 0x84,
    ReadResp = 0x85,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Msg {
    pub kind: MsgKind,
    pub status: u8,
    pub conn: u32,
    pub op_id: u64,
    pub rkey: u32,
    /// Key of the initiator's registration holding the local side.
    pub src_key: u32,
    /// Target address (requests).
    pub addr: u64,
    pub len: u64,
    /// Initiator's address of the local side (for process_vm_*).
    pub src_addr: u64,
    pub aux: u64,
    pub aux2: u64,
    pub inline_len: u16,
}

impl Msg {
    pub fn new(kind: MsgKind) -> Msg {
        Msg {
            kind,
            status: 0,
            conn: 0,
            op_id: 0,
            rkey: 0,
            src_key: 0,
            addr: 0,
            len: 0,
            src_addr: 0,
            aux: 0,
            aux2: 0,
            inline_len: 0,
        }
    }

    /// Writes header and `inline` into `out`; returns the bytes used.
    pub fn encode(&self, inline: &[u8], out: &mut [u8; SLOT_PAYLOAD]) -> usize {
        self.encode_with(inline, &[], out)
    }

    /// As `encode`, the inline payload being `inline` then `tail` (a
    /// request's riding notification).
    pub fn encode_with(&self, inline: &[u8], tail: &[u8], out: &mut [u8; SLOT_PAYLOAD]) -> usize {
        let len = inline.len() + tail.len();
        assert!(len <= MAX_INLINE, "inline payload {len} > {MAX_INLINE}");
        out[0] = self.kind as u8;
        out[1] = self.status;
        out[2..4].copy_from_slice(&(len as u16).to_le_bytes());
        out[4..8].copy_from_slice(&self.conn.to_le_bytes());
        out[8..16].copy_from_slice(&self.op_id.to_le_bytes());
        out[16..20].copy_from_slice(&self.rkey.to_le_bytes());
        out[20..24].copy_from_slice(&self.src_key.to_le_bytes());
        out[24..32].copy_from_slice(&self.addr.to_le_bytes());
        out[32..40].copy_from_slice(&self.len.to_le_bytes());
        out[40..48].copy_from_slice(&self.src_addr.to_le_bytes());
        out[48..56].copy_from_slice(&self.aux.to_le_bytes());
        out[56..64].copy_from_slice(&self.aux2.to_le_bytes());
        out[MSG_HEADER..MSG_HEADER + inline.len()].copy_from_slice(inline);
        out[MSG_HEADER + inline.len()..MSG_HEADER + len].copy_from_slice(tail);
        MSG_HEADER + len
    }

    /// Decodes one message; returns it and its inline payload.
    pub fn decode(buf: &[u8]) -> Result<(Msg, &[u8]), DecodeError> {
        if buf.len() < MSG_HEADER {
            return Err(DecodeError::Truncated {
                what: WHAT,
                needed: MSG_HEADER,
                got: buf.len(),
            });
        }
        let u32_at = |i: usize| u32::from_le_bytes(buf[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(buf[i..i + 8].try_into().expect("8 bytes"));
        let kind = match buf[0] {
            1 => MsgKind::Connect,
            2 => MsgKind::ConnectAck,
            3 => MsgKind::Close,
            4 => MsgKind::WriteReq,
            5 => MsgKind::ReadReq,
            6 => MsgKind::Notify,
            7 => MsgKind::IpcRevoke,
            0x84 => MsgKind::WriteAck,
            0x85 => MsgKind::ReadResp,
            got => return Err(DecodeError::UnknownKind { what: WHAT, got }),
        };
        let inline_len = u16::from_le_bytes([buf[2], buf[3]]);
        let m = Msg {
            kind,
            status: buf[1],
            inline_len,
            conn: u32_at(4),
            op_id: u64_at(8),
            rkey: u32_at(16),
            src_key: u32_at(20),
            addr: u64_at(24),
            len: u64_at(32),
            src_addr: u64_at(40),
            aux: u64_at(48),
            aux2: u64_at(56),
        };
        let n = inline_len as usize;
        if n > MAX_INLINE {
            return Err(DecodeError::TooLong {
                what: WHAT,
                len: n as u64,
                max: MAX_INLINE as u64,
            });
        }
        if buf.len() != MSG_HEADER + n {
            return Err(DecodeError::BadLength {
                what: WHAT,
                len: buf.len(),
                expected: "64 + inline_len",
            });
        }
        let status_ok = match kind {
            MsgKind::WriteAck | MsgKind::ReadResp => status_from(m.status).is_some(),
            MsgKind::Notify | MsgKind::ConnectAck => m.status <= 1,
            // Request flags: initiator memory is GPU (bit 0, then the
            // inline bytes are its 80-byte IPC reference), no inline data
            // (bit 1), a notification rides after the inline bytes (bit
            // 2, its length in aux2).
            MsgKind::WriteReq | MsgKind::ReadReq => {
                let note = if m.status & 4 != 0 { m.aux2 } else { 0 };
                m.status <= 7 && note <= n as u64 && (m.status & 1 == 0 || n as u64 - note == 80)
            }
            _ => m.status == 0,
        };
        if !status_ok {
            return Err(DecodeError::Invalid {
                what: WHAT,
                reason: format!("{kind:?} with status {}", m.status),
            });
        }
        Ok((m, &buf[MSG_HEADER..]))
    }
}

pub fn status_from(v: u8) -> Option<Status> {
    Status::from_u8(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testrng::Rng;

    #[test]
    fn round_trip_and_rejections() {
        let mut m = Msg::new(MsgKind::WriteReq);
        m.op_id = 7;
        m.len = 5;
        let mut out = [0u8; SLOT_PAYLOAD];
        let n = m.encode(b"hello", &mut out);
        let (d, inline) = Msg::decode(&out[..n]).unwrap();
        assert_eq!(inline, b"hello");
        assert_eq!(d, Msg { inline_len: 5, ..m });
        assert!(Msg::decode(&out[..n - 1]).is_err());
        out[0] = 9;
        assert!(matches!(
            Msg::decode(&out[..n]),
            Err(DecodeError::UnknownKind { got: 9, .. })
        ));
        out[0] = 4;
        out[1] = 8;
        assert!(Msg::decode(&out[..n]).is_err(), "unknown request flags");
        // A riding notification: its length (aux2) within the inline bytes.
        out[1] = 4;
        out[56..64].copy_from_slice(&6u64.to_le_bytes());
        assert!(
            Msg::decode(&out[..n]).is_err(),
            "a note longer than the inline bytes"
        );
        out[56..64].copy_from_slice(&2u64.to_le_bytes());
        assert!(Msg::decode(&out[..n]).is_ok(), "a riding note");
        out[1] = 5;
        assert!(
            Msg::decode(&out[..n]).is_err(),
            "a GPU initiator's IPC reference and a note: 80 bytes and the note's"
        );
        out[56..64].copy_from_slice(&0u64.to_le_bytes());
        out[1] = 1;
        assert!(
            Msg::decode(&out[..n]).is_err(),
            "a GPU initiator's request carries its 80-byte IPC reference"
        );
        out[1] = 2;
        assert!(Msg::decode(&out[..n]).is_ok(), "no-inline flag");
    }

    #[test]
    fn random_bytes_never_panic_and_round_trip() {
        let mut rng = Rng(3);
        for _ in 0..20000 {
            let n = MSG_HEADER + rng.below(40) as usize;
            let mut b = rng.bytes(n);
            b[0] = [1u8, 2, 3, 4, 5, 6, 0x84, 0x85][rng.below(8) as usize];
            b[1] = rng.below(3) as u8;
            b[2..4].copy_from_slice(&((n - MSG_HEADER) as u16).to_le_bytes());
            if let Ok((m, inline)) = Msg::decode(&b) {
                let mut out = [0u8; SLOT_PAYLOAD];
                let k = m.encode(inline, &mut out);
                assert_eq!(&out[..k], &b[..]);
            }
        }
    }
}

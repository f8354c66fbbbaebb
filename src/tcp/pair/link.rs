//! The simulated link under a `Pair`: one pipe per stream and direction
//! (the kernel's buffers), the relay that spoils headers in flight, and
//! the faults a run is given.

use std::collections::VecDeque;

use super::{HDR, RKEY, TAG};
use crate::auth::TAG_LEN;
use crate::wire::{DataHeader, DataKind};

/// How a relay spoils a header in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Corrupt {
    /// An unknown frame kind: a decode error.
    Kind,
    /// Non-zero reserved bits: a decode error.
    Reserved,
    /// A flipped op id: a response that matches no request.
    OpId,
    /// A flipped key tag: the target refuses the request (UnknownKey).
    Tag,
    /// A flipped payload byte (the first after the nth header).
    Payload,
    /// A forged READ request slipped in before the nth header.
    Inject,
}

/// The faults of one run.
#[derive(Debug, Clone, Default)]
pub(crate) struct Faults {
    /// Writes and reads move a few random bytes at a time.
    pub fragment: bool,
    /// Each stream delays its bytes by up to this many µs (its own amount).
    pub delay_us: u64,
    /// (side, from µs, for µs): that side reads nothing in the window.
    pub stop_reading: Option<(usize, u64, u64)>,
    /// (direction a→b = 0, stream, bytes): the stream dies after that many
    /// bytes in that direction; the reader sees them, then end of stream.
    pub cut: Option<(usize, usize, usize)>,
    /// The connection resets at this virtual time (µs).
    pub reset_at_us: Option<u64>,
    /// (direction, stream, bytes): the sender goes quiet after that many
    /// bytes, the connection staying open (a stopped process).
    pub stall: Option<(usize, usize, usize)>,
    /// (direction, nth header on stream 0, how).
    pub corrupt: Option<(usize, usize, Corrupt)>,
    /// Notifications the receiving application holds before it must drain
    /// (a full inbox pushes back through the stream).
    pub inbox_cap: usize,
    /// Frame MACs on every stream: `Some(full)`.
    pub integrity: Option<bool>,
}

/// One direction of one stream: the kernel's send and receive buffers.
pub(super) struct Pipe {
    /// Bytes in flight, each with the virtual time it may be read.
    pub(super) bytes: VecDeque<(u64, u8)>,
    pub(super) cap: usize,
    pub(super) delay_us: u64,
    /// Bytes accepted so far, and the count after which the pipe dies.
    pub(super) accepted: usize,
    pub(super) cut_after: Option<usize>,
    /// Bytes handed to the reader, and the count it never gets past.
    pub(super) delivered: usize,
    pub(super) stall_after: Option<usize>,
    pub(super) closed: bool,
    pub(super) relay: Relay,
}

/// Watches frames go by (headers and payload lengths) and can spoil one
/// header, as a hostile box on the path would.
pub(super) struct Relay {
    pub(super) hdr: Vec<u8>,
    pub(super) payload_left: u64,
    pub(super) headers_seen: usize,
    pub(super) corrupt: Option<(usize, Corrupt)>,
    /// Frame MACs on the link: `Some(full)` (the relay only skips them).
    pub(super) integrity: Option<bool>,
    /// A payload byte is to be flipped (`Corrupt::Payload`).
    pub(super) flip_next_payload: bool,
}

impl Relay {
    /// Passes `b` on, changed if it completes the header to spoil.
    pub(super) fn pass(&mut self, out: &mut Vec<u8>, b: u8) {
        if self.payload_left > 0 {
            self.payload_left -= 1;
            out.push(if std::mem::take(&mut self.flip_next_payload) {
                b ^ 0x10
            } else {
                b
            });
            return;
        }
        self.hdr.push(b);
        let tag = if self.integrity.is_some() { TAG_LEN } else { 0 };
        if self.hdr.len() < HDR + tag {
            return;
        }
        let mut h = std::mem::take(&mut self.hdr);
        if let Ok(d) = DataHeader::decode(&h[..HDR]) {
            let len = d.payload_len();
            let trailer = if self.integrity == Some(true) && len > 0 {
                TAG_LEN as u64
            } else {
                0
            };
            self.payload_left = len + trailer;
        }
        if let Some((nth, how)) = self.corrupt {
            if nth == self.headers_seen {
                match how {
                    Corrupt::Kind => h[0] = 0x7f,
                    Corrupt::Reserved => h[2] = 1,
                    Corrupt::OpId => h[8] ^= 0x40,
                    Corrupt::Tag => h[32] ^= 0x01,
                    Corrupt::Payload => self.flip_next_payload = true,
                    Corrupt::Inject => {
                        let forged = DataHeader::request(DataKind::ReadReq, RKEY, TAG, 0xbad, 0, 8);
                        out.extend_from_slice(&forged.encode());
                        out.extend(std::iter::repeat_n(0u8, tag));
                    }
                }
            }
        }
        self.headers_seen += 1;
        out.extend_from_slice(&h);
    }
}

impl Pipe {
    pub(super) fn room(&self) -> usize {
        self.cap - self.bytes.len()
    }
}

//! Frame MACs on an authenticated connection: the tags that seal what we
//! send, and the lengths they add.

use super::{Integrity, StreamProto, TxFrame, HDR, TAG_LEN};

/// Domain labels, so a header tag and a payload tag of one frame differ.
pub(super) const TAG_HEADER: &[u8] = b"H";

pub(super) const TAG_PAYLOAD: &[u8] = b"P";

/// Writes a frame's tags (no-op without integrity). A gated frame is
/// sealed when released, once its payload is final.
pub(super) fn seal(mac: &Option<Integrity>, f: &mut TxFrame) {
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

impl StreamProto {
    /// Bytes of a header on the wire (with its tag, if any).
    pub(super) fn hdr_len(&self) -> usize {
        HDR + if self.mac.is_some() { TAG_LEN } else { 0 }
    }

    /// Bytes of a payload tag after a payload of `len` bytes.
    pub(super) fn trailer_len(&self, len: usize) -> usize {
        match &self.mac {
            Some(m) if m.full && len > 0 => TAG_LEN,
            _ => 0,
        }
    }

    /// The running tag of a payload that is received but thrown away
    /// (`full` integrity: its tag is still checked).
    pub(super) fn payload_run(&self, len: usize) -> Option<crate::auth::TagRun> {
        let m = self.mac.as_ref().filter(|m| m.full && len > 0)?;
        let mut r = m.rx.start(self.rx_seq - 1);
        r.update(TAG_PAYLOAD);
        Some(r)
    }
}

//! `RemoteBuf`: an advertised remote buffer, byte-compatible with the seed's
//! 64-byte `FifoItem` (little-endian):
//!
//! ```text
//! 0  addr  u64 | 8 size u32 | 12 rkey u32 | 16 nmsgs u32 | 20 rid u32
//! 24 idx   u64 | 32 reserved [u8; 32]
//! ```
//!
//! The reserved bytes are carried through untouched, so a peer's padding
//! survives decode-then-encode.

use super::cursor::{DecodeError, Reader};

pub const REMOTE_BUF_LEN: usize = 64;
/// `reserved[8]` bit: the window is GPU memory.
pub const REMOTE_FLAG_DEVICE: u8 = 1;
/// `reserved[8]` bit: `reserved[12..16]` holds the registration's RDMA
/// rkey (the NIC's key; `rkey` stays ferry's own for tcp and shm).
pub const REMOTE_FLAG_NIC_KEY: u8 = 2;

/// A window of a peer's registered memory that the peer advertised to us.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RemoteBuf {
    /// Peer virtual address of the first byte.
    pub addr: u64,
    pub size: u32,
    /// Key of the peer's registration that holds `[addr, addr + size)`.
    pub rkey: u32,
    pub nmsgs: u32,
    pub rid: u32,
    pub idx: u64,
    pub reserved: [u8; 32],
}

impl RemoteBuf {
    pub fn encode(&self) -> [u8; REMOTE_BUF_LEN] {
        let mut out = [0u8; REMOTE_BUF_LEN];
        out[0..8].copy_from_slice(&self.addr.to_le_bytes());
        out[8..12].copy_from_slice(&self.size.to_le_bytes());
        out[12..16].copy_from_slice(&self.rkey.to_le_bytes());
        out[16..20].copy_from_slice(&self.nmsgs.to_le_bytes());
        out[20..24].copy_from_slice(&self.rid.to_le_bytes());
        out[24..32].copy_from_slice(&self.idx.to_le_bytes());
        out[32..64].copy_from_slice(&self.reserved);
        out
    }

    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        if buf.len() != REMOTE_BUF_LEN {
            return Err(DecodeError::BadLength {
                what: "remote buffer (FifoItem)",
                len: buf.len(),
                expected: "exactly 64",
            });
        }
        let mut r = Reader::new(buf, "remote buffer (FifoItem)");
        let out = Self {
            addr: r.u64_le()?,
            size: r.u32_le()?,
            rkey: r.u32_le()?,
            nmsgs: r.u32_le()?,
            rid: r.u32_le()?,
            idx: r.u64_le()?,
            reserved: r.array()?,
        };
        r.finish()?;
        Ok(out)
    }

    /// The random half of the key (reserved bytes 0..8). A target refuses a
    /// request whose tag does not match the advertised one, so the 32-bit
    /// `rkey` alone cannot be guessed into access. A UCCL peer's FifoItem
    /// has zeros here.
    pub fn key_tag(&self) -> u64 {
        u64::from_le_bytes(self.reserved[..8].try_into().expect("8 bytes"))
    }

    /// Whether the advertiser marked the window as GPU memory (reserved
    /// byte 8, bit 0): a same-host initiator then sends no inline bytes,
    /// since the target copies with CUDA, not the CPU.
    pub fn is_device(&self) -> bool {
        self.reserved[8] & REMOTE_FLAG_DEVICE != 0
    }

    /// The RDMA rkey the advertiser's NIC honours for this window, if any.
    pub fn nic_rkey(&self) -> Option<u32> {
        (self.reserved[8] & REMOTE_FLAG_NIC_KEY != 0)
            .then(|| u32::from_le_bytes(self.reserved[12..16].try_into().expect("4 bytes")))
    }

    /// The sub-window `[offset, offset + len)` of this buffer, or `None` if it
    /// does not lie inside.
    pub fn slice(&self, offset: u32, len: u32) -> Option<RemoteBuf> {
        let end = offset.checked_add(len)?;
        if end > self.size {
            return None;
        }
        Some(RemoteBuf {
            addr: self.addr.checked_add(offset as u64)?,
            size: len,
            ..*self
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testrng::Rng;

    #[test]
    fn layout_is_the_seed_fifo_item() {
        let rb = RemoteBuf {
            addr: 0x1122334455667788,
            size: 0xaabbccdd,
            rkey: 7,
            nmsgs: 1,
            rid: 2,
            idx: 3,
            reserved: [9; 32],
        };
        let b = rb.encode();
        assert_eq!(&b[0..8], &0x1122334455667788u64.to_le_bytes());
        assert_eq!(&b[8..12], &[0xdd, 0xcc, 0xbb, 0xaa]);
        assert_eq!(b[12], 7);
        assert_eq!(b[16], 1);
        assert_eq!(b[20], 2);
        assert_eq!(b[24], 3);
        assert_eq!(&b[32..], &[9; 32]);
        assert_eq!(RemoteBuf::decode(&b).unwrap(), rb);
    }

    #[test]
    fn wrong_lengths_are_errors() {
        for n in [0usize, 1, 63, 65, 128] {
            let e = RemoteBuf::decode(&vec![0; n]).unwrap_err();
            assert!(matches!(e, DecodeError::BadLength { len, .. } if len == n));
        }
    }

    #[test]
    fn slice_checks_bounds() {
        let rb = RemoteBuf {
            addr: 100,
            size: 10,
            ..Default::default()
        };
        assert_eq!(rb.slice(2, 8).unwrap().addr, 102);
        assert!(rb.slice(2, 9).is_none());
        assert!(rb.slice(u32::MAX, 2).is_none());
    }

    #[test]
    fn property_round_trip() {
        let mut rng = Rng(7);
        for _ in 0..2000 {
            let b = rng.bytes(64);
            assert_eq!(RemoteBuf::decode(&b).unwrap().encode().to_vec(), b);
        }
    }
}

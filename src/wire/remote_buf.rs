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

/// A window's bytes: the seed's 64-byte `FifoItem`.
pub const REMOTE_BUF_LEN: usize = 64;
/// `reserved[8]` bit: the window is GPU memory.
pub const REMOTE_FLAG_DEVICE: u8 = 1;
/// `reserved[8]` bit: the window carries the registration's RDMA rkeys
/// (the NICs' keys; `rkey` stays ferry's own for tcp and shm): one per NIC
/// of the advertiser, `reserved[9] + 1` of them (1..=4), the first in
/// `reserved[12..16]`, the others in `reserved[16..28]`.
pub const REMOTE_FLAG_NIC_KEY: u8 = 2;
/// `reserved[10]`: the registration's value type for the codec
/// (`crate::codec::FloatType` + 1; 0: none said).
const DTYPE_AT: usize = 10;

/// A window's RDMA rkeys, one per NIC of its advertiser; queue pair `i` of
/// a connection (on the advertiser's NIC `i % len`) uses key `i % len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NicKeys {
    keys: [u32; super::MAX_NICS],
    n: u8,
}

impl NicKeys {
    /// `None` unless 1..=`MAX_NICS` keys.
    pub fn new(keys: &[u32]) -> Option<NicKeys> {
        if keys.is_empty() || keys.len() > super::MAX_NICS {
            return None;
        }
        let mut k = NicKeys {
            keys: [0; super::MAX_NICS],
            n: keys.len() as u8,
        };
        k.keys[..keys.len()].copy_from_slice(keys);
        Some(k)
    }

    /// How many keys (one per NIC).
    pub fn len(&self) -> usize {
        self.n as usize
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The key for queue pair `qp`.
    pub fn for_qp(&self, qp: usize) -> u32 {
        self.keys[qp % self.len().max(1)]
    }

    /// The keys, in NIC order.
    pub fn as_slice(&self) -> &[u32] {
        &self.keys[..self.len()]
    }
}

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

    /// The value type the advertiser registered the memory with (the
    /// codec's `FloatType` as a byte), if it said one.
    pub fn dtype(&self) -> Option<u8> {
        self.reserved[DTYPE_AT].checked_sub(1)
    }

    /// Says the window's values are of type `dtype` (a `FloatType` byte).
    pub fn set_dtype(&mut self, dtype: Option<u8>) {
        self.reserved[DTYPE_AT] = dtype.map_or(0, |d| d.saturating_add(1));
    }

    /// The RDMA rkey the advertiser's (first) NIC honours for this window,
    /// if any.
    pub fn nic_rkey(&self) -> Option<u32> {
        self.nic_rkeys().map(|k| k.for_qp(0))
    }

    /// The RDMA rkeys of every NIC of the advertiser, if it registered the
    /// window with them.
    pub fn nic_rkeys(&self) -> Option<NicKeys> {
        if self.reserved[8] & REMOTE_FLAG_NIC_KEY == 0 {
            return None;
        }
        let n = (self.reserved[9] as usize & 3) + 1;
        let mut keys = [0u32; super::MAX_NICS];
        keys[0] = u32::from_le_bytes(self.reserved[12..16].try_into().expect("4 bytes"));
        for (i, k) in keys.iter_mut().enumerate().take(n).skip(1) {
            let at = 16 + 4 * (i - 1);
            *k = u32::from_le_bytes(self.reserved[at..at + 4].try_into().expect("4 bytes"));
        }
        NicKeys::new(&keys[..n])
    }

    /// Marks the window as reachable through the advertiser's NICs with
    /// `keys`.
    pub fn set_nic_rkeys(&mut self, keys: &NicKeys) {
        self.reserved[8] |= REMOTE_FLAG_NIC_KEY;
        self.reserved[9] = (keys.len() as u8).saturating_sub(1) & 3;
        self.reserved[12..16].copy_from_slice(&keys.for_qp(0).to_le_bytes());
        for (i, k) in keys.as_slice().iter().enumerate().skip(1) {
            let at = 16 + 4 * (i - 1);
            self.reserved[at..at + 4].copy_from_slice(&k.to_le_bytes());
        }
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
    fn nic_keys_round_trip_one_to_four() {
        for n in 1..=4usize {
            let keys: Vec<u32> = (0..n as u32).map(|i| 0x1000 + i).collect();
            let k = NicKeys::new(&keys).unwrap();
            let mut rb = RemoteBuf::default();
            assert_eq!(rb.nic_rkeys(), None);
            rb.set_nic_rkeys(&k);
            let back = RemoteBuf::decode(&rb.encode()).unwrap();
            assert_eq!(back.nic_rkeys(), Some(k));
            assert_eq!(back.nic_rkey(), Some(0x1000));
            assert_eq!(k.for_qp(n), 0x1000, "queue pair n wraps to NIC 0");
            assert_eq!(back.key_tag(), 0, "the tag is untouched");
        }
        assert_eq!(NicKeys::new(&[]), None);
        assert_eq!(NicKeys::new(&[1; 5]), None);
    }

    #[test]
    fn dtype_rides_in_its_own_byte() {
        let mut rb = RemoteBuf::default();
        assert_eq!(rb.dtype(), None);
        rb.set_nic_rkeys(&NicKeys::new(&[1, 2, 3, 4]).unwrap());
        rb.set_dtype(Some(1));
        let back = RemoteBuf::decode(&rb.encode()).unwrap();
        assert_eq!(back.dtype(), Some(1));
        assert_eq!(back.nic_rkeys(), NicKeys::new(&[1, 2, 3, 4]));
        rb.set_dtype(None);
        assert_eq!(rb.dtype(), None);
    }

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

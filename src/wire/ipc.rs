//! `IpcBuf`: an advertised window of GPU memory that a process on the same
//! host maps with CUDA IPC (`advertise_ipc` → `write_ipc` / `read_ipc`).
//! The seed's `IpcTransferInfo` carries a handle, an offset and a size; this
//! adds who owns it (so a mapping can be cached per owner and allocation,
//! and dropped when the owner revokes it) and which host it lives on.
//!
//! ```text
//! 0   magic "FIPC" u32 | 4 version u16 | 6 owner device u16
//! 8   owner endpoint id u64 | 16 host token u64
//! 24  owner pid u32 | 28 reserved u32 (must be 0)
//! 32  alloc id u64 (random per registration)
//! 40  alloc base u64 (owner's address) | 48 alloc len u64
//! 56  offset u64 (from alloc base) | 64 len u64
//! 72  CUDA IPC memory handle [u8; 64]
//! ```
//! Little-endian; 136 bytes. Decoding checks that `[offset, offset + len)`
//! lies inside the allocation.

use super::cursor::{DecodeError, Reader};

pub const IPC_BUF_LEN: usize = 136;
pub const IPC_MAGIC: u32 = u32::from_le_bytes(*b"FIPC");
pub const IPC_VERSION: u16 = 1;
const WHAT: &str = "IPC buffer";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcBuf {
    pub device: u16,
    pub owner_id: u64,
    pub host_token: u64,
    pub owner_pid: u32,
    pub alloc_id: u64,
    pub alloc_base: u64,
    pub alloc_len: u64,
    pub offset: u64,
    pub len: u64,
    pub handle: [u8; 64],
}

impl IpcBuf {
    pub fn encode(&self) -> [u8; IPC_BUF_LEN] {
        let mut o = [0u8; IPC_BUF_LEN];
        o[0..4].copy_from_slice(&IPC_MAGIC.to_le_bytes());
        o[4..6].copy_from_slice(&IPC_VERSION.to_le_bytes());
        o[6..8].copy_from_slice(&self.device.to_le_bytes());
        o[8..16].copy_from_slice(&self.owner_id.to_le_bytes());
        o[16..24].copy_from_slice(&self.host_token.to_le_bytes());
        o[24..28].copy_from_slice(&self.owner_pid.to_le_bytes());
        o[32..40].copy_from_slice(&self.alloc_id.to_le_bytes());
        o[40..48].copy_from_slice(&self.alloc_base.to_le_bytes());
        o[48..56].copy_from_slice(&self.alloc_len.to_le_bytes());
        o[56..64].copy_from_slice(&self.offset.to_le_bytes());
        o[64..72].copy_from_slice(&self.len.to_le_bytes());
        o[72..136].copy_from_slice(&self.handle);
        o
    }

    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        if buf.len() != IPC_BUF_LEN {
            return Err(DecodeError::BadLength {
                what: WHAT,
                len: buf.len(),
                expected: "exactly 136",
            });
        }
        let mut r = Reader::new(buf, WHAT);
        let magic = r.u32_le()?;
        if magic != IPC_MAGIC {
            return Err(DecodeError::BadMagic {
                what: WHAT,
                got: magic,
                expected: IPC_MAGIC,
            });
        }
        let version = r.u16_le()?;
        if version != IPC_VERSION {
            return Err(DecodeError::UnsupportedVersion {
                what: WHAT,
                got: version,
                supported: IPC_VERSION,
            });
        }
        let device = r.u16_le()?;
        let owner_id = r.u64_le()?;
        let host_token = r.u64_le()?;
        let owner_pid = r.u32_le()?;
        let reserved = r.u32_le()?;
        if reserved != 0 {
            return Err(DecodeError::Invalid {
                what: WHAT,
                reason: format!("reserved field is {reserved:#x}, must be 0"),
            });
        }
        let b = IpcBuf {
            device,
            owner_id,
            host_token,
            owner_pid,
            alloc_id: r.u64_le()?,
            alloc_base: r.u64_le()?,
            alloc_len: r.u64_le()?,
            offset: r.u64_le()?,
            len: r.u64_le()?,
            handle: r.array()?,
        };
        r.finish()?;
        match b.offset.checked_add(b.len) {
            Some(end) if end <= b.alloc_len => Ok(b),
            _ => Err(DecodeError::Invalid {
                what: WHAT,
                reason: format!(
                    "window offset {} + len {} lies outside the {}-byte allocation",
                    b.offset, b.len, b.alloc_len
                ),
            }),
        }
    }

    /// The sub-window `[offset, offset + len)` of this one, or `None` if it
    /// does not lie inside.
    pub fn slice(&self, offset: u64, len: u64) -> Option<IpcBuf> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        Some(IpcBuf {
            offset: self.offset + offset,
            len,
            ..*self
        })
    }
}

/// Where the initiator's GPU memory is: its allocation's IPC handle, the
/// allocation base in its process, and the offset of the transfer in it.
/// 80 bytes inline.
#[derive(Clone, Copy)]
pub struct IpcRef {
    pub handle: [u8; 64],
    pub alloc_base: u64,
    pub offset: u64,
}

impl IpcRef {
    pub const LEN: usize = 80;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut o = [0u8; Self::LEN];
        o[..64].copy_from_slice(&self.handle);
        o[64..72].copy_from_slice(&self.alloc_base.to_le_bytes());
        o[72..80].copy_from_slice(&self.offset.to_le_bytes());
        o
    }

    pub fn decode(b: &[u8]) -> Option<IpcRef> {
        if b.len() != Self::LEN {
            return None;
        }
        Some(IpcRef {
            handle: b[..64].try_into().ok()?,
            alloc_base: u64::from_le_bytes(b[64..72].try_into().ok()?),
            offset: u64::from_le_bytes(b[72..80].try_into().ok()?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testrng::Rng;

    fn sample(rng: &mut Rng) -> IpcBuf {
        let alloc_len = rng.below(1 << 40) + 1;
        let offset = rng.below(alloc_len);
        let len = rng.below(alloc_len - offset + 1);
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&rng.bytes(64));
        IpcBuf {
            device: rng.next() as u16,
            owner_id: rng.next(),
            host_token: rng.next(),
            owner_pid: rng.next() as u32,
            alloc_id: rng.next(),
            alloc_base: rng.next(),
            alloc_len,
            offset,
            len,
            handle,
        }
    }

    #[test]
    fn round_trips() {
        let mut rng = Rng(0x1bc);
        for _ in 0..2000 {
            let b = sample(&mut rng);
            let bytes = b.encode();
            assert_eq!(IpcBuf::decode(&bytes).unwrap(), b);
        }
    }

    #[test]
    fn rejects_bad_input() {
        let mut rng = Rng(7);
        let b = sample(&mut rng);
        let good = b.encode();
        assert!(matches!(
            IpcBuf::decode(&good[..135]),
            Err(DecodeError::BadLength { len: 135, .. })
        ));
        let mut x = good;
        x[0] ^= 1;
        assert!(matches!(
            IpcBuf::decode(&x),
            Err(DecodeError::BadMagic { .. })
        ));
        let mut x = good;
        x[4] = 9;
        assert!(matches!(
            IpcBuf::decode(&x),
            Err(DecodeError::UnsupportedVersion { got: 9, .. })
        ));
        let mut x = good;
        x[29] = 1;
        assert!(matches!(
            IpcBuf::decode(&x),
            Err(DecodeError::Invalid { .. })
        ));
        // Window past the allocation's end, and one whose end wraps.
        let mut w = b;
        w.offset = w.alloc_len;
        w.len = 1;
        assert!(IpcBuf::decode(&w.encode()).is_err());
        w.offset = u64::MAX;
        w.len = 2;
        assert!(IpcBuf::decode(&w.encode()).is_err());
    }

    #[test]
    fn slices_stay_inside() {
        let mut rng = Rng(3);
        let mut b = sample(&mut rng);
        b.alloc_len = 1000;
        b.offset = 100;
        b.len = 500;
        let s = b.slice(10, 490).unwrap();
        assert_eq!((s.offset, s.len), (110, 490));
        assert!(b.slice(10, 491).is_none());
        assert!(b.slice(u64::MAX, 2).is_none());
    }
}

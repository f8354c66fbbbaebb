//! A bounds-checked reader over untrusted bytes and the one decode error type.

use thiserror::Error;

/// What was wrong with bytes a decoder was given. Each variant names the
/// structure being decoded and the sizes or values that did not fit.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DecodeError {
    #[error("{what}: truncated: needed {needed} bytes, got {got}")]
    Truncated {
        what: &'static str,
        needed: usize,
        got: usize,
    },
    #[error("{what}: {extra} trailing bytes after a complete value")]
    TrailingBytes { what: &'static str, extra: usize },
    #[error("{what}: bad magic {got:#010x} (expected {expected:#010x})")]
    BadMagic {
        what: &'static str,
        got: u32,
        expected: u32,
    },
    #[error("{what}: unsupported protocol version {got} (this build speaks {supported})")]
    UnsupportedVersion {
        what: &'static str,
        got: u16,
        supported: u16,
    },
    #[error("{what}: unknown kind {got:#04x}")]
    UnknownKind { what: &'static str, got: u8 },
    #[error("{what}: length {len} exceeds the cap of {max}")]
    TooLong {
        what: &'static str,
        len: u64,
        max: u64,
    },
    #[error("{what}: {len} bytes fits no known layout ({expected})")]
    BadLength {
        what: &'static str,
        len: usize,
        expected: &'static str,
    },
    #[error("{what}: {reason}")]
    Invalid { what: &'static str, reason: String },
}

/// Reads fixed-width fields from a byte slice, failing with `Truncated`
/// instead of panicking.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Self { buf, pos: 0, what }
    }

    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let out = &self.buf[self.pos..end];
                self.pos = end;
                Ok(out)
            }
            None => Err(DecodeError::Truncated {
                what: self.what,
                needed: self.pos.saturating_add(n),
                got: self.buf.len(),
            }),
        }
    }

    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N)?);
        Ok(out)
    }

    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }
    pub fn u16_le(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub fn u16_be(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.array()?))
    }
    pub fn u32_le(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub fn u64_le(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// Every byte not read yet.
    pub fn rest(&mut self) -> &'a [u8] {
        let out = &self.buf[self.pos..];
        self.pos = self.buf.len();
        out
    }

    /// Succeeds only if every byte was consumed.
    pub fn finish(self) -> Result<(), DecodeError> {
        let extra = self.buf.len() - self.pos;
        if extra == 0 {
            Ok(())
        } else {
            Err(DecodeError::TrailingBytes {
                what: self.what,
                extra,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_reports_truncation_with_sizes() {
        let mut r = Reader::new(&[1, 2, 3], "x");
        assert_eq!(r.u16_le().unwrap(), 0x0201);
        assert_eq!(
            r.u32_le(),
            Err(DecodeError::Truncated {
                what: "x",
                needed: 6,
                got: 3
            })
        );
    }

    #[test]
    fn finish_rejects_trailing_bytes() {
        let mut r = Reader::new(&[1, 2, 3], "x");
        r.u8().unwrap();
        assert_eq!(
            r.finish(),
            Err(DecodeError::TrailingBytes {
                what: "x",
                extra: 2
            })
        );
    }

    #[test]
    fn huge_length_does_not_overflow() {
        let mut r = Reader::new(&[0; 4], "x");
        r.u8().unwrap();
        assert!(matches!(
            r.bytes(usize::MAX),
            Err(DecodeError::Truncated { .. })
        ));
    }
}

//! The float-aware lossless codec for the network paths (issue 27): one
//! chunk of a transfer in, one frame out, and back — no I/O here.
//!
//! ML tensors compress badly as bytes (lz4 ~1.0×) but their exponents do
//! not: most values of a layer share a few exponents. So each value is
//! rotated left by one bit (the sign moves to the bottom, the exponent's
//! top bits to the top) and split into byte planes; the top plane —
//! bf16's and fp32's whole exponent, fp16's exponent and 3 mantissa bits,
//! all of an 8-bit value — is entropy-coded with zstd level 1 (with its
//! content checksum), the rest goes raw. A chunk that does not shrink by at
//! least `MIN_GAIN` goes raw whole (a flag), so incompressible data costs
//! one try.
//!
//! A frame (little-endian): `version u8, flags u8, dtype u8, 0 u8,
//! raw_len u32, packed_len u32`, then either `raw_len` raw bytes (flag
//! `RAW`) or the zstd frame of the top plane (`packed_len` bytes) and the
//! other planes and the odd tail, raw. Decoding writes straight into the
//! destination, whose length the caller knows from the request: a frame
//! that claims another length, decodes to a different one (a bomb is just
//! that), fails its checksum or has trailing bytes is an error.

use std::fmt;

/// How a registration's bytes are laid out (the seed's `FloatType`), which
/// decides the planes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FloatType {
    /// Opaque bytes: zstd on all of them.
    Bytes = 0,
    /// bfloat16: 8 exponent bits (a plane of their own), 7 mantissa.
    Bf16 = 1,
    /// IEEE half: 5 exponent bits, 10 mantissa.
    Fp16 = 2,
    /// IEEE single: 8 exponent bits, 23 mantissa.
    Fp32 = 3,
    /// 8-bit float, 4 exponent bits and 3 mantissa (OCP E4M3).
    Fp8E4m3 = 4,
    /// 8-bit float, 5 exponent bits and 2 mantissa (OCP E5M2).
    Fp8E5m2 = 5,
}

impl FloatType {
    /// The type a wire byte names (its discriminant); `None` for any other.
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Self::Bytes,
            1 => Self::Bf16,
            2 => Self::Fp16,
            3 => Self::Fp32,
            4 => Self::Fp8E4m3,
            5 => Self::Fp8E5m2,
            _ => return None,
        })
    }

    /// The name `parse` takes (and the bench prints).
    pub fn name(self) -> &'static str {
        match self {
            Self::Bytes => "bytes",
            Self::Bf16 => "bf16",
            Self::Fp16 => "fp16",
            Self::Fp32 => "fp32",
            Self::Fp8E4m3 => "fp8-e4m3",
            Self::Fp8E5m2 => "fp8-e5m2",
        }
    }

    /// `bytes`, `bf16` (`bfloat16`), `fp16` (`float16`, `half`), `fp32`
    /// (`float32`, `float`), `fp8` or `fp8-e4m3` (`float8_e4m3fn`),
    /// `fp8-e5m2` (`float8_e5m2`): the bench's names and torch's.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name.trim().to_ascii_lowercase().as_str() {
            "bytes" | "uint8" | "int8" => Self::Bytes,
            "bf16" | "bfloat16" => Self::Bf16,
            "fp16" | "float16" | "half" => Self::Fp16,
            "fp32" | "float32" | "float" => Self::Fp32,
            "fp8" | "fp8-e4m3" | "fp8_e4m3" | "float8_e4m3fn" | "float8_e4m3fnuz" => Self::Fp8E4m3,
            "fp8-e5m2" | "fp8_e5m2" | "float8_e5m2" | "float8_e5m2fnuz" => Self::Fp8E5m2,
            _ => return None,
        })
    }

    /// Bytes per value.
    pub fn width(self) -> usize {
        match self {
            Self::Bytes | Self::Fp8E4m3 | Self::Fp8E5m2 => 1,
            Self::Bf16 | Self::Fp16 => 2,
            Self::Fp32 => 4,
        }
    }
}

/// Bytes of a frame's header.
pub const FRAME_HEADER: usize = 12;
const VERSION: u8 = 1;
/// Flag: the payload is the chunk's raw bytes.
const RAW: u8 = 1;
/// A frame must save at least this share of the chunk, or it goes raw.
pub const MIN_GAIN: f64 = 0.05;
/// zstd level 1: measured ~0.7 GB/s per core on bf16 exponents.
const LEVEL: i32 = 1;
/// The largest chunk a frame describes (its lengths are u32).
pub const MAX_CHUNK: usize = u32::MAX as usize;

/// Why a frame was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CodecError {
    /// Shorter than its header or than its lengths say.
    Truncated {
        /// Bytes there were.
        len: usize,
        /// Bytes needed.
        need: usize,
    },
    /// A version, flag or dtype we do not know.
    Unknown {
        /// Which field.
        what: &'static str,
        /// Its value.
        value: u8,
    },
    /// It describes `len` bytes where `expected` were asked.
    Length {
        /// Bytes the frame describes.
        len: u64,
        /// Bytes asked for.
        expected: usize,
    },
    /// Its lengths do not add up (`payload` bytes after the header).
    Inconsistent {
        /// The packed plane's length the header gives.
        packed: u64,
        /// Bytes after the header.
        payload: usize,
    },
    /// The packed plane does not decode to exactly `expected` bytes, or
    /// fails zstd's checksum.
    Packed {
        /// zstd's complaint, or how many bytes came out.
        why: String,
        /// Bytes it must decode to.
        expected: usize,
    },
    /// The chunk is larger than a frame can describe.
    TooLarge {
        /// The chunk's length.
        len: usize,
    },
}

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Truncated { len, need } => {
                write!(f, "compressed frame of {len} bytes, at least {need} needed")
            }
            Self::Unknown { what, value } => write!(f, "compressed frame: unknown {what} {value}"),
            Self::Length { len, expected } => write!(
                f,
                "compressed frame decodes to {len} bytes where {expected} were asked"
            ),
            Self::Inconsistent { packed, payload } => write!(
                f,
                "compressed frame: a {packed}-byte packed plane in a {payload}-byte payload"
            ),
            Self::Packed { why, expected } => write!(
                f,
                "compressed plane does not decode to its {expected} bytes: {why}"
            ),
            Self::TooLarge { len } => write!(f, "a {len}-byte chunk is past a frame's u32"),
        }
    }
}

impl std::error::Error for CodecError {}

/// One side's codec: zstd contexts and scratch planes, reused chunk after
/// chunk (nothing is allocated per chunk once they have grown).
pub struct Codec {
    cctx: zstd::bulk::Compressor<'static>,
    dctx: zstd::bulk::Decompressor<'static>,
    /// The top plane of a chunk, and its zstd frame.
    top: Vec<u8>,
    packed: Vec<u8>,
}

impl fmt::Debug for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Codec")
            .field("scratch", &self.top.capacity())
            .finish()
    }
}

impl Codec {
    /// A codec with its zstd contexts (checksums on), scratch empty.
    pub fn new() -> std::io::Result<Self> {
        use zstd::zstd_safe::CParameter as P;
        let mut cctx = zstd::bulk::Compressor::new(LEVEL)?;
        cctx.set_parameter(P::ChecksumFlag(true))?;
        // An exponent plane has few long matches and a skewed alphabet: a
        // tiny match table (2^7 entries, matches of 7 bytes or more) packs
        // it 3x faster than level 1's defaults, and a little smaller
        // (examples/codec_speed.rs, on the wordllama weights: bf16 0.22 ->
        // 0.7 GB/s of payload per core, plane 2.71x -> 2.94x).
        cctx.set_parameter(P::HashLog(7))?;
        cctx.set_parameter(P::MinMatch(7))?;
        cctx.set_parameter(P::WindowLog(20))?;
        Ok(Self {
            cctx,
            dctx: zstd::bulk::Decompressor::new()?,
            top: Vec::new(),
            packed: Vec::new(),
        })
    }

    /// Appends the frame of `chunk` (values of `dtype`) to `out` (cleared
    /// first): packed if that saves at least `MIN_GAIN`, else raw.
    pub fn encode(
        &mut self,
        dtype: FloatType,
        chunk: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        if !self.pack(dtype, chunk, out)? {
            out.clear();
            out.resize(FRAME_HEADER, 0);
            out.extend_from_slice(chunk);
            put_header(out, RAW, dtype, chunk.len(), 0);
        }
        Ok(())
    }

    /// Puts the packed frame of `chunk` in `out` (cleared first) when that
    /// saves at least `MIN_GAIN`; `false` (and `out` undefined) when it
    /// does not, so a caller that can send the chunk as it is need not
    /// copy it into a raw frame.
    pub fn pack(
        &mut self,
        dtype: FloatType,
        chunk: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<bool, CodecError> {
        if chunk.len() > MAX_CHUNK {
            return Err(CodecError::TooLarge { len: chunk.len() });
        }
        out.clear();
        let w = dtype.width();
        let n = chunk.len() / w;
        if n == 0 {
            return Ok(false);
        }
        split(dtype, chunk, n, &mut self.top);
        self.packed.clear();
        self.packed.reserve(zstd::zstd_safe::compress_bound(n));
        let budget = (chunk.len() as f64 * (1.0 - MIN_GAIN)) as usize;
        let p = match self
            .cctx
            .compress_to_buffer(&self.top[..n], &mut self.packed)
        {
            Ok(p) if FRAME_HEADER + p + (chunk.len() - n) <= budget => p,
            _ => return Ok(false),
        };
        out.reserve(FRAME_HEADER + p + chunk.len() - n);
        out.resize(FRAME_HEADER, 0);
        out.extend_from_slice(&self.packed[..p]);
        let rest_at = out.len();
        out.resize(rest_at + chunk.len() - n, 0);
        rest(dtype, chunk, n, &mut out[rest_at..]);
        put_header(out, 0, dtype, chunk.len(), p);
        Ok(true)
    }

    /// Decodes `frame` into `dst`, whose length is the chunk's as the
    /// request said; anything else about the frame is checked, not trusted.
    pub fn decode(&mut self, frame: &[u8], dst: &mut [u8]) -> Result<FloatType, CodecError> {
        let h = Header::parse(frame)?;
        if h.raw_len != dst.len() as u64 {
            return Err(CodecError::Length {
                len: h.raw_len,
                expected: dst.len(),
            });
        }
        let payload = &frame[FRAME_HEADER..];
        if h.flags & RAW != 0 {
            if h.packed_len != 0 || payload.len() != dst.len() {
                return Err(CodecError::Inconsistent {
                    packed: h.packed_len,
                    payload: payload.len(),
                });
            }
            dst.copy_from_slice(payload);
            return Ok(h.dtype);
        }
        let n = dst.len() / h.dtype.width();
        let rest_len = dst.len() - n;
        if h.packed_len.checked_add(rest_len as u64) != Some(payload.len() as u64) || n == 0 {
            return Err(CodecError::Inconsistent {
                packed: h.packed_len,
                payload: payload.len(),
            });
        }
        let (packed, raw) = payload.split_at(h.packed_len as usize);
        self.top.resize(n, 0);
        // Into exactly `n` bytes: a frame that would decode to more fails
        // here without writing past them.
        let got = self
            .dctx
            .decompress_to_buffer(packed, &mut self.top[..n])
            .map_err(|e| CodecError::Packed {
                why: e.to_string(),
                expected: n,
            })?;
        if got != n {
            return Err(CodecError::Packed {
                why: format!("{got} bytes"),
                expected: n,
            });
        }
        join(h.dtype, &self.top[..n], raw, dst);
        Ok(h.dtype)
    }
}

struct Header {
    flags: u8,
    dtype: FloatType,
    raw_len: u64,
    packed_len: u64,
}

impl Header {
    fn parse(frame: &[u8]) -> Result<Self, CodecError> {
        if frame.len() < FRAME_HEADER {
            return Err(CodecError::Truncated {
                len: frame.len(),
                need: FRAME_HEADER,
            });
        }
        if frame[0] != VERSION {
            return Err(CodecError::Unknown {
                what: "version",
                value: frame[0],
            });
        }
        if frame[1] & !RAW != 0 || frame[3] != 0 {
            return Err(CodecError::Unknown {
                what: "flags",
                value: frame[1],
            });
        }
        let dtype = FloatType::from_u8(frame[2]).ok_or(CodecError::Unknown {
            what: "dtype",
            value: frame[2],
        })?;
        let u32_at = |i: usize| u32::from_le_bytes(frame[i..i + 4].try_into().expect("4 bytes"));
        Ok(Self {
            flags: frame[1],
            dtype,
            raw_len: u32_at(4).into(),
            packed_len: u32_at(8).into(),
        })
    }
}

fn put_header(out: &mut [u8], flags: u8, dtype: FloatType, raw_len: usize, packed_len: usize) {
    out[0] = VERSION;
    out[1] = flags;
    out[2] = dtype as u8;
    out[3] = 0;
    out[4..8].copy_from_slice(&(raw_len as u32).to_le_bytes());
    out[8..12].copy_from_slice(&(packed_len as u32).to_le_bytes());
}

/// The top byte of each of the `n` values, rotated, into `top`.
fn split(dtype: FloatType, chunk: &[u8], n: usize, top: &mut Vec<u8>) {
    // Sized first, then filled by zipped slices: loops the compiler
    // vectorizes (an `extend` from a mapped iterator is not).
    top.clear();
    top.resize(n, 0);
    match dtype.width() {
        1 => {
            for (t, b) in top.iter_mut().zip(&chunk[..n]) {
                *t = b.rotate_left(1);
            }
        }
        2 => {
            for (t, v) in top.iter_mut().zip(chunk.chunks_exact(2)) {
                *t = (u16::from_le_bytes([v[0], v[1]]).rotate_left(1) >> 8) as u8;
            }
        }
        _ => {
            for (t, v) in top.iter_mut().zip(chunk.chunks_exact(4)) {
                *t = (u32::from_le_bytes([v[0], v[1], v[2], v[3]]).rotate_left(1) >> 24) as u8;
            }
        }
    }
}

/// The other planes of the `n` values (plane by plane), then the tail.
fn rest(dtype: FloatType, chunk: &[u8], n: usize, out: &mut [u8]) {
    let w = dtype.width();
    let tail = &chunk[n * w..];
    let (planes, out_tail) = out.split_at_mut(n * (w - 1));
    out_tail.copy_from_slice(tail);
    match w {
        1 => {}
        2 => {
            for (o, v) in planes.iter_mut().zip(chunk.chunks_exact(2)) {
                *o = u16::from_le_bytes([v[0], v[1]]).rotate_left(1) as u8;
            }
        }
        _ => {
            for (i, v) in chunk.chunks_exact(4).enumerate() {
                let r = u32::from_le_bytes([v[0], v[1], v[2], v[3]]).rotate_left(1);
                for p in 0..3 {
                    planes[p * n + i] = (r >> (8 * p)) as u8;
                }
            }
        }
    }
}

/// The inverse of `split` + `rest`, into `dst`.
fn join(dtype: FloatType, top: &[u8], raw: &[u8], dst: &mut [u8]) {
    let (w, n) = (dtype.width(), top.len());
    let (planes, tail) = raw.split_at(n * (w - 1));
    dst[n * w..].copy_from_slice(tail);
    match w {
        1 => {
            for (d, t) in dst[..n].iter_mut().zip(top) {
                *d = t.rotate_right(1);
            }
        }
        2 => {
            for (i, d) in dst[..2 * n].chunks_exact_mut(2).enumerate() {
                let r = (u16::from(top[i]) << 8) | u16::from(planes[i]);
                d.copy_from_slice(&r.rotate_right(1).to_le_bytes());
            }
        }
        _ => {
            for (i, d) in dst[..4 * n].chunks_exact_mut(4).enumerate() {
                let r = (u32::from(top[i]) << 24)
                    | (u32::from(planes[2 * n + i]) << 16)
                    | (u32::from(planes[n + i]) << 8)
                    | u32::from(planes[i]);
                d.copy_from_slice(&r.rotate_right(1).to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [FloatType; 6] = [
        FloatType::Bytes,
        FloatType::Bf16,
        FloatType::Fp16,
        FloatType::Fp32,
        FloatType::Fp8E4m3,
        FloatType::Fp8E5m2,
    ];

    /// A deterministic stand-in for weights: values of a normal-ish
    /// distribution (sum of uniforms) of scale 0.02, as `dtype`.
    fn weights(dtype: FloatType, n_bytes: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut out = Vec::with_capacity(n_bytes);
        while out.len() < n_bytes {
            let v = ((0..4).map(|_| rnd()).sum::<f64>() - 2.0) * 0.02;
            let f = v as f32;
            match dtype.width() {
                4 => out.extend_from_slice(&f.to_le_bytes()),
                2 if dtype == FloatType::Bf16 => {
                    out.extend_from_slice(&((f.to_bits() >> 16) as u16).to_le_bytes())
                }
                2 => out.extend_from_slice(&f16_bits(f).to_le_bytes()),
                _ => out.push((f.to_bits() >> 24) as u8),
            }
        }
        out.truncate(n_bytes);
        out
    }

    /// f32 -> IEEE half, truncating (enough for test data).
    fn f16_bits(f: f32) -> u16 {
        let b = f.to_bits();
        let sign = ((b >> 16) & 0x8000) as u16;
        let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
        if exp <= 0 {
            return sign;
        }
        sign | ((exp.min(30) as u16) << 10) | ((b >> 13) & 0x3ff) as u16
    }

    #[test]
    fn every_dtype_round_trips_at_odd_lengths() {
        let mut c = Codec::new().unwrap();
        let mut frame = Vec::new();
        for dtype in ALL {
            for len in [0usize, 1, 2, 3, 5, 4097, (1 << 20) + 3] {
                let data = weights(dtype, len, len as u64 + 7);
                c.encode(dtype, &data, &mut frame).unwrap();
                let mut back = vec![0xAAu8; len];
                assert_eq!(c.decode(&frame, &mut back).unwrap(), dtype);
                assert_eq!(back, data, "{dtype:?} {len}");
            }
        }
    }

    #[test]
    fn weight_like_floats_shrink_and_random_bytes_go_raw() {
        let mut c = Codec::new().unwrap();
        let mut frame = Vec::new();
        let n = 1 << 20;
        let bf16 = weights(FloatType::Bf16, n, 3);
        c.encode(FloatType::Bf16, &bf16, &mut frame).unwrap();
        let ratio = n as f64 / frame.len() as f64;
        assert!(ratio > 1.25, "bf16 shrank only {ratio:.3}x");
        assert_eq!(frame[1] & RAW, 0);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let noise: Vec<u8> = (0..n)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                (x >> 33) as u8
            })
            .collect();
        c.encode(FloatType::Bf16, &noise, &mut frame).unwrap();
        assert_eq!(frame[1] & RAW, RAW, "incompressible data goes raw");
        assert_eq!(frame.len(), FRAME_HEADER + n);
        let mut back = vec![0u8; n];
        c.decode(&frame, &mut back).unwrap();
        assert_eq!(back, noise);
    }

    #[test]
    fn frames_that_lie_are_refused() {
        let mut c = Codec::new().unwrap();
        let mut frame = Vec::new();
        let data = weights(FloatType::Bf16, 65_536, 5);
        c.encode(FloatType::Bf16, &data, &mut frame).unwrap();
        assert_eq!(frame[1] & RAW, 0);
        let mut dst = vec![0u8; data.len()];
        // Another length than the request's.
        let mut short = vec![0u8; data.len() - 2];
        assert!(matches!(
            c.decode(&frame, &mut short),
            Err(CodecError::Length { .. })
        ));
        // A flipped byte in the packed plane: zstd's checksum (or its
        // format) refuses it.
        let mut bad = frame.clone();
        bad[FRAME_HEADER + 20] ^= 0x40;
        assert!(c.decode(&bad, &mut dst).is_err());
        // Truncated, trailing bytes, unknown fields.
        assert!(c.decode(&frame[..frame.len() - 1], &mut dst).is_err());
        let mut long = frame.clone();
        long.push(0);
        assert!(matches!(
            c.decode(&long, &mut dst),
            Err(CodecError::Inconsistent { .. })
        ));
        for (at, v) in [(0usize, 9u8), (1, 2), (2, 6), (3, 1)] {
            let mut f = frame.clone();
            f[at] = v;
            assert!(
                matches!(c.decode(&f, &mut dst), Err(CodecError::Unknown { .. })),
                "{at}"
            );
        }
        assert!(c.decode(&frame[..5], &mut dst).is_err());
        c.decode(&frame, &mut dst).unwrap();
        assert_eq!(dst, data);
    }

    /// `FERRY_CODEC_CORPUS=dir cargo test --lib codec` writes seed inputs
    /// for the `codec_frame` fuzz target (u16 chunk length + frame).
    #[test]
    fn seed_frames_for_the_fuzzer() {
        let Some(dir) = std::env::var_os("FERRY_CODEC_CORPUS") else {
            return;
        };
        let mut c = Codec::new().unwrap();
        let mut frame = Vec::new();
        for (i, dtype) in ALL.into_iter().enumerate() {
            for len in [0usize, 3, 64, 1001] {
                let data = weights(dtype, len, i as u64 + 1);
                c.encode(dtype, &data, &mut frame).unwrap();
                let mut seed = (len as u16).to_le_bytes().to_vec();
                seed.extend_from_slice(&frame);
                let path = std::path::Path::new(&dir).join(format!("{dtype:?}-{len}"));
                std::fs::write(path, seed).unwrap();
            }
        }
    }

    #[test]
    fn a_decompression_bomb_writes_nothing_past_its_chunk() {
        // 1 MiB of zeros packs into a few bytes; framed as a 1000-byte
        // bf16 chunk (500 values), it must fail, not grow.
        let mut c = Codec::new().unwrap();
        let bomb = zstd::bulk::compress(&vec![0u8; 1 << 20], 1).unwrap();
        let rest = 1000 - 500;
        let mut frame = vec![0u8; FRAME_HEADER];
        put_header(&mut frame, 0, FloatType::Bf16, 1000, bomb.len());
        frame.extend_from_slice(&bomb);
        frame.extend_from_slice(&vec![0u8; rest]);
        let mut dst = vec![0u8; 1000];
        let e = c.decode(&frame, &mut dst).unwrap_err();
        assert!(matches!(e, CodecError::Packed { expected: 500, .. }), "{e}");
    }
}

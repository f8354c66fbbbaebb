//! Compression on the tcp path (issue 27): typed registrations packed by
//! the codec, byte-exact at odd offsets and lengths for every type, chunks
//! that do not shrink going as they are, and peers that turn it off.

mod common;

use std::time::Duration;

use common::*;
use ferry::codec::FloatType;
use ferry::oob::IoPreference;
use ferry::{Compress, Config, Endpoint, MemoryRegion};

/// Two tcp endpoints, `a` connected to `b`, each with its own setting.
fn pair(a_mode: Compress, b_mode: Compress) -> (Endpoint, Endpoint, ferry::ConnId) {
    let mk = |mode| {
        let mut c: Config = config(IoPreference::Auto);
        c.compress = mode;
        c.compress_threads = 2;
        // Several frames per op, cut at odd places.
        c.chunk_bytes = 192 << 10;
        Endpoint::builder().config(c).build().unwrap()
    };
    let (a, b) = (mk(a_mode), mk(b_mode));
    b.start_passive_accept().unwrap();
    let conn = a.add_remote(&b.metadata_bytes()).unwrap();
    b.accept(Duration::from_secs(5)).unwrap();
    (a, b, conn)
}

/// Deterministic values that look like a layer's weights: small normals
/// (a sum of uniforms), in `dtype`'s bytes; `Bytes` gets text-like bytes.
fn weights(dtype: FloatType, len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut uniform = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut out = Vec::with_capacity(len + 4);
    while out.len() < len {
        let v = (((0..4).map(|_| uniform()).sum::<f64>() - 2.0) * 0.02) as f32;
        match dtype {
            FloatType::Bf16 => out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes()),
            FloatType::Fp16 => out.extend_from_slice(&f16_bits(v).to_le_bytes()),
            FloatType::Fp32 => out.extend_from_slice(&v.to_le_bytes()),
            // e4m3 / e5m2: sign, then the exponent's top bits set by scale.
            FloatType::Fp8E4m3 | FloatType::Fp8E5m2 => {
                let e = (v.abs() * 400.0).log2().clamp(0.0, 7.0) as u8;
                out.push(((v < 0.0) as u8) << 7 | e << 3 | (uniform() * 8.0) as u8);
            }
            _ => {
                let words = [b"the ".as_slice(), b"weights ", b"of a ", b"layer\n"];
                out.extend_from_slice(words[(uniform() * 4.0) as usize]);
            }
        }
    }
    out.truncate(len);
    out
}

fn f16_bits(f: f32) -> u16 {
    let b = f.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    if exp <= 0 {
        return sign;
    }
    sign | ((exp.min(30) as u16) << 10) | ((b >> 13) & 0x3ff) as u16
}

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn typed(ep: &Endpoint, len: usize, dtype: FloatType, fill: u8) -> MemoryRegion {
    let mr = ep.alloc(len).unwrap().with_dtype(dtype);
    mr.write_at(0, &vec![fill; len]).unwrap();
    mr
}

fn bytes(mr: &MemoryRegion) -> Vec<u8> {
    let mut v = vec![0u8; mr.len()];
    mr.read_at(0, &mut v).unwrap();
    v
}

/// A WRITE of `data` from `a` at offset 3 into `b`'s window at offset 5,
/// then a READ of it back into `a` at offset 7: both byte-exact, and
/// nothing outside the ranges touched.
fn round_trip(a: &Endpoint, b: &Endpoint, conn: ferry::ConnId, dtype: FloatType, data: &[u8]) {
    let n = data.len();
    let src = typed(a, n + 16, dtype, 0xa5);
    src.write_at(3, data).unwrap();
    let dst = typed(b, n + 16, dtype, 0xee);
    let win = dst.advertise(5, n).unwrap();
    a.write(conn, &src, 3, n, &win).unwrap();
    let got = bytes(&dst);
    assert!(got[..5].iter().all(|&x| x == 0xee), "{dtype:?}: before");
    assert!(got[5..5 + n] == *data, "{dtype:?}: WRITE not byte-exact");
    assert!(got[5 + n..].iter().all(|&x| x == 0xee), "{dtype:?}: after");
    let back = typed(a, n + 16, dtype, 0x11);
    a.read(conn, &back, 7, n, &win).unwrap();
    let got = bytes(&back);
    assert!(got[..7].iter().all(|&x| x == 0x11), "{dtype:?}: before");
    assert!(got[7..7 + n] == *data, "{dtype:?}: READ not byte-exact");
    assert!(got[7 + n..].iter().all(|&x| x == 0x11), "{dtype:?}: after");
}

#[test]
fn every_type_goes_packed_and_arrives_byte_exact() {
    let (a, b, conn) = pair(Compress::On, Compress::On);
    let types = [
        FloatType::Bf16,
        FloatType::Fp16,
        FloatType::Fp32,
        FloatType::Fp8E4m3,
        FloatType::Fp8E5m2,
        FloatType::Bytes,
    ];
    for (i, dtype) in types.into_iter().enumerate() {
        let before = (a.compress_stats().unwrap(), b.compress_stats().unwrap());
        // Five frames and an odd tail (not a whole value at the end).
        let data = weights(dtype, (1 << 20) + 333, i as u64 + 1);
        round_trip(&a, &b, conn, dtype, &data);
        let (sa, sb) = (a.compress_stats().unwrap(), b.compress_stats().unwrap());
        assert!(
            sa.packed > before.0.packed,
            "{dtype:?}: a packed nothing: {sa:?}"
        );
        assert!(
            sb.unpacked > before.1.unpacked,
            "{dtype:?}: b unpacked nothing"
        );
        assert!(
            sb.packed > before.1.packed,
            "{dtype:?}: the READ went plain"
        );
        assert!(
            sa.unpacked > before.0.unpacked,
            "{dtype:?}: a unpacked nothing"
        );
    }
    let s = a.compress_stats().unwrap();
    assert!(s.wire_bytes < s.raw_bytes, "{s:?}");
    assert_eq!(s.threads, 2);
}

#[test]
fn chunks_that_do_not_shrink_go_as_they_are() {
    let (a, b, conn) = pair(Compress::On, Compress::On);
    let data = random_bytes((1 << 20) + 17, 9);
    round_trip(&a, &b, conn, FloatType::Bf16, &data);
    let s = a.compress_stats().unwrap();
    assert!(s.tried > 0, "{s:?}");
    assert_eq!(s.packed, 0, "random bytes were sent packed: {s:?}");
    assert_eq!(b.compress_stats().unwrap().unpacked, 0);
}

#[test]
fn a_peer_that_turns_it_off_gets_plain_frames() {
    for (x, y) in [(Compress::On, Compress::Off), (Compress::Off, Compress::On)] {
        let (a, b, conn) = pair(x, y);
        let data = weights(FloatType::Bf16, 1 << 20, 3);
        round_trip(&a, &b, conn, FloatType::Bf16, &data);
        for ep in [&a, &b] {
            if let Some(s) = ep.compress_stats() {
                assert_eq!((s.tried, s.unpacked, s.threads), (0, 0, 0), "{s:?}");
            }
        }
    }
}

#[test]
fn untyped_memory_and_small_chunks_go_plain() {
    let (a, b, conn) = pair(Compress::On, Compress::On);
    let n = 1 << 20;
    let src = a.alloc(n).unwrap();
    src.write_at(0, &weights(FloatType::Bf16, n, 5)).unwrap();
    let dst = b.alloc(n).unwrap();
    a.write(conn, &src, 0, n, &dst.advertise(0, n).unwrap())
        .unwrap();
    // Typed, but 8 KiB: below what is worth packing.
    let t = typed(&b, 8192, FloatType::Bf16, 0);
    a.write(conn, &src, 0, 8192, &t.advertise(0, 8192).unwrap())
        .unwrap();
    assert_eq!(a.compress_stats().unwrap().tried, 0);
    assert_eq!(bytes(&dst), bytes(&src));
}

#[test]
fn the_window_carries_the_type() {
    let ep = client(IoPreference::Auto);
    let mr = ep.alloc(4096).unwrap();
    assert_eq!(mr.advertise(0, 4096).unwrap().dtype(), None);
    mr.set_dtype(Some(FloatType::Fp16));
    assert_eq!(mr.dtype(), Some(FloatType::Fp16));
    let w = mr.advertise(8, 64).unwrap();
    assert_eq!(w.dtype(), Some(FloatType::Fp16 as u8));
}

/// A hostile peer that agreed to the codec sends a packed WRITE whose
/// frame decodes to 2 MiB for a 64 KiB request (a decompression bomb),
/// then one that fails its checksum: each kills its connection, with the
/// codec's reason, and nothing past the request's window is written.
#[test]
fn bombs_and_bad_checksums_kill_the_connection_with_their_reason() {
    use ferry::codec::Codec;
    use ferry::wire::{ControlFrame, DataHeader, DataKind, Hello, CAP_CODEC};
    use std::io::{Read, Write};
    let mut c: Config = config(IoPreference::Auto);
    c.compress = Compress::On;
    let b = Endpoint::builder().config(c).build().unwrap();
    b.start_passive_accept().unwrap();
    let addr = ferry::EndpointMetadata::decode(&b.metadata_bytes())
        .unwrap()
        .socket_addr();
    let dst = typed(&b, 4 << 20, FloatType::Bytes, 0x5a);
    let win = dst.advertise(0, 64 << 10).unwrap();
    let mut codec = Codec::new().unwrap();
    let mut bomb = Vec::new();
    assert!(codec
        .pack(FloatType::Bytes, &vec![0u8; 2 << 20], &mut bomb)
        .unwrap());
    let chunk = weights(FloatType::Bf16, 64 << 10, 4);
    let mut bad = Vec::new();
    assert!(codec.pack(FloatType::Bf16, &chunk, &mut bad).unwrap());
    let packed = u32::from_le_bytes(bad[8..12].try_into().unwrap()) as usize;
    bad[ferry::codec::FRAME_HEADER + packed - 1] ^= 0x40; // the checksum's last byte
    for (frame, why) in [(bomb, "decodes to 2097152 bytes"), (bad, "checksum")] {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let hello = Hello {
            endpoint_id: 77,
            caps: CAP_CODEC,
            conn_nonce: 0x1234,
            stream_idx: 0,
            stream_count: 1,
            max_inflight: 8,
            host_token: 0,
            auth_nonce: 5,
        };
        s.write_all(&ControlFrame::Hello(hello).encode()).unwrap();
        let ControlFrame::HelloAck(_) = read_control_frame(&mut s) else {
            panic!("not acknowledged")
        };
        let (conn, _) = b.accept(Duration::from_secs(5)).unwrap();
        let h = DataHeader::request(
            DataKind::WriteReq,
            win.rkey,
            win.key_tag(),
            1,
            win.addr,
            64 << 10,
        )
        .packed(frame.len() as u32);
        s.write_all(&h.encode()).unwrap();
        s.write_all(&frame).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut sink = [0u8; 64];
        assert_eq!(
            s.read(&mut sink).unwrap_or(0),
            0,
            "no ack, and the connection closed"
        );
        // An op on the dead connection fails with the reason it died.
        let err = b.write(conn, &dst, 0, 16, &win).unwrap_err().to_string();
        assert!(err.contains(why), "{err}");
    }
    assert!(
        bytes(&dst)[64 << 10..].iter().all(|&x| x == 0x5a),
        "written past the window"
    );
}

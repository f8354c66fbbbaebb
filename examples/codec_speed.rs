//! How fast one core packs and unpacks a file of values with the codec,
//! in 4 MiB chunks (the tcp path's default frame), and the ratio:
//! `cargo run --release --example codec_speed -- FILE bf16` (files from
//! `benches/fetch_weights.py`).
use ferry::codec::{Codec, FloatType};
use std::time::Instant;

fn main() {
    let mut a = std::env::args().skip(1);
    let path = a.next().expect("FILE");
    let dtype = FloatType::parse(&a.next().unwrap_or("bf16".into())).expect("dtype");
    let data = std::fs::read(path).expect("read");
    let chunk = 4 << 20;
    let mut c = Codec::new().unwrap();
    let mut out = Vec::new();
    let mut back = vec![0u8; chunk];
    let (mut raw, mut wire, mut t_enc, mut t_dec) = (0usize, 0usize, 0f64, 0f64);
    for _ in 0..4 {
        for ch in data.chunks_exact(chunk) {
            let t = Instant::now();
            assert!(c.pack(dtype, ch, &mut out).unwrap());
            t_enc += t.elapsed().as_secs_f64();
            let t = Instant::now();
            c.decode(&out, &mut back).unwrap();
            t_dec += t.elapsed().as_secs_f64();
            raw += ch.len();
            wire += out.len();
        }
    }
    println!(
        "{}: ratio {:.3}, pack {:.2} GB/s, unpack {:.2} GB/s (one core)",
        dtype.name(),
        raw as f64 / wire as f64,
        raw as f64 / t_enc / 1e9,
        raw as f64 / t_dec / 1e9
    );
}

#![no_main]
//! A peer's compressed frame (src/codec.rs): decoding never panics and
//! never writes past the chunk the request asked for; what decodes, encodes
//! and decodes back to the same bytes.
use ferry::codec::Codec;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first two bytes are the request's chunk length (the receiver
    // knows it from the request, not from the frame).
    if data.len() < 2 {
        return;
    }
    let want = u16::from_le_bytes([data[0], data[1]]) as usize;
    let frame = &data[2..];
    let mut c = Codec::new().expect("zstd contexts");
    let mut dst = vec![0u8; want];
    if let Ok(dtype) = c.decode(frame, &mut dst) {
        let mut again = Vec::new();
        c.encode(dtype, &dst, &mut again).expect("a decoded chunk encodes");
        let mut back = vec![0u8; want];
        c.decode(&again, &mut back).expect("our own frame decodes");
        assert_eq!(back, dst);
    }
});

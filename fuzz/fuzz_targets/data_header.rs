#![no_main]
//! The tcp data path's 32-byte header: never panics; whatever decodes
//! re-encodes to the input and carries a capped payload length.
use ferry::wire::{DataHeader, DATA_HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = DataHeader::decode(data) {
        assert_eq!(data.len(), DATA_HEADER_LEN);
        assert_eq!(h.encode().as_slice(), data);
        assert!(h.payload_len() <= u32::MAX as u64);
        // A packed frame is never longer than what it decodes to, nor than
        // the bound: what a peer can make us buffer.
        if h.packed_len != 0 {
            assert!(h.packed_len as u64 <= h.len);
            assert!(h.packed_len <= ferry::wire::MAX_PACKED_FRAME);
        }
    }
});

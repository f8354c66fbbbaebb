#![no_main]
//! RemoteBuf (FifoItem): exactly 64 bytes decode, and re-encode to the input.
use ferry::wire::RemoteBuf;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match RemoteBuf::decode(data) {
        Ok(rb) => assert_eq!(rb.encode().as_slice(), data),
        Err(_) => assert_ne!(data.len(), 64),
    }
});

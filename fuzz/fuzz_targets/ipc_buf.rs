#![no_main]
//! IpcBuf: decode never panics, and what decodes re-encodes to the input.
use ferry::wire::IpcBuf;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(b) = IpcBuf::decode(data) {
        assert_eq!(b.encode().as_slice(), data);
    }
});

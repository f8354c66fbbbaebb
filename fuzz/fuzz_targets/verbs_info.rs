#![no_main]
//! VerbsInfo: decode never panics, and what decodes re-encodes to the input.
use ferry::wire::VerbsInfo;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(v) = VerbsInfo::decode(data) {
        assert_eq!(v.encode(), data);
    }
});

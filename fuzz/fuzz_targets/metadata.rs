#![no_main]
//! Endpoint metadata: never panics; whatever decodes re-encodes to the input.
use ferry::wire::EndpointMetadata;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = EndpointMetadata::decode(data) {
        assert_eq!(m.encode(), data);
    }
});

#![no_main]
//! Shared-memory ring messages: never panic; whatever decodes re-encodes to
//! the input.
use ferry::testkit::shm_msg_round_trip;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(again) = shm_msg_round_trip(data) {
        assert_eq!(again, data);
    }
});

#![no_main]
//! Shared-memory ring messages: never panic; whatever decodes re-encodes to
//! the input.
use ferry::wire::{ShmMsg, SHM_SLOT_PAYLOAD};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((m, inline)) = ShmMsg::decode(data) {
        let mut out = [0u8; SHM_SLOT_PAYLOAD];
        let n = m.encode(inline, &mut out);
        assert_eq!(&out[..n], data);
    }
});

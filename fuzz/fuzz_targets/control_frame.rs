#![no_main]
//! Control frames: never panic; the header check agrees with the full
//! decode; whatever decodes re-encodes to the input.
use ferry::wire::{ControlFrame, CONTROL_HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let decoded = ControlFrame::decode(data);
    if data.len() >= CONTROL_HEADER_LEN {
        let header: [u8; CONTROL_HEADER_LEN] = data[..CONTROL_HEADER_LEN].try_into().unwrap();
        if let Ok(len) = ControlFrame::body_len(&header) {
            if decoded.is_ok() {
                assert_eq!(len, data.len() - CONTROL_HEADER_LEN);
            }
        } else {
            assert!(decoded.is_err());
        }
    }
    if let Ok(f) = decoded {
        assert_eq!(f.encode(), data);
    }
});

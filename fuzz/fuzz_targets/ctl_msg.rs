#![no_main]
//! The two-sided protocol's messages (`CtlMsg`: offers, answers, eager
//! messages, bounce grants and landings) a peer sends: anything decodes or
//! is refused without a panic, and what decodes re-encodes to the input.
use ferry::wire::CtlMsg;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = CtlMsg::decode(data) {
        assert_eq!(m.encode(), data);
    }
});

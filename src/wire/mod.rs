//! Sans-IO codecs for every byte format ferry puts on a wire or hands to a
//! peer: endpoint metadata, the 64-byte `RemoteBuf` (the seed's `FifoItem`),
//! control-path frames, the tcp data path's fixed headers and the
//! same-host rings' messages.
//!
//! Nothing here makes a syscall or reads a clock. Every decoder treats its
//! input as hostile: lengths are capped, reserved fields checked, and trailing
//! bytes rejected. Each decoder has a fuzz target under `fuzz/` that also
//! checks that decode-then-encode gives the input back.

mod cursor;
mod data;
mod frame;
mod ipc;
mod metadata;
mod msg;
mod remote_buf;
pub(crate) mod shm_msg;
mod verbs;
mod window;

pub use cursor::DecodeError;
pub use data::{
    DataHeader, DataKind, Status, DATA_HEADER_LEN, FLAG_PACKED, MAX_NOTIFY_BYTES,
    MAX_NOTIFY_WIRE_BYTES, MAX_PACKED_FRAME, NOTE_APP, NOTE_CTL,
};
pub use frame::{
    encode_dialed, ControlFrame, Hello, CAP_AUTH, CAP_CODEC, CAP_INTEGRITY_FULL, CAP_SHM,
    CAP_VERBS, CONTROL_HEADER_LEN, CONTROL_MAGIC, MAX_CONTROL_BODY, MAX_STREAMS, PROTOCOL_VERSION,
};
pub use ipc::{IpcBuf, IpcRef, IPC_BUF_LEN};
pub use metadata::{normalize_bus_id, EndpointMetadata, MAX_BDF_LEN};
pub use msg::{CtlMsg, FinStatus, MAX_EAGER_BYTES};
pub use remote_buf::{NicKeys, RemoteBuf, REMOTE_BUF_LEN, REMOTE_FLAG_DEVICE, REMOTE_FLAG_NIC_KEY};
pub use shm_msg::{
    Msg as ShmMsg, MsgKind as ShmMsgKind, MAX_INLINE as SHM_MAX_INLINE,
    SLOT_PAYLOAD as SHM_SLOT_PAYLOAD,
};
#[cfg(test)]
pub(crate) use verbs::tests::sample as verbs_sample;
pub use verbs::{NicAddr, VerbsInfo, LINK_ETHERNET, LINK_INFINIBAND, MAX_DATA_QPS, MAX_NICS};
pub use window::AnyWindow;

#[cfg(test)]
pub(crate) mod testrng {
    /// xorshift64*: a seeded generator so property tests replay exactly.
    pub struct Rng(pub u64);
    impl Rng {
        pub fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            self.0 = x;
            x.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        pub fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
        pub fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }
}

//! The protocol of one tcp data stream, with no I/O: a state machine that
//! takes received bytes, time and copy completions in, and says what to
//! send and where the next bytes should land.
//!
//! The driver (`stream.rs`, or the `Pair` harness in tests) calls, in any
//! interleaving:
//!
//! * `push_request` / `push_notify` to queue frames (after `can_request` /
//!   `can_notify`), `release` when a staged GPU copy of a gated frame ends;
//! * `tx_iovecs` to learn what may be written now (frames in order, a gated
//!   frame and everything behind it held back), then `on_sent(n)` with the
//!   number of bytes the socket took;
//! * `rx_iovecs` to learn where received bytes go (the rest of a payload's
//!   destination first, then the header buffer), then `on_received(n)`;
//! * `step` to handle what is buffered, one unit at a time, until it says
//!   `NeedBytes` (read more) or `Blocked` (the shard must make room first:
//!   a full inbox, or no bounce buffer free);
//! * `oldest_pending` for the op timeout, `fail_pending` when the stream
//!   dies.
//!
//! Every memory range it hands out lies in a `RegionSlice` it holds, so the
//! pointers in `tx_iovecs` / `rx_iovecs` stay valid until the next call
//! that takes `&mut self`.
//!
//! On an authenticated connection (`Integrity`) every frame header is
//! followed by a 16-byte tag over its sequence number and the header, so a
//! relay can neither inject, replay, reorder nor alter a frame's header
//! (its key, address, length, op id): the frame fails verification before
//! anything acts on it and the connection dies. In `full` mode a frame with
//! a payload also ends with a tag over the payload, checked before the op
//! completes (a READ's data) or is acknowledged (a WRITE's).

mod integrity;
mod pack;
mod rx;
mod target;
mod tx;

use std::collections::VecDeque;
use std::time::Instant;

use crate::auth::{FrameKey, Tag, TAG_LEN};
use crate::error::Error;
use crate::region::RegionSlice;
use crate::wire::{Status, DATA_HEADER_LEN};
use crate::xfer::{PendingOp, Sink};

pub(crate) use pack::{CodecCounters, PackChoice, PackMode, PackShared};

const HDR: usize = DATA_HEADER_LEN;
/// Receive buffer for headers (and payload bytes that share their read).
pub(crate) const RBUF_BYTES: usize = 256 * 1024;
/// iovecs gathered into one `writev`.
pub(crate) const MAX_IOV: usize = 64;
/// Notifications queued for sending per stream.
pub(crate) const NOTIFY_QUEUE: usize = 64;

/// Frame MACs of one stream of an authenticated connection.
#[derive(Clone, Debug)]
pub(crate) struct Integrity {
    /// Tags the frames we send.
    pub tx: FrameKey,
    /// Checks the frames we receive.
    pub rx: FrameKey,
    /// Payloads too, not only headers.
    pub full: bool,
}

/// Per-stream bounds, fixed at connection time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StreamLimits {
    /// Requests we keep outstanding at most.
    pub own_max: usize,
    /// Requests the peer declared it keeps outstanding at most.
    pub peer_max: usize,
    /// Both sides offered the codec (`CAP_CODEC`): packed frames may flow.
    pub codec: bool,
}

/// What a frame's payload is, and what keeps it alive until it is sent.
enum TxPayload {
    None,
    Slice(RegionSlice),
    Bytes(Vec<u8>),
    /// A codec frame (its buffer is reused once sent).
    Packed(Vec<u8>),
}

impl TxPayload {
    fn ptr_len(&self) -> (*const u8, usize) {
        match self {
            TxPayload::None => (std::ptr::null(), 0),
            TxPayload::Slice(s) => (s.ptr(), s.len()),
            TxPayload::Bytes(b) | TxPayload::Packed(b) => (b.as_ptr(), b.len()),
        }
    }
}

struct TxFrame {
    /// The header, then its tag when the stream has integrity.
    hdr: [u8; HDR + TAG_LEN],
    payload: TxPayload,
    /// Packed (as these values) once its staging copy ends.
    pack_after: Option<crate::codec::FloatType>,
    /// The payload's tag (`full` integrity, frames with a payload).
    trailer: Tag,
    /// This frame's number among the frames we send on the stream.
    seq: u64,
    class: FrameClass,
    /// Non-zero: not to be sent until `release(gate)` (its payload is being
    /// staged from GPU memory, or its ack waits for a copy into it).
    gate: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum FrameClass {
    Request,
    Response,
    Notify,
}

/// On tcp a request also has the op id its response must echo.
struct Pending {
    op_id: u64,
    op: PendingOp,
}

enum After {
    Ack {
        op_id: u64,
        status: Status,
    },
    ReadDone,
    /// A WRITE into GPU memory landed in a bounce buffer: copy it on, then
    /// acknowledge.
    AckStaged {
        op_id: u64,
        gpu: RegionSlice,
        bounce: RegionSlice,
    },
}

enum Rx {
    Header,
    /// Payload bytes go into `into`; `done` of them have arrived.
    Payload {
        into: RegionSlice,
        done: usize,
        then: After,
    },
    Discard {
        left: usize,
        then: After,
        /// The tag of the bytes passing by (`full` integrity).
        run: Option<crate::auth::TagRun>,
    },
    Notify {
        buf: Vec<u8>,
        want: usize,
    },
    NotifyBlocked(Vec<u8>),
    /// A packed payload arriving into a buffer of its own, to be decoded
    /// into `dst`.
    Packed {
        buf: Vec<u8>,
        done: usize,
        dst: RegionSlice,
        then: pack::Unpack,
        held: crate::xfer::Held,
    },
    /// A payload is in; its tag (`full` integrity) must match `expected`
    /// before `then` happens.
    Trailer {
        expected: Tag,
        then: Then,
    },
}

/// What follows a checked payload.
enum Then {
    Finish(After),
    Deliver(Vec<u8>),
    Unpack(Vec<u8>, RegionSlice, pack::Unpack, crate::xfer::Held),
}

/// What `step` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Handled a unit (a header, a finished payload, a notification).
    Progress,
    /// Needs more bytes from the peer.
    NeedBytes,
    /// Cannot go on until the shard makes room (inbox full, no bounce
    /// buffer free); reading more would only buffer what cannot be handled.
    Blocked,
}

pub(crate) struct StreamProto {
    limits: StreamLimits,
    tx: VecDeque<TxFrame>,
    /// Bytes of `tx.front()` already sent.
    head_sent: usize,
    notify_queued: usize,
    pending: VecDeque<Pending>,
    /// Requests received from the peer whose response is not yet sent.
    peer_owed: usize,
    rbuf: Box<[u8]>,
    rs: usize,
    re: usize,
    rx: Rx,
    /// This stream's index in its connection (names it in `Stage`).
    idx: u8,
    next_gate: u64,
    /// When bytes last arrived (`on_received`'s clock).
    last_rx: Option<Instant>,
    mac: Option<Integrity>,
    /// Numbers of the next frame we send and the next we receive.
    tx_seq: u64,
    rx_seq: u64,
    /// Packed frames, when both sides offered the codec.
    pack: Option<pack::PackState>,
}

// SAFETY: the only raw pointers a StreamProto makes are derived on demand
// from the `RegionSlice`s and buffers it owns; moving it to another thread
// moves those owners with it.
unsafe impl Send for StreamProto {}

const EMPTY_IOV: libc::iovec = libc::iovec {
    iov_base: std::ptr::null_mut(),
    iov_len: 0,
};

impl StreamProto {
    pub fn new(limits: StreamLimits, idx: u8, mac: Option<Integrity>) -> Self {
        Self {
            limits,
            tx: VecDeque::with_capacity(limits.own_max + limits.peer_max + NOTIFY_QUEUE),
            head_sent: 0,
            notify_queued: 0,
            pending: VecDeque::with_capacity(limits.own_max),
            peer_owed: 0,
            rbuf: vec![0u8; RBUF_BYTES].into_boxed_slice(),
            rs: 0,
            re: 0,
            rx: Rx::Header,
            idx,
            next_gate: 1,
            last_rx: None,
            mac,
            tx_seq: 0,
            rx_seq: 0,
            pack: None,
        }
    }

    pub fn can_request(&self) -> bool {
        self.pending.len() < self.limits.own_max
    }

    pub fn can_notify(&self) -> bool {
        self.notify_queued < NOTIFY_QUEUE
    }

    pub fn has_tx(&self) -> bool {
        !self.tx.is_empty()
    }

    /// Whether the front frame may be sent now (queued and not gated).
    pub fn tx_ready(&self) -> bool {
        self.tx.front().is_some_and(|f| f.gate == 0)
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    #[cfg(test)]
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    pub fn oldest_pending(&self) -> Option<Instant> {
        self.pending.front().map(|p| p.op.sent_at)
    }

    /// Fails every outstanding request of this stream.
    pub fn fail_pending(&mut self, err: &Error, sink: &mut impl Sink) {
        for p in self.pending.drain(..) {
            sink.done(p.op.slot, Err(err.duplicate()));
        }
    }
}

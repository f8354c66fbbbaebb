//! One connection's streams as the protocol sees them, apart from their
//! sockets: which stream each frame of an op goes to, and when the
//! connection has failed by time. The shard's tcp side runs it over real
//! sockets, `pair.rs` over a simulated link, so dealing and the timeout
//! rules are tested without a kernel.

use std::borrow::{Borrow, BorrowMut};
use std::time::{Duration, Instant};

use super::proto::{PackChoice, StreamProto};
use crate::error::{ConnFault, OpKind};
use crate::region::{KeyRef, RegionSlice};
use crate::xfer::Progress;

/// One part of an op as the dealer sees it: our bytes, and where they go
/// (or come from) in the peer's window.
pub(crate) trait FramePart {
    fn local(&self) -> &RegionSlice;
    fn key(&self) -> KeyRef;
    fn remote_addr(&self) -> u64;
    /// What the bytes are, for the codec (None: sent as they are).
    fn dtype(&self) -> Option<crate::codec::FloatType> {
        None
    }
}

/// A frame of GPU memory: it goes through a bounce buffer the caller has
/// (or has not yet).
pub(crate) struct DeviceFrame {
    /// The stream it was dealt to.
    pub stream: usize,
    pub op_id: u64,
    pub key: KeyRef,
    pub addr: u64,
    pub local: RegionSlice,
    /// The values' type (a WRITE's chunk may go packed once staged).
    pub dtype: Option<crate::codec::FloatType>,
}

/// What the caller did with a `DeviceFrame`.
pub(crate) enum DeviceStep {
    /// Queued (sent once copied, or its READ pushed).
    Queued,
    /// No bounce buffer free now: try again later.
    Busy,
    /// None can be had: the op fails.
    Failed,
}

/// How far `deal` got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dealt {
    /// Every frame is queued.
    All,
    /// A stream (or the bounce buffers) is full: deal again later from
    /// `at`.
    Full,
    /// A GPU frame could not be staged: the op fails.
    Failed,
}

/// Deals op `slot`'s frames (each part cut into `chunk`-byte frames)
/// round-robin over `streams`, from `at` and stream `*next`, until all are
/// queued or the next stream is full. Frames of GPU memory go to `device`.
/// Op ids are `slot << 32 | frame number`.
pub(crate) fn deal<S: BorrowMut<StreamProto>, P: FramePart>(
    streams: &mut [S],
    next: &mut usize,
    (kind, slot): (OpKind, u32),
    parts: &[P],
    at: &mut Progress,
    (chunk, now): (usize, Instant),
    mut device: impl FnMut(&mut StreamProto, DeviceFrame) -> DeviceStep,
) -> Dealt {
    while at.desc < parts.len() {
        let p = &parts[at.desc];
        let n = at.frame_len(p.local().len(), chunk);
        let which = *next % streams.len();
        let s = streams[which].borrow_mut();
        if !s.can_request() {
            return Dealt::Full;
        }
        let op_id = ((slot as u64) << 32) | at.emitted as u64;
        let local = p
            .local()
            .sub(at.off, n)
            .expect("the planner stays inside the op's slice");
        let (key, addr) = (p.key(), p.remote_addr() + at.off as u64);
        if local.is_device() {
            let frame = DeviceFrame {
                stream: which,
                op_id,
                key,
                addr,
                local,
                dtype: p.dtype(),
            };
            match device(s, frame) {
                DeviceStep::Queued => {}
                DeviceStep::Busy => return Dealt::Full,
                DeviceStep::Failed => return Dealt::Failed,
            }
        } else {
            // A WRITE of typed values may go packed (the codec); a READ's
            // data is packed, or not, by the target.
            let dtype = p.dtype().filter(|_| kind == OpKind::Write);
            match s.pack_choice(dtype, n) {
                PackChoice::Pack(d) => s.push_write_packed(d, slot, op_id, key, addr, local, now),
                PackChoice::Plain => s.push_request(kind, slot, op_id, key, addr, local, now),
                PackChoice::Wait => return Dealt::Full,
            }
        }
        *next = next.wrapping_add(1);
        at.advance(n, p.local().len());
    }
    Dealt::All
}

/// When the oldest request still waiting for a reply went out, over all
/// of a connection's streams.
pub(crate) fn oldest_pending<S: Borrow<StreamProto>>(streams: &[S]) -> Option<Instant> {
    streams
        .iter()
        .filter_map(|s| s.borrow().oldest_pending())
        .min()
}

/// Why a connection must fail at `now` under op timeout `limit`: a
/// request unanswered past it, or an inbound frame begun and then silent
/// past it (half a frame holds our memory). None while neither.
pub(crate) fn overdue<S: Borrow<StreamProto>>(
    streams: &[S],
    now: Instant,
    limit: Duration,
) -> Option<ConnFault> {
    if oldest_pending(streams).is_some_and(|t| now.saturating_duration_since(t) > limit) {
        Some(ConnFault::Timeout {
            what: "a response to a request (FERRY_OP_TIMEOUT_MS)",
            timeout_ms: limit.as_millis() as u64,
        })
    } else if streams
        .iter()
        .any(|s| s.borrow().inbound_stalled(now, limit))
    {
        Some(ConnFault::Timeout {
            what: "the rest of an inbound frame begun (FERRY_OP_TIMEOUT_MS)",
            timeout_ms: limit.as_millis() as u64,
        })
    } else {
        None
    }
}

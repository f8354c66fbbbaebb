//! Packed frames on one stream (the float-aware codec, `crate::codec`):
//! which chunks are packed, the codec jobs that pack and unpack them (run
//! off the shard by the endpoint's pool; this only queues them and takes
//! their ends), and what holds a peer's packed bytes.
//!
//! Sending: a WRITE chunk (or a READ's response) whose values have a type
//! is queued as a gated frame and an `Encode` job; when the job ends the
//! frame goes packed, or as it was when packing did not pay. Receiving: a
//! packed payload is read whole into a buffer of its own (the header
//! bounds it by `MAX_PACKED_FRAME` and by the request's length), then a
//! `Decode` job writes it into the checked destination; a WRITE's ack is
//! gated until then, a READ completes then. A frame that does not decode
//! to exactly its request kills the connection with the codec's reason.

use std::time::Instant;

use super::{Rx, StreamProto, TxPayload, HDR};
use crate::error::{ConnFault, OpKind};
use crate::region::{KeyRef, RegionSlice};
use crate::wire::{DataHeader, DataKind, Status};
use crate::xfer::{Sink, Stage};

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::codec::FloatType;
use crate::wire::MAX_PACKED_FRAME;
use crate::xfer::{CodecJob, CodecOutcome, CodecTicket, CodecWork, Held};

/// Codec jobs one stream has out at most; past it, chunks to pack wait
/// (dealing stops, a peer's packed frame is left unread).
pub(crate) const PACK_SLOTS: usize = 8;
/// Buffers a stream keeps for reuse.
const SPARE_BUFS: usize = 4;
/// Chunks smaller than this go as they are: packing them costs more
/// latency than their bytes take on any link.
pub(crate) const MIN_PACK_BYTES: usize = 16 << 10;
/// After this many chunks in a row that did not shrink enough, only one
/// in `PROBE_EVERY` is tried (incompressible data costs a sample).
const RAW_STREAK: u32 = 4;
const PROBE_EVERY: u32 = 16;
/// `Auto` packs while the link drains slower than this share of what the
/// codec sustains.
const AUTO_SHARE: f64 = 0.8;
/// A link-rate sample needs this many bytes and this long.
const SAMPLE_BYTES: u64 = 1 << 20;
const SAMPLE_TIME: std::time::Duration = std::time::Duration::from_millis(2);

/// `FERRY_COMPRESS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackMode {
    /// Pack while the connection's measured link rate is below what the
    /// codec sustains.
    Auto,
    On,
}

/// What every stream of an endpoint shares about packing.
#[derive(Debug, Clone)]
pub(crate) struct PackShared {
    pub mode: PackMode,
    /// Bytes per second the codec pool packs (its threads together),
    /// measured as it runs.
    pub codec_rate: Arc<AtomicU64>,
    /// Bytes of peers' packed frames held now, endpoint-wide, and the most
    /// it may be: a frame past it waits unread.
    pub held: Arc<AtomicUsize>,
    pub held_max: usize,
    pub stats: Arc<CodecCounters>,
}

/// What the codec did, endpoint-wide (`Endpoint::compress_stats`).
#[derive(Debug, Default)]
pub(crate) struct CodecCounters {
    /// Chunks given to the codec to pack, and those that went packed.
    pub tried: AtomicU64,
    pub packed: AtomicU64,
    /// Bytes of the chunks that went packed, and of their frames.
    pub raw_bytes: AtomicU64,
    pub wire_bytes: AtomicU64,
    /// Peers' packed frames received (given to the codec to decode), and
    /// the bytes they decode to.
    pub unpacked: AtomicU64,
    pub unpacked_bytes: AtomicU64,
    /// ... and their bytes on the wire.
    pub unpacked_wire_bytes: AtomicU64,
}

/// How fast the socket drains while it pushes back: the link's rate, as
/// far as this stream sees it.
#[derive(Debug, Default)]
pub(crate) struct LinkMeter {
    /// Since when the socket has been full (a write would block).
    since: Option<Instant>,
    bytes: u64,
    /// Bytes per second (smoothed), once a sample was taken.
    rate: Option<f64>,
}

impl LinkMeter {
    /// The socket took `n` bytes at `now`.
    pub fn sent(&mut self, n: usize, now: Instant) {
        let Some(t) = self.since else { return };
        self.bytes += n as u64;
        let dt = now.saturating_duration_since(t);
        if self.bytes >= SAMPLE_BYTES && dt >= SAMPLE_TIME {
            let sample = self.bytes as f64 / dt.as_secs_f64();
            self.rate = Some(self.rate.map_or(sample, |r| 0.7 * r + 0.3 * sample));
            self.since = Some(now);
            self.bytes = 0;
        }
    }

    /// A write would block with frames left: the socket is full.
    pub fn blocked(&mut self, now: Instant) {
        if self.since.is_none() {
            self.since = Some(now);
            self.bytes = 0;
        }
    }

    /// Nothing more to send now: the link is not what holds us back.
    pub fn drained(&mut self) {
        self.since = None;
    }

    pub fn rate(&self) -> Option<f64> {
        self.rate
    }
}

/// What to do with a chunk that could be packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PackChoice {
    Pack(FloatType),
    Plain,
    /// It should be packed, but the stream's codec jobs are all out.
    Wait,
}

/// One stream's packing state (present when both sides offered the codec).
pub(crate) struct PackState {
    shared: PackShared,
    /// Jobs queued for the pool (the driver takes them).
    pub(super) jobs: Vec<CodecJob>,
    /// Jobs given out and not yet back.
    in_flight: usize,
    spare: Vec<Vec<u8>>,
    raw_streak: u32,
    probe: u32,
    pub(super) meter: LinkMeter,
    /// A chunk with a value type came by: only then is the link measured
    /// (a connection of untyped memory pays no clock read per write).
    typed: bool,
}

impl PackState {
    pub fn new(shared: PackShared) -> Self {
        Self {
            shared,
            // Empty until used: an idle connection pays nothing for them.
            jobs: Vec::new(),
            in_flight: 0,
            spare: Vec::new(),
            raw_streak: 0,
            probe: 0,
            meter: LinkMeter::default(),
            typed: false,
        }
    }

    fn buf(&mut self) -> Vec<u8> {
        self.spare.pop().unwrap_or_default()
    }

    fn give_back(&mut self, buf: Vec<u8>) {
        if self.spare.len() < SPARE_BUFS {
            self.spare.push(buf);
        }
    }

    /// Whether the policy packs a chunk of `len` bytes now.
    fn wants(&mut self, len: usize) -> bool {
        if !(MIN_PACK_BYTES..=MAX_PACKED_FRAME as usize).contains(&len) {
            return false;
        }
        let on = match self.shared.mode {
            PackMode::On => true,
            PackMode::Auto => {
                let codec = self.shared.codec_rate.load(Ordering::Relaxed) as f64;
                self.meter.rate().is_some_and(|r| r < AUTO_SHARE * codec)
            }
        };
        if !on {
            return false;
        }
        if self.raw_streak >= RAW_STREAK {
            self.probe = self.probe.wrapping_add(1);
            return self.probe % PROBE_EVERY == 0;
        }
        true
    }

    fn queue(&mut self, ticket: CodecTicket, work: CodecWork) {
        self.in_flight += 1;
        self.jobs.push(CodecJob { ticket, work });
    }
}

/// What a received packed payload is for.
pub(super) enum Unpack {
    /// A peer's WRITE: acknowledge once decoded.
    Ack { op_id: u64 },
    /// A peer's WRITE into GPU memory, decoded into a bounce buffer:
    /// copied on into `gpu`, then acknowledged.
    AckStaged { op_id: u64, gpu: RegionSlice },
    /// The response to our oldest READ.
    Read,
}

impl StreamProto {
    /// Turns packing on for this stream (both sides offered the codec).
    pub fn enable_pack(&mut self, shared: PackShared) {
        self.pack = Some(PackState::new(shared));
    }

    /// Codec jobs queued since the last call, for the pool.
    pub fn take_codec_jobs(&mut self) -> impl Iterator<Item = CodecJob> + '_ {
        self.pack.iter_mut().flat_map(|p| p.jobs.drain(..))
    }

    pub fn has_codec_jobs(&self) -> bool {
        self.pack.as_ref().is_some_and(|p| !p.jobs.is_empty())
    }

    /// The link meter, for the driver's writes (None: not packing).
    pub fn link_meter(&mut self) -> Option<&mut LinkMeter> {
        self.pack
            .as_mut()
            .filter(|p| p.typed && p.shared.mode == PackMode::Auto)
            .map(|p| &mut p.meter)
    }

    /// Whether a chunk of `len` bytes of `dtype` values goes packed.
    pub fn pack_choice(&mut self, dtype: Option<FloatType>, len: usize) -> PackChoice {
        let (Some(p), Some(d)) = (self.pack.as_mut(), dtype) else {
            return PackChoice::Plain;
        };
        p.typed = true;
        if !p.wants(len) {
            return PackChoice::Plain;
        }
        if p.in_flight >= PACK_SLOTS {
            return PackChoice::Wait;
        }
        PackChoice::Pack(d)
    }

    /// Queues a WRITE request whose payload is packed first (`pack_choice`
    /// said so); the frame waits, gated, for its job.
    #[allow(clippy::too_many_arguments)]
    pub fn push_write_packed(
        &mut self,
        dtype: FloatType,
        slot: u32,
        op_id: u64,
        key: KeyRef,
        addr: u64,
        local: RegionSlice,
        now: Instant,
    ) {
        let gate = self.new_gate();
        let src = local.clone();
        self.push_request_gated(OpKind::Write, (slot, op_id), (key, addr), local, now, gate);
        self.encode_job(gate, dtype, src);
    }

    pub(super) fn encode_job(&mut self, gate: u64, dtype: FloatType, src: RegionSlice) {
        let p = self.pack.as_mut().expect("packing is on");
        let out = p.buf();
        let ticket = CodecTicket {
            stream: self.idx,
            gate,
            slot: 0,
            post: None,
            _held: None,
        };
        p.queue(ticket, CodecWork::Encode { dtype, src, out });
    }

    /// A READ of our host memory `w`: answered packed when its region has a
    /// value type and the policy packs now (`Some(true)`), plainly
    /// (`Some(false)`), or not yet (`None`: the codec jobs are all out).
    pub(super) fn respond_packed(&mut self, op_id: u64, w: &RegionSlice) -> Option<bool> {
        let dtype = w.region().dtype();
        match self.pack_choice(dtype, w.len()) {
            PackChoice::Plain => Some(false),
            PackChoice::Wait => None,
            PackChoice::Pack(d) => {
                let gate = self.new_gate();
                let hdr =
                    DataHeader::response(DataKind::ReadResp, Status::Ok, op_id, w.len() as u64);
                self.push_response(hdr, TxPayload::Slice(w.clone()), gate);
                self.encode_job(gate, d, w.clone());
                Some(true)
            }
        }
    }

    /// A packed payload's header arrived for `dst`: its bytes are read
    /// into a buffer of their own. `Ok(false)`: no room now (the stream's
    /// jobs are all out, or the endpoint holds its most of peers' packed
    /// bytes); the caller puts the header back.
    pub(super) fn take_packed(
        &mut self,
        h: &DataHeader,
        dst: RegionSlice,
        then: Unpack,
    ) -> Result<bool, ConnFault> {
        let Some(p) = self.pack.as_mut() else {
            return Err(ConnFault::misbehaved(format!(
                "a packed {:?} on a connection that did not agree to the codec",
                h.kind
            )));
        };
        let n = h.packed_len as usize;
        if p.in_flight >= PACK_SLOTS {
            return Ok(false);
        }
        let Some(held) = Held::claim(&p.shared.held, n, p.shared.held_max) else {
            return Ok(false);
        };
        let mut buf = p.buf();
        buf.resize(n, 0);
        self.rx = Rx::Packed {
            buf,
            done: 0,
            dst,
            then,
            held,
        };
        Ok(true)
    }

    /// A packed payload is all here (and its tag checked): its decode is
    /// queued, a WRITE's ack gated behind it, a READ taken off `pending`.
    pub(super) fn unpack(&mut self, buf: Vec<u8>, dst: RegionSlice, then: Unpack, held: Held) {
        let mut ticket = CodecTicket {
            stream: self.idx,
            gate: 0,
            slot: 0,
            post: None,
            _held: Some(held),
        };
        match then {
            Unpack::Ack { op_id } => {
                ticket.gate = self.new_gate();
                let hdr = DataHeader::response(DataKind::WriteAck, Status::Ok, op_id, 0);
                self.push_response(hdr, TxPayload::None, ticket.gate);
            }
            Unpack::AckStaged { op_id, gpu } => {
                ticket.gate = self.new_gate();
                let hdr = DataHeader::response(DataKind::WriteAck, Status::Ok, op_id, 0);
                self.push_response(hdr, TxPayload::None, ticket.gate);
                ticket.post = Some((gpu, dst.clone()));
            }
            Unpack::Read => {
                let p = self
                    .pending
                    .pop_front()
                    .expect("a READ response matched the front request");
                ticket.slot = p.op.slot;
                ticket.post = p.op.post.map(|gpu| (gpu, p.op.local));
            }
        }
        let p = self.pack.as_mut().expect("packing is on");
        let s = &p.shared.stats;
        s.unpacked.fetch_add(1, Ordering::Relaxed);
        s.unpacked_bytes
            .fetch_add(dst.len() as u64, Ordering::Relaxed);
        s.unpacked_wire_bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        p.queue(ticket, CodecWork::Decode { frame: buf, dst });
    }

    /// A codec job of this stream ended. `Err`: a peer's frame did not
    /// decode into its request (the connection must die, with this reason).
    pub fn codec_done(
        &mut self,
        ticket: CodecTicket,
        outcome: CodecOutcome,
        sink: &mut impl Sink,
    ) -> Result<(), ConnFault> {
        let Some(p) = self.pack.as_mut() else {
            return Ok(());
        };
        p.in_flight = p.in_flight.saturating_sub(1);
        match outcome {
            CodecOutcome::Encoded { buf, packed } => {
                p.shared.stats.tried.fetch_add(1, Ordering::Relaxed);
                if packed {
                    p.raw_streak = 0;
                } else {
                    p.raw_streak = p.raw_streak.saturating_add(1);
                }
                self.release_encoded(ticket.gate, buf, packed);
                Ok(())
            }
            CodecOutcome::Decoded { buf, result } => {
                p.give_back(buf);
                result?;
                if let Some((gpu, bounce)) = ticket.post {
                    // Decoded into a bounce buffer: on into GPU memory,
                    // then the ack goes (or the READ completes).
                    sink.gpu_stage(Stage {
                        stream: self.idx,
                        gate: ticket.gate,
                        slot: ticket.slot,
                        dst: gpu,
                        src: bounce,
                    });
                } else if ticket.gate != 0 {
                    self.release(ticket.gate, true);
                } else {
                    sink.done(ticket.slot, Ok(()));
                }
                Ok(())
            }
        }
    }

    /// The gated frame `gate` gets its packed payload (or goes as it was).
    fn release_encoded(&mut self, gate: u64, buf: Vec<u8>, packed: bool) {
        let Some(f) = self.tx.iter_mut().find(|f| f.gate == gate) else {
            if let Some(p) = self.pack.as_mut() {
                p.give_back(buf);
            }
            return;
        };
        if packed {
            if let Some(p) = &self.pack {
                let s = &p.shared.stats;
                s.packed.fetch_add(1, Ordering::Relaxed);
                s.raw_bytes
                    .fetch_add(f.payload.ptr_len().1 as u64, Ordering::Relaxed);
                s.wire_bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
            }
            if let Ok(h) = DataHeader::decode(&f.hdr[..HDR]) {
                let packed_len = u32::try_from(buf.len()).expect("a packed frame fits its u32");
                f.hdr[..HDR].copy_from_slice(&h.packed(packed_len).encode());
                f.payload = TxPayload::Packed(buf);
            }
        } else if let Some(p) = self.pack.as_mut() {
            p.give_back(buf);
        }
        self.release(gate, true);
    }

    /// Gated frame `gate` (a READ response being copied out of GPU memory
    /// into its bounce buffer) is packed once that copy ends.
    pub(super) fn pack_after_stage(&mut self, gate: u64, dtype: FloatType) {
        if let Some(f) = self.tx.iter_mut().find(|f| f.gate == gate) {
            f.pack_after = Some(dtype);
        }
    }

    /// A sent packed payload's buffer, back for reuse.
    pub(super) fn reuse(&mut self, buf: Vec<u8>) {
        if let Some(p) = self.pack.as_mut() {
            p.give_back(buf);
        }
    }
}

#[cfg(test)]
mod tests;

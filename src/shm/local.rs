//! One same-host connection: two rings (ours to read, the peer's to write)
//! and the copies a target makes on behalf of its peer.
//!
//! The target does every copy, after checking key, bounds and access in its
//! own region table, exactly as on the tcp path. It reaches the initiator's
//! memory in one of three ways: small WRITE payloads and READ results ride
//! inline in the ring message; memory the initiator allocated with
//! `alloc_host` is a memfd the target has mapped (one memcpy); any other
//! registered memory is copied with `process_vm_readv`/`process_vm_writev`
//! (probed when the connection is made; refused connections fall back to tcp).
//!
//! A WRITE's notification (the application's, or a two-sided message's
//! `Fin`) rides in its one request (`REQ_NOTE`) where the peer said it
//! takes them (`connect::FEATURE_NOTES_RIDE`): the target hands it to its
//! inbox as it answers the request Ok, and drops it if the request
//! failed, instead of the initiator sending it once the answer came back.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::time::Instant;

use slab::Slab;

use super::named_ring::ShmRing;
use super::ring::SLOT_PAYLOAD;
use crate::error::{ConnFault, ConnId, Result};
use crate::region::{RegionSlice, Regions};
use crate::sys::Mapping;
use crate::wire::shm_msg::{Msg, MsgKind};
use crate::wire::MAX_NOTIFY_WIRE_BYTES;
use crate::xfer::{PendingOp, Sink};

/// IPC revocations one connection keeps for a peer whose ring is full.
/// Past it the oldest is dropped: the peer's mapping then stays open (it
/// keeps that GPU memory alive) until we go away, but it can never serve
/// a new allocation at the same base, since the importer checks the handle
/// (`gpu::ipc`).
pub(crate) const MAX_REVOKES_OWED: usize = 256;

/// A peer's memfd region mapped into this process.
#[derive(Clone)]
pub(crate) struct PeerMap {
    /// Shared with CUDA copies in flight, which hold it until they end.
    pub map: Arc<Mapping>,
    /// The address the region has in the peer's process.
    pub base: u64,
}

/// Regions of local peers this process has mapped, by (peer id, key).
pub(crate) type PeerMaps = crate::sys::IntMap<(u64, u32), PeerMap>;

type Pending = PendingOp;

mod initiator;
mod target;

/// Request `status` bits. The initiator's memory is GPU memory: the inline
/// bytes are its IPC reference (`IpcRef`), not data.
pub(crate) const REQ_INITIATOR_GPU: u8 = 1;
/// Copy with CUDA, never through inline bytes (a GPU side is involved).
pub(crate) const REQ_NO_INLINE: u8 = 2;
/// A notification rides at the end of the request's inline bytes (its
/// length in `aux2`): the target delivers it once the copy has landed, as
/// it answers Ok, and drops it if the request fails. Sent only to a peer
/// that said it understands (`connect::FEATURE_NOTES_RIDE`).
pub(crate) const REQ_NOTE: u8 = 4;
/// Reply `aux` value: the target copied with CUDA; no inline bytes follow.
pub(crate) const REPLY_GPU_COPIED: u64 = 1;

pub(crate) struct LocalConn {
    pub id: ConnId,
    pub peer_id: u64,
    pub peer_pid: u32,
    /// The peer's number for this connection (echoed in every message).
    pub peer_conn: u32,
    rx: ShmRing,
    tx: ShmRing,
    /// Replies that found the peer's ring full; bounded by `peer_max`.
    outbox: VecDeque<([u8; SLOT_PAYLOAD], usize)>,
    /// IPC revocations that found the peer's ring full, sent as it makes
    /// room; distinct bases, at most `MAX_REVOKES_OWED`.
    revokes_owed: Vec<u64>,
    pending: Slab<Pending>,
    own_max: usize,
    peer_max: usize,
    peer_owed: usize,
    notify: Vec<u8>,
    /// A whole notification the application's inbox had no room for; the
    /// ring is not read until it is delivered (back-pressure, not loss).
    notify_blocked: Option<Vec<u8>>,
    /// When the connection last moved a message, as of the driver's last
    /// look at the clock (for the idle timeout and cooling) ...
    last_active: Instant,
    /// ... and whether it moved one since: a busy pass reads no clock for
    /// it (one read per busy pass was ~5 % of a same-host round trip).
    active_since: bool,
    /// Kept by the driver: polled every pass (hot), or in turn with the
    /// other quiet ones; and for how many passes it has found nothing.
    pub hot: bool,
    pub quiet_passes: u32,
    /// Our ring's bit on the shard's doorbell (None: no doorbell, or past
    /// its bits; such a connection is never left unpolled).
    pub bell_bit: Option<u32>,
    /// Pushed quietly since the last `ring_if_due`.
    ring_due: bool,
    /// Served requests whose CMA copy waits for the end of the run of such
    /// requests (`flush_cma`): one syscall per direction for all of them.
    /// Bounded by `peer_max` (each is a request the peer has out).
    cma_batch: Vec<target::DeferredCma>,
    /// The peer takes notifications riding in our requests (`REQ_NOTE`).
    notes_ride: bool,
    /// Notifications riding in the peer's requests not answered yet, by
    /// request: at most `peer_max`, each at most `MAX_INLINE` bytes.
    held_notes: crate::sys::IntMap<u64, Vec<u8>>,
    /// Riding notifications whose requests were answered Ok, for the
    /// application's inbox at the next poll (in answer order).
    notes_landed: VecDeque<Vec<u8>>,
}

// SAFETY: the raw pointers in `pending` point into regions kept alive by the
// `_keep` handle stored beside them.
unsafe impl Send for LocalConn {}

/// Copies `len` bytes. glibc's `rep movsb` copy runs ~15x slower here when
/// the destination sits 1..63 bytes past the source modulo 4 KiB (loads
/// alias the stores just made: "4K aliasing"), which malloc'd buffers hit
/// easily; fixed 256-byte block copies, which compile to plain vector
/// moves, do not care.
///
/// # Safety
/// `src` is readable and `dst` writable for `len` bytes, and they do not overlap.
pub(crate) unsafe fn copy_bytes(dst: *mut u8, src: *const u8, len: usize) {
    let skew = (dst as usize).wrapping_sub(src as usize) & 4095;
    if len < 4096 || !(1..64).contains(&skew) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return;
    }
    let mut off = 0;
    while off + 256 <= len {
        // SAFETY: off + 256 <= len, inside both ranges.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.add(off) as *const [u8; 256],
                dst.add(off) as *mut [u8; 256],
                1,
            )
        };
        off += 256;
    }
    // SAFETY: the tail lies inside both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(off), dst.add(off), len - off) };
}

/// Pushes `msg` into the peer's ring `tx`. While the shard polls the
/// connection every pass (`hot`), the peer's doorbell is rung once at the
/// end of the pass (`LocalConn::ring_if_due`, for all the pass pushed;
/// `due` records that one is owed): a sleeping peer then wakes once to a
/// batch of replies, not once per reply. Otherwise it rings now.
fn push_to(
    tx: &ShmRing,
    hot: bool,
    due: &mut bool,
    msg: &[u8],
) -> Result<(), crate::shm::ring::RingError> {
    if hot {
        tx.push_quiet(msg)?;
        *due = true;
        Ok(())
    } else {
        tx.push(msg)
    }
}

/// How the protocol reaches a peer process's memory that is not mapped
/// here. The driver's is `Cma` (`process_vm_readv/writev`, a syscall); a
/// test can stand in for it, so the protocol runs without one.
pub(crate) trait PeerMemory {
    /// Copies between `ours` and the peer's `[addr, addr + ours.len())`:
    /// from the peer into `ours` when `from_peer`, else the other way.
    fn copy(&mut self, pid: u32, ours: &RegionSlice, addr: u64, from_peer: bool) -> io::Result<()>;

    /// Copies every `(ours, addr)` pair in one go, all from the peer when
    /// `from_peer`, else all to it. `Err` (or a partial copy) leaves each
    /// one's fate unknown: the caller copies them one by one to learn it.
    fn copy_many<'a>(
        &mut self,
        pid: u32,
        pairs: impl Iterator<Item = (&'a RegionSlice, u64)>,
        from_peer: bool,
    ) -> io::Result<()> {
        let _ = (pid, pairs.count(), from_peer);
        Err(io::Error::from(io::ErrorKind::Unsupported))
    }
}

impl LocalConn {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: ConnId,
        peer_id: u64,
        peer_pid: u32,
        peer_conn: u32,
        rx: ShmRing,
        tx: ShmRing,
        own_max: usize,
        peer_max: usize,
    ) -> Self {
        Self {
            id,
            peer_id,
            peer_pid,
            peer_conn,
            rx,
            tx,
            outbox: VecDeque::with_capacity(peer_max),
            revokes_owed: Vec::new(),
            pending: Slab::with_capacity(own_max),
            own_max,
            peer_max,
            peer_owed: 0,
            notify: Vec::new(),
            notify_blocked: None,
            last_active: Instant::now(),
            active_since: false,
            hot: false,
            quiet_passes: 0,
            bell_bit: None,
            ring_due: false,
            cma_batch: Vec::with_capacity(peer_max),
            notes_ride: false,
            held_notes: Default::default(),
            notes_landed: VecDeque::new(),
        }
    }

    /// Whether the peer said it takes notifications riding in requests
    /// (`connect::FEATURE_NOTES_RIDE`).
    pub fn set_notes_ride(&mut self, ride: bool) {
        self.notes_ride = ride;
    }

    /// Whether a notification may ride in a request to the peer.
    pub fn notes_ride(&self) -> bool {
        self.notes_ride
    }

    /// The driver saw it move a message (the time is taken at the next
    /// look at `last_active`).
    pub fn touch(&mut self) {
        self.active_since = true;
    }

    /// When it last moved a message; traffic since the last look counts as
    /// `now` (so it is at most late by the time between looks, never early).
    pub fn last_active(&mut self, now: Instant) -> Instant {
        if std::mem::take(&mut self.active_since) {
            self.last_active = now;
        }
        self.last_active
    }

    fn tx_push(&mut self, msg: &[u8]) -> Result<(), crate::shm::ring::RingError> {
        push_to(&self.tx, self.hot, &mut self.ring_due, msg)
    }

    /// Rings the peer's doorbell for what was pushed quietly, if it sleeps.
    pub fn ring_if_due(&mut self) {
        if self.ring_due {
            self.ring_due = false;
            self.tx.ring_if_wanted();
        }
    }

    /// Says whether the shard polls our ring (`cold == false`) or relies on
    /// the peer ringing the doorbell. After going cold the ring must be
    /// polled once more (see `Ring::set_bell`).
    pub fn set_cold(&self, cold: bool) {
        if let Some(bit) = self.bell_bit {
            self.rx.ring.set_bell(bit, cold);
        }
    }

    /// Whether only polling can move it on: replies waiting for room in
    /// the peer's ring (the peer does not ring us when it makes room), or a
    /// notification waiting for the application's inbox.
    pub fn needs_polling(&self) -> bool {
        !self.outbox.is_empty() || self.notify_blocked.is_some() || !self.notes_landed.is_empty()
    }

    /// Whether it has anything under way: requests of ours or the peer's,
    /// messages waiting for ring room, a notification held back.
    pub fn busy(&self) -> bool {
        self.busy_with_ops() || self.owes_revokes()
    }

    /// As `busy`, leaving out owed revocations: only those make nobody
    /// wait, so they are retried every `LOCAL_PARK`, not spun on.
    pub fn busy_with_ops(&self) -> bool {
        !self.pending.is_empty()
            || !self.outbox.is_empty()
            || self.notify_blocked.is_some()
            || !self.notes_landed.is_empty()
            || self.peer_owed > 0
    }

    /// Revocations wait for room in the peer's ring (the peer does not
    /// ring us when it makes room).
    pub fn owes_revokes(&self) -> bool {
        !self.revokes_owed.is_empty()
    }

    pub fn can_request(&self) -> bool {
        self.pending.len() < self.own_max && self.outbox.is_empty()
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    pub fn oldest_pending(&self) -> Option<Instant> {
        self.pending.iter().map(|(_, p)| p.sent_at).min()
    }

    /// A message as a hostile peer would send it (tests).
    #[cfg(test)]
    pub fn send_raw(&mut self, m: &Msg, inline: &[u8]) -> bool {
        self.send(m, inline)
    }

    fn send(&mut self, m: &Msg, inline: &[u8]) -> bool {
        let mut buf = [0u8; SLOT_PAYLOAD];
        let n = m.encode(inline, &mut buf);
        self.tx_push(&buf[..n]).is_ok()
    }

    pub fn send_close(&mut self) {
        let mut m = Msg::new(MsgKind::Close);
        m.conn = self.peer_conn;
        let _ = self.send(&m, &[]);
        // The connection goes now: no end of pass rings for it.
        self.ring_if_due();
    }

    /// Sends queued replies, then handles what the peer sent. Returns work
    /// done; `Err` means the connection is broken.
    pub fn poll(
        &mut self,
        regions: &mut impl Regions,
        maps: &PeerMaps,
        peer_mem: &mut impl PeerMemory,
        sink: &mut impl Sink,
    ) -> Result<usize, ConnFault> {
        let mut work = 0;
        while let Some((buf, n)) = self.outbox.front() {
            if push_to(&self.tx, self.hot, &mut self.ring_due, &buf[..*n]).is_err() {
                break;
            }
            self.outbox.pop_front();
            work += 1;
        }
        // Replies first: the peer waits on them; revocations only free memory.
        while self.outbox.is_empty() {
            let Some(&base) = self.revokes_owed.first() else {
                break;
            };
            if !self.send_ipc_revoke(base) {
                break;
            }
            self.revokes_owed.remove(0);
            work += 1;
        }
        if let Some(msg) = self.notify_blocked.take() {
            if let Err(back) = sink.notify(msg) {
                self.notify_blocked = Some(back);
                return Ok(work);
            }
            work += 1;
        }
        // Riding notifications whose copies landed since the last pass
        // (a CUDA copy's, answered by the shard).
        work += self.deliver_landed(sink);
        // Bounded per call so one busy peer cannot starve the loop.
        for _ in 0..256 {
            if self.notify_blocked.is_some() {
                break;
            }
            let mut buf = [0u8; SLOT_PAYLOAD];
            let Some(n) = self.rx.ring.pop(&mut buf) else {
                break;
            };
            work += 1;
            let (m, inline) =
                Msg::decode(&buf[..n]).map_err(|e| ConnFault::misbehaved(e.to_string()))?;
            if crate::stage_trace::ENABLED {
                use crate::stage_trace::{mark, Stage};
                match m.kind {
                    MsgKind::WriteReq | MsgKind::ReadReq => mark(Stage::RequestIn),
                    MsgKind::WriteAck | MsgKind::ReadResp => mark(Stage::ReplyIn),
                    _ => {}
                }
            }
            self.on_msg(m, inline, regions, maps, peer_mem, sink)?;
            // A request answered at once hands over its riding note before
            // the ring's next message (which the peer sent after it).
            work += self.deliver_landed(sink);
        }
        self.flush_cma(peer_mem, sink);
        work += self.deliver_landed(sink);
        Ok(work)
    }

    /// Hands the riding notifications whose requests were answered Ok to
    /// the inbox, in order, until it is full (then `notify_blocked` holds
    /// one and the ring waits). Returns how many it handed over.
    fn deliver_landed(&mut self, sink: &mut impl Sink) -> usize {
        let mut n = 0;
        while self.notify_blocked.is_none() {
            let Some(msg) = self.notes_landed.pop_front() else {
                break;
            };
            n += 1;
            if let Err(back) = sink.notify(msg) {
                self.notify_blocked = Some(back);
            }
        }
        n
    }

    fn on_msg(
        &mut self,
        m: Msg,
        inline: &[u8],
        regions: &mut impl Regions,
        maps: &PeerMaps,
        peer_mem: &mut impl PeerMemory,
        sink: &mut impl Sink,
    ) -> Result<(), ConnFault> {
        match m.kind {
            MsgKind::WriteReq | MsgKind::ReadReq => {
                return self.serve(m, inline, regions, maps, peer_mem, sink);
            }
            MsgKind::WriteAck | MsgKind::ReadResp => return self.on_reply(m, inline, sink),
            MsgKind::Notify => {
                if self.notify.len() + inline.len() > MAX_NOTIFY_WIRE_BYTES {
                    return Err(ConnFault::misbehaved(format!(
                        "notification longer than {MAX_NOTIFY_WIRE_BYTES} bytes"
                    )));
                }
                self.notify.extend_from_slice(inline);
                if m.status == 0 {
                    let msg = std::mem::take(&mut self.notify);
                    if let Err(back) = sink.notify(msg) {
                        self.notify_blocked = Some(back);
                    }
                }
            }
            MsgKind::IpcRevoke => sink.ipc_revoked(m.addr),
            MsgKind::Close => return Err(ConnFault::closed_by_peer()),
            MsgKind::Connect | MsgKind::ConnectAck => {
                return Err(ConnFault::misbehaved(format!(
                    "{:?} on an established connection",
                    m.kind
                )));
            }
        }
        Ok(())
    }
}

impl Drop for LocalConn {
    fn drop(&mut self) {
        self.send_close();
    }
}

#[cfg(test)]
mod tests;

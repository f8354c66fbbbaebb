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

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::time::Instant;

use slab::Slab;

use super::copy_path::{self, CopyPath};
use super::named_ring::ShmRing;
use super::ring::SLOT_PAYLOAD;
use crate::error::{ConnFault, ConnId, Error, OpKind, Result};
use crate::region::{Access, KeyRef, RegionSlice, Regions};
use crate::sys::Mapping;
use crate::wire::shm_msg::{Msg, MsgKind, MAX_INLINE};
use crate::wire::IpcRef;
use crate::wire::{Status, MAX_NOTIFY_WIRE_BYTES};
use crate::xfer::{GpuReq, HostCopy, PeerBytes, PendingOp, Sink, Theirs};

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

/// Request `status` bits. The initiator's memory is GPU memory: the inline
/// bytes are its IPC reference (`IpcRef`), not data.
pub(crate) const REQ_INITIATOR_GPU: u8 = 1;
/// Copy with CUDA, never through inline bytes (a GPU side is involved).
pub(crate) const REQ_NO_INLINE: u8 = 2;
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
    cma_batch: Vec<DeferredCma>,
}

/// A checked request to be copied with CMA and answered by `flush_cma`.
struct DeferredCma {
    op_id: u64,
    write: bool,
    /// Our side (held: the region stays alive until the copy).
    ours: RegionSlice,
    /// The initiator's address.
    addr: u64,
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
        }
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
        !self.outbox.is_empty() || self.notify_blocked.is_some()
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

    /// Queues one request; `false` if there is no room now (retry later).
    #[allow(clippy::too_many_arguments)]
    pub fn push_request(
        &mut self,
        kind: OpKind,
        slot: u32,
        key: KeyRef,
        addr: u64,
        local: &RegionSlice,
        remote_device: bool,
        now: Instant,
    ) -> bool {
        if !self.can_request() {
            return false;
        }
        let len = local.len();
        let keep = local.region();
        let local_device = local.is_device();
        let entry = self.pending.vacant_entry();
        let mut m = Msg::new(if kind == OpKind::Write {
            MsgKind::WriteReq
        } else {
            MsgKind::ReadReq
        });
        m.conn = self.peer_conn;
        m.op_id = entry.key() as u64;
        m.rkey = key.rkey;
        // Requests carry the key's tag in `aux`.
        m.aux = key.tag;
        m.addr = addr;
        m.len = len as u64;
        m.src_key = keep.rkey;
        m.src_addr = local.addr();
        let gpu_ref;
        let inline: &[u8] = if local_device {
            // The endpoint exported the handle before submitting.
            let Some(handle) = keep.ipc_handle.get() else {
                return false;
            };
            let crate::gpu::MemKind::Device { alloc_base, .. } = keep.mem else {
                unreachable!("checked is_device")
            };
            m.status = REQ_INITIATOR_GPU | REQ_NO_INLINE;
            gpu_ref = IpcRef {
                handle: *handle,
                alloc_base,
                offset: local.addr() - alloc_base,
            }
            .encode();
            &gpu_ref
        } else if remote_device {
            m.status = REQ_NO_INLINE;
            &[]
        } else if kind == OpKind::Write && len <= MAX_INLINE {
            // SAFETY: `local` is a checked slice of `len` live bytes (it
            // holds its region); a racing remote write can change the bytes,
            // never their validity (u8).
            unsafe { std::slice::from_raw_parts(local.ptr(), len) }
        } else {
            &[]
        };
        let mut buf = [0u8; SLOT_PAYLOAD];
        let n = m.encode(inline, &mut buf);
        // By field, not `tx_push`: `entry` holds `pending` borrowed.
        if push_to(&self.tx, self.hot, &mut self.ring_due, &buf[..n]).is_err() {
            return false;
        }
        crate::stage_trace::mark(crate::stage_trace::Stage::RequestOut);
        entry.insert(Pending {
            slot,
            kind,
            local: local.clone(),
            rkey: key.rkey,
            addr,
            sent_at: now,
            post: None,
        });
        true
    }

    /// Sends a notification as fragments; `false` if the ring is full
    /// (nothing was sent then, unless a previous fragment went out; the
    /// caller only retries whole notifications on a fresh ring).
    pub fn push_notify(&mut self, payload: &[u8]) -> bool {
        let pieces: Vec<&[u8]> = if payload.is_empty() {
            vec![&[][..]]
        } else {
            payload.chunks(MAX_INLINE).collect()
        };
        if self.tx.ring.capacity() - self.tx.ring.len() < pieces.len() || !self.outbox.is_empty() {
            return false;
        }
        let last = pieces.len() - 1;
        for (i, p) in pieces.iter().enumerate() {
            let mut m = Msg::new(MsgKind::Notify);
            m.conn = self.peer_conn;
            m.status = (i < last) as u8;
            if !self.send(&m, p) {
                // Only another producer (there is none: one ring per
                // direction per connection) could have filled it.
                return false;
            }
        }
        true
    }

    /// Answers a request whose copy ran elsewhere (CUDA, or a host copy
    /// spread over the shards).
    pub fn finish_gpu(&mut self, op_id: u64, write: bool, status: Status) {
        let mut reply = self.answer(write, op_id);
        reply.status = status as u8;
        reply.aux = REPLY_GPU_COPIED;
        self.reply(&reply, &[]);
    }

    /// Tells the peer to close its IPC mapping of the allocation at
    /// `alloc_base`: now, or once its ring has room (`poll`).
    pub fn push_ipc_revoke(&mut self, alloc_base: u64) {
        if self.revokes_owed.is_empty() && self.send_ipc_revoke(alloc_base) {
            return;
        }
        if self.revokes_owed.contains(&alloc_base) {
            return;
        }
        if self.revokes_owed.len() == MAX_REVOKES_OWED {
            let lost = self.revokes_owed.remove(0);
            tracing::warn!(
                conn = %self.id,
                "peer's ring full for {MAX_REVOKES_OWED} IPC revocations: \
                 the one of {lost:#x} is dropped (its mapping there stays open)"
            );
        }
        self.revokes_owed.push(alloc_base);
    }

    fn send_ipc_revoke(&mut self, alloc_base: u64) -> bool {
        let mut m = Msg::new(MsgKind::IpcRevoke);
        m.conn = self.peer_conn;
        m.addr = alloc_base;
        self.send(&m, &[])
    }

    /// Revocations waiting for room in the peer's ring.
    #[cfg(test)]
    pub fn revokes_owed(&self) -> usize {
        self.revokes_owed.len()
    }

    pub fn send_close(&mut self) {
        let mut m = Msg::new(MsgKind::Close);
        m.conn = self.peer_conn;
        let _ = self.send(&m, &[]);
        // The connection goes now: no end of pass rings for it.
        self.ring_if_due();
    }

    pub fn fail_pending(&mut self, err: &Error, sink: &mut impl Sink) {
        for p in self.pending.drain() {
            sink.done(p.slot, Err(err.duplicate()));
        }
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
        }
        self.flush_cma(peer_mem);
        Ok(work)
    }

    /// The reply to the peer's request `op_id` (status Ok until set).
    fn answer(&self, write: bool, op_id: u64) -> Msg {
        let mut reply = Msg::new(if write {
            MsgKind::WriteAck
        } else {
            MsgKind::ReadResp
        });
        reply.conn = self.peer_conn;
        reply.op_id = op_id;
        reply
    }

    /// Copies and answers the requests put off for CMA: one syscall per
    /// direction for the run (the kernel's per-call checks — the peer's
    /// task, its mm, ptrace access — were most of a small copy's cost),
    /// each on its own if the batch fails, to learn which one did.
    fn flush_cma(&mut self, peer_mem: &mut impl PeerMemory) {
        if self.cma_batch.is_empty() {
            return;
        }
        let mut batch = std::mem::take(&mut self.cma_batch);
        for write in [true, false] {
            let mut pairs = batch.iter().filter(|d| d.write == write).peekable();
            if pairs.peek().is_none() {
                continue;
            }
            let pairs = pairs.map(|d| (&d.ours, d.addr));
            let all_ok = peer_mem.copy_many(self.peer_pid, pairs, write).is_ok();
            for d in batch.iter().filter(|d| d.write == write) {
                let ok = all_ok || peer_mem.copy(self.peer_pid, &d.ours, d.addr, write).is_ok();
                let mut reply = self.answer(write, d.op_id);
                reply.status = if ok { Status::Ok } else { Status::PeerMemory } as u8;
                self.reply(&reply, &[]);
            }
        }
        batch.clear();
        self.cma_batch = batch;
    }

    fn reply(&mut self, m: &Msg, inline: &[u8]) {
        self.peer_owed -= 1;
        let mut buf = [0u8; SLOT_PAYLOAD];
        let n = m.encode(inline, &mut buf);
        if self.outbox.is_empty() && self.tx_push(&buf[..n]).is_ok() {
            crate::stage_trace::mark(crate::stage_trace::Stage::ReplyOut);
            return;
        }
        // Room is guaranteed: the peer keeps at most peer_max requests out.
        self.outbox.push_back((buf, n));
    }

    /// Finds the initiator's side of a transfer in a mapped memfd region.
    /// The address of the peer's `[addr, addr + len)` in its memfd
    /// mapping here, and the mapping itself.
    fn mapped<'m>(
        &self,
        maps: &'m PeerMaps,
        key: u32,
        addr: u64,
        len: u64,
    ) -> Option<(*mut u8, &'m Arc<Mapping>)> {
        let pm = maps.get(&(self.peer_id, key))?;
        let off = addr.checked_sub(pm.base)?;
        let end = off.checked_add(len)?;
        // SAFETY: off + len <= mapping length, checked here.
        (end <= pm.map.len() as u64).then(|| (unsafe { pm.map.ptr().add(off as usize) }, &pm.map))
    }

    /// Serves a peer's WRITE or READ request: checks it against our
    /// registrations, copies (inline, mapped, CMA, or by the shards or
    /// CUDA, who answer later) and replies.
    fn serve(
        &mut self,
        m: Msg,
        inline: &[u8],
        regions: &mut impl Regions,
        maps: &PeerMaps,
        peer_mem: &mut impl PeerMemory,
        sink: &mut impl Sink,
    ) -> Result<(), ConnFault> {
        if self.peer_owed >= self.peer_max {
            return Err(ConnFault::misbehaved(format!(
                "peer sent more than the agreed {} requests in flight",
                self.peer_max
            )));
        }
        self.peer_owed += 1;
        let write = m.kind == MsgKind::WriteReq;
        let need = if write {
            Access::REMOTE_WRITE
        } else {
            Access::REMOTE_READ
        };
        let mut reply = self.answer(write, m.op_id);
        // Borrowed (no count of the region): the table holds it while this
        // request is served, and nothing here changes the table; what
        // keeps the slice longer (a put-off or handed-over copy) adopts
        // it. `held` keeps it (and so the bytes an inline reply copies)
        // until the reply is encoded.
        let mut held: Option<RegionSlice> = None;
        let mut out_inline: &[u8] = &[];
        let key = KeyRef {
            rkey: m.rkey,
            tag: m.aux,
        };
        let status = match regions.check_as(key, m.addr, m.len, need, true) {
            Err(st) => st,
            Ok(mut w) => {
                let path = copy_path::choose(&copy_path::Request {
                    write,
                    gpu: m.status != 0 || w.is_device(),
                    inline_len: inline.len(),
                    len: w.len(),
                    max_inline: MAX_INLINE,
                });
                if path != CopyPath::Here
                    || self.mapped(maps, m.src_key, m.src_addr, m.len).is_some()
                {
                    // Requests are served in order: the copies put off so
                    // far happen before this one's.
                    self.flush_cma(peer_mem);
                } else {
                    // Copied with CMA with the rest of this run of such
                    // requests (`flush_cma` copies and answers).
                    w.adopt();
                    self.cma_batch.push(DeferredCma {
                        op_id: m.op_id,
                        write,
                        ours: w,
                        addr: m.src_addr,
                    });
                    return Ok(());
                }
                let copied = match path {
                    CopyPath::Cuda => {
                        // The copy outlives this call.
                        w.adopt();
                        match self.cuda_copy(&m, inline, w, write, maps, sink) {
                            // The shard copies and answers.
                            Ok(()) => return Ok(()),
                            Err(status) => {
                                reply.status = status as u8;
                                self.reply(&reply, &[]);
                                return Ok(());
                            }
                        }
                    }
                    CopyPath::FromRequest => {
                        // SAFETY: both ranges are `len` long and distinct.
                        unsafe { std::ptr::copy_nonoverlapping(inline.as_ptr(), w.ptr(), w.len()) };
                        true
                    }
                    CopyPath::InReply => {
                        // SAFETY: `w` is len readable bytes kept alive by `held`.
                        out_inline = unsafe { std::slice::from_raw_parts(w.ptr(), w.len()) };
                        true
                    }
                    CopyPath::Spread | CopyPath::Here => {
                        let spread = path == CopyPath::Spread;
                        match self.copy_host(&m, &w, write, spread, maps, peer_mem, sink) {
                            Some(copied) => copied,
                            // A sibling shard copies; it answers.
                            None => return Ok(()),
                        }
                    }
                };
                held = Some(w);
                if copied {
                    Status::Ok
                } else {
                    Status::PeerMemory
                }
            }
        };
        reply.status = status as u8;
        if status != Status::Ok {
            out_inline = &[];
        }
        self.reply(&reply, out_inline);
        drop(held);
        Ok(())
    }

    /// Hands a request with a GPU side to the shard's CUDA copies (they
    /// answer); `Err` is the status to answer now.
    fn cuda_copy(
        &self,
        m: &Msg,
        inline: &[u8],
        w: RegionSlice,
        write: bool,
        maps: &PeerMaps,
        sink: &mut impl Sink,
    ) -> Result<(), Status> {
        let theirs = if m.status & REQ_INITIATOR_GPU != 0 {
            IpcRef::decode(inline).map(Theirs::Ipc)
        } else {
            self.mapped(maps, m.src_key, m.src_addr, m.len)
                .map(|(p, m)| Theirs::Host(p, m.clone()))
        };
        // The initiator's host memory is not mapped here (only alloc_host
        // memory is), and the CPU cannot copy into GPU memory across
        // processes.
        let theirs = theirs.ok_or(Status::PeerMemory)?;
        let req = GpuReq {
            conn: self.id,
            peer_id: self.peer_id,
            peer_pid: self.peer_pid,
            op_id: m.op_id,
            write,
            ours: w,
            theirs,
        };
        if sink.gpu_copy(req) {
            Ok(())
        } else {
            Err(Status::DeviceMemory)
        }
    }

    /// Copies a checked request's bytes between `w` (ours) and the
    /// initiator's memory: through its memfd mapping when we have one, else
    /// with CMA. Returns whether it copied, or None when a large copy was
    /// handed to the shards (they answer).
    #[allow(clippy::too_many_arguments)]
    fn copy_host(
        &mut self,
        m: &Msg,
        w: &RegionSlice,
        write: bool,
        spread: bool,
        maps: &PeerMaps,
        peer_mem: &mut impl PeerMemory,
        sink: &mut impl Sink,
    ) -> Option<bool> {
        let (len, ours) = (w.len(), w.ptr());
        let mapped = self.mapped(maps, m.src_key, m.src_addr, m.len);
        // A large copy is spread over the shards, which
        // answer when every slice is done.
        if spread {
            let theirs = match mapped {
                Some((p, map)) => PeerBytes::Mapped {
                    off: p as usize - map.ptr() as usize,
                    map: map.clone(),
                },
                None => PeerBytes::Process {
                    pid: self.peer_pid,
                    addr: m.src_addr,
                },
            };
            let req = HostCopy {
                conn: self.id,
                op_id: m.op_id,
                write,
                ours: w.clone(),
                theirs,
            };
            if sink.host_copy(req).is_ok() {
                return None;
            }
        }
        Some(match mapped {
            Some((theirs, _)) => {
                // SAFETY: both ranges checked, `len` long;
                // the peer's mapping lives in `maps` during
                // the call.
                unsafe {
                    if write {
                        copy_bytes(ours, theirs, len)
                    } else {
                        copy_bytes(theirs, ours, len)
                    }
                };
                true
            }
            None => peer_mem.copy(self.peer_pid, w, m.src_addr, write).is_ok(),
        })
    }

    /// A reply to one of our requests: ends its op.
    fn on_reply(&mut self, m: Msg, inline: &[u8], sink: &mut impl Sink) -> Result<(), ConnFault> {
        let key = m.op_id as usize;
        let Some(p) = self.pending.try_remove(key) else {
            return Err(ConnFault::misbehaved(format!(
                "{:?} for op {} that is not outstanding",
                m.kind, m.op_id
            )));
        };
        let want = if p.kind == OpKind::Write {
            MsgKind::WriteAck
        } else {
            MsgKind::ReadResp
        };
        if m.kind != want {
            return Err(ConnFault::misbehaved(format!(
                "{:?} answers a {} request",
                m.kind, p.kind
            )));
        }
        let status = Status::from_u8(m.status).unwrap_or(Status::PeerMemory);
        if status == Status::Ok
            && p.kind == OpKind::Read
            && p.local.len() <= MAX_INLINE
            && m.aux != REPLY_GPU_COPIED
        {
            if inline.len() != p.local.len() {
                return Err(ConnFault::misbehaved(format!(
                    "READ reply carries {} inline bytes, {} were asked",
                    inline.len(),
                    p.local.len()
                )));
            }
            // SAFETY: `p.local` is a checked slice of exactly
            // `inline.len()` live bytes (held by the pending op).
            unsafe { std::ptr::copy_nonoverlapping(inline.as_ptr(), p.local.ptr(), inline.len()) };
        }
        sink.done(p.slot, p.outcome(status));
        Ok(())
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
mod tests {
    use super::*;

    #[test]
    fn copy_bytes_is_exact_at_every_skew_and_tail() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + i / 255) as u8).collect();
        for skew in [0usize, 1, 8, 16, 63, 64, 100] {
            for len in [0usize, 5, 4095, 4096, 4097, 10_000, 12_345] {
                let mut dst = vec![0u8; len + 200];
                // SAFETY: both buffers hold the ranges used.
                unsafe { copy_bytes(dst.as_mut_ptr().add(skew), src.as_ptr(), len) };
                assert_eq!(&dst[skew..skew + len], &src[..len], "skew {skew} len {len}");
                assert!(dst[..skew].iter().all(|&b| b == 0));
                assert!(dst[skew + len..].iter().all(|&b| b == 0));
            }
        }
    }

    use crate::region::{Grant, Region, RegionTable};
    use crate::xfer::testing::{bytes_of, owned_region, write_into, RecSink, View};

    const KEY: KeyRef = KeyRef {
        rkey: 0x77,
        tag: 0x1234_5678,
    };

    /// The peer is this process, so its addresses are ours: copies the way
    /// process_vm_* would, without the syscall; or refuses, as a kernel
    /// with ptrace restrictions does.
    #[derive(Default)]
    struct SameProcess {
        refuse: bool,
        calls: usize,
        /// Sizes of the `copy_many` batches it took (`None`: it refuses
        /// batches, as a kernel that fails one of them would).
        batches: Option<Vec<usize>>,
        /// An address whose copy fails.
        bad_addr: Option<u64>,
        /// The count of each batched copy's region as it was copied.
        counts: Vec<usize>,
    }

    impl PeerMemory for SameProcess {
        fn copy_many<'a>(
            &mut self,
            pid: u32,
            pairs: impl Iterator<Item = (&'a RegionSlice, u64)>,
            from_peer: bool,
        ) -> io::Result<()> {
            let pairs: Vec<_> = pairs.collect();
            if self.batches.is_none() || pairs.iter().any(|p| Some(p.1) == self.bad_addr) {
                return Err(io::Error::from_raw_os_error(libc::EFAULT));
            }
            for (ours, addr) in &pairs {
                self.counts.push(Arc::strong_count(ours.region()));
                self.copy(pid, ours, *addr, from_peer)?;
            }
            self.batches.as_mut().expect("checked").push(pairs.len());
            Ok(())
        }

        fn copy(
            &mut self,
            _pid: u32,
            ours: &RegionSlice,
            addr: u64,
            from_peer: bool,
        ) -> io::Result<()> {
            self.calls += 1;
            if self.refuse || Some(addr) == self.bad_addr {
                return Err(io::Error::from_raw_os_error(libc::EPERM));
            }
            // SAFETY: `addr` is a live region of this test (the "peer"),
            // `ours` a checked slice; the two do not overlap.
            unsafe {
                if from_peer {
                    std::ptr::copy_nonoverlapping(addr as *const u8, ours.ptr(), ours.len())
                } else {
                    std::ptr::copy_nonoverlapping(ours.ptr(), addr as *mut u8, ours.len())
                }
            }
            Ok(())
        }
    }

    struct Side {
        conn: LocalConn,
        mem: Arc<Region>,
        table: RegionTable,
        done: Vec<(u32, Result<()>)>,
        inbox: VecDeque<Vec<u8>>,
    }

    impl Side {
        fn poll(&mut self, mem: &mut SameProcess) -> Result<usize, ConnFault> {
            let mut regions = View {
                table: &self.table,
                conn: self.conn.id,
            };
            let mut sink = RecSink {
                done: &mut self.done,
                inbox: &mut self.inbox,
                cap: 8,
            };
            self.conn
                .poll(&mut regions, &PeerMaps::default(), mem, &mut sink)
        }
    }

    /// Two connection engines over real rings, in one process.
    fn pair(tag: &str) -> (Side, Side) {
        let base = format!("/ferry-test-{:x}-{tag}", std::process::id());
        let ab = ShmRing::create(&format!("{base}-ab"), 64, 1).unwrap();
        let ba = ShmRing::create(&format!("{base}-ba"), 64, 1).unwrap();
        let to_b = ShmRing::open(&format!("{base}-ab")).unwrap();
        let to_a = ShmRing::open(&format!("{base}-ba")).unwrap();
        let pid = std::process::id();
        let side = |id, peer, rx, tx| {
            let mem = owned_region(1 << 20, KEY.rkey, KEY.tag);
            let mut table = RegionTable::default();
            table.insert(KEY.rkey, Grant::whole(&mem));
            Side {
                conn: LocalConn::new(ConnId(id), peer, pid, 7, rx, tx, 16, 16),
                mem,
                table,
                done: Vec::new(),
                inbox: VecDeque::new(),
            }
        };
        (side(1, 2, ba, to_b), side(2, 1, ab, to_a))
    }

    /// `a` starts an op of `len` bytes at offset `off` of both regions;
    /// both sides poll until it ends.
    fn op(
        a: &mut Side,
        b: &mut Side,
        mem: &mut SameProcess,
        kind: OpKind,
        off: usize,
        len: usize,
    ) -> Result<()> {
        let local = RegionSlice::new(&a.mem, off, len).unwrap();
        let addr = b.mem.addr() + off as u64;
        assert!(a
            .conn
            .push_request(kind, 5, KEY, addr, &local, false, Instant::now()));
        b.poll(mem).unwrap();
        a.poll(mem).unwrap();
        assert_eq!(a.done.len(), 1, "the op ended once");
        a.done.pop().unwrap().1
    }

    #[test]
    fn inline_and_copied_transfers_are_byte_exact() {
        let (mut a, mut b) = pair("exact");
        let mut mem = SameProcess::default();
        let data: Vec<u8> = (0..70_000u32).map(|i| (i * 13 + i / 256) as u8).collect();
        for (kind, off, len) in [
            (OpKind::Write, 3, 100),
            (OpKind::Read, 200, MAX_INLINE),
            (OpKind::Write, 4096, 65_536),
            (OpKind::Read, 90_000, 70_000),
        ] {
            let (src, dst) = match kind {
                OpKind::Write => (a.mem.clone(), b.mem.clone()),
                OpKind::Read => (b.mem.clone(), a.mem.clone()),
            };
            write_into(&src, off, &data[..len]);
            op(&mut a, &mut b, &mut mem, kind, off, len).unwrap();
            assert_eq!(bytes_of(&dst, off, len), &data[..len], "{kind} {len}");
        }
        // Only the two large ones needed the peer's memory.
        assert_eq!(mem.calls, 2);
    }

    /// `a` starts `ops` (kind, offset, length) at once; `b` serves them in
    /// one pass; their outcomes in the order they were pushed.
    fn ops_in_one_pass(
        a: &mut Side,
        b: &mut Side,
        mem: &mut SameProcess,
        ops: &[(OpKind, usize, usize)],
    ) -> Vec<Result<()>> {
        for (i, &(kind, off, len)) in ops.iter().enumerate() {
            let local = RegionSlice::new(&a.mem, off, len).unwrap();
            let addr = b.mem.addr() + off as u64;
            assert!(a
                .conn
                .push_request(kind, i as u32, KEY, addr, &local, false, Instant::now()));
        }
        b.poll(mem).unwrap();
        a.poll(mem).unwrap();
        assert_eq!(a.done.len(), ops.len(), "each op ended once");
        let mut done = std::mem::take(&mut a.done);
        done.sort_by_key(|d| d.0);
        done.into_iter().map(|d| d.1).collect()
    }

    #[test]
    fn a_pass_copies_its_requests_in_one_batch_per_direction_in_order() {
        let (mut a, mut b) = pair("batch");
        let mut mem = SameProcess {
            batches: Some(Vec::new()),
            ..Default::default()
        };
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 1) as u8).collect();
        write_into(&a.mem, 0, &data);
        write_into(&b.mem, 65_536, &data);
        // Four WRITEs of 4 KiB, then an inline READ of bytes the first one
        // writes (it must see them: the batch is copied before the READ is
        // answered), then two READs of 4 KiB.
        let ops = [
            (OpKind::Write, 0, 4096),
            (OpKind::Write, 4096, 4096),
            (OpKind::Write, 8192, 4096),
            (OpKind::Write, 12_288, 4096),
            (OpKind::Read, 0, 100),
            (OpKind::Read, 65_536, 4096),
            (OpKind::Read, 65_536 + 4096, 4096),
        ];
        for r in ops_in_one_pass(&mut a, &mut b, &mut mem, &ops[..4]) {
            r.unwrap();
        }
        assert_eq!(bytes_of(&b.mem, 0, 8192), &data[..]);
        let fresh: Vec<u8> = (0..4096u32).map(|i| (i * 3 + 5) as u8).collect();
        write_into(&a.mem, 0, &fresh);
        for r in ops_in_one_pass(&mut a, &mut b, &mut mem, &ops) {
            r.unwrap();
        }
        assert_eq!(bytes_of(&b.mem, 0, 4096), &fresh[..]);
        assert_eq!(
            bytes_of(&a.mem, 0, 100),
            &fresh[..100],
            "the READ saw the WRITE"
        );
        assert_eq!(bytes_of(&a.mem, 65_536, 8192), &data[..]);
        // The first pass: one batch of 4; the second: the 4 WRITEs before
        // the inline READ, then the 2 READs.
        assert_eq!(mem.batches.as_deref(), Some(&[4, 4, 2][..]));
    }

    /// A request is checked with a borrowed slice (no count: the table
    /// holds the region while it is served); one whose copy is put off to
    /// the pass's batch takes its own count, since the table may change
    /// before the batch is copied (a later request's lookup applies queued
    /// registration changes, removals too).
    #[test]
    fn a_put_off_copy_holds_its_region() {
        let (mut a, mut b) = pair("held");
        let mut mem = SameProcess {
            batches: Some(Vec::new()),
            ..Default::default()
        };
        let ops = [(OpKind::Write, 0, 4096), (OpKind::Read, 4096, 4096)];
        for r in ops_in_one_pass(&mut a, &mut b, &mut mem, &ops) {
            r.unwrap();
        }
        // b's table and b's handle, and one count for each of the two
        // put-off copies (both in the batch at once).
        assert_eq!(mem.counts, [4, 4]);
        assert_eq!(Arc::strong_count(&b.mem), 2, "and let go after");
    }

    #[test]
    fn a_failed_batch_fails_only_the_op_that_cannot_be_copied() {
        let (mut a, mut b) = pair("batchfail");
        let mut mem = SameProcess {
            batches: Some(Vec::new()),
            bad_addr: Some(a.mem.addr() + 8192),
            ..Default::default()
        };
        let ops = [
            (OpKind::Write, 0, 4096),
            (OpKind::Write, 4096, 4096),
            (OpKind::Write, 8192, 4096),
            (OpKind::Write, 12_288, 4096),
        ];
        let out = ops_in_one_pass(&mut a, &mut b, &mut mem, &ops);
        for (i, r) in out.iter().enumerate() {
            assert_eq!(r.is_err(), i == 2, "op {i}: {r:?}");
        }
        // The connection goes on.
        mem.bad_addr = None;
        for r in ops_in_one_pass(&mut a, &mut b, &mut mem, &ops) {
            r.unwrap();
        }
    }

    #[test]
    fn unreachable_peer_memory_fails_the_op_not_the_connection() {
        let (mut a, mut b) = pair("refuse");
        let mut mem = SameProcess {
            refuse: true,
            ..Default::default()
        };
        let e = op(&mut a, &mut b, &mut mem, OpKind::Write, 0, 10_000).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Remote {
                    status: Status::PeerMemory,
                    ..
                }
            ),
            "{e:?}"
        );
        mem.refuse = false;
        op(&mut a, &mut b, &mut mem, OpKind::Write, 0, 10_000).unwrap();
    }

    /// The IPC revocations `b` finds in its ring, in order (other
    /// messages are skipped).
    fn revokes_in_ring(b: &mut Side) -> Vec<u64> {
        let mut out = Vec::new();
        let mut buf = [0u8; SLOT_PAYLOAD];
        while let Some(n) = b.conn.rx.ring.pop(&mut buf) {
            let (m, _) = Msg::decode(&buf[..n]).unwrap();
            if m.kind == MsgKind::IpcRevoke {
                out.push(m.addr);
            }
        }
        out
    }

    #[test]
    fn revocations_wait_for_room_in_a_full_ring_and_are_never_refused() {
        let (mut a, mut b) = pair("revoke");
        let mut mem = SameProcess::default();
        // The peer stops reading: its ring fills with notifications' worth
        // of other messages.
        let filler = Msg::new(MsgKind::Close);
        let mut sent = 0;
        while a.conn.send(&filler, &[]) {
            sent += 1;
        }
        assert!(sent > 0);
        a.conn.push_ipc_revoke(0xa000);
        a.conn.push_ipc_revoke(0xb000);
        a.conn.push_ipc_revoke(0xa000);
        assert_eq!(a.conn.revokes_owed(), 2, "kept once each");
        assert!(
            a.conn.owes_revokes() && a.conn.busy(),
            "kept hot: only polling sends them"
        );
        // Still full: polling sends nothing and loses nothing.
        a.poll(&mut mem).unwrap();
        assert_eq!(a.conn.revokes_owed(), 2);
        // The peer reads; our next pass sends them, in order.
        assert!(revokes_in_ring(&mut b).is_empty());
        a.poll(&mut mem).unwrap();
        assert_eq!(a.conn.revokes_owed(), 0);
        assert!(!a.conn.busy());
        assert_eq!(revokes_in_ring(&mut b), vec![0xa000, 0xb000]);
        // With room, one goes at once.
        a.conn.push_ipc_revoke(0xc000);
        assert_eq!(a.conn.revokes_owed(), 0);
        assert_eq!(revokes_in_ring(&mut b), vec![0xc000]);
    }

    #[test]
    fn a_peer_that_never_reads_holds_at_most_the_cap_of_revocations() {
        let (mut a, _b) = pair("revoke-cap");
        let filler = Msg::new(MsgKind::Close);
        while a.conn.send(&filler, &[]) {}
        for i in 0..(MAX_REVOKES_OWED as u64 + 10) {
            a.conn.push_ipc_revoke(0x1000 * (i + 1));
        }
        assert_eq!(a.conn.revokes_owed(), MAX_REVOKES_OWED);
        // The oldest went first.
        assert_eq!(a.conn.revokes_owed[0], 0x1000 * 11);
    }

    #[test]
    fn a_reply_to_nothing_breaks_the_connection() {
        let (mut a, mut b) = pair("stray");
        let mut mem = SameProcess::default();
        let mut m = Msg::new(MsgKind::WriteAck);
        m.conn = 7;
        m.op_id = 999;
        assert!(b.conn.send(&m, &[]));
        let e = a.poll(&mut mem).unwrap_err();
        assert!(
            matches!(&e, ConnFault::PeerMisbehaved { what } if what.contains("not outstanding")),
            "{e}"
        );
    }

    #[test]
    fn a_notification_past_the_cap_breaks_the_connection() {
        let (mut a, mut b) = pair("notify");
        let mut mem = SameProcess::default();
        assert!(b.conn.push_notify(&[1u8; 3000]));
        a.poll(&mut mem).unwrap();
        assert_eq!(a.inbox.pop_front().unwrap(), vec![1u8; 3000]);
        // Fragments that add up past MAX_NOTIFY_WIRE_BYTES.
        let mut m = Msg::new(MsgKind::Notify);
        m.conn = 7;
        m.status = 1;
        for _ in 0..=(MAX_NOTIFY_WIRE_BYTES / MAX_INLINE) {
            assert!(b.conn.send(&m, &[0u8; MAX_INLINE]));
        }
        let e = a.poll(&mut mem).unwrap_err();
        assert!(
            matches!(&e, ConnFault::PeerMisbehaved { what } if what.contains("longer than")),
            "{e}"
        );
    }
}

//! The initiator's side of a same-host connection: our requests pushed
//! into the peer's ring (inline bytes, or where the target finds them), our
//! notifications and IPC revocations, and the target's replies matched to
//! the ops they end.

use std::time::Instant;

use super::{
    push_to, LocalConn, Pending, MAX_REVOKES_OWED, REPLY_GPU_COPIED, REQ_INITIATOR_GPU, REQ_NOTE,
    REQ_NO_INLINE,
};
use crate::error::{ConnFault, Error, OpKind};
use crate::region::{KeyRef, RegionSlice};
use crate::shm::ring::SLOT_PAYLOAD;
use crate::wire::shm_msg::{Msg, MsgKind, MAX_INLINE};
use crate::wire::{IpcRef, Status};
use crate::xfer::Sink;

impl LocalConn {
    /// Queues one request: `None` if there is no room now (retry later),
    /// else whether `note` rode in it (where the peer takes riding notes
    /// and it fits beside the request's own bytes): the peer delivers it
    /// once the request's copy has landed, never if it failed.
    #[allow(clippy::too_many_arguments)]
    pub fn push_request(
        &mut self,
        kind: OpKind,
        slot: u32,
        key: KeyRef,
        addr: u64,
        local: &RegionSlice,
        remote_device: bool,
        note: Option<&[u8]>,
        now: Instant,
    ) -> Option<bool> {
        if !self.can_request() {
            return None;
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
            let handle = keep.ipc_handle.get()?;
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
        // A riding note goes after the request's own bytes; its length
        // says where.
        let (tail, rode) = match note {
            Some(n) if self.notes_ride && inline.len() + n.len() <= MAX_INLINE => {
                m.status |= REQ_NOTE;
                m.aux2 = n.len() as u64;
                (n, true)
            }
            _ => (&[][..], false),
        };
        let mut buf = [0u8; SLOT_PAYLOAD];
        let n = m.encode_with(inline, tail, &mut buf);
        // By field, not `tx_push`: `entry` holds `pending` borrowed.
        if push_to(&self.tx, self.hot, &mut self.ring_due, &buf[..n]).is_err() {
            return None;
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
        Some(rode)
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

    pub(super) fn send_ipc_revoke(&mut self, alloc_base: u64) -> bool {
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

    pub fn fail_pending(&mut self, err: &Error, sink: &mut impl Sink) {
        for p in self.pending.drain() {
            sink.done(p.slot, Err(err.duplicate()));
        }
    }

    /// A reply to one of our requests: ends its op.
    pub(super) fn on_reply(
        &mut self,
        m: Msg,
        inline: &[u8],
        sink: &mut impl Sink,
    ) -> Result<(), ConnFault> {
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
}

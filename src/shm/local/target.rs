//! The target's side of a same-host connection: a peer's request checked
//! against our regions, copied by the path `copy_path` picks (inline,
//! mapped, CMA in batches, a sibling shard, or CUDA) and answered.

use std::sync::Arc;

use super::{copy_bytes, LocalConn, PeerMaps, PeerMemory, REQ_INITIATOR_GPU, REQ_NOTE};
use crate::error::ConnFault;
use crate::region::{Access, KeyRef, RegionSlice, Regions};
use crate::shm::copy_path::{self, CopyPath};
use crate::shm::ring::SLOT_PAYLOAD;
use crate::sys::Mapping;
use crate::wire::shm_msg::{Msg, MsgKind, MAX_INLINE};
use crate::wire::{IpcRef, Status, MAX_NOTIFY_WIRE_BYTES};
use crate::xfer::{CmaBatch, GpuReq, HostCopy, PeerBytes, Sink, Theirs};

/// A checked request to be copied with CMA and answered by `flush_cma`.
pub(super) struct DeferredCma {
    pub(super) op_id: u64,
    pub(super) write: bool,
    /// Our side (held: the region stays alive until the copy).
    pub(super) ours: RegionSlice,
    /// The initiator's address.
    pub(super) addr: u64,
}

impl LocalConn {
    /// The reply to the peer's request `op_id` (status Ok until set).
    pub(super) fn answer(&self, write: bool, op_id: u64) -> Msg {
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
    pub(super) fn flush_cma(&mut self, peer_mem: &mut impl PeerMemory, sink: &mut impl Sink) {
        if self.cma_batch.is_empty() {
            return;
        }
        let mut batch = std::mem::take(&mut self.cma_batch);
        for write in [true, false] {
            let mut pairs = batch.iter().filter(|d| d.write == write).peekable();
            if pairs.peek().is_none() {
                continue;
            }
            // A long run goes to the copy threads, which answer it.
            if self.spread_cma(&batch, write, sink) {
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

    /// Hands this run's CMA copies of one direction to the shard's copy
    /// threads when they are many bytes (twice what one job takes): one
    /// core's CMA moves ~3 GB/s, a KV-cache request of 4 KiB pieces
    /// needs several. Whether it did (the shard answers them).
    fn spread_cma(&mut self, batch: &[DeferredCma], write: bool, sink: &mut impl Sink) -> bool {
        let run = batch.iter().filter(|d| d.write == write);
        let bytes: usize = run.clone().map(|d| d.ours.len()).sum();
        if bytes < 2 * crate::xfer::CMA_JOB_MIN_BYTES {
            return false;
        }
        let pieces = run.map(|d| (d.op_id, d.ours.clone(), d.addr)).collect();
        let req = CmaBatch {
            conn: self.id,
            pid: self.peer_pid,
            write,
            pieces,
        };
        sink.cma_batch(req).is_ok()
    }

    pub(super) fn reply(&mut self, m: &Msg, inline: &[u8]) {
        // A notification that rode in the request lands with its copy.
        if let Some(note) = self.held_notes.remove(&m.op_id) {
            if m.status == Status::Ok as u8 {
                self.notes_landed.push_back(note);
            }
        }
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
    pub(super) fn mapped<'m>(
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
    pub(super) fn serve(
        &mut self,
        mut m: Msg,
        inline: &[u8],
        regions: &mut impl Regions,
        maps: &PeerMaps,
        peer_mem: &mut impl PeerMemory,
        sink: &mut impl Sink,
    ) -> Result<(), ConnFault> {
        self.count_request()?;
        let inline = self.hold_note(&mut m, inline)?;
        let write = m.kind == MsgKind::WriteReq;
        let need = if write {
            Access::REMOTE_WRITE
        } else {
            Access::REMOTE_READ
        };
        let key = KeyRef {
            rkey: m.rkey,
            tag: m.aux,
        };
        // Borrowed (no count of the region): the table holds it while this
        // request is served, and nothing here changes the table; what keeps
        // the slice longer (a put-off or handed-over copy) adopts it.
        let mut w = match regions.check_as(key, m.addr, m.len, need, true) {
            Ok(w) => w,
            Err(status) => {
                sink.served(write, None);
                self.reply_status(write, m.op_id, status);
                return Ok(());
            }
        };
        sink.served(write, Some(m.len));
        let path = copy_path::choose(&copy_path::Request {
            write,
            gpu: m.status != 0 || w.is_device(),
            inline_len: inline.len(),
            len: w.len(),
            max_inline: MAX_INLINE,
        });
        if path == CopyPath::Here && self.mapped(maps, m.src_key, m.src_addr, m.len).is_none() {
            // Copied with CMA with the rest of this run of such requests
            // (`flush_cma` copies and answers).
            w.adopt();
            let (op_id, addr, ours) = (m.op_id, m.src_addr, w);
            self.cma_batch.push(DeferredCma {
                op_id,
                write,
                ours,
                addr,
            });
            return Ok(());
        }
        // Requests are served in order: the copies put off so far happen
        // before this one's.
        self.flush_cma(peer_mem, sink);
        self.serve_now(path, &m, inline, w, maps, peer_mem, sink);
        Ok(())
    }

    /// Copies a checked request by `path` and answers it, or hands it to
    /// who will (CUDA, a sibling shard).
    #[allow(clippy::too_many_arguments)]
    fn serve_now(
        &mut self,
        path: CopyPath,
        m: &Msg,
        inline: &[u8],
        mut w: RegionSlice,
        maps: &PeerMaps,
        peer_mem: &mut impl PeerMemory,
        sink: &mut impl Sink,
    ) {
        let write = m.kind == MsgKind::WriteReq;
        let copied = match path {
            CopyPath::Cuda => {
                // The copy outlives this call.
                w.adopt();
                if let Err(status) = self.cuda_copy(m, inline, w, write, maps, sink) {
                    self.reply_status(write, m.op_id, status);
                }
                // Else the shard copies and answers.
                return;
            }
            CopyPath::FromRequest => {
                // SAFETY: both ranges are `len` long and distinct.
                unsafe { std::ptr::copy_nonoverlapping(inline.as_ptr(), w.ptr(), w.len()) };
                true
            }
            CopyPath::InReply => {
                let mut reply = self.answer(write, m.op_id);
                reply.status = Status::Ok as u8;
                // SAFETY: `w` is len readable bytes, alive (and unchanged:
                // this thread serves the region) until the reply is encoded.
                let bytes = unsafe { std::slice::from_raw_parts(w.ptr(), w.len()) };
                self.reply(&reply, bytes);
                return;
            }
            CopyPath::Spread | CopyPath::Here => {
                let spread = path == CopyPath::Spread;
                match self.copy_host(m, &w, write, spread, maps, peer_mem, sink) {
                    Some(copied) => copied,
                    // A sibling shard copies; it answers.
                    None => return,
                }
            }
        };
        let status = if copied {
            Status::Ok
        } else {
            Status::PeerMemory
        };
        self.reply_status(write, m.op_id, status);
    }

    /// One more request of the peer's out (each is answered once); past
    /// the agreed number the peer broke the protocol.
    fn count_request(&mut self) -> Result<(), ConnFault> {
        if self.peer_owed >= self.peer_max {
            return Err(ConnFault::misbehaved(format!(
                "peer sent more than the agreed {} requests in flight",
                self.peer_max
            )));
        }
        self.peer_owed += 1;
        Ok(())
    }

    /// Takes the notification riding at the end of request `m`'s inline
    /// bytes (`REQ_NOTE`), held until the request is answered (`reply`),
    /// and returns the request's own bytes.
    fn hold_note<'a>(&mut self, m: &mut Msg, inline: &'a [u8]) -> Result<&'a [u8], ConnFault> {
        if m.status & REQ_NOTE == 0 {
            return Ok(inline);
        }
        m.status &= !REQ_NOTE;
        let n = m.aux2;
        if m.kind != MsgKind::WriteReq
            || n > inline.len() as u64
            || n > MAX_NOTIFY_WIRE_BYTES as u64
        {
            return Err(ConnFault::misbehaved(format!(
                "a {:?} with a riding notification of {n} bytes in {} inline",
                m.kind,
                inline.len()
            )));
        }
        let (own, note) = inline.split_at(inline.len() - n as usize);
        if self.held_notes.insert(m.op_id, note.to_vec()).is_some() {
            return Err(ConnFault::misbehaved(format!(
                "request {} sent again while outstanding",
                m.op_id
            )));
        }
        Ok(own)
    }

    /// Answers request `op_id` with `status` and no bytes.
    fn reply_status(&mut self, write: bool, op_id: u64, status: Status) {
        let mut reply = self.answer(write, op_id);
        reply.status = status as u8;
        self.reply(&reply, &[]);
    }

    /// Hands a request with a GPU side to the shard's CUDA copies (they
    /// answer); `Err` is the status to answer now.
    pub(super) fn cuda_copy(
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
    pub(super) fn copy_host(
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
}

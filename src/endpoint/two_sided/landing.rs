//! The I/O of eager messages into bounce slots (`bounce.rs` has the
//! rules): the receiver's grant, the sender's WRITE into a slot, the
//! receiver's copy out of it, and the messages each side says.

use super::bounce::{self, Bounce, Granted, Landing, Verdict};
use super::state::{ctl, CopyOut, Posted, State, MAX_OUTBOX};
use crate::endpoint::{Endpoint, MemoryRegion, Peer};
use crate::error::{ConnId, Error, OpKind, Result};
use crate::reactor::IpcParts;
use crate::region::RegionSlice;
use crate::wire::{AnyWindow, CtlMsg, FinStatus, NOTE_APP};

/// What became of a message in a slot for a posted receive.
pub(super) enum Taken {
    /// The receive ended (the message copied in, or refused).
    Ended(Result<usize>),
    /// It is being copied into the receive's GPU buffer (`State::copying`).
    Copying,
    /// Not taken (the other kind of memory): the receive stays posted and
    /// the sender sends the message again into its offer.
    Again,
}

impl Endpoint {
    /// Receiver: grants the peer on `conn` a bounce, once per connection,
    /// when a receive into `mr` is posted there: a same-host peer, a host
    /// receive longer than the inline bound or one of GPU memory, slots
    /// configured for its kind, and room in `MAX_BOUNCE_BYTES`. Failing to
    /// make one is no error: messages then come the usual way.
    pub(super) fn grant_bounce(&self, st: &mut State, conn: ConnId, mr: &MemoryRegion, max: usize) {
        let device = mr.inner.mem.is_device();
        let wanted = device || max > super::state::MAX_EAGER_SAME_HOST;
        let slots = if device {
            self.inner.cfg.msg_bounce_gpu_slots
        } else {
            self.inner.cfg.msg_bounce_slots
        };
        let c = st.conns.entry(conn).or_default();
        let local = matches!(self.peer(conn), Some(Peer::Local { .. }));
        if c.bounce_tried || !wanted || slots == 0 || !local {
            return;
        }
        c.bounce_tried = true;
        let slot_bytes = if device {
            bounce::GPU_SLOT_BYTES
        } else {
            bounce::HOST_SLOT_BYTES
        };
        let bytes = slots as usize * slot_bytes as usize;
        let held: usize = (st.conns.values())
            .filter_map(|c| c.bounce.as_ref())
            .filter(|b| b.device() == device)
            .map(Bounce::bytes)
            .sum();
        if held + bytes > bounce::MAX_BOUNCE_BYTES {
            return;
        }
        // A key window over GPU memory too: the sender's WRITE into a slot
        // is then copied by our shard (its requests carry its memory's IPC
        // reference), so only this process runs GPU copies for the
        // connection. Two processes' kernels on one GPU take turns by
        // time slices without MPS: a sender copying into our slots with
        // its own kernel measured 258 µs a message (UCCL's benchmark).
        //
        // GPU memory comes uninitialised: zeroed, so a slot never shows
        // bytes this process held before (a peer's `Landed` for a slot it
        // never wrote copies the slot as it is).
        let made = match mr.inner.mem {
            crate::gpu::MemKind::Device { ordinal, .. } => self
                .alloc_gpu_on(ordinal, bytes)
                .and_then(|b| b.write_at(0, &vec![0; bytes]).map(|()| b)),
            _ => self.alloc_host(bytes),
        }
        .and_then(|b| Ok((self.advertise(conn, &b, 0, bytes)?, b)));
        let (window, b) = match made {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(%conn, "no bounce slots for the peer: {e}");
                return;
            }
        };
        let c = st.conns.get_mut(&conn).expect("entered above");
        c.bounce = Some(Bounce::new(b, slots, slot_bytes));
        let grant = CtlMsg::Grant {
            slots,
            slot_bytes,
            window: AnyWindow::Key(window),
        };
        st.outbox.push_back((conn, ctl(grant)));
    }

    /// Sender: the peer's grant, kept if it is the first and a same-host
    /// peer's key window (its own memory by construction: its shard
    /// checks every WRITE against its keys). A CUDA IPC window is refused:
    /// our kernels would copy into it, beside the peer's (see
    /// `grant_bounce`), and it could name memory that is not the peer's.
    pub(super) fn take_grant(
        &self,
        st: &mut State,
        conn: ConnId,
        (slots, slot_bytes): (u16, u32),
        w: &AnyWindow,
    ) {
        let local = matches!(self.peer(conn), Some(Peer::Local { .. }));
        let c = st.conns.entry(conn).or_default();
        match w.key() {
            Some(r) if local && c.granted.is_none() => {
                c.granted = Some(Granted::new(slots, slot_bytes, *r));
            }
            _ => {
                tracing::warn!(%conn, "a bounce grant not taken (a second one, not a key window, or not a same-host peer's)")
            }
        }
    }

    /// Receiver: message `seq`, in slot `l` of `conn`'s bounce, for
    /// receive `posted` (taken out of the posted ones by the caller, who
    /// puts it back on `Again`): copied in, refused, or sent `Again`, and
    /// the sender answered; the slot released once nothing reads it.
    pub(super) fn take_landing(
        &self,
        st: &mut State,
        conn: ConnId,
        seq: u64,
        posted: &Posted,
        l: Landing,
    ) -> Taken {
        let Some(b) = st.conns.get_mut(&conn).and_then(|c| c.bounce.as_mut()) else {
            return Taken::Again;
        };
        let len = l.len as usize;
        let src = b.slice(l);
        let taken = match bounce::verdict(posted.max, posted.is_device(), b.device(), len) {
            Verdict::Again => {
                st.answer(conn, seq, FinStatus::Again, 0);
                Taken::Again
            }
            Verdict::TooLarge => {
                st.answer(conn, seq, FinStatus::TooLarge, posted.max);
                let len = len as u64;
                let posted = posted.max;
                Taken::Ended(Err(Error::MessageTooLarge { len, posted }))
            }
            // Nothing to copy (a buffer of no bytes: neither `dest` nor `gpu`).
            Verdict::Take if len == 0 => {
                st.answer(conn, seq, FinStatus::Ok, 0);
                Taken::Ended(Ok(0))
            }
            Verdict::Take => match (&posted.dest, &posted.gpu) {
                (Some(dest), _) => {
                    // SAFETY: host memory (a host slot, `verdict`), alive
                    // while `src` holds the bounce region, `len` bytes
                    // from its start (`land` checked them against the
                    // slot). The peer may still write there: bytes change,
                    // never their validity (u8).
                    let bytes = unsafe { std::slice::from_raw_parts(src.ptr(), len) };
                    dest.copy_in(bytes);
                    st.bounced_in += 1;
                    st.answer(conn, seq, FinStatus::Ok, len as u64);
                    Taken::Ended(Ok(len))
                }
                (None, Some((region, off))) => {
                    let started = (region.upgrade())
                        .and_then(|r| RegionSlice::new(&r, *off, len))
                        .ok_or(Error::Shutdown)
                        .and_then(|dst| {
                            let parts = IpcParts::Local { dst, src };
                            (self.inner).submit_ipc(conn, OpKind::Read, parts, None, NOTE_APP)
                        });
                    match started {
                        Ok(t) => {
                            // Taken: it lands unless the GPU fails the
                            // copy (the receive then fails with why).
                            st.answer(conn, seq, FinStatus::Ok, len as u64);
                            let slot = l.slot;
                            let id = posted.id;
                            st.copying.push(CopyOut {
                                conn,
                                slot,
                                id,
                                len,
                                t,
                            });
                            return Taken::Copying;
                        }
                        Err(e) => {
                            st.answer(conn, seq, FinStatus::Failed, 0);
                            Taken::Ended(Err(e))
                        }
                    }
                }
                (None, None) => unreachable!("a buffer of bytes is host or GPU memory"),
            },
        };
        release(st, conn, l.slot);
        taken
    }

    /// Receiver: ends the receives whose copies out of a slot ended.
    pub(super) fn end_copies(&self, st: &mut State) {
        let mut i = 0;
        while i < st.copying.len() {
            let Some(r) = st.copying[i].t.poll() else {
                i += 1;
                continue;
            };
            let done = st.copying.swap_remove(i);
            st.bounced_in += u64::from(r.is_ok());
            st.ended.insert(done.id, r.map(|()| done.len));
            release(st, done.conn, done.slot);
        }
    }
}

/// Receiver: `slot` of `conn`'s bounce may be written again; the sender
/// is told. A slot taken by a receive is one per receive we posted (our
/// bound); one freed at once (a landing for a receive that ended, or a
/// number sent twice) a peer can cause without end, so past `MAX_OUTBOX`
/// unsaid messages (peers not reading) it is not said, it is logged: the
/// slot is free here, and lost to that peer.
pub(super) fn release(st: &mut State, conn: ConnId, slot: u16) {
    if let Some(b) = st.conns.get_mut(&conn).and_then(|c| c.bounce.as_mut()) {
        b.slots.release(slot);
        if st.outbox.len() >= MAX_OUTBOX {
            tracing::warn!(%conn, slot, "a bounce slot freed, unsaid: peers are not reading");
            return;
        }
        st.outbox.push_back((conn, ctl(CtlMsg::Released { slot })));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that repeats a landing for a receive that ended (each freed
    /// at once and answered `Released`) while nobody reads our answers
    /// grows the outbox only to its bound; the slot is free each time.
    #[test]
    fn released_answers_stop_at_the_outbox_bound() {
        let cfg = crate::endpoint::Config {
            listen_addr: "127.0.0.1".parse().unwrap(),
            transport: crate::endpoint::Transport::Tcp,
            ..Default::default()
        };
        let ep = Endpoint::builder().config(cfg).build().unwrap();
        let mut st = State::default();
        let conn = ConnId(7);
        let c = st.conns.entry(conn).or_default();
        c.next_recv = 5;
        c.bounce = Some(Bounce::new(ep.alloc(4 * 64).unwrap(), 4, 64));
        for _ in 0..2 * MAX_OUTBOX {
            let b = st.conns.get_mut(&conn).unwrap().bounce.as_mut().unwrap();
            let l = b.slots.land(2, 64).expect("the slot is free again");
            release(&mut st, conn, l.slot);
        }
        assert_eq!(st.outbox.len(), MAX_OUTBOX);
    }
}

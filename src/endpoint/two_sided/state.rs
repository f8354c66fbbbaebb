//! The two-sided matching state, apart from the I/O: what each connection
//! has posted, offered, sent eagerly and holds, and what each message from
//! the peer does to it. The caller (`super`) reads the inbox, starts the
//! WRITEs, revokes windows and queues what `outbox` holds.

use std::collections::{BTreeMap, HashMap, VecDeque};

use std::sync::Weak;

use super::bounce::{self, Bounce, Granted, Verdict};
use crate::error::{ConnFault, ConnId, Error, Result};
use crate::reactor::Transfer;
use crate::region::{Region, RegionSlice};
use crate::wire::{CtlMsg, FinStatus, RemoteBuf, MAX_EAGER_BYTES, NOTE_CTL};

/// Offers of receive buffers a connection may have waiting for a send.
/// A receiver never has more than this many offered and unanswered: its
/// further receives wait on its side and are offered as earlier ones end,
/// so an honest sender never refuses one.
pub(super) const MAX_UNMATCHED: usize = 1024;
/// Messages waiting for room in a shard's queue, all connections together;
/// past this a refusal owed to a peer that offers past its bound while
/// not reading is not said (it is logged): no peer grows our memory.
pub(super) const MAX_OUTBOX: usize = 4 * MAX_UNMATCHED;
/// The longest message sent eagerly to a same-host peer: its ring carries
/// a notification ~200 bytes a slot, and past 4 KiB the WRITE (one copy,
/// then `Fin`) was as quick (`ferry bench --op send`, 8 KiB: 17 µs round
/// trip by WRITE, 22 eagerly, on 2 cores); over tcp up to `MAX_EAGER_BYTES`.
pub(super) const MAX_EAGER_SAME_HOST: usize = 4096;
/// Eager messages a connection's sender has out and unanswered; past this
/// a small message goes the usual way (offer, WRITE, `Fin`).
pub(super) const EAGER_WINDOW: usize = 64;
/// Eager messages a receiver holds for one connection before their buffer
/// is posted (the sender's window: an honest sender never sees `Again`
/// for want of room here) ...
pub(super) const MAX_HELD_PER_CONN: usize = EAGER_WINDOW;
/// ... and their bytes, all connections together: past this an eager
/// message is answered `Again` and comes the usual way, so peers that
/// send and never see a receive posted hold at most this much of ours.
pub(super) const MAX_HELD_BYTES: usize = 8 << 20;

#[derive(Default)]
pub(super) struct State {
    next_id: u64,
    pub(super) conns: HashMap<ConnId, ConnMsgs>,
    /// Ended ops' results, until polled.
    pub(super) ended: HashMap<u64, Result<usize>>,
    /// Messages for peers not yet queued (their shard's queue was full).
    pub(super) outbox: VecDeque<(ConnId, Vec<u8>)>,
    /// `conns.len()` after the last sweep of dead connections' entries.
    pub(super) swept_len: usize,
    /// Messages being copied out of our bounce slots into their GPU
    /// buffers (kept past their connection's end: the copy runs on).
    pub(super) copying: Vec<CopyOut>,
    /// Messages of ours the peer took out of its bounce slots (metrics) ...
    pub(super) bounced_out: u64,
    /// ... and those taken out of ours into their buffers.
    pub(super) bounced_in: u64,
    /// Bytes of eager messages held, all connections together.
    held_bytes: usize,
}

#[derive(Default)]
pub(super) struct ConnMsgs {
    pub(super) next_send: u64,
    pub(super) next_recv: u64,
    /// Sends not yet matched, in order.
    pub(super) sends: VecDeque<Pending>,
    /// The peer's offers not yet matched, by sequence number.
    pub(super) offers: BTreeMap<u64, RemoteBuf>,
    /// Sends whose WRITE runs.
    pub(super) writing: Vec<Writing>,
    /// Sends that went eagerly, awaiting the receiver's `Ack`.
    pub(super) eager: BTreeMap<u64, Eager>,
    /// Our posted receives awaiting the sender's `Fin` (or its eager
    /// message), by number.
    pub(super) recvs: HashMap<u64, Posted>,
    /// Of those, how many were offered (`Cts` sent) and not yet answered.
    pub(super) offered: usize,
    /// Those not yet offered (past `MAX_UNMATCHED` offered), in order.
    pub(super) unoffered: VecDeque<(u64, RemoteBuf)>,
    /// Eager messages that came before their receive was posted.
    pub(super) held: BTreeMap<u64, Vec<u8>>,
    /// The peer's bounce slots we may WRITE messages into (its `Grant`).
    pub(super) granted: Option<Granted>,
    /// Our bounce slots granted to the peer, and what landed in them.
    pub(super) bounce: Option<Bounce>,
    /// A bounce was tried for this connection (granted or not: at most one
    /// allocation each).
    pub(super) bounce_tried: bool,
}

/// A message being copied out of bounce slot `slot` of `conn` into the GPU
/// buffer of receive `id`.
pub(super) struct CopyOut {
    pub(super) conn: ConnId,
    pub(super) slot: u16,
    pub(super) id: u64,
    pub(super) len: usize,
    pub(super) t: Transfer,
}

pub(super) struct Pending {
    pub(super) id: u64,
    pub(super) seq: u64,
    /// The message (it holds the registration).
    pub(super) msg: RegionSlice,
}

/// A send that went eagerly (inline, or into a bounce slot).
pub(super) struct Eager {
    pub(super) id: u64,
    /// The message (it holds the registration) until the send ended;
    /// `None` after: the answer is awaited only to keep the window (see
    /// `eager_offer`), and the registration is free to go meanwhile.
    pub(super) msg: Option<RegionSlice>,
    /// The peer's bounce slot it went into (`None`: inside the `Eager`
    /// notification).
    pub(super) slot: Option<u16>,
    /// That slot's WRITE, while it runs.
    pub(super) write: Option<Transfer>,
}

impl Eager {
    /// Sent inside the `Eager` notification (`msg`: `None` if it ended at
    /// once, its receive offered already).
    pub(super) fn inline(id: u64, msg: Option<RegionSlice>) -> Eager {
        Eager {
            id,
            msg,
            slot: None,
            write: None,
        }
    }

    /// Being WRITten (`write`) into the peer's bounce slot `slot`.
    pub(super) fn in_slot(id: u64, msg: RegionSlice, slot: u16, write: Transfer) -> Eager {
        Eager {
            id,
            msg: Some(msg),
            slot: Some(slot),
            write: Some(write),
        }
    }

    pub(super) fn ended(&self) -> bool {
        self.msg.is_none()
    }
}

pub(super) struct Writing {
    pub(super) id: u64,
    pub(super) seq: u64,
    pub(super) len: u64,
    pub(super) t: Transfer,
}

pub(super) struct Posted {
    pub(super) id: u64,
    pub(super) max: u64,
    /// The window's key, revoked once the message is in (0: none).
    pub(super) rkey: u32,
    /// The buffer, where the CPU may copy an eager message into it (host
    /// memory); `None` for GPU memory (such a message is sent `Again`).
    pub(super) dest: Option<Dest>,
    /// GPU memory (a receive of at least a byte): the region, not held
    /// while nothing came (deregistering it fails the receive), and the
    /// buffer's offset in it, where a bounce slot's message is copied.
    pub(super) gpu: Option<(Weak<Region>, usize)>,
}

impl Posted {
    /// Whether its buffer is GPU memory (as its offer's window says).
    pub(super) fn is_device(&self) -> bool {
        self.gpu.is_some()
    }
}

/// A posted host buffer, held (a receive is an op in flight on its
/// buffer: deregistering it waits for the receive to end, as for a
/// transfer), so an eager message for it always lands: its sender may
/// have been told so already (see `ConnMsgs::eager_offer`).
pub(super) struct Dest(RegionSlice);

impl Dest {
    /// Where an eager message for `slice` lands; `None` for GPU memory.
    pub(super) fn of(slice: RegionSlice) -> Option<Dest> {
        (!slice.is_device()).then_some(Dest(slice))
    }

    /// Copies `bytes` in; the caller checked they fit the posted length.
    pub(super) fn copy_in(&self, bytes: &[u8]) {
        assert!(bytes.len() <= self.0.len(), "checked by the caller");
        // SAFETY: host memory (`of`), alive while the slice holds it,
        // writable (checked when posted), `bytes.len()` fits (above). A
        // peer's WRITE into the same window can change bytes, never their
        // validity (u8).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.0.ptr(), bytes.len()) }
    }
}

impl ConnMsgs {
    pub(super) fn pending(&self) -> bool {
        !self.sends.is_empty()
            || !self.recvs.is_empty()
            || !self.writing.is_empty()
            || !self.eager.is_empty()
            || !self.held.is_empty()
            || self.bounce.as_ref().is_some_and(|b| !b.held.is_empty())
    }

    /// The lowest number a send of ours still waits on an offer for.
    pub(super) fn first_unmatched(&self) -> u64 {
        let send = self.sends.front().map(|p| p.seq);
        let eager = (self.eager.iter())
            .find(|(_, e)| !e.ended())
            .map(|(seq, _)| *seq);
        [send, eager]
            .into_iter()
            .flatten()
            .fold(self.next_send, u64::min)
    }

    /// Whether message `msg`, number `seq`, goes eagerly: small (at most
    /// `max`, the path's bound), in host
    /// memory, room in the window, and no offer for it here that it would
    /// not fill (GPU memory: `Again`; too short: the usual path refuses
    /// it before a byte moves).
    pub(super) fn goes_eagerly(&self, msg: &RegionSlice, seq: u64, max: usize) -> bool {
        msg.len() <= max.min(MAX_EAGER_BYTES)
            && !msg.is_device()
            && self.eager.len() < EAGER_WINDOW
            && self.offers.get(&seq).map_or(true, |w| {
                let max = u64::from(w.size);
                bounce::verdict(max, w.is_device(), false, msg.len()) == Verdict::Take
            })
    }

    /// A bounce slot of the peer's for message `msg`, number `seq`, taken:
    /// one is granted and free, the message fits it, the window has room,
    /// and no offer for it is here (then it goes straight into that).
    pub(super) fn bounce_slot(&mut self, msg: &RegionSlice, seq: u64) -> Option<(u16, RemoteBuf)> {
        if self.eager.len() >= EAGER_WINDOW || self.offers.contains_key(&seq) {
            return None;
        }
        let g = self.granted.as_mut()?;
        if !g.fits(msg.len(), msg.is_device()) {
            return None;
        }
        g.take()
    }

    /// Ends the WRITEs of our messages into the peer's bounce slots. One
    /// that failed goes the usual way (its slot is free again: no
    /// `Landed` rides on a failed WRITE, so the peer never heard of it);
    /// one that landed is decided by its offer, if that came meanwhile.
    pub(super) fn end_bounce_writes(&mut self, ended: &mut HashMap<u64, Result<usize>>) {
        // (Empty, the usual case: collected without an allocation.)
        let writing: Vec<u64> = (self.eager.iter())
            .filter(|(_, e)| e.write.is_some())
            .map(|(seq, _)| *seq)
            .collect();
        for seq in writing {
            let e = self.eager.get_mut(&seq).expect("listed");
            let Some(r) = e.write.as_mut().and_then(Transfer::poll) else {
                continue;
            };
            e.write = None;
            match r {
                Ok(()) => {
                    if let Some(w) = self.offers.remove(&seq) {
                        if let Some((id, r)) = self.eager_offer(seq, &w) {
                            ended.insert(id, r);
                        }
                    }
                }
                Err(err) => {
                    tracing::debug!(seq, "a message's WRITE into a bounce slot failed ({err}): it goes the usual way");
                    let e = self.eager.remove(&seq).expect("listed");
                    if let (Some(g), Some(slot)) = (self.granted.as_mut(), e.slot) {
                        g.release(slot);
                    }
                    let msg = e.msg.expect("not ended while its WRITE runs");
                    let at = self.sends.partition_point(|p| p.seq < seq);
                    self.sends.insert(at, Pending { id: e.id, seq, msg });
                }
            }
        }
    }

    /// The receiver's offer for `seq`, an eager message of ours: what the
    /// receiver will do with the message is known now, so the send ends
    /// (it lands, or it is too long for the buffer: the receiver refuses
    /// it alike) or, for GPU memory (the receiver answers `Again`), goes
    /// the usual way into this offer. `None`: no eager message of ours
    /// awaits an offer there.
    pub(super) fn eager_offer(
        &mut self,
        seq: u64,
        window: &RemoteBuf,
    ) -> Option<(u64, Result<usize>)> {
        let slot_device = self.granted.as_ref().is_some_and(Granted::device);
        let e = self.eager.get_mut(&seq).filter(|e| !e.ended())?;
        if e.write.is_some() {
            // Its WRITE into the slot runs: decided once it ended (it may
            // fail, and then go into this offer).
            self.offers.insert(seq, *window);
            return None;
        }
        let in_slot = e.slot.is_some() && slot_device;
        // Its `Ack` will only close the window now.
        let msg = e.msg.take().expect("not ended");
        let (id, len) = (e.id, msg.len());
        let max = u64::from(window.size);
        match bounce::verdict(max, window.is_device(), in_slot, len) {
            Verdict::Take => return Some((id, Ok(len))),
            Verdict::TooLarge => {
                let len = len as u64;
                return Some((id, Err(Error::MessageTooLarge { len, posted: max })));
            }
            Verdict::Again => {}
        }
        let send = Pending { id, seq, msg };
        let at = self.sends.partition_point(|p| p.seq < seq);
        self.sends.insert(at, send);
        self.offers.insert(seq, *window);
        None
    }
}

/// What ending a posted receive leaves the caller to do.
#[must_use]
pub(super) struct Ended {
    /// The window's key to revoke (0: none).
    pub(super) rkey: u32,
}

impl State {
    pub(super) fn new_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// `conn` is gone: everything it held fails, what it held is dropped.
    pub(super) fn fail_conn(&mut self, conn: ConnId, err: &Error) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        let ids = (c.sends.iter().map(|s| s.id))
            .chain(c.recvs.values().map(|p| p.id))
            .chain(c.writing.iter().map(|w| w.id))
            .chain(c.eager.values().filter(|e| !e.ended()).map(|e| e.id));
        for id in ids {
            self.ended.insert(id, Err(err.duplicate()));
        }
        self.held_bytes -= c.held.values().map(Vec::len).sum::<usize>();
        self.outbox.retain(|(to, _)| *to != conn);
    }

    /// Offers `conn`'s posted receives that wait, while fewer than
    /// `MAX_UNMATCHED` are offered and unanswered (the sender's bound).
    pub(super) fn offer_next(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        while c.offered < MAX_UNMATCHED {
            let Some((seq, window)) = c.unoffered.pop_front() else {
                break;
            };
            c.offered += 1;
            self.outbox
                .push_back((conn, ctl(CtlMsg::Cts { seq, window })));
        }
    }

    /// Receive `seq` of `conn` (taken out of `recvs`) ended: its offer no
    /// longer counts (or it is never made), the next may be offered.
    pub(super) fn end_posted(&mut self, conn: ConnId, seq: u64, posted: &Posted) -> Ended {
        if let Some(c) = self.conns.get_mut(&conn) {
            match c.unoffered.iter().position(|(s, _)| *s == seq) {
                Some(i) => {
                    c.unoffered.remove(i);
                }
                None => c.offered = c.offered.saturating_sub(1),
            }
        }
        self.offer_next(conn);
        Ended { rkey: posted.rkey }
    }

    /// The peer's eager message `seq` on `conn`: into its posted buffer,
    /// held until that is posted, or answered `Again`. What a receive it
    /// ended leaves to do is returned.
    pub(super) fn take_eager(&mut self, conn: ConnId, seq: u64, payload: &[u8]) -> Option<Ended> {
        let c = self.conns.entry(conn).or_default();
        if let Some(posted) = c.recvs.get(&seq) {
            if posted.dest.is_none() {
                self.answer(conn, seq, FinStatus::Again, 0);
                return None;
            }
            let posted = c.recvs.remove(&seq).expect("looked up");
            let r = self.fill(conn, seq, &posted, payload);
            self.ended.insert(posted.id, r);
            return Some(self.end_posted(conn, seq, &posted));
        }
        if seq < c.next_recv {
            tracing::warn!(%conn, seq, "an eager message for a receive that ended: ignored");
        } else if c.held.contains_key(&seq) {
            tracing::warn!(%conn, seq, "an eager message sent twice: ignored");
        } else if c.held.len() < MAX_HELD_PER_CONN
            && self.held_bytes + payload.len() <= MAX_HELD_BYTES
        {
            self.held_bytes += payload.len();
            c.held.insert(seq, payload.to_vec());
        } else {
            self.answer(conn, seq, FinStatus::Again, 0);
        }
        None
    }

    /// A receive just numbered `seq` on `conn` takes the eager message
    /// held for it, if one is: `Some(result)` when that ended it (the
    /// buffer is host memory), else it is posted as usual (an `Again` is
    /// said for a GPU buffer).
    pub(super) fn take_held(
        &mut self,
        conn: ConnId,
        seq: u64,
        posted: &Posted,
    ) -> Option<Result<usize>> {
        let payload = self.conns.get_mut(&conn)?.held.remove(&seq)?;
        self.held_bytes -= payload.len();
        if posted.dest.is_none() {
            self.answer(conn, seq, FinStatus::Again, 0);
            return None;
        }
        Some(self.fill(conn, seq, posted, &payload))
    }

    /// Copies eager message `seq` into `posted`'s buffer, or refuses it
    /// (longer than the buffer), and answers the sender.
    fn fill(&mut self, conn: ConnId, seq: u64, posted: &Posted, payload: &[u8]) -> Result<usize> {
        let dest = posted.dest.as_ref().expect("a host buffer");
        let len = payload.len() as u64;
        if len > posted.max {
            self.answer(conn, seq, FinStatus::TooLarge, posted.max);
            return Err(Error::MessageTooLarge {
                len,
                posted: posted.max,
            });
        }
        dest.copy_in(payload);
        self.answer(conn, seq, FinStatus::Ok, len);
        Ok(payload.len())
    }

    /// Queues the answer to eager message `seq`. An `Ack` of a message
    /// taken is one per receive we posted (our bound); `Again` a peer can
    /// ask for without end (the same message again and again, for a GPU
    /// buffer or past the hold bounds), so past `MAX_OUTBOX` unsaid
    /// messages (peers not reading) it is not said, it is logged, as an
    /// offer refused past the bound: no peer grows our memory.
    pub(super) fn answer(&mut self, conn: ConnId, seq: u64, status: FinStatus, len: u64) {
        if status == FinStatus::Again && self.outbox.len() >= MAX_OUTBOX {
            tracing::warn!(%conn, seq, "an eager message not taken, unanswered: peers are not reading");
            return;
        }
        self.outbox
            .push_back((conn, ctl(CtlMsg::Ack { seq, status, len })));
    }

    /// The receiver's answer to our eager message `seq` on `conn`: the
    /// send ends, or (`Again`) waits for its offer like any other.
    pub(super) fn take_ack(&mut self, conn: ConnId, seq: u64, status: FinStatus, len: u64) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let Some(sent) = c.eager.remove(&seq) else {
            tracing::warn!(%conn, seq, "an answer for no eager message of ours: ignored");
            return;
        };
        if sent.slot.is_some() && status == FinStatus::Ok {
            self.bounced_out += 1;
        }
        let Some(msg) = sent.msg else {
            // Ended when its offer came (what the receiver answers was
            // known then; a GPU buffer's offer waits in `offers` for the
            // WRITE): the answer only closes the window.
            return;
        };
        let msg_len = msg.len() as u64;
        let r = match status {
            FinStatus::Again => {
                // Back in number order among the sends that wait.
                let at = c.sends.partition_point(|p| p.seq < seq);
                c.sends.insert(
                    at,
                    Pending {
                        id: sent.id,
                        seq,
                        msg,
                    },
                );
                return;
            }
            FinStatus::Ok if len == msg_len => Ok(msg_len as usize),
            FinStatus::Ok => Err(Error::ConnFailed {
                conn,
                cause: ConnFault::misbehaved(format!(
                    "the peer says it took {len} bytes of a {msg_len}-byte message"
                )),
            }),
            FinStatus::TooLarge => Err(Error::MessageTooLarge {
                len: msg_len,
                posted: len,
            }),
            FinStatus::Failed => Err(Error::ConnFailed {
                conn,
                cause: ConnFault::refused(format!("the receiver did not take message {seq}")),
            }),
        };
        // Its offer, if one came, will not be used.
        c.offers.remove(&seq);
        self.ended.insert(sent.id, r);
    }
}

/// An engine message as a notification payload.
pub(super) fn ctl(msg: CtlMsg) -> Vec<u8> {
    msg.encode_after(NOTE_CTL)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::test_region;

    fn said(st: &mut State) -> Vec<String> {
        st.outbox
            .drain(..)
            .map(|(_, m)| format!("{:?}", CtlMsg::decode(&m[1..]).unwrap()))
            .collect()
    }

    /// Eager messages that come before their receive are held within the
    /// per-connection and total bounds, the rest answered `Again`; a held
    /// one ends the receive posted for it; a GPU buffer sends it `Again`.
    #[test]
    fn early_eager_messages_are_held_within_bounds() {
        let mut st = State::default();
        let a = ConnId(1);
        for seq in 0..MAX_HELD_PER_CONN as u64 + 1 {
            assert!(st.take_eager(a, seq, &[seq as u8; 16]).is_none());
        }
        let out = said(&mut st);
        assert_eq!(
            out.len(),
            1,
            "only the one past the bound is answered: {out:?}"
        );
        assert!(out[0].contains("Again") && out[0].contains(&format!("seq: {MAX_HELD_PER_CONN}")));
        assert_eq!(st.held_bytes, 16 * MAX_HELD_PER_CONN);

        // Twice the same number: the second is ignored, nothing said.
        assert!(st.take_eager(a, 3, &[9; 16]).is_none());
        assert!(said(&mut st).is_empty());

        // The total bound: other connections' messages past it go Again.
        let per = MAX_EAGER_BYTES;
        let mut conn = 2;
        while st.held_bytes + per <= MAX_HELD_BYTES {
            assert!(st.take_eager(ConnId(conn), 0, &vec![0; per]).is_none());
            conn += 1;
        }
        assert!(said(&mut st).is_empty());
        assert!(st.take_eager(ConnId(conn), 0, &vec![0; per]).is_none());
        assert!(said(&mut st)[0].contains("Again"));

        // A receive posted for a held message takes it ...
        let mut buf = [0u8; 32];
        let region = test_region(&mut buf);
        let posted = Posted {
            id: 77,
            max: 32,
            rkey: 0,
            dest: Dest::of(RegionSlice::new(&region, 0, 32).unwrap()),
            gpu: None,
        };
        let before = st.held_bytes;
        assert_eq!(st.take_held(a, 3, &posted).unwrap().unwrap(), 16);
        assert_eq!(st.held_bytes, before - 16);
        assert!(said(&mut st)[0].contains("Ok"));
        // SAFETY: the region is `buf`, written above through its pointer.
        assert_eq!(unsafe { std::ptr::read_volatile(region.ptr().add(15)) }, 3);
        // ... a GPU buffer (no `dest`) sends it Again and is posted.
        let gpu = Posted {
            dest: None,
            gpu: Some((std::sync::Weak::new(), 0)),
            ..posted
        };
        assert!(st.take_held(a, 4, &gpu).is_none());
        assert!(said(&mut st)[0].contains("Again"));
        // A dead connection gives its bytes back.
        let before = st.held_bytes;
        st.fail_conn(a, &Error::Shutdown);
        assert_eq!(st.held_bytes, before - 16 * (MAX_HELD_PER_CONN - 2));
    }

    /// A peer that repeats an eager message for a GPU buffer (each one
    /// answered `Again`) while nobody reads our answers grows the outbox
    /// only to its bound.
    #[test]
    fn again_answers_stop_at_the_outbox_bound() {
        let mut st = State::default();
        let a = ConnId(1);
        let c = st.conns.entry(a).or_default();
        c.next_recv = 1;
        c.recvs.insert(
            0,
            Posted {
                id: 5,
                max: 64,
                rkey: 0,
                dest: None,
                gpu: None,
            },
        );
        for _ in 0..2 * MAX_OUTBOX {
            assert!(st.take_eager(a, 0, &[1; 8]).is_none());
        }
        assert_eq!(st.outbox.len(), MAX_OUTBOX);
        assert!(
            st.conns[&a].recvs.contains_key(&0),
            "the receive stays posted"
        );
    }

    /// An eager message longer than the buffer fails the receive and says
    /// the buffer's size; one for a receive that ended is ignored.
    #[test]
    fn an_eager_message_too_long_for_its_buffer_is_refused() {
        let mut st = State::default();
        let a = ConnId(1);
        let mut buf = [0u8; 8];
        let region = test_region(&mut buf);
        let c = st.conns.entry(a).or_default();
        c.next_recv = 1;
        c.offered = 1;
        c.recvs.insert(
            0,
            Posted {
                id: 5,
                max: 8,
                rkey: 42,
                dest: Dest::of(RegionSlice::new(&region, 0, 8).unwrap()),
                gpu: None,
            },
        );
        let ended = st.take_eager(a, 0, &[1; 9]).expect("ends the receive");
        assert_eq!(ended.rkey, 42, "its window is to be revoked");
        assert!(matches!(
            st.ended.remove(&5),
            Some(Err(Error::MessageTooLarge { len: 9, posted: 8 }))
        ));
        let out = said(&mut st);
        assert!(
            out[0].contains("TooLarge") && out[0].contains("len: 8"),
            "{out:?}"
        );
        assert_eq!(st.conns[&a].offered, 0, "its offer was answered");
        assert!(st.take_eager(a, 0, &[1]).is_none());
        assert!(said(&mut st).is_empty() && st.conns[&a].held.is_empty());
    }
}

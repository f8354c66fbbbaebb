//! Two-sided send/recv (the seed's `send`/`recv`): messages matched in
//! order per connection to the buffers the receiver posted.
//!
//! The receiver offers (`wire::msg`): `recv` grants the peer a write
//! window over the buffer and sends `Cts{seq}`, numbered in posting order;
//! `send` takes the next number on the sender's side. When a send and the
//! offer of its number are both there, the sender checks the length
//! against the buffer (longer: both sides fail with `MessageTooLarge`,
//! nothing moves), WRITEs the bytes (one-sided, bounds-checked by the
//! receiver's shard like any WRITE) with `Fin` as the WRITE's
//! notification (its shard sends it once the WRITE ended well; a failed
//! WRITE's `Fin` says so, sent by the next call that makes progress),
//! which ends the receive and revokes its window. So nothing lands
//! where no buffer was posted, and unmatched offers a sender holds are
//! bounded (`MAX_UNMATCHED` per connection; more are refused).
//!
//! Small messages skip the offer (`state::EAGER_WINDOW`, `wire::msg`): a
//! send of at most `MAX_EAGER_BYTES` of host memory (`MAX_EAGER_SAME_HOST`
//! to a same-host peer) goes inside an
//! `Eager` notification at once; the receiver copies it into the buffer
//! posted for its number, or holds it (bounded per connection and in
//! all) until that buffer is posted, and answers `Ack`. The send ends on
//! the `Ack`, or as soon as the receiver's offer for its number shows
//! what the receiver will do with it (a host buffer it fits: it lands
//! unless the connection dies, which fails the receive as a lost `Fin`
//! does; too short: `MessageTooLarge` on both sides). A GPU buffer, or a
//! receiver with no room to hold it, answers `Again`, and the message
//! goes the usual way. A posted host receive holds its buffer until it
//! ends (so a message its sender was told landed does land).
//!
//! Between processes of one host, the receiver's first receive of host
//! memory past the inline bound (or of GPU memory, where configured) on a
//! connection also grants the sender bounce slots (`bounce.rs`,
//! `landing.rs`): a message that fits one and has no offer yet is
//! WRITten into a free slot at once (`Landed` riding on the WRITE) and
//! copied out on match, answered as an eager one, the slot then
//! `Released`. It ends as an eager send does.
//!
//! Progress is made by the calls: posting, `poll_message` and
//! `wait_message` (the WRITEs themselves run on the shards as usual). A
//! blocking `send` thus completes while its receiver only waits in
//! `recv`. The engine's messages travel as notifications of kind
//! `NOTE_CTL`, into an inbox of their own: the application's
//! notifications never see them.

mod bounce;
mod landing;
mod state;

use std::sync::mpsc::Receiver;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use self::landing::Taken;
use self::state::{ctl, Pending, Posted, State, Writing, MAX_OUTBOX, MAX_UNMATCHED};
use super::lanes::Via;
use super::{Endpoint, MemoryRegion};
use crate::error::{ConnFault, ConnId, Error, Result};
use crate::reactor::{Command, Transfer};
use crate::region::RegionSlice;
use crate::wire::{CtlMsg, FinStatus, RemoteBuf};

/// Receives one connection may have posted and not ended, and sends
/// started and not ended: past these a post is refused at the call
/// (`LimitReached`, busy).
pub const MAX_POSTED_MESSAGES: usize = 1 << 16;
/// Connections' entries kept before the first sweep of those that died
/// idle (see `sweep_dead`).
const SWEEP_FLOOR: usize = 64;

/// A send or receive in flight: poll it with [`Endpoint::poll_message`]
/// or [`Endpoint::wait_message`] until it ends (its result is kept until
/// then).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MessageOp(u64);

/// The two-sided state of an endpoint.
/// What peers send that is not an op: notifications and two-sided
/// messages.
pub(super) struct Mail {
    /// The application's notifications, as the shards deliver them.
    pub(super) inbox: Mutex<Receiver<(ConnId, Vec<u8>)>>,
    /// Two-sided send/recv: the engine's own messages and the matching.
    pub(super) messages: Messages,
}

pub(super) struct Messages {
    ctl: Mutex<Receiver<(ConnId, Vec<u8>)>>,
    state: Mutex<State>,
}

impl Messages {
    pub(super) fn new(ctl: Receiver<(ConnId, Vec<u8>)>) -> Messages {
        Messages {
            ctl: Mutex::new(ctl),
            state: Mutex::new(State::default()),
        }
    }
}

/// # Two-sided messages
///
/// `send_async` / `recv_async`, matched in order per connection, then
/// `poll_message` / `wait_message`.
impl Endpoint {
    /// Sends `mr[offset..offset + len]` as one message to the peer on
    /// `conn`, into the next receive buffer posted there (in order per
    /// connection). The bytes must stay unchanged until the send ends
    /// (once they are in the peer's buffer).
    pub fn send_async(
        &self,
        conn: ConnId,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
    ) -> Result<MessageOp> {
        let msg = mr.slice(offset, len)?;
        self.inner.live(conn)?;
        let eager_max = match self.peer(conn) {
            Some(super::Peer::Local { .. }) => state::MAX_EAGER_SAME_HOST,
            _ => crate::wire::MAX_EAGER_BYTES,
        };
        let mut st = self.msg_state();
        let id = st.new_id();
        let c = st.conns.entry(conn).or_default();
        if c.sends.len() + c.writing.len() + c.eager.len() >= MAX_POSTED_MESSAGES {
            return Err(Error::LimitReached {
                limit: "sends under way per connection (MAX_POSTED_MESSAGES)",
                max: MAX_POSTED_MESSAGES,
            });
        }
        let seq = c.next_send;
        c.next_send += 1;
        if c.goes_eagerly(&msg, seq, eager_max) {
            // SAFETY: host memory (`goes_eagerly`), alive while `msg`
            // holds the registration, `msg.len()` bytes from its start.
            let bytes = unsafe { std::slice::from_raw_parts(msg.ptr(), msg.len()) };
            let eager = ctl(CtlMsg::Eager {
                seq,
                payload: bytes,
            });
            let len = msg.len();
            // Its buffer is offered already: it lands there (see
            // `state::ConnMsgs::eager_offer`); the send ends now.
            let ended = c.offers.remove(&seq).is_some();
            let msg = (!ended).then_some(msg);
            c.eager.insert(seq, state::Eager::inline(id, msg));
            if ended {
                st.ended.insert(id, Ok(len));
            }
            st.outbox.push_back((conn, eager));
        } else if let Some((slot, window)) = c.bounce_slot(&msg, seq) {
            let len = msg.len() as u32;
            let landed = CtlMsg::Landed { seq, slot, len }.encode();
            match self.write_from(conn, msg.clone(), &window, &landed) {
                Ok(t) => {
                    c.eager.insert(seq, state::Eager::in_slot(id, msg, slot, t));
                }
                Err(e) => {
                    tracing::debug!(%conn, seq, "a message into a bounce slot did not start: {e}");
                    c.granted.as_mut().expect("a slot taken").release(slot);
                    c.sends.push_back(Pending { id, seq, msg });
                }
            }
        } else {
            c.sends.push_back(Pending { id, seq, msg });
        }
        drop(st);
        self.progress();
        Ok(MessageOp(id))
    }

    /// Posts `mr[offset..offset + max]` (cut to the registration's end and
    /// to 4 GiB − 1) for the next message from the peer on `conn`; ends
    /// with the message's length. A longer message fails this receive and
    /// its send with [`Error::MessageTooLarge`].
    pub fn recv_async(
        &self,
        conn: ConnId,
        mr: &MemoryRegion,
        offset: usize,
        max: usize,
    ) -> Result<MessageOp> {
        let room = mr.len().checked_sub(offset).ok_or(Error::OutOfRange {
            offset,
            len: max,
            region_len: mr.len(),
        })?;
        let max = max.min(room).min(u32::MAX as usize);
        // A WRITE lands there: the destination must be writable here.
        if max > 0 && !mr.inner.access.contains(crate::region::Access::LOCAL_WRITE) {
            return Err(Error::ReadOnlyDestination {
                addr: mr.inner.addr(),
                len: mr.len(),
            });
        }
        // Where the CPU copies an eager message (host memory only), or a
        // GPU copy one out of a bounce slot.
        let dest = state::Dest::of(mr.slice(offset, max)?);
        let gpu = (max > 0 && mr.inner.mem.is_device())
            .then(|| (std::sync::Arc::downgrade(&mr.inner), offset));
        let window = if max == 0 {
            self.inner.live(conn)?;
            RemoteBuf::default()
        } else {
            self.advertise(conn, mr, offset, max)?
        };
        let mut st = self.msg_state();
        let id = st.new_id();
        let c = st.conns.entry(conn).or_default();
        if c.recvs.len() >= MAX_POSTED_MESSAGES {
            drop(st);
            if window.rkey != 0 {
                self.inner.forget_region(window.rkey);
            }
            return Err(Error::LimitReached {
                limit: "receives posted per connection (MAX_POSTED_MESSAGES)",
                max: MAX_POSTED_MESSAGES,
            });
        }
        let seq = c.next_recv;
        c.next_recv += 1;
        let posted = Posted {
            id,
            max: max as u64,
            rkey: window.rkey,
            dest,
            gpu,
        };
        self.grant_bounce(&mut st, conn, mr, max);
        // Its message may be here already (sent eagerly, or into a slot).
        let mut ended = st.take_held(conn, seq, &posted).map(Taken::Ended);
        let landed = (st.conns.get_mut(&conn))
            .and_then(|c| c.bounce.as_mut())
            .and_then(|b| b.held.remove(&seq));
        match (&ended, landed) {
            (None, Some(l)) => ended = Some(self.take_landing(&mut st, conn, seq, &posted, l)),
            // The same number sent both ways (a peer's fault): the slot is
            // freed, the message inline taken.
            (Some(_), Some(l)) => landing::release(&mut st, conn, l.slot),
            _ => {}
        }
        if let Some(Taken::Ended(_) | Taken::Copying) = ended {
            if let Some(Taken::Ended(r)) = ended {
                st.ended.insert(id, r);
            }
            flush_outbox(&mut st, self);
            drop(st);
            if window.rkey != 0 {
                self.inner.forget_region(window.rkey);
            }
            return Ok(MessageOp(id));
        }
        let c = st.conns.get_mut(&conn).expect("entered above");
        c.recvs.insert(seq, posted);
        c.unoffered.push_back((seq, window));
        st.offer_next(conn);
        drop(st);
        self.progress();
        Ok(MessageOp(id))
    }

    /// `None` while `op` runs; once it ended, its result (the message's
    /// length, on both sides), given once.
    pub fn poll_message(&self, op: MessageOp) -> Option<Result<usize>> {
        self.progress();
        self.msg_state().ended.remove(&op.0)
    }

    /// Waits up to `timeout` for `op` to end (spinning, then sleeping in
    /// short steps); a timeout leaves it running. Needs shards that run:
    /// managed ones, or embedded ones another thread polls.
    pub fn wait_message(&self, op: MessageOp, timeout: Duration) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        let mut spins = 0u32;
        loop {
            if let Some(r) = self.poll_message(op) {
                return r;
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: "a message",
                    timeout_ms: timeout.as_millis() as u64,
                });
            }
            spins += 1;
            if spins < 2000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// The matching state, locked.
    fn msg_state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.mail.messages.state.lock().expect("lock")
    }

    /// One step of every connection's two-sided work: take the engine's
    /// messages that arrived, start the WRITEs whose message and buffer
    /// are both there, end those that finished, fail what a dead
    /// connection held, and queue what is to be said.
    fn progress(&self) {
        let arrived: Vec<(ConnId, Vec<u8>)> = {
            let rx = self.inner.mail.messages.ctl.lock().expect("lock");
            std::iter::from_fn(|| rx.try_recv().ok())
                .take(256)
                .collect()
        };
        let mut st = self.msg_state();
        for (conn, bytes) in arrived {
            self.take_ctl(&mut st, conn, &bytes);
        }
        if !st.copying.is_empty() {
            self.end_copies(&mut st);
        }
        let conns: Vec<ConnId> = st
            .conns
            .iter()
            .filter(|(_, c)| c.pending() || !c.offers.is_empty())
            .map(|(k, _)| *k)
            .collect();
        for conn in conns {
            if let Err(e) = self.conn_status(conn) {
                st.fail_conn(conn, &e);
                continue;
            }
            self.match_and_write(&mut st, conn);
        }
        self.sweep_dead(&mut st);
        flush_outbox(&mut st, self);
    }

    /// Drops the entries of connections that died with nothing under way
    /// (only their sequence numbers were left; an id is never reused), so
    /// connections that come, exchange a message and go do not grow the
    /// map. Those with work under way failed above. Once the map has
    /// doubled since the last sweep: amortized O(1) per call.
    fn sweep_dead(&self, st: &mut State) {
        if st.conns.len() <= SWEEP_FLOOR.max(2 * st.swept_len) {
            return;
        }
        self.inner.reap_closed();
        let live = self.inner.conns.live.lock().expect("lock");
        st.conns
            .retain(|k, c| c.pending() || !c.offers.is_empty() || live.contains_key(k));
        drop(live);
        st.swept_len = st.conns.len();
    }

    /// Two-sided messages sent into peers' bounce slots and taken out of
    /// ours (`Metrics::bounced_out`, `bounced_in`).
    pub(super) fn bounced(&self) -> (u64, u64) {
        let st = self.msg_state();
        (st.bounced_out, st.bounced_in)
    }

    /// Connections with two-sided message state (like `conn_count`: those
    /// that ended idle are swept as the map grows, so this stays near the
    /// open connections plus those with messages under way).
    pub fn message_conns(&self) -> usize {
        self.msg_state().conns.len()
    }

    /// One of the engine's messages from the peer on `conn`.
    fn take_ctl(&self, st: &mut State, conn: ConnId, bytes: &[u8]) {
        let msg = match CtlMsg::decode(bytes) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(%conn, "a two-sided message that does not decode: {e}");
                return;
            }
        };
        match msg {
            CtlMsg::Cts { seq, window } => {
                let c = st.conns.entry(conn).or_default();
                let eager = c.eager.get(&seq).is_some_and(|e| !e.ended());
                if eager {
                    if let Some((id, r)) = c.eager_offer(seq, &window) {
                        st.ended.insert(id, r);
                    }
                } else if seq < c.first_unmatched() || c.offers.contains_key(&seq) {
                    tracing::warn!(%conn, seq, "a receive buffer offered twice: ignored");
                } else if c.offers.len() >= MAX_UNMATCHED {
                    // Refused: its receiver learns it, we hold nothing.
                    let fin = CtlMsg::Fin {
                        seq,
                        status: FinStatus::Failed,
                        len: 0,
                    };
                    if st.outbox.len() < MAX_OUTBOX {
                        st.outbox.push_back((conn, ctl(fin)));
                    } else {
                        tracing::warn!(%conn, seq, "an offer past the bound, unanswered: the peer is not reading");
                    }
                } else {
                    c.offers.insert(seq, window);
                }
            }
            CtlMsg::Fin { seq, status, len } => {
                let Some(posted) = st.conns.get_mut(&conn).and_then(|c| c.recvs.remove(&seq))
                else {
                    tracing::warn!(%conn, seq, "an answer for no receive of ours: ignored");
                    return;
                };
                // Its offer is answered: the next receive may be offered.
                let ended = st.end_posted(conn, seq, &posted);
                if ended.rkey != 0 {
                    self.inner.forget_region(ended.rkey);
                }
                let r = match status {
                    FinStatus::Ok if len <= posted.max => {
                        // RDMA WRITEs into GPU memory: visible to GPU work
                        // launched after this, as after a notification.
                        self.inner.flush_for_notification(conn);
                        Ok(len as usize)
                    }
                    FinStatus::Ok => Err(Error::ConnFailed {
                        conn,
                        cause: ConnFault::misbehaved(format!(
                            "the peer says it sent {len} bytes into a {}-byte buffer",
                            posted.max
                        )),
                    }),
                    FinStatus::TooLarge => Err(Error::MessageTooLarge {
                        len,
                        posted: posted.max,
                    }),
                    FinStatus::Failed | FinStatus::Again => Err(Error::ConnFailed {
                        conn,
                        cause: ConnFault::refused(format!(
                            "the sender could not fill receive buffer {seq}"
                        )),
                    }),
                };
                st.ended.insert(posted.id, r);
            }
            CtlMsg::Eager { seq, payload } => {
                if let Some(ended) = st.take_eager(conn, seq, payload) {
                    if ended.rkey != 0 {
                        self.inner.forget_region(ended.rkey);
                    }
                }
            }
            CtlMsg::Ack { seq, status, len } => st.take_ack(conn, seq, status, len),
            CtlMsg::Grant {
                slots,
                slot_bytes,
                window,
            } => self.take_grant(st, conn, (slots, slot_bytes), &window),
            CtlMsg::Landed { seq, slot, len } => self.take_landed(st, conn, seq, slot, len),
            CtlMsg::Released { slot } => {
                let c = st.conns.entry(conn).or_default();
                if !c.granted.as_mut().is_some_and(|g| g.release(slot)) {
                    tracing::warn!(%conn, slot, "a bounce slot released that was not written: ignored");
                }
            }
        }
    }

    /// Receiver: message `seq` landed in bounce slot `slot`: into the
    /// receive posted for it, held until that is posted, or (a claim that
    /// does not fit the grant, a number already taken) ignored.
    fn take_landed(&self, st: &mut State, conn: ConnId, seq: u64, slot: u16, len: u32) {
        let c = st.conns.entry(conn).or_default();
        let Some(b) = c.bounce.as_mut() else {
            tracing::warn!(%conn, seq, "a message in a bounce slot never granted: ignored");
            return;
        };
        let l = match b.slots.land(slot, len) {
            Ok(l) => l,
            Err(why) => {
                tracing::warn!(%conn, seq, "a bounce landing that does not fit: {why}; ignored");
                return;
            }
        };
        if let Some(posted) = c.recvs.remove(&seq) {
            match self.take_landing(st, conn, seq, &posted, l) {
                Taken::Again => {
                    let c = st.conns.get_mut(&conn).expect("entered above");
                    c.recvs.insert(seq, posted);
                }
                taken => {
                    if let Taken::Ended(r) = taken {
                        st.ended.insert(posted.id, r);
                    }
                    let ended = st.end_posted(conn, seq, &posted);
                    if ended.rkey != 0 {
                        self.inner.forget_region(ended.rkey);
                    }
                }
            }
        } else if seq < c.next_recv || b.held.contains_key(&seq) {
            tracing::warn!(%conn, seq, "a message in a bounce slot for a receive that ended, or twice: ignored");
            landing::release(st, conn, slot);
        } else {
            b.held.insert(seq, l);
        }
    }

    /// Starts the WRITE of every send whose buffer was offered, and ends
    /// those whose WRITE finished.
    fn match_and_write(&self, st: &mut State, conn: ConnId) {
        let State {
            conns,
            ended,
            outbox,
            ..
        } = st;
        let Some(c) = conns.get_mut(&conn) else {
            return;
        };
        c.end_bounce_writes(ended);
        while let Some(p) = c.sends.front() {
            let Some(window) = c.offers.remove(&p.seq) else {
                break;
            };
            let p = c.sends.pop_front().expect("front");
            let (len, max) = (p.msg.len() as u64, window.size as u64);
            let fin = |status| {
                (
                    conn,
                    ctl(CtlMsg::Fin {
                        seq: p.seq,
                        status,
                        len,
                    }),
                )
            };
            if len > max {
                ended.insert(p.id, Err(Error::MessageTooLarge { len, posted: max }));
                outbox.push_back(fin(FinStatus::TooLarge));
            } else if len == 0 {
                ended.insert(p.id, Ok(0));
                outbox.push_back(fin(FinStatus::Ok));
            } else {
                // `Fin` rides with the WRITE: its shard sends it the moment
                // the WRITE ended well, without waiting for this thread.
                let fin_ok = CtlMsg::Fin {
                    seq: p.seq,
                    status: FinStatus::Ok,
                    len,
                }
                .encode();
                match self.write_from(conn, p.msg, &window, &fin_ok) {
                    Ok(t) => c.writing.push(Writing {
                        id: p.id,
                        seq: p.seq,
                        len,
                        t,
                    }),
                    Err(e) => {
                        ended.insert(p.id, Err(e));
                        outbox.push_back(fin(FinStatus::Failed));
                    }
                }
            }
        }
        let mut i = 0;
        while i < c.writing.len() {
            let Some(r) = c.writing[i].t.poll() else {
                i += 1;
                continue;
            };
            let done = c.writing.swap_remove(i);
            // Ended well: its shard sent `Fin` (Ok) with it. Else the
            // receiver learns it here.
            if r.is_err() {
                let fin = CtlMsg::Fin {
                    seq: done.seq,
                    status: FinStatus::Failed,
                    len: done.len,
                };
                outbox.push_back((conn, ctl(fin)));
            }
            ended.insert(done.id, r.map(|()| done.len as usize));
        }
    }

    /// WRITEs `msg` into the start of `window`; `fin` (an encoded
    /// `CtlMsg`) goes to the peer once it ended well.
    fn write_from(
        &self,
        conn: ConnId,
        msg: RegionSlice,
        window: &RemoteBuf,
        fin: &[u8],
    ) -> Result<Transfer> {
        let same_host = || matches!(self.peer(conn), Some(super::Peer::Local { .. }));
        let d = super::ops::desc_of(msg, window, &same_host)?;
        let parts = crate::reactor::OpParts::One(d);
        let mut via = Via::now().noting_engine(fin);
        self.inner
            .submit(conn, crate::error::OpKind::Write, parts, &mut via)
    }
}

/// Queues what is to be said, in order, until a shard's queue is full.
fn flush_outbox(st: &mut State, ep: &Endpoint) {
    while let Some((conn, msg)) = st.outbox.pop_front() {
        let Some((lane, shard)) = ep.inner.lanes(conn).next() else {
            continue;
        };
        let cmd = Command::Notify {
            conn: lane,
            payload: msg,
            ticket: None,
        };
        match shard.submit(cmd) {
            Ok(()) => {}
            Err((Error::QueueFull { .. }, Command::Notify { payload, .. })) => {
                st.outbox.push_front((conn, payload));
                return;
            }
            // Shut down: nothing will be said again.
            Err(_) => {}
        }
    }
}

//! Two-sided send/recv (the seed's `send`/`recv`): messages matched in
//! order per connection to the buffers the receiver posted.
//!
//! The receiver pulls (`wire::msg`): `send` grants the peer a read window
//! over the message and sends `Rts{seq}`; the receiver's `recv` posts a
//! buffer that takes the next sequence number; when both are there, the
//! receiver checks the length against its buffer (longer: both sides fail
//! with `MessageTooLarge`), READs the bytes (one-sided, bounds-checked by
//! the sender's shard like any READ) and answers `Fin`, which ends the send
//! and revokes its window. So the receiver never holds bytes it posted no
//! buffer for, and unmatched announcements are bounded (`MAX_UNMATCHED`
//! per connection; more fail at the sender).
//!
//! Progress is made by the calls: posting, `poll_message` and
//! `wait_message` (the READs themselves run on the shards as usual). The
//! engine's messages travel as notifications of kind `NOTE_CTL`, into an
//! inbox of their own: the application's notifications never see them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::mpsc::Receiver;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::lanes::Via;
use super::{Endpoint, MemoryRegion};
use crate::error::{ConnId, Error, Result};
use crate::reactor::{Command, Transfer};
use crate::region::RegionSlice;
use crate::wire::{CtlMsg, FinStatus, RemoteBuf, NOTE_CTL};

/// Announced messages a connection may have waiting for a posted receive.
pub(super) const MAX_UNMATCHED: usize = 1024;

/// A send or receive in flight: poll it with [`Endpoint::poll_message`]
/// or [`Endpoint::wait_message`] until it ends (its result is kept until
/// then).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MessageOp(u64);

/// The two-sided state of an endpoint.
pub(super) struct Messages {
    ctl: Mutex<Receiver<(ConnId, Vec<u8>)>>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    conns: HashMap<ConnId, ConnMsgs>,
    /// Ended ops' results, until polled.
    ended: HashMap<u64, Result<usize>>,
    /// Messages for peers not yet queued (their shard's queue was full).
    outbox: VecDeque<(ConnId, Vec<u8>)>,
}

#[derive(Default)]
struct ConnMsgs {
    next_send: u64,
    next_recv: u64,
    /// Sends awaiting the receiver's `Fin`, by sequence number.
    sends: HashMap<u64, Send>,
    /// Posted receives not yet matched, in posting order.
    recvs: VecDeque<Posted>,
    /// Announced messages not yet matched, by sequence number.
    arrived: BTreeMap<u64, (u64, RemoteBuf)>,
    /// Receives whose READ runs.
    reading: Vec<Reading>,
}

struct Send {
    id: u64,
    len: u64,
    /// The window's key, revoked once the receiver is done (0: none).
    rkey: u32,
}

struct Posted {
    id: u64,
    seq: u64,
    /// The whole buffer posted (it holds the registration).
    buf: RegionSlice,
    max: u64,
}

struct Reading {
    id: u64,
    seq: u64,
    len: u64,
    t: Transfer,
}

impl ConnMsgs {
    fn pending(&self) -> bool {
        !self.sends.is_empty() || !self.recvs.is_empty() || !self.reading.is_empty()
    }
}

impl Messages {
    pub(super) fn new(ctl: Receiver<(ConnId, Vec<u8>)>) -> Messages {
        Messages {
            ctl: Mutex::new(ctl),
            state: Mutex::new(State::default()),
        }
    }
}

impl Endpoint {
    /// Sends `mr[offset..offset + len]` as one message to the peer on
    /// `conn`, where it fills the next receive buffer posted there (in
    /// order per connection). The bytes must stay unchanged until the
    /// send ends; the receiver reads them from here.
    pub fn send_async(
        &self,
        conn: ConnId,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
    ) -> Result<MessageOp> {
        let window = if len == 0 {
            mr.slice(offset, 0)?;
            if !self.inner.conns.lock().expect("lock").contains_key(&conn) {
                return Err(Error::UnknownConn { conn });
            }
            RemoteBuf::default()
        } else {
            self.advertise(conn, mr, offset, len)?
        };
        let mut st = self.inner.messages.state.lock().expect("lock");
        let id = st.new_id();
        let c = st.conns.entry(conn).or_default();
        let seq = c.next_send;
        c.next_send += 1;
        c.sends.insert(
            seq,
            Send {
                id,
                len: len as u64,
                rkey: window.rkey,
            },
        );
        let len = len as u64;
        st.outbox
            .push_back((conn, ctl(CtlMsg::Rts { seq, len, window })));
        drop(st);
        self.progress();
        Ok(MessageOp(id))
    }

    /// Posts `mr[offset..offset + max]` (cut to the registration's end)
    /// for the next message from the peer on `conn`; ends with the
    /// message's length. A longer message fails this receive and its send
    /// with [`Error::MessageTooLarge`].
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
        let max = max.min(room);
        let buf = mr.slice(offset, max)?;
        // A READ lands there: the destination must be writable here.
        if max > 0 && !mr.inner.access.contains(crate::region::Access::LOCAL_WRITE) {
            return Err(Error::ReadOnlyDestination {
                addr: mr.inner.addr(),
                len: mr.len(),
            });
        }
        if !self.inner.conns.lock().expect("lock").contains_key(&conn) {
            return Err(Error::UnknownConn { conn });
        }
        let mut st = self.inner.messages.state.lock().expect("lock");
        let id = st.new_id();
        let c = st.conns.entry(conn).or_default();
        let seq = c.next_recv;
        c.next_recv += 1;
        c.recvs.push_back(Posted {
            id,
            seq,
            buf,
            max: max as u64,
        });
        drop(st);
        self.progress();
        Ok(MessageOp(id))
    }

    /// `None` while `op` runs; once it ended, its result (a receive: the
    /// message's length; a send: its length), given once.
    pub fn poll_message(&self, op: MessageOp) -> Option<Result<usize>> {
        self.progress();
        self.inner
            .messages
            .state
            .lock()
            .expect("lock")
            .ended
            .remove(&op.0)
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

    /// One step of every connection's two-sided work: take the engine's
    /// messages that arrived, start the READs whose buffer and message
    /// are both there, end those that finished, fail what a dead
    /// connection held, and queue what is to be said.
    fn progress(&self) {
        let arrived: Vec<(ConnId, Vec<u8>)> = {
            let rx = self.inner.messages.ctl.lock().expect("lock");
            std::iter::from_fn(|| rx.try_recv().ok())
                .take(256)
                .collect()
        };
        let mut st = self.inner.messages.state.lock().expect("lock");
        for (conn, bytes) in arrived {
            self.take_ctl(&mut st, conn, &bytes);
        }
        let conns: Vec<ConnId> = st
            .conns
            .iter()
            .filter(|(_, c)| c.pending() || !c.arrived.is_empty())
            .map(|(k, _)| *k)
            .collect();
        for conn in conns {
            if self.peer(conn).is_none() {
                st.fail_conn(conn);
                continue;
            }
            self.match_and_read(&mut st, conn);
        }
        st.flush_outbox(self);
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
            CtlMsg::Rts { seq, len, window } => {
                let c = st.conns.entry(conn).or_default();
                let taken = c.recvs.front().map_or(c.next_recv, |p| p.seq);
                if seq < taken || c.arrived.contains_key(&seq) {
                    tracing::warn!(%conn, seq, "a message announced twice: ignored");
                } else if c.arrived.len() >= MAX_UNMATCHED {
                    // Refused: its sender learns it, we hold nothing.
                    let fin = CtlMsg::Fin {
                        seq,
                        status: FinStatus::Failed,
                        posted: 0,
                    };
                    st.outbox.push_back((conn, ctl(fin)));
                } else {
                    c.arrived.insert(seq, (len, window));
                }
            }
            CtlMsg::Fin {
                seq,
                status,
                posted,
            } => {
                let Some(send) = st.conns.get_mut(&conn).and_then(|c| c.sends.remove(&seq)) else {
                    tracing::warn!(%conn, seq, "an answer for no message of ours: ignored");
                    return;
                };
                if send.rkey != 0 {
                    self.inner.forget_region(send.rkey);
                }
                let r = match status {
                    FinStatus::Ok => Ok(send.len as usize),
                    FinStatus::TooLarge => Err(Error::MessageTooLarge {
                        len: send.len,
                        posted,
                    }),
                    FinStatus::Failed => Err(Error::ConnFailed {
                        conn,
                        reason: format!("the receiver could not take message {seq}"),
                    }),
                };
                st.ended.insert(send.id, r);
            }
        }
    }

    /// READs the first `len` bytes of `window` into the start of `buf`.
    fn read_into(
        &self,
        conn: ConnId,
        buf: &RegionSlice,
        len: usize,
        window: &RemoteBuf,
    ) -> Result<Transfer> {
        let local = buf.sub(0, len).expect("len checked against the buffer");
        let same_host = || matches!(self.peer(conn), Some(super::Peer::Local { .. }));
        let d = super::desc_of(local, window, &same_host)?;
        let parts = crate::reactor::OpParts::One(d);
        self.inner
            .submit(conn, crate::error::OpKind::Read, parts, &mut Via::now())
    }

    /// Starts the READ of every posted receive whose message arrived, and
    /// ends those whose READ finished.
    fn match_and_read(&self, st: &mut State, conn: ConnId) {
        let State {
            conns,
            ended,
            outbox,
            ..
        } = st;
        let Some(c) = conns.get_mut(&conn) else {
            return;
        };
        while let Some(p) = c.recvs.front() {
            let Some((len, window)) = c.arrived.remove(&p.seq) else {
                break;
            };
            let p = c.recvs.pop_front().expect("front");
            let fin = |status, posted| {
                (
                    conn,
                    ctl(CtlMsg::Fin {
                        seq: p.seq,
                        status,
                        posted,
                    }),
                )
            };
            if len > p.max {
                ended.insert(p.id, Err(Error::MessageTooLarge { len, posted: p.max }));
                outbox.push_back(fin(FinStatus::TooLarge, p.max));
            } else if len == 0 {
                ended.insert(p.id, Ok(0));
                outbox.push_back(fin(FinStatus::Ok, p.max));
            } else {
                match self.read_into(conn, &p.buf, len as usize, &window) {
                    Ok(t) => c.reading.push(Reading {
                        id: p.id,
                        seq: p.seq,
                        len,
                        t,
                    }),
                    Err(e) => {
                        ended.insert(p.id, Err(e));
                        outbox.push_back(fin(FinStatus::Failed, p.max));
                    }
                }
            }
        }
        let mut i = 0;
        while i < c.reading.len() {
            let Some(r) = c.reading[i].t.poll() else {
                i += 1;
                continue;
            };
            let done = c.reading.swap_remove(i);
            let status = if r.is_ok() {
                FinStatus::Ok
            } else {
                FinStatus::Failed
            };
            ended.insert(done.id, r.map(|()| done.len as usize));
            let fin = CtlMsg::Fin {
                seq: done.seq,
                status,
                posted: done.len,
            };
            outbox.push_back((conn, ctl(fin)));
        }
    }
}

impl State {
    fn new_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// `conn` is gone: everything it held fails.
    fn fail_conn(&mut self, conn: ConnId) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        let ids = (c.sends.values().map(|s| s.id))
            .chain(c.recvs.iter().map(|p| p.id))
            .chain(c.reading.iter().map(|r| r.id));
        for id in ids {
            self.ended.insert(id, Err(Error::UnknownConn { conn }));
        }
        self.outbox.retain(|(to, _)| *to != conn);
    }

    /// Queues what is to be said, in order, until a shard's queue is full.
    fn flush_outbox(&mut self, ep: &Endpoint) {
        while let Some((conn, msg)) = self.outbox.pop_front() {
            let Some((lane, shard)) = ep.inner.lanes(conn).next() else {
                continue;
            };
            let cmd = Command::Notify {
                conn: lane,
                payload: msg,
            };
            match shard.submit(cmd) {
                Ok(()) => {}
                Err((Error::QueueFull { .. }, Command::Notify { payload, .. })) => {
                    self.outbox.push_front((conn, payload));
                    return;
                }
                // Shut down: nothing will be said again.
                Err(_) => {}
            }
        }
    }
}

/// An engine message as a notification payload.
fn ctl(msg: CtlMsg) -> Vec<u8> {
    let mut out = vec![NOTE_CTL];
    out.extend_from_slice(&msg.encode());
    out
}

//! `Pair`: two tcp protocol engines — one connection of N streams, both
//! sides initiating — over a simulated link, in virtual time, in one
//! thread, deterministic from a seed. No sockets: the engines are the real
//! `StreamProto`s and the target side checks every request against a real
//! `RegionTable`; only the kernel's byte pipes are simulated.
//!
//! The link can fragment writes and reads, delay each stream by its own
//! amount (so streams overtake each other), stop one side reading, cut a
//! stream after some bytes (truncation), reset the whole connection, and
//! corrupt frame headers in flight (a hostile relay). The harness checks
//! that every operation ends exactly once, byte-exact when it succeeds or
//! with an error when it does not, that nothing hangs (an iteration cap),
//! that queues stay within their bounds, and that no request is left
//! pending when the dust settles.
//!
//! A seed that once failed becomes a case in the tests below.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::conn::{deal, Dealt, FramePart};
use super::proto::{Integrity, Step, StreamLimits, StreamProto, NOTIFY_QUEUE};
use crate::auth::{Direction, FrameKey};
use crate::error::{ConnFault, ConnId, Error, OpKind, Result};
use crate::region::{Grant, KeyRef, Region, RegionSlice, RegionTable};
use crate::wire::testrng::Rng;
use crate::wire::DATA_HEADER_LEN;
use crate::xfer::testing::{self, bytes_of, RecSink, View};
use crate::xfer::Progress;

const HDR: usize = DATA_HEADER_LEN;
const RKEY: u32 = 0x5151;
const TAG: u64 = 0x7a67_7a67_0000_0001;

/// An operation one side started, as its application sees it.
struct OpRec {
    kind: OpKind,
    /// Frames not yet ended.
    left: usize,
    result: Option<Result<()>>,
    ended: bool,
    local_off: usize,
    remote_off: usize,
    len: usize,
    seed: u8,
    /// Its one part, and how far the dealer got with it.
    part: Part,
    at: Progress,
}

/// An op's one part: our bytes and the peer's address for them.
#[derive(Clone)]
struct Part {
    local: RegionSlice,
    remote_addr: u64,
}

impl FramePart for Part {
    fn local(&self) -> &RegionSlice {
        &self.local
    }

    fn key(&self) -> KeyRef {
        KeyRef {
            rkey: RKEY,
            tag: TAG,
        }
    }

    fn remote_addr(&self) -> u64 {
        self.remote_addr
    }
}

struct Side {
    conn: ConnId,
    streams: Vec<StreamProto>,
    table: RegionTable,
    mem: Arc<Region>,
    done: Vec<(u32, Result<()>)>,
    inbox: VecDeque<Vec<u8>>,
    delivered: Vec<Vec<u8>>,
    notes_sent: Vec<Vec<u8>>,
    notes_queued: VecDeque<Vec<u8>>,
    dead: Option<ConnFault>,
    ops: Vec<OpRec>,
    /// Ops not wholly dealt yet, oldest first, and the stream the dealer
    /// goes to next.
    undealt: VecDeque<u32>,
    next: usize,
    next_local: usize,
    next_remote: usize,
}

fn owned_region(len: usize) -> Arc<Region> {
    testing::owned_region(len, RKEY, TAG)
}

fn pattern(i: usize, seed: u8) -> u8 {
    ((i as u64)
        .wrapping_add(1)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        >> 56) as u8
        ^ seed
}

fn fill(r: &Region, off: usize, len: usize, seed: u8) {
    assert!(off + len <= r.len());
    for i in 0..len {
        // SAFETY: in bounds of a live owned region (checked above).
        unsafe { *r.ptr().add(off + i) = pattern(i, seed) };
    }
}

/// The outcome of a run, for the tests' extra checks.
pub(crate) struct Report {
    pub ok: usize,
    pub failed: usize,
    pub errors: Vec<String>,
    pub notes_delivered: usize,
    pub died: [Option<ConnFault>; 2],
    pub end_us: u64,
}

pub(crate) struct Pair {
    sides: [Side; 2],
    /// pipes[dir][stream]; dir 0 carries a→b.
    pipes: [Vec<Pipe>; 2],
    rng: Rng,
    faults: Faults,
    now_us: u64,
    base: Instant,
    limits: StreamLimits,
    chunk: usize,
    op_timeout_us: u64,
}

const MEM: usize = 8 << 20;
const HALF: usize = MEM / 2;

impl Pair {
    pub fn new(seed: u64, n_streams: usize, faults: Faults) -> Pair {
        let mut rng = Rng(seed | 1);
        let limits = StreamLimits {
            own_max: 8,
            peer_max: 8,
            codec: false,
        };
        // Both sides' keys as a handshake would derive them (side 0 is the
        // client), one pair per stream.
        let macs = |client: bool| -> Vec<Option<Integrity>> {
            (0..n_streams as u64)
                .map(|i| {
                    let full = faults.integrity?;
                    let k = |dir| FrameKey::derive(b"pair secret", dir, 10 + i, 20 + i, 1, 2);
                    let (c2s, s2c) = (k(Direction::ClientToServer), k(Direction::ServerToClient));
                    let (tx, rx) = if client { (c2s, s2c) } else { (s2c, c2s) };
                    Some(Integrity { tx, rx, full })
                })
                .collect()
        };
        let side = |id: u64| {
            let mem = owned_region(MEM);
            let mut table = RegionTable::default();
            table.insert(RKEY, Grant::whole(&mem));
            Side {
                conn: ConnId(id),
                streams: macs(id == 1)
                    .into_iter()
                    .enumerate()
                    .map(|(i, mac)| StreamProto::new(limits, i as u8, mac))
                    .collect(),
                table,
                mem,
                done: Vec::new(),
                inbox: VecDeque::new(),
                delivered: Vec::new(),
                notes_sent: Vec::new(),
                notes_queued: VecDeque::new(),
                dead: None,
                ops: Vec::new(),
                undealt: VecDeque::new(),
                next: 0,
                next_local: 0,
                next_remote: 0,
            }
        };
        let mut pipes: [Vec<Pipe>; 2] = [Vec::new(), Vec::new()];
        for (dir, p) in pipes.iter_mut().enumerate() {
            for s in 0..n_streams {
                let cut_after = match faults.cut {
                    Some((d, st, n)) if d == dir && st == s => Some(n),
                    _ => None,
                };
                let stall_after = match faults.stall {
                    Some((d, st, n)) if d == dir && st == s => Some(n),
                    _ => None,
                };
                let corrupt = match faults.corrupt {
                    Some((d, nth, how)) if d == dir && s == 0 => Some((nth, how)),
                    _ => None,
                };
                p.push(Pipe {
                    bytes: VecDeque::new(),
                    cap: 64 << 10,
                    delay_us: if faults.delay_us > 0 {
                        rng.below(faults.delay_us + 1)
                    } else {
                        0
                    },
                    accepted: 0,
                    cut_after,
                    delivered: 0,
                    stall_after,
                    closed: false,
                    relay: Relay {
                        hdr: Vec::new(),
                        payload_left: 0,
                        headers_seen: 0,
                        corrupt,
                        integrity: faults.integrity,
                        flip_next_payload: false,
                    },
                });
            }
        }
        Pair {
            sides: [side(1), side(2)],
            pipes,
            rng,
            faults,
            now_us: 0,
            base: Instant::now(),
            limits,
            chunk: 16 << 10,
            op_timeout_us: 200_000,
        }
    }

    fn now(&self) -> Instant {
        self.base + Duration::from_micros(self.now_us)
    }

    /// Side `s` starts an operation of `len` bytes on its peer's memory.
    pub fn start_op(&mut self, s: usize, kind: OpKind, len: usize) {
        let seed = self.rng.next() as u8;
        let peer_base = self.sides[1 - s].mem.addr();
        let peer = &self.sides[1 - s];
        let side = &self.sides[s];
        let local_off = side.next_local;
        let remote_off = HALF + side.next_remote;
        assert!(
            local_off + len <= HALF && remote_off + len <= MEM,
            "harness memory"
        );
        match kind {
            OpKind::Write => fill(&side.mem, local_off, len, seed),
            OpKind::Read => fill(&peer.mem, remote_off, len, seed),
        }
        let side = &mut self.sides[s];
        // Each op gets its own ranges, 8-byte aligned plus a random skew.
        let skew = (self.rng.below(8)) as usize;
        side.next_local += len + skew;
        side.next_remote += len + skew;
        let slot = side.ops.len() as u32;
        let frames = len.div_ceil(self.chunk).max(1);
        let part = Part {
            local: RegionSlice::new(&side.mem, local_off, len).expect("fits"),
            remote_addr: peer_base + remote_off as u64,
        };
        side.undealt.push_back(slot);
        side.ops.push(OpRec {
            part,
            at: Progress::default(),
            kind,
            left: frames,
            result: None,
            ended: false,
            local_off,
            remote_off,
            len,
            seed,
        });
    }

    /// Side `s` sends a notification.
    pub fn notify(&mut self, s: usize, payload: Vec<u8>) {
        self.sides[s].notes_queued.push_back(payload);
    }

    /// Queues what fits, with the tcp side's own dealer (`conn::deal`).
    fn submit(&mut self, s: usize) {
        let now = self.now();
        let chunk = self.chunk;
        let side = &mut self.sides[s];
        if side.dead.is_some() {
            return;
        }
        while let Some(&slot) = side.undealt.front() {
            let op = &mut side.ops[slot as usize];
            let parts = std::slice::from_ref(&op.part);
            let dealt = deal(
                &mut side.streams,
                &mut side.next,
                (op.kind, slot),
                parts,
                &mut op.at,
                (chunk, now),
                |_, _| unreachable!("the pair moves host memory only"),
            );
            if dealt != Dealt::All {
                break;
            }
            side.undealt.pop_front();
        }
        let side = &mut self.sides[s];
        while let Some(n) = side.notes_queued.front() {
            let st = &mut side.streams[0];
            if !st.can_notify() {
                break;
            }
            let n = n.clone();
            st.push_notify(n.clone());
            side.notes_sent.push(n);
            side.notes_queued.pop_front();
        }
    }

    /// Moves what side `s` may send into its pipes.
    fn send(&mut self, s: usize) {
        if self.sides[s].dead.is_some() {
            return;
        }
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 16];
        for i in 0..self.sides[s].streams.len() {
            let pipe = &mut self.pipes[s][i];
            if pipe.closed {
                continue;
            }
            let st = &mut self.sides[s].streams[i];
            // The send queue never holds more than its bounds allow.
            assert!(
                !st.has_tx() || st.pending_len() <= self.limits.own_max,
                "pending beyond own_max"
            );
            let n_iov = st.tx_iovecs(&mut iov);
            let mut budget = pipe.room();
            if self.faults.fragment {
                budget = budget.min(1 + self.rng.below(97) as usize);
            }
            let mut sent = 0;
            let mut out = Vec::new();
            for v in &iov[..n_iov] {
                let n = v.iov_len.min(budget - sent);
                // SAFETY: the engine's iovecs are valid until its next
                // `&mut` call (`on_sent` below).
                let b = unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, n) };
                for &x in b {
                    pipe.relay.pass(&mut out, x);
                }
                sent += n;
                if sent == budget {
                    break;
                }
            }
            // The relay hands on whole headers only; what it holds back is
            // in flight all the same.
            let at = self.now_us + pipe.delay_us;
            for x in out {
                if pipe.cut_after.is_some_and(|c| pipe.accepted >= c) {
                    pipe.closed = true;
                    break;
                }
                pipe.accepted += 1;
                pipe.bytes.push_back((at, x));
            }
            st.on_sent(sent);
        }
    }

    /// Side `s` reads what has arrived and handles it.
    fn receive(&mut self, s: usize) {
        if self.sides[s].dead.is_some() {
            return;
        }
        if let Some((who, from, len)) = self.faults.stop_reading {
            if who == s && self.now_us >= from && self.now_us < from + len {
                return;
            }
        }
        let now = self.now();
        let n = self.sides[s].streams.len();
        let start = self.rng.below(n as u64) as usize;
        for k in 0..n {
            let i = (start + k) % n;
            let pipe = &mut self.pipes[1 - s][i];
            let mut cap = pipe.stall_after.map_or(usize::MAX, |l| l - pipe.delivered);
            if self.faults.fragment {
                cap = cap.min(1 + self.rng.below(131) as usize);
            }
            let now_us = self.now_us;
            let avail = pipe
                .bytes
                .iter()
                .take(cap)
                .take_while(|(t, _)| *t <= now_us)
                .count();
            let chunk: Vec<u8> = pipe.bytes.iter().take(avail).map(|&(_, b)| b).collect();
            let eof = pipe.closed && pipe.bytes.len() == avail;
            let side = &mut self.sides[s];
            let st = &mut side.streams[i];
            let taken = st.receive_bytes(&chunk, now);
            self.pipes[1 - s][i].bytes.drain(..taken);
            self.pipes[1 - s][i].delivered += taken;
            let mut regions = View {
                table: &side.table,
                conn: side.conn,
            };
            let mut sink = RecSink {
                done: &mut side.done,
                inbox: &mut side.inbox,
                cap: self.faults.inbox_cap.max(1),
            };
            let r = loop {
                match st.step(&mut regions, &mut sink) {
                    Ok(Step::Progress) => continue,
                    Ok(_) => break Ok(()),
                    Err(e) => break Err(e),
                }
            };
            let r = r.and_then(|()| {
                if eof && taken == chunk.len() {
                    Err(ConnFault::closed_by_peer())
                } else {
                    Ok(())
                }
            });
            if let Err(e) = r {
                self.kill(s, e);
                return;
            }
        }
    }

    /// The connection of side `s` dies (as the shard's `drop_conn`): every
    /// outstanding request fails with one error, and the peer sees the
    /// socket close.
    fn kill(&mut self, s: usize, cause: ConnFault) {
        let side = &mut self.sides[s];
        if side.dead.is_some() {
            return;
        }
        let err = Error::ConnFailed {
            conn: side.conn,
            cause: cause.clone(),
        };
        let mut sink = RecSink {
            done: &mut side.done,
            inbox: &mut side.inbox,
            cap: usize::MAX,
        };
        for st in side.streams.iter_mut() {
            st.fail_pending(&err, &mut sink);
        }
        // Frames never queued fail too.
        for slot in side.undealt.drain(..) {
            let op = &side.ops[slot as usize];
            let never = op.len.div_ceil(self.chunk).max(1) - op.at.emitted as usize;
            for _ in 0..never {
                side.done.push((slot, Err(err.duplicate())));
            }
        }
        side.dead = Some(cause);
        for dir in 0..2 {
            for p in self.pipes[dir].iter_mut() {
                p.closed = true;
            }
        }
    }

    /// Publishes completions to the op records, checking each op ends once.
    fn reap(&mut self, s: usize) {
        let side = &mut self.sides[s];
        for (slot, r) in side.done.drain(..) {
            let op = &mut side.ops[slot as usize];
            assert!(!op.ended, "op {slot} of side {s} completed twice");
            assert!(op.left > 0);
            op.left -= 1;
            if let Err(e) = r {
                op.result.get_or_insert(Err(e));
            }
            if op.left == 0 {
                op.ended = true;
                op.result.get_or_insert(Ok(()));
            }
        }
        // The application drains its inbox, slowly when asked to.
        let take = if self.faults.inbox_cap > 0 {
            1
        } else {
            usize::MAX
        };
        for _ in 0..take {
            match side.inbox.pop_front() {
                Some(n) => side.delivered.push(n),
                None => break,
            }
        }
    }

    fn check_timeouts(&mut self, s: usize) {
        let now = self.now();
        let limit = Duration::from_micros(self.op_timeout_us);
        // The tcp side's own rule, over the simulated streams.
        if let Some(why) = super::conn::overdue(&self.sides[s].streams, now, limit) {
            self.kill(s, why);
        }
    }

    fn all_ended(&self) -> bool {
        self.sides.iter().all(|s| {
            s.ops.iter().all(|o| o.ended)
                && (s.dead.is_some() || s.notes_queued.is_empty())
                && s.inbox.is_empty()
        }) && self.notes_settled()
    }

    /// Every notification sent was delivered, or the connection died.
    fn notes_settled(&self) -> bool {
        (0..2).all(|s| {
            let (from, to) = (&self.sides[s], &self.sides[1 - s]);
            from.dead.is_some() || to.dead.is_some() || to.delivered.len() == from.notes_sent.len()
        })
    }

    /// Runs until every operation has ended; panics on a hang.
    pub fn run(&mut self) -> Report {
        for _ in 0..200_000 {
            if let Some(t) = self.faults.reset_at_us {
                if self.now_us >= t {
                    self.kill(
                        0,
                        ConnFault::Closed {
                            why: "connection reset",
                        },
                    );
                    self.kill(
                        1,
                        ConnFault::from_io(
                            "receive",
                            &std::io::Error::from_raw_os_error(libc::ECONNRESET),
                        ),
                    );
                }
            }
            for s in 0..2 {
                self.submit(s);
                self.send(s);
            }
            for s in 0..2 {
                self.receive(s);
                self.reap(s);
                self.check_timeouts(s);
                self.reap(s);
            }
            if self.all_ended() {
                return self.verify();
            }
            self.now_us += 1 + self.rng.below(20);
        }
        panic!(
            "hang: ops left {:?}, dead {:?}",
            self.sides
                .iter()
                .map(|s| s.ops.iter().filter(|o| !o.ended).count())
                .collect::<Vec<_>>(),
            self.sides.iter().map(|s| &s.dead).collect::<Vec<_>>()
        );
    }

    fn verify(&mut self) -> Report {
        let mut rep = Report {
            ok: 0,
            failed: 0,
            errors: Vec::new(),
            notes_delivered: 0,
            died: [self.sides[0].dead.clone(), self.sides[1].dead.clone()],
            end_us: self.now_us,
        };
        for s in 0..2 {
            let (side, peer) = (&self.sides[s], &self.sides[1 - s]);
            for (i, op) in side.ops.iter().enumerate() {
                match op.result.as_ref().expect("ended ops have a result") {
                    Ok(()) => {
                        let got = match op.kind {
                            OpKind::Write => bytes_of(&peer.mem, op.remote_off, op.len),
                            OpKind::Read => bytes_of(&side.mem, op.local_off, op.len),
                        };
                        let bad = got
                            .iter()
                            .enumerate()
                            .position(|(j, &b)| b != pattern(j, op.seed));
                        assert_eq!(bad, None, "side {s} op {i} ({}) reported Ok", op.kind);
                        rep.ok += 1;
                    }
                    Err(e) => {
                        rep.failed += 1;
                        rep.errors.push(e.to_string());
                    }
                }
            }
            // No request is left behind, and nothing still waits to go.
            for st in &side.streams {
                assert!(!st.has_pending(), "side {s}: a request still pending");
                assert!(
                    side.dead.is_some() || !st.has_tx(),
                    "side {s}: frames left unsent"
                );
            }
            // Notifications arrive whole and in order.
            let sent = &peer.notes_sent;
            assert!(side.delivered.len() <= sent.len());
            assert_eq!(&side.delivered[..], &sent[..side.delivered.len()]);
            rep.notes_delivered += side.delivered.len();
        }
        rep
    }
}

mod link;
#[cfg(test)]
mod tests;

pub(crate) use link::{Corrupt, Faults};
use link::{Pipe, Relay};

//! The shard's timeout checks: each connection looked at when its timer
//! is due (what it says: `Carrier::check`), the idle and op timeouts,
//! and the dropping of connections that failed.

use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::{route, Shard, HOT_LOCAL_CHECK, MAX_CHECK_INTERVAL, MAX_DUE_PER_CHECK};
use crate::error::{ConnFault, ConnId};
use crate::reactor::source::{ConnCheck, ConnRef};

impl Shard {
    pub(super) fn remember_failed(&mut self, conn: ConnId, group: ConnId, cause: ConnFault) {
        self.dir.remember_failed(conn, group, cause);
        self.ledger.forget_conn_if_idle(conn);
    }

    /// Drops a connection: its transport fails what it had under way,
    /// the shard forgets its grants and remembers why it died.
    pub(super) fn drop_at(&mut self, at: ConnRef, cause: ConnFault) {
        let gone = {
            let mut cx = cx!(self, None);
            let (t, idx) = route(&mut self.tcp, &mut self.local, at);
            t.remove(idx, &cause, &mut cx)
        };
        let kind = crate::metrics::failure_idx(cause.kind());
        self.ledger.metrics.conn_failures[kind].add(1);
        self.regions.revoke_conn(gone.group);
        self.dir.remove(gone.id);
        // Same-host peers with no connection left here: their IPC mappings
        // on this shard go too.
        for peer in self.local.peers_gone.drain(..) {
            if let Some(g) = &mut self.gpu {
                g.revoke_owner(peer);
            }
        }
        self.remember_failed(gone.id, gone.group, cause);
    }

    /// The longest a connection goes between looks by the timeout checks.
    pub(super) fn check_interval(&self) -> Duration {
        (self.cfg.op_timeout / 4).clamp(Duration::from_millis(1), MAX_CHECK_INTERVAL)
    }

    /// Arms the first look at a connection just added.
    pub(super) fn arm_new(&mut self, at: ConnRef, id: ConnId) {
        let first = Instant::now() + self.check_interval();
        self.timers.arm(first, at, id);
    }

    /// Runs the timeout checks that are due: the parked commands' (only
    /// connections that found no room have any), then each connection whose
    /// timer came due, re-armed at its next deadline. No connection is
    /// looked at before its time.
    pub(super) fn check_timeouts(&mut self, now: Instant) {
        self.ledger.clock.calibrate(now);
        self.local.settle_activity(now);
        self.tcp.broken_links(&mut self.to_fail);
        let limit = self.cfg.op_timeout;
        // A connection whose commands found no room for a whole op timeout
        // (a peer that stopped reading) is failed; what it parked then
        // fails with the reason on the next pass.
        if let Some(before) = now.checked_sub(limit) {
            for conn in self.parked.waiting_since_before(before) {
                if let Some(at) = self.dir.get(conn) {
                    self.to_fail.push((
                        at,
                        ConnFault::Timeout {
                            what:
                                "room for commands (the peer is not reading; FERRY_OP_TIMEOUT_MS)",
                            timeout_ms: limit.as_millis() as u64,
                        },
                    ));
                }
            }
        }
        if now.saturating_duration_since(self.hot_checked) >= HOT_LOCAL_CHECK {
            self.hot_checked = now;
            let mut due = std::mem::take(&mut self.due);
            for &idx in self.local.hot() {
                if let Some(lc) = self.local.conns.get(idx).filter(|lc| lc.busy()) {
                    due.push((ConnRef::Local(idx), lc.id));
                }
            }
            let mut seen = None;
            for (at, _) in due.drain(..) {
                // Their timers stay armed; this look only adds to them.
                let _ = self.check_conn(at, now, &mut seen);
            }
            self.due = due;
        }
        let scan_every = (self.cfg.stall / 4).min(self.check_interval());
        if now.saturating_duration_since(self.scanned) >= scan_every {
            self.scanned = now;
            self.report_stalls(now);
        }
        if self.timers.next().is_some_and(|t| t <= now) {
            let mut due = std::mem::take(&mut self.due);
            self.timers.due(now, MAX_DUE_PER_CHECK, &mut due);
            // Many connections often share one peer process: one look each.
            let mut seen = None;
            for (at, id) in due.drain(..) {
                if self.dir.get(id) != Some(at) {
                    continue; // gone since it was armed
                }
                if let Some(next) = self.check_conn(at, now, &mut seen) {
                    self.timers.arm(next, at, id);
                }
            }
            self.due = due;
        }
        self.fail_marked();
    }

    /// Reports each op in flight past the stall threshold, once: a
    /// warning with its connection, peer, size and age (the op timeout
    /// fails it later if it is still there), and the metrics' count.
    fn report_stalls(&mut self, now: Instant) {
        let (dir, tcp, local, shard) = (&self.dir, &self.tcp, &self.local, self.id);
        self.ledger.scan(now, self.cfg.stall, |conn, op, age| {
            let peer = conn
                .and_then(|c| dir.get(c))
                .map(|at| match at {
                    ConnRef::Tcp(i) => tcp.peer_name(i),
                    ConnRef::Local(i) => local.peer_name(i),
                })
                .unwrap_or_else(|| "gone".to_string());
            let op_name = if op.op == 0 { "WRITE" } else { "READ" };
            warn!(
                shard,
                conn = %conn.map_or_else(|| "none".to_string(), |c| c.to_string()),
                peer = %peer,
                op = op_name,
                transport = op.via.name(),
                bytes = op.bytes,
                age_ms = age.as_millis() as u64,
                "op stalled: in flight past FERRY_STALL_MS"
            );
        });
    }

    /// Checks one connection: requests past the op timeout, a half-arrived
    /// frame gone quiet, a vanished peer process, the idle timeout. Marks it
    /// for failing (and returns `None`) or returns when to look again.
    pub(super) fn check_conn(
        &mut self,
        at: ConnRef,
        now: Instant,
        seen: &mut Option<(u32, bool)>,
    ) -> Option<Instant> {
        let limit = self.cfg.op_timeout;
        let ConnCheck {
            why,
            busy,
            last_active,
            oldest,
        } = {
            let (t, idx) = route(&mut self.tcp, &mut self.local, at);
            let c = t.check(idx, now, limit, seen);
            let parked = self.parked.has(t.conn_id(idx));
            ConnCheck {
                busy: c.busy || parked,
                ..c
            }
        };
        if let Some(why) = why {
            self.to_fail.push((at, why));
            return None;
        }
        let tick = Duration::from_millis(1);
        let mut next = now + self.check_interval();

        if let Some(t) = oldest {
            next = next.min(t + limit + tick);
        }
        if let (Some(idle), false) = (self.cfg.idle_timeout, busy) {
            if now.saturating_duration_since(last_active) > idle {
                self.to_fail.push((
                    at,
                    ConnFault::Timeout {
                        what: "traffic on an idle connection (FERRY_IDLE_TIMEOUT_MS)",
                        timeout_ms: idle.as_millis() as u64,
                    },
                ));
                return None;
            }
            next = next.min(last_active + idle + tick);
        }
        Some(next.max(now + tick))
    }

    /// Drops the connections marked in `to_fail`, failing their requests;
    /// a warning if requests were lost, a note if the connection was idle.
    /// Returns how many were dropped.
    pub(super) fn fail_marked(&mut self) -> usize {
        if self.to_fail.is_empty() {
            return 0;
        }
        let mut to_fail = std::mem::take(&mut self.to_fail);
        // A connection may be marked twice in a pass (say, late and
        // stalled): drop it once, with the first reason.
        to_fail.sort_by_key(|(at, _)| *at);
        to_fail.dedup_by_key(|(at, _)| *at);
        let n = to_fail.len();
        for (at, cause) in to_fail.drain(..) {
            let (conn, busy) = {
                let (t, idx) = route(&mut self.tcp, &mut self.local, at);
                (t.conn_id(idx), t.has_pending(idx))
            };
            if busy {
                warn!(shard = self.id, %conn, "connection failed: {cause}");
            } else {
                info!(shard = self.id, %conn, "connection closed: {cause}");
            }
            self.drop_at(at, cause);
        }
        self.to_fail = to_fail;
        n
    }
}

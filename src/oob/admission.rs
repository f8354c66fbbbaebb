//! Who may be in handshake, with no I/O: the streams of each connection
//! (a connection is acknowledged only when all of them are here, from one
//! address), sockets per address, and which socket a newcomer evicts. The
//! gate (`gate.rs`) asks; the numbers are its limits.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Instant;

use crate::wire::Hello;

/// A connection: the peer's endpoint id and its connection nonce.
pub(crate) type GroupKey = (u64, u64);

/// The streams of one connection in handshake.
pub(crate) struct Group<S> {
    /// Socket keys by stream index; `None` until that stream's Hello arrives.
    pub members: Vec<Option<usize>>,
    arrived: usize,
    /// The connection's quota place, once admitted.
    pub slot: Option<S>,
}

pub(crate) struct Admission<S> {
    per_addr: HashMap<IpAddr, usize>,
    groups: HashMap<GroupKey, Group<S>>,
}

/// One socket in handshake, as eviction sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Candidate {
    pub key: usize,
    pub ip: IpAddr,
    /// It has sent something.
    pub heard: bool,
    pub since: Instant,
}

/// The socket to evict (from `ip` only, if given): the oldest of those
/// that have sent nothing yet, else the oldest.
pub(crate) fn victim(cands: impl Iterator<Item = Candidate>, ip: Option<IpAddr>) -> Option<usize> {
    cands
        .filter(|c| ip.map_or(true, |ip| c.ip == ip))
        .min_by_key(|c| (c.heard, c.since))
        .map(|c| c.key)
}

/// Whom a newcomer from `ip` must evict first: `Some(Some(ip))` one of its
/// address's sockets (the address is at its share), `Some(None)` any (the
/// gate is full), `None` nobody.
pub(crate) fn eviction_scope(
    from_addr: usize,
    pending: usize,
    max_per_addr: usize,
    max_pending: usize,
    ip: IpAddr,
) -> Option<Option<IpAddr>> {
    if from_addr >= max_per_addr {
        Some(Some(ip))
    } else if pending >= max_pending {
        Some(None)
    } else {
        None
    }
}

impl<S> Default for Admission<S> {
    fn default() -> Self {
        Self {
            per_addr: HashMap::new(),
            groups: HashMap::new(),
        }
    }
}

impl<S> Admission<S> {
    /// Sockets from `ip` in handshake.
    pub fn count_of(&self, ip: IpAddr) -> usize {
        self.per_addr.get(&ip).copied().unwrap_or(0)
    }

    /// A socket from `ip` came in ...
    pub fn arrived(&mut self, ip: IpAddr) {
        *self.per_addr.entry(ip).or_insert(0) += 1;
    }

    /// ... and left.
    pub fn left(&mut self, ip: IpAddr) {
        if let Some(n) = self.per_addr.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.per_addr.remove(&ip);
            }
        }
    }

    /// Files socket `key` (from `ip`; `ip_of` gives any socket's address)
    /// under its connection by the peer's `Hello`. `Ok(Some(members))`:
    /// the connection is whole (every stream's socket, in stream order);
    /// `Err`: why the stream is refused (a stream count that disagrees, a
    /// stream twice, streams from two addresses).
    pub fn join(
        &mut self,
        key: usize,
        theirs: &Hello,
        ip: IpAddr,
        ip_of: impl Fn(usize) -> IpAddr,
    ) -> Result<Option<Vec<usize>>, String> {
        // The decoder refuses these; checked again before anything is
        // filed, so no refused stream leaves a group behind.
        if theirs.stream_idx >= theirs.stream_count {
            return Err(format!(
                "stream {} of {}",
                theirs.stream_idx, theirs.stream_count
            ));
        }
        let gk = (theirs.endpoint_id, theirs.conn_nonce);
        let g = self.groups.entry(gk).or_insert_with(|| Group {
            members: vec![None; theirs.stream_count as usize],
            arrived: 0,
            slot: None,
        });
        if g.members.len() != theirs.stream_count as usize {
            return Err(format!(
                "stream {} says {} streams, earlier ones said {}",
                theirs.stream_idx,
                theirs.stream_count,
                g.members.len()
            ));
        }
        if g.members[theirs.stream_idx as usize].is_some() {
            return Err(format!("stream {} arrived twice", theirs.stream_idx));
        }
        // Members of one connection must come from one address.
        if g.members
            .iter()
            .flatten()
            .next()
            .is_some_and(|&k| ip_of(k) != ip)
        {
            return Err("streams of one connection come from different addresses".into());
        }
        g.members[theirs.stream_idx as usize] = Some(key);
        g.arrived += 1;
        if g.arrived < g.members.len() {
            return Ok(None);
        }
        Ok(Some(
            g.members.iter().map(|m| m.expect("all arrived")).collect(),
        ))
    }

    /// The whole connection `gk` was admitted: it holds `slot`.
    pub fn admitted(&mut self, gk: GroupKey, slot: S) {
        if let Some(g) = self.groups.get_mut(&gk) {
            g.slot = Some(slot);
        }
    }

    pub fn group(&self, gk: GroupKey) -> Option<&Group<S>> {
        self.groups.get(&gk)
    }

    /// Forgets connection `gk` (done, or dropped), handing back its record.
    pub fn take(&mut self, gk: GroupKey) -> Option<Group<S>> {
        self.groups.remove(&gk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn hello(idx: u16, count: u16) -> Hello {
        Hello {
            endpoint_id: 1,
            caps: 0,
            conn_nonce: 2,
            stream_idx: idx,
            stream_count: count,
            max_inflight: 8,
            host_token: 0,
            auth_nonce: 0,
        }
    }

    #[test]
    fn a_connection_is_whole_when_every_stream_is_here() {
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let mut a: Admission<()> = Admission::default();
        assert_eq!(a.join(7, &hello(1, 3), ip, |_| ip), Ok(None));
        assert_eq!(a.join(4, &hello(0, 3), ip, |_| ip), Ok(None));
        assert!(a
            .join(9, &hello(1, 3), ip, |_| ip)
            .unwrap_err()
            .contains("twice"));
        assert!(a
            .join(9, &hello(2, 4), ip, |_| ip)
            .unwrap_err()
            .contains("earlier ones said 3"));
        let other: IpAddr = "10.0.0.2".parse().unwrap();
        assert!(a
            .join(9, &hello(2, 3), other, |_| ip)
            .unwrap_err()
            .contains("different addresses"));
        assert_eq!(a.join(5, &hello(2, 3), ip, |_| ip), Ok(Some(vec![4, 7, 5])));
        a.admitted((1, 2), ());
        assert!(a.take((1, 2)).unwrap().slot.is_some());
        assert!(a.group((1, 2)).is_none());
    }

    #[test]
    fn eviction_prefers_the_silent_then_the_oldest_of_the_address() {
        let (x, y): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let t0 = Instant::now();
        let c = |key, ip, heard, s| Candidate {
            key,
            ip,
            heard,
            since: t0 + Duration::from_secs(s),
        };
        let cands = [
            c(1, x, true, 0),
            c(2, x, false, 5),
            c(3, y, false, 1),
            c(4, x, false, 3),
        ];
        assert_eq!(victim(cands.into_iter(), Some(x)), Some(4));
        assert_eq!(victim(cands.into_iter(), None), Some(3));
        assert_eq!(victim([c(1, x, true, 0)].into_iter(), Some(y)), None);
        assert_eq!(eviction_scope(5, 10, 5, 100, x), Some(Some(x)));
        assert_eq!(eviction_scope(1, 100, 5, 100, x), Some(None));
        assert_eq!(eviction_scope(1, 10, 5, 100, x), None);
        let mut a: Admission<()> = Admission::default();
        a.arrived(x);
        a.arrived(x);
        a.left(x);
        assert_eq!(a.count_of(x), 1);
        a.left(x);
        assert_eq!(a.count_of(x), 0);
    }
}

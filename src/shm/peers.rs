//! The endpoint's same-host peers, for every shard at once: which peer
//! processes have connections to us (only they may share memory), and the
//! memfd regions they shared, mapped here.
//!
//! Same-host connections live on any shard, but one fd-passing socket
//! (polled by shard 0) receives every peer's regions. So the maps live
//! here, written on the control path only — a connection set up or ended,
//! regions mapped — and each shard keeps a copy it refreshes when the
//! generation number moved: a pass costs one atomic load, and the data
//! path takes no lock. A copy may lag a mapping by a pass; a request that
//! finds no mapping is served with `process_vm_readv/writev`, so a lag
//! costs speed, never correctness. A mapping is unmapped once the last
//! copy (and the last copy in flight) lets go of it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::fdpass::{FdListener, Sender};
use super::local::PeerMaps;

#[derive(Default)]
struct State {
    /// Established connections per peer (endpoint id, process id).
    conns: HashMap<(u64, u32), usize>,
    maps: PeerMaps,
}

#[derive(Default)]
pub(crate) struct PeerShares {
    /// Bumped (under the lock) whenever `maps` changes.
    gen: AtomicU64,
    state: Mutex<State>,
}

impl PeerShares {
    /// A connection from endpoint `peer` in process `pid` is established.
    pub fn conn_up(&self, peer: u64, pid: u32) {
        *self.lock().conns.entry((peer, pid)).or_default() += 1;
    }

    /// One of them ended; with the last one the peer's maps go.
    pub fn conn_down(&self, peer: u64, pid: u32) {
        let mut st = self.lock();
        let Some(n) = st.conns.get_mut(&(peer, pid)) else {
            return;
        };
        *n -= 1;
        if *n > 0 {
            return;
        }
        st.conns.remove(&(peer, pid));
        if st.conns.keys().any(|&(p, _)| p == peer) {
            return;
        }
        let before = st.maps.len();
        st.maps.retain(|(p, _), _| *p != peer);
        if st.maps.len() != before {
            self.gen.fetch_add(1, Ordering::Release);
        }
    }

    /// Whether a connection from `peer` in process `pid` is established.
    #[cfg(test)]
    pub fn connected(&self, peer: u64, pid: u32) -> bool {
        self.lock().conns.contains_key(&(peer, pid))
    }

    /// Serves `listener` (see `FdListener::poll`): maps what connected
    /// peers share. Returns how many regions were mapped.
    pub fn poll_listener(&self, listener: &mut FdListener) -> usize {
        let mut st = self.lock();
        let State { conns, maps } = &mut *st;
        let n = listener.poll(maps, |s: Sender| conns.contains_key(&(s.id, s.pid)));
        if n > 0 {
            self.gen.fetch_add(1, Ordering::Release);
        }
        n
    }

    /// The generation of the maps (moves with every change).
    pub fn generation(&self) -> u64 {
        self.gen.load(Ordering::Acquire)
    }

    /// Replaces `into` with the current maps; returns their generation.
    pub fn copy_maps(&self, into: &mut PeerMaps) -> u64 {
        let st = self.lock();
        into.clear();
        into.extend(st.maps.iter().map(|(k, m)| (*k, m.clone())));
        self.gen.load(Ordering::Acquire)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic elsewhere with the lock held leaves consistent maps
        // (every change is one insert or retain).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    #[cfg(test)]
    pub fn insert_for_test(&self, peer: u64, key: u32, m: super::local::PeerMap) {
        self.lock().maps.insert((peer, key), m);
        self.gen.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::local::PeerMap;
    use std::sync::Arc;

    fn map() -> PeerMap {
        let m = crate::sys::Mapping::map_fd(-1, 0).unwrap();
        PeerMap {
            map: Arc::new(m),
            base: 0x1000,
        }
    }

    #[test]
    fn maps_live_while_a_connection_of_the_peer_does_and_copies_follow() {
        let s = PeerShares::default();
        s.conn_up(7, 100);
        s.conn_up(7, 100);
        assert!(s.connected(7, 100));
        assert!(!s.connected(7, 101), "another process of the same id");
        let g0 = s.generation();
        s.insert_for_test(7, 1, map());
        s.insert_for_test(8, 1, map());
        assert_ne!(s.generation(), g0);
        let mut copy = PeerMaps::default();
        let g1 = s.copy_maps(&mut copy);
        assert_eq!(g1, s.generation());
        assert_eq!(copy.len(), 2);
        let held = copy[&(7, 1)].map.clone();
        s.conn_down(7, 100);
        assert_eq!(s.generation(), g1, "one connection of two ended");
        s.conn_down(7, 100);
        assert!(!s.connected(7, 100));
        assert_ne!(s.generation(), g1, "the last one took the maps");
        s.copy_maps(&mut copy);
        assert!(copy.contains_key(&(8, 1)) && !copy.contains_key(&(7, 1)));
        assert_eq!(
            Arc::strong_count(&held),
            1,
            "only the copy in flight holds it"
        );
        s.conn_down(9, 1); // unknown: nothing happens
    }
}

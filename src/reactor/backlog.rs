//! Commands that found no room on their connection (a full stream or
//! ring), in order per connection, with when each connection's oldest
//! began to wait. Bounded: one connection at most `per_conn`, all together
//! at most `total` (past which the shard stops taking commands from its
//! queue, so back-pressure reaches the submitters).

use std::collections::VecDeque;
use std::time::Instant;

use crate::error::ConnId;
use crate::sys::IntMap;

pub(crate) struct Backlog<T> {
    queues: IntMap<ConnId, (Instant, VecDeque<T>)>,
    count: usize,
    per_conn: usize,
    total: usize,
}

impl<T> Backlog<T> {
    pub fn new(per_conn: usize, total: usize) -> Self {
        Self {
            queues: Default::default(),
            count: 0,
            per_conn,
            total,
        }
    }

    /// Commands waiting for `conn`.
    pub fn len_of(&self, conn: ConnId) -> usize {
        self.queues.get(&conn).map_or(0, |(_, q)| q.len())
    }

    /// Whether `conn` has commands waiting (a later one waits behind them).
    pub fn has(&self, conn: ConnId) -> bool {
        self.queues.contains_key(&conn)
    }

    /// Whether `conn` has its whole share waiting.
    pub fn at_share(&self, conn: ConnId) -> bool {
        self.len_of(conn) >= self.per_conn
    }

    /// Whether the backlog as a whole is full.
    pub fn full(&self) -> bool {
        self.count >= self.total
    }

    pub fn push(&mut self, conn: ConnId, cmd: T) {
        self.count += 1;
        self.queues
            .entry(conn)
            .or_insert_with(|| (Instant::now(), VecDeque::new()))
            .1
            .push_back(cmd);
    }

    /// Offers waiting commands to `apply`, each connection's in order,
    /// until it hands one back (still no room). A connection that moved
    /// starts its wait anew. Returns how many went through.
    pub fn retry(&mut self, mut apply: impl FnMut(T) -> Option<T>) -> usize {
        let mut n = 0;
        for (since, q) in self.queues.values_mut() {
            let mut moved = false;
            while let Some(cmd) = q.pop_front() {
                match apply(cmd) {
                    None => {
                        n += 1;
                        moved = true;
                    }
                    Some(back) => {
                        q.push_front(back);
                        break;
                    }
                }
            }
            if moved {
                *since = Instant::now();
            }
        }
        self.count -= n;
        self.queues.retain(|_, (_, q)| !q.is_empty());
        n
    }

    /// Connections whose oldest command has waited since before `t`.
    pub fn waiting_since_before(&self, t: Instant) -> impl Iterator<Item = ConnId> + '_ {
        self.queues
            .iter()
            .filter(move |(_, (since, _))| *since < t)
            .map(|(c, _)| *c)
    }

    pub fn is_empty(&self) -> bool {
        self.queues.is_empty()
    }

    /// Everything waiting, to fail it (shutdown).
    pub fn drain(&mut self) -> impl Iterator<Item = T> {
        self.count = 0;
        std::mem::take(&mut self.queues)
            .into_values()
            .flat_map(|(_, q)| q)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_in_order_and_retried_until_refused() {
        let (a, b) = (ConnId(1), ConnId(2));
        let mut bl: Backlog<u32> = Backlog::new(2, 3);
        bl.push(a, 10);
        bl.push(a, 11);
        assert!(bl.at_share(a) && !bl.at_share(b) && !bl.full());
        bl.push(b, 20);
        assert!(bl.full() && bl.has(b));
        // a's first goes, its second is refused; b's goes.
        let mut seen = Vec::new();
        let n = bl.retry(|c| {
            seen.push(c);
            (c == 11).then_some(c)
        });
        assert_eq!(n, 2);
        assert!(seen.contains(&10) && seen.contains(&11) && seen.contains(&20));
        assert_eq!((bl.len_of(a), bl.len_of(b)), (1, 0));
        assert!(!bl.has(b) && !bl.full());
        let later = Instant::now() + std::time::Duration::from_secs(1);
        assert_eq!(bl.waiting_since_before(later).collect::<Vec<_>>(), [a]);
        assert_eq!(bl.drain().collect::<Vec<_>>(), [11]);
        assert!(bl.is_empty());
    }
}

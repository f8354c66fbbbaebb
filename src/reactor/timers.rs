//! When each connection is next looked at by the shard's timeout checks: a
//! min-heap of (when, where, which), one live entry per connection. The
//! shard pops what is due (O(due · log n)), checks those connections, and
//! re-arms each at its next deadline (the oldest request's op timeout, the
//! idle timeout, or a check-interval cap for the rest). Entries of removed
//! connections are dropped when they come due (the id no longer matches).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

use super::source::ConnRef;
use crate::error::ConnId;

#[derive(Default)]
pub(crate) struct Timers {
    heap: BinaryHeap<Reverse<(Instant, ConnRef, ConnId)>>,
}

impl Timers {
    /// Looks at connection `id` (living at `at`) again at `when`.
    pub fn arm(&mut self, when: Instant, at: ConnRef, id: ConnId) {
        self.heap.push(Reverse((when, at, id)));
    }

    /// The earliest armed time.
    pub fn next(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((t, _, _))| *t)
    }

    /// Moves up to `max` entries due at `now` into `out`, earliest first.
    pub fn due(&mut self, now: Instant, max: usize, out: &mut Vec<(ConnRef, ConnId)>) {
        while out.len() < max {
            match self.heap.peek() {
                Some(Reverse((t, _, _))) if *t <= now => {
                    let Reverse((_, at, id)) = self.heap.pop().expect("peeked");
                    out.push((at, id));
                }
                _ => break,
            }
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.heap.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn due_entries_come_out_earliest_first_and_only_when_due() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut t = Timers::default();
        t.arm(ms(30), ConnRef::Tcp(3), ConnId(3));
        t.arm(ms(10), ConnRef::Local(1), ConnId(1));
        t.arm(ms(20), ConnRef::Tcp(2), ConnId(2));
        assert_eq!(t.next(), Some(ms(10)));
        let mut out = Vec::new();
        t.due(ms(5), 10, &mut out);
        assert!(out.is_empty(), "nothing due yet");
        t.due(ms(25), 10, &mut out);
        assert_eq!(
            out,
            vec![(ConnRef::Local(1), ConnId(1)), (ConnRef::Tcp(2), ConnId(2))]
        );
        assert_eq!(t.len(), 1);
        out.clear();
        t.arm(ms(26), ConnRef::Tcp(4), ConnId(4));
        t.due(ms(100), 1, &mut out);
        assert_eq!(out, vec![(ConnRef::Tcp(4), ConnId(4))], "at most max");
        assert_eq!(t.next(), Some(ms(30)));
    }
}

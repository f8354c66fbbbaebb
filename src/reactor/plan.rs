//! The planner: how an operation is cut into pieces and dealt over a
//! connection's streams. Pure: no I/O, no clock, nothing but the cursor it
//! is handed, so it is tested on its own.
//!
//! * over **tcp** an op's every part is cut into frames of at most
//!   `chunk_bytes` (a zero-length part is one empty frame), dealt
//!   round-robin over the connection's streams;
//! * over **shm** each part is one ring message (the target copies it
//!   whole);
//! * over **verbs** the whole op is one piece: the verbs layer stripes it
//!   over its queue pairs and completes it once (`verbs/plan.rs`).

/// Which path an operation takes, which decides how it is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    Tcp,
    Local,
    Verbs,
}

/// Frames a tcp part of `len` bytes becomes.
pub(crate) fn frames_of(len: usize, chunk: usize) -> u32 {
    if len == 0 {
        1
    } else {
        len.div_ceil(chunk) as u32
    }
}

/// Pieces an op whose parts have these lengths becomes on `route`: the
/// count its ledger entry waits for.
pub(crate) fn pieces(route: Route, lens: impl Iterator<Item = usize>, chunk: usize) -> u32 {
    match route {
        Route::Verbs => 1,
        Route::Local => lens.count() as u32,
        Route::Tcp => lens.map(|l| frames_of(l, chunk)).sum(),
    }
}

pub(crate) use crate::xfer::Progress;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testrng::Rng;

    #[test]
    fn frames_cover_every_byte_once() {
        let mut rng = Rng(7);
        for _ in 0..2000 {
            let chunk = 1 + rng.below(5000) as usize;
            let lens: Vec<usize> = (0..1 + rng.below(5))
                .map(|_| match rng.below(4) {
                    0 => 0,
                    1 => chunk * (1 + rng.below(3) as usize),
                    _ => rng.below(20_000) as usize,
                })
                .collect();
            let want = pieces(Route::Tcp, lens.iter().copied(), chunk);
            let mut at = Progress::default();
            let mut covered = vec![0usize; lens.len()];
            while at.desc < lens.len() {
                let n = at.frame_len(lens[at.desc], chunk);
                assert!(n <= chunk);
                assert_eq!(at.off, covered[at.desc], "frames are contiguous");
                covered[at.desc] += n;
                at.advance(n, lens[at.desc]);
            }
            assert_eq!(covered, lens);
            assert_eq!(at.emitted, want, "the ledger waits for as many frames");
        }
    }

    #[test]
    fn routes_count_their_pieces() {
        let lens = [0usize, 5, 4096, 4097];
        assert_eq!(pieces(Route::Verbs, lens.iter().copied(), 4096), 1);
        assert_eq!(pieces(Route::Local, lens.iter().copied(), 4096), 4);
        assert_eq!(
            pieces(Route::Tcp, lens.iter().copied(), 4096),
            1 + 1 + 1 + 2
        );
    }
}

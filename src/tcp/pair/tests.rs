use super::*;

/// A workload: both sides start a mix of READs and WRITEs (single- and
/// multi-frame) and some notifications.
fn workload(p: &mut Pair, seed: u64, ops: usize) {
    let mut rng = Rng(seed ^ 0xabcdef);
    for i in 0..ops {
        let s = i % 2;
        let kind = if rng.below(2) == 0 {
            OpKind::Write
        } else {
            OpKind::Read
        };
        let len = match rng.below(4) {
            0 => 1 + rng.below(64) as usize,
            1 => 1 + rng.below(8 << 10) as usize,
            _ => 1 + rng.below(96 << 10) as usize,
        };
        p.start_op(s, kind, len);
        if rng.below(4) == 0 {
            let n = rng.below(300) as usize;
            p.notify(s, (0..n).map(|j| (j as u8) ^ (i as u8)).collect());
        }
    }
}

fn run(seed: u64, streams: usize, faults: Faults) -> Report {
    let mut p = Pair::new(seed, streams, faults);
    workload(&mut p, seed, 40);
    p.run()
}

const SEEDS: std::ops::Range<u64> = 1..9;

#[test]
fn clean_link_moves_every_byte() {
    for seed in SEEDS {
        let r = run(seed, 2, Faults::default());
        assert_eq!(r.failed, 0, "seed {seed}: {:?}", r.errors);
        assert_eq!(r.ok, 40);
        assert!(r.died.iter().all(|d| d.is_none()));
    }
}

#[test]
fn fragmented_reads_and_writes() {
    for seed in SEEDS {
        let f = Faults {
            fragment: true,
            ..Faults::default()
        };
        let r = run(seed, 3, f);
        assert_eq!(r.failed, 0, "seed {seed}: {:?}", r.errors);
    }
}

#[test]
fn delayed_streams_overtake_each_other() {
    for seed in SEEDS {
        let f = Faults {
            delay_us: 400,
            fragment: seed % 2 == 0,
            ..Faults::default()
        };
        let r = run(seed, 4, f);
        assert_eq!(r.failed, 0, "seed {seed}: {:?}", r.errors);
    }
}

#[test]
fn a_pause_in_reading_shorter_than_the_timeout_loses_nothing() {
    for seed in SEEDS {
        let f = Faults {
            stop_reading: Some(((seed % 2) as usize, 50, 20_000)),
            ..Faults::default()
        };
        let r = run(seed, 2, f);
        assert_eq!(r.failed, 0, "seed {seed}: {:?}", r.errors);
    }
}

#[test]
fn a_peer_that_stops_reading_fails_ops_at_the_timeout() {
    for seed in SEEDS {
        let f = Faults {
            stop_reading: Some((1, 30, u64::MAX / 2)),
            ..Faults::default()
        };
        let r = run(seed, 2, f);
        // Side 0 gets no answers: its ops fail (cleanly) once the op
        // timeout passes, not before, and nothing hangs.
        assert!(r.failed > 0, "seed {seed}");
        assert!(r.end_us >= 200_000, "seed {seed}: ended at {} µs", r.end_us);
        assert!(
            r.errors.iter().any(|e| e.contains("FERRY_OP_TIMEOUT_MS")),
            "seed {seed}: {:?}",
            r.errors
        );
    }
}

#[test]
fn truncated_stream_fails_cleanly() {
    for seed in SEEDS {
        for cut in [1, HDR - 1, HDR, HDR + 3, 20_000] {
            let f = Faults {
                cut: Some(((seed % 2) as usize, 0, cut)),
                ..Faults::default()
            };
            let r = run(seed, 2, f);
            assert!(r.failed > 0, "seed {seed} cut {cut}");
            assert!(r.died.iter().any(|d| d.is_some()));
        }
    }
}

#[test]
fn reset_mid_transfer_fails_the_rest_once() {
    for seed in SEEDS {
        let f = Faults {
            reset_at_us: Some(100 + seed * 37),
            fragment: true,
            ..Faults::default()
        };
        let r = run(seed, 3, f);
        assert!(r.failed > 0, "seed {seed}");
        assert!(r
            .errors
            .iter()
            .all(|e| e.contains("reset") || e.contains("closed")));
    }
}

#[test]
fn corrupted_headers_are_caught() {
    for seed in SEEDS {
        for how in [
            Corrupt::Kind,
            Corrupt::Reserved,
            Corrupt::OpId,
            Corrupt::Tag,
        ] {
            for dir in 0..2 {
                let f = Faults {
                    corrupt: Some((dir, (seed % 5) as usize, how)),
                    ..Faults::default()
                };
                let r = run(seed, 2, f);
                // Every op ended, byte-exact if Ok (checked in
                // `verify`); the spoiled frame made something fail.
                assert!(r.failed > 0, "seed {seed} {how:?} dir {dir}");
                if how == Corrupt::Tag && r.died.iter().all(|d| d.is_none()) {
                    // A refused request leaves the connection usable.
                    assert!(
                        r.errors.iter().any(|e| e.contains("no live registration")),
                        "{:?}",
                        r.errors
                    );
                }
            }
        }
    }
}

#[test]
fn integrity_on_a_clean_link_moves_every_byte() {
    for seed in SEEDS {
        for full in [false, true] {
            let f = Faults {
                integrity: Some(full),
                fragment: seed % 2 == 0,
                delay_us: 300,
                ..Faults::default()
            };
            let mut p = Pair::new(seed, 3, f);
            for i in 0..20 {
                p.notify(i % 2, vec![i as u8; 1 + i * 7]);
            }
            workload(&mut p, seed, 40);
            let r = p.run();
            assert_eq!(r.failed, 0, "seed {seed} full {full}: {:?}", r.errors);
            assert_eq!(r.ok, 40);
            assert!(r.notes_delivered >= 20);
            assert!(r.died.iter().all(|d| d.is_none()));
        }
    }
}

/// With frame MACs, whatever a relay changes, adds or replays kills the
/// connection at the frame it touched, before anything acts on it;
/// every op still ends once, byte-exact if Ok.
#[test]
fn integrity_catches_every_change_on_the_path() {
    for seed in SEEDS {
        for (how, full) in [
            (Corrupt::Kind, false),
            (Corrupt::Reserved, false),
            (Corrupt::OpId, false),
            (Corrupt::Tag, false),
            (Corrupt::Inject, false),
            (Corrupt::Inject, true),
            (Corrupt::Payload, true),
        ] {
            for dir in 0..2 {
                let f = Faults {
                    corrupt: Some((dir, (seed % 5) as usize, how)),
                    integrity: Some(full),
                    ..Faults::default()
                };
                let r = run(seed, 2, f);
                let why = format!("{:?}", r.died);
                assert!(
                    why.contains("failed authentication"),
                    "seed {seed} {how:?} full {full} dir {dir}: {why}"
                );
                assert!(r.failed > 0, "seed {seed} {how:?} dir {dir}");
            }
        }
    }
}

#[test]
fn a_full_inbox_pushes_back_and_loses_no_notification() {
    for seed in SEEDS {
        let mut p = Pair::new(
            seed,
            2,
            Faults {
                inbox_cap: 1,
                ..Faults::default()
            },
        );
        for i in 0..(NOTIFY_QUEUE * 2) {
            p.notify(i % 2, vec![i as u8; 1 + i % 40]);
        }
        workload(&mut p, seed, 10);
        let r = p.run();
        assert_eq!(r.failed, 0, "seed {seed}: {:?}", r.errors);
        assert!(r.notes_delivered >= NOTIFY_QUEUE * 2);
    }
}

#[test]
fn a_frame_that_stops_midway_fails_the_connection_at_the_timeout() {
    for seed in SEEDS {
        // Side 0's first frame on stream 0: its header and 10 bytes,
        // then silence (the rest of a payload, or of the next header).
        let f = Faults {
            stall: Some((0, 0, HDR + 10)),
            ..Faults::default()
        };
        let r = run(seed, 2, f);
        assert!(r.failed > 0, "seed {seed}");
        assert!(r.end_us >= 200_000, "seed {seed}: ended at {} µs", r.end_us);
        // The receiver, whose memory the half frame held, gave up on
        // it (or the sender's own op timeout fired first).
        let why = format!("{:?}", r.died);
        assert!(
            r.died
                .iter()
                .flatten()
                .any(|c| matches!(c, ConnFault::Timeout { .. })),
            "seed {seed}: {why}"
        );
    }
}

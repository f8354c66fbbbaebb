//! `ferry bench` itself: options that change what is measured run and say
//! what they measured.

mod common;

use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(common::ferry_bin())
        .arg("bench")
        .args(args)
        .env("FERRY_TRANSPORT", "tcp")
        .output()
        .expect("run ferry bench")
}

#[test]
fn several_submitting_threads_each_keep_their_batch_in_flight() {
    let out = bench(&[
        "--transport",
        "tcp",
        "--sizes",
        "4K",
        "--shards",
        "2",
        "--conns",
        "2",
        "--threads",
        "2",
        "--batch",
        "8",
        "--seconds",
        "0.2",
        "--json",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<&str> = text.lines().filter(|l| l.contains("\"op\"")).collect();
    assert_eq!(rows.len(), 2, "a WRITE and a READ row: {text}");
    for r in rows {
        // Two threads, 8 each.
        assert!(r.contains("\"batch\":16"), "{r}");
    }
}

#[test]
fn threads_without_managed_shards_is_refused_with_the_reason() {
    let out = bench(&["--transport", "tcp", "--threads", "2"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--threads 2: needs managed shards"), "{err}");
}

#[test]
fn idle_probe_with_baseline_reports_each_round_and_the_wake_reference() {
    let out = bench(&[
        "--transport",
        "shm",
        "--sizes",
        "4K",
        "--idle-conns",
        "3",
        "--baseline",
        "--rounds",
        "2",
        "--seconds",
        "0.1",
        "--op",
        "write",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let idle = text
        .lines()
        .find(|l| l.contains("\"idle_conns\""))
        .unwrap_or_else(|| panic!("no idle line in {text}"));
    for field in [
        "\"rounds\":2",
        "\"rtt_after_idle_us\":",
        "\"wake_floor_us\":",
        "\"ratio\":",
    ] {
        assert!(idle.contains(field), "{field} missing from {idle}");
    }
}

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

/// A 4 KiB tcp run of 0.2 s over `--shards 2` with `extra` flags: its
/// WRITE and READ rows (`--json`).
fn tcp_rows(extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        "--transport",
        "tcp",
        "--sizes",
        "4K",
        "--shards",
        "2",
        "--seconds",
        "0.2",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = bench(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<String> = text
        .lines()
        .filter(|l| l.contains("\"op\""))
        .map(str::to_owned)
        .collect();
    assert_eq!(rows.len(), 2, "a WRITE and a READ row: {text}");
    rows
}

#[test]
fn several_submitting_threads_each_keep_their_batch_in_flight() {
    for r in tcp_rows(&["--conns", "2", "--threads", "2", "--batch", "8"]) {
        // Two threads, 8 each.
        assert!(r.contains("\"batch\":16"), "{r}");
    }
}

/// One thread over three connections of two shards, 7 ops in flight:
/// shares of 3, 2 and 2, each refilled on its own connection.
#[test]
fn one_thread_keeps_each_connections_share_of_the_batch_in_flight() {
    for r in tcp_rows(&["--conns", "3", "--batch", "7"]) {
        assert!(r.contains("\"batch\":7"), "{r}");
        assert!(!r.contains("\"gbps\":0.0000"), "{r}");
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
fn the_embedded_shard_round_trip_runs_on_the_shard_and_through_its_queue() {
    for submit in ["each", "queue"] {
        let out = bench(&[
            "--transport",
            "shm",
            "--sizes",
            "8",
            "--op",
            "write",
            "--latency",
            "--batch",
            "1",
            // Over 100 round trips (the warm-up) even on a loaded machine.
            "--seconds",
            "1",
            "--submit",
            submit,
            "--json",
        ]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "--submit {submit}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("\"p50_us\""), "--submit {submit}: {text}");
    }
    let out = bench(&["--transport", "shm", "--submit", "direct"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("expected each, batch or queue"), "{err}");
    let out = bench(&["--transport", "shm", "--submit", "queue", "--burst", "4"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--burst: only with --submit batch"), "{err}");
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

#[test]
fn same_host_round_trips_with_baseline_print_the_cache_line_floor() {
    let args = [
        "--transport",
        "shm",
        "--sizes",
        "4K",
        "--latency",
        "--baseline",
        "--rounds",
        "1",
        "--seconds",
        "0.5",
        "--op",
        "write",
    ];
    let out = bench(&[&args[..], &["--json"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let row = text
        .lines()
        .find(|l| l.contains("\"write_latency\""))
        .unwrap_or_else(|| panic!("no latency row in {text}"));
    let field = |name: &str| -> f64 {
        let at = row
            .find(&format!("\"{name}\":"))
            .unwrap_or_else(|| panic!("{name} missing from {row}"));
        let rest = &row[at + name.len() + 3..];
        let end = rest.find([',', '}']).expect("a number");
        rest[..end].parse().expect("a number")
    };
    for name in ["p50_us", "baseline_p50_us", "baseline_p99_us"] {
        assert!(field(name) > 0.0, "{name} in {row}");
    }
    assert!(
        field("baseline_p99_us") >= field("baseline_p50_us"),
        "{row}"
    );
    let out = bench(&args);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines()
            .any(|l| l.starts_with("write_latency") && l.contains("cache-line ping-pong p50")),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Built with `--features stage-trace`: a same-host round trip's stages,
/// the target's among them (stamped in the other process), each printed
/// with the round trips that reached it.
#[cfg(feature = "stage-trace")]
#[test]
fn stage_trace_prints_each_stage_of_a_same_host_round_trip_both_processes_included() {
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--transport",
            "shm",
            "--sizes",
            "4K",
            "--latency",
            "--batch",
            "1",
            "--seconds",
            "0.5",
            "--op",
            "write",
        ];
        args.extend_from_slice(extra);
        let out = bench(&args);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        err
    };
    let count = |err: &str, pair: &str| -> u64 {
        let line = err
            .lines()
            .find(|l| l.starts_with("stage") && l.contains(pair))
            .unwrap_or_else(|| panic!("no {pair} line in {err}"));
        line.rsplit('(')
            .next()
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no count in {line}"))
    };
    // Through the shard's queue: every stage, in stage order.
    let err = run(&["--submit", "queue"]);
    for pair in [
        "Submit -> Submitted",
        "Submitted -> CmdTaken",
        "CmdTaken -> RequestOut",
        "RequestOut -> RequestIn",
        "RequestIn -> ReplyOut",
        "ReplyOut -> ReplyIn",
        "ReplyIn -> Published",
        "Published -> Seen",
    ] {
        assert!(count(&err, pair) > 100, "{pair}: {err}");
    }
    // Applied in the call (the default, `write_async_on`): the request is
    // out before the call returns, and no queue is crossed.
    let err = run(&[]);
    for pair in [
        "Submit -> RequestOut",
        "RequestOut -> Submitted",
        "ReplyOut -> ReplyIn",
        "ReplyIn -> Published",
        "Published -> Seen",
    ] {
        assert!(count(&err, pair) > 100, "{pair}: {err}");
    }
    assert!(!err.contains("CmdTaken"), "{err}");
}

/// `--op send`: two-sided round trips of each size, the target echoing
/// them, with the one-sided WRITE round trip of the same block as the
/// row's reference; every size in turn (the echo of one ends before the
/// next begins), over tcp and on one host.
#[test]
fn two_sided_round_trips_have_the_one_sided_write_beside_them() {
    for transport in ["tcp", "shm"] {
        let out = bench(&[
            "--transport",
            transport,
            "--op",
            "send",
            "--sizes",
            "8,4K",
            "--seconds",
            "0.3",
            "--json",
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{transport}: {err}");
        let text = String::from_utf8_lossy(&out.stdout);
        let rows: Vec<&str> = text.lines().filter(|l| l.starts_with('{')).collect();
        assert_eq!(rows.len(), 2, "{transport}: one row a size: {text}");
        for (row, size) in rows.iter().zip(["8", "4096"]) {
            assert!(row.contains("\"op\":\"send_latency\""), "{row}");
            assert!(row.contains(&format!("\"block_bytes\":{size},")), "{row}");
            assert!(row.contains("\"reference\":\"one-sided write\""), "{row}");
            assert!(row.contains("\"baseline_p50_us\":"), "{row}");
        }
    }
}

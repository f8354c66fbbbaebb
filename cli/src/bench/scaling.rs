//! A scaling run (--streams LIST): one run per count, then the table and
//! chart.

use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::args::fmt_size;

use super::opts::Opts;

/// A number after `"key":` in one of the bench's JSON lines.
pub(super) fn json_num(line: &str, key: &str) -> Option<f64> {
    let at = line.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = &line[at..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    rest[..end].trim().parse().ok()
}

/// A text after `"key":"` in one of the bench's JSON lines.
pub(super) fn json_str<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(&format!("\"{key}\":\""))? + key.len() + 4;
    line[at..].split('"').next()
}

/// `--streams 1,2,4,8`: runs this benchmark once per count (as a child
/// `ferry bench --json`, so each gets a fresh target), prints each run's
/// rows with its count, and with --plot draws GB/s against the count.
pub(super) fn scaling(o: &Opts, list: &[usize]) -> Result<()> {
    // Our flags again, less the ones each run sets.
    let argv: Vec<String> = std::env::args().skip(2).collect();
    let mut base = Vec::new();
    let mut i = 0;
    while i < argv.len() {
        let a = &argv[i];
        let name = a.trim_start_matches("--");
        let (name, inline) = match name.split_once('=') {
            Some((n, _)) => (n, true),
            None => (name, false),
        };
        let takes_value = !matches!(name, "json" | "latency" | "baseline");
        if matches!(name, "streams" | "plot" | "json") {
            i += if takes_value && !inline { 2 } else { 1 };
            continue;
        }
        base.push(a.clone());
        i += 1;
    }
    let exe = std::env::current_exe().context("finding the ferry executable")?;
    let mut plotted: Vec<crate::plot::Series> = Vec::new();
    if !o.json {
        println!(
            "{:>7} {:<6} {:>9} {:>9} {:>10} {:>7}",
            "streams", "op", "block", "GB/s", "base GB/s", "ratio"
        );
    }
    for &n in list {
        let mut cmd = Command::new(&exe);
        cmd.arg("bench")
            .args(&base)
            .args(["--streams", &n.to_string(), "--json"])
            .stdin(Stdio::null())
            .stderr(Stdio::inherit());
        if o.shards.is_none() {
            cmd.args(["--shards", &n.to_string()]);
        }
        let out = cmd
            .output()
            .context("running one count of the scaling run")?;
        if !out.status.success() {
            bail!("the run with --streams {n} failed: {}", out.status);
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if o.json {
                println!("{}", line.replacen('{', &format!("{{\"streams\":{n},"), 1));
            }
            let (Some(op), Some(block), Some(gbps)) = (
                json_str(line, "op"),
                json_num(line, "block_bytes"),
                json_num(line, "gbps"),
            ) else {
                continue;
            };
            let base_gbps = json_num(line, "baseline_gbps");
            if !o.json {
                println!(
                    "{n:>7} {op:<6} {:>9} {gbps:>9.3} {:>10} {:>7}",
                    fmt_size(block as usize),
                    base_gbps.map_or(String::new(), |b| format!("{b:.3}")),
                    base_gbps.map_or(String::new(), |b| format!("{:.2}", gbps / b)),
                );
            }
            let what = format!("{op} {}", fmt_size(block as usize));
            crate::plot::add_point(&mut plotted, format!("ferry {what}"), false, n, gbps);
            if let Some(b) = base_gbps {
                crate::plot::add_point(&mut plotted, format!("reference {what}"), true, n, b);
            }
        }
    }
    if let Some(path) = &o.plot {
        let axis = crate::plot::XAxis {
            name: "streams (= shards unless --shards)",
            label: |n| n.to_string(),
        };
        let title = "ferry bench scaling run".to_owned();
        std::fs::write(path, crate::plot::svg(&title, &axis, &plotted))
            .with_context(|| format!("writing {path}"))?;
        eprintln!("chart written to {path}");
    }
    Ok(())
}

//! The README's table of bad values, for the commands: each `ferry ...`
//! row runs and must fail with the message the row quotes; `FERRY_LOG`'s
//! row runs `ferry info`. (The variables' rows are checked in the
//! library: `endpoint::config`.)

mod common;

use std::process::{Command, Stdio};

fn rows() -> Vec<(String, String, String)> {
    let readme = include_str!("../../README.md");
    let table = readme
        .split("### What a bad value gets")
        .nth(1)
        .expect("the README has the table")
        .split("\n#")
        .next()
        .unwrap();
    table
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|row| {
            let quoted: Vec<&str> = row.split('`').skip(1).step_by(2).collect();
            let cells: Vec<&str> = row.split('|').collect();
            (
                quoted[0].to_owned(),
                quoted[quoted.len() - 1].to_owned(),
                cells[2].trim().to_owned(),
            )
        })
        .collect()
}

fn run(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let out = Command::new(common::ferry_bin())
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_bad_command_in_the_readme_gets_what_it_says() {
    let mut n = 0;
    for (input, want, said) in rows() {
        let Some(cmd) = input.strip_prefix("ferry ") else {
            continue;
        };
        let args: Vec<&str> = cmd.split_whitespace().collect();
        let (code, err) = run(&args, &[]);
        let exit: i32 = said
            .strip_prefix("exit ")
            .and_then(|s| s.split(':').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{input}: the row says no exit code"));
        assert_eq!(code, Some(exit), "{input}: {err}");
        assert!(err.contains(&want), "{input}: {err}");
        n += 1;
    }
    assert!(n >= 20, "{n} rows");
}

#[test]
fn a_bad_log_level_is_said_and_warn_is_used() {
    let (input, want, _) = rows()
        .into_iter()
        .find(|(i, _, _)| i.starts_with("FERRY_LOG="))
        .expect("a FERRY_LOG row");
    let value = input.split_once('=').unwrap().1;
    let (code, err) = run(&["info"], &[("FERRY_LOG", value)]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains(&want), "{err}");
}

//! The C face from C: `tests/c/two_process.c` (two processes: WRITE,
//! READ, notifications, errors) and `examples/c/hello.c`, compiled
//! against include/ferry.h and this build's libferry.so, then run.

use std::path::{Path, PathBuf};
use std::process::Command;

/// target/<profile>, where cargo put libferry.so (this test is in deps/).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_owned()
}

/// Builds libferry.so as it is now (cargo builds a cdylib for `build`,
/// not for an integration test of its package).
fn build_lib() {
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "-q", "-p", "ferry-c"]);
    if lib_dir().ends_with("release") {
        cmd.arg("--release");
    }
    let status = cmd.status().expect("cargo");
    assert!(status.success(), "cargo build -p ferry-c failed");
}

/// Compiles `src` (relative to the workspace) into the target directory.
fn compile(src: &str, out: &str) -> PathBuf {
    compile_with(src, out, &[])
}

/// `compile`, with extra compiler flags.
fn compile_with(src: &str, out: &str, flags: &[&str]) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    build_lib();
    let lib = lib_dir();
    assert!(
        lib.join("libferry.so").exists(),
        "no libferry.so in {}: build the workspace first",
        lib.display()
    );
    let bin = lib.join(out);
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args([
            "-std=c11",
            "-D_DEFAULT_SOURCE",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-O1",
        ])
        .args(flags)
        .arg("-I")
        .arg(root.join("include"))
        .arg(root.join(src))
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lferry", "-o"])
        .arg(&bin)
        .status()
        .expect("a C compiler (cc) on PATH");
    assert!(status.success(), "{src} did not compile");
    bin
}

/// Compiles and runs `src` (with `env` set); it must succeed and print
/// `says`.
fn run_c(src: &str, out: &str, says: &str, env: &[(&str, &str)]) {
    run_bin(compile(src, out), says, env);
}

/// Runs `bin` (with `env` set); it must succeed and print `says`.
fn run_bin(bin: PathBuf, says: &str, env: &[(&str, &str)]) {
    let out = Command::new(&bin)
        .envs(env.iter().copied())
        .output()
        .expect("run the C program");
    let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {text}", out.status);
    assert!(text.contains(says), "{text}");
    // What it measured, in the test's report (`--nocapture`).
    println!("{}: {}", bin.display(), text.trim_end());
}

#[test]
fn two_processes_drive_the_c_face() {
    run_c(
        "capi/tests/c/two_process.c",
        "ferry-c-two-process",
        "all checks held",
        &[],
    );
}

/// The same checks with the shards run by the calling threads (and their
/// helpers): `FERRY_DRIVE=caller`.
#[test]
fn two_processes_drive_the_c_face_with_caller_driven_shards() {
    run_c(
        "capi/tests/c/two_process.c",
        "ferry-c-two-process-caller",
        "all checks held",
        &[("FERRY_DRIVE", "caller")],
    );
}

/// A thread waits for 1 000 transfers over 4 connections in poll(2) on
/// the completion fd (`tests/c/completion_fd.c`), with ferry's shard
/// threads and with caller-driven shards.
#[test]
fn a_c_host_waits_on_the_completion_fd() {
    for drive in ["threads", "caller"] {
        run_c(
            "capi/tests/c/completion_fd.c",
            &format!("ferry-c-completion-fd-{drive}"),
            "every completion seen once through the fd",
            &[("FERRY_DRIVE", drive)],
        );
    }
}

#[test]
fn the_c_example_runs() {
    run_c(
        "examples/c/hello.c",
        "ferry-c-hello",
        "the target holds \"hello from C\"",
        &[],
    );
}

/// A C host with SIGPIPE at its default disposition outlives peers that
/// die under it, on every transport and drive mode: `tests/c/peer_death.c`.
fn peers_die(transport: &str, drive: &str) {
    run_c(
        "capi/tests/c/peer_death.c",
        &format!("ferry-c-peer-death-{transport}-{drive}"),
        "the host lived",
        &[
            ("FERRY_TRANSPORT", transport),
            ("FERRY_DRIVE", drive),
            ("FERRY_LISTEN_ADDR", "127.0.0.1"),
        ],
    );
}

#[test]
fn sigpipe_never_reaches_the_host_tcp() {
    peers_die("tcp", "threads");
}

#[test]
fn sigpipe_never_reaches_the_host_tcp_caller_driven() {
    peers_die("tcp", "caller");
}

#[test]
fn sigpipe_never_reaches_the_host_same_host() {
    peers_die("shm", "threads");
}

#[test]
fn sigpipe_never_reaches_the_host_same_host_caller_driven() {
    peers_die("shm", "caller");
}

/// A silent, a lying and a gone peer (ferry's rogue test peers) fail their
/// connections with three different statuses: `tests/c/causes.c`.
#[test]
fn a_silent_a_lying_and_a_gone_peer_are_three_statuses() {
    use engine::rogue::{spawn, Behaviour};
    let port = |how| spawn(how).expect("a rogue peer").port().to_string();
    let (silent, garbage, hangup) = (
        port(Behaviour::Silent),
        port(Behaviour::Garbage),
        port(Behaviour::HangUp),
    );
    run_c(
        "capi/tests/c/causes.c",
        "ferry-c-causes",
        "three causes, three statuses",
        &[
            ("FERRY_ROGUE_SILENT", &silent),
            ("FERRY_ROGUE_GARBAGE", &garbage),
            ("FERRY_ROGUE_HANGUP", &hangup),
        ],
    );
}

/// Every handle type released twice, used after release and made up:
/// `FERRY_ERR_INVALID`, with AddressSanitizer watching for any read of
/// freed memory (`tests/c/misuse.c`).
#[test]
fn misused_handles_are_refused_under_address_sanitizer() {
    let bin = compile_with(
        "capi/tests/c/misuse.c",
        "ferry-c-misuse",
        &["-fsanitize=address", "-fno-omit-frame-pointer"],
    );
    // Rust's allocations go through the C allocator ASan replaces: a
    // use after free inside libferry is caught too. Leaks are not the
    // point here (threads of the endpoint outlive main's checks).
    run_bin(
        bin,
        "every misuse refused",
        &[("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=1")],
    );
}

//! Requests of many small GPU pieces — a KV-cache hand-off's shape — byte
//! exact on every way they can run: CUDA IPC ops of this endpoint and a
//! same-host peer's requests on its GPU memory, WRITE and READ, through the
//! gather kernel (`FERRY_GPU_COPY=kernel`) and the copy engine (`engine`):
//! 1 piece, 32 at odd offsets, 160 and 200 (the kernel reads descriptors
//! by value up to 160), 1024 of 16 KiB, 100 000 of odd sizes, runs
//! of adjacent pieces (joined into one copy) and pieces too long for the
//! kernel beside short ones; a piece that cannot be copied fails its whole
//! request. Lone small copies also go through the copy runner (a
//! resident kernel, `src/gpu/runner/`) and, with it off, a launch.
//!
//! `#[ignore]`d: run with `cargo test --test gpu_pieces -- --ignored`
//! where there is a GPU (they fail, not pass, where there is none).

mod common;

use common::{ask, Path, Target};
use ferry::{
    AnyWindow, Config, ConnId, Endpoint, GpuCopy, IpcBuf, MemoryRegion, OpKind, RemoteBuf,
};
use ferry_cli::testkit::{check_pattern, fill_pattern, fnv64};

const SPAN: usize = 48 << 20;

fn cfg(way: GpuCopy) -> Config {
    let mut c = Config::default();
    c.listen_addr = "127.0.0.1".parse().unwrap();
    c.gpu = Some(0);
    c.gpu_copy = way;
    c
}

fn way_name(way: GpuCopy) -> &'static str {
    match way {
        GpuCopy::Kernel => "kernel",
        GpuCopy::Engine => "engine",
        GpuCopy::Auto => "auto",
    }
}

/// `[base, base + total)` cut into pieces of the sizes `sizes` cycles
/// through, listed in a scattered order when `shuffle` (no two neighbours
/// adjacent in the list, mostly), else in order (every piece continues the
/// last: they join).
fn layout(base: usize, total: usize, sizes: &[usize], shuffle: bool) -> Vec<(usize, usize)> {
    let mut v = Vec::new();
    let (mut at, mut i) = (base, 0);
    while at < base + total {
        let len = sizes[i % sizes.len()].min(base + total - at);
        v.push((at, len));
        at += len;
        i += 1;
    }
    if shuffle {
        // A fixed LCG: the same order every run.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for k in (1..v.len()).rev() {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            v.swap(k, (x >> 33) as usize % (k + 1));
        }
    }
    v
}

/// The cases: (name, base, total, sizes, shuffled).
fn cases() -> Vec<(&'static str, usize, usize, Vec<usize>, bool)> {
    vec![
        ("1 piece at an odd offset", 4099, 777, vec![777], false),
        ("32 x 4 KiB at odd offsets", 13, 32 * 4096, vec![4096], true),
        ("odd sizes", 1, 300_001, vec![1, 4095, 17, 65_537, 3], true),
        // The kernel's three ways to its descriptors (src/gpu/gather.rs):
        // by value up to 160, pinned memory below 256, device memory after.
        ("160 pieces, by value", 7, 160 * 3000, vec![3000], true),
        ("200 pieces, pinned", 9, 200 * 3000, vec![3000], true),
        ("1024 x 16 KiB", 0, 1024 * 16384, vec![16384], true),
        ("adjacent pieces join", 64, 256 * 4096, vec![4096], false),
        (
            "long and short",
            5,
            8 << 20,
            vec![300 << 10, 4096, 2 << 20, 100],
            true,
        ),
        (
            "100 000 pieces",
            3,
            100_000 * 400 + 57,
            vec![400, 399, 401],
            true,
        ),
    ]
}

fn pattern_hash(off: usize, len: usize, seed: u8) -> u64 {
    let mut b = vec![0u8; len];
    fill_pattern(&mut b, off as u64, seed);
    fnv64(&b)
}

fn ghash(ep: &Endpoint, conn: ConnId, off: usize, len: usize) -> u64 {
    let a = ask(ep, conn, &format!("ghash {off} {len}"));
    u64::from_str_radix(a.strip_prefix("hash ").expect(&a), 16).unwrap()
}

fn gpu_fill(mr: &MemoryRegion, off: usize, len: usize, seed: u8) {
    let mut b = vec![0u8; len];
    fill_pattern(&mut b, off as u64, seed);
    mr.write_at(off, &b).unwrap();
}

fn gpu_bytes(mr: &MemoryRegion, off: usize, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    mr.read_at(off, &mut b).unwrap();
    b
}

/// How a case's request is made.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Post {
    /// `writev` / `readv`.
    Vectored,
    /// `prepare` once, `post` twice (the second post is the one checked).
    Prepared,
}

/// Runs every case as one WRITE and one READ request; `windows` makes
/// the pieces' windows (an IPC window or a key window of the peer).
fn every_case(
    ep: &Endpoint,
    conn: ConnId,
    local: &MemoryRegion,
    what: &str,
    window: impl Fn(usize, usize) -> AnyWindow,
) {
    for post in [Post::Vectored, Post::Prepared] {
        for (k, case) in cases().into_iter().enumerate() {
            one_case(
                ep,
                conn,
                local,
                &format!("{what}, {post:?}"),
                &window,
                post,
                k,
                case,
            );
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn one_case(
    ep: &Endpoint,
    conn: ConnId,
    local: &MemoryRegion,
    what: &str,
    window: &impl Fn(usize, usize) -> AnyWindow,
    post: Post,
    k: usize,
    (name, base, total, sizes, shuffle): (&str, usize, usize, Vec<usize>, bool),
) {
    {
        let pieces = layout(base, total, &sizes, shuffle);
        let locals: Vec<(&MemoryRegion, usize, usize)> =
            pieces.iter().map(|&(o, l)| (local, o, l)).collect();
        let windows: Vec<AnyWindow> = pieces.iter().map(|&(o, l)| window(o, l)).collect();
        let run = |kind: OpKind| -> ferry::Result<()> {
            match (post, kind) {
                (Post::Vectored, OpKind::Write) => ep.writev(conn, &locals, &windows),
                (Post::Vectored, OpKind::Read) => ep.readv(conn, &locals, &windows),
                (Post::Prepared, kind) => {
                    let p = ep.prepare(conn, kind, &locals, &windows)?;
                    // CUDA IPC pieces (all below 8 MiB) are planned.
                    assert_eq!(p.is_planned(), windows.iter().all(|w| w.ipc().is_some()));
                    ep.post(&p, None)?.wait()?;
                    ep.post(&p, None)?.wait()
                }
            }
        };
        // WRITE: the peer's span holds something else first.
        let seed = 20 + 2 * k as u8;
        assert_eq!(ask(ep, conn, &format!("gfill {base} {total} 7")), "ok");
        gpu_fill(local, base, total, seed);
        run(OpKind::Write).unwrap_or_else(|e| panic!("{what}, {name}: WRITE failed: {e}"));
        assert_eq!(
            ghash(ep, conn, base, total),
            pattern_hash(base, total, seed),
            "{what}, {name}: WRITE ({} pieces)",
            pieces.len()
        );
        // READ: ours holds something else first.
        let seed = seed + 1;
        assert_eq!(ask(ep, conn, &format!("gfill {base} {total} {seed}")), "ok");
        gpu_fill(local, base, total, 8);
        run(OpKind::Read).unwrap_or_else(|e| panic!("{what}, {name}: READ failed: {e}"));
        assert_eq!(
            check_pattern(&gpu_bytes(local, base, total), base as u64, seed),
            None,
            "{what}, {name}: READ ({} pieces)",
            pieces.len()
        );
    }
}

fn gpu_target(way: GpuCopy) -> Target {
    let env = [("FERRY_GPU_COPY", way_name(way))];
    Target::start_with(Path::Shm, SPAN, &env, &["--gpu", "0"])
}

fn ipc_pieces(way: GpuCopy) {
    let target = gpu_target(way);
    let ep = Endpoint::builder().config(cfg(way)).build().unwrap();
    let conn = ep.add_remote(&target.served.meta).unwrap();
    let remote: IpcBuf = target.served.ipc.expect("IPCBUF line");
    let local = ep.alloc_gpu(SPAN).unwrap();
    let what = format!("CUDA IPC, {}", way_name(way));
    every_case(&ep, conn, &local, &what, |o, l| {
        AnyWindow::Ipc(remote.slice(o as u64, l as u64).unwrap())
    });

    // A piece whose handle cannot be opened fails the whole request, and
    // nothing is reported done that did not land; the next request runs.
    let mut bad = remote.slice(0, 4096).unwrap();
    bad.alloc_base ^= 1 << 40;
    bad.handle = [0xa5; 64];
    for kind in [ferry::OpKind::Write, ferry::OpKind::Read] {
        let mut windows: Vec<IpcBuf> = (0..32)
            .map(|i| remote.slice(8192 * i, 4096).unwrap())
            .collect();
        windows[17] = bad;
        let locals: Vec<(&MemoryRegion, usize, usize)> =
            (0..32).map(|i| (&local, 8192 * i, 4096)).collect();
        let r = match kind {
            ferry::OpKind::Write => ep.writev(conn, &locals, &windows),
            ferry::OpKind::Read => ep.readv(conn, &locals, &windows),
        };
        assert!(r.is_err(), "{what}: a {kind:?} with a bad piece: {r:?}");
        let any: Vec<AnyWindow> = windows.iter().map(|w| AnyWindow::Ipc(*w)).collect();
        let p = ep.prepare(conn, kind, &locals, &any).unwrap();
        assert!(p.is_planned());
        let r = ep.post(&p, None).and_then(|t| t.wait());
        assert!(
            r.is_err(),
            "{what}: a prepared {kind:?} with a bad piece: {r:?}"
        );
    }
    gpu_fill(&local, 0, 4096, 99);
    let w = remote.slice(0, 4096).unwrap();
    ep.write(conn, &local, 0, 4096, &w).unwrap();
    assert_eq!(ghash(&ep, conn, 0, 4096), pattern_hash(0, 4096, 99));
}

fn same_host_pieces(way: GpuCopy) {
    let target = gpu_target(way);
    let ep = Endpoint::builder().config(cfg(way)).build().unwrap();
    let conn = ep.add_remote(&target.served.meta).unwrap();
    let grb: RemoteBuf = target.served.gpu_rbuf.expect("GRBUF line");
    let local = ep.alloc_gpu(SPAN).unwrap();
    let what = format!("same-host requests on GPU memory, {}", way_name(way));
    every_case(&ep, conn, &local, &what, |o, l| {
        AnyWindow::Key(grb.slice(o as u32, l as u32).unwrap())
    });
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu_pieces -- --ignored)"]
fn ipc_pieces_through_the_gather_kernel_are_byte_exact() {
    ipc_pieces(GpuCopy::Kernel);
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu_pieces -- --ignored)"]
fn ipc_pieces_through_the_copy_engine_are_byte_exact() {
    ipc_pieces(GpuCopy::Engine);
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu_pieces -- --ignored)"]
fn same_host_gpu_requests_through_the_gather_kernel_are_byte_exact() {
    same_host_pieces(GpuCopy::Kernel);
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu_pieces -- --ignored)"]
fn same_host_gpu_requests_through_the_copy_engine_are_byte_exact() {
    same_host_pieces(GpuCopy::Engine);
}

/// A `ferry serve` target on GPU 0 and an endpoint whose copy runner
/// waits `runner_us` (0: off) with 1 MiB of GPU memory: (target, endpoint,
/// connection, the target's IPC window, our memory).
fn lone_pair(runner_us: u64) -> (Target, Endpoint, ConnId, IpcBuf, MemoryRegion) {
    let target = gpu_target(GpuCopy::Kernel);
    let mut c = cfg(GpuCopy::Kernel);
    c.gpu_runner_us = runner_us;
    let ep = Endpoint::builder().config(c).build().unwrap();
    let conn = ep.add_remote(&target.served.meta).unwrap();
    let remote: IpcBuf = target.served.ipc.expect("IPCBUF line");
    let local = ep.alloc_gpu(1 << 20).unwrap();
    (target, ep, conn, remote, local)
}

/// Lone small CUDA IPC ops go to the copy runner (src/gpu/runner/), a
/// kernel that stays resident for `FERRY_GPU_RUNNER_US` after each copy
/// and then ends itself. Ops spaced below, at and past that span (the
/// runner serving, ending as one is posted, launched again) at odd sizes
/// and offsets (its byte loop), at its 64 KiB limit and one byte past it
/// (the launched kernel), both directions: each byte exact. And a
/// device-wide synchronisation right after an op returns: the runner does
/// not hold the GPU.
#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu_pieces -- --ignored)"]
fn lone_copies_through_the_runner_are_byte_exact_across_its_ends() {
    let (_target, ep, conn, remote, local) = lone_pair(50);
    let sizes = [1usize, 15, 16, 777, 4096, 4099, 16384, 65536, 65537];
    let gaps_us = [0u64, 10, 40, 50, 60, 100, 400, 2000];
    for i in 0..240usize {
        let len = sizes[i % sizes.len()];
        let off = (i * 4099) % (512 << 10) + (i % 3) * 16;
        let w = remote.slice(off as u64, len as u64).unwrap();
        std::thread::sleep(std::time::Duration::from_micros(gaps_us[i % gaps_us.len()]));
        let seed = (i % 200) as u8 + 1;
        let what = format!("op {i}: {len} bytes at {off}");
        if i % 2 == 0 {
            gpu_fill(&local, off, len, seed);
            ep.write(conn, &local, off, len, &w)
                .unwrap_or_else(|e| panic!("{what}: WRITE failed: {e}"));
            assert_eq!(
                ghash(&ep, conn, off, len),
                pattern_hash(off, len, seed),
                "{what}: WRITE"
            );
        } else {
            assert_eq!(ask(&ep, conn, &format!("gfill {off} {len} {seed}")), "ok");
            gpu_fill(&local, off, len, 0);
            ep.read(conn, &local, off, len, &w)
                .unwrap_or_else(|e| panic!("{what}: READ failed: {e}"));
            assert_eq!(
                check_pattern(&gpu_bytes(&local, off, len), off as u64, seed),
                None,
                "{what}: READ"
            );
        }
    }
    // Many back to back, no gap: the runner stays and serves them all
    // (and ends after twenty idle spans of life at most, mid-run).
    for i in 0..2000usize {
        let off = (i * 4096) % (512 << 10);
        let w = remote.slice(off as u64, 4096).unwrap();
        ep.write(conn, &local, off, 4096, &w).unwrap();
    }
    gpu_fill(&local, 0, 4096, 77);
    ep.write(conn, &local, 0, 4096, &remote.slice(0, 4096).unwrap())
        .unwrap();
    assert_eq!(ghash(&ep, conn, 0, 4096), pattern_hash(0, 4096, 77));
    // A device-wide synchronisation right after an op ends: the runner
    // ends itself; one that never did would hold this call for ever.
    let (tx, rx) = std::sync::mpsc::channel();
    ep.write(conn, &local, 0, 4096, &remote.slice(0, 4096).unwrap())
        .unwrap();
    std::thread::spawn(move || {
        common::primary_context_current();
        // SAFETY: a plain driver call in the primary context.
        let r = unsafe { cudarc::driver::sys::cuCtxSynchronize() };
        tx.send(r).unwrap();
    });
    let r = rx
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("cuCtxSynchronize returns while the runner is idle");
    assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
}

/// With the runner off (`FERRY_GPU_RUNNER_US=0`) a lone small copy is
/// launched as a batch of one: byte exact both ways.
#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu_pieces -- --ignored)"]
fn lone_copies_without_the_runner_are_byte_exact() {
    let (_target, ep, conn, remote, local) = lone_pair(0);
    for (i, len) in [1usize, 777, 4096, 65536].into_iter().enumerate() {
        let off = 4099 * i + 3;
        let w = remote.slice(off as u64, len as u64).unwrap();
        gpu_fill(&local, off, len, 40 + i as u8);
        ep.write(conn, &local, off, len, &w).unwrap();
        assert_eq!(
            ghash(&ep, conn, off, len),
            pattern_hash(off, len, 40 + i as u8)
        );
        assert_eq!(ask(&ep, conn, &format!("gfill {off} {len} 9")), "ok");
        ep.read(conn, &local, off, len, &w).unwrap();
        assert_eq!(
            check_pattern(&gpu_bytes(&local, off, len), off as u64, 9),
            None
        );
    }
}

/// Two-sided GPU messages on one host in a request loop (each receive
/// posted once the last ended, the sender ahead or behind: UCCL's
/// benchmark) go through the receiver's GPU bounce slots
/// (`FERRY_MSG_BOUNCE_GPU_SLOTS=16`): the receiver's shard copies each
/// message into a slot (a same-host WRITE), then out into its buffer (a
/// local copy); both lone copies, the runner's. Sizes about the slot (64 KiB: past it
/// the usual way), one longer than its buffer (both sides fail, the slot
/// is freed), one into host memory (sent again the usual way): every
/// other message lands byte-exact with its length on both sides.
#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu_pieces -- --ignored)"]
fn lone_copies_carry_two_sided_gpu_messages_through_bounce_slots() {
    const N: usize = 240;
    const SLOT: usize = 70_000;
    let sizes = [4096usize, 256, 65536, 65537, 1, 30_001, 4099];
    let a = Endpoint::builder()
        .config(cfg(GpuCopy::Auto))
        .build()
        .unwrap();
    let mut with_slots = cfg(GpuCopy::Auto);
    with_slots.msg_bounce_gpu_slots = 16;
    let b = Endpoint::builder().config(with_slots).build().unwrap();
    b.start_passive_accept().unwrap();
    let ca = a.add_remote(&b.metadata_bytes()).unwrap();
    let (cb, _) = b.accept(std::time::Duration::from_secs(10)).unwrap();
    let src = a.alloc_gpu(N * SLOT).unwrap();
    let dst = b.alloc_gpu(N * SLOT).unwrap();
    let host = b.alloc(SLOT).unwrap();
    gpu_fill(&src, 0, N * SLOT, 5);
    // One thread plays both sides: each side's calls move its part.
    let both = |r, s| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let (mut got, mut sent) = (None, None);
        while got.is_none() || sent.is_none() {
            assert!(std::time::Instant::now() < deadline, "a message took 10 s");
            got = got.or_else(|| b.poll_message(r));
            sent = sent.or_else(|| a.poll_message(s));
        }
        (got.unwrap(), sent.unwrap())
    };
    for i in 0..N {
        let len = sizes[i % sizes.len()];
        let (too_long, to_host) = (i == 100, i == 150);
        let max = if too_long { len - 1 } else { SLOT };
        let post = |b: &Endpoint| match to_host {
            true => b.recv_async(cb, &host, 0, max).unwrap(),
            false => b.recv_async(cb, &dst, i * SLOT, max).unwrap(),
        };
        let (s, r) = if i % 3 == 0 {
            let r = post(&b);
            (a.send_async(ca, &src, i * SLOT, len).unwrap(), r)
        } else {
            let s = a.send_async(ca, &src, i * SLOT, len).unwrap();
            std::thread::sleep(std::time::Duration::from_micros(20 * (i % 4) as u64));
            (s, post(&b))
        };
        let (got, sent) = both(r, s);
        if too_long {
            for e in [got, sent] {
                assert!(
                    matches!(e, Err(ferry::Error::MessageTooLarge { .. })),
                    "{i}: {e:?}"
                );
            }
            continue;
        }
        assert_eq!((got.unwrap(), sent.unwrap()), (len, len), "message {i}");
        let back = if to_host {
            let mut v = vec![0u8; len];
            host.read_at(0, &mut v).unwrap();
            v
        } else {
            gpu_bytes(&dst, i * SLOT, len)
        };
        assert_eq!(
            check_pattern(&back, (i * SLOT) as u64, 5),
            None,
            "message {i} of {len}"
        );
    }
    // The last answer may still be on its way to the sender (its send
    // ended on the offer): its calls take it in (a message of its own,
    // never received, is the handle it polls).
    let one = a.alloc(1).unwrap();
    let handle = a.send_async(ca, &one, 0, 1).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while a.metrics().bounced_out != b.metrics().bounced_in {
        assert!(std::time::Instant::now() < deadline, "answers never came");
        assert!(a.poll_message(handle).is_none());
    }
    let out = a.metrics().bounced_out;
    assert!(out >= 100, "{out} messages through the slots");
}

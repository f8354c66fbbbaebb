//! The GPU path: devices, pointer classification, CUDA IPC between two
//! processes and within one, the handle cache and revocation.
//!
//! Every test here needs a CUDA driver with a GPU, so each is
//! `#[ignore]`d: run them with `cargo test --test gpu -- --ignored` where
//! there is one (they fail, not pass, where there is none). Two GPUs
//! (NVLink or not) exercise GPU0 -> GPU1.

mod common;

use std::time::{Duration, Instant};

use common::{ask, Path, Target};
use ferry::{Config, ConnId, Endpoint, Error, IpcBuf, MemKind, MemoryRegion, Mode, Transport};
use ferry_cli::testkit::{check_pattern, fill_pattern, fnv64};

/// The number of GPUs; a test that was asked to run (`--ignored`) on a
/// machine without one fails here, saying why.
fn gpus() -> usize {
    match ferry::gpu::cuda() {
        Ok(c) if !c.devices.is_empty() => c.devices.len(),
        Ok(_) => panic!("GPU test run (--ignored) but the driver lists no GPU"),
        Err(e) => panic!("GPU test run (--ignored) without a GPU: {e}"),
    }
}

fn cfg(gpu: usize) -> Config {
    {
        let mut conf = Config::default();
        conf.listen_addr = "127.0.0.1".parse().unwrap();
        conf.gpu = Some(gpu);
        conf
    }
}

fn peer_gpu(n: usize) -> usize {
    if n >= 2 {
        1
    } else {
        0
    }
}

/// Fills `len` bytes of GPU region `mr` at `off` with the pattern.
fn gpu_fill(mr: &MemoryRegion, off: usize, len: usize, seed: u8) {
    let mut b = vec![0u8; len];
    fill_pattern(&mut b, off as u64, seed);
    mr.write_at(off, &b).unwrap();
}

/// Reads `len` bytes of GPU region `mr` at `off`.
fn gpu_bytes(mr: &MemoryRegion, off: usize, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    mr.read_at(off, &mut b).unwrap();
    b
}

fn ghash(ep: &Endpoint, conn: ConnId, off: usize, len: usize) -> u64 {
    let a = ask(ep, conn, &format!("ghash {off} {len}"));
    u64::from_str_radix(a.strip_prefix("hash ").expect(&a), 16).unwrap()
}

fn pattern_hash(off: usize, len: usize, seed: u8) -> u64 {
    let mut b = vec![0u8; len];
    fill_pattern(&mut b, off as u64, seed);
    fnv64(&b)
}

struct Pair {
    ep: Endpoint,
    conn: ConnId,
    remote: IpcBuf,
    _target: Target,
}

fn pair(n: usize, bytes: usize) -> Pair {
    let g = peer_gpu(n).to_string();
    let target = Target::start_with(Path::Shm, bytes, &[], &["--gpu", &g]);
    let ep = Endpoint::builder().config(cfg(0)).build().unwrap();
    let conn = ep.add_remote(&target.served.meta).unwrap();
    assert!(
        matches!(ep.peer(conn), Some(ferry::Peer::Local { .. })),
        "same-host peer expected"
    );
    let remote = target.served.ipc.expect("IPCBUF line");
    Pair {
        ep,
        conn,
        remote,
        _target: target,
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn devices_bus_ids_and_gpu_choice() {
    let n = gpus();
    let c = ferry::gpu::cuda().unwrap();
    for d in &c.devices {
        let b = &d.bus_id;
        println!("GPU {}: {} at {b}", d.ordinal, d.name);
        assert_eq!(b.len(), 12, "bus id {b:?}");
        assert_eq!(b, &ferry::gpu::normalize_bus_id(b));
        assert_eq!(b, &b.to_ascii_lowercase());
    }
    match Endpoint::builder().config(cfg(n)).build() {
        Err(Error::GpuOutOfRange { idx, count }) => assert_eq!((idx, count), (n, n)),
        other => panic!("expected GpuOutOfRange, got {:?}", other.map(|_| ())),
    }
    let ep = Endpoint::builder().config(cfg(0)).build().unwrap();
    assert_eq!(ep.gpu(), Some(0));
    assert_eq!(ep.metadata().gpu_bdf, c.devices[0].bus_id);
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn pointers_are_classified_and_lazy_mode_picks_the_gpu() {
    let n = gpus();
    let last = n - 1;
    // Lazy endpoint: no GPU until a GPU pointer is registered.
    let lazy = Endpoint::builder()
        .config({
            let mut conf = Config::default();
            conf.listen_addr = "127.0.0.1".parse().unwrap();
            conf
        })
        .build()
        .unwrap();
    assert_eq!(lazy.gpu(), None);
    let host = lazy.alloc(4096).unwrap();
    assert_eq!(lazy.mem_kind(&host), MemKind::Host);
    assert_eq!(lazy.gpu(), None);
    let owner = Endpoint::builder().config(cfg(last)).build().unwrap();
    let big = owner.alloc_gpu(3 << 20).unwrap();
    let MemKind::Device {
        ordinal,
        alloc_base,
        alloc_len,
    } = owner.mem_kind(&big)
    else {
        panic!("alloc_gpu gave {:?}", owner.mem_kind(&big))
    };
    assert_eq!((ordinal, alloc_base), (last as i32, big.addr()));
    assert!(alloc_len >= 3 << 20);
    // A pointer inside the allocation: the driver's base, not the pointer.
    // SAFETY: `big` outlives `inner`, which is deregistered first.
    let inner = unsafe {
        lazy.register_raw(
            (big.addr() + 12345) as *mut u8,
            1 << 20,
            ferry::Access::all(),
        )
    }
    .unwrap();
    assert_eq!(
        lazy.mem_kind(&inner),
        MemKind::Device {
            ordinal: last as i32,
            alloc_base: big.addr(),
            alloc_len
        }
    );
    assert_eq!(
        lazy.gpu(),
        Some(last),
        "the first GPU pointer picks the GPU"
    );
    lazy.deregister(inner).unwrap();
    let pinned = lazy.alloc_pinned(1 << 20).unwrap();
    assert_eq!(lazy.mem_kind(&pinned), MemKind::Pinned);
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn ipc_between_processes_is_byte_exact() {
    let n = gpus();
    let p = pair(n, 64 << 20);
    let local = p.ep.alloc_gpu(64 << 20).unwrap();
    let cases = [
        (0usize, 1usize),
        (7, 4095),
        (4096, 4096),
        (1 << 20, (1 << 20) + 13),
        (3, 16 << 20),
        (333, 40 << 20), // split across the stream pool
    ];
    for (i, &(off, len)) in cases.iter().enumerate() {
        let seed = 10 + i as u8;
        gpu_fill(&local, off, len, seed);
        let w = p.remote.slice(off as u64, len as u64).unwrap();
        p.ep.write(p.conn, &local, off, len, &w).unwrap();
        assert_eq!(
            ghash(&p.ep, p.conn, off, len),
            pattern_hash(off, len, seed),
            "write_ipc {len} B at {off}"
        );
        let seed = 100 + i as u8;
        assert_eq!(
            ask(&p.ep, p.conn, &format!("gfill {off} {len} {seed}")),
            "ok"
        );
        p.ep.read(p.conn, &local, off, len, &w).unwrap();
        let got = gpu_bytes(&local, off, len);
        assert_eq!(
            check_pattern(&got, off as u64, seed),
            None,
            "read_ipc {len} B at {off}"
        );
    }
    // Vectored, and many async ops waited newest-first.
    let v: Vec<(&MemoryRegion, usize, usize)> =
        (0..8).map(|k| (&local, k * 8192 + 5, 3000)).collect();
    let rs: Vec<IpcBuf> = (0..8)
        .map(|k| p.remote.slice((k * 8192 + 5) as u64, 3000).unwrap())
        .collect();
    gpu_fill(&local, 0, 8 * 8192, 77);
    p.ep.writev(p.conn, &v, &rs).unwrap();
    for k in 0..8 {
        let off = k * 8192 + 5;
        assert_eq!(ghash(&p.ep, p.conn, off, 3000), pattern_hash(off, 3000, 77));
    }
    assert_eq!(ask(&p.ep, p.conn, "gfill 0 65536 78"), "ok");
    p.ep.readv(p.conn, &v, &rs).unwrap();
    for k in 0..8 {
        let off = k * 8192 + 5;
        assert_eq!(
            check_pattern(&gpu_bytes(&local, off, 3000), off as u64, 78),
            None
        );
    }
    gpu_fill(&local, 0, 64 * 4096, 79);
    let ts: Vec<_> = (0..64)
        .map(|k| {
            let w = p.remote.slice(k * 4096, 4096).unwrap();
            p.ep.write_async(p.conn, &local, k as usize * 4096, 4096, &w)
                .unwrap()
        })
        .collect();
    for t in ts.into_iter().rev() {
        t.wait().unwrap();
    }
    assert_eq!(
        ghash(&p.ep, p.conn, 0, 64 * 4096),
        pattern_hash(0, 64 * 4096, 79)
    );
    // Pinned host memory -> the peer's GPU, and back.
    let pinned = p.ep.alloc_pinned(1 << 20).unwrap();
    let mut b = vec![0u8; 1 << 20];
    fill_pattern(&mut b, 0, 80);
    pinned.write_at(0, &b).unwrap();
    p.ep.write(p.conn, &pinned, 0, 1 << 20, &p.remote).unwrap();
    assert_eq!(
        ghash(&p.ep, p.conn, 0, 1 << 20),
        pattern_hash(0, 1 << 20, 80)
    );
    assert_eq!(ask(&p.ep, p.conn, "gfill 0 1048576 81"), "ok");
    p.ep.read(p.conn, &pinned, 0, 1 << 20, &p.remote).unwrap();
    pinned.read_at(0, &mut b).unwrap();
    assert_eq!(check_pattern(&b, 0, 81), None);
    let s = p.ep.ipc_stats();
    println!("ipc stats after the suite: {s:?}");
    assert_eq!(s.opens, 1, "one open for one allocation: {s:?}");
    assert!(s.hits >= 90, "repeated transfers hit the cache: {s:?}");
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn ipc_256_mib_is_byte_exact() {
    let n = gpus();
    let len = 256 << 20;
    let p = pair(n, len);
    let local = p.ep.alloc_gpu(len).unwrap();
    gpu_fill(&local, 0, len, 5);
    p.ep.write(p.conn, &local, 0, len, &p.remote).unwrap();
    assert_eq!(ghash(&p.ep, p.conn, 0, len), pattern_hash(0, len, 5));
    assert_eq!(ask(&p.ep, p.conn, &format!("gfill 0 {len} 6")), "ok");
    p.ep.read(p.conn, &local, 0, len, &p.remote).unwrap();
    assert_eq!(check_pattern(&gpu_bytes(&local, 0, len), 0, 6), None);
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn deregistration_closes_peer_mappings() {
    let n = gpus();
    let p = pair(n, 1 << 20);
    let local = p.ep.alloc_gpu(1 << 20).unwrap();
    for _ in 0..10 {
        p.ep.write(p.conn, &local, 0, 4096, &p.remote).unwrap();
    }
    let s = p.ep.ipc_stats();
    assert_eq!((s.opens, s.open_now), (1, 1), "{s:?}");
    assert_eq!(s.hits, 9, "{s:?}");
    assert_eq!(ask(&p.ep, p.conn, "drop-gpu"), "ok");
    let deadline = Instant::now() + Duration::from_secs(5);
    while p.ep.ipc_stats().open_now != 0 {
        assert!(
            Instant::now() < deadline,
            "mapping still open: {:?}",
            p.ep.ipc_stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let s = p.ep.ipc_stats();
    assert_eq!(s.closes, 1, "{s:?}");
    println!("after the owner deregistered: {s:?}");
    // Removing the peer closes whatever is still open (nothing here).
    p.ep.remove_remote(p.conn).unwrap();
    assert_eq!(p.ep.ipc_stats().open_now, 0);
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn a_new_allocation_after_deregistration_gets_a_fresh_mapping() {
    // The owner frees its allocation and makes a new one (often at the same
    // base): our writes must land in the new one, through a new mapping.
    let n = gpus();
    let mut p = pair(n, 1 << 20);
    let local = p.ep.alloc_gpu(1 << 20).unwrap();
    gpu_fill(&local, 0, 1 << 20, 41);
    p.ep.write(p.conn, &local, 0, 4096, &p.remote).unwrap();
    assert_eq!(p.ep.ipc_stats().opens, 1);
    assert_eq!(ask(&p.ep, p.conn, "drop-gpu"), "ok");
    let reply = ask(&p.ep, p.conn, "new-gpu");
    let hex = reply
        .strip_prefix("ipcbuf ")
        .unwrap_or_else(|| panic!("{reply}"));
    let fresh = IpcBuf::decode(&ferry_cli::testkit::unhex(hex).unwrap()).unwrap();
    println!(
        "old base {:#x}, new base {:#x} (same: {})",
        p.remote.alloc_base,
        fresh.alloc_base,
        p.remote.alloc_base == fresh.alloc_base
    );
    p.remote = fresh;
    for (off, len, seed) in [(0usize, 1usize << 20, 42u8), (4099, 5000, 43)] {
        gpu_fill(&local, off, len, seed);
        let w = p.remote.slice(off as u64, len as u64).unwrap();
        p.ep.write(p.conn, &local, off, len, &w).unwrap();
        assert_eq!(
            ghash(&p.ep, p.conn, off, len),
            pattern_hash(off, len, seed),
            "write of {len} B at {off} into the new allocation"
        );
    }
    let s = p.ep.ipc_stats();
    assert_eq!(s.opens, 2, "the new allocation was opened afresh: {s:?}");
    assert_eq!(s.open_now, 1, "the old mapping is closed: {s:?}");
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn peer_removal_closes_its_mappings() {
    let n = gpus();
    let p = pair(n, 1 << 20);
    let local = p.ep.alloc_gpu(1 << 20).unwrap();
    p.ep.read(p.conn, &local, 0, 4096, &p.remote).unwrap();
    assert_eq!(p.ep.ipc_stats().open_now, 1);
    p.ep.remove_remote(p.conn).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while p.ep.ipc_stats().open_now != 0 {
        assert!(Instant::now() < deadline, "{:?}", p.ep.ipc_stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    // The connection is gone: IPC on it fails like any op.
    match p.ep.write(p.conn, &local, 0, 4096, &p.remote) {
        Err(Error::UnknownConn { .. }) | Err(Error::ConnFailed { .. }) => {}
        other => panic!("expected a connection error, got {other:?}"),
    }
}

/// Two endpoints in this process (on GPU 0 and the peer GPU), `a`
/// connected to `b`.
fn same_process_pair() -> (Endpoint, Endpoint, ConnId) {
    let n = gpus();
    let a = Endpoint::builder().config(cfg(0)).build().unwrap();
    let b = Endpoint::builder()
        .config(cfg(peer_gpu(n)))
        .build()
        .unwrap();
    b.start_passive_accept().unwrap();
    let conn = a.add_remote(&b.metadata_bytes()).unwrap();
    (a, b, conn)
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn same_process_needs_no_handle() {
    let (a, b, conn) = same_process_pair();
    let dst = b.alloc_gpu(1 << 20).unwrap();
    let win = dst.advertise_ipc(4096, 65536).unwrap();
    let src = a.alloc_gpu(1 << 20).unwrap();
    gpu_fill(&src, 0, 65536, 9);
    a.write(conn, &src, 0, 65536, &win).unwrap();
    assert_eq!(check_pattern(&gpu_bytes(&dst, 4096, 65536), 0, 9), None);
    let s = a.ipc_stats();
    assert_eq!((s.opens, s.same_process), (0, 1), "{s:?}");
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn ipc_ops_carry_a_notification_sent_after_their_data() {
    let (a, b, conn) = same_process_pair();
    let far = b.alloc_gpu(8 << 20).unwrap();
    let win = far.advertise_ipc(0, 8 << 20).unwrap();
    let near = a.alloc_gpu(8 << 20).unwrap();
    for (i, kind) in [ferry::OpKind::Write, ferry::OpKind::Read]
        .into_iter()
        .enumerate()
    {
        let seed = 40 + i as u8;
        let len = (6 << 20) + 7;
        if kind == ferry::OpKind::Write {
            gpu_fill(&near, 0, len, seed);
        } else {
            gpu_fill(&far, 0, len, seed);
        }
        let note = format!("done {i}");
        let t = a
            .transfer_notify_async(conn, kind, &[(&near, 0, len)], &[win], note.as_bytes())
            .unwrap();
        // Released unwatched: the note still comes, after the bytes.
        drop(t);
        let (_, got) = b.recv_notification(Duration::from_secs(10)).unwrap();
        assert_eq!(got, note.as_bytes());
        let landed = if kind == ferry::OpKind::Write {
            &far
        } else {
            &near
        };
        assert_eq!(
            check_pattern(&gpu_bytes(landed, 0, len), 0, seed),
            None,
            "{kind:?}"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn ipc_refuses_bad_requests_with_clear_errors() {
    let n = gpus();
    let p = pair(n, 1 << 20);
    let gpu = p.ep.alloc_gpu(1 << 20).unwrap();
    let host = p.ep.alloc(1 << 20).unwrap();
    // advertise_ipc of host memory.
    assert!(matches!(
        host.advertise_ipc(0, 10),
        Err(Error::Unsupported { .. })
    ));
    // Longer than the window; outside the local region.
    let w = p.remote.slice(0, 100).unwrap();
    assert!(matches!(
        p.ep.write(p.conn, &gpu, 0, 101, &w),
        Err(Error::RemoteTooSmall { len: 101, .. })
    ));
    assert!(matches!(
        p.ep.write(p.conn, &gpu, (1 << 20) - 10, 11, &p.remote),
        Err(Error::OutOfRange { .. })
    ));
    // A window from another host.
    let mut foreign = p.remote;
    foreign.host_token ^= 1;
    assert!(matches!(
        p.ep.write(p.conn, &gpu, 0, 8, &foreign),
        Err(Error::Unsupported { .. })
    ));
    // A window of an endpoint this connection does not lead to.
    let mut other = p.remote;
    other.owner_id ^= 1;
    assert!(matches!(
        p.ep.write(p.conn, &gpu, 0, 8, &other),
        Err(Error::Unsupported { .. })
    ));
    // An unknown connection.
    assert!(matches!(
        p.ep.advertise_ipc(ConnId(999_999), &gpu, 0, 8),
        Err(Error::UnknownConn { .. })
    ));
    // GPU memory on the tcp path: staged by the target, bytes intact.
    let b = Endpoint::builder()
        .config({
            let mut conf = cfg(0);
            conf.transport = Transport::Tcp;
            conf.mode = Mode::Managed;
            conf
        })
        .build()
        .unwrap();
    b.start_passive_accept().unwrap();
    let c2 = p.ep.add_remote(&b.metadata_bytes()).unwrap();
    let bg = b.alloc_gpu(4096).unwrap();
    host.write_at(0, b"gpu-tcp!").unwrap();
    p.ep.write(c2, &host, 0, 8, &bg.advertise(0, 4096).unwrap())
        .unwrap();
    assert_eq!(gpu_bytes(&bg, 0, 8), b"gpu-tcp!");
    // The connection still works, and a good IPC op after the errors too.
    p.ep.write(p.conn, &gpu, 0, 8, &p.remote).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn plain_write_read_use_cuda_between_local_gpus() {
    let n = gpus();
    let p = pair(n, 32 << 20);
    let grb = p._target.served.gpu_rbuf.expect("GRBUF line");
    assert!(grb.is_device(), "a GPU window is marked as such");
    let hrb = p._target.served.rbuf;
    let gpu = p.ep.alloc_gpu(32 << 20).unwrap();
    // GPU -> peer GPU and back, through the ordinary write/read.
    for (i, &(off, len)) in [(0usize, 8usize), (5, 176), (4099, 100_000), (1, 20 << 20)]
        .iter()
        .enumerate()
    {
        let seed = 30 + i as u8;
        gpu_fill(&gpu, off, len, seed);
        let w = grb.slice(off as u32, len as u32).unwrap();
        p.ep.write(p.conn, &gpu, off, len, &w).unwrap();
        assert_eq!(ghash(&p.ep, p.conn, off, len), pattern_hash(off, len, seed));
        let seed = 60 + i as u8;
        assert_eq!(
            ask(&p.ep, p.conn, &format!("gfill {off} {len} {seed}")),
            "ok"
        );
        p.ep.read(p.conn, &gpu, off, len, &w).unwrap();
        assert_eq!(
            check_pattern(&gpu_bytes(&gpu, off, len), off as u64, seed),
            None
        );
    }
    // Our GPU memory -> the peer's host memory, and back.
    gpu_fill(&gpu, 0, 1 << 20, 90);
    p.ep.write(p.conn, &gpu, 0, 1 << 20, &hrb).unwrap();
    assert_eq!(
        common::remote_hash(&p.ep, p.conn, 0, 1 << 20),
        pattern_hash(0, 1 << 20, 90)
    );
    assert_eq!(ask(&p.ep, p.conn, "fill 0 100 91"), "ok");
    p.ep.read(p.conn, &gpu, 0, 100, &hrb).unwrap();
    assert_eq!(check_pattern(&gpu_bytes(&gpu, 0, 100), 0, 91), None);
    // Our memfd host memory -> the peer's GPU, and back.
    let shared = p.ep.alloc_host(1 << 20).unwrap();
    let mut b = vec![0u8; 1 << 20];
    fill_pattern(&mut b, 0, 92);
    shared.write_at(0, &b).unwrap();
    p.ep.write(p.conn, &shared, 0, 1 << 20, &grb).unwrap();
    assert_eq!(
        ghash(&p.ep, p.conn, 0, 1 << 20),
        pattern_hash(0, 1 << 20, 92)
    );
    p.ep.read(p.conn, &shared, 0, 64, &grb.slice(4096, 64).unwrap())
        .unwrap();
    shared.read_at(0, &mut b[..64]).unwrap();
    assert_eq!(check_pattern(&b[..64], 4096, 92), None);
    // Private host memory cannot be reached by the peer's GPU copy: a clear
    // refusal, and the connection stays usable.
    let private = p.ep.alloc(4096).unwrap();
    match p.ep.write(p.conn, &private, 0, 8, &grb) {
        Err(Error::Remote { status, .. }) => assert_eq!(status, ferry::wire::Status::PeerMemory),
        other => panic!("expected PeerMemory, got {other:?}"),
    }
    p.ep.write(p.conn, &gpu, 0, 8, &grb).unwrap();
    // Many async GPU writes at once.
    gpu_fill(&gpu, 0, 256 * 4096, 93);
    let ts: Vec<_> = (0..256u32)
        .map(|k| {
            let w = grb.slice(k * 4096, 4096).unwrap();
            p.ep.write_async(p.conn, &gpu, k as usize * 4096, 4096, &w)
                .unwrap()
        })
        .collect();
    for t in ts {
        t.wait().unwrap();
    }
    assert_eq!(
        ghash(&p.ep, p.conn, 0, 256 * 4096),
        pattern_hash(0, 256 * 4096, 93)
    );
}

/// GPU memory on both sides of a tcp connection (pinned bounce buffers),
/// and GPU <-> host, with `env` applied to both processes.
fn tcp_gpu_round(env: &[(&str, &str)], sizes: &[(usize, usize)]) {
    let n = gpus();
    let mut tenv = vec![("FERRY_TRANSPORT", "tcp")];
    tenv.extend_from_slice(env);
    let g = peer_gpu(n).to_string();
    let target = Target::start_with(Path::TcpEpoll, 64 << 20, &tenv, &["--gpu", &g]);
    let mut c = {
        let mut conf = cfg(0);
        conf.transport = Transport::Tcp;
        conf
    };
    for (k, v) in env {
        match *k {
            "FERRY_CHUNK_BYTES" => c.chunk_bytes = v.parse().unwrap(),
            "FERRY_GPU_BOUNCE_BYTES" => c.gpu_bounce_bytes = v.parse().unwrap(),
            _ => panic!("unexpected {k}"),
        }
    }
    let ep = Endpoint::builder().config(c).build().unwrap();
    let conn = ep.add_remote(&target.served.meta).unwrap();
    assert!(matches!(ep.peer(conn), Some(ferry::Peer::Net(_))));
    let grb = target.served.gpu_rbuf.expect("GRBUF");
    let gpu = ep.alloc_gpu(64 << 20).unwrap();
    for (i, &(off, len)) in sizes.iter().enumerate() {
        let seed = 20 + i as u8;
        gpu_fill(&gpu, off, len, seed);
        let w = grb.slice(off as u32, len as u32).unwrap();
        ep.write(conn, &gpu, off, len, &w).unwrap();
        assert_eq!(
            ghash(&ep, conn, off, len),
            pattern_hash(off, len, seed),
            "tcp GPU write {len} at {off}"
        );
        let seed = 120 + i as u8;
        assert_eq!(ask(&ep, conn, &format!("gfill {off} {len} {seed}")), "ok");
        ep.read(conn, &gpu, off, len, &w).unwrap();
        assert_eq!(
            check_pattern(&gpu_bytes(&gpu, off, len), off as u64, seed),
            None,
            "tcp GPU read {len} at {off}"
        );
    }
    // Host memory here <-> the peer's GPU, our GPU <-> the peer's host memory.
    let host = ep.alloc(1 << 20).unwrap();
    let mut b = vec![0u8; 1 << 20];
    fill_pattern(&mut b, 0, 7);
    host.write_at(0, &b).unwrap();
    ep.write(conn, &host, 0, 1 << 20, &grb).unwrap();
    assert_eq!(ghash(&ep, conn, 0, 1 << 20), pattern_hash(0, 1 << 20, 7));
    ep.read(conn, &gpu, 0, 1 << 20, &target.served.rbuf)
        .unwrap();
    let mut want = vec![0u8; 1 << 20];
    fill_pattern(&mut want, 0, 0); // serve's host region pattern, seed 0
    assert_eq!(gpu_bytes(&gpu, 0, 1 << 20), want);
    // Many small GPU ops in flight at once, waited newest-first.
    gpu_fill(&gpu, 0, 128 * 4096, 8);
    let ts: Vec<_> = (0..128u32)
        .map(|k| {
            let w = grb.slice(k * 4096, 4096).unwrap();
            ep.write_async(conn, &gpu, k as usize * 4096, 4096, &w)
                .unwrap()
        })
        .collect();
    for t in ts.into_iter().rev() {
        t.wait().unwrap();
    }
    assert_eq!(
        ghash(&ep, conn, 0, 128 * 4096),
        pattern_hash(0, 128 * 4096, 8)
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn gpu_memory_over_tcp_is_byte_exact() {
    tcp_gpu_round(
        &[],
        &[(0, 1), (13, 4097), (1 << 20, (5 << 20) + 3), (7, 40 << 20)],
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn gpu_memory_over_tcp_with_few_bounce_buffers() {
    // 1 MiB chunks and 2 bounce buffers per side: transfers wait for
    // buffers on both sides (the `Busy` paths) and still finish intact.
    tcp_gpu_round(
        &[
            ("FERRY_CHUNK_BYTES", "1048576"),
            ("FERRY_GPU_BOUNCE_BYTES", "2097152"),
        ],
        &[(3, 9 << 20), (0, 32 << 20)],
    );
}

/// `read_at`/`write_at` are safe for every memory kind: on GPU memory they
/// copy through the driver (never a CPU dereference of a device pointer),
/// and a bad range is a typed error.
#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn read_at_and_write_at_work_on_gpu_memory() {
    let _ = gpus();
    let ep = Endpoint::builder().config(cfg(0)).build().unwrap();
    let mr = ep.alloc_gpu(3 << 20).unwrap();
    assert!(matches!(ep.mem_kind(&mr), MemKind::Device { .. }));
    let mut src = vec![0u8; (1 << 20) + 7];
    fill_pattern(&mut src, 5, 77);
    mr.write_at(5, &src).unwrap();
    let mut back = vec![0u8; src.len()];
    mr.read_at(5, &mut back).unwrap();
    assert_eq!(check_pattern(&back, 5, 77), None);
    let mut one = [0u8; 1];
    mr.read_at((3 << 20) - 1, &mut one).unwrap();
    assert!(matches!(
        mr.read_at(3 << 20, &mut one),
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        mr.write_at((3 << 20) - 1, &[1, 2]),
        Err(Error::OutOfRange { .. })
    ));
}

/// Without a driver, GPU requests are typed errors (this runs everywhere:
/// on a GPU machine it checks the other side of the same promise).
#[test]
fn gpu_allocation_says_why_without_a_driver() {
    // No GPU named: an endpoint starts anywhere, and GPU work picks GPU 0.
    let mut c = Config::default();
    c.listen_addr = "127.0.0.1".parse().unwrap();
    let ep = Endpoint::builder().config(c).build().unwrap();
    match ferry::gpu::cuda() {
        Err(why) => {
            assert!(matches!(why, Error::NoGpu { .. }), "{why:?}");
            let e = ep.alloc_gpu(4096).unwrap_err();
            assert!(matches!(e, Error::NoGpu { .. }), "{e:?}");
        }
        Ok(c) if c.devices.is_empty() => {
            assert!(ep.alloc_gpu(4096).is_err());
        }
        Ok(_) => {
            let mr = ep.alloc_gpu(4096).unwrap();
            mr.write_at(0, &[9u8; 16]).unwrap();
            let mut b = [0u8; 16];
            mr.read_at(0, &mut b).unwrap();
            assert_eq!(b, [9u8; 16]);
        }
    }
}

/// A target serving `bytes` of GPU memory (its GPU: the peer GPU) over
/// tcp only, and a client endpoint on GPU 0 connected to it.
fn tcp_gpu_pair(bytes: usize) -> (Target, Endpoint, ConnId) {
    let n = gpus();
    let g = peer_gpu(n).to_string();
    let target = Target::start_with(
        Path::TcpEpoll,
        bytes,
        &[("FERRY_TRANSPORT", "tcp")],
        &["--gpu", &g],
    );
    let mut c = cfg(0);
    c.transport = Transport::Tcp;
    let ep = Endpoint::builder().config(c).build().unwrap();
    let conn = ep.add_remote(&target.served.meta).unwrap();
    (target, ep, conn)
}

/// GPU memory that CUDA cannot export over IPC (a stream-ordered pool's,
/// `cuMemAllocAsync`) still moves over tcp: nothing is exported for a
/// connection that is not same-host.
#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn pool_memory_that_cannot_be_exported_moves_over_tcp() {
    use cudarc::driver::sys as cu;
    let (target, ep, conn) = tcp_gpu_pair(8 << 20);
    let len = 8usize << 20;
    let mut ptr: cu::CUdeviceptr = 0;
    common::primary_context_current();
    // SAFETY: plain driver calls on device 0's primary context (retained
    // by ferry); the pointer is freed below, after its deregistration.
    unsafe {
        assert_eq!(
            cu::cuMemAllocAsync(&mut ptr, len, std::ptr::null_mut()),
            cu::CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            cu::cuStreamSynchronize(std::ptr::null_mut()),
            cu::CUresult::CUDA_SUCCESS
        );
        // What the old code demanded, and CUDA refuses for pool memory.
        let mut h: cu::CUipcMemHandle = std::mem::zeroed();
        assert_ne!(
            cu::cuIpcGetMemHandle(&mut h, ptr),
            cu::CUresult::CUDA_SUCCESS,
            "this driver exports pool memory; the test proves nothing here"
        );
    }
    // SAFETY: the allocation outlives the registration (freed after it).
    let mr = unsafe { ep.register_raw(ptr as *mut u8, len, ferry::Access::all()) }.unwrap();
    assert!(matches!(ep.mem_kind(&mr), MemKind::Device { .. }));
    let grb = target.served.gpu_rbuf.expect("GRBUF");
    gpu_fill(&mr, 0, len, 61);
    ep.write(conn, &mr, 0, len, &grb.slice(0, len as u32).unwrap())
        .unwrap();
    assert_eq!(ghash(&ep, conn, 0, len), pattern_hash(0, len, 61));
    ep.deregister(mr).unwrap();
    // SAFETY: deregistered above; nothing uses the memory any more.
    unsafe {
        cu::cuMemFreeAsync(ptr, std::ptr::null_mut());
        cu::cuStreamSynchronize(std::ptr::null_mut());
    }
}

/// `flush_rdma_writes` is a real driver call on each GPU with registered
/// memory (`cuFlushGPUDirectRDMAWrites`, owner scope): it succeeds on this
/// GPU once device memory is registered, and is a no-op before; data
/// written to the memory stays as it was.
#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn rdma_write_flush_runs_on_registered_gpus() {
    gpus();
    let ep = Endpoint::builder().config(cfg(0)).build().unwrap();
    ep.flush_rdma_writes().unwrap();
    let mr = ep.alloc_gpu(1 << 20).unwrap();
    gpu_fill(&mr, 0, 65536, 3);
    ep.flush_rdma_writes().unwrap();
    assert_eq!(check_pattern(&gpu_bytes(&mr, 0, 65536), 0, 3), None);
}

/// Many small GPU-memory ops in flight over tcp at once: their staging
/// copies go out in batches (the gather kernel, where it loads), both the
/// 16-byte word path (aligned) and the byte path (odd offsets and
/// lengths), WRITE and READ, each op's bytes exact and nothing beside
/// them touched.
#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn many_small_gpu_ops_over_tcp_are_byte_exact_at_odd_offsets() {
    let (target, ep, conn) = tcp_gpu_pair(64 << 20);
    let grb = target.served.gpu_rbuf.expect("GRBUF");
    let gpu = ep.alloc_gpu(16 << 20).unwrap();
    let lens = [
        1usize, 3, 16, 17, 255, 4095, 4096, 4097, 8192, 65_535, 65_536, 65_537,
    ];
    let mut ops = Vec::new();
    let mut off = 0usize;
    for k in 0..240usize {
        let len = lens[k % lens.len()];
        // Every third op at an odd offset: the byte path.
        if k % 3 == 1 {
            off += 5;
        }
        ops.push((off, len));
        off = (off + len + 31) & !15;
    }
    assert!(off < 16 << 20);
    // WRITE: the peer's bytes outside the ops keep its fill.
    assert_eq!(ask(&ep, conn, &format!("gfill 0 {} 77", 16 << 20)), "ok");
    gpu_fill(&gpu, 0, 16 << 20, 5);
    let ts: Vec<_> = ops
        .iter()
        .map(|&(o, l)| {
            let w = grb.slice(o as u32, l as u32).unwrap();
            ep.write_async(conn, &gpu, o, l, &w).unwrap()
        })
        .collect();
    for t in ts {
        t.wait().unwrap();
    }
    let mut at = 0;
    for &(o, l) in &ops {
        assert_eq!(
            ghash(&ep, conn, o, l),
            pattern_hash(o, l, 5),
            "WRITE of {l} at {o}"
        );
        if o > at {
            assert_eq!(
                ghash(&ep, conn, at, o - at),
                pattern_hash(at, o - at, 77),
                "gap at {at}"
            );
        }
        at = o + l;
    }
    // READ into a region whose other bytes must stay as they were.
    assert_eq!(ask(&ep, conn, &format!("gfill 0 {} 91", 16 << 20)), "ok");
    gpu_fill(&gpu, 0, 16 << 20, 6);
    let ts: Vec<_> = ops
        .iter()
        .map(|&(o, l)| {
            let w = grb.slice(o as u32, l as u32).unwrap();
            ep.read_async(conn, &gpu, o, l, &w).unwrap()
        })
        .collect();
    for t in ts {
        t.wait().unwrap();
    }
    let got = gpu_bytes(&gpu, 0, off);
    let mut at = 0;
    for &(o, l) in &ops {
        assert_eq!(
            check_pattern(&got[o..o + l], o as u64, 91),
            None,
            "READ of {l} at {o}"
        );
        if o > at {
            assert_eq!(
                check_pattern(&got[at..o], at as u64, 6),
                None,
                "gap at {at}"
            );
        }
        at = o + l;
    }
}

/// Compression (issue 27) with GPU memory on both sides of a tcp
/// connection: WRITE chunks are packed from their bounce buffers, a WRITE
/// into GPU memory is decoded into a bounce buffer and copied on before
/// its ack, a READ of GPU memory is packed after its copy out, and one
/// into GPU memory decoded before its copy in. Byte-exact at odd offsets.
#[test]
#[ignore = "needs an NVIDIA GPU (cargo test --test gpu -- --ignored)"]
fn packed_frames_move_gpu_memory_over_tcp_byte_exact() {
    use ferry::codec::FloatType;
    let n = gpus();
    let mk = |gpu| {
        let mut c = cfg(gpu);
        c.transport = ferry::Transport::Tcp;
        c.compress = ferry::Compress::On;
        c.chunk_bytes = 1 << 20;
        Endpoint::builder().config(c).build().unwrap()
    };
    let (a, b) = (mk(0), mk(peer_gpu(n)));
    b.start_passive_accept().unwrap();
    let conn = a.add_remote(&b.metadata_bytes()).unwrap();
    let len = (6 << 20) + 1234;
    // bf16-like values: a few exponents, varied mantissas.
    let data: Vec<u8> = (0..len)
        .map(|i| {
            if i % 2 == 1 {
                0x3c + (i / 7 % 3) as u8
            } else {
                (i * 31 / 5) as u8
            }
        })
        .collect();
    let src = a.alloc_gpu(len + 64).unwrap().with_dtype(FloatType::Bf16);
    src.write_at(3, &data).unwrap();
    let dst = b.alloc_gpu(len + 64).unwrap().with_dtype(FloatType::Bf16);
    dst.write_at(0, &vec![0xee; len + 64]).unwrap();
    let win = dst.advertise(5, len).unwrap();
    a.write(conn, &src, 3, len, &win).unwrap();
    let got = gpu_bytes(&dst, 0, len + 64);
    assert!(
        got[5..5 + len] == data[..],
        "WRITE into GPU memory not exact"
    );
    assert!(got[..5].iter().chain(&got[5 + len..]).all(|&x| x == 0xee));
    let back = a.alloc_gpu(len + 64).unwrap();
    a.read(conn, &back, 7, len, &win).unwrap();
    assert!(
        gpu_bytes(&back, 7, len) == data,
        "READ into GPU memory not exact"
    );
    let (sa, sb) = (a.compress_stats().unwrap(), b.compress_stats().unwrap());
    assert!(sa.packed >= 6 && sb.unpacked >= 6, "{sa:?} {sb:?}");
    assert!(sb.packed >= 6 && sa.unpacked >= 6, "{sa:?} {sb:?}");
}

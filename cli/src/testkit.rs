//! Helpers shared by the tests, `ferry serve` and `ferry bench`; not part
//! of the library's API.
//!
//! A deterministic byte pattern for tests, `ferry serve` and benchmarks.
//! Each byte depends on its absolute position, so a transfer that lands at
//! the wrong offset shows up, unlike a pattern that repeats every 256 bytes.

/// The pattern byte at absolute position `pos` for `seed`.
#[inline]
pub fn pattern_byte(pos: u64, seed: u8) -> u8 {
    ((pos.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8) ^ seed
}

/// Fills `buf` with the pattern, as if it started at position `start`.
pub fn fill_pattern(buf: &mut [u8], start: u64, seed: u8) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern_byte(start + i as u64, seed);
    }
}

/// Index of the first byte of `buf` that differs from the pattern.
pub fn check_pattern(buf: &[u8], start: u64, seed: u8) -> Option<usize> {
    buf.iter()
        .enumerate()
        .position(|(i, &b)| b != pattern_byte(start + i as u64, seed))
}

/// FNV-1a 64 of `buf`, to compare large buffers across processes.
pub fn fnv64(buf: &[u8]) -> u64 {
    buf.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// What a `ferry serve` process prints before it is ready.
pub struct Served {
    pub meta: Vec<u8>,
    pub rbuf: ferry::RemoteBuf,
    pub rbuf_ro: ferry::RemoteBuf,
    pub rbuf_wo: ferry::RemoteBuf,
    /// The GPU region's IPC window (`serve --gpu`).
    pub ipc: Option<ferry::IpcBuf>,
    /// The GPU region's key window (`serve --gpu`).
    pub gpu_rbuf: Option<ferry::RemoteBuf>,
    /// Where its metrics are served (`serve --metrics`).
    pub metrics: Option<String>,
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn unhex(s: &str) -> Result<Vec<u8>, String> {
    let s = s.trim();
    if s.len() % 2 != 0 {
        return Err(format!("hex string has odd length {}", s.len()));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| format!("bad hex at {i}: {e}")))
        .collect()
}

/// Reads the lines `ferry serve` prints, up to READY.
pub fn read_served(out: &mut impl std::io::BufRead) -> Result<Served, String> {
    let (mut meta, mut rbuf, mut ro, mut wo) = (None, None, None, None);
    let (mut ipc, mut gpu_rbuf, mut metrics) = (None, None, None);
    let mut line = String::new();
    let rb = |v: &str| -> Result<ferry::RemoteBuf, String> {
        ferry::RemoteBuf::decode(&unhex(v)?).map_err(|e| e.to_string())
    };
    loop {
        line.clear();
        if out.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
            return Err("the target process exited before READY".into());
        }
        let t = line.trim();
        let (k, v) = t.split_once(' ').unwrap_or((t, ""));
        match k {
            "META" => meta = Some(unhex(v)?),
            "RBUF" => rbuf = Some(rb(v)?),
            "RBUF_RO" => ro = Some(rb(v)?),
            "RBUF_WO" => wo = Some(rb(v)?),
            "GRBUF" => gpu_rbuf = Some(rb(v)?),
            "IPCBUF" => ipc = Some(ferry::IpcBuf::decode(&unhex(v)?).map_err(|e| e.to_string())?),
            "METRICS" => metrics = Some(v.to_string()),
            "READY" => break,
            _ => {}
        }
    }
    Ok(Served {
        meta: meta.ok_or("no META line")?,
        rbuf: rbuf.ok_or("no RBUF line")?,
        rbuf_ro: ro.ok_or("no RBUF_RO line")?,
        rbuf_wo: wo.ok_or("no RBUF_WO line")?,
        ipc,
        gpu_rbuf,
        metrics,
    })
}

/// Resident memory of process `pid`, in KiB (0 if unknown).
pub fn rss_kib(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// CPU time process `pid` has used, all its threads together, in
/// nanoseconds (`/proc/<pid>/task/*/schedstat`: nanosecond resolution,
/// where `stat`'s clock ticks are 10 ms). Threads that ended are not
/// counted; 0 if the process is gone.
pub fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

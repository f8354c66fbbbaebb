//! OS helpers shared by every layer: randomness, interface addresses,
//! thread affinity, hashes, shared mappings and memfd memory, process
//! liveness. No transport logic lives here.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::io;
use std::net::{IpAddr, Ipv4Addr};

use tracing::warn;

mod maps;
pub(crate) use maps::range_mapped;

/// A libc return value that says "failed, see errno" by being -1.
pub(crate) trait MinusOne: Copy + PartialEq {
    /// -1 of this type.
    const MINUS_ONE: Self;
}

impl MinusOne for i32 {
    const MINUS_ONE: Self = -1;
}

impl MinusOne for i64 {
    const MINUS_ONE: Self = -1;
}

impl MinusOne for isize {
    const MINUS_ONE: Self = -1;
}

/// The one place a libc call's -1 becomes an `io::Error` with its errno
/// (std's `cvt`); `syscall!` calls it.
pub(crate) fn cvt<T: MinusOne>(r: T) -> io::Result<T> {
    if r == T::MINUS_ONE {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// `syscall!(fstat(fd, &mut st))`: calls libc's `fstat` and returns its
/// result as an `io::Result` (errno on -1), as mio's `syscall!` does. The
/// call is unsafe: a `// SAFETY:` comment above each use says why its
/// arguments are valid, as for any unsafe block.
macro_rules! syscall {
    ($fn:ident ( $($arg:expr),* $(,)? )) => {{
        // SAFETY: stated at the macro's call site (see above).
        let r = unsafe { libc::$fn($($arg),*) };
        $crate::sys::cvt(r)
    }};
}
pub(crate) use syscall;

/// 32 random bits (PSNs and the like).
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) fn random_u32() -> u32 {
    random_u64() as u32
}

pub(crate) fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n == b.len() as isize {
        return u64::from_le_bytes(b);
    }
    // getrandom cannot fail for 8 bytes on Linux >= 3.17; mix clock and pid if it did.
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (t.as_nanos() as u64) ^ ((std::process::id() as u64) << 32)
}

/// The first non-loopback IPv4 address of an interface that is up.
pub(crate) fn primary_ipv4() -> Option<IpAddr> {
    let mut ifa: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `ifa` with a list we free below.
    if unsafe { libc::getifaddrs(&mut ifa) } != 0 {
        return None;
    }
    let mut cur = ifa;
    let mut found = None;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned.
        let a = unsafe { &*cur };
        let up = a.ifa_flags & libc::IFF_UP as u32 != 0;
        let lo = a.ifa_flags & libc::IFF_LOOPBACK as u32 != 0;
        // SAFETY: ifa_addr, when non-null, points to a sockaddr whose family
        // field says which sockaddr type it is.
        let family = (!a.ifa_addr.is_null()).then(|| unsafe { (*a.ifa_addr).sa_family } as i32);
        if up && !lo && family == Some(libc::AF_INET) {
            // SAFETY: the family is AF_INET, so this is a sockaddr_in.
            let sin = unsafe { &*(a.ifa_addr as *const libc::sockaddr_in) };
            found = Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                sin.sin_addr.s_addr,
            ))));
            break;
        }
        cur = a.ifa_next;
    }
    // SAFETY: `ifa` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(ifa) };
    found
}

/// Moves the calling thread to another core it may run on, leaving its
/// affinity as it was: the kernel migrates a thread at once when its
/// current core leaves its allowed set, and keeps it where it is when the
/// set is widened again. Returns whether it moved (false for a thread
/// allowed on one core only, or where the calls fail).
pub(crate) fn move_off_this_core() -> bool {
    const SIZE: usize = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: cpu_set_t is plain bits, filled in by the kernel; the calls
    // act on this thread only, and the original set is put back.
    unsafe {
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, SIZE, &mut allowed) != 0 {
            return false;
        }
        let Ok(cur) = usize::try_from(libc::sched_getcpu()) else {
            return false;
        };
        if libc::CPU_COUNT(&allowed) < 2 || cur >= libc::CPU_SETSIZE as usize {
            return false;
        }
        let mut elsewhere = allowed;
        libc::CPU_CLR(cur, &mut elsewhere);
        let moved = cvt(libc::sched_setaffinity(0, SIZE, &elsewhere)).is_ok();
        if let Err(e) = cvt(libc::sched_setaffinity(0, SIZE, &allowed)) {
            warn!("could not restore this thread's core affinity: {e}");
        }
        moved
    }
}

/// Pins the calling thread to `core`.
pub(crate) fn pin_to_core(core: usize) {
    // SAFETY: cpu_set_t is plain bits; CPU_SET and sched_setaffinity(0, ..)
    // act on this thread only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        if let Err(e) = cvt(libc::sched_setaffinity(
            0,
            std::mem::size_of::<libc::cpu_set_t>(),
            &set,
        )) {
            warn!(core, "could not pin shard thread: {e}");
        }
    }
}

/// The CPUs a Linux cpulist names ("0-3,8,10-11"); malformed parts are
/// skipped.
pub(crate) fn parse_cpulist(list: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                    // A bound on what a malformed file can make us allocate.
                    if a <= b && b < 1 << 16 {
                        out.extend(a..=b);
                    }
                }
            }
            None => {
                if let Ok(c) = part.trim().parse() {
                    out.push(c);
                }
            }
        }
    }
    out
}

/// The order shards are pinned to cores in (`FERRY_PIN`): the cores of
/// NUMA node `near` first (the GPU's), then the other nodes' in node
/// order, each list only the cores this process may run on. `nodes` are
/// (node, cpulist) pairs as sysfs has them; `allowed` says whether a core
/// is in our affinity mask. Empty when nothing is known.
pub(crate) fn pin_order(
    nodes: &[(usize, String)],
    near: Option<usize>,
    allowed: impl Fn(usize) -> bool,
) -> Vec<usize> {
    let mut nodes: Vec<&(usize, String)> = nodes.iter().collect();
    nodes.sort_by_key(|(n, _)| (Some(*n) != near, *n));
    nodes
        .iter()
        .flat_map(|(_, l)| parse_cpulist(l))
        .filter(|&c| allowed(c))
        .collect()
}

/// `pin_order` for this machine, near the NUMA node of PCI device `bdf`
/// (the GPU), from /sys.
pub(crate) fn machine_pin_order(bdf: Option<&str>) -> Vec<usize> {
    let mut nodes = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/sys/devices/system/node") {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(n) = name.strip_prefix("node").and_then(|n| n.parse().ok()) else {
                continue;
            };
            if let Ok(l) = std::fs::read_to_string(e.path().join("cpulist")) {
                nodes.push((n, l));
            }
        }
    }
    let near = bdf.filter(|b| !b.is_empty()).and_then(|b| {
        std::fs::read_to_string(format!(
            "/sys/bus/pci/devices/{}/numa_node",
            b.to_ascii_lowercase()
        ))
        .ok()?
        .trim()
        .parse::<usize>()
        .ok()
    });
    // SAFETY: a zeroed cpu_set_t filled in by the kernel for this thread.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above; a valid out pointer of the right size.
    let have =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }
            == 0;
    pin_order(&nodes, near, |c| {
        // SAFETY: CPU_ISSET reads the set; c is bounded by the kernel's lists.
        !have || (c < libc::CPU_SETSIZE as usize && unsafe { libc::CPU_ISSET(c, &set) })
    })
}

/// When any of several threads last saw activity, at millisecond grain:
/// the lanes of one connection share one, so a lane idle while its
/// siblings are busy is not idle. A writer stores at most once per
/// millisecond (`touch`), so the shared line is seldom written.
#[derive(Debug, Default)]
pub(crate) struct Activity(std::sync::atomic::AtomicU64);

fn epoch() -> std::time::Instant {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(std::time::Instant::now)
}

impl Activity {
    pub fn touch(&self, now: std::time::Instant) {
        use std::sync::atomic::Ordering;
        let ms = now.saturating_duration_since(epoch()).as_millis() as u64;
        if self.0.load(Ordering::Relaxed) < ms {
            self.0.fetch_max(ms, Ordering::Relaxed);
        }
    }

    /// The last activity (never before `floor`, the caller's own).
    pub fn last(&self, floor: std::time::Instant) -> std::time::Instant {
        let ms = self.0.load(std::sync::atomic::Ordering::Relaxed);
        floor.max(epoch() + std::time::Duration::from_millis(ms))
    }
}

/// Whether `fd` becomes readable within `timeout_ms` (tests).
#[cfg(test)]
pub(crate) fn fd_readable(fd: i32, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd of ours.
    unsafe { libc::poll(&mut p, 1, timeout_ms) == 1 }
}

/// A multiply-shift hasher for the engine's small integer keys (rkeys,
/// connection ids): the hot-path tables need speed, not DoS resistance, and
/// their keys come from this process (a peer can only name them).
#[derive(Default, Clone, Copy)]
pub(crate) struct IntHasher(u64);

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64);
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

pub(crate) type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

/// FNV-1a 64 of `buf` (host tokens; tests compare large buffers with it).
pub fn fnv64(buf: &[u8]) -> u64 {
    buf.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// A shared mapping, unmapped on drop. Its range is fixed at creation:
/// the fields are private, so no code can point it elsewhere.
pub(crate) struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a Mapping is an address range; users synchronise through it.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// The first byte of the mapping.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Maps `len` bytes of `fd` shared, read-write.
    pub fn map_fd(fd: i32, len: usize) -> io::Result<Mapping> {
        if len == 0 {
            return Ok(Mapping {
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                len: 0,
            });
        }
        // SAFETY: a fresh shared mapping of an fd we hold; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: p as *mut u8,
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: we mapped exactly this range and nobody uses it after drop.
            unsafe { libc::munmap(self.ptr as *mut _, self.len) };
        }
    }
}

/// Host memory in a memfd: shareable with local peers by passing the fd.
pub(crate) struct MemfdBuf {
    pub fd: i32,
    pub map: Mapping,
}

impl MemfdBuf {
    pub fn new(len: usize) -> crate::error::Result<MemfdBuf> {
        let name = std::ffi::CString::new("ferry-host").expect("no NUL");
        // SAFETY: valid name; flags are plain bits.
        let fd = syscall!(memfd_create(name.as_ptr(), libc::MFD_CLOEXEC))
            .map_err(|e| crate::error::Error::io("memfd_create", e))?;
        // SAFETY: fd is ours.
        if let Err(e) = syscall!(ftruncate(fd, len as libc::off_t)) {
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            return Err(crate::error::Error::io("ftruncate(memfd)", e));
        }
        let map = match Mapping::map_fd(fd, len) {
            Ok(m) => m,
            Err(e) => {
                // SAFETY: fd is ours.
                unsafe { libc::close(fd) };
                return Err(crate::error::Error::io("mmap(memfd)", e));
            }
        };
        Ok(MemfdBuf { fd, map })
    }
}

impl Drop for MemfdBuf {
    fn drop(&mut self) {
        // SAFETY: we own the descriptor (the mapping drops separately).
        unsafe { libc::close(self.fd) };
    }
}

/// Whether process `pid` exists (EPERM means it does, owned by another user).
pub(crate) fn pid_alive(pid: u32) -> bool {
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission.
    match syscall!(kill(pid as i32, 0)) {
        Ok(_) => true,
        Err(e) => e.raw_os_error() == Some(libc::EPERM),
    }
}

pub(crate) fn this_pid() -> u32 {
    std::process::id()
}

/// The time, read from the OS at most once: a loop pass that needs "now"
/// in several places (each read of a socket, the idle clock) pays for one
/// clock read, and a pass that needs none pays nothing.
#[derive(Default)]
pub(crate) struct LazyClock(Option<std::time::Instant>);

impl LazyClock {
    pub fn now(&mut self) -> std::time::Instant {
        *self.0.get_or_insert_with(std::time::Instant::now)
    }
}

/// Times the calling thread was preempted (involuntary context switches,
/// `getrusage(RUSAGE_THREAD)`); 0 if unknown.
/// How hard this host's threads wait for a core: the share of time in
/// which some runnable thread had none (Linux's pressure stall information,
/// `/proc/pressure/cpu`, "some"). A host with a core for every busy thread
/// stays near 0 (1.4 % measured with two spinning threads on the 2-core
/// machine); one more busy thread than cores takes it past 50 %. Where PSI
/// is off, the run queue's length at the moment of asking
/// (`/proc/loadavg`) stands in.
#[derive(Debug)]
pub(crate) struct CpuPressure {
    /// The open PSI file (read again from offset 0 each time), None
    /// without PSI.
    psi: Option<std::fs::File>,
    /// The last reading: when, and the stall total then (µs).
    last: Option<(std::time::Instant, u64)>,
}

/// Readings further apart than this average over too long to say what the
/// host is doing now.
const PRESSURE_MAX_SPAN: std::time::Duration = std::time::Duration::from_secs(1);

impl CpuPressure {
    pub fn new() -> Self {
        Self {
            psi: std::fs::File::open("/proc/pressure/cpu").ok(),
            last: None,
        }
    }

    /// Whether some thread waited for a core more than `share` of the time
    /// since the last call (None: not known yet, or not readable).
    pub fn stalled_over(&mut self, share: f64, now: std::time::Instant) -> Option<bool> {
        let Some(f) = &self.psi else {
            return runnable_over_cores();
        };
        let mut buf = [0u8; 256];
        let n = std::os::unix::fs::FileExt::read_at(f, &mut buf, 0).ok()?;
        let total = parse_psi_some_total(std::str::from_utf8(&buf[..n]).ok()?)?;
        let prev = self.last.replace((now, total));
        let (then, before) = prev?;
        let span = now.saturating_duration_since(then);
        if span.is_zero() || span > PRESSURE_MAX_SPAN {
            return None;
        }
        let stalled_us = total.saturating_sub(before) as f64;
        Some(stalled_us > share * span.as_micros() as f64)
    }
}

/// The "some" line's `total=` (µs) of a `/proc/pressure/cpu` text.
fn parse_psi_some_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("some "))?;
    let field = line
        .split_ascii_whitespace()
        .find(|f| f.starts_with("total="))?;
    field["total=".len()..].parse().ok()
}

/// Whether this host has more runnable threads than online cores right now
/// (`/proc/loadavg`'s running count, which includes the caller). None
/// where it cannot be read.
pub(crate) fn runnable_over_cores() -> Option<bool> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let running = parse_loadavg_running(&text)?;
    // SAFETY: sysconf has no preconditions.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    (online > 0).then_some(running > online as u64)
}

/// The running-thread count of a `/proc/loadavg` line ("0.1 0.2 0.3 R/T P").
fn parse_loadavg_running(text: &str) -> Option<u64> {
    let field = text.split_ascii_whitespace().nth(3)?;
    field.split_once('/')?.0.parse().ok()
}

pub(crate) fn involuntary_switches() -> u64 {
    // SAFETY: a zeroed rusage filled in by the kernel.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_THREAD with a valid out pointer.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) } != 0 {
        return 0;
    }
    ru.ru_nivcsw as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loadavg_running_count() {
        assert_eq!(
            parse_loadavg_running("0.36 0.27 0.11 3/345 6789\n"),
            Some(3)
        );
        assert_eq!(parse_loadavg_running("0.36 0.27 0.11"), None);
        assert_eq!(parse_loadavg_running("0.36 0.27 0.11 x/3 1"), None);
        assert!(runnable_over_cores().is_some(), "readable on Linux");
    }

    #[test]
    fn psi_some_total() {
        let text = "some avg10=1.70 avg60=4.15 avg300=6.79 total=67263607\n\
                    full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(parse_psi_some_total(text), Some(67263607));
        assert_eq!(parse_psi_some_total("full avg10=0 total=5\n"), None);
        assert_eq!(parse_psi_some_total("some avg10=0 total=x\n"), None);
        let mut p = CpuPressure::new();
        let t0 = std::time::Instant::now();
        assert_eq!(p.stalled_over(0.1, t0), None, "no span yet");
        if p.psi.is_some() {
            std::thread::sleep(std::time::Duration::from_millis(20));
            let later = std::time::Instant::now();
            assert!(p.stalled_over(0.1, later).is_some());
            // Over too long a span the average says nothing of now.
            assert_eq!(p.stalled_over(0.1, later + PRESSURE_MAX_SPAN * 2), None);
        }
    }

    #[test]
    fn cpulists_and_the_pin_order() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), [0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpulist(""), Vec::<usize>::new());
        assert_eq!(parse_cpulist("5-2,x,7"), [7]);
        assert_eq!(parse_cpulist("0-99999999"), Vec::<usize>::new());
        let nodes = [(0, "0-3".to_owned()), (1, "4-7".to_owned())];
        // The GPU's node first; cores we may not use are left out.
        assert_eq!(
            pin_order(&nodes, Some(1), |c| c != 5),
            [4, 6, 7, 0, 1, 2, 3]
        );
        assert_eq!(pin_order(&nodes, None, |_| true), [0, 1, 2, 3, 4, 5, 6, 7]);
        assert!(pin_order(&[], Some(0), |_| true).is_empty());
    }
}

//! Whether a range of this process's memory is mapped with the access a
//! registration asks for: a Python or C caller hands us a bare pointer, and
//! a peer's WRITE into memory that is not writable would kill the process.
//!
//! The kernel answers per mapping through `PROCMAP_QUERY` (an ioctl on
//! `/proc/self/maps`, Linux 6.11+: ~2 µs a query); where it has none, the
//! maps' text is read and parsed (its cost grows with the mappings: 0.25 to
//! 0.6 ms on the 2-core machine, most of a registration's cost).

use std::os::fd::{AsRawFd, OwnedFd};

/// `struct procmap_query` of `<linux/fs.h>` (uapi, Linux 6.11).
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: libc::c_ulong = (3 << 30)
    | ((std::mem::size_of::<ProcmapQuery>() as libc::c_ulong) << 16)
    | ((b'f' as libc::c_ulong) << 8)
    | 17;
const VMA_READABLE: u64 = 0x01;
const VMA_WRITABLE: u64 = 0x02;

/// What one query says of the byte at an address.
enum Vma {
    /// The mapping holding it: its end and flags.
    At { end: u64, flags: u64 },
    /// No mapping holds it.
    None,
}

/// Runs `f` with this thread's `/proc/self/maps` opened for queries, or
/// returns None where the kernel has no `PROCMAP_QUERY` (found once per
/// thread and process). One file per thread: the kernel keeps per-file
/// state while it answers a query. The file answers for the process that
/// opened it: a child made by `fork` (which copies this thread's copy)
/// opens its own.
fn with_query_fd<R>(f: impl FnOnce(&OwnedFd) -> R) -> Option<R> {
    thread_local! {
        static FD: std::cell::RefCell<Option<(u32, Option<OwnedFd>)>> =
            const { std::cell::RefCell::new(None) };
    }
    let pid = std::process::id();
    FD.with(|slot| {
        let mut slot = slot.borrow_mut();
        if !matches!(&*slot, Some((p, _)) if *p == pid) {
            *slot = Some((pid, open_for_queries()));
        }
        let (_, fd) = slot.as_ref().expect("just set");
        fd.as_ref().map(f)
    })
}

fn open_for_queries() -> Option<OwnedFd> {
    let fd: OwnedFd = std::fs::File::open("/proc/self/maps").ok()?.into();
    // Whether the kernel knows the query: ask about a byte of our own stack.
    let probe = 0u8;
    query(&fd, std::ptr::addr_of!(probe) as u64).ok()?;
    Some(fd)
}

/// The refusal of a range whose byte `at` is mapped as `perms` (the maps'
/// notation) without the access asked for.
fn not_accessible(at: u64, perms: &str, write: bool) -> String {
    let want = if write {
        "readable and writable"
    } else {
        "readable"
    };
    format!("{at:#x} is mapped {perms}, not {want}")
}

/// The mapping that holds `addr`, by the kernel; `Err` where the query
/// itself failed (no such ioctl).
fn query(fd: &OwnedFd, addr: u64) -> Result<Vma, i32> {
    let mut q = ProcmapQuery {
        size: std::mem::size_of::<ProcmapQuery>() as u64,
        query_addr: addr,
        ..Default::default()
    };
    // SAFETY: `q` is a valid, writable `procmap_query` whose `size` says
    // its length; no name or build id buffer is asked for (sizes 0).
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), PROCMAP_QUERY as _, &mut q) };
    if r == 0 {
        return Ok(Vma::At {
            end: q.vma_end,
            flags: q.vma_flags,
        });
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::ENOENT) => Ok(Vma::None),
        e => Err(e.unwrap_or(0)),
    }
}

/// Whether `[ptr, ptr + len)` is mapped in this process now, readable (and
/// writable when `write`): `Err` names the first byte that is not.
pub(crate) fn range_mapped(ptr: u64, len: u64, write: bool) -> Result<(), String> {
    let end = ptr
        .checked_add(len)
        .ok_or_else(|| format!("[{ptr:#x}, +{len}) runs past the end of the address space"))?;
    if let Some(Ok(r)) = with_query_fd(|fd| range_mapped_by_query(fd, ptr, end, write)) {
        return r;
    }
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| format!("reading /proc/self/maps: {e}"))?;
    range_mapped_in(&maps, ptr, len, write)
}

/// `range_mapped` by the kernel's query, mapping after mapping; the outer
/// `Err` when a query failed (then the text decides).
fn range_mapped_by_query(
    fd: &OwnedFd,
    ptr: u64,
    end: u64,
    write: bool,
) -> Result<Result<(), String>, i32> {
    let mut at = ptr;
    while at < end {
        match query(fd, at)? {
            Vma::None => return Ok(Err(format!("{at:#x} is not mapped in this process"))),
            Vma::At {
                end: vma_end,
                flags,
            } => {
                let readable = flags & VMA_READABLE != 0;
                let writable = flags & VMA_WRITABLE != 0;
                if !readable || (write && !writable) {
                    let perms = format!(
                        "{}{}",
                        if readable { "r" } else { "-" },
                        if writable { "w" } else { "-" }
                    );
                    return Ok(Err(not_accessible(at, &perms, write)));
                }
                // The query answers for the mapping holding `at`: its end
                // is past `at`, so the walk moves on.
                at = vma_end.max(at + 1);
            }
        }
    }
    Ok(Ok(()))
}

/// Whether `[ptr, ptr + len)` is mapped in this process, readable (and
/// writable when `write`), by the lines of `/proc/self/maps` in `maps`:
/// `Err` names the first byte that is not.
pub(crate) fn range_mapped_in(maps: &str, ptr: u64, len: u64, write: bool) -> Result<(), String> {
    let end = ptr
        .checked_add(len)
        .ok_or_else(|| format!("[{ptr:#x}, +{len}) runs past the end of the address space"))?;
    let mut at = ptr;
    // The maps are in address order: walk them, each covering the next
    // byte, until the range is covered.
    for line in maps.lines() {
        if at >= end {
            break;
        }
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else {
            continue;
        };
        if hi <= at {
            continue;
        }
        if lo > at {
            break;
        }
        let p = perms.as_bytes();
        let ok = p.first() == Some(&b'r') && (!write || p.get(1) == Some(&b'w'));
        if !ok {
            return Err(not_accessible(at, perms, write));
        }
        at = hi;
    }
    if at < end {
        return Err(format!("{at:#x} is not mapped in this process"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0a000-55d0b000 r--p 00000000 08:01 1 /bin/x
55d0b000-55d0d000 r-xp 00001000 08:01 1 /bin/x
7f0000000000-7f0000002000 rw-p 00000000 00:00 0
7f0000002000-7f0000003000 rw-s 00000000 00:05 9 /dev/shm/a
7f0000005000-7f0000006000 ---p 00000000 00:00 0
";

    #[test]
    fn ranges_are_checked_against_the_maps() {
        // Across two adjacent writable mappings.
        assert!(range_mapped_in(MAPS, 0x7f0000001000, 0x1800, true).is_ok());
        // Read-only code: readable, not writable.
        assert!(range_mapped_in(MAPS, 0x55d0a800, 0x1000, false).is_ok());
        let e = range_mapped_in(MAPS, 0x55d0a800, 16, true).unwrap_err();
        assert!(e.contains("0x55d0a800") && e.contains("r--p"), "{e}");
        // A hole, a guard page, nothing at all, the end of the space.
        let e = range_mapped_in(MAPS, 0x7f0000002800, 0x1000, true).unwrap_err();
        assert!(e.contains("0x7f0000003000 is not mapped"), "{e}");
        assert!(range_mapped_in(MAPS, 0x7f0000005000, 1, false).is_err());
        assert!(range_mapped_in(MAPS, 0x1, 1, false)
            .unwrap_err()
            .contains("0x1 is not mapped"));
        assert!(range_mapped_in(MAPS, 1 << 63, 1 << 40, false).is_err());
        assert!(range_mapped_in(MAPS, u64::MAX, 2, false)
            .unwrap_err()
            .contains("past the end"));
    }

    #[test]
    fn this_process_has_its_heap_and_not_page_zero() {
        let v = vec![0u8; 1 << 20];
        assert!(range_mapped(v.as_ptr() as u64, v.len() as u64, true).is_ok());
        assert!(range_mapped(0x1000, 4096, false).is_err());
    }

    /// Three pages: read-write, read-only, then a hole (unmapped).
    fn rw_ro_hole() -> (u64, u64) {
        let page = 4096usize;
        // SAFETY: a fresh anonymous mapping of three pages, then changes
        // to its own pages only; leaked (the test process ends).
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                3 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            let p = p.cast::<u8>();
            assert_eq!(libc::mprotect(p.add(page).cast(), page, libc::PROT_READ), 0);
            assert_eq!(libc::munmap(p.add(2 * page).cast(), page), 0);
            (p as u64, page as u64)
        }
    }

    #[test]
    fn the_query_and_the_text_agree_on_real_mappings() {
        let (p, page) = rw_ro_hole();
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let cases = [
            (p, page, true),
            (p, 2 * page, false),
            (p, 2 * page, true),
            (p + page, page, true),
            (p + page, page, false),
            (p + page, page + 1, false),
            (p + 2 * page, 1, false),
            (0x1000, 1, false),
        ];
        for (at, len, write) in cases {
            let text = range_mapped_in(&maps, at, len, write);
            // Where the kernel has no PROCMAP_QUERY, range_mapped reads the
            // text itself: the two still agree.
            let now = range_mapped(at, len, write);
            assert_eq!(
                text.is_ok(),
                now.is_ok(),
                "{at:#x} +{len} write {write}: {text:?} {now:?}"
            );
        }
        let e = range_mapped(p, 2 * page, true).unwrap_err();
        assert!(
            e.contains(&format!("{:#x}", p + page)) && e.contains("not readable and writable"),
            "{e}"
        );
        let e = range_mapped(p + page, 2 * page, false).unwrap_err();
        assert!(
            e.contains(&format!("{:#x} is not mapped", p + 2 * page)),
            "{e}"
        );
    }

    #[test]
    fn kernels_from_6_11_answer_the_query() {
        // The query's number and layout are ours to get right: where the
        // kernel has it, it must answer (else every check reads the text).
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut v = release
            .trim()
            .split(['.', '-'])
            .map(|x| x.parse::<u32>().unwrap_or(0));
        let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
        let has = with_query_fd(|_| ()).is_some();
        if (major, minor) >= (6, 11) {
            assert!(has, "kernel {release}: PROCMAP_QUERY refused");
        }
        if has {
            let v = [7u8; 64];
            let r = with_query_fd(|fd| {
                range_mapped_by_query(fd, v.as_ptr() as u64, v.as_ptr() as u64 + 64, true)
            });
            assert_eq!(r, Some(Ok(Ok(()))));
        }
    }

    #[test]
    fn a_forked_child_asks_about_its_own_mappings() {
        // This thread's query file is open in the parent before the fork.
        let v = [1u8; 64];
        assert!(range_mapped(v.as_ptr() as u64, 64, true).is_ok());
        // SAFETY: the child only makes system calls and reads (no
        // allocation on the paths it takes: another thread of the parent
        // may have held the allocator's lock) and ends with `_exit`.
        unsafe {
            let pid = libc::fork();
            assert!(pid >= 0);
            if pid == 0 {
                let page = 4096;
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    page,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                // Mapped in the child only: the parent's file would say no.
                let ok = p != libc::MAP_FAILED && range_mapped(p as u64, page as u64, true).is_ok();
                libc::_exit(if ok { 0 } else { 1 });
            }
            let mut status = 0;
            assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
            assert!(
                libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                "the child's own mapping was refused"
            );
        }
    }
}

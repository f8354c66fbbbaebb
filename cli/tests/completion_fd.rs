//! Completion without polling: a thread waits in `poll(2)` on the
//! endpoint's completion fd for 1 000 transfers over 4 connections (tcp
//! and same host), sees each end exactly once, and the CPU it used is
//! reported (measured, not asserted: the machine is noisy).

mod common;

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common::*;
use ferry::oob::IoPreference;
use ferry::{Endpoint, Transport};

const CONNS: usize = 4;
const TRANSFERS: usize = 1000;

/// Waits up to `ms` for `fd` to be readable; whether it was.
fn readable_within(fd: i32, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd, live for the call.
    unsafe { libc::poll(&mut p, 1, ms) == 1 }
}

/// This thread's CPU time so far.
fn thread_cpu() -> Duration {
    // SAFETY: zero is a valid value of this plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: fills one rusage struct we own.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) }, 0);
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn wait_on_the_fd(transport: Transport) {
    let mut cfg = config(IoPreference::Auto);
    cfg.transport = transport;
    let a = Endpoint::builder().config(cfg.clone()).build().unwrap();
    let b = Endpoint::builder().config(cfg).build().unwrap();
    b.start_passive_accept().unwrap();
    let conns: Vec<_> = (0..CONNS)
        .map(|_| a.add_remote(&b.metadata_bytes()).unwrap())
        .collect();
    let far = b.alloc(TRANSFERS * 4096).unwrap();
    let win = far.advertise(0, TRANSFERS * 4096).unwrap();
    let near = a.alloc(TRANSFERS * 4096).unwrap();
    let fd = a.completion_fd().unwrap();
    assert_eq!(a.as_raw_fd(), fd, "one fd per endpoint");

    // Another thread posts, in waves of 40 (10 a connection) every 10 ms,
    // as a service's requests come; this one only waits.
    let (tx, rx) = std::sync::mpsc::channel::<(usize, ferry::Transfer)>();
    let mut seen = vec![0u32; TRANSFERS];
    let (mut wakes, mut cpu, mut wall) = (0u64, Duration::ZERO, Duration::ZERO);
    std::thread::scope(|s| {
        let (a, near, conns) = (&a, &near, &conns);
        s.spawn(move || {
            for wave in 0..TRANSFERS / 40 {
                for k in 0..40 {
                    let i = wave * 40 + k;
                    let w = win.slice((i * 4096) as u32, 4096).unwrap();
                    let t = a
                        .write_async(conns[i % CONNS], near, i * 4096, 4096, &w)
                        .unwrap();
                    tx.send((i, t)).unwrap();
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        let (cpu0, t0) = (thread_cpu(), Instant::now());
        let mut pending: Vec<(usize, ferry::Transfer)> = Vec::new();
        let mut done = 0;
        while done < TRANSFERS {
            a.ack_completions();
            pending.extend(rx.try_iter());
            pending.retain_mut(|(i, t)| match t.poll() {
                Some(r) => {
                    r.unwrap();
                    seen[*i] += 1;
                    done += 1;
                    false
                }
                None => true,
            });
            if pending.is_empty() {
                // Nothing in flight: wait for the next post, not the fd.
                match rx.recv_timeout(Duration::from_secs(10)) {
                    Ok(x) => pending.push(x),
                    Err(_) => break,
                }
                continue;
            }
            assert!(
                readable_within(fd, 10_000),
                "not readable within 10 s with transfers in flight"
            );
            wakes += 1;
        }
        (cpu, wall) = (thread_cpu() - cpu0, t0.elapsed());
    });
    assert!(
        seen.iter().all(|&n| n == 1),
        "every transfer seen exactly once"
    );
    println!(
        "{transport:?}: {TRANSFERS} transfers over {CONNS} connections, {wakes} wakes; \
         the waiting thread used {:.2} ms of CPU in {:.0} ms ({:.2} % of a core)",
        cpu.as_secs_f64() * 1e3,
        wall.as_secs_f64() * 1e3,
        100.0 * cpu.as_secs_f64() / wall.as_secs_f64()
    );

    // Notifications raise it too; nothing pending: it is not readable.
    a.ack_completions();
    assert!(!readable_within(fd, 0), "quiet after the ack");
    let (cb, _) = b.accept(Duration::from_secs(5)).unwrap();
    b.send_notification(cb, b"hello").unwrap();
    assert!(readable_within(fd, 10_000), "a notification raises it");
    a.ack_completions();
    assert!(a.try_recv_notification().is_some());
}

#[test]
fn a_thread_waits_for_a_thousand_transfers_on_the_fd_over_tcp() {
    wait_on_the_fd(Transport::Tcp);
}

#[test]
fn a_thread_waits_for_a_thousand_transfers_on_the_fd_on_one_host() {
    wait_on_the_fd(Transport::Auto);
}

/// Ten threads post one op at a time; one waiter (the fd's one reader,
/// which acknowledges before it looks) sees every completion, each one
/// racing its acknowledgement, and never sleeps past one.
#[test]
fn completions_racing_the_ack_are_never_missed() {
    let a = Endpoint::builder()
        .config(config(IoPreference::Auto))
        .build()
        .unwrap();
    let b = Endpoint::builder()
        .config(config(IoPreference::Auto))
        .build()
        .unwrap();
    b.start_passive_accept().unwrap();
    let conn = a.add_remote(&b.metadata_bytes()).unwrap();
    let far = b.alloc(1 << 16).unwrap();
    let win = far.advertise(0, 8).unwrap();
    let fd = a.completion_fd().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<ferry::Transfer>();
    const EACH: usize = 200;
    std::thread::scope(|s| {
        for _ in 0..10 {
            let (a, win, tx) = (&a, win, tx.clone());
            s.spawn(move || {
                let near = a.alloc(8).unwrap();
                for _ in 0..EACH {
                    let t = a.write_async(conn, &near, 0, 8, &win).unwrap();
                    tx.send(t).unwrap();
                    std::thread::sleep(Duration::from_micros(50));
                }
            });
        }
        drop(tx);
        let mut pending: Vec<ferry::Transfer> = Vec::new();
        let (mut done, mut open) = (0, true);
        while done < 10 * EACH {
            a.ack_completions();
            while let Ok(t) = rx.try_recv() {
                pending.push(t);
            }
            pending.retain_mut(|t| match t.poll() {
                Some(r) => {
                    r.unwrap();
                    done += 1;
                    false
                }
                None => true,
            });
            if pending.is_empty() {
                if !open {
                    break;
                }
                match rx.recv_timeout(Duration::from_secs(10)) {
                    Ok(t) => pending.push(t),
                    Err(_) => open = false,
                }
                continue;
            }
            assert!(
                readable_within(fd, 10_000),
                "a completion was missed ({done} seen)"
            );
        }
        assert_eq!(done, 10 * EACH);
    });
}

use super::*;
use crate::sys::MemfdBuf;

fn listener() -> (u64, FdListener) {
    let id = crate::sys::random_u64();
    (id, FdListener::bind(id).unwrap())
}

/// Shares `regions` from a thread while this one polls the listener
/// with `known` until the sharer returns.
fn share_and_poll(
    l: &mut FdListener,
    to: u64,
    from: u64,
    regions: Vec<(u32, usize)>,
    known: impl Fn(Sender) -> bool,
    maps: &mut PeerMaps,
) -> io::Result<()> {
    let bufs: Vec<MemfdBuf> = regions
        .iter()
        .map(|&(_, len)| MemfdBuf::new(len).unwrap())
        .collect();
    let shared = shared_over(&regions, &bufs);
    std::thread::scope(|s| {
        // Refusals show as the sharer's timeout; acceptance well within
        // it even on a loaded machine.
        let wait = Duration::from_millis(if known(me(from)) { 3000 } else { 400 });
        let t = s.spawn(move || share(from, to, &shared, wait));
        while !t.is_finished() {
            l.poll(maps, &known);
            std::thread::sleep(Duration::from_millis(1));
        }
        t.join().unwrap()
    })
}

/// One `Shared` per (key, len) over `bufs`, at 0x1000 × key.
fn shared_over(regions: &[(u32, usize)], bufs: &[MemfdBuf]) -> Vec<Shared> {
    regions
        .iter()
        .zip(bufs)
        .map(|(&(key, len), b)| Shared {
            key,
            len: len as u64,
            base: 0x1000 * key as u64,
            fd: b.fd,
        })
        .collect()
}

/// Installs a handler that does nothing for `sig`, without SA_RESTART,
/// so that a blocking call it interrupts returns EINTR.
fn catch_without_restart(sig: libc::c_int) {
    extern "C" fn nothing(_: libc::c_int) {}
    // SAFETY: a handler that does nothing, for a signal only the
    // calling test sends (to its own thread).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = nothing as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(sig, &sa, std::ptr::null_mut()), 0);
    }
}

fn me(id: u64) -> Sender {
    Sender {
        id,
        pid: std::process::id(),
    }
}

#[test]
fn a_connected_peer_maps_an_unknown_one_does_not() {
    let (id, mut l) = listener();
    let mut maps = PeerMaps::default();
    let r = share_and_poll(&mut l, id, 77, vec![(1, 4096)], |s| s == me(77), &mut maps);
    r.unwrap();
    assert!(maps.contains_key(&(77, 1)));
    // An endpoint id no connection has (or this id from another pid):
    // no ack, nothing mapped.
    let r = share_and_poll(&mut l, id, 78, vec![(1, 4096)], |s| s == me(77), &mut maps);
    assert!(r.is_err());
    assert!(!maps.contains_key(&(78, 1)));
    let r = share_and_poll(
        &mut l,
        id,
        77,
        vec![(2, 4096)],
        |s| s.id == 77 && s.pid != std::process::id(),
        &mut maps,
    );
    assert!(r.is_err(), "the kernel's pid, not the message, decides");
    assert!(!maps.contains_key(&(77, 2)));
}

/// A signal that interrupts the wait for the peer's ack (EINTR, here
/// from a handler without SA_RESTART) does not fail the share: the
/// wait is made again.
#[test]
fn a_signal_during_the_wait_for_the_ack_does_not_fail_the_share() {
    catch_without_restart(libc::SIGUSR1);
    let (id, mut l) = listener();
    let mut maps = PeerMaps::default();
    let bufs = [MemfdBuf::new(4096).unwrap()];
    let shared = shared_over(&[(3, 4096)], &bufs);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let t = s.spawn(move || {
            // SAFETY: pthread_self has no preconditions.
            tx.send(unsafe { libc::pthread_self() }).unwrap();
            share(41, id, &shared, Duration::from_secs(10))
        });
        let sharer = rx.recv().unwrap();
        // The message waits unread: the sharer is in its wait for the ack.
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(10));
            // SAFETY: `t` is not joined yet, so `sharer` names a thread
            // that is alive or exited-but-joinable (then ESRCH).
            unsafe { libc::pthread_kill(sharer, libc::SIGUSR1) };
        }
        while !t.is_finished() {
            l.poll(&mut maps, |s| s == me(41));
            std::thread::sleep(Duration::from_millis(1));
        }
        t.join().unwrap().unwrap();
    });
    assert!(maps.contains_key(&(41, 3)));
}

/// Signals that keep interrupting the wait do not stretch it: a peer
/// that never acks fails the share at the timeout, not later.
#[test]
fn signals_do_not_stretch_the_wait_past_its_timeout() {
    catch_without_restart(libc::SIGUSR2);
    // A listener nobody polls: the message is never read, never acked.
    let (id, _l) = listener();
    let bufs = [MemfdBuf::new(4096).unwrap()];
    let shared = shared_over(&[(4, 4096)], &bufs);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let t = s.spawn(move || {
            // SAFETY: pthread_self has no preconditions.
            tx.send(unsafe { libc::pthread_self() }).unwrap();
            let start = Instant::now();
            let r = share(42, id, &shared, Duration::from_millis(200));
            (r, start.elapsed())
        });
        let sharer = rx.recv().unwrap();
        // A signal every 20 ms for 1.5 s, or until the sharer gave up.
        for _ in 0..75 {
            if t.is_finished() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
            // SAFETY: as in the test above.
            unsafe { libc::pthread_kill(sharer, libc::SIGUSR2) };
        }
        let (r, took) = t.join().unwrap();
        assert!(r.is_err());
        assert!(took < Duration::from_millis(1000), "gave up after {took:?}");
    });
}

#[test]
fn a_mapping_is_never_replaced() {
    let (id, mut l) = listener();
    let mut maps = PeerMaps::default();
    share_and_poll(&mut l, id, 5, vec![(9, 4096)], |s| s == me(5), &mut maps).unwrap();
    let first = maps[&(5, 9)].map.ptr();
    let r = share_and_poll(&mut l, id, 5, vec![(9, 8192)], |s| s == me(5), &mut maps);
    assert!(r.is_err());
    assert_eq!(maps[&(5, 9)].map.ptr(), first, "the first mapping stands");
    assert_eq!(maps[&(5, 9)].map.len(), 4096);
}

#[test]
fn a_peer_maps_within_its_limits() {
    let mut maps = PeerMaps::default();
    let fd = || {
        let b = MemfdBuf::new(4096).unwrap();
        // SAFETY: dup of a descriptor we hold.
        own(unsafe { libc::dup(b.fd) })
    };
    // A huge (sparse) region is refused by its size before any mmap.
    let huge = Received {
        sender: 3,
        entries: vec![(1, MAX_PEER_MAPPED_BYTES + 1, 0)],
        fds: vec![fd()],
    };
    let e = map_all(me(3), huge, &mut maps).unwrap_err();
    assert!(e.to_string().contains("MAX_PEER_MAPPED_BYTES"), "{e}");
    // Too many regions, counting those mapped already.
    let many = Received {
        sender: 3,
        entries: (0..MAX_PER_MSG as u32).map(|k| (k, 4096, 0)).collect(),
        fds: (0..MAX_PER_MSG).map(|_| fd()).collect(),
    };
    for (i, k) in (0..MAX_PEER_MAPS as u32).enumerate() {
        maps.insert(
            (3, 10_000 + k),
            PeerMap {
                map: std::sync::Arc::new(Mapping::map_fd(fd().as_raw_fd(), 0).unwrap()),
                base: i as u64,
            },
        );
    }
    let e = map_all(me(3), many, &mut maps).unwrap_err();
    assert!(e.to_string().contains("MAX_PEER_MAPS"), "{e}");
    assert!(maps.len() == MAX_PEER_MAPS, "nothing half-mapped");
    // The limits are per peer: another peer still maps.
    let fine = Received {
        sender: 4,
        entries: vec![(1, 4096, 0)],
        fds: vec![fd()],
    };
    assert_eq!(map_all(me(4), fine, &mut maps).unwrap(), 1);
    assert!(maps.contains_key(&(4, 1)));
}

/// A process of another user cannot even be heard (needs root to be
/// another user).
#[test]
#[ignore = "needs root to run a sender as another uid (cargo test -p ferry --lib -- --ignored fdpass)"]
fn another_users_process_is_refused() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "needs root");
    let (id, mut l) = listener();
    let b = MemfdBuf::new(4096).unwrap();
    // SAFETY: the child only drops privileges, shares and exits; all
    // it uses was set up before the fork.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: plain syscalls in the child.
        unsafe {
            if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                libc::_exit(2);
            }
        }
        let shared = [Shared {
            key: 1,
            len: 4096,
            base: 0,
            fd: b.fd,
        }];
        let r = share(99, id, &shared, Duration::from_millis(500));
        // SAFETY: leaves the child at once.
        unsafe { libc::_exit(if r.is_ok() { 0 } else { 1 }) };
    }
    let mut maps = PeerMaps::default();
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut status = 0;
    loop {
        // Even a listener that knew the id would not hear it.
        l.poll(&mut maps, |_| true);
        // SAFETY: polls our child without blocking.
        if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
            break;
        }
        assert!(Instant::now() < deadline, "the child did not finish");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(libc::WIFEXITED(status));
    assert_eq!(
        libc::WEXITSTATUS(status),
        1,
        "the other user's share failed"
    );
    assert!(maps.is_empty());
}

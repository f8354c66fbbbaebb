//! The runner's protocol against the kernel's loop run on a thread (no GPU
//! needed): stress, and a loom model.

/// The kernel's loop in Rust, on a thread, over the same control block:
/// what the protocol tests run the real `Host` against (no GPU here).
/// Line for line the PTX above, but "idle" is `idle_polls` looks that
/// found nothing (time would make the loom model unbounded), and it copies
/// between host buffers.
mod soft {
    use super::super::*;
    use crate::sync::AtomicBool;
    #[cfg(loom)]
    use loom::{sync::Arc, thread};
    #[cfg(not(loom))]
    use std::{sync::Arc, thread};

    pub(super) struct SoftKernel {
        pub ctl: Arc<Ctl>,
        pub idle_polls: u32,
        /// Times each `seq` was copied (index `seq`).
        pub copied: Arc<Vec<AtomicU32>>,
        /// Descriptors read before the shard stored them (and read again).
        pub stale: Arc<AtomicU32>,
        pub launches: u32,
        /// Queries of the kernel's end (the driver calls `ended` stands for).
        pub queries: u32,
        ended: Option<Arc<AtomicBool>>,
        pub threads: Vec<thread::JoinHandle<()>>,
    }

    impl SoftKernel {
        pub fn new(ctl: Arc<Ctl>, idle_polls: u32, seqs: usize) -> Self {
            Self {
                ctl,
                idle_polls,
                copied: Arc::new((0..seqs).map(|_| AtomicU32::new(0)).collect()),
                stale: Arc::new(AtomicU32::new(0)),
                launches: 0,
                queries: 0,
                ended: None,
                threads: Vec::new(),
            }
        }
    }

    impl Kernel for SoftKernel {
        fn launch(&mut self, _ctl: &Ctl, last: u32) -> Result<()> {
            let ended = Arc::new(AtomicBool::new(false));
            self.ended = Some(ended.clone());
            let (ctl, idle, copied) = (self.ctl.clone(), self.idle_polls, self.copied.clone());
            let stale = self.stale.clone();
            self.threads.push(thread::spawn(move || {
                run(&ctl, last, idle, &copied, &stale);
                ended.store(true, Ordering::Release);
            }));
            self.launches += 1;
            Ok(())
        }

        fn ended(&mut self) -> Result<bool> {
            self.queries += 1;
            Ok(self
                .ended
                .as_ref()
                .is_none_or(|e| e.load(Ordering::Acquire)))
        }
    }

    fn run(ctl: &Ctl, mut last: u32, idle_polls: u32, copied: &[AtomicU32], stale: &AtomicU32) {
        let mut empty = 0;
        loop {
            // POLL: the descriptor, then the word, as the kernel issues
            // its loads (the GPU may serve them in either order; here the
            // descriptor is read first, and a pause between widens the
            // window in which it is the last copy's).
            let (mut dst, mut src) = (
                ctl.dst.load(Ordering::Relaxed),
                ctl.src.load(Ordering::Relaxed),
            );
            #[cfg(not(loom))]
            for _ in 0..32 {
                std::hint::spin_loop();
            }
            let mut go = ctl.go.load(Ordering::Acquire);
            if go as u32 == last {
                if empty < idle_polls {
                    empty += 1;
                    thread::yield_now();
                    continue;
                }
                // ENDING: say so, fence, look once more.
                ctl.quit.store(1, Ordering::Relaxed);
                fence(Ordering::SeqCst);
                (dst, src) = (
                    ctl.dst.load(Ordering::Relaxed),
                    ctl.src.load(Ordering::Relaxed),
                );
                go = ctl.go.load(Ordering::Acquire);
                if go as u32 == last {
                    return;
                }
                // RESUME
                ctl.quit.store(0, Ordering::Relaxed);
            }
            // GOT
            let len = go >> 32;
            if len >= STOP {
                return;
            }
            // The tags: a word of the last copy means the descriptor is
            // read again, after the word (then it must be this copy's).
            let tag = u64::from(go as u32 & 0xFF);
            if dst >> 56 != tag || src >> 56 != tag {
                stale.fetch_add(1, Ordering::Relaxed);
                (dst, src) = (
                    ctl.dst.load(Ordering::Relaxed),
                    ctl.src.load(Ordering::Relaxed),
                );
                assert!(
                    dst >> 56 == tag && src >> 56 == tag,
                    "read after the word, the descriptor is the last copy's"
                );
            }
            let (dst, src) = (dst & ADDR_MASK, src & ADDR_MASK);
            // SAFETY: the test posts ranges of its own live buffers and
            // keeps them until the copy's done word.
            unsafe {
                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len as usize)
            };
            copied[go as u32 as usize % copied.len()].fetch_add(1, Ordering::Relaxed);
            // COPIED
            ctl.done.store(go as u32, Ordering::Release);
            last = go as u32;
            empty = 0;
        }
    }
}

#[cfg(not(loom))]
mod protocol {
    use super::super::*;
    use super::soft::SoftKernel;
    use std::sync::Arc;

    #[test]
    fn the_control_block_offsets_match_the_kernel() {
        assert!(PTX.contains("[%rd1+16]") && DESC == 16);
        assert!(PTX.contains("[%rd1+64]") && DONE == 64);
        assert!(PTX.contains("[%rd1+68]") && QUIT == 68);
        assert!(PTX.contains("4294967295") && STOP == 4_294_967_295);
        assert_eq!(GO, 0);
        assert!(PTX.contains("add.s64 %rd8, %rd8, 256;") && THREADS == 256);
        // The tag's place and the address's mask.
        assert!(PTX.contains("shr.u64 %rd9, %rd4, 56;") && PTX.contains("shr.u64 %rd9, %rd5, 56;"));
        // A stale descriptor is read again after the word, never looped on.
        assert_eq!(
            PTX.matches("ld.volatile.global.v2.u64 {%rd4, %rd5}, [%rd1+16];")
                .count(),
            3
        );
        assert!(PTX.contains(&format!("and.b64 %rd4, %rd4, {ADDR_MASK};")));
        assert!(PTX.contains(&format!("and.b64 %rd5, %rd5, {ADDR_MASK};")));
    }

    #[test]
    fn an_address_over_the_tag_is_refused_before_anything_is_posted() {
        let ctl = Arc::new(Ctl::new());
        let mut k = SoftKernel::new(ctl.clone(), 0, 2);
        let mut host = Host::default();
        assert!(reaches(ADDR_MASK, 0) && !reaches(0, ADDR_MASK + 1));
        let e = host.start(&ctl, &mut k, 1 << 56, 0x1000, 8).unwrap_err();
        assert!(e.to_string().contains("0x100000000000000"), "{e}");
        assert!(host.free() && k.launches == 0);
        assert_eq!(ctl.go.load(Ordering::Relaxed), 0);
        assert_eq!(tagged(0x1234, 0x1_0203), 0x0300_0000_0000_1234);
    }

    /// Thousands of copies posted at every moment of the kernel's life —
    /// while it serves, while it ends, after it ended — against the
    /// kernel's loop on a thread: each copy made exactly once, byte exact,
    /// none reported done before its bytes landed, none failed.
    #[test]
    fn every_copy_is_made_once_whenever_the_kernel_ends() {
        const COPIES: usize = 20_000;
        for idle_polls in [0, 1, 3, 50] {
            let ctl = Arc::new(Ctl::new());
            let mut k = SoftKernel::new(ctl.clone(), idle_polls, COPIES + 2);
            let mut host = Host::default();
            let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
            let mut dst = vec![0u8; 4096];
            let mut x: u32 = 12345;
            for i in 0..COPIES {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                let (off, len) = ((x >> 8) as usize % 2048, 1 + (x >> 20) as usize % 2048);
                dst[off..off + len].fill(0);
                host.start(
                    &ctl,
                    &mut k,
                    dst[off..].as_mut_ptr() as u64,
                    src[off..].as_ptr() as u64,
                    len,
                )
                .unwrap();
                // A pause of its own length now and then: the kernel is
                // caught serving, ending or ended.
                for _ in 0..(x >> 4) % 64 {
                    std::hint::spin_loop();
                }
                if x % 7 == 0 {
                    std::thread::yield_now();
                }
                let r = loop {
                    if let Some(r) = host.poll(&ctl, &mut k) {
                        break r;
                    }
                    std::thread::yield_now();
                };
                r.unwrap_or_else(|e| panic!("copy {i} (idle {idle_polls}): {e}"));
                assert_eq!(dst[off..off + len], src[off..off + len], "copy {i}");
            }
            host.stop(&ctl);
            for t in k.threads.drain(..) {
                t.join().unwrap();
            }
            let once = k.copied[1..=COPIES]
                .iter()
                .all(|c| c.load(Ordering::Relaxed) == 1);
            assert!(once, "idle {idle_polls}: a copy made twice or never");
            eprintln!(
                "idle {idle_polls}: {} descriptors read before they were stored, and read again",
                k.stale.load(Ordering::Relaxed)
            );
            // A kernel that ends at its first idle look ended and was
            // launched again along the way (with longer idle spans a
            // loaded machine may keep one kernel busy throughout).
            assert!(
                k.launches > 1 || idle_polls > 0,
                "idle {idle_polls}: {} launches",
                k.launches
            );
        }
    }

    /// Copies posted to a kernel that is serving make no driver call on
    /// the way in: its end is queried only once it began ending.
    #[test]
    fn a_copy_to_a_serving_runner_posts_without_a_driver_call() {
        let ctl = Arc::new(Ctl::new());
        let mut k = SoftKernel::new(ctl.clone(), u32::MAX, 1002);
        let mut host = Host::default();
        let src = [5u8; 64];
        let mut dst = [0u8; 64];
        let mut at_start = 0;
        for i in 0..1000 {
            let before = k.queries;
            host.start(
                &ctl,
                &mut k,
                dst.as_mut_ptr() as u64,
                src.as_ptr() as u64,
                1 + i % 64,
            )
            .unwrap();
            at_start += k.queries - before;
            while host.poll(&ctl, &mut k).map(Result::unwrap).is_none() {
                std::thread::yield_now();
            }
        }
        assert_eq!(dst, src);
        assert_eq!(k.launches, 1, "the kernel never ends here");
        assert_eq!(
            at_start, 0,
            "queries of the kernel's end when a copy was posted"
        );
        host.stop(&ctl);
        for t in k.threads.drain(..) {
            t.join().unwrap();
        }
    }
}

/// The handshake under loom (`--cfg loom`): the real `Host` against the
/// kernel's loop, which ends as soon as it finds nothing, so every second
/// copy races its end. In every interleaving each copy is made exactly
/// once and the host sees it done.
#[cfg(loom)]
mod loom_models {
    use super::super::*;
    use super::soft::SoftKernel;
    use loom::sync::Arc;

    #[test]
    fn loom_runner_copies_once_whenever_it_ends() {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(|| {
            let ctl = Arc::new(Ctl::new());
            let mut k = SoftKernel::new(ctl.clone(), 0, 4);
            let mut host = Host::default();
            let src = [7u8; 8];
            let mut dst = [0u8; 8];
            for (i, len) in [(1u32, 3usize), (2, 5)] {
                host.start(
                    &ctl,
                    &mut k,
                    dst.as_mut_ptr() as u64,
                    src.as_ptr() as u64,
                    len,
                )
                .unwrap();
                loop {
                    if let Some(r) = host.poll(&ctl, &mut k) {
                        r.unwrap();
                        break;
                    }
                    loom::thread::yield_now();
                }
                assert_eq!(k.copied[i as usize].load(Ordering::Relaxed), 1);
            }
            host.stop(&ctl);
            for t in k.threads.drain(..) {
                t.join().unwrap();
            }
            assert_eq!(dst[..5], [7u8; 5]);
            assert_eq!(k.copied[1].load(Ordering::Relaxed), 1);
            assert_eq!(k.copied[2].load(Ordering::Relaxed), 1);
        });
    }
}

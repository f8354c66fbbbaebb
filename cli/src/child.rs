//! The processes `ferry bench` starts beside itself: the target
//! (`ferry serve`), the raw TCP reference's peer, and busy contenders —
//! each killed if the benchmark returns early.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// Busy processes beside the benchmark (`--contend`), killed on drop.
pub struct Contenders(Vec<Child>);

impl Contenders {
    pub fn start(n: usize) -> Result<Contenders> {
        let exe = std::env::current_exe().context("finding the ferry executable")?;
        let mut c = Contenders(Vec::with_capacity(n));
        for _ in 0..n {
            c.0.push(
                Command::new(&exe)
                    .arg("busy")
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .spawn()
                    .context("spawning ferry busy")?,
            );
        }
        // Let them get going before anything is measured.
        std::thread::sleep(Duration::from_millis(50));
        Ok(c)
    }
}

impl Drop for Contenders {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `ferry busy`: one thread that spins until its parent goes away (a
/// contender for `ferry bench --contend`).
pub fn busy() -> ! {
    // SAFETY: asks for SIGKILL when the parent dies; no pointers.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    let mut x = 0u64;
    loop {
        for i in 0..(1u64 << 20) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
        }
        // SAFETY: as above.
        if unsafe { libc::getppid() } != parent {
            std::process::exit(0);
        }
    }
}

/// A child process that is killed if we return early.
pub struct Peer(pub Child);

impl Drop for Peer {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn spawn_self(args: &[&str]) -> Result<Child> {
    let exe = std::env::current_exe().context("finding the ferry executable")?;
    let mut cmd = Command::new(exe);
    if let Some((k, v)) = crate::bench::stages::child_env() {
        cmd.env(k, v);
    }
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("spawning ferry {}", args.join(" ")))
}

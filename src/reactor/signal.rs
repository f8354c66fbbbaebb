//! The endpoint's completion fd: an eventfd that becomes readable when a
//! transfer ends or a notification (an application's, or a step of a
//! two-sided message) arrives, so a service can wait for thousands of
//! transfers in `poll(2)`/`epoll`/asyncio without a spinning thread.
//!
//! Made by the first `fd()` call; until then a completion costs one load.
//! Once made, a completer writes the eventfd only when it is not raised
//! already (`raised`), so a burst of completions costs one syscall until
//! the waiter acknowledges (`ack`: drain the eventfd, lower the flag).
//! The waiter acknowledges *before* it looks at what ended, and each
//! completer publishes *before* it looks at the flag, both with a SeqCst
//! fence between: either the completer sees the flag lowered and raises
//! it again, or the waiter sees the completion — none is missed.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::OnceLock;

#[derive(Debug, Default)]
pub(crate) struct Signal {
    fd: OnceLock<OwnedFd>,
    /// The eventfd holds a count nobody acknowledged yet.
    raised: AtomicBool,
}

impl Signal {
    /// The eventfd, made at the first call.
    pub fn fd(&self) -> std::io::Result<RawFd> {
        if let Some(fd) = self.fd.get() {
            return Ok(fd.as_raw_fd());
        }
        // SAFETY: eventfd takes no pointers; a non-negative result is a
        // new descriptor that we own.
        let raw =
            crate::sys::cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
        // SAFETY: `raw` is ours (just made) and owned once.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // Two first calls at once: one fd wins, the other is closed.
        Ok(self.fd.get_or_init(|| fd).as_raw_fd())
    }

    /// Something ended: make the fd readable, unless nobody asked for it
    /// or it is readable already. Called after the completion is visible.
    #[inline]
    pub fn raise(&self) {
        let Some(fd) = self.fd.get() else {
            return;
        };
        fence(Ordering::SeqCst);
        if self.raised.load(Ordering::Relaxed) || self.raised.swap(true, Ordering::SeqCst) {
            return;
        }
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd. It
        // can only fail with EAGAIN (the count at its maximum: readable
        // anyway), so the result is not needed.
        let _ = unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// The waiter saw the fd readable: drain it and lower the flag; what
    /// ends after this raises it again. Call before looking at what ended.
    pub fn ack(&self) {
        let Some(fd) = self.fd.get() else {
            return;
        };
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer from our
        // eventfd (non-blocking: EAGAIN when it holds nothing).
        let _ = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        self.raised.store(false, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(fd: RawFd) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, live for the call; no wait.
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    }

    #[test]
    fn raised_until_acknowledged_and_again_after() {
        let s = Signal::default();
        // Before anyone asks, raising does nothing (and costs a load).
        s.raise();
        let fd = s.fd().unwrap();
        assert_eq!(s.fd().unwrap(), fd, "one fd for the endpoint");
        assert!(!readable(fd));
        s.raise();
        s.raise();
        assert!(readable(fd));
        s.ack();
        assert!(!readable(fd), "one ack drains a burst");
        s.raise();
        assert!(readable(fd), "what ends after the ack raises it again");
    }
}

//! Completion without polling: the endpoint's completion fd.

use std::os::fd::{AsRawFd, RawFd};

use super::Endpoint;
use crate::error::{Error, Result};

/// # Completion without polling
impl Endpoint {
    /// A file descriptor (an eventfd) that becomes readable when one of
    /// this endpoint's transfers ends or a notification arrives (an
    /// application's, or a step of a two-sided message): wait on it with
    /// `poll(2)`, `epoll` or an event loop instead of spinning on
    /// transfers. Made at the first call (until then completions cost
    /// nothing more); the same fd every call, closed with the endpoint.
    ///
    /// Once it polls readable, call [`Endpoint::ack_completions`], *then*
    /// look at what you wait for (`Transfer::poll`, `poll_message`,
    /// `try_recv_notification`): whatever ends after the ack makes it
    /// readable again, so no completion is missed. The shards must run
    /// without you (managed mode, the default).
    ///
    /// ```no_run
    /// # fn f(ep: &ferry::Endpoint, mut ts: Vec<ferry::Transfer>) -> ferry::Result<()> {
    /// let fd = ep.completion_fd()?;
    /// while !ts.is_empty() {
    ///     let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    ///     // SAFETY: one pollfd, live for the call.
    ///     unsafe { libc::poll(&mut p, 1, 1000) };
    ///     ep.ack_completions();
    ///     ts.retain_mut(|t| t.poll().is_none());
    /// }
    /// # Ok(()) }
    /// ```
    pub fn completion_fd(&self) -> Result<RawFd> {
        self.inner
            .shards
            .table
            .signal()
            .fd()
            .map_err(|e| Error::io("eventfd", e))
    }

    /// Drains the completion fd (see [`Endpoint::completion_fd`]); call it
    /// after the fd polled readable and before looking at what ended.
    pub fn ack_completions(&self) {
        self.inner.shards.table.signal().ack();
    }
}

/// The completion fd ([`Endpoint::completion_fd`]); -1 if it could not be
/// made (out of descriptors): call `completion_fd` to learn why.
impl AsRawFd for Endpoint {
    fn as_raw_fd(&self) -> RawFd {
        self.completion_fd().unwrap_or(-1)
    }
}

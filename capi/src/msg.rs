//! Two-sided messages (the seed's send/recv): matched in order per
//! connection to the buffers the receiver posted.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::{ConnId, Endpoint, MessageOp};

use crate::endpoint::{ferry_endpoint, ferry_region};
use crate::status::*;

/// A send or receive in flight (`ferry_send` / `ferry_recv`).
pub struct ferry_message {
    ep: Arc<crate::drive::Engine>,
    op: MessageOp,
    /// The outcome once known: the length, or the failure's status.
    outcome: Mutex<Option<Result<usize, i32>>>,
}

/// Makes a message op on `[off, off + len)` of `r` (`cut`: cut to the
/// region's end, for a receive buffer).
#[allow(clippy::too_many_arguments)]
fn start(
    what: &str,
    ep: *const ferry_endpoint,
    r: *const ferry_region,
    off: usize,
    len: usize,
    cut: bool,
    out: *mut *mut ferry_message,
    post: impl FnOnce(&Endpoint, &engine::MemoryRegion, usize, usize) -> engine::Result<MessageOp>,
) -> i32 {
    guard(what, || {
        // SAFETY: live handles or NULL (the callers' contracts).
        let (ep, r) = unsafe { (handle(ep, "ep")?, handle(r, "region")?) };
        if out.is_null() {
            return Err(invalid("out is NULL"));
        }
        let len = if cut {
            len.min(r.len().saturating_sub(off))
        } else {
            len
        };
        let (mr, at) = r.part(off, len)?;
        let op = post(&ep.ep, mr, at, len)?;
        let m = give_out(ferry_message {
            ep: ep.ep.clone(),
            op,
            outcome: Mutex::new(None),
        })?;
        // SAFETY: non-null and valid (the callers' contracts).
        unsafe { *out = m };
        Ok(FERRY_OK)
    })
}

/// Sends `[off, off + len)` of `r` as one message into the peer's next
/// posted receive on `conn`. The bytes must stay unchanged until the send
/// ends. A side's part moves in its own calls (poll, wait).
///
/// # Safety
/// `ep`, `r` live; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn ferry_send(
    ep: *const ferry_endpoint,
    conn: u64,
    r: *const ferry_region,
    off: usize,
    len: usize,
    out: *mut *mut ferry_message,
) -> i32 {
    start(
        "ferry_send",
        ep,
        r,
        off,
        len,
        false,
        out,
        |ep, mr, at, len| ep.send_async(ConnId(conn), mr, at, len),
    )
}

/// Posts `[off, off + max)` of `r` (cut to the region's end) for the next
/// message from `conn`; a longer message fails here and at its sender.
/// Up to 65 536 receives (and as many sends) may be under way per
/// connection; past that the post is `FERRY_ERR_BUSY`.
///
/// # Safety
/// `ep`, `r` live; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn ferry_recv(
    ep: *const ferry_endpoint,
    conn: u64,
    r: *const ferry_region,
    off: usize,
    max: usize,
    out: *mut *mut ferry_message,
) -> i32 {
    start(
        "ferry_recv",
        ep,
        r,
        off,
        max,
        true,
        out,
        |ep, mr, at, max| ep.recv_async(ConnId(conn), mr, at, max),
    )
}

impl ferry_message {
    /// Waits (the shards' helpers run them meanwhile).
    fn waited(&self, d: Duration) -> engine::Result<usize> {
        self.ep.hand_over();
        self.ep.wait_message(self.op, d)
    }

    fn check(&self, wait: Option<Duration>, len: *mut usize) -> Result<i32, Fail> {
        let mut st = self.outcome.lock().expect("lock");
        if st.is_none() {
            let r = match wait {
                None => {
                    self.ep.assist();
                    self.ep.poll_message(self.op)
                }
                Some(d) => match self.waited(d) {
                    Err(engine::Error::Timeout { .. }) => None,
                    other => Some(other),
                },
            };
            match r {
                None => return Ok(FERRY_PENDING),
                Some(Ok(n)) => *st = Some(Ok(n)),
                Some(Err(e)) => {
                    let f = Fail::from(e);
                    *st = Some(Err(f.0));
                    return Err(f);
                }
            }
        }
        match st.expect("known") {
            Ok(n) => {
                if !len.is_null() {
                    // SAFETY: non-null and valid (the callers' contracts).
                    unsafe { *len = n };
                }
                Ok(FERRY_OK)
            }
            Err(code) => Err(Fail(code, "the message failed (reported before)".into())),
        }
    }
}

/// `FERRY_OK` once the message moved (its length in `*len`, if not NULL),
/// `FERRY_PENDING` before, its error if it failed.
///
/// # Safety
/// `m` from `ferry_send`/`ferry_recv`, not released; `len` valid or NULL.
#[no_mangle]
pub unsafe extern "C" fn ferry_message_poll(m: *const ferry_message, len: *mut usize) -> i32 {
    guard("ferry_message_poll", || {
        // SAFETY: the caller's promise.
        unsafe { handle(m, "message")? }.check(None, len)
    })
}

/// As `ferry_message_poll`, waiting up to `timeout_ms` first.
///
/// # Safety
/// `m` from `ferry_send`/`ferry_recv`, not released; `len` valid or NULL.
#[no_mangle]
pub unsafe extern "C" fn ferry_message_wait(
    m: *const ferry_message,
    timeout_ms: u32,
    len: *mut usize,
) -> i32 {
    guard("ferry_message_wait", || {
        // SAFETY: the caller's promise.
        let m = unsafe { handle(m, "message")? };
        m.check(Some(Duration::from_millis(timeout_ms.into())), len)
    })
}

/// Releases a message handle (one in flight goes on; its outcome is
/// dropped). NULL: nothing.
///
/// # Safety
/// `m` from `ferry_send`/`ferry_recv`, not used again.
#[no_mangle]
pub unsafe extern "C" fn ferry_message_release(m: *mut ferry_message) {
    if let Some(h) = take_back(m, "ferry_message_release") {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(h)));
    }
}

//! One-sided transfers: a whole list of descriptors in one post, with an
//! optional notification; poll, wait, release.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::{AnyWindow, ConnId, MemoryRegion};

use crate::drive::Engine;
use crate::endpoint::{ferry_endpoint, ferry_region};
use crate::status::*;

/// WRITE: local bytes into the peer's windows.
pub const FERRY_WRITE: u32 = 0;
/// READ: the peer's windows into local bytes.
pub const FERRY_READ: u32 = 1;

/// One piece of a transfer: `len` bytes at `local_offset` of `local` and
/// at `remote_offset` of the peer's `window` (the bytes `ferry_advertise`
/// or `ferry_advertise_ipc` gave it: `window_len` of 64 or 136).
#[repr(C)]
pub struct ferry_desc {
    pub local: *const ferry_region,
    pub local_offset: usize,
    pub len: usize,
    pub window: *const u8,
    pub window_len: usize,
    pub remote_offset: u64,
}

/// A transfer in flight (`ferry_post`).
pub struct ferry_transfer {
    state: Mutex<State>,
    /// Its endpoint: kept alive until the transfer is released, and run
    /// by a polling caller (`FERRY_DRIVE=caller`).
    eng: Arc<Engine>,
}

struct State {
    /// None once its outcome was reported.
    t: Option<engine::Transfer>,
    /// The outcome, once known (reported again on every later call).
    outcome: Option<i32>,
}

/// Starts one transfer of every descriptor in `descs` (`n` of them) on
/// `conn`: one call into ferry for the whole list. With `notif` (`notif_len`
/// bytes, at most `FERRY_MAX_NOTIFY`; NULL: none), ferry sends the peer a
/// notification once the transfer ended well — after the data is in place
/// (a WRITE: the peer applied it; a READ: it is here) — whether or not
/// anyone polls the transfer; a failed transfer sends none.
///
/// # Safety
/// `ep` live; `descs` valid for `n` descriptors, each naming a live region
/// and `window_len` valid bytes; `notif` valid for `notif_len` bytes;
/// `out` valid.
#[no_mangle]
pub unsafe extern "C" fn ferry_post(
    ep: *const ferry_endpoint,
    conn: u64,
    op: u32,
    descs: *const ferry_desc,
    n: usize,
    notif: *const u8,
    notif_len: usize,
    out: *mut *mut ferry_transfer,
) -> i32 {
    guard("ferry_post", || {
        // SAFETY: the caller's promises, as documented.
        let ep = unsafe { handle(ep, "ep")? };
        if out.is_null() {
            return Err(invalid("out is NULL"));
        }
        if n == 0 || descs.is_null() {
            return Err(invalid("no descriptors"));
        }
        if notif_len > crate::endpoint::FERRY_MAX_NOTIFY {
            return Err(invalid(format!(
                "a notification of {notif_len} bytes is over 4096"
            )));
        }
        // SAFETY: as above.
        let note = unsafe { bytes(notif, notif_len, "notif")? };
        // SAFETY: non-null, `n` descriptors (the caller's promise).
        let descs = unsafe { std::slice::from_raw_parts(descs, n) };
        let (locals, windows) = pieces(descs)?;
        let c = ConnId(conn);
        // As the seed: an unknown connection fails the post, not later.
        ep.ep.conn_status(c)?;
        let kind = op_kind(op)?;
        let t = if notif.is_null() {
            match kind {
                engine::OpKind::Write => ep.ep.writev_async(c, &locals, &windows)?,
                engine::OpKind::Read => ep.ep.readv_async(c, &locals, &windows)?,
            }
        } else {
            ep.ep
                .transfer_notify_async(c, kind, &locals, &windows, note)?
        };
        // SAFETY: `out` non-null and valid (the caller's promise).
        unsafe { hand_out(&ep.ep, t, out) }
    })
}

/// Gives a started transfer out as a handle in `*out` (after a turn of
/// the shards for a polling caller).
///
/// # Safety
/// `out` non-null and valid.
pub(crate) unsafe fn hand_out(
    eng: &Arc<Engine>,
    t: engine::Transfer,
    out: *mut *mut ferry_transfer,
) -> Result<i32, Fail> {
    eng.assist();
    let h = give_out(ferry_transfer {
        state: Mutex::new(State {
            t: Some(t),
            outcome: None,
        }),
        eng: eng.clone(),
    })?;
    // SAFETY: the caller's promise.
    unsafe { *out = h };
    Ok(FERRY_OK)
}

/// Every descriptor's local slice and window, checked.
pub(crate) type Pieces<'a> = (Vec<(&'a MemoryRegion, usize, usize)>, Vec<AnyWindow>);

pub(crate) fn pieces(descs: &[ferry_desc]) -> Result<Pieces<'_>, Fail> {
    let mut locals: Vec<(&MemoryRegion, usize, usize)> = Vec::with_capacity(descs.len());
    let mut windows: Vec<AnyWindow> = Vec::with_capacity(descs.len());
    // Descriptors of one remote registration share its window bytes
    // (NIXL passes the same pointer): decoded once per run of them.
    let mut last: Option<(*const u8, usize, AnyWindow)> = None;
    for (i, d) in descs.iter().enumerate() {
        let (l, w) =
            piece(d, &mut last).map_err(|Fail(c, m)| Fail(c, format!("descriptor {i}: {m}")))?;
        locals.push(l);
        windows.push(w);
    }
    Ok((locals, windows))
}

/// `FERRY_WRITE` or `FERRY_READ`.
pub(crate) fn op_kind(op: u32) -> Result<engine::OpKind, Fail> {
    match op {
        FERRY_WRITE => Ok(engine::OpKind::Write),
        FERRY_READ => Ok(engine::OpKind::Read),
        other => Err(invalid(format!("unknown op {other}"))),
    }
}

/// One descriptor's local slice and window, checked; `last` is the window
/// the previous descriptor decoded, by the address and length of its bytes
/// (they stay unchanged during the call: ferry_post's contract).
fn piece<'a>(
    d: &'a ferry_desc,
    last: &mut Option<(*const u8, usize, AnyWindow)>,
) -> Result<((&'a MemoryRegion, usize, usize), AnyWindow), Fail> {
    // SAFETY: a live region or NULL (ferry_post's contract).
    let r = unsafe { handle(d.local, "local")? };
    let (mr, at) = r.part(d.local_offset, d.len)?;
    let w = match last {
        Some((p, n, w)) if *p == d.window && *n == d.window_len => *w,
        _ => {
            // SAFETY: `window_len` valid bytes (ferry_post's contract).
            let raw = unsafe { bytes(d.window, d.window_len, "window")? };
            let w = AnyWindow::decode(raw).map_err(|e| invalid(e.to_string()))?;
            *last = Some((d.window, d.window_len, w));
            w
        }
    };
    let w = w.slice(d.remote_offset, d.len as u64).ok_or_else(|| {
        invalid(format!(
            "[{}, +{}) is outside the {}-byte window",
            d.remote_offset,
            d.len,
            w.len()
        ))
    })?;
    Ok(((mr, at, d.len), w))
}

impl ferry_transfer {
    /// Waits (the shards' helpers run them meanwhile).
    fn waited(&self, t: &mut engine::Transfer, d: Duration) -> engine::Result<()> {
        self.eng.hand_over();
        t.wait_timeout(d)
    }

    /// Its outcome once ended, or `FERRY_PENDING`; `wait` waits up to that
    /// long first.
    fn check(&self, wait: Option<Duration>) -> Result<i32, Fail> {
        let mut st = self.state.lock().expect("lock");
        if let Some(done) = st.outcome {
            return match done {
                FERRY_OK => Ok(FERRY_OK),
                FERRY_ERR_CANCELLED => Err(Fail(
                    FERRY_ERR_CANCELLED,
                    "the transfer was cancelled".into(),
                )),
                code => Err(Fail(code, "the transfer failed (reported before)".into())),
            };
        }
        let t = st.t.as_mut().expect("running until its outcome is known");
        let r = match wait {
            None => t.poll().or_else(|| {
                self.eng.assist();
                t.poll()
            }),
            Some(d) => match self.waited(t, d) {
                Err(engine::Error::Timeout {
                    what: "transfer", ..
                }) => None,
                other => Some(other),
            },
        };
        let Some(r) = r else {
            return Ok(FERRY_PENDING);
        };
        st.t = None;
        match r {
            Ok(()) => {
                st.outcome = Some(FERRY_OK);
                Ok(FERRY_OK)
            }
            Err(e) => {
                let f = Fail::from(e);
                st.outcome = Some(f.0);
                Err(f)
            }
        }
    }
}

/// `FERRY_OK` once the transfer ended well,
/// `FERRY_PENDING` while it runs, its error if it failed.
///
/// # Safety
/// `t` from `ferry_post`, not released.
#[no_mangle]
pub unsafe extern "C" fn ferry_transfer_poll(t: *const ferry_transfer) -> i32 {
    guard("ferry_transfer_poll", || {
        // SAFETY: the caller's promise.
        unsafe { handle(t, "transfer")? }.check(None)
    })
}

/// As `ferry_transfer_poll`, waiting up to `timeout_ms` for the end
/// (`FERRY_PENDING` at the timeout: it goes on).
///
/// # Safety
/// `t` from `ferry_post`, not released.
#[no_mangle]
pub unsafe extern "C" fn ferry_transfer_wait(t: *const ferry_transfer, timeout_ms: u32) -> i32 {
    guard("ferry_transfer_wait", || {
        // SAFETY: the caller's promise.
        let t = unsafe { handle(t, "transfer")? };
        t.check(Some(Duration::from_millis(timeout_ms.into())))
    })
}

/// Cancels a transfer: its notification is withdrawn unless it was already
/// sent, and its outcome becomes `FERRY_ERR_CANCELLED` unless it had
/// already ended. Bytes already on the wire still land (ferry cannot
/// recall them); its memory stays registered until they did, so the
/// regions may be deregistered (that waits) and freed afterwards.
///
/// # Safety
/// `t` from `ferry_post`, not released.
#[no_mangle]
pub unsafe extern "C" fn ferry_transfer_cancel(t: *const ferry_transfer) -> i32 {
    guard("ferry_transfer_cancel", || {
        // SAFETY: the caller's promise.
        let t = unsafe { handle(t, "transfer")? };
        let mut st = t.state.lock().expect("lock");
        if st.outcome.is_none() {
            if let Some(running) = st.t.take() {
                running.withdraw_note();
            }
            st.outcome = Some(FERRY_ERR_CANCELLED);
        }
        Ok(FERRY_OK)
    })
}

/// Releases a transfer. One still in flight runs to its end (its memory
/// stays registered until then, and its notification is still sent if it
/// ends well); its outcome is dropped. NULL: nothing.
///
/// # Safety
/// `t` from `ferry_post`, not used again.
#[no_mangle]
pub unsafe extern "C" fn ferry_transfer_release(t: *mut ferry_transfer) {
    if let Some(h) = take_back(t, "ferry_transfer_release") {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(h)));
    }
}

//! Status codes, the thread's last error, and the guard every entry runs in.

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Done.
pub const FERRY_OK: i32 = 0;
/// Not done yet (a transfer or message still in flight).
pub const FERRY_PENDING: i32 = 1;
/// A null handle or pointer, a short buffer, a bad argument or range.
pub const FERRY_ERR_INVALID: i32 = -1;
/// A wait ran out; what it waited for goes on.
pub const FERRY_ERR_TIMEOUT: i32 = -2;
/// The connection is unknown, closed here, or gone (the peer closed it,
/// reset it or died; a device under it failed).
pub const FERRY_ERR_DISCONNECTED: i32 = -3;
/// The peer refused the operation (key, bounds or access).
pub const FERRY_ERR_REMOTE: i32 = -4;
/// No room now: a full submission queue or every in-flight slot taken.
pub const FERRY_ERR_BUSY: i32 = -5;
/// A panic inside ferry (a bug): the call did nothing further.
pub const FERRY_ERR_PANIC: i32 = -6;
/// Anything else (the message says what).
pub const FERRY_ERR_INTERNAL: i32 = -7;
/// Cancelled by `ferry_transfer_cancel`.
pub const FERRY_ERR_CANCELLED: i32 = -8;
/// The connection failed: its peer did not answer within ferry's deadline
/// (`FERRY_OP_TIMEOUT_MS`, `FERRY_IDLE_TIMEOUT_MS`). Later calls on it
/// get the same status.
pub const FERRY_ERR_PEER_TIMEOUT: i32 = -9;
/// The connection failed: its peer broke the protocol, or its bytes
/// failed their integrity check. Later calls on it get the same status.
pub const FERRY_ERR_PEER_MISBEHAVED: i32 = -10;

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

/// The reason of the last failure of a ferry call on this thread ("" if
/// none): valid until the next ferry call on this thread.
#[no_mangle]
pub extern "C" fn ferry_last_error() -> *const c_char {
    LAST.with(|l| l.borrow().as_ptr())
}

fn set_last(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).expect("no NUL left");
    LAST.with(|l| *l.borrow_mut() = c);
}

/// A failure: its status and its message.
pub(crate) struct Fail(pub i32, pub String);

impl From<engine::Error> for Fail {
    fn from(e: engine::Error) -> Fail {
        use engine::FailureKind as K;
        let code = match e.kind() {
            K::Invalid => FERRY_ERR_INVALID,
            K::Timeout => FERRY_ERR_TIMEOUT,
            K::Busy => FERRY_ERR_BUSY,
            K::Remote => FERRY_ERR_REMOTE,
            K::Disconnected => FERRY_ERR_DISCONNECTED,
            K::PeerTimeout => FERRY_ERR_PEER_TIMEOUT,
            K::PeerMisbehaved => FERRY_ERR_PEER_MISBEHAVED,
            _ => FERRY_ERR_INTERNAL,
        };
        Fail(code, e.to_string())
    }
}

pub(crate) fn invalid(msg: impl Into<String>) -> Fail {
    Fail(FERRY_ERR_INVALID, msg.into())
}

/// Runs one entry: its status, or the failure's (recorded as the thread's
/// last error); a panic is `FERRY_ERR_PANIC`.
pub(crate) fn guard(what: &str, f: impl FnOnce() -> Result<i32, Fail>) -> i32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(status)) => status,
        Ok(Err(Fail(code, msg))) => {
            set_last(&format!("{what}: {msg}"));
            code
        }
        Err(_) => {
            set_last(&format!("{what}: a panic inside ferry"));
            FERRY_ERR_PANIC
        }
    }
}

/// The value of handle `p`, or `FERRY_ERR_INVALID` naming `name`: NULL,
/// released, or never given out.
///
/// # Safety
/// No other thread releases `p` during the call (the C face's contract).
pub(crate) unsafe fn handle<'a, T: crate::handles::Handled>(
    p: *const T,
    name: &str,
) -> Result<&'a T, Fail> {
    if p.is_null() {
        return Err(invalid(format!("{name} is NULL")));
    }
    T::table().get(p).ok_or_else(|| {
        invalid(format!(
            "{name} {p:p} is not a live handle (released, or never given out)"
        ))
    })
}

/// Gives out `value` as a handle (NULL past 4 Mi live ones of its kind).
pub(crate) fn give_out<T: crate::handles::Handled>(value: T) -> Result<*mut T, Fail> {
    T::table().insert(value).ok_or_else(|| {
        Fail(
            FERRY_ERR_BUSY,
            "every handle slot of this kind is taken".into(),
        )
    })
}

/// Ends handle `p`, handing back its value; NULL or a dead handle: `None`
/// (recorded as the thread's last error, as `what` found it).
pub(crate) fn take_back<T: crate::handles::Handled>(p: *const T, what: &str) -> Option<Box<T>> {
    if p.is_null() {
        return None;
    }
    let v = T::table().remove(p);
    if v.is_none() {
        set_last(&format!(
            "{what}: {p:p} is not a live handle (released twice, or never given out)"
        ));
    }
    v
}

/// `len` bytes at `p` (empty for a zero length), or `FERRY_ERR_INVALID`.
///
/// # Safety
/// `p` is null or valid for `len` bytes for the call's duration.
pub(crate) unsafe fn bytes<'a>(p: *const u8, len: usize, name: &str) -> Result<&'a [u8], Fail> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(invalid(format!("{name} is NULL with a length of {len}")));
    }
    // SAFETY: non-null, and the caller's promise of `len` valid bytes.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// Writes `src` to `out` (which holds `cap` bytes) and its length to
/// `len_out`; a short or null `out` is `FERRY_ERR_INVALID`, with the
/// length needed still written to `len_out`.
///
/// # Safety
/// `out` is null or valid for `cap` bytes; `len_out` is null or valid.
pub(crate) unsafe fn give(
    src: &[u8],
    out: *mut u8,
    cap: usize,
    len_out: *mut usize,
    name: &str,
) -> Result<i32, Fail> {
    if !len_out.is_null() {
        // SAFETY: non-null, the caller's promise.
        unsafe { *len_out = src.len() };
    }
    if out.is_null() || cap < src.len() {
        return Err(invalid(format!(
            "{name} needs {} bytes, the buffer holds {cap}{}",
            src.len(),
            if out.is_null() { " (NULL)" } else { "" }
        )));
    }
    // SAFETY: `out` holds `cap` >= src.len() bytes (checked), distinct
    // from `src` (ours).
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), out, src.len()) };
    Ok(FERRY_OK)
}

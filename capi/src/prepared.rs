//! Transfers checked once and posted many times (a NIXL transfer handle):
//! `ferry_prepare`, `ferry_post_prepared`, `ferry_prepared_free`.

use std::sync::Arc;

use engine::{ConnId, MemoryRegion};

use crate::drive::Engine;
use crate::endpoint::ferry_endpoint;
use crate::status::*;
use crate::xfer::{ferry_desc, ferry_transfer, hand_out, op_kind, pieces};

/// A transfer checked by `ferry_prepare`: its descriptors' regions are
/// held (a `ferry_deregister` of one waits for `ferry_prepared_free`, 10 s
/// at most), its windows decoded, and for CUDA IPC windows the copies
/// planned, so that each `ferry_post_prepared` checks nothing per
/// descriptor.
pub struct ferry_prepared {
    /// Declared first, so dropped first: it borrows `regions`.
    p: engine::Prepared<'static>,
    /// Each distinct registration the descriptors name, held.
    #[allow(dead_code)]
    regions: Vec<Arc<MemoryRegion>>,
    eng: Arc<Engine>,
}

/// Checks the transfer of every descriptor in `descs` (`n` of them) on
/// `conn` once, for posting with `ferry_post_prepared` as often as
/// wanted; fails as `ferry_post` would for the same descriptors.
///
/// # Safety
/// `ep` live; `descs` valid for `n` descriptors, each naming a live region
/// and `window_len` valid bytes; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn ferry_prepare(
    ep: *const ferry_endpoint,
    conn: u64,
    op: u32,
    descs: *const ferry_desc,
    n: usize,
    out: *mut *mut ferry_prepared,
) -> i32 {
    guard("ferry_prepare", || {
        // SAFETY: the caller's promises, as documented.
        let ep = unsafe { handle(ep, "ep")? };
        if out.is_null() {
            return Err(invalid("out is NULL"));
        }
        if n == 0 || descs.is_null() {
            return Err(invalid("no descriptors"));
        }
        // SAFETY: non-null, `n` descriptors (the caller's promise).
        let descs = unsafe { std::slice::from_raw_parts(descs, n) };
        let kind = op_kind(op)?;
        let c = ConnId(conn);
        ep.ep.conn_status(c)?;
        let (locals, windows) = pieces(descs)?;
        // Hold each registration, and borrow the held one for as long as
        // the handle lives.
        let mut regions: Vec<Arc<MemoryRegion>> = Vec::new();
        let mut held: Vec<(&'static MemoryRegion, usize, usize)> = Vec::with_capacity(n);
        for (d, &(mr, off, len)) in descs.iter().zip(&locals) {
            // SAFETY: a live region (checked by `pieces` above).
            let whole = unsafe { handle(d.local, "local")? }
                .registration()
                .ok_or_else(|| invalid("a region is released"))?;
            debug_assert!(std::ptr::eq(whole.as_ref(), mr));
            let arc = match regions.iter().find(|r| Arc::ptr_eq(r, whole)) {
                Some(a) => a.clone(),
                None => {
                    regions.push(whole.clone());
                    whole.clone()
                }
            };
            // SAFETY: the region is inside an Arc that `regions` holds
            // until the handle is dropped, after `p` (field order): the
            // reference stays valid for as long as it is used.
            let r: &'static MemoryRegion = unsafe { &*Arc::as_ptr(&arc) };
            held.push((r, off, len));
        }
        let p = ep.ep.prepare(c, kind, &held, &windows)?;
        let h = give_out(ferry_prepared {
            p,
            regions,
            eng: ep.ep.clone(),
        })?;
        // SAFETY: `out` non-null and valid (the caller's promise).
        unsafe { *out = h };
        Ok(FERRY_OK)
    })
}

/// Starts a prepared transfer, with a notification as `ferry_post`'s
/// (`notif`, `notif_len`; NULL: none). The transfer is its own handle
/// (poll, wait, release as any); the prepared one may be posted again at
/// once.
///
/// # Safety
/// `p` from `ferry_prepare`, not freed; `notif` valid for `notif_len`
/// bytes; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn ferry_post_prepared(
    p: *const ferry_prepared,
    notif: *const u8,
    notif_len: usize,
    out: *mut *mut ferry_transfer,
) -> i32 {
    guard("ferry_post_prepared", || {
        // SAFETY: the caller's promises, as documented.
        let p = unsafe { handle(p, "p")? };
        if out.is_null() {
            return Err(invalid("out is NULL"));
        }
        if notif_len > crate::endpoint::FERRY_MAX_NOTIFY {
            return Err(invalid(format!(
                "a notification of {notif_len} bytes is over 4096"
            )));
        }
        // SAFETY: as above.
        let note = unsafe { bytes(notif, notif_len, "notif")? };
        let note = (!notif.is_null()).then_some(note);
        let t = p.eng.post(&p.p, note)?;
        // SAFETY: `out` non-null and valid (the caller's promise).
        unsafe { hand_out(&p.eng, t, out) }
    })
}

/// Frees a prepared transfer (transfers posted from it run on). NULL:
/// nothing.
///
/// # Safety
/// `p` from `ferry_prepare`, not used again.
#[no_mangle]
pub unsafe extern "C" fn ferry_prepared_free(p: *mut ferry_prepared) {
    if let Some(h) = take_back(p, "ferry_prepared_free") {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(h)));
    }
}

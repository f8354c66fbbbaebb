//! Config, endpoints, connections, registrations, windows, notifications.

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::{Access, ConnId, Endpoint, SharedRegion};

use crate::drive::{Driver, Engine};
use crate::status::*;

/// Settings for a new endpoint: the `FERRY_*` variables by name (values
/// set here win over the environment's).
pub struct ferry_config {
    vars: Mutex<HashMap<String, String>>,
}

/// An endpoint (its shards run on ferry's threads, or with
/// `FERRY_DRIVE=caller` on the calling threads too).
pub struct ferry_endpoint {
    pub(crate) ep: Arc<Engine>,
    /// A notification too long for the caller's buffer, kept for the next call.
    held_note: Mutex<Option<(ConnId, Vec<u8>)>>,
}

/// A registration of `[ptr, ptr + len)` (host or GPU memory).
pub struct ferry_region {
    pub(crate) ep: Arc<Engine>,
    pub(crate) sh: Option<SharedRegion>,
}

/// `ferry_register` flag: peers may only READ it, and it is never the
/// destination of this side's READs.
pub const FERRY_ACCESS_READONLY: u32 = 1;
/// `ferry_advertise` connection for a window any connected peer may use
/// (the registration's own key, until deregistration).
pub const FERRY_ANY_CONN: u64 = u64::MAX;

/// `ferry_region_set_dtype` value types (the seed's `FloatType` numbers,
/// and `FERRY_DTYPE_BYTES` for opaque bytes).
pub const FERRY_DTYPE_NONE: u32 = 0;
pub const FERRY_DTYPE_FP16: u32 = 1;
pub const FERRY_DTYPE_BF16: u32 = 2;
pub const FERRY_DTYPE_FP32: u32 = 3;
pub const FERRY_DTYPE_FP8_E4M3: u32 = 4;
pub const FERRY_DTYPE_FP8_E5M2: u32 = 5;
pub const FERRY_DTYPE_BYTES: u32 = 6;
/// Bytes of a key window (`ferry_advertise`).
pub const FERRY_WINDOW_LEN: usize = 64;
/// Bytes of a CUDA IPC window (`ferry_advertise_ipc`).
pub const FERRY_IPC_WINDOW_LEN: usize = 136;
/// Longest notification.
pub const FERRY_MAX_NOTIFY: usize = 4096;

/// A new, empty config.
#[no_mangle]
pub extern "C" fn ferry_config_new() -> *mut ferry_config {
    give_out(ferry_config {
        vars: Mutex::new(HashMap::new()),
    })
    .unwrap_or(std::ptr::null_mut())
}

/// Sets variable `name` (e.g. "FERRY_SHARDS") to `value`. An unknown name
/// or a bad value is refused when the endpoint is made.
///
/// # Safety
/// `cfg` from `ferry_config_new`; `name` and `value` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn ferry_config_set(
    cfg: *mut ferry_config,
    name: *const c_char,
    value: *const c_char,
) -> i32 {
    guard("ferry_config_set", || {
        // SAFETY: the caller's promises (not released meanwhile;
        // NUL-terminated strings or NULL).
        let (cfg, n, v) = unsafe {
            (
                handle(cfg, "cfg")?,
                cstr(name, "name")?,
                cstr(value, "value")?,
            )
        };
        cfg.vars.lock().expect("lock").insert(n, v);
        Ok(FERRY_OK)
    })
}

/// Frees a config (NULL: nothing).
///
/// # Safety
/// `cfg` from `ferry_config_new`, not used again.
#[no_mangle]
pub unsafe extern "C" fn ferry_config_free(cfg: *mut ferry_config) {
    drop(take_back(cfg, "ferry_config_free"));
}

/// # Safety
/// `p` is null or NUL-terminated.
unsafe fn cstr(p: *const c_char, name: &str) -> Result<String, Fail> {
    if p.is_null() {
        return Err(invalid(format!("{name} is NULL")));
    }
    // SAFETY: non-null and NUL-terminated (the caller's promise).
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(str::to_owned)
        .map_err(|_| invalid(format!("{name} is not UTF-8")))
}

/// Makes an endpoint from `cfg` (NULL: the environment alone) into `*out`.
///
/// # Safety
/// `cfg` is NULL or a live config; `out` is valid for one pointer.
#[no_mangle]
pub unsafe extern "C" fn ferry_endpoint_create(
    cfg: *const ferry_config,
    out: *mut *mut ferry_endpoint,
) -> i32 {
    guard("ferry_endpoint_create", || {
        if out.is_null() {
            return Err(invalid("out is NULL"));
        }
        let vars = if cfg.is_null() {
            HashMap::new()
        } else {
            // SAFETY: the caller's promise (not released meanwhile).
            unsafe { handle(cfg, "cfg")? }
                .vars
                .lock()
                .expect("lock")
                .clone()
        };
        let asked = Mutex::new(Vec::new());
        let config = engine::Config::from_lookup(|k| {
            asked.lock().expect("lock").push(k.to_owned());
            vars.get(k).cloned().or_else(|| std::env::var(k).ok())
        })?;
        let asked = asked.into_inner().expect("lock");
        let ours = |k: &String| k == "FERRY_DRIVE";
        if let Some(unknown) = vars.keys().find(|k| !asked.contains(k) && !ours(k)) {
            return Err(invalid(format!("{unknown} is not a ferry setting")));
        }
        let drive = vars
            .get("FERRY_DRIVE")
            .cloned()
            .or_else(|| std::env::var("FERRY_DRIVE").ok());
        let caller = match drive.as_deref() {
            None | Some("threads") => false,
            Some("caller") => true,
            Some(other) => {
                return Err(invalid(format!(
                    "invalid FERRY_DRIVE = {other:?}: expected threads or caller"
                )))
            }
        };
        let mut config = config;
        if caller {
            config.mode = engine::Mode::Embedded;
        }
        let ep = Endpoint::builder().config(config).build()?;
        let drive = if caller {
            let d = Driver::start(&ep)
                .map_err(|e| Fail(FERRY_ERR_INTERNAL, format!("a shard helper thread: {e}")))?;
            Some(d)
        } else {
            None
        };
        let h = give_out(ferry_endpoint {
            ep: Arc::new(Engine { ep, drive }),
            held_note: Mutex::new(None),
        })?;
        // SAFETY: `out` is non-null and valid (the caller's promise).
        unsafe { *out = h };
        Ok(FERRY_OK)
    })
}

/// Releases the handle; the endpoint shuts down once its last region and
/// transfer are released too. NULL: nothing.
///
/// # Safety
/// `ep` from `ferry_endpoint_create`, not used again.
#[no_mangle]
pub unsafe extern "C" fn ferry_endpoint_destroy(ep: *mut ferry_endpoint) {
    if let Some(h) = take_back(ep, "ferry_endpoint_destroy") {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(h)));
    }
}

/// The endpoint's completion fd into `*fd`: an eventfd that becomes
/// readable when one of its transfers ends or a notification (or a step
/// of a two-sided message) arrives — wait on it with poll/epoll instead of
/// polling transfers. Once it is readable, call `ferry_endpoint_ack`, then
/// poll what you wait for: what ends after the ack makes it readable
/// again. One waiter per endpoint (the one that acks). The same fd every
/// call; closed by `ferry_endpoint_destroy`. With `FERRY_DRIVE=caller`
/// ferry's helpers run the shards while the caller sleeps.
///
/// # Safety
/// `ep` live; `fd` valid.
#[no_mangle]
pub unsafe extern "C" fn ferry_endpoint_fd(ep: *const ferry_endpoint, fd: *mut i32) -> i32 {
    guard("ferry_endpoint_fd", || {
        // SAFETY: the caller's promises, as documented.
        let ep = unsafe { handle(ep, "ep")? };
        if fd.is_null() {
            return Err(invalid("fd is NULL"));
        }
        let got = ep.ep.completion_fd()?;
        // A caller about to sleep on the fd: the helpers run the shards.
        ep.ep.hand_over();
        // SAFETY: non-null and valid (the caller's promise).
        unsafe { *fd = got };
        Ok(FERRY_OK)
    })
}

/// Drains the completion fd (`ferry_endpoint_fd`): call it after the fd
/// polled readable and before polling transfers.
///
/// # Safety
/// `ep` live.
#[no_mangle]
pub unsafe extern "C" fn ferry_endpoint_ack(ep: *const ferry_endpoint) -> i32 {
    guard("ferry_endpoint_ack", || {
        // SAFETY: the caller's promise.
        let ep = unsafe { handle(ep, "ep")? };
        ep.ep.ack_completions();
        Ok(FERRY_OK)
    })
}

/// The endpoint's metrics in the Prometheus text format (what a
/// service serves as `GET /metrics`; see the README's "Watching it run")
/// into `buf` (`cap` bytes), its length in `*len`. A short or NULL `buf`
/// is `FERRY_ERR_INVALID` with the length needed still in `*len` (the
/// text grows a little as counters grow: ask with room to spare). Not
/// NUL-terminated.
///
/// # Safety
/// `ep` live; `buf` valid for `cap` bytes (or NULL); `len` valid or NULL.
#[no_mangle]
pub unsafe extern "C" fn ferry_metrics(
    ep: *const ferry_endpoint,
    buf: *mut std::ffi::c_char,
    cap: usize,
    len: *mut usize,
) -> i32 {
    guard("ferry_metrics", || {
        // SAFETY: the caller's promises, as documented.
        unsafe {
            let ep = handle(ep, "ep")?;
            give(
                ep.ep.metrics_text().as_bytes(),
                buf.cast(),
                cap,
                len,
                "the metrics",
            )
        }
    })
}

/// The endpoint's metadata (the seed's format; what peers pass to
/// `ferry_add_remote`) into `buf` (`cap` bytes); its length in `*len`.
///
/// # Safety
/// `ep` live; `buf` valid for `cap` bytes (or NULL); `len` valid or NULL.
#[no_mangle]
pub unsafe extern "C" fn ferry_endpoint_metadata(
    ep: *const ferry_endpoint,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
) -> i32 {
    guard("ferry_endpoint_metadata", || {
        // SAFETY: the caller's promises, as documented.
        unsafe {
            let ep = handle(ep, "ep")?;
            give(&ep.ep.metadata_bytes(), buf, cap, len, "the metadata")
        }
    })
}

/// Connects to the peer whose metadata is `meta` (`len` bytes).
///
/// # Safety
/// `ep` live; `meta` valid for `len` bytes; `conn` valid.
#[no_mangle]
pub unsafe extern "C" fn ferry_add_remote(
    ep: *const ferry_endpoint,
    meta: *const u8,
    len: usize,
    conn: *mut u64,
) -> i32 {
    guard("ferry_add_remote", || {
        // SAFETY: the caller's promises, as documented.
        let (ep, meta, conn) = unsafe {
            (
                handle(ep, "ep")?,
                bytes(meta, len, "meta")?,
                slot(conn, "conn")?,
            )
        };
        ep.ep.hand_over();
        *conn = ep.ep.add_remote(meta)?.0;
        Ok(FERRY_OK)
    })
}

/// Connects to `ip:port` (IPv4 or IPv6 text).
///
/// # Safety
/// `ep` live; `ip` NUL-terminated; `conn` valid.
#[no_mangle]
pub unsafe extern "C" fn ferry_connect(
    ep: *const ferry_endpoint,
    ip: *const c_char,
    port: u16,
    conn: *mut u64,
) -> i32 {
    guard("ferry_connect", || {
        // SAFETY: the caller's promises, as documented.
        let (ep, ip, conn) = unsafe { (handle(ep, "ep")?, cstr(ip, "ip")?, slot(conn, "conn")?) };
        let ip: std::net::IpAddr = ip
            .parse()
            .map_err(|_| invalid(format!("{ip:?} is not an IP address")))?;
        ep.ep.hand_over();
        *conn = ep.ep.connect((ip, port).into())?.0;
        Ok(FERRY_OK)
    })
}

/// Accepts connections in the background from now on.
///
/// # Safety
/// `ep` live.
#[no_mangle]
pub unsafe extern "C" fn ferry_start_passive_accept(ep: *const ferry_endpoint) -> i32 {
    guard("ferry_start_passive_accept", || {
        // SAFETY: the caller's promise.
        unsafe { handle(ep, "ep")? }.ep.start_passive_accept()?;
        Ok(FERRY_OK)
    })
}

/// Waits up to `timeout_ms` for a peer's connection.
///
/// # Safety
/// `ep` live; `conn` valid.
#[no_mangle]
pub unsafe extern "C" fn ferry_accept(
    ep: *const ferry_endpoint,
    timeout_ms: u32,
    conn: *mut u64,
) -> i32 {
    guard("ferry_accept", || {
        // SAFETY: the caller's promise.
        let (ep, conn) = unsafe { (handle(ep, "ep")?, slot(conn, "conn")?) };
        let (c, _) = ep.ep.accept(Duration::from_millis(timeout_ms.into()))?;
        *conn = c.0;
        Ok(FERRY_OK)
    })
}

/// Whether the peer on `conn` is on this host (`*local` = 1: shared
/// memory, and CUDA IPC windows work) or reached over the network (0).
///
/// # Safety
/// `ep` live; `local` valid.
#[no_mangle]
pub unsafe extern "C" fn ferry_peer_is_local(
    ep: *const ferry_endpoint,
    conn: u64,
    local: *mut i32,
) -> i32 {
    guard("ferry_peer_is_local", || {
        // SAFETY: the caller's promise.
        let (ep, local) = unsafe { (handle(ep, "ep")?, slot(local, "local")?) };
        let c = ConnId(conn);
        let peer = ep.ep.conn_status(c)?;
        *local = i32::from(matches!(peer, engine::Peer::Local { .. }));
        Ok(FERRY_OK)
    })
}

/// Closes a connection; what was under way on it fails.
///
/// # Safety
/// `ep` live.
#[no_mangle]
pub unsafe extern "C" fn ferry_remove_remote(ep: *const ferry_endpoint, conn: u64) -> i32 {
    guard("ferry_remove_remote", || {
        // SAFETY: the caller's promise.
        unsafe { handle(ep, "ep")? }
            .ep
            .remove_remote(ConnId(conn))?;
        Ok(FERRY_OK)
    })
}

/// Whether the far end of `conn` is the endpoint that `meta` (`len`
/// bytes, metadata the caller trusts, e.g. loaded for a peer it knows by
/// name) describes: `*vouched` = 1 or 0. For a connection a peer dialed,
/// that endpoint is asked whether it dialed it to us (one round trip,
/// within the connect timeout; it answers from its accept loop, so it must
/// accept: `ferry_start_passive_accept`); an error means it could not be
/// asked, and nothing is proven either way.
///
/// # Safety
/// `ep` live; `meta` valid for `len` bytes; `vouched` valid.
#[no_mangle]
pub unsafe extern "C" fn ferry_vouch(
    ep: *const ferry_endpoint,
    conn: u64,
    meta: *const u8,
    len: usize,
    vouched: *mut i32,
) -> i32 {
    guard("ferry_vouch", || {
        // SAFETY: the caller's promises, as documented.
        let (ep, meta, vouched) = unsafe {
            (
                handle(ep, "ep")?,
                bytes(meta, len, "meta")?,
                slot(vouched, "vouched")?,
            )
        };
        let at = engine::wire::EndpointMetadata::decode(meta)
            .map_err(engine::Error::from)?
            .socket_addr();
        *vouched = i32::from(ep.ep.vouch(ConnId(conn), at)?);
        Ok(FERRY_OK)
    })
}

/// The output slot `p`, checked before the call does (or waits for)
/// anything: a NULL output is refused at once.
///
/// # Safety
/// `p` is null or valid for one `T` for the call's duration.
unsafe fn slot<'a, T>(p: *mut T, name: &str) -> Result<&'a mut T, Fail> {
    // SAFETY: null is refused; otherwise the caller's promise above.
    unsafe { p.as_mut() }.ok_or_else(|| invalid(format!("{name} is NULL")))
}

/// Registers `[ptr, ptr + len)`, host or GPU memory (`flags`: 0 or
/// `FERRY_ACCESS_READONLY`). The range must be mapped with that access
/// (checked: an unmapped address is an error naming it) and stay valid
/// until `ferry_deregister` returns. The same range again, or a part of a
/// live registration, shares it (one NIC registration, same keys).
///
/// # Safety
/// `ep` live; `out` valid; the memory stays valid until deregistered.
#[no_mangle]
pub unsafe extern "C" fn ferry_register(
    ep: *const ferry_endpoint,
    ptr: *mut c_void,
    len: usize,
    flags: u32,
    out: *mut *mut ferry_region,
) -> i32 {
    guard("ferry_register", || {
        // SAFETY: the caller's promise.
        let ep = unsafe { handle(ep, "ep")? };
        if out.is_null() {
            return Err(invalid("out is NULL"));
        }
        if flags & !FERRY_ACCESS_READONLY != 0 {
            return Err(invalid(format!("unknown flags {flags:#x}")));
        }
        let access = if flags & FERRY_ACCESS_READONLY != 0 {
            Access::REMOTE_READ
        } else {
            Access::all()
        };
        // SAFETY: register_shared checks that the range is mapped with
        // `access`; that it stays valid until deregistered is this
        // function's contract with its caller.
        let sh = unsafe { ep.ep.register_shared(ptr.cast(), len, access) }?;
        let r = give_out(ferry_region {
            ep: ep.ep.clone(),
            sh: Some(sh),
        })?;
        // SAFETY: `out` non-null and valid (the caller's promise).
        unsafe { *out = r };
        Ok(FERRY_OK)
    })
}

/// Says what a registration's values are (`FERRY_DTYPE_*`), so tcp
/// transfers of it may be compressed losslessly (`FERRY_COMPRESS`): windows
/// advertised from now on carry the type. `FERRY_DTYPE_NONE` undoes it.
/// A registration shared by several `ferry_register` calls of one range
/// has one type: the last one set.
///
/// # Safety
/// `r` from `ferry_register`, live.
#[no_mangle]
pub unsafe extern "C" fn ferry_region_set_dtype(r: *const ferry_region, dtype: u32) -> i32 {
    use engine::codec::FloatType;
    guard("ferry_region_set_dtype", || {
        // SAFETY: the caller's promise.
        let r = unsafe { handle(r, "region")? };
        let t = match dtype {
            FERRY_DTYPE_NONE => None,
            FERRY_DTYPE_FP16 => Some(FloatType::Fp16),
            FERRY_DTYPE_BF16 => Some(FloatType::Bf16),
            FERRY_DTYPE_FP32 => Some(FloatType::Fp32),
            FERRY_DTYPE_FP8_E4M3 => Some(FloatType::Fp8E4m3),
            FERRY_DTYPE_FP8_E5M2 => Some(FloatType::Fp8E5m2),
            FERRY_DTYPE_BYTES => Some(FloatType::Bytes),
            other => return Err(invalid(format!("unknown dtype {other} (FERRY_DTYPE_*)"))),
        };
        let sh =
            r.sh.as_ref()
                .ok_or_else(|| invalid("the region was deregistered"))?;
        sh.region().set_dtype(t);
        Ok(FERRY_OK)
    })
}

/// Releases a registration (the last holder of a shared one ends it, once
/// no call holds it: this may wait up to 10 s). NULL: nothing.
///
/// # Safety
/// `r` from `ferry_register`, not used again.
#[no_mangle]
pub unsafe extern "C" fn ferry_deregister(r: *mut ferry_region) -> i32 {
    if r.is_null() {
        return FERRY_OK;
    }
    let Some(mut r) = take_back(r, "ferry_deregister") else {
        return FERRY_ERR_INVALID;
    };
    guard("ferry_deregister", move || {
        let Some(sh) = r.sh.take() else {
            return Ok(FERRY_OK);
        };
        let Some(mr) = r.ep.release_shared(sh) else {
            return Ok(FERRY_OK);
        };
        match r.ep.deregister_when_free(mr, Duration::from_secs(10)) {
            Err(engine::Error::Timeout { .. }) => Err(Fail(
                FERRY_ERR_BUSY,
                "still held by a call after 10 s; deregistered when it ends".into(),
            )),
            other => Ok(other.map(|()| FERRY_OK)?),
        }
    })
}

impl ferry_region {
    /// The whole registration this handle's range is in (None once
    /// released).
    pub(crate) fn registration(&self) -> Option<&Arc<engine::MemoryRegion>> {
        self.sh.as_ref().map(SharedRegion::region)
    }

    /// Bytes this handle's range holds (0 once released).
    pub(crate) fn len(&self) -> usize {
        self.sh.as_ref().map_or(0, SharedRegion::len)
    }

    /// The registration and where `[off, off + len)` of this handle's
    /// range starts in it.
    pub(crate) fn part(
        &self,
        off: usize,
        len: usize,
    ) -> Result<(&engine::MemoryRegion, usize), Fail> {
        let sh = self
            .sh
            .as_ref()
            .ok_or_else(|| invalid("the region is released"))?;
        if off.checked_add(len).map_or(true, |end| end > sh.len()) {
            return Err(invalid(format!(
                "[{off}, +{len}) is outside the {}-byte region",
                sh.len()
            )));
        }
        Ok((sh.region(), sh.offset() + off))
    }
}

/// The window part of both advertise calls: `[off, off + len)` of `r`,
/// made by `make` from the registration and the offset in it, into `out`.
///
/// # Safety
/// `ep`, `r` live or NULL; `out` valid for `out_len` bytes or NULL.
#[allow(clippy::too_many_arguments)]
unsafe fn advertise_with(
    what: &str,
    ep: *const ferry_endpoint,
    r: *const ferry_region,
    off: usize,
    len: usize,
    out: *mut u8,
    out_len: usize,
    make: impl FnOnce(&Endpoint, &engine::MemoryRegion, usize) -> engine::Result<Vec<u8>>,
) -> i32 {
    guard(what, || {
        // SAFETY: the caller's promises.
        let (ep, r) = unsafe { (handle(ep, "ep")?, handle(r, "region")?) };
        let (mr, at) = r.part(off, len)?;
        let w = make(&ep.ep, mr, at)?;
        // SAFETY: as above.
        unsafe { give(&w, out, out_len, std::ptr::null_mut(), "the window") }
    })
}

/// A key window on `[off, off + len)` of `r` for the peer on `conn`
/// (`FERRY_ANY_CONN`: any connected peer) into `out` (`out_len` ≥
/// `FERRY_WINDOW_LEN`).
///
/// # Safety
/// `ep`, `r` live; `out` valid for `out_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn ferry_advertise(
    ep: *const ferry_endpoint,
    conn: u64,
    r: *const ferry_region,
    off: usize,
    len: usize,
    out: *mut u8,
    out_len: usize,
) -> i32 {
    let make = |ep: &Endpoint, mr: &engine::MemoryRegion, at| {
        let w = if conn == FERRY_ANY_CONN {
            mr.advertise(at, len)?
        } else {
            ep.advertise(ConnId(conn), mr, at, len)?
        };
        Ok(w.encode().to_vec())
    };
    // SAFETY: this function's contract.
    unsafe { advertise_with("ferry_advertise", ep, r, off, len, out, out_len, make) }
}

/// A CUDA IPC window on `[off, off + len)` of GPU region `r` for the
/// same-host peer on `conn` (`FERRY_ANY_CONN`: any same-host peer) into `out` (`out_len` ≥ `FERRY_IPC_WINDOW_LEN`).
///
/// # Safety
/// `ep`, `r` live; `out` valid for `out_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn ferry_advertise_ipc(
    ep: *const ferry_endpoint,
    conn: u64,
    r: *const ferry_region,
    off: usize,
    len: usize,
    out: *mut u8,
    out_len: usize,
) -> i32 {
    let make = |ep: &Endpoint, mr: &engine::MemoryRegion, at| {
        let w = if conn == FERRY_ANY_CONN {
            mr.advertise_ipc(at, len)?
        } else {
            ep.advertise_ipc(ConnId(conn), mr, at, len)?
        };
        Ok(w.encode().to_vec())
    };
    // SAFETY: this function's contract.
    unsafe { advertise_with("ferry_advertise_ipc", ep, r, off, len, out, out_len, make) }
}

/// Sends `len` bytes (at most `FERRY_MAX_NOTIFY`) to the peer's inbox.
/// `FERRY_OK`: it will arrive, or the connection fails (later calls say
/// why). `FERRY_ERR_BUSY`: the connection already holds
/// `FERRY_NOTIFY_OUTBOX` notifications not yet sent (its peer is not
/// reading); nothing was taken: try again.
///
/// # Safety
/// `ep` live; `msg` valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn ferry_send_notification(
    ep: *const ferry_endpoint,
    conn: u64,
    msg: *const u8,
    len: usize,
) -> i32 {
    guard("ferry_send_notification", || {
        // SAFETY: the caller's promises.
        let (ep, msg) = unsafe { (handle(ep, "ep")?, bytes(msg, len, "msg")?) };
        let sent = ep.ep.send_notification(ConnId(conn), msg);
        // Refused for room too: a caller that tries again moves the
        // shards that make the room (FERRY_DRIVE=caller).
        ep.ep.assist();
        sent?;
        Ok(FERRY_OK)
    })
}

/// Waits up to `timeout_ms` for a notification: its connection in
/// `*conn`, its bytes in `buf` (`cap` bytes), its length in `*len`. A
/// buffer too short is `FERRY_ERR_INVALID` with `*len` the length needed;
/// the notification is kept for the next call.
///
/// # Safety
/// `ep` live; `conn`, `len` valid; `buf` valid for `cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn ferry_recv_notification(
    ep: *const ferry_endpoint,
    timeout_ms: u32,
    conn: *mut u64,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
) -> i32 {
    guard("ferry_recv_notification", || {
        // SAFETY: the caller's promise.
        let ep = unsafe { handle(ep, "ep")? };
        if conn.is_null() || len.is_null() {
            return Err(invalid("conn or len is NULL"));
        }
        let held = ep.held_note.lock().expect("lock").take();
        let (c, msg) = match held {
            Some(n) => n,
            None => {
                if timeout_ms == 0 {
                    ep.ep.assist();
                } else {
                    ep.ep.hand_over();
                }
                ep.ep
                    .recv_notification(Duration::from_millis(timeout_ms.into()))?
            }
        };
        // SAFETY: checked non-null; valid (the caller's promise).
        unsafe { *conn = c.0 };
        // SAFETY: as above.
        match unsafe { give(&msg, buf, cap, len, "the notification") } {
            Ok(s) => Ok(s),
            Err(e) => {
                *ep.held_note.lock().expect("lock") = Some((c, msg));
                Err(e)
            }
        }
    })
}

//! `ferry.p2p.Endpoint`: the seed's Python `Endpoint`, name for name, on a
//! `ferry::Endpoint`.
//!
//! Integer ids map to ferry objects through tables: a connection id is the
//! `ConnId` itself; `mr_id`s and transfer ids index tables here. Where the
//! seed aborts or returns `false`, this returns `ok=False`, logs why on the
//! `ferry` logger, and (with `strict=True`) raises `FerryError` instead.
//! Where the seed raises for malformed arguments (lists of unequal length,
//! a `meta` that is not 64 bytes), this raises too.
//!
//! Raw pointers are the caller's promise, as in the seed: memory given to
//! `reg` (or met by an `*_ipc` call, which registers the containing GPU
//! allocation, or the exact host range, on first use) must stay valid
//! until `dereg` (or `close`) returns.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry::wire::{IPC_BUF_LEN, REMOTE_BUF_LEN};
use ferry::AnyWindow;
use ferry::{Access, ConnId, Endpoint, EndpointMetadata, MemKind, MemoryRegion, Peer, Transfer};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::desc::{self, XferDesc};
use crate::{log, FerryError};

/// How long a blocking call waits between looks at Python's signals.
const SLICE: Duration = Duration::from_millis(50);
/// Registrations looked at, nearest address first, to find one holding a
/// raw pointer before registering it anew.
const CONTAINING_SCAN: usize = 64;

type R<T> = std::result::Result<T, String>;

fn err(e: ferry::Error) -> String {
    e.to_string()
}

/// A peer's window: a `RemoteBuf` (64 bytes: tcp, shm, verbs) or an
/// `IpcBuf` (136 bytes: CUDA IPC).
type Win = AnyWindow;

fn window(b: &[u8]) -> R<Win> {
    AnyWindow::decode(b).map_err(|e| e.to_string())
}

fn encode(w: &Win) -> Vec<u8> {
    w.encode()
}

#[derive(Default)]
struct State {
    regs: HashMap<u64, Arc<MemoryRegion>>,
    /// (address, mr_id) of every registration, for pointer lookups.
    by_addr: BTreeMap<(u64, u64), ()>,
    next_mr: u64,
    xfers: HashMap<u64, Transfer>,
    next_xfer: u64,
}

impl State {
    fn add(&mut self, mr: MemoryRegion) -> u64 {
        let id = self.next_mr;
        self.next_mr += 1;
        self.by_addr.insert((mr.addr(), id), ());
        self.regs.insert(id, Arc::new(mr));
        id
    }

    fn remove(&mut self, id: u64) -> Option<Arc<MemoryRegion>> {
        let mr = self.regs.remove(&id)?;
        self.by_addr.remove(&(mr.addr(), id));
        Some(mr)
    }

    /// A registration holding `[ptr, ptr + len)`, nearest start first.
    fn containing(&self, ptr: u64, len: u64) -> Option<(Arc<MemoryRegion>, usize)> {
        self.by_addr
            .range(..=(ptr, u64::MAX))
            .rev()
            .take(CONTAINING_SCAN)
            .find_map(|(&(addr, id), _)| {
                let mr = &self.regs[&id];
                let end = addr.checked_add(mr.len() as u64)?;
                (ptr.checked_add(len)? <= end).then(|| (mr.clone(), (ptr - addr) as usize))
            })
    }
}

/// The seed's `Endpoint` (see the module docs of `ferry._native`).
#[pyclass(module = "ferry._native", name = "Endpoint", frozen, subclass)]
pub struct P2pEndpoint {
    ep: Mutex<Option<Arc<Endpoint>>>,
    strict: bool,
    state: Mutex<State>,
    published: Mutex<Option<crate::registry::Published>>,
}

/// Waits for `t`, the GIL released, running Python's signal handlers every
/// `SLICE`; an exception from them (KeyboardInterrupt) ends the wait (the
/// operation itself runs on to its end).
fn wait(py: Python<'_>, t: &mut Transfer, timeout: Option<Duration>) -> PyResult<R<()>> {
    let deadline = timeout.map(|d| Instant::now() + d);
    loop {
        let r = py.allow_threads(|| t.wait_timeout(SLICE));
        match r {
            Err(ferry::Error::Timeout {
                what: "transfer", ..
            }) => {
                py.check_signals()?;
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(Err(format!(
                        "transfer not done after {} ms",
                        timeout.unwrap_or_default().as_millis()
                    )));
                }
            }
            other => return Ok(other.map_err(err)),
        }
    }
}

fn len_mismatch(what: &str) -> PyErr {
    FerryError::new_err(format!(
        "{what}: all input vectors/lists must have length num_iovs"
    ))
}

impl P2pEndpoint {
    fn ep(&self) -> R<Arc<Endpoint>> {
        self.ep
            .lock()
            .expect("lock")
            .clone()
            .ok_or_else(|| "the endpoint is closed".to_owned())
    }

    /// `ok=False` (logged) or, when strict, `FerryError`.
    fn fail<T>(&self, py: Python<'_>, what: &str, e: String, default: T) -> PyResult<T> {
        let msg = format!("{what}: {e}");
        if self.strict {
            return Err(FerryError::new_err(msg));
        }
        log(py, "warning", &msg);
        Ok(default)
    }

    fn out<T: Default>(&self, py: Python<'_>, what: &str, r: R<T>) -> PyResult<(bool, T)> {
        match r {
            Ok(v) => Ok((true, v)),
            Err(e) => self.fail(py, what, e, (false, T::default())),
        }
    }

    fn done(&self, py: Python<'_>, what: &str, r: R<()>) -> PyResult<bool> {
        match r {
            Ok(()) => Ok(true),
            Err(e) => self.fail(py, what, e, false),
        }
    }

    fn mr(&self, mr_id: u64) -> R<Arc<MemoryRegion>> {
        let st = self.state.lock().expect("lock");
        st.regs
            .get(&mr_id)
            .cloned()
            .ok_or_else(|| format!("unknown mr_id {mr_id}"))
    }

    /// `ptr` inside registration `mr_id`: the region and the offset.
    fn local(&self, mr_id: u64, ptr: u64, size: usize) -> R<(Arc<MemoryRegion>, usize)> {
        let mr = self.mr(mr_id)?;
        let off = ptr.wrapping_sub(mr.addr());
        if ptr < mr.addr() || off.saturating_add(size as u64) > mr.len() as u64 {
            return Err(format!(
                "[{ptr:#x}, +{size}) is not inside mr_id {mr_id} ([{:#x}, +{}))",
                mr.addr(),
                mr.len()
            ));
        }
        Ok((mr, off as usize))
    }

    /// A registration holding `[ptr, ptr + size)`: an existing one, else
    /// (the seed's `*_ipc` calls take bare pointers) the containing GPU
    /// allocation, or the exact host range, registered now.
    fn by_ptr(&self, ep: &Endpoint, ptr: u64, size: usize) -> R<(Arc<MemoryRegion>, usize)> {
        if let Some(hit) = self
            .state
            .lock()
            .expect("lock")
            .containing(ptr, size as u64)
        {
            return Ok(hit);
        }
        let (base, len) = match ferry::gpu::memory::classify(ptr).map_err(err)? {
            MemKind::Device {
                alloc_base,
                alloc_len,
                ..
            } => (alloc_base, alloc_len),
            _ => (ptr, size),
        };
        // SAFETY: the caller's promise (module docs): the memory stays
        // valid until deregistered; for GPU memory the driver says the
        // allocation is [base, base + len).
        let mr = unsafe { ep.register_raw(base as *mut u8, len, Access::all()) }.map_err(err)?;
        self.note_gpu(ep);
        let mut st = self.state.lock().expect("lock");
        st.add(mr);
        Ok(st.containing(ptr, size as u64).expect("just registered"))
    }

    /// Publishes which GPU this endpoint serves once it has one, so that a
    /// same-host peer's `connect_local(bus id)` finds it.
    fn note_gpu(&self, ep: &Endpoint) {
        let mut p = self.published.lock().expect("lock");
        if p.is_some() {
            return;
        }
        let Some(g) = ep.gpu() else { return };
        let Ok(bus) = ferry::gpu::cuda().and_then(|c| c.device(g).map(|d| d.bus_id.clone())) else {
            return;
        };
        *p = crate::registry::publish(&bus, ep.id()).ok();
    }

    fn submit(
        &self,
        ep: &Endpoint,
        conn: u64,
        write: bool,
        locals: &[(Arc<MemoryRegion>, usize, usize)],
        wins: &[Win],
    ) -> R<Transfer> {
        let conn = ConnId(conn);
        let l: Vec<(&MemoryRegion, usize, usize)> =
            locals.iter().map(|(m, o, n)| (&**m, *o, *n)).collect();
        if write {
            ep.writev_async(conn, &l, wins)
        } else {
            ep.readv_async(conn, &l, wins)
        }
        .map_err(err)
    }

    fn keep(&self, t: Transfer) -> u64 {
        let mut st = self.state.lock().expect("lock");
        let id = st.next_xfer;
        st.next_xfer += 1;
        st.xfers.insert(id, t);
        id
    }

    /// Submits and either waits (`blocking`) or files the transfer:
    /// `(ok, transfer_id)`; blocking calls return `(ok, 0)`.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        what: &str,
        conn: u64,
        write: bool,
        locals: R<Vec<(Arc<MemoryRegion>, usize, usize)>>,
        wins: R<Vec<Win>>,
        blocking: bool,
    ) -> PyResult<(bool, u64)> {
        let r = (|| {
            let ep = self.ep()?;
            // The seed refuses an unknown connection before posting (the
            // core would fail the op later, after an ok).
            if ep.peer(ConnId(conn)).is_none() {
                return Err(err(ferry::Error::UnknownConn { conn: ConnId(conn) }));
            }
            let (l, w) = (locals?, wins?);
            py.allow_threads(|| self.submit(&ep, conn, write, &l, &w))
        })();
        let mut t = match r {
            Ok(t) => t,
            Err(e) => return self.fail(py, what, e, (false, 0)),
        };
        if !blocking {
            return Ok((true, self.keep(t)));
        }
        let r = wait(py, &mut t, None)?;
        Ok((self.done(py, what, r)?, 0))
    }

    fn meta_windows(what: &str, metas: &Bound<'_, PyList>, n: usize) -> PyResult<R<Vec<Win>>> {
        if metas.len() != n {
            return Err(len_mismatch(what));
        }
        let mut out = Vec::with_capacity(n);
        for m in metas.iter() {
            let b = m
                .downcast::<PyBytes>()
                .map_err(|_| FerryError::new_err(format!("{what}: each window must be bytes")))?;
            match window(b.as_bytes()) {
                Ok(w) => out.push(w),
                Err(e) => return Ok(Err(e)),
            }
        }
        Ok(Ok(out))
    }

    /// The seed's `(conn, [mr_id], [ptr], [size], [meta], n)` operations.
    #[allow(clippy::too_many_arguments)]
    fn vector(
        &self,
        py: Python<'_>,
        what: &str,
        write: bool,
        conn_id: u64,
        mr_id_v: Vec<u64>,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
        meta_blob_v: &Bound<'_, PyList>,
        num_iovs: usize,
        blocking: bool,
    ) -> PyResult<(bool, u64)> {
        if mr_id_v.len() != num_iovs || ptr_v.len() != num_iovs || size_v.len() != num_iovs {
            return Err(len_mismatch(what));
        }
        let wins = Self::meta_windows(what, meta_blob_v, num_iovs)?;
        let locals = (0..num_iovs)
            .map(|i| {
                self.local(mr_id_v[i], ptr_v[i], size_v[i])
                    .map(|(m, o)| (m, o, size_v[i]))
            })
            .collect();
        self.run(py, what, conn_id, write, locals, wins, blocking)
    }

    fn single(
        &self,
        py: Python<'_>,
        what: &str,
        write: bool,
        (conn_id, mr_id, ptr, size): (u64, u64, u64, usize),
        meta: &[u8],
        blocking: bool,
    ) -> PyResult<(bool, u64)> {
        if meta.len() != REMOTE_BUF_LEN {
            return Err(FerryError::new_err(format!(
                "{what}: meta must be exactly {REMOTE_BUF_LEN} bytes (the peer's advertise), not {}",
                meta.len()
            )));
        }
        let locals = self
            .local(mr_id, ptr, size)
            .map(|(m, o)| vec![(m, o, size)]);
        let wins = window(meta).map(|w| vec![w]);
        self.run(py, what, conn_id, write, locals, wins, blocking)
    }

    /// The `*_ipc` operations: bare pointers, windows from `advertise_ipc`.
    #[allow(clippy::too_many_arguments)]
    fn ipc(
        &self,
        py: Python<'_>,
        what: &str,
        write: bool,
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
        infos: Vec<R<Win>>,
        blocking: bool,
    ) -> PyResult<(bool, u64)> {
        if size_v.len() != ptr_v.len() || infos.len() != ptr_v.len() {
            return Err(FerryError::new_err(format!(
                "{what}: ptr_v, size_v and info_v must have the same length"
            )));
        }
        let locals = self.ep().and_then(|ep| {
            ptr_v
                .iter()
                .zip(&size_v)
                .map(|(&p, &n)| self.by_ptr(&ep, p, n).map(|(m, o)| (m, o, n)))
                .collect()
        });
        let wins = infos.into_iter().collect();
        self.run(py, what, conn_id, write, locals, wins, blocking)
    }

    /// The window of `[off, off + size)` of `mr` for the peer on `conn`:
    /// an `IpcBuf` for GPU memory, else a `RemoteBuf` (host memory moves
    /// over shm or tcp with the same `*_ipc` calls).
    fn ipc_window(ep: &Endpoint, conn: u64, mr: &MemoryRegion, off: usize, size: usize) -> R<Win> {
        if ep.mem_kind(mr).is_device() {
            ep.advertise_ipc(ConnId(conn), mr, off, size)
                .map(AnyWindow::Ipc)
                .map_err(err)
        } else {
            ep.advertise(ConnId(conn), mr, off, size)
                .map(AnyWindow::Key)
                .map_err(err)
        }
    }

    fn advertise_ipc_all(&self, conn: u64, ptrs: &[u64], sizes: &[usize]) -> R<Vec<Vec<u8>>> {
        if ptrs.len() != sizes.len() {
            return Err(format!("{} pointers but {} sizes", ptrs.len(), sizes.len()));
        }
        let ep = self.ep()?;
        ptrs.iter()
            .zip(sizes)
            .map(|(&p, &n)| {
                let (mr, off) = self.by_ptr(&ep, p, n)?;
                Self::ipc_window(&ep, conn, &mr, off, n).map(|w| encode(&w))
            })
            .collect()
    }

    fn advertise_one(&self, conn: Option<u64>, mr_id: u64, ptr: u64, size: usize) -> R<Vec<u8>> {
        let ep = self.ep()?;
        let (mr, off) = self.local(mr_id, ptr, size)?;
        let rb = match conn {
            Some(c) => ep.advertise(ConnId(c), &mr, off, size),
            None => mr.advertise(off, size),
        };
        rb.map(|r| r.encode().to_vec()).map_err(err)
    }

    /// Loops `step` (a call that gives up after `SLICE`) until it returns
    /// something other than a timeout, `deadline` passes, or a signal
    /// handler raises.
    fn blocking<T>(
        py: Python<'_>,
        deadline: Option<Instant>,
        mut step: impl FnMut() -> ferry::Result<T> + Send,
    ) -> PyResult<R<T>>
    where
        T: Send,
    {
        loop {
            match py.allow_threads(&mut step) {
                Err(e @ (ferry::Error::AcceptTimeout { .. } | ferry::Error::Timeout { .. })) => {
                    py.check_signals()?;
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Ok(Err(err(e)));
                    }
                }
                other => return Ok(other.map_err(err)),
            }
        }
    }

    fn register_one(&self, ep: &Endpoint, ptr: u64, size: usize) -> R<u64> {
        self.register_with(ep, ptr, size, Access::all())
    }

    fn register_with(&self, ep: &Endpoint, ptr: u64, size: usize, access: Access) -> R<u64> {
        // SAFETY: the caller's promise (module docs), as with the seed's reg.
        let mr = unsafe { ep.register_raw(ptr as *mut u8, size, access) }.map_err(err)?;
        self.note_gpu(ep);
        Ok(self.state.lock().expect("lock").add(mr))
    }
}

/// (address, bytes) of a tensor as the seed reads it (`data_ptr()`,
/// `numel()`, `element_size()`), or of an object with the array interface
/// (numpy).
fn tensor_info(o: &Bound<'_, PyAny>) -> PyResult<(u64, usize)> {
    if o.hasattr("data_ptr")? {
        let ptr: u64 = o.call_method0("data_ptr")?.extract()?;
        let n: usize = o.call_method0("numel")?.extract()?;
        let es: usize = o.call_method0("element_size")?.extract()?;
        return Ok((ptr, n * es));
    }
    if let Ok(ai) = o.getattr("__array_interface__") {
        let (ptr, _ro): (u64, bool) = ai.get_item("data")?.extract()?;
        let n: usize = o.getattr("nbytes")?.extract()?;
        return Ok((ptr, n));
    }
    Err(FerryError::new_err(format!(
        "{} is not a tensor (no data_ptr()) nor an array (no __array_interface__)",
        o.get_type().name()?
    )))
}

#[pymethods]
impl P2pEndpoint {
    /// `Endpoint(local_gpu_idx=None, *ignored, strict=False)`. With a GPU
    /// index the endpoint serves that GPU; without one it is lazy (the
    /// first GPU pointer registered picks it). Extra positional arguments
    /// (the seed's `num_cpus`) are accepted and ignored. Settings come from
    /// `FERRY_*` variables (and the seed's `UCCL_P2P_*` where one matches).
    #[new]
    #[pyo3(signature = (local_gpu_idx=None, *_ignored, strict=false))]
    fn py_new(
        py: Python<'_>,
        local_gpu_idx: Option<usize>,
        _ignored: &Bound<'_, PyTuple>,
        strict: bool,
    ) -> PyResult<Self> {
        let cfg = crate::env::config(py).map_err(|e| FerryError::new_err(e.to_string()))?;
        let ep = py
            .allow_threads(|| {
                let mut b = Endpoint::builder().config(cfg);
                if let Some(g) = local_gpu_idx {
                    b = b.gpu(g);
                }
                b.build()
            })
            .map_err(|e| FerryError::new_err(format!("Endpoint: {e}")))?;
        let me = P2pEndpoint {
            ep: Mutex::new(Some(Arc::new(ep))),
            strict,
            state: Mutex::new(State::default()),
            published: Mutex::new(None),
        };
        if let Ok(ep) = me.ep() {
            me.note_gpu(&ep);
        }
        Ok(me)
    }

    fn __repr__(&self) -> String {
        match self.ep() {
            Ok(ep) => format!(
                "<ferry P2P Endpoint {:016x} at {} gpu={:?} conns={} regs={}>",
                ep.id(),
                ep.metadata().socket_addr(),
                ep.gpu(),
                ep.conn_count(),
                ep.registration_count()
            ),
            Err(_) => "<ferry P2P Endpoint (closed)>".to_owned(),
        }
    }

    /// Closes the endpoint: drops every registration and unfinished
    /// transfer id and shuts the engine down (once no call is using it).
    fn close(&self, py: Python<'_>) {
        let ep = self.ep.lock().expect("lock").take();
        let st = std::mem::take(&mut *self.state.lock().expect("lock"));
        self.published.lock().expect("lock").take();
        py.allow_threads(move || {
            if let Some(ep) = &ep {
                ep.stop_accept();
            }
            drop(st);
            drop(ep);
        });
    }

    /// This endpoint's id (ferry's; what `accept_local` reports of a peer).
    #[getter]
    fn endpoint_id(&self) -> PyResult<u64> {
        self.ep().map(|e| e.id()).map_err(FerryError::new_err)
    }

    /// The GPU index this endpoint serves, or None (lazy, none yet).
    #[getter]
    fn gpu(&self) -> PyResult<Option<usize>> {
        self.ep().map(|e| e.gpu()).map_err(FerryError::new_err)
    }

    // ---- connections ---------------------------------------------------

    /// The seed's metadata bytes: address, port and GPU bus id.
    fn get_metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let ep = self.ep().map_err(FerryError::new_err)?;
        Ok(PyBytes::new(py, &ep.metadata_bytes()))
    }

    /// `(ip, port, gpu_bdf)` of metadata bytes.
    #[staticmethod]
    fn parse_metadata(metadata: &[u8]) -> PyResult<(String, u16, String)> {
        let m = EndpointMetadata::decode(metadata)
            .map_err(|e| FerryError::new_err(format!("parse_metadata: {e}")))?;
        let a = m.socket_addr();
        Ok((a.ip().to_string(), a.port(), m.gpu_bdf.clone()))
    }

    #[staticmethod]
    fn get_oob_ip() -> String {
        crate::get_oob_ip()
    }

    /// `connect(remote_ip_addr, remote_gpu_bdf_or_idx, remote_port=-1) ->
    /// (ok, conn_id)`. ferry listens on the port in the metadata; a
    /// negative port means this endpoint's own `FERRY_LISTEN_PORT`.
    #[pyo3(signature = (remote_ip_addr, remote_gpu_bdf=None, remote_port=-1))]
    fn connect(
        &self,
        py: Python<'_>,
        remote_ip_addr: &str,
        remote_gpu_bdf: Option<&Bound<'_, PyAny>>,
        remote_port: i64,
    ) -> PyResult<(bool, u64)> {
        let _ = remote_gpu_bdf; // the peer's GPU is its own business
        let r = (|| {
            let ep = self.ep()?;
            let ip: IpAddr = remote_ip_addr
                .trim()
                .parse()
                .map_err(|_| format!("{remote_ip_addr:?} is not an IP address"))?;
            let port = match u16::try_from(remote_port) {
                Ok(p) if p > 0 => p,
                _ if remote_port < 0 && ep.config().listen_port != 0 => ep.config().listen_port,
                _ => {
                    return Err(format!(
                        "port {remote_port}: pass the port from parse_metadata (this endpoint \
                         has no FERRY_LISTEN_PORT to assume)"
                    ))
                }
            };
            py.allow_threads(|| ep.connect(SocketAddr::new(ip, port)).map_err(err))
        })();
        self.out(py, "connect", r.map(|c| c.0))
    }

    /// `accept() -> (ok, ip, gpu_idx, conn_id)`: waits for one connection
    /// (Ctrl-C interrupts). A same-host peer reports ip "127.0.0.1"; the
    /// peer's GPU index is not sent, so it is -1.
    fn accept(&self, py: Python<'_>) -> PyResult<(bool, String, i64, u64)> {
        let r = self
            .ep()
            .map(|ep| Self::blocking(py, None, || ep.accept(SLICE)));
        let r = match r {
            Ok(x) => x?,
            Err(e) => Err(e),
        };
        match r {
            Ok((c, Peer::Net(a))) => Ok((true, a.ip().to_string(), -1, c.0)),
            Ok((c, Peer::Local { .. })) => Ok((true, "127.0.0.1".into(), -1, c.0)),
            Err(e) => self.fail(py, "accept", e, (false, String::new(), -1, 0)),
        }
    }

    /// Accepts connections in a background thread from now on.
    fn start_passive_accept(&self, py: Python<'_>) -> PyResult<bool> {
        let r = self
            .ep()
            .and_then(|ep| ep.start_passive_accept().map_err(err));
        self.done(py, "start_passive_accept", r)
    }

    /// `add_remote_endpoint(metadata) -> (ok, conn_id)`: connects once per
    /// remote endpoint (a same-host one over shared memory).
    fn add_remote_endpoint(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<(bool, u64)> {
        let r = self
            .ep()
            .and_then(|ep| py.allow_threads(|| ep.add_remote(metadata).map_err(err)));
        self.out(py, "add_remote_endpoint", r.map(|c| c.0))
    }

    fn remove_remote_endpoint(&self, py: Python<'_>, conn_id: u64) -> PyResult<bool> {
        let r = self
            .ep()
            .and_then(|ep| py.allow_threads(|| ep.remove_remote(ConnId(conn_id)).map_err(err)));
        self.done(py, "remove_remote_endpoint", r)
    }

    /// `connect_local(remote) -> (ok, conn_id)` over shared memory, to the
    /// same-host endpoint that serves GPU `remote` (a bus id as in the
    /// metadata, or a GPU index), or whose metadata bytes `remote` is.
    fn connect_local(&self, py: Python<'_>, remote: &Bound<'_, PyAny>) -> PyResult<(bool, u64)> {
        let target: R<Result<u64, Vec<u8>>> = if let Ok(b) = remote.downcast::<PyBytes>() {
            Ok(Err(b.as_bytes().to_vec()))
        } else if let Ok(i) = remote.extract::<usize>() {
            ferry::gpu::cuda()
                .and_then(|c| c.device(i).map(|d| d.bus_id.clone()))
                .map_err(|e| format!("GPU {i}: {e}"))
                .and_then(|bus| crate::registry::find(&bus))
                .map(Ok)
        } else if let Ok(s) = remote.extract::<String>() {
            crate::registry::find(&ferry::wire::normalize_bus_id(&s)).map(Ok)
        } else {
            Err("remote must be a GPU bus id (str), a GPU index (int) or metadata (bytes)".into())
        };
        let r = self.ep().and_then(|ep| {
            let target = target?;
            py.allow_threads(|| match target {
                Ok(id) if id == ep.id() => Err(
                    "that GPU is served by this endpoint itself (one endpoint per GPU and host)"
                        .into(),
                ),
                Ok(id) => ep.connect_local(id).map_err(err),
                Err(meta) => ep.add_remote(&meta).map_err(err),
            })
        });
        self.out(py, "connect_local", r.map(|c| c.0))
    }

    /// `accept_local() -> (ok, remote_gpu_bdf, conn_id)`: waits for one
    /// same-host connection; the bus id is the peer's GPU if it published
    /// one, else "".
    fn accept_local(&self, py: Python<'_>) -> PyResult<(bool, String, u64)> {
        let r = self
            .ep()
            .map(|ep| Self::blocking(py, None, || ep.accept_local(SLICE)));
        let r = match r {
            Ok(x) => x?,
            Err(e) => Err(e),
        };
        match r {
            Ok((c, peer_id, _pid)) => Ok((
                true,
                crate::registry::bus_id_of(peer_id).unwrap_or_default(),
                c.0,
            )),
            Err(e) => self.fail(py, "accept_local", e, (false, String::new(), 0)),
        }
    }

    /// ferry's: who is at the other end of `conn_id`: `("tcp", "ip:port")`
    /// or `("shm", "<endpoint id>")`; `None` for an unknown or closed one.
    fn peer(&self, conn_id: u64) -> Option<(&'static str, String)> {
        match self.ep().ok()?.peer(ConnId(conn_id))? {
            Peer::Net(a) => Some(("tcp", a.to_string())),
            Peer::Local { endpoint_id, .. } => Some(("shm", format!("{endpoint_id:016x}"))),
        }
    }

    /// The seed keeps a rank → connection map that nothing fills;
    /// `UINT64_MAX` means unknown, as there.
    fn conn_id_of_rank(&self, _rank: i64) -> u64 {
        u64::MAX
    }

    // ---- memory ---------------------------------------------------------

    /// `reg(ptr, size, floatType=kUndefined) -> (ok, mr_id)`. The memory
    /// (host or GPU) must stay valid until `dereg(mr_id)` returns.
    /// ferry's `readonly=True` lets peers only READ it, and it is never the
    /// destination of this side's READs (for memory Python considers
    /// immutable, such as `bytes`).
    #[pyo3(signature = (ptr, size, floatType=None, *, readonly=false))]
    #[allow(non_snake_case)]
    fn reg(
        &self,
        py: Python<'_>,
        ptr: u64,
        size: usize,
        floatType: Option<&Bound<'_, PyAny>>,
        readonly: bool,
    ) -> PyResult<(bool, u64)> {
        let _ = floatType; // ferry does not compress
        let access = if readonly {
            Access::REMOTE_READ
        } else {
            Access::all()
        };
        let r = self
            .ep()
            .and_then(|ep| py.allow_threads(|| self.register_with(&ep, ptr, size, access)));
        self.out(py, "reg", r)
    }

    /// ferry's: `alloc_host(size) -> (ok, mr_id, ptr)`: `size` zeroed bytes
    /// of host memory the engine owns, registered; a memfd shared with
    /// same-host peers, so their transfers into or out of it are one
    /// memcpy. Freed by `dereg(mr_id)` (or `close`): the pointer dies then.
    fn alloc_host(&self, py: Python<'_>, size: usize) -> PyResult<(bool, u64, u64)> {
        let r = self.ep().and_then(|ep| {
            py.allow_threads(|| {
                let mr = ep.alloc_host(size).map_err(err)?;
                let ptr = mr.addr();
                Ok((self.state.lock().expect("lock").add(mr), ptr))
            })
        });
        let (ok, (id, ptr)) = self.out(py, "alloc_host", r)?;
        Ok((ok, id, ptr))
    }

    /// `regv(ptrs, sizes) -> (ok, [mr_id])`; all or none are registered.
    fn regv(
        &self,
        py: Python<'_>,
        ptrs: Vec<u64>,
        sizes: Vec<usize>,
    ) -> PyResult<(bool, Vec<u64>)> {
        if ptrs.len() != sizes.len() {
            return Err(FerryError::new_err("regv: ptrs and sizes must match"));
        }
        let r = self.ep().and_then(|ep| {
            py.allow_threads(|| {
                let mut ids = Vec::with_capacity(ptrs.len());
                for (&p, &n) in ptrs.iter().zip(&sizes) {
                    match self.register_one(&ep, p, n) {
                        Ok(id) => ids.push(id),
                        Err(e) => {
                            let mut st = self.state.lock().expect("lock");
                            ids.iter().for_each(|id| drop(st.remove(*id)));
                            return Err(e);
                        }
                    }
                }
                Ok(ids)
            })
        });
        self.out(py, "regv", r)
    }

    /// Deregisters `mr_id`, waiting until no transfer uses it (then the
    /// memory may be freed).
    fn dereg(&self, py: Python<'_>, mr_id: u64) -> PyResult<bool> {
        let mr = self.state.lock().expect("lock").remove(mr_id);
        let r = match mr {
            None => Err(format!("unknown mr_id {mr_id}")),
            Some(mut mr) => py.allow_threads(|| {
                // A call submitting an operation may hold it a moment; the
                // memory may be freed once this returns, so wait for it.
                let deadline = Instant::now() + Duration::from_secs(10);
                loop {
                    match Arc::try_unwrap(mr) {
                        Ok(mr) => {
                            return match self.ep() {
                                Ok(ep) => ep.deregister(mr).map_err(err),
                                Err(_) => Ok(()),
                            }
                        }
                        Err(_) if Instant::now() >= deadline => {
                            return Err(format!(
                                "mr_id {mr_id} is still held by a call after 10 s; \
                                 it is deregistered when that call ends"
                            ))
                        }
                        Err(still) => {
                            mr = still;
                            std::thread::sleep(Duration::from_micros(200));
                        }
                    }
                }
            }),
        };
        self.done(py, "dereg", r)
    }

    /// `advertise(conn_id, mr_id, ptr, size)` (the seed's 0.1 wheel: a key
    /// for that connection only) or `advertise(mr_id, ptr, size)` (its
    /// repository: a key any connected peer may use) -> `(ok, 64 bytes)`.
    #[pyo3(signature = (*args))]
    fn advertise<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
    ) -> PyResult<(bool, Bound<'py, PyBytes>)> {
        let r = match args.len() {
            4 => {
                let (c, m, p, n): (u64, u64, u64, usize) = args.extract()?;
                self.advertise_one(Some(c), m, p, n)
            }
            3 => {
                let (m, p, n): (u64, u64, usize) = args.extract()?;
                self.advertise_one(None, m, p, n)
            }
            n => {
                return Err(FerryError::new_err(format!(
                    "advertise takes (conn_id, mr_id, ptr, size) or (mr_id, ptr, size), not {n} arguments"
                )))
            }
        };
        let (ok, b) = self.out(py, "advertise", r)?;
        Ok((ok, PyBytes::new(py, &b)))
    }

    /// `advertisev(conn_id, mr_id_v, ptr_v, size_v, num_iovs)` or
    /// `advertisev(mr_id_v, ptr_v, size_v, num_iovs)` -> `(ok, [bytes])`.
    #[pyo3(signature = (*args))]
    fn advertisev<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
    ) -> PyResult<(bool, Vec<Bound<'py, PyBytes>>)> {
        let (conn, m, p, s, n): (Option<u64>, Vec<u64>, Vec<u64>, Vec<usize>, usize) =
            match args.len() {
                5 => {
                    let (c, m, p, s, n) = args.extract()?;
                    (Some(c), m, p, s, n)
                }
                4 => {
                    let (m, p, s, n) = args.extract()?;
                    (None, m, p, s, n)
                }
                k => {
                    return Err(FerryError::new_err(format!(
                "advertisev takes ([conn_id,] mr_id_v, ptr_v, size_v, num_iovs), not {k} arguments"
            )))
                }
            };
        if m.len() != n || p.len() != n || s.len() != n {
            return Err(len_mismatch("advertisev"));
        }
        let r: R<Vec<Vec<u8>>> = (0..n)
            .map(|i| self.advertise_one(conn, m[i], p[i], s[i]))
            .collect();
        let (ok, v) = self.out(py, "advertisev", r)?;
        let v = if ok {
            v
        } else {
            vec![vec![0u8; REMOTE_BUF_LEN]; n]
        };
        Ok((ok, v.iter().map(|b| PyBytes::new(py, b)).collect()))
    }

    // ---- one-sided operations with registrations ---------------------------

    fn write(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: usize,
        meta: &[u8],
    ) -> PyResult<bool> {
        let a = (conn_id, mr_id, ptr, size);
        Ok(self.single(py, "write", true, a, meta, true)?.0)
    }

    fn read(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: usize,
        meta: &[u8],
    ) -> PyResult<bool> {
        let a = (conn_id, mr_id, ptr, size);
        Ok(self.single(py, "read", false, a, meta, true)?.0)
    }

    fn write_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: usize,
        meta: &[u8],
    ) -> PyResult<(bool, u64)> {
        let a = (conn_id, mr_id, ptr, size);
        self.single(py, "write_async", true, a, meta, false)
    }

    fn read_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: usize,
        meta: &[u8],
    ) -> PyResult<(bool, u64)> {
        let a = (conn_id, mr_id, ptr, size);
        self.single(py, "read_async", false, a, meta, false)
    }

    #[allow(clippy::too_many_arguments)]
    fn writev(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id_v: Vec<u64>,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
        meta_blob_v: &Bound<'_, PyList>,
        num_iovs: usize,
    ) -> PyResult<bool> {
        Ok(self
            .vector(
                py,
                "writev",
                true,
                conn_id,
                mr_id_v,
                ptr_v,
                size_v,
                meta_blob_v,
                num_iovs,
                true,
            )?
            .0)
    }

    #[allow(clippy::too_many_arguments)]
    fn readv(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id_v: Vec<u64>,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
        meta_blob_v: &Bound<'_, PyList>,
        num_iovs: usize,
    ) -> PyResult<bool> {
        Ok(self
            .vector(
                py,
                "readv",
                false,
                conn_id,
                mr_id_v,
                ptr_v,
                size_v,
                meta_blob_v,
                num_iovs,
                true,
            )?
            .0)
    }

    #[allow(clippy::too_many_arguments)]
    fn writev_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id_v: Vec<u64>,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
        meta_blob_v: &Bound<'_, PyList>,
        num_iovs: usize,
    ) -> PyResult<(bool, u64)> {
        self.vector(
            py,
            "writev_async",
            true,
            conn_id,
            mr_id_v,
            ptr_v,
            size_v,
            meta_blob_v,
            num_iovs,
            false,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn readv_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id_v: Vec<u64>,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
        meta_blob_v: &Bound<'_, PyList>,
        num_iovs: usize,
    ) -> PyResult<(bool, u64)> {
        self.vector(
            py,
            "readv_async",
            false,
            conn_id,
            mr_id_v,
            ptr_v,
            size_v,
            meta_blob_v,
            num_iovs,
            false,
        )
    }

    // ---- the IPC family (bare pointers) -------------------------------------

    /// `advertise_ipc(conn_id, ptr, size) -> (ok, bytes)`: a CUDA IPC
    /// window (136 bytes) of GPU memory; of host memory, an ordinary
    /// window (64 bytes) that the same calls move over shm or tcp.
    fn advertise_ipc<'py>(
        &self,
        py: Python<'py>,
        conn_id: u64,
        ptr: u64,
        size: usize,
    ) -> PyResult<(bool, Bound<'py, PyBytes>)> {
        let r = self
            .advertise_ipc_all(conn_id, &[ptr], &[size])
            .map(|mut v| v.remove(0));
        let (ok, b) = self.out(py, "advertise_ipc", r)?;
        Ok((ok, PyBytes::new(py, &b)))
    }

    fn advertisev_ipc<'py>(
        &self,
        py: Python<'py>,
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
    ) -> PyResult<(bool, Vec<Bound<'py, PyBytes>>)> {
        let r = self.advertise_ipc_all(conn_id, &ptr_v, &size_v);
        let (ok, v) = self.out(py, "advertisev_ipc", r)?;
        Ok((ok, v.iter().map(|b| PyBytes::new(py, b)).collect()))
    }

    fn write_ipc(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr: u64,
        size: usize,
        info: &[u8],
    ) -> PyResult<bool> {
        Ok(self
            .ipc(
                py,
                "write_ipc",
                true,
                conn_id,
                vec![ptr],
                vec![size],
                vec![window(info)],
                true,
            )?
            .0)
    }

    fn read_ipc(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr: u64,
        size: usize,
        info: &[u8],
    ) -> PyResult<bool> {
        Ok(self
            .ipc(
                py,
                "read_ipc",
                false,
                conn_id,
                vec![ptr],
                vec![size],
                vec![window(info)],
                true,
            )?
            .0)
    }

    fn write_ipc_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr: u64,
        size: usize,
        info: &[u8],
    ) -> PyResult<(bool, u64)> {
        self.ipc(
            py,
            "write_ipc_async",
            true,
            conn_id,
            vec![ptr],
            vec![size],
            vec![window(info)],
            false,
        )
    }

    fn read_ipc_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr: u64,
        size: usize,
        info: &[u8],
    ) -> PyResult<(bool, u64)> {
        self.ipc(
            py,
            "read_ipc_async",
            false,
            conn_id,
            vec![ptr],
            vec![size],
            vec![window(info)],
            false,
        )
    }

    fn writev_ipc(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
        info_v: Vec<Vec<u8>>,
    ) -> PyResult<bool> {
        let w = info_v.iter().map(|b| window(b)).collect();
        Ok(self
            .ipc(py, "writev_ipc", true, conn_id, ptr_v, size_v, w, true)?
            .0)
    }

    fn readv_ipc(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
        info_v: Vec<Vec<u8>>,
    ) -> PyResult<bool> {
        let w = info_v.iter().map(|b| window(b)).collect();
        Ok(self
            .ipc(py, "readv_ipc", false, conn_id, ptr_v, size_v, w, true)?
            .0)
    }

    fn writev_ipc_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
        info_v: Vec<Vec<u8>>,
    ) -> PyResult<(bool, u64)> {
        let w = info_v.iter().map(|b| window(b)).collect();
        self.ipc(
            py,
            "writev_ipc_async",
            true,
            conn_id,
            ptr_v,
            size_v,
            w,
            false,
        )
    }

    fn readv_ipc_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
        info_v: Vec<Vec<u8>>,
    ) -> PyResult<(bool, u64)> {
        let w = info_v.iter().map(|b| window(b)).collect();
        self.ipc(
            py,
            "readv_ipc_async",
            false,
            conn_id,
            ptr_v,
            size_v,
            w,
            false,
        )
    }

    // ---- transfers by id ------------------------------------------------------

    /// `poll_async(transfer_id) -> (ok, done)`. A finished id is forgotten
    /// once reported; an unknown one gives `(False, False)`, a failed
    /// transfer `(False, True)`.
    fn poll_async(&self, py: Python<'_>, transfer_id: u64) -> PyResult<(bool, bool)> {
        let r = {
            let mut st = self.state.lock().expect("lock");
            match st.xfers.get_mut(&transfer_id) {
                None => None,
                Some(t) => match t.poll() {
                    None => return Ok((true, false)),
                    Some(r) => {
                        st.xfers.remove(&transfer_id);
                        Some(r)
                    }
                },
            }
        };
        match r {
            None => self.fail(
                py,
                "poll_async",
                format!("unknown or already reported transfer id {transfer_id}"),
                (false, false),
            ),
            Some(Ok(())) => Ok((true, true)),
            Some(Err(e)) => self.fail(py, "poll_async", err(e), (false, true)),
        }
    }

    /// ferry's: waits for a transfer id (GIL released, Ctrl-C interrupts)
    /// up to `timeout_s` (None: no limit); `True` when it succeeded. A
    /// transfer still running at the timeout keeps its id.
    #[pyo3(signature = (transfer_id, timeout_s=None))]
    fn wait(&self, py: Python<'_>, transfer_id: u64, timeout_s: Option<f64>) -> PyResult<bool> {
        let t = self.state.lock().expect("lock").xfers.remove(&transfer_id);
        let Some(mut t) = t else {
            let e = format!("unknown or already reported transfer id {transfer_id}");
            return self.fail(py, "wait", e, false);
        };
        let timeout = timeout_s.map(|s| Duration::from_secs_f64(s.max(0.0)));
        let r = match wait(py, &mut t, timeout) {
            Ok(r) => r,
            Err(interrupt) => {
                self.state
                    .lock()
                    .expect("lock")
                    .xfers
                    .insert(transfer_id, t);
                return Err(interrupt);
            }
        };
        if r.is_err() && !t.is_done() {
            self.state
                .lock()
                .expect("lock")
                .xfers
                .insert(transfer_id, t);
        }
        self.done(py, "wait", r)
    }

    // ---- tensors and descriptors ---------------------------------------------

    /// Registers each tensor (anything with `data_ptr()`, `numel()` and
    /// `element_size()`, or numpy's array interface) and returns its
    /// `XferDesc`; a tensor that cannot be registered gets `mr_id`
    /// `UINT64_MAX` (and the reason is logged).
    fn register_memory(
        &self,
        py: Python<'_>,
        tensor_list: &Bound<'_, PyList>,
    ) -> PyResult<Vec<XferDesc>> {
        let ep = self.ep().map_err(FerryError::new_err)?;
        let mut out = Vec::with_capacity(tensor_list.len());
        for t in tensor_list.iter() {
            let (ptr, size) = tensor_info(&t)?;
            let r = py.allow_threads(|| {
                let id = self.register_one(&ep, ptr, size)?;
                let mr = self.mr(id)?;
                let mut info = mr.advertise(0, size).map_err(err)?.encode().to_vec();
                if ep.mem_kind(&mr).is_device() {
                    info.extend_from_slice(&mr.advertise_ipc(0, size).map_err(err)?.encode());
                }
                Ok::<_, String>(XferDesc {
                    addr: ptr,
                    size: size as u64,
                    mr_id: id,
                    lkeys: vec![mr.rkey()],
                    rkeys: vec![mr.rkey()],
                    info,
                })
            });
            match r {
                Ok(d) => out.push(d),
                Err(e) => {
                    let d = XferDesc {
                        addr: ptr,
                        size: size as u64,
                        mr_id: u64::MAX,
                        ..Default::default()
                    };
                    out.push(self.fail(py, "register_memory", e, d)?);
                }
            }
        }
        Ok(out)
    }

    fn deregister_memory(
        &self,
        py: Python<'_>,
        desc_list: Vec<PyRef<'_, XferDesc>>,
    ) -> PyResult<()> {
        for d in desc_list.iter().filter(|d| d.mr_id != u64::MAX) {
            self.dereg(py, d.mr_id)?;
        }
        Ok(())
    }

    fn get_serialized_descs<'py>(
        &self,
        py: Python<'py>,
        desc_list: Vec<PyRef<'py, XferDesc>>,
    ) -> Bound<'py, PyBytes> {
        let v: Vec<XferDesc> = desc_list.iter().map(|d| (**d).clone()).collect();
        desc::to_bytes(py, &v)
    }

    fn deserialize_descs(&self, serialized_bytes: &[u8]) -> PyResult<Vec<XferDesc>> {
        desc::from_bytes(serialized_bytes)
    }

    /// `transfer(conn_id, "read"|"write", local_descs, remote_descs) ->
    /// (ok, transfer_id)`: one operation over the pairs; to a same-host
    /// peer, GPU windows go by CUDA IPC.
    fn transfer(
        &self,
        py: Python<'_>,
        conn_id: u64,
        op_name: &str,
        local_desc_list: Vec<PyRef<'_, XferDesc>>,
        remote_desc_list: Vec<PyRef<'_, XferDesc>>,
    ) -> PyResult<(bool, u64)> {
        let write = match op_name {
            "write" => true,
            "read" => false,
            _ => {
                return Err(FerryError::new_err(format!(
                    "transfer: invalid op_name {op_name:?} (read or write)"
                )))
            }
        };
        if local_desc_list.len() != remote_desc_list.len() {
            return Err(FerryError::new_err(
                "transfer: local and remote descriptors must have the same size",
            ));
        }
        let local_peer = self
            .ep()
            .map(|ep| matches!(ep.peer(ConnId(conn_id)), Some(Peer::Local { .. })))
            .unwrap_or(false);
        let locals = local_desc_list
            .iter()
            .map(|d| {
                self.local(d.mr_id, d.addr, d.size as usize)
                    .map(|(m, o)| (m, o, d.size as usize))
            })
            .collect();
        let wins = remote_desc_list
            .iter()
            .map(|d| {
                let i = &d.info;
                if local_peer && i.len() == REMOTE_BUF_LEN + IPC_BUF_LEN {
                    window(&i[REMOTE_BUF_LEN..])
                } else if i.len() >= REMOTE_BUF_LEN {
                    window(&i[..REMOTE_BUF_LEN])
                } else {
                    Err("remote descriptor carries no ferry window (was it made by ferry's register_memory?)".into())
                }
            })
            .collect();
        self.run(py, "transfer", conn_id, write, locals, wins, false)
    }

    // ---- notifications ---------------------------------------------------

    /// Sends a small message (at most 4096 bytes) to the peer's inbox.
    fn send_notification(&self, py: Python<'_>, conn_id: u64, msg: &[u8]) -> PyResult<bool> {
        let r = self.ep().and_then(|ep| {
            py.allow_threads(|| ep.send_notification(ConnId(conn_id), msg).map_err(err))
        });
        self.done(py, "send_notification", r)
    }

    /// `recv_notification(timeout_ms=-1) -> (ok, conn_id, bytes)`: the next
    /// message from any peer; a negative timeout waits without limit.
    #[pyo3(signature = (timeout_ms=-1))]
    fn recv_notification<'py>(
        &self,
        py: Python<'py>,
        timeout_ms: i64,
    ) -> PyResult<(bool, u64, Bound<'py, PyBytes>)> {
        let deadline = u64::try_from(timeout_ms)
            .ok()
            .map(|ms| Instant::now() + Duration::from_millis(ms));
        let r = match self.ep() {
            Ok(ep) => Self::blocking(py, deadline, || {
                let left = deadline.map_or(SLICE, |d| {
                    d.saturating_duration_since(Instant::now()).min(SLICE)
                });
                ep.recv_notification(left)
            })?,
            Err(e) => Err(e),
        };
        match r {
            Ok((c, m)) => Ok((true, c.0, PyBytes::new(py, &m))),
            Err(e) => {
                let (ok, c, _) = self.fail(py, "recv_notification", e, (false, 0u64, ()))?;
                Ok((ok, c, PyBytes::new(py, b"")))
            }
        }
    }
}

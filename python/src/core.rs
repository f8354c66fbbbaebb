//! The native classes, mirroring the core one to one: `Endpoint`,
//! `Region`, `Connection`, `Transfer`. Both Python faces are built on
//! them: the Pythonic `ferry.Endpoint` (`ferry/_api.py`) and the seed's
//! `ferry.p2p.Endpoint` (`ferry/p2p.py`: integer ids, `(ok, …)` tuples,
//! the sixteen op variants). Every check of a range, a window or a
//! connection is made here (in the core), once; errors raise `FerryError`.
//!
//! Raw pointers are the caller's promise, as in the seed: memory given to
//! `register` must stay valid until the region is closed.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry::{
    Access, AnyWindow, ConnId, EndpointMetadata, MemKind, MemoryRegion, Peer, SharedRegion,
};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;

use crate::FerryError;

/// How long a blocking call waits between looks at Python's signals.
const SLICE: Duration = Duration::from_millis(50);

/// The exception for a ferry error: its kind's subclass of `FerryError`.
fn fe(e: impl Into<ferry::Error>) -> PyErr {
    crate::error_to_py(e.into())
}

/// Loops `step` (a call that gives up after at most `SLICE`) with the GIL
/// released until it returns something other than a timeout, `deadline`
/// passes (the timeout is returned), or a signal handler raises.
fn blocking<T: Send>(
    py: Python<'_>,
    deadline: Option<Instant>,
    mut step: impl FnMut(Duration) -> ferry::Result<T> + Send,
) -> PyResult<ferry::Result<T>> {
    loop {
        let left = deadline.map_or(SLICE, |d| {
            d.saturating_duration_since(Instant::now()).min(SLICE)
        });
        match py.allow_threads(|| step(left)) {
            Err(e @ (ferry::Error::AcceptTimeout { .. } | ferry::Error::Timeout { .. })) => {
                py.check_signals()?;
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(Err(e));
                }
            }
            other => return Ok(other),
        }
    }
}

fn deadline_of(timeout_s: Option<f64>) -> Option<Instant> {
    timeout_s.map(|s| Instant::now() + Duration::from_secs_f64(s.max(0.0)))
}

fn peer_of(p: Peer) -> (&'static str, String) {
    match p {
        Peer::Net(a) => ("tcp", a.to_string()),
        Peer::Local { endpoint_id, .. } => ("shm", format!("{endpoint_id:016x}")),
    }
}

/// The endpoint, shared by the objects it hands out; `close` empties it,
/// and they all see "closed" from then on.
#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Option<Arc<ferry::Endpoint>>>>);

impl Shared {
    fn get(&self) -> PyResult<Arc<ferry::Endpoint>> {
        self.0
            .lock()
            .expect("lock")
            .clone()
            .ok_or_else(|| FerryError::new_err("the endpoint is closed"))
    }

    fn same(&self, other: &Shared) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// `ferry::Endpoint`.
#[pyclass(module = "ferry._native", name = "Endpoint", frozen)]
pub struct Endpoint {
    ep: Shared,
    /// Which GPU this endpoint serves, published for same-host peers'
    /// `connect_local(bus id)` once it has one.
    published: Mutex<Option<ferry::endpoint::gpu_registry::Published>>,
}

impl Endpoint {
    fn get(&self) -> PyResult<Arc<ferry::Endpoint>> {
        self.ep.get()
    }

    fn conn(&self, _ep: Arc<ferry::Endpoint>, id: ConnId) -> Connection {
        Connection {
            ep: self.ep.clone(),
            id,
        }
    }

    fn region(&self, ep: &Arc<ferry::Endpoint>, held: Held) -> Region {
        let gpu = ep.mem_kind(held.region()).is_device();
        let r = Region {
            ep: self.ep.clone(),
            sh: Mutex::new(Some(held)),
            gpu,
        };
        self.publish_gpu(ep);
        r
    }

    /// Publishes the GPU this endpoint serves, once it has one.
    fn publish_gpu(&self, ep: &ferry::Endpoint) {
        let mut p = self.published.lock().expect("lock");
        if p.is_some() {
            return;
        }
        let Some(g) = ep.gpu() else { return };
        let Ok(bus) = ferry::gpu::cuda().and_then(|c| c.device(g).map(|d| d.bus_id.clone())) else {
            return;
        };
        *p = ferry::endpoint::gpu_registry::publish(&bus, ep.id()).ok();
    }
}

#[pymethods]
impl Endpoint {
    /// An endpoint configured from `FERRY_*` variables (and the seed's
    /// `UCCL_P2P_*` where one matches), serving GPU `gpu` (None: the first
    /// GPU memory registered picks it).
    #[new]
    #[pyo3(signature = (gpu=None))]
    fn py_new(py: Python<'_>, gpu: Option<usize>) -> PyResult<Self> {
        let cfg = crate::env::config(py).map_err(fe)?;
        let ep = py
            .allow_threads(|| {
                let mut b = ferry::Endpoint::builder().config(cfg);
                if let Some(g) = gpu {
                    b = b.gpu(g);
                }
                b.build()
            })
            .map_err(|e| FerryError::new_err(format!("Endpoint: {e}")))?;
        let me = Endpoint {
            ep: Shared(Arc::new(Mutex::new(Some(Arc::new(ep))))),
            published: Mutex::new(None),
        };
        let ep = me.get()?;
        me.publish_gpu(&ep);
        Ok(me)
    }

    fn __repr__(&self) -> String {
        match self.get() {
            Ok(ep) => format!(
                "<ferry Endpoint {:016x} at {} gpu={:?} conns={} regs={}>",
                ep.id(),
                ep.metadata().socket_addr(),
                ep.gpu(),
                ep.conn_count(),
                ep.registration_count()
            ),
            Err(_) => "<ferry Endpoint (closed)>".to_owned(),
        }
    }

    /// Shuts the engine down once nothing uses it (regions and
    /// connections still held keep it until they go).
    fn close(&self, py: Python<'_>) {
        let ep = self.ep.0.lock().expect("lock").take();
        self.published.lock().expect("lock").take();
        py.allow_threads(move || {
            if let Some(ep) = &ep {
                ep.stop_accept();
            }
            drop(ep);
        });
    }

    #[getter]
    fn id(&self) -> PyResult<u64> {
        Ok(self.get()?.id())
    }

    /// The GPU index it serves, or None (lazy, none yet).
    #[getter]
    fn gpu(&self) -> PyResult<Option<usize>> {
        Ok(self.get()?.gpu())
    }

    /// The metadata bytes a peer connects with (address, port, GPU bus id).
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.get()?.metadata_bytes()))
    }

    /// The port `FERRY_LISTEN_PORT` fixed (0: none).
    #[getter]
    fn listen_port(&self) -> PyResult<u16> {
        Ok(self.get()?.config().listen_port)
    }

    /// `(ip, port, gpu_bdf)` of metadata bytes.
    #[staticmethod]
    fn parse_metadata(metadata: &[u8]) -> PyResult<(String, u16, String)> {
        let m = EndpointMetadata::decode(metadata)
            .map_err(|e| FerryError::new_err(format!("parse_metadata: {e}")))?;
        let a = m.socket_addr();
        Ok((a.ip().to_string(), a.port(), m.gpu_bdf.clone()))
    }

    /// Connects to the endpoint listening at `ip:port`.
    fn connect(&self, py: Python<'_>, ip: &str, port: u16) -> PyResult<Connection> {
        let ep = self.get()?;
        let ip: IpAddr = ip
            .trim()
            .parse()
            .map_err(|_| FerryError::new_err(format!("{ip:?} is not an IP address")))?;
        let id = py
            .allow_threads(|| ep.connect(SocketAddr::new(ip, port)))
            .map_err(fe)?;
        Ok(self.conn(ep, id))
    }

    /// Connects (once per remote endpoint) to the peer whose metadata this
    /// is; a same-host one over shared memory.
    fn add_remote(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<Connection> {
        let ep = self.get()?;
        let id = py.allow_threads(|| ep.add_remote(metadata)).map_err(fe)?;
        Ok(self.conn(ep, id))
    }

    /// Connects over shared memory to same-host endpoint `peer_id`.
    fn connect_local(&self, py: Python<'_>, peer_id: u64) -> PyResult<Connection> {
        let ep = self.get()?;
        if peer_id == ep.id() {
            return Err(FerryError::new_err(
                "that GPU is served by this endpoint itself (one endpoint per GPU and host)",
            ));
        }
        let id = py.allow_threads(|| ep.connect_local(peer_id)).map_err(fe)?;
        Ok(self.conn(ep, id))
    }

    /// Waits up to `timeout_s` (None: no limit; Ctrl-C interrupts) for
    /// one connection: `(connection, ("tcp", "ip:port") or ("shm", id))`.
    #[pyo3(signature = (timeout_s=None))]
    fn accept(
        &self,
        py: Python<'_>,
        timeout_s: Option<f64>,
    ) -> PyResult<(Connection, (&'static str, String))> {
        let ep = self.get()?;
        let (id, peer) = blocking(py, deadline_of(timeout_s), |d| ep.accept(d))?.map_err(fe)?;
        Ok((self.conn(ep, id), peer_of(peer)))
    }

    /// Waits for one same-host connection: `(connection, peer endpoint id)`.
    #[pyo3(signature = (timeout_s=None))]
    fn accept_local(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<(Connection, u64)> {
        let ep = self.get()?;
        let (id, peer, _pid) =
            blocking(py, deadline_of(timeout_s), |d| ep.accept_local(d))?.map_err(fe)?;
        Ok((self.conn(ep, id), peer))
    }

    /// Accepts connections in a background thread from now on.
    fn start_passive_accept(&self) -> PyResult<()> {
        self.get()?.start_passive_accept().map_err(fe)
    }

    /// The connection `conn_id` names, if this endpoint has it.
    fn connection(&self, conn_id: u64) -> PyResult<Connection> {
        let ep = self.get()?;
        ep.conn_status(ConnId(conn_id)).map_err(fe)?;
        Ok(self.conn(ep, ConnId(conn_id)))
    }

    /// One WRITE (`write`) or READ of `size` bytes at `ptr` in `region`
    /// against `window` (the peer's advertised bytes) on connection
    /// `conn_id`, waited for: `Connection.run` of one piece without a
    /// `Connection` object or lists (ferry.p2p's `write_ipc`/`read_ipc`).
    /// Raises `FerryError` if it failed; Ctrl-C interrupts the wait.
    #[allow(clippy::too_many_arguments)] // Python's positional call, one argument each
    fn run_one(
        &self,
        py: Python<'_>,
        conn_id: u64,
        write: bool,
        region: PyRef<'_, Region>,
        ptr: u64,
        size: usize,
        window: PyBackedBytes,
    ) -> PyResult<()> {
        let ep = self.get()?;
        let id = ConnId(conn_id);
        ep.conn_status(id).map_err(fe)?;
        region.owned_by(&self.ep)?;
        let v = region.view()?;
        let off = region.offset_of(&v, ptr, size)?;
        let win = AnyWindow::decode(&window).map_err(fe)?;
        run_op(py, &ep, id, write, &[(&*v.mr, off, size)], &[win])
    }

    /// Registers `[ptr, ptr + size)` (host or GPU memory), which must stay
    /// valid until the region is closed. `readonly`: peers may only READ
    /// it, and it is never the destination of this side's READs.
    #[pyo3(signature = (ptr, size, readonly=false))]
    fn register(&self, py: Python<'_>, ptr: u64, size: usize, readonly: bool) -> PyResult<Region> {
        let ep = self.get()?;
        let access = if readonly {
            Access::REMOTE_READ
        } else {
            Access::all()
        };
        // SAFETY: register_shared checks the range is mapped with `access`
        // (a Python caller cannot be asked to prove its pointer); that it
        // stays valid until the region closes is the caller's promise
        // (module docs), as with the seed's reg. Through the registration
        // cache: the same range or a part of a live registration shares it
        // (UCCL's semantics).
        let sh = py
            .allow_threads(|| unsafe { ep.register_shared(ptr as *mut u8, size, access) })
            .map_err(fe)?;
        Ok(self.region(&ep, Held::Shared(sh)))
    }

    /// The range the seed's `*_ipc` calls register for a bare pointer: the
    /// GPU allocation that holds it, or the exact host range.
    fn allocation_of(&self, ptr: u64, size: usize) -> PyResult<(u64, usize)> {
        Ok(match ferry::gpu::memory::classify(ptr).map_err(fe)? {
            MemKind::Device {
                alloc_base,
                alloc_len,
                ..
            } => (alloc_base, alloc_len),
            _ => (ptr, size),
        })
    }

    /// `size` zeroed bytes of host memory the engine owns, registered; a
    /// memfd shared with same-host peers (their transfers are one memcpy).
    fn alloc_host(&self, py: Python<'_>, size: usize) -> PyResult<Region> {
        let ep = self.get()?;
        let mr = py.allow_threads(|| ep.alloc_host(size)).map_err(fe)?;
        Ok(self.region(&ep, Held::Own(Arc::new(mr))))
    }

    /// The next notification from any peer, waiting up to `timeout_s`
    /// (None: no limit): `(conn_id, bytes)`; a timeout raises.
    #[pyo3(signature = (timeout_s=None))]
    fn recv_notification<'py>(
        &self,
        py: Python<'py>,
        timeout_s: Option<f64>,
    ) -> PyResult<(u64, Bound<'py, PyBytes>)> {
        let ep = self.get()?;
        let (c, m) =
            blocking(py, deadline_of(timeout_s), |d| ep.recv_notification(d))?.map_err(fe)?;
        Ok((c.0, PyBytes::new(py, &m)))
    }

    /// The endpoint's completion fd: readable when a transfer ends or a
    /// notification arrives (see `Endpoint::completion_fd`).
    fn completion_fd(&self) -> PyResult<i32> {
        self.get()?.completion_fd().map_err(fe)
    }

    /// Drains the completion fd; call before looking at what ended.
    fn ack_completions(&self) -> PyResult<()> {
        self.get()?.ack_completions();
        Ok(())
    }

    /// The endpoint's metrics in the Prometheus text format.
    fn metrics_text(&self) -> PyResult<String> {
        Ok(self.get()?.metrics_text())
    }

    /// The registration cache's `(hits, misses)` so far.
    fn reg_cache_stats(&self) -> PyResult<(u64, u64)> {
        let s = self.get()?.reg_cache_stats();
        Ok((s.hits, s.misses))
    }

    /// Who is at the other end of `conn_id`: `("tcp", "ip:port")` or
    /// `("shm", "<endpoint id>")`; None for an unknown or closed one.
    fn peer(&self, conn_id: u64) -> PyResult<Option<(&'static str, String)>> {
        Ok(self.get()?.peer(ConnId(conn_id)).map(peer_of))
    }

    /// Whether the far end of `conn_id` is the endpoint whose metadata
    /// (bytes you trust, e.g. loaded for a peer you know by name) this is:
    /// for a connection a peer dialed, that endpoint is asked whether it
    /// dialed it to us (one round trip; `Endpoint::vouch`). Raises when it
    /// cannot be asked: nothing is proven either way then.
    fn vouch(&self, py: Python<'_>, conn_id: u64, metadata: &[u8]) -> PyResult<bool> {
        let ep = self.get()?;
        let at = ferry::EndpointMetadata::decode(metadata)
            .map_err(|e| fe(ferry::Error::from(e)))?
            .socket_addr();
        py.allow_threads(|| ep.vouch(ConnId(conn_id), at))
            .map_err(fe)
    }
}

/// What a native `Region` holds: its own registration (engine memory), or
/// one holder's share of a cached one (raw pointers).
enum Held {
    Own(Arc<MemoryRegion>),
    Shared(SharedRegion),
}

impl Held {
    fn region(&self) -> &Arc<MemoryRegion> {
        match self {
            Held::Own(mr) => mr,
            Held::Shared(sh) => sh.region(),
        }
    }

    /// This holder's part: (address, length).
    fn span(&self) -> (u64, usize) {
        match self {
            Held::Own(mr) => (mr.addr(), mr.len()),
            Held::Shared(sh) => (sh.addr(), sh.len()),
        }
    }
}

/// `ferry::MemoryRegion` (or a part of one the registration cache shares):
/// registered memory.
#[pyclass(module = "ferry._native", name = "Region", frozen)]
pub struct Region {
    ep: Shared,
    sh: Mutex<Option<Held>>,
    gpu: bool,
}

/// A region's registration and its part, for one call.
struct View {
    mr: Arc<MemoryRegion>,
    addr: u64,
    len: usize,
}

impl Region {
    /// Refuses a region registered with another endpoint than `ep`.
    fn owned_by(&self, ep: &Shared) -> PyResult<()> {
        if self.ep.same(ep) {
            Ok(())
        } else {
            Err(FerryError::new_err(
                "a region of another endpoint than this connection's",
            ))
        }
    }

    /// The registration, while it and its endpoint are open.
    fn view(&self) -> PyResult<View> {
        self.ep.get()?;
        let g = self.sh.lock().expect("lock");
        let h = g
            .as_ref()
            .ok_or_else(|| FerryError::new_err("the region is closed"))?;
        let (addr, len) = h.span();
        Ok(View {
            mr: h.region().clone(),
            addr,
            len,
        })
    }

    /// A window on `[ptr, ptr + size)` for the peer on `conn` (any peer
    /// with None): a CUDA IPC one when `ipc`, else a key window.
    fn window<'py>(
        &self,
        py: Python<'py>,
        ptr: u64,
        size: usize,
        conn: Option<&Connection>,
        ipc: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let v = self.view()?;
        let off = self.offset_of(&v, ptr, size)?;
        let mr = &v.mr;
        let w: AnyWindow = match (ipc, conn) {
            (true, Some(c)) => self
                .ep
                .get()?
                .advertise_ipc(c.id, mr, off, size)
                .map(Into::into),
            (true, None) => mr.advertise_ipc(off, size).map(Into::into),
            (false, Some(c)) => self
                .ep
                .get()?
                .advertise(c.id, mr, off, size)
                .map(Into::into),
            (false, None) => mr.advertise(off, size).map(Into::into),
        }
        .map_err(fe)?;
        Ok(PyBytes::new(py, &w.encode()))
    }

    /// The offset in the registration of `[ptr, ptr + size)`, which must
    /// lie in this region's part: the one range check both faces rely on.
    fn offset_of(&self, v: &View, ptr: u64, size: usize) -> PyResult<usize> {
        let inside = ptr >= v.addr && (ptr - v.addr).saturating_add(size as u64) <= v.len as u64;
        if !inside {
            return Err(FerryError::new_err(format!(
                "[{ptr:#x}, +{size}) is outside the region [{:#x}, +{})",
                v.addr, v.len
            )));
        }
        Ok((ptr - v.mr.addr()) as usize)
    }
}

#[pymethods]
impl Region {
    #[getter]
    fn ptr(&self) -> PyResult<u64> {
        Ok(self.view()?.addr)
    }

    #[getter]
    fn nbytes(&self) -> PyResult<usize> {
        Ok(self.view()?.len)
    }

    #[getter]
    fn is_gpu(&self) -> bool {
        self.gpu
    }

    #[getter]
    fn rkey(&self) -> PyResult<u32> {
        Ok(self.view()?.mr.rkey())
    }

    #[getter]
    fn closed(&self) -> bool {
        self.sh.lock().expect("lock").is_none()
    }

    /// Says what the values are (bf16, fp16, fp32, fp8, fp8-e5m2, bytes, or
    /// torch's and numpy's names such as "torch.bfloat16"; None: nothing),
    /// so tcp transfers of it may be compressed (`FERRY_COMPRESS`): windows
    /// advertised from now on carry the type. Returns whether the name was
    /// a type the codec knows (an integer dtype is not: nothing is set).
    #[pyo3(signature = (dtype=None))]
    fn set_dtype(&self, dtype: Option<&str>) -> PyResult<bool> {
        let t = match dtype {
            None => None,
            Some(name) => {
                let bare = name.rsplit('.').next().unwrap_or(name);
                match ferry::codec::FloatType::parse(bare) {
                    Some(t) => Some(t),
                    None => return Ok(false),
                }
            }
        };
        self.view()?.mr.set_dtype(t);
        Ok(true)
    }

    /// Whether `[ptr, ptr + size)` lies inside it.
    fn contains(&self, ptr: u64, size: usize) -> bool {
        self.view()
            .is_ok_and(|v| self.offset_of(&v, ptr, size).is_ok())
    }

    /// A 64-byte window on `[ptr, ptr + size)`: for the peer on `conn`
    /// only (until the connection closes), or with None for any connected
    /// peer (until the region closes).
    #[pyo3(signature = (ptr, size, conn=None))]
    fn advertise<'py>(
        &self,
        py: Python<'py>,
        ptr: u64,
        size: usize,
        conn: Option<&Connection>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.window(py, ptr, size, conn, false)
    }

    /// The window the seed's `advertise_ipc` gives for `[ptr, ptr + size)`:
    /// a CUDA IPC window (136 bytes) of GPU memory for the same-host peer
    /// on `conn` (any same-host peer with None); of host memory an
    /// ordinary window (64 bytes), which the same calls move over shm or tcp.
    #[pyo3(signature = (ptr, size, conn=None))]
    fn advertise_ipc<'py>(
        &self,
        py: Python<'py>,
        ptr: u64,
        size: usize,
        conn: Option<&Connection>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.window(py, ptr, size, conn, self.gpu)
    }

    /// Deregisters it, waiting until no transfer uses it (then the memory
    /// may be freed). Closing twice does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let Some(held) = self.sh.lock().expect("lock").take() else {
            return Ok(());
        };
        // A closed endpoint took its registrations with it.
        let Ok(ep) = self.ep.get() else {
            return Ok(());
        };
        let mr = match held {
            Held::Own(mr) => mr,
            Held::Shared(sh) => match ep.release_shared(sh) {
                Some(mr) => mr,
                // Other holders keep the registration.
                None => return Ok(()),
            },
        };
        // A call submitting an operation may hold it a moment; the memory
        // may be freed once this returns, so wait for it.
        py.allow_threads(
            || match ep.deregister_when_free(mr, Duration::from_secs(10)) {
                Err(ferry::Error::Timeout { .. }) => {
                    Err("the region is still held by a call after \
                                                     10 s; it is deregistered when that call ends"
                        .to_owned())
                }
                other => other.map_err(|e| e.to_string()),
            },
        )
        .map_err(FerryError::new_err)
    }

    fn __repr__(&self) -> String {
        match self.view() {
            Ok(v) => format!(
                "<ferry Region {} {} bytes at {:#x}>",
                if self.gpu { "gpu" } else { "host" },
                v.len,
                v.addr
            ),
            Err(_) => "<ferry Region (closed)>".to_owned(),
        }
    }
}

/// A connection to one peer.
#[pyclass(module = "ferry._native", name = "Connection", frozen)]
pub struct Connection {
    ep: Shared,
    id: ConnId,
}

impl Connection {
    /// The endpoint and `region`'s registration, checked to be this
    /// connection's endpoint's and the connection alive.
    fn own(&self, region: &Region) -> PyResult<(Arc<ferry::Endpoint>, View)> {
        let ep = self.ep.get()?;
        region.owned_by(&self.ep)?;
        ep.conn_status(self.id).map_err(fe)?;
        Ok((ep, region.view()?))
    }

    /// Posts one send, or one receive (its size cut to the region's end,
    /// as the seed's callers expect), of `[ptr, ptr + size)` of `region`.
    fn post(
        &self,
        send: bool,
        region: &Region,
        ptr: u64,
        size: usize,
    ) -> PyResult<(Arc<ferry::Endpoint>, ferry::MessageOp)> {
        let (ep, v) = self.own(region)?;
        let op = if send {
            let off = region.offset_of(&v, ptr, size)?;
            ep.send_async(self.id, &v.mr, off, size)
        } else {
            let end = v.addr.saturating_add(v.len as u64);
            let size = if ptr >= v.addr && ptr < end {
                size.min((end - ptr) as usize)
            } else {
                size
            };
            let off = region.offset_of(&v, ptr, size)?;
            ep.recv_async(self.id, &v.mr, off, size)
        };
        Ok((ep, op.map_err(fe)?))
    }

    /// The checked pieces of one WRITE or READ (`submit`, `run`): the
    /// endpoint, each local piece as (registration, offset, size), and
    /// the decoded windows.
    #[allow(clippy::type_complexity)]
    fn pieces(
        &self,
        locals: &[(PyRef<'_, Region>, u64, usize)],
        windows: &[PyBackedBytes],
    ) -> PyResult<(
        Arc<ferry::Endpoint>,
        Vec<(Arc<MemoryRegion>, usize, usize)>,
        Vec<AnyWindow>,
    )> {
        let ep = self.ep.get()?;
        ep.conn_status(self.id).map_err(fe)?;
        if locals.len() != windows.len() {
            return Err(FerryError::new_err(format!(
                "{} local pieces but {} windows",
                locals.len(),
                windows.len()
            )));
        }
        let mut held = Vec::with_capacity(locals.len());
        for (r, ptr, size) in locals {
            r.owned_by(&self.ep)?;
            let v = r.view()?;
            let off = r.offset_of(&v, *ptr, *size)?;
            held.push((v.mr, off, *size));
        }
        let wins = windows
            .iter()
            .map(|b| AnyWindow::decode(b).map_err(fe))
            .collect::<PyResult<Vec<_>>>()?;
        Ok((ep, held, wins))
    }
}

#[pymethods]
impl Connection {
    #[getter]
    fn id(&self) -> u64 {
        self.id.0
    }

    /// `("tcp", "ip:port")` or `("shm", "<endpoint id>")`; None once closed.
    #[getter]
    fn peer(&self) -> Option<(&'static str, String)> {
        self.ep.get().ok()?.peer(self.id).map(peer_of)
    }

    /// Whether the peer is on this host (shared memory).
    #[getter]
    fn is_local(&self) -> bool {
        let peer = self.ep.get().ok().and_then(|ep| ep.peer(self.id));
        matches!(peer, Some(Peer::Local { .. }))
    }

    /// Starts one WRITE (`write`) or READ over the pairs of `locals`
    /// (`(region, ptr, size)`: `size` bytes at `ptr` in `region`) and
    /// `windows` (the peer's advertised bytes, one per local piece; all
    /// 64-byte windows or all CUDA IPC ones).
    fn submit(
        &self,
        py: Python<'_>,
        write: bool,
        locals: Vec<(PyRef<'_, Region>, u64, usize)>,
        windows: Vec<PyBackedBytes>,
    ) -> PyResult<Transfer> {
        let (ep, held, wins) = self.pieces(&locals, &windows)?;
        let l: Vec<(&MemoryRegion, usize, usize)> =
            held.iter().map(|(m, o, n)| (&**m, *o, *n)).collect();
        let t = py
            .allow_threads(|| start_op(&ep, self.id, write, &l, &wins))
            .map_err(fe)?;
        Ok(Transfer::new(t))
    }

    /// `submit` and the transfer's `wait` in one call, the GIL released
    /// once for both (what ferry.p2p's blocking calls use): returns when
    /// the operation ended; raises `FerryError` if it failed. Ctrl-C
    /// interrupts the wait; the operation runs on.
    fn run(
        &self,
        py: Python<'_>,
        write: bool,
        locals: Vec<(PyRef<'_, Region>, u64, usize)>,
        windows: Vec<PyBackedBytes>,
    ) -> PyResult<()> {
        let (ep, held, wins) = self.pieces(&locals, &windows)?;
        let l: Vec<(&MemoryRegion, usize, usize)> =
            held.iter().map(|(m, o, n)| (&**m, *o, *n)).collect();
        run_op(py, &ep, self.id, write, &l, &wins)
    }

    /// Two-sided: sends `[ptr, ptr + size)` of `region` as one message,
    /// which fills the peer's next posted receive on this connection.
    fn send(&self, region: PyRef<'_, Region>, ptr: u64, size: usize) -> PyResult<Message> {
        let (_, op) = self.post(true, &region, ptr, size)?;
        Ok(Message::new(self.ep.clone(), op))
    }

    /// Two-sided: posts `[ptr, ptr + size)` of `region` (cut to the
    /// region's end, as the seed's callers expect) for the peer's next
    /// message on this connection; the Message's `length` says how much came.
    fn recv(&self, region: PyRef<'_, Region>, ptr: u64, size: usize) -> PyResult<Message> {
        let (_, op) = self.post(false, &region, ptr, size)?;
        Ok(Message::new(self.ep.clone(), op))
    }

    /// Two-sided and blocking: `send` (`send` True) or `recv`, then waits
    /// for it to end, in one call with the GIL released once; returns the
    /// message's length. Ctrl-C interrupts the wait (checked each 50 ms);
    /// the message stays posted, as a dropped `Message`'s does.
    fn exchange(
        &self,
        py: Python<'_>,
        send: bool,
        region: PyRef<'_, Region>,
        ptr: u64,
        size: usize,
    ) -> PyResult<usize> {
        let (ep, op) = self.post(send, &region, ptr, size)?;
        blocking(py, None, |left| ep.wait_message(op, left))?.map_err(fe)
    }

    /// Sends a small message (at most 4096 bytes) to the peer's inbox.
    fn notify(&self, py: Python<'_>, message: &[u8]) -> PyResult<()> {
        let ep = self.ep.get()?;
        py.allow_threads(|| ep.send_notification(self.id, message))
            .map_err(fe)
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let ep = self.ep.get()?;
        py.allow_threads(|| ep.remove_remote(self.id)).map_err(fe)
    }

    fn __repr__(&self) -> String {
        format!("<ferry Connection {:#x} {:?}>", self.id.0, self.peer())
    }
}

/// An operation in flight.
#[pyclass(module = "ferry._native", name = "Transfer", frozen)]
pub struct Transfer {
    t: Mutex<Slot>,
}

enum Slot {
    Idle(ferry::Transfer),
    /// A thread waits on it (with the GIL released, so not under the lock).
    Waited,
    /// Its outcome was reported.
    Reported,
}

impl Transfer {
    fn new(t: ferry::Transfer) -> Self {
        Self {
            t: Mutex::new(Slot::Idle(t)),
        }
    }
}

/// Starts one WRITE or READ and waits for its end with the GIL released
/// once for both (`Connection.run`, `Endpoint.run_one`); Ctrl-C
/// interrupts the wait, and the operation runs on.
fn run_op(
    py: Python<'_>,
    ep: &ferry::Endpoint,
    id: ConnId,
    write: bool,
    l: &[(&MemoryRegion, usize, usize)],
    wins: &[AnyWindow],
) -> PyResult<()> {
    let mut t = py
        .allow_threads(|| {
            let mut t = start_op(ep, id, write, l, wins)?;
            match t.wait_timeout(SLICE) {
                Err(ferry::Error::Timeout {
                    what: "transfer", ..
                }) => Ok(Some(t)),
                other => other.map(|()| None),
            }
        })
        .map_err(fe)?;
    while let Some(mut left) = t.take() {
        py.check_signals()?;
        t = match py.allow_threads(|| left.wait_timeout(SLICE)) {
            Err(ferry::Error::Timeout {
                what: "transfer", ..
            }) => Some(left),
            other => {
                other.map_err(fe)?;
                None
            }
        };
    }
    Ok(())
}

/// Starts one WRITE or READ of `l` against `wins` on connection `id`.
fn start_op(
    ep: &ferry::Endpoint,
    id: ConnId,
    write: bool,
    l: &[(&MemoryRegion, usize, usize)],
    wins: &[AnyWindow],
) -> ferry::Result<ferry::Transfer> {
    if write {
        ep.writev_async(id, l, wins)
    } else {
        ep.readv_async(id, l, wins)
    }
}

#[pymethods]
impl Transfer {
    /// Whether it has ended; raises `FerryError` (once) if it failed.
    fn done(&self) -> PyResult<bool> {
        let mut g = self.t.lock().expect("lock");
        let t = match &mut *g {
            Slot::Idle(t) => t,
            Slot::Waited => return Ok(false),
            Slot::Reported => return Ok(true),
        };
        match t.poll() {
            None => Ok(false),
            Some(r) => {
                *g = Slot::Reported;
                r.map(|()| true).map_err(fe)
            }
        }
    }

    /// Waits up to `timeout_s` (None: no limit) with the GIL released
    /// (Ctrl-C interrupts; the operation runs on): True when it ended,
    /// False at the timeout; raises `FerryError` (once) if it failed.
    #[pyo3(signature = (timeout_s=None))]
    fn wait(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<bool> {
        let mut t = {
            let mut g = self.t.lock().expect("lock");
            match std::mem::replace(&mut *g, Slot::Waited) {
                Slot::Idle(t) => t,
                other => {
                    let reported = matches!(other, Slot::Reported);
                    *g = other;
                    if reported {
                        return Ok(true);
                    }
                    return Err(FerryError::new_err("another thread waits on this transfer"));
                }
            }
        };
        let deadline = deadline_of(timeout_s);
        let r = loop {
            let left = deadline.map_or(SLICE, |d| {
                d.saturating_duration_since(Instant::now()).min(SLICE)
            });
            match py.allow_threads(|| t.wait_timeout(left)) {
                Err(ferry::Error::Timeout {
                    what: "transfer", ..
                }) => {
                    if let Err(interrupt) = py.check_signals() {
                        break Err(interrupt);
                    }
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        break Ok(None);
                    }
                }
                other => break Ok(Some(other)),
            }
        };
        let mut g = self.t.lock().expect("lock");
        match r {
            // Still in flight: back for a later wait or poll.
            Err(interrupt) => {
                *g = Slot::Idle(t);
                Err(interrupt)
            }
            Ok(None) => {
                *g = Slot::Idle(t);
                Ok(false)
            }
            Ok(Some(outcome)) => {
                *g = Slot::Reported;
                outcome.map(|()| true).map_err(fe)
            }
        }
    }
}

/// A two-sided send or receive in flight (`Connection.send` / `recv`).
#[pyclass(module = "ferry._native", name = "Message", frozen)]
pub struct Message {
    ep: Shared,
    op: ferry::MessageOp,
    /// The outcome once reported: the message's length.
    ended: Mutex<Option<usize>>,
}

impl Message {
    fn new(ep: Shared, op: ferry::MessageOp) -> Self {
        Self {
            ep,
            op,
            ended: Mutex::new(None),
        }
    }

    fn ended(&self, r: ferry::Result<usize>) -> PyResult<bool> {
        let n = r.map_err(fe)?;
        *self.ended.lock().expect("lock") = Some(n);
        Ok(true)
    }
}

#[pymethods]
impl Message {
    /// Whether it has ended; raises `FerryError` (once) if it failed.
    fn done(&self) -> PyResult<bool> {
        if self.ended.lock().expect("lock").is_some() {
            return Ok(true);
        }
        match self.ep.get()?.poll_message(self.op) {
            None => Ok(false),
            Some(r) => self.ended(r),
        }
    }

    /// Waits up to `timeout_s` (None: no limit) with the GIL released
    /// (Ctrl-C interrupts): True when it ended, False at the timeout;
    /// raises `FerryError` (once) if it failed.
    #[pyo3(signature = (timeout_s=None))]
    fn wait(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<bool> {
        if self.ended.lock().expect("lock").is_some() {
            return Ok(true);
        }
        let ep = self.ep.get()?;
        let deadline = deadline_of(timeout_s);
        loop {
            let left = deadline.map_or(SLICE, |d| {
                d.saturating_duration_since(Instant::now()).min(SLICE)
            });
            match py.allow_threads(|| ep.wait_message(self.op, left)) {
                Err(ferry::Error::Timeout {
                    what: "a message", ..
                }) => {
                    py.check_signals()?;
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Ok(false);
                    }
                }
                other => return self.ended(other),
            }
        }
    }

    /// The message's length once ended (a send: what was sent); None before.
    #[getter]
    fn length(&self) -> Option<usize> {
        *self.ended.lock().expect("lock")
    }
}

/// How many GPUs are visible here (0 without a CUDA driver).
#[pyfunction]
pub fn gpu_count() -> usize {
    ferry::gpu::cuda().map_or(0, |c| c.device_count())
}

/// The bus id of visible GPU `index`.
#[pyfunction]
pub fn gpu_bus_id(index: usize) -> PyResult<String> {
    ferry::gpu::cuda()
        .and_then(|c| c.device(index).map(|d| d.bus_id.clone()))
        .map_err(|e| FerryError::new_err(format!("GPU {index}: {e}")))
}

/// The same-host endpoint that published GPU `bus_id` (any spelling).
#[pyfunction]
pub fn endpoint_of_gpu(bus_id: &str) -> PyResult<u64> {
    ferry::endpoint::gpu_registry::find(bus_id).map_err(|e| FerryError::new_err(e.to_string()))
}

/// The GPU bus id endpoint `endpoint_id` published, or "".
#[pyfunction]
pub fn gpu_of_endpoint(endpoint_id: u64) -> String {
    ferry::endpoint::gpu_registry::bus_id_of(endpoint_id).unwrap_or_default()
}

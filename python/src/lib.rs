//! `ferry._native`: the Python extension module behind the `ferry` package.
//!
//! * [`core`]: `Endpoint`, `Region`, `Connection`, `Transfer`, mirroring
//!   the core's types; the Pythonic `ferry.Endpoint` (ferry/_api.py) and
//!   the seed's `ferry.p2p.Endpoint` (ferry/p2p.py: integer ids, `(ok, …)`
//!   tuples) are both Python on top of them.
//! * [`desc::XferDesc`] and its byte format: `register_memory` /
//!   `get_serialized_descs` / `transfer`.
//!
//! Every blocking call releases the GIL and wakes every 50 ms to run
//! Python's signal handlers, so Ctrl-C interrupts it.

use pyo3::prelude::*;

mod core;
mod desc;
mod env;

pyo3::create_exception!(
    _native,
    FerryError,
    pyo3::exceptions::PyRuntimeError,
    "A ferry operation failed; the message says what and why. Every ferry \
     failure is one; its subclass says which kind (ferry's `FailureKind`)."
);
pyo3::create_exception!(
    _native,
    InvalidArgument,
    FerryError,
    "A bad argument, range, buffer or setting: the call did nothing."
);
pyo3::create_exception!(
    _native,
    WaitTimeout,
    FerryError,
    "A wait ran out; what it waited for goes on."
);
pyo3::create_exception!(
    _native,
    Busy,
    FerryError,
    "No room now (back-pressure): the call did nothing; try again later."
);
pyo3::create_exception!(
    _native,
    RemoteRefused,
    FerryError,
    "The target refused the operation (key, bounds or access)."
);
pyo3::create_exception!(
    _native,
    ConnectionFailed,
    FerryError,
    "The connection is dead: every later call on it fails the same way."
);
pyo3::create_exception!(
    _native,
    Disconnected,
    ConnectionFailed,
    "The connection is unknown, was closed here, or its peer left."
);
pyo3::create_exception!(
    _native,
    PeerTimeout,
    ConnectionFailed,
    "The connection failed: its peer did not answer within ferry's deadline."
);
pyo3::create_exception!(
    _native,
    PeerMisbehaved,
    ConnectionFailed,
    "The connection failed: its peer broke the protocol or failed integrity."
);

/// The exception for `e`: its kind's class, its text the message.
pub(crate) fn error_to_py(e: ferry::Error) -> PyErr {
    use ferry::FailureKind as K;
    let msg = e.to_string();
    match e.kind() {
        K::Invalid => InvalidArgument::new_err(msg),
        K::Timeout => WaitTimeout::new_err(msg),
        K::Busy => Busy::new_err(msg),
        K::Remote => RemoteRefused::new_err(msg),
        K::Disconnected => Disconnected::new_err(msg),
        K::PeerTimeout => PeerTimeout::new_err(msg),
        K::PeerMisbehaved => PeerMisbehaved::new_err(msg),
        _ => FerryError::new_err(msg),
    }
}

/// Starts one of ferry's rogue test peers on 127.0.0.1 (`"silent"`,
/// `"garbage"` or `"hangup"`) and returns its port: for the tests that
/// show each cause of a failed connection as its own exception class.
#[pyfunction]
fn _rogue_peer(behaviour: &str) -> PyResult<u16> {
    let how: ferry::rogue::Behaviour = behaviour.parse().map_err(InvalidArgument::new_err)?;
    ferry::rogue::spawn(how)
        .map(|a| a.port())
        .map_err(|e| FerryError::new_err(format!("a rogue peer: {e}")))
}

/// Logs `msg` on the `ferry` logger of Python's `logging` at `level`
/// ("warning", "info", …). Logging never fails the caller.
pub(crate) fn log(py: Python<'_>, level: &str, msg: &str) {
    let _ = py
        .import("logging")
        .and_then(|m| m.call_method1("getLogger", ("ferry",)))
        .and_then(|l| l.call_method1(level, (msg,)));
}

/// The seed's `get_oob_ip`: the address an endpoint advertises by default.
#[pyfunction]
fn get_oob_ip() -> String {
    ferry::oob_ip().to_string()
}

/// Whether the same-host path works here (`None`) or why not.
#[pyfunction]
fn shm_unavailable() -> Option<String> {
    ferry::probe_shm().err()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("FerryError", m.py().get_type::<FerryError>())?;
    m.add("InvalidArgument", m.py().get_type::<InvalidArgument>())?;
    m.add("WaitTimeout", m.py().get_type::<WaitTimeout>())?;
    m.add("Busy", m.py().get_type::<Busy>())?;
    m.add("RemoteRefused", m.py().get_type::<RemoteRefused>())?;
    m.add("ConnectionFailed", m.py().get_type::<ConnectionFailed>())?;
    m.add("Disconnected", m.py().get_type::<Disconnected>())?;
    m.add("PeerTimeout", m.py().get_type::<PeerTimeout>())?;
    m.add("PeerMisbehaved", m.py().get_type::<PeerMisbehaved>())?;
    m.add_function(wrap_pyfunction!(_rogue_peer, m)?)?;
    m.add_class::<core::Endpoint>()?;
    m.add_class::<core::Region>()?;
    m.add_class::<core::Connection>()?;
    m.add_class::<core::Transfer>()?;
    m.add_class::<core::Message>()?;
    m.add_function(wrap_pyfunction!(core::gpu_count, m)?)?;
    m.add_function(wrap_pyfunction!(core::gpu_bus_id, m)?)?;
    m.add_function(wrap_pyfunction!(core::endpoint_of_gpu, m)?)?;
    m.add_function(wrap_pyfunction!(core::gpu_of_endpoint, m)?)?;
    m.add_function(wrap_pyfunction!(desc::serialize_descs, m)?)?;
    m.add_function(wrap_pyfunction!(desc::deserialize_descs, m)?)?;
    m.add_class::<desc::XferDesc>()?;
    m.add_class::<desc::FloatType>()?;
    m.add_function(wrap_pyfunction!(get_oob_ip, m)?)?;
    m.add_function(wrap_pyfunction!(shm_unavailable, m)?)?;
    m.add("UINT64_MAX", u64::MAX)?;
    // The window sizes, so Python never restates them.
    m.add("REMOTE_BUF_LEN", ferry::wire::REMOTE_BUF_LEN)?;
    m.add("IPC_BUF_LEN", ferry::wire::IPC_BUF_LEN)?;
    Ok(())
}

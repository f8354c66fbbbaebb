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
    "A ferry operation failed; the message says what and why."
);

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

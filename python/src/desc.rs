//! `XferDesc` (the seed's transfer descriptor, from `register_memory`) and
//! its byte format, and the seed's `FloatType`.
//!
//! The byte format is the seed's `serialize_xfer_descs`, little-endian:
//! `count u64`, then per descriptor `addr u64 | size u64 | nkeys u64 |
//! lkeys u32×nkeys | rkeys u32×nkeys | info_len u64 | info`. ferry's `info`
//! is the 64-byte `RemoteBuf` of the registration (any connected peer may
//! use it until deregistration), followed, for GPU memory, by the 136-byte
//! `IpcBuf` that same-host peers map. Decoding takes hostile input: every
//! length is checked against the bytes that remain, so nothing is
//! allocated beyond the input's size.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::FerryError;

/// A registered buffer as the seed describes it: address, size, the
/// registration's id (`mr_id`, `UINT64_MAX` when not registered here) and
/// keys; `info` holds the windows a peer uses (see the module docs).
#[pyclass(module = "ferry._native", get_all, set_all)]
#[derive(Clone, Debug, Default)]
pub struct XferDesc {
    pub addr: u64,
    pub size: u64,
    pub mr_id: u64,
    pub lkeys: Vec<u32>,
    pub rkeys: Vec<u32>,
    pub info: Vec<u8>,
}

#[pymethods]
impl XferDesc {
    /// Every field may be given, or set afterwards (clients build
    /// descriptors by hand, e.g. a sub-range of a registered one).
    #[new]
    #[pyo3(signature = (addr=0, size=0, mr_id=u64::MAX, lkeys=Vec::new(), rkeys=Vec::new(), info=Vec::new()))]
    fn py_new(
        addr: u64,
        size: u64,
        mr_id: u64,
        lkeys: Vec<u32>,
        rkeys: Vec<u32>,
        info: Vec<u8>,
    ) -> Self {
        XferDesc {
            addr,
            size,
            mr_id,
            lkeys,
            rkeys,
            info,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "<XferDesc addr={} size={} mr_id={}>",
            self.addr, self.size, self.mr_id
        )
    }
}

/// The seed's element types (accepted by `reg`, which ferry does not
/// compress, so they change nothing).
#[pyclass(module = "ferry._native", eq, eq_int)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum FloatType {
    kUndefined = 0,
    kFloat16 = 1,
    kBFloat16 = 2,
    kFloat32 = 3,
    kFloat8E4M3FN = 4,
    kFloat8E5M2 = 5,
}

pub fn serialize(descs: &[XferDesc]) -> Vec<u8> {
    let mut o = Vec::new();
    o.extend_from_slice(&(descs.len() as u64).to_le_bytes());
    for d in descs {
        let n = d.lkeys.len().min(d.rkeys.len());
        o.extend_from_slice(&d.addr.to_le_bytes());
        o.extend_from_slice(&d.size.to_le_bytes());
        o.extend_from_slice(&(n as u64).to_le_bytes());
        for k in &d.lkeys[..n] {
            o.extend_from_slice(&k.to_le_bytes());
        }
        for k in &d.rkeys[..n] {
            o.extend_from_slice(&k.to_le_bytes());
        }
        o.extend_from_slice(&(d.info.len() as u64).to_le_bytes());
        o.extend_from_slice(&d.info);
    }
    o
}

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], String> {
        if n > self.0.len() as u64 {
            return Err(format!(
                "descriptor bytes end early: {what} needs {n} bytes, {} left",
                self.0.len()
            ));
        }
        let (h, t) = self.0.split_at(n as usize);
        self.0 = t;
        Ok(h)
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn keys(&mut self, n: u64, what: &str) -> Result<Vec<u32>, String> {
        let b = self.take(n.saturating_mul(4), what)?;
        Ok(b.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }
}

/// Smallest encoded descriptor: addr, size, nkeys (the seed's oldest form
/// ends there).
const MIN_DESC: u64 = 24;

pub fn deserialize(b: &[u8]) -> Result<Vec<XferDesc>, String> {
    if b.is_empty() {
        return Ok(Vec::new());
    }
    let mut c = Cursor(b);
    let count = c.u64("the count")?;
    if count.saturating_mul(MIN_DESC) > c.0.len() as u64 {
        return Err(format!(
            "descriptor bytes claim {count} descriptors but hold {} bytes",
            b.len()
        ));
    }
    let mut out = Vec::with_capacity(count as usize);
    for i in 0..count {
        let addr = c.u64("addr")?;
        let size = c.u64("size")?;
        let nkeys = c.u64("the key count")?;
        let lkeys = c.keys(nkeys, "lkeys")?;
        let rkeys = c.keys(nkeys, "rkeys")?;
        // The seed's format before IPC info ends here.
        let info = if c.0.is_empty() && i + 1 == count {
            Vec::new()
        } else {
            let n = c.u64("the info length")?;
            c.take(n, "info")?.to_vec()
        };
        out.push(XferDesc {
            addr,
            size,
            mr_id: u64::MAX,
            lkeys,
            rkeys,
            info,
        });
    }
    if !c.0.is_empty() {
        return Err(format!(
            "{} bytes left over after {count} descriptors",
            c.0.len()
        ));
    }
    Ok(out)
}

/// The seed's `get_serialized_descs`: the descriptors as bytes.
#[pyfunction]
pub fn serialize_descs<'py>(
    py: Python<'py>,
    descs: Vec<PyRef<'py, XferDesc>>,
) -> Bound<'py, PyBytes> {
    let v: Vec<XferDesc> = descs.iter().map(|d| (**d).clone()).collect();
    PyBytes::new(py, &serialize(&v))
}

/// The seed's `deserialize_descs`.
#[pyfunction]
pub fn deserialize_descs(b: &[u8]) -> PyResult<Vec<XferDesc>> {
    deserialize(b).map_err(FerryError::new_err)
}

//! The CUDA driver, loaded at run time: initialisation, the visible devices
//! and their primary contexts, and the error mapping every other `gpu` file
//! uses.

use std::ffi::{c_char, c_int, CStr};
use std::sync::OnceLock;

use cudarc::driver::sys as cu;

use crate::error::{Error, Result};
pub use crate::wire::normalize_bus_id;

/// One visible GPU.
#[derive(Debug)]
pub struct DeviceInfo {
    /// Its ordinal (the driver's numbering).
    pub ordinal: i32,
    /// Normalised PCI bus id, `dddd:bb:dd.f` in lower case (the seed's form).
    pub bus_id: String,
    /// The driver's name for it.
    pub name: String,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: its memory can be exported
    /// as a dma-buf (for `ibv_reg_dmabuf_mr`).
    pub dma_buf: bool,
    pub(crate) ctx: CtxPtr,
}

/// A retained primary context. Contexts are process-wide driver objects
/// usable from any thread, so sharing the pointer is sound.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CtxPtr(pub cu::CUcontext);
// SAFETY: see the type's comment: a CUcontext may be made current on any
// thread; the pointer itself is never dereferenced by Rust.
unsafe impl Send for CtxPtr {}
// SAFETY: as above.
unsafe impl Sync for CtxPtr {}

/// The driver after `cuInit`, with every visible device.
#[derive(Debug)]
pub struct Cuda {
    /// Every visible GPU, by ordinal.
    pub devices: Vec<DeviceInfo>,
    /// The driver has `cuMemcpyBatchAsync_v2` (CUDA 13 drivers do).
    pub has_batch_copy: bool,
}

static CUDA: OnceLock<std::result::Result<Cuda, String>> = OnceLock::new();

/// The driver, initialised once per process. `Err` says why there is no
/// GPU path ("no CUDA driver: libcuda.so not found", a failing `cuInit`, no
/// device).
pub fn cuda() -> Result<&'static Cuda> {
    CUDA.get_or_init(init)
        .as_ref()
        .map_err(|why| Error::NoGpu { why: why.clone() })
}

/// Why the GPU path is off, or `None` when it works (for `ferry info`).
pub fn status() -> std::result::Result<&'static Cuda, String> {
    cuda().map_err(|e| match e {
        Error::NoGpu { why } => why,
        other => other.to_string(),
    })
}

/// The driver's name for a status code, e.g. `CUDA_ERROR_INVALID_VALUE`.
pub(crate) fn error_name(code: cu::CUresult) -> String {
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or fails;
    // it is only called once the library is known to be loaded.
    let r = unsafe { cu::cuGetErrorName(code, &mut p) };
    if r != cu::CUresult::CUDA_SUCCESS || p.is_null() {
        return format!("{code:?}");
    }
    // SAFETY: the driver returned a NUL-terminated static string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Maps a driver status to `Ok` or `Error::Cuda` naming the call.
pub(crate) fn check(call: &'static str, r: cu::CUresult) -> Result<()> {
    if r == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(Error::Cuda {
        call,
        code: r as u32,
        name: error_name(r),
    })
}

fn init() -> std::result::Result<Cuda, String> {
    // SAFETY: probing only tries to dlopen the library.
    if !unsafe { cu::is_culib_present() } {
        return Err("no CUDA driver: libcuda.so could not be loaded".into());
    }
    // SAFETY: the library is present, so the symbol loads; flags must be 0.
    check("cuInit", unsafe { cu::cuInit(0) }).map_err(|e| format!("CUDA driver: {e}"))?;
    let mut n: c_int = 0;
    // SAFETY: writes one int.
    check("cuDeviceGetCount", unsafe { cu::cuDeviceGetCount(&mut n) })
        .map_err(|e| e.to_string())?;
    if n <= 0 {
        return Err("CUDA driver loaded but it sees no GPU".into());
    }
    let mut devices = Vec::with_capacity(n as usize);
    for ordinal in 0..n {
        let dev = describe(ordinal).map_err(|e| format!("GPU {ordinal}: {e}"))?;
        devices.push(dev);
    }
    // Probed, not assumed: cudarc panics on a missing symbol.
    // SAFETY: looks a symbol up in the already-loaded library.
    let has_batch_copy = unsafe {
        cu::culib()
            .get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync_v2")
            .is_ok()
    };
    Ok(Cuda {
        devices,
        has_batch_copy,
    })
}

fn describe(ordinal: i32) -> Result<DeviceInfo> {
    let mut dev: cu::CUdevice = 0;
    // SAFETY: writes one device handle for an ordinal below the count.
    check("cuDeviceGet", unsafe { cu::cuDeviceGet(&mut dev, ordinal) })?;
    let mut buf = [0 as c_char; 64];
    // SAFETY: the buffer holds 64 chars and the driver NUL-terminates.
    check("cuDeviceGetPCIBusId", unsafe {
        cu::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as c_int, dev)
    })?;
    // SAFETY: NUL-terminated by the driver (checked length above).
    let bus = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let mut name = [0 as c_char; 128];
    // SAFETY: as above.
    check("cuDeviceGetName", unsafe {
        cu::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev)
    })?;
    // SAFETY: as above.
    let name = unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let mut dma_buf: c_int = 0;
    // SAFETY: writes one int for a valid device; an old driver that does
    // not know the attribute answers an error, read as "no".
    let dma_buf = unsafe {
        cu::cuDeviceGetAttribute(
            &mut dma_buf,
            cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
            dev,
        )
    } == cu::CUresult::CUDA_SUCCESS
        && dma_buf != 0;
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: retains the primary context; it is kept for the process's life.
    check("cuDevicePrimaryCtxRetain", unsafe {
        cu::cuDevicePrimaryCtxRetain(&mut ctx, dev)
    })?;
    Ok(DeviceInfo {
        ordinal,
        bus_id: normalize_bus_id(&bus),
        name,
        dma_buf,
        ctx: CtxPtr(ctx),
    })
}

impl Cuda {
    /// How many devices are visible.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Checks `idx` against the visible devices.
    pub fn device(&self, idx: usize) -> Result<&DeviceInfo> {
        self.devices.get(idx).ok_or(Error::GpuOutOfRange {
            idx,
            count: self.devices.len(),
        })
    }

    /// Makes device `ordinal`'s primary context current on this thread (a
    /// no-op when it already is). Asked of the driver each time rather than
    /// cached: the application may switch contexts on the same thread.
    pub(crate) fn make_current(&self, ordinal: i32) -> Result<()> {
        let dev = self.device(ordinal as usize)?;
        let mut cur: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context pointer (null if none is current).
        check("cuCtxGetCurrent", unsafe { cu::cuCtxGetCurrent(&mut cur) })?;
        if cur == dev.ctx.0 {
            return Ok(());
        }
        // SAFETY: the context was retained in `init` and is never released.
        check("cuCtxSetCurrent", unsafe { cu::cuCtxSetCurrent(dev.ctx.0) })
    }

    /// Makes the RDMA WRITEs a NIC completed into device `ordinal`'s
    /// memory so far visible to work launched on it afterwards
    /// (`cuFlushGPUDirectRDMAWrites`, owner scope): a completion says the
    /// NIC placed the bytes, not that the GPU sees them. Blocks until the
    /// flush is done (microseconds); call it off the data path.
    pub(crate) fn flush_rdma_writes(&self, ordinal: i32) -> Result<()> {
        self.make_current(ordinal)?;
        // SAFETY: plain enum arguments; the device's context is current.
        check("cuFlushGPUDirectRDMAWrites", unsafe {
            cu::cuFlushGPUDirectRDMAWrites(
                cu::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                cu::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
            )
        })
    }

    /// Lets every device reach every other's memory (NVLink or PCIe P2P),
    /// where the hardware allows. Failures only cost speed (copies then
    /// stage through the host), so they are logged, not returned.
    pub(crate) fn enable_peer_access(&self) {
        PEERS.get_or_init(|| {
            let mut on = Vec::new();
            for a in &self.devices {
                for b in &self.devices {
                    if a.ordinal == b.ordinal {
                        continue;
                    }
                    let mut can: c_int = 0;
                    // SAFETY: writes one int; both ordinals are valid devices.
                    let r = unsafe { cu::cuDeviceCanAccessPeer(&mut can, a.ordinal, b.ordinal) };
                    if r != cu::CUresult::CUDA_SUCCESS || can == 0 {
                        continue;
                    }
                    if self.make_current(a.ordinal).is_err() {
                        continue;
                    }
                    // SAFETY: both contexts are retained primary contexts.
                    let r = unsafe { cu::cuCtxEnablePeerAccess(b.ctx.0, 0) };
                    if r != cu::CUresult::CUDA_SUCCESS
                        && r != cu::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                    {
                        tracing::info!(
                            "peer access GPU {} -> {}: {}",
                            a.ordinal,
                            b.ordinal,
                            error_name(r)
                        );
                    } else {
                        on.push((a.ordinal, b.ordinal));
                    }
                }
            }
            on
        });
    }

    /// Whether kernels of device `from` may touch memory of device `to`:
    /// the same device, or peer access that `enable_peer_access` turned on.
    pub(crate) fn reaches(&self, from: i32, to: i32) -> bool {
        from == to || PEERS.get().is_some_and(|p| p.contains(&(from, to)))
    }
}

/// Pairs (from, to) with peer access on, once `enable_peer_access` ran.
static PEERS: OnceLock<Vec<(i32, i32)>> = OnceLock::new();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_a_clear_error_not_a_panic() {
        match cuda() {
            Ok(c) => assert!(!c.devices.is_empty()),
            Err(Error::NoGpu { why }) => assert!(!why.is_empty()),
            Err(other) => panic!("unexpected {other}"),
        }
    }
}

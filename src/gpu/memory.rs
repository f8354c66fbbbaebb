//! What a pointer is (host, or which GPU, and its allocation), and the
//! memory the engine allocates itself: device memory and pinned host memory.

use std::ffi::c_void;

use cudarc::driver::sys as cu;

use super::driver::{check, cuda};
pub use super::kinds::MemKind;
use crate::error::{Error, Result};

/// Asks the driver what `ptr` is. Without a driver every pointer is host
/// memory. Managed (unified) memory is refused: the engine cannot tell
/// where its pages are, so neither DMA nor IPC is safe on it.
pub fn classify(ptr: u64) -> Result<MemKind> {
    let Ok(c) = cuda() else {
        return Ok(MemKind::Host);
    };
    let mut mem_type: u32 = 0;
    let mut ordinal: i32 = -1;
    let mut base: u64 = 0;
    let mut size: usize = 0;
    let mut managed: u32 = 0;
    let mut attrs = [
        cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
    ];
    let mut data: [*mut c_void; 5] = [
        (&mut mem_type as *mut u32).cast(),
        (&mut ordinal as *mut i32).cast(),
        (&mut base as *mut u64).cast(),
        (&mut size as *mut usize).cast(),
        (&mut managed as *mut u32).cast(),
    ];
    c.make_current(0)?;
    // SAFETY: each data pointer points at a variable of the attribute's
    // documented type; unknown pointers get zeroed values, not an error.
    check("cuPointerGetAttributes", unsafe {
        cu::cuPointerGetAttributes(
            attrs.len() as u32,
            attrs.as_mut_ptr(),
            data.as_mut_ptr(),
            ptr,
        )
    })?;
    if managed != 0 {
        return Err(Error::Unsupported {
            what: "registering CUDA managed memory",
            reason: format!(
                "{ptr:#x} is managed (unified) memory; use cuMemAlloc or pinned host memory"
            ),
        });
    }
    Ok(match mem_type {
        x if x == cu::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 => MemKind::Device {
            ordinal,
            alloc_base: base,
            alloc_len: size,
        },
        x if x == cu::CUmemorytype::CU_MEMORYTYPE_HOST as u32 => MemKind::Pinned,
        _ => MemKind::Host,
    })
}

/// Device memory the engine allocated (`Endpoint::alloc_gpu`); freed on drop.
pub(crate) struct DeviceBuf {
    ptr: u64,
    ordinal: i32,
}

impl DeviceBuf {
    pub fn new(ordinal: i32, len: usize) -> Result<Self> {
        let c = cuda()?;
        c.make_current(ordinal)?;
        let mut ptr: cu::CUdeviceptr = 0;
        // SAFETY: allocates `len` bytes in the current context.
        check("cuMemAlloc", unsafe {
            cu::cuMemAlloc_v2(&mut ptr, len.max(1))
        })?;
        Ok(Self { ptr, ordinal })
    }

    /// The device address of the allocation.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        if let Ok(c) = cuda() {
            if c.make_current(self.ordinal).is_ok() {
                // SAFETY: `ptr` came from cuMemAlloc and is freed once; the
                // region holding it is gone, so nothing uses it any more.
                let r = unsafe { cu::cuMemFree_v2(self.ptr) };
                if let Err(e) = check("cuMemFree", r) {
                    tracing::warn!("freeing GPU memory {:#x}: {e}", self.ptr);
                }
            }
        }
    }
}

/// Pinned host memory (`cuMemHostAlloc`, portable to every context); the
/// fastest host side of a host↔GPU copy. Freed on drop.
pub(crate) struct PinnedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain memory owned by this value; see Region's Send reasoning.
unsafe impl Send for PinnedBuf {}
// SAFETY: as above.
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    pub fn new(len: usize) -> Result<Self> {
        let c = cuda()?;
        c.make_current(0)?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: allocates `len` bytes of page-locked memory.
        check("cuMemHostAlloc", unsafe {
            cu::cuMemHostAlloc(&mut p, len.max(1), cu::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        // SAFETY: fresh allocation of at least `len` bytes; zeroing also
        // faults the pages in before they are measured.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len) };
        Ok(Self { ptr: p.cast(), len })
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Bytes allocated.
    pub fn len(&self) -> usize {
        self.len
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if cuda().is_ok() {
            // SAFETY: `ptr` came from cuMemHostAlloc and is freed once.
            let _ = unsafe { cu::cuMemFreeHost(self.ptr.cast()) };
        }
    }
}

/// Blocking copy between any two addresses the driver knows (unified
/// addressing); for setup and tests, never on the loop. Safe code uses
/// `MemoryRegion::read_at`/`write_at`, which check the range first.
///
/// # Safety
/// `[dst, dst + len)` and `[src, src + len)` must be live memory (GPU,
/// pinned or pageable host) for the whole call: the driver reads pageable
/// host memory with the CPU, and a bad host address faults.
pub unsafe fn copy_blocking(dst: u64, src: u64, len: usize) -> Result<()> {
    let c = cuda()?;
    c.make_current(0)?;
    // SAFETY: the caller's promise: both ranges are live for `len` bytes.
    check("cuMemcpy", unsafe { cu::cuMemcpy(dst, src, len) })?;
    // From pageable memory cuMemcpy may return before the DMA lands, and
    // the engine's streams do not wait for the legacy stream: finish here.
    // SAFETY: waits for the current context's work.
    check("cuCtxSynchronize", unsafe { cu::cuCtxSynchronize() })
}

/// Reference throughput for benchmarks: copies `size`-byte blocks from
/// `src` to `dst` (cycling through `slots` blocks of each) on one stream of
/// device `ordinal`, `batch` copies per synchronisation, for about `secs`
/// seconds; returns GB/s (1e9 B/s). With device buffers on two GPUs this is
/// `cudaMemcpyPeer`'s rate; with a pinned host source, pinned H2D.
///
/// # Safety
/// `dst` and `src` must each be live memory of at least `size * slots`
/// bytes for the whole call.
pub unsafe fn copy_throughput(
    ordinal: i32,
    dst: u64,
    src: u64,
    size: usize,
    slots: usize,
    batch: usize,
    secs: f64,
) -> Result<f64> {
    let c = cuda()?;
    c.make_current(ordinal)?;
    c.enable_peer_access();
    c.make_current(ordinal)?;
    let mut stream: cu::CUstream = std::ptr::null_mut();
    // SAFETY: creates a stream in the current context; destroyed below.
    check("cuStreamCreate", unsafe {
        cu::cuStreamCreate(
            &mut stream,
            cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
        )
    })?;
    let run = |n: usize, k0: usize| -> Result<()> {
        for k in k0..k0 + n {
            let off = ((k % slots.max(1)) * size) as u64;
            // SAFETY: the caller passes buffers of at least slots * size bytes.
            check("cuMemcpyAsync", unsafe {
                cu::cuMemcpyAsync(dst + off, src + off, size, stream)
            })?;
        }
        // SAFETY: waits for this stream's copies.
        check("cuStreamSynchronize", unsafe {
            cu::cuStreamSynchronize(stream)
        })
    };
    let result = (|| {
        run(batch, 0)?; // warm-up
        let start = std::time::Instant::now();
        let (mut k, mut bytes) = (0usize, 0u64);
        while start.elapsed().as_secs_f64() < secs {
            run(batch, k)?;
            k += batch;
            bytes += (batch * size) as u64;
        }
        Ok(bytes as f64 / start.elapsed().as_secs_f64() / 1e9)
    })();
    // SAFETY: the stream is idle (synchronised) and destroyed once.
    unsafe { cu::cuStreamDestroy_v2(stream) };
    result
}

/// A dma-buf file descriptor for the GPU allocation `[alloc_base,
/// alloc_base + alloc_len)` (for `ibv_reg_dmabuf_mr`). The caller closes it.
/// A GPU without dma-buf support (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`
/// 0: an older driver or kernel) is refused before the call, so the caller
/// falls back to registering the device pointer (nvidia-peermem).
pub fn dmabuf_fd(ordinal: i32, alloc_base: u64, alloc_len: usize) -> Result<i32> {
    let c = cuda()?;
    if !c.device(ordinal as usize)?.dma_buf {
        return Err(crate::error::Error::Unsupported {
            what: "dma-buf export of GPU memory",
            reason: format!("GPU {ordinal} reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0"),
        });
    }
    c.make_current(ordinal)?;
    let mut fd: i32 = -1;
    // SAFETY: writes one int (the fd) for a live allocation's whole range.
    check("cuMemGetHandleForAddressRange", unsafe {
        cu::cuMemGetHandleForAddressRange(
            (&mut fd as *mut i32).cast(),
            alloc_base,
            alloc_len,
            cu::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    })?;
    Ok(fd)
}

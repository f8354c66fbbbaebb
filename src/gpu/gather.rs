//! Many small copies in one kernel launch.
//!
//! `cuMemcpyBatchAsync` still costs the calling thread about a microsecond
//! per copy, and the copy engine runs the copies of one batch one after
//! another (about a microsecond each at 4 KiB, measured on an H200 with
//! `benches/cuda_call_cost.py`). For GPU memory over tcp every small op
//! pays one such copy on each side, so a window of 32 ops moved as a wave
//! that took ~30 µs to issue and ~30 µs to run per side. This kernel copies
//! a whole batch at once instead: one launch (a few microseconds whatever
//! the count), one thread block per copy, all blocks in parallel.
//!
//! The kernel is PTX, loaded by the driver's JIT (no toolkit at build time,
//! no fat binary): `ferry_gather(descs, count)` where `descs` points to
//! `count` descriptors `{dst: u64, src: u64, len: u64}`, written in
//! pinned memory and read there (kernels reach it at its host address), or
//! for a large batch copied to device memory ahead of the launch on its
//! stream; a batch of at most `PARAM_DESCS` goes by value in the launch's
//! parameters instead (`ferry_gather_p`), read from the constant bank. Block (x, y) copies the y-th 16 KiB of copy x: 16-byte words
//! when all three are 16-byte aligned, else bytes.
//!
//! Only memory that kernels may touch goes through it: device memory and
//! pinned buffers made by `cuMemHostAlloc` (every such allocation is
//! reachable from every device at its host address under unified
//! addressing). Pageable host memory, whose pages a kernel cannot reach,
//! stays with the copy engine. Callers say which is which.

use cudarc::driver::sys as cu;

use super::driver::{check, cuda};
use super::memory::{DeviceBuf, PinnedBuf};
use crate::error::Result;

/// Copies longer than this go to the copy engine. Each copy gets one
/// block per `CHUNK_BYTES` (the grid's y), so a 256 KiB KV block is 16
/// blocks in parallel, not one block looping 16 times.
pub(crate) const KERNEL_MAX_BYTES: usize = 256 << 10;
/// Bytes of a copy one block moves: four 16-byte words per thread, all
/// four read before the first is written (with one word a thread, a
/// 16 KiB piece was four blocks each waiting out one read, and 1 024
/// such pieces took 29 µs from launch to event where one engine copy of
/// the same 16 MiB took 18 on the H100; `benches/gather_probe.py`). The
/// PTX's `16384` is this.
const CHUNK_BYTES: usize = 16384;
const _: () = assert!(
    THREADS as usize * 16 * 4 == CHUNK_BYTES,
    "four words per thread per chunk"
);
/// Threads per block (one block per copy).
const THREADS: u32 = 256;
/// Bytes of one descriptor.
const DESC_BYTES: usize = 24;

/// The copy loop both entries share, once a block has its copy's
/// descriptor in %rd5 (dst), %rd6 (src), %rd7 (len) and the copy's index
/// checked. Labels are local to each entry in PTX, so it appears twice.
macro_rules! copy_body {
    () => {
        r#"
    // This block's chunk of the copy: [start, end), CHUNK bytes at y.
    mov.u32 %r9, %ctaid.y;
    mul.wide.u32 %rd15, %r9, 16384;
    setp.ge.u64 %p5, %rd15, %rd7;
    @%p5 bra DONE;
    add.s64 %rd16, %rd15, 16384;
    min.u64 %rd16, %rd16, %rd7;
    cvta.to.global.u64 %rd5, %rd5;
    cvta.to.global.u64 %rd6, %rd6;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %ntid.x;
    cvt.u64.u32 %rd8, %r3;
    cvt.u64.u32 %rd9, %r4;
    or.b64 %rd10, %rd5, %rd6;
    or.b64 %rd10, %rd10, %rd7;
    and.b64 %rd10, %rd10, 15;
    setp.ne.u64 %p2, %rd10, 0;
    @%p2 bra BYTES;
    // 16-byte words: this thread's are start/16 + tid + k * ntid for k
    // in 0..4 (the chunk is 4 * ntid words), each below end/16. All four
    // loads are issued before the first store: four reads in flight per
    // thread instead of one.
    shr.u64 %rd11, %rd16, 4;
    shr.u64 %rd17, %rd15, 4;
    add.s64 %rd8, %rd8, %rd17;
    add.s64 %ra1, %rd8, %rd9;
    add.s64 %ra2, %ra1, %rd9;
    add.s64 %ra3, %ra2, %rd9;
    setp.lt.u64 %q0, %rd8, %rd11;
    setp.lt.u64 %q1, %ra1, %rd11;
    setp.lt.u64 %q2, %ra2, %rd11;
    setp.lt.u64 %q3, %ra3, %rd11;
    shl.b64 %rd12, %rd8, 4;
    shl.b64 %rd18, %rd9, 4;
    add.s64 %rd13, %rd6, %rd12;
    add.s64 %ra4, %rd13, %rd18;
    add.s64 %ra5, %ra4, %rd18;
    add.s64 %ra6, %ra5, %rd18;
    @%q0 ld.global.v4.u32 {%w0, %w1, %w2, %w3}, [%rd13];
    @%q1 ld.global.v4.u32 {%w4, %w5, %w6, %w7}, [%ra4];
    @%q2 ld.global.v4.u32 {%w8, %w9, %w10, %w11}, [%ra5];
    @%q3 ld.global.v4.u32 {%w12, %w13, %w14, %w15}, [%ra6];
    add.s64 %rd14, %rd5, %rd12;
    add.s64 %ra4, %rd14, %rd18;
    add.s64 %ra5, %ra4, %rd18;
    add.s64 %ra6, %ra5, %rd18;
    @%q0 st.global.v4.u32 [%rd14], {%w0, %w1, %w2, %w3};
    @%q1 st.global.v4.u32 [%ra4], {%w4, %w5, %w6, %w7};
    @%q2 st.global.v4.u32 [%ra5], {%w8, %w9, %w10, %w11};
    @%q3 st.global.v4.u32 [%ra6], {%w12, %w13, %w14, %w15};
    bra DONE;
BYTES:
    // Bytes: [start + tid, end) by ntid, four loads in flight per pass
    // (16 passes over a whole chunk, as many as one byte a pass took
    // over the 4 KiB chunks before).
    add.s64 %rd8, %rd8, %rd15;
BYTELOOP:
    setp.ge.u64 %p4, %rd8, %rd16;
    @%p4 bra DONE;
    add.s64 %ra1, %rd8, %rd9;
    add.s64 %ra2, %ra1, %rd9;
    add.s64 %ra3, %ra2, %rd9;
    setp.lt.u64 %q1, %ra1, %rd16;
    setp.lt.u64 %q2, %ra2, %rd16;
    setp.lt.u64 %q3, %ra3, %rd16;
    add.s64 %rd13, %rd6, %rd8;
    ld.global.u8 %rs1, [%rd13];
    add.s64 %ra4, %rd6, %ra1;
    @%q1 ld.global.u8 %rs2, [%ra4];
    add.s64 %ra5, %rd6, %ra2;
    @%q2 ld.global.u8 %rs3, [%ra5];
    add.s64 %ra6, %rd6, %ra3;
    @%q3 ld.global.u8 %rs4, [%ra6];
    add.s64 %rd14, %rd5, %rd8;
    st.global.u8 [%rd14], %rs1;
    add.s64 %ra4, %rd5, %ra1;
    @%q1 st.global.u8 [%ra4], %rs2;
    add.s64 %ra5, %rd5, %ra2;
    @%q2 st.global.u8 [%ra5], %rs3;
    add.s64 %ra6, %rd5, %ra3;
    @%q3 st.global.u8 [%ra6], %rs4;
    add.s64 %rd8, %ra3, %rd9;
    bra BYTELOOP;
DONE:
    ret;
}
"#
    };
}

/// The kernel, in PTX (ISA 7.0, sm_70 and later: the driver compiles it
/// for the GPU at load). NUL-terminated, as `cuModuleLoadData` reads it.
///
/// Two entries (two modules, `PTX` and `PTX_P`): `ferry_gather(descs, count)` reads the descriptors from
/// memory (pinned or device); `ferry_gather_p(count, descs[])` takes up to
/// `PARAM_DESCS` of them by value, in the launch's parameters, which every
/// block reads from the constant bank instead of over PCIe — for a batch
/// of 32 copies in 512 blocks those were 4 096 warps' reads of pinned host
/// memory before any byte moved.
const PTX: &str = concat!(
    r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry ferry_gather(
    .param .u64 descs,
    .param .u32 count
)
{
    .reg .pred %p<6>;
    .reg .b16 %rs<5>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<20>;
    .reg .pred %q<4>;
    .reg .b32 %w<16>;
    .reg .b64 %ra<7>;

    ld.param.u64 %rd1, [descs];
    ld.param.u32 %r1, [count];
    mov.u32 %r2, %ctaid.x;
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r2, 24;
    add.s64 %rd4, %rd2, %rd3;
    ld.global.u64 %rd5, [%rd4];
    ld.global.u64 %rd6, [%rd4+8];
    ld.global.u64 %rd7, [%rd4+16];
"#,
    copy_body!(),
    "\0"
);

/// The by-value entry, its own module: were a driver to refuse it, the
/// first still loads and batches read their descriptors from memory.
const PTX_P: &str = concat!(
    r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry ferry_gather_p(
    .param .u32 count,
    .param .align 8 .b8 descs[3840]
)
{
    .reg .pred %p<6>;
    .reg .b16 %rs<5>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<20>;
    .reg .pred %q<4>;
    .reg .b32 %w<16>;
    .reg .b64 %ra<7>;

    ld.param.u32 %r1, [count];
    mov.u32 %r2, %ctaid.x;
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra DONE;
    // A kernel parameter's address, read with ld.param (PTX ISA 5.1.6.1).
    mov.u64 %rd2, descs;
    mul.wide.u32 %rd3, %r2, 24;
    add.s64 %rd4, %rd2, %rd3;
    ld.param.u64 %rd5, [%rd4];
    ld.param.u64 %rd6, [%rd4+8];
    ld.param.u64 %rd7, [%rd4+16];
"#,
    copy_body!(),
    "\0"
);

/// Descriptors passed by value (`ferry_gather_p`): 3 840 bytes, inside
/// the 4 KiB of parameters every driver takes.
const PARAM_DESCS: usize = 160;
const _: () = assert!(PARAM_DESCS * DESC_BYTES == 3840, "the PTX's descs[]");

/// The loaded kernel of one device and its descriptor slots: `slots`
/// batches can be in flight at once, each holding its slot (and the
/// pinned descriptors in it) until its event has fired. A slot's buffer
/// grows to the largest batch it carried (a request of 100 000 pieces is
/// one launch), and is kept for the next.
pub(crate) struct Gather {
    ordinal: i32,
    module: cu::CUmodule,
    /// `ferry_gather`: descriptors in memory.
    func: cu::CUfunction,
    /// `ferry_gather_p` (up to `PARAM_DESCS` descriptors by value) and its
    /// module, where it loaded.
    by_value: Option<(cu::CUmodule, cu::CUfunction)>,
    /// Batches of at least this many copies: descriptors in device memory.
    device_descs: usize,
    /// Each slot's descriptors (None: not allocated yet).
    descs: Vec<Option<SlotBufs>>,
    /// Bit i set: slot i is free.
    free: u32,
}

/// A slot's descriptors: written in pinned host memory, copied to the
/// device ahead of the launch on the same stream, read there by the blocks
/// (every warp of every block reads its copy's descriptor: from host
/// memory that was a PCIe round trip each, ~200 ns a piece at 100 000).
struct SlotBufs {
    host: PinnedBuf,
    dev: DeviceBuf,
    /// Descriptors each holds.
    cap: usize,
}

// SAFETY: module and function are driver handles usable from any thread;
// a Gather is used by the one shard that owns its copier.
unsafe impl Send for Gather {}

/// Descriptors a slot's first buffer holds.
const FIRST_SLOT_DESCS: usize = 1024;

impl Gather {
    /// Loads the kernel into device `ordinal`'s context (left current)
    /// with `slots` (≤ 32) slots; batches of at least `device_descs`
    /// copies read their descriptors from device memory (copied there
    /// first), smaller ones from pinned memory.
    pub fn load(ordinal: i32, slots: usize, device_descs: usize) -> Result<Self> {
        let slots = slots.clamp(1, 32);
        cuda()?.make_current(ordinal)?;
        let (module, func) = load_entry(PTX, c"ferry_gather")?;
        let by_value = load_entry(PTX_P, c"ferry_gather_p")
            .map_err(|e| {
                tracing::warn!(
                    gpu = ordinal,
                    "the by-value gather kernel did not load ({e}): descriptors go through memory"
                )
            })
            .ok();
        Ok(Self {
            ordinal,
            module,
            func,
            by_value,
            device_descs,
            descs: (0..slots).map(|_| None).collect(),
            free: if slots == 32 {
                u32::MAX
            } else {
                (1u32 << slots) - 1
            },
        })
    }

    /// A free slot, if any.
    pub fn take_slot(&mut self) -> Option<usize> {
        if self.free == 0 {
            return None;
        }
        let s = self.free.trailing_zeros() as usize;
        self.free &= !(1 << s);
        Some(s)
    }

    /// Gives `slot` back once the launch that used it has ended.
    pub fn free_slot(&mut self, slot: usize) {
        self.free |= 1 << slot;
    }

    /// The descriptor buffers of taken `slot`, room for `n` at least; the
    /// module's context is current after.
    fn room(&mut self, slot: usize, n: usize) -> Result<&SlotBufs> {
        let fits = matches!(&self.descs[slot], Some(b) if b.cap >= n);
        if !fits {
            // The old buffers (if any) are free: the slot's launch ended.
            self.descs[slot] = None;
            let cap = n.next_power_of_two().max(FIRST_SLOT_DESCS);
            // Both make other contexts current.
            let host = PinnedBuf::new(cap * DESC_BYTES)?;
            let dev = DeviceBuf::new(self.ordinal, cap * DESC_BYTES)?;
            cuda()?.make_current(self.ordinal)?;
            self.descs[slot] = Some(SlotBufs { host, dev, cap });
        }
        Ok(self.descs[slot].as_ref().expect("allocated above"))
    }

    /// Writes the descriptors of `dsts[i] <- srcs[i]` (`sizes[i]` bytes)
    /// into `slot` and launches the kernel on `stream` (in the current
    /// context, the module's).
    ///
    /// # Safety
    /// Every range must be device memory or `cuMemHostAlloc` memory and
    /// stay valid until the launch has ended on `stream`; `slot` must be
    /// taken, and stays so until then.
    pub unsafe fn launch(
        &mut self,
        slot: usize,
        dsts: &[u64],
        srcs: &[u64],
        sizes: &[usize],
        stream: cu::CUstream,
    ) -> Result<()> {
        let n = sizes.len().min(dsts.len()).min(srcs.len());
        let mut count = n as u32;
        let longest = sizes[..n].iter().copied().max().unwrap_or(0);
        let chunks = longest.div_ceil(CHUNK_BYTES).max(1) as u32;
        if let (Some((_, func_p)), true) = (self.by_value, n <= PARAM_DESCS) {
            // By value: the driver copies all of `descs[]` into the launch.
            let mut words = [0u64; PARAM_DESCS * 3];
            for i in 0..n {
                words[3 * i] = dsts[i];
                words[3 * i + 1] = srcs[i];
                words[3 * i + 2] = sizes[i] as u64;
            }
            let mut params = [
                (&mut count as *mut u32).cast::<std::ffi::c_void>(),
                words.as_mut_ptr().cast::<std::ffi::c_void>(),
            ];
            // SAFETY: the kernel's two parameters (a u32 and 3 840 bytes),
            // read during the call; the ranges are valid until the launch
            // ends (the caller's promise).
            return check("cuLaunchKernel", unsafe {
                self.launch_fn(func_p, count, chunks, &mut params, stream)
            });
        }
        let bufs = self.room(slot, n)?;
        let (d, dev) = (bufs.host.ptr().cast::<u64>(), bufs.dev.ptr());
        for i in 0..n {
            // SAFETY: the slot's buffer holds at least n descriptors of 3
            // words; no launch reads it now (the slot was free: its last
            // launch ended).
            unsafe {
                d.add(3 * i).write(dsts[i]);
                d.add(3 * i + 1).write(srcs[i]);
                d.add(3 * i + 2).write(sizes[i] as u64);
            }
        }
        // A few hundred descriptors are read where they are written
        // (pinned memory that kernels reach at its host address): one more
        // call would cost more than their reads over PCIe.
        let mut descs = if n < self.device_descs {
            d as u64
        } else {
            // SAFETY: n descriptors from our pinned buffer to our device
            // buffer (both hold cap >= n), ordered before the launch on
            // `stream`; the slot (so both buffers) stays taken until the
            // launch ended.
            check("cuMemcpyHtoDAsync", unsafe {
                cu::cuMemcpyHtoDAsync_v2(dev, d.cast(), n * DESC_BYTES, stream)
            })?;
            dev
        };
        let mut params = [
            (&mut descs as *mut u64).cast::<std::ffi::c_void>(),
            (&mut count as *mut u32).cast::<std::ffi::c_void>(),
        ];
        // SAFETY: the kernel's two parameters, read during the call; the
        // ranges are valid until the launch ends (the caller's promise).
        check("cuLaunchKernel", unsafe {
            self.launch_fn(self.func, count, chunks, &mut params, stream)
        })
    }

    /// One launch of `func` over `count` x `chunks` blocks.
    ///
    /// # Safety
    /// `params` must be `func`'s parameters, as `cuLaunchKernel` reads them.
    unsafe fn launch_fn(
        &self,
        func: cu::CUfunction,
        count: u32,
        chunks: u32,
        params: &mut [*mut std::ffi::c_void; 2],
        stream: cu::CUstream,
    ) -> cu::CUresult {
        // SAFETY: the caller's promise; no extra launch options.
        unsafe {
            cu::cuLaunchKernel(
                func,
                count,
                chunks,
                1,
                THREADS,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
    }
}

/// Loads `ptx` into the current context and finds its entry `name`.
pub(crate) fn load_entry(
    ptx: &str,
    name: &std::ffi::CStr,
) -> Result<(cu::CUmodule, cu::CUfunction)> {
    let mut module: cu::CUmodule = std::ptr::null_mut();
    // SAFETY: a NUL-terminated PTX image, read during the call.
    check("cuModuleLoadData", unsafe {
        cu::cuModuleLoadData(&mut module, ptx.as_ptr().cast())
    })?;
    let mut func: cu::CUfunction = std::ptr::null_mut();
    // SAFETY: a function of the module just loaded, by a C string name.
    let r = unsafe { cu::cuModuleGetFunction(&mut func, module, name.as_ptr()) };
    if let Err(e) = check("cuModuleGetFunction", r) {
        // SAFETY: the module loaded above, unused.
        unsafe { cu::cuModuleUnload(module) };
        return Err(e);
    }
    Ok((module, func))
}

impl Drop for Gather {
    fn drop(&mut self) {
        // SAFETY: our modules; the owning copier synchronised its streams.
        unsafe {
            cu::cuModuleUnload(self.module);
            if let Some((m, _)) = self.by_value {
                cu::cuModuleUnload(m);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels (both gather modules and the runner) assemble for the oldest and a current target, by
    /// NVIDIA's own assembler (no GPU needed: `ptxas` from PyPI's
    /// nvidia-cuda-nvcc wheel; .ci/run installs it and sets FERRY_PTXAS).
    /// A driver JIT-compiles the same text at first use, where a mistake
    /// would only show as "small copies stay on the copy engine".
    #[test]
    #[ignore = "needs ptxas (FERRY_PTXAS names it)"]
    fn the_kernels_assemble() {
        let ptxas = std::env::var("FERRY_PTXAS").expect("FERRY_PTXAS: the ptxas binary");
        let dir = std::env::temp_dir().join(format!("ferry-ptx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, ptx, entry) in [
            ("gather", PTX, "ferry_gather"),
            ("gather_p", PTX_P, "ferry_gather_p"),
            ("runner", super::super::runner::PTX, "ferry_runner"),
        ] {
            let src = dir.join(format!("{name}.ptx"));
            std::fs::write(&src, ptx.trim_end_matches('\0')).unwrap();
            for arch in ["sm_70", "sm_90"] {
                let out = std::process::Command::new(&ptxas)
                    .arg(format!("-arch={arch}"))
                    .arg("-v")
                    .arg(&src)
                    .arg("-o")
                    .arg(dir.join(format!("{name}.{arch}.cubin")))
                    .output()
                    .expect("run ptxas");
                let log = String::from_utf8_lossy(&out.stderr);
                assert!(out.status.success(), "{name} for {arch}: {log}");
                assert!(
                    log.contains(entry),
                    "{name} for {arch}: no {entry} in {log}"
                );
                // Descriptors by value are read in place (constant bank),
                // not copied to a stack frame first.
                assert!(
                    log.contains("0 bytes stack frame"),
                    "{name} for {arch}: {log}"
                );
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

//! The GPU path: the CUDA driver loaded at run time through
//! cudarc, device discovery, pointer classification, CUDA IPC between
//! processes of one host, and asynchronous copies on a stream pool whose
//! events the shard's loop polls.
//!
//! Without a driver (`libcuda.so` absent, or no GPU) nothing here fails at
//! load: [`driver::cuda`] returns `Error::NoGpu` saying why, every pointer
//! is host memory, and the host paths work as before.

pub(crate) mod copy;
pub mod driver;
pub(crate) mod gather;
pub(crate) mod ipc;
mod kinds;
pub mod memory;
pub(crate) mod runner;

pub use copy::GpuCopy;
pub use driver::{cuda, normalize_bus_id, Cuda, DeviceInfo};
pub use ipc::IpcStats;
pub use memory::MemKind;

//! The `gpu` module of a build without the `gpu` feature: the same names,
//! and every GPU request answered with `Error::NoGpu`. Host memory paths do
//! not notice the difference.

use crate::error::{Error, Result};

fn off() -> Error {
    Error::NoGpu {
        why: "this build has no GPU path (built without the `gpu` feature)".into(),
    }
}

pub mod driver {
    use super::*;

    #[derive(Debug)]
    pub struct DeviceInfo {
        pub ordinal: i32,
        pub bus_id: String,
        pub name: String,
    }

    #[derive(Debug)]
    pub struct Cuda {
        pub devices: Vec<DeviceInfo>,
        pub has_batch_copy: bool,
    }

    impl Cuda {
        pub fn device(&self, idx: usize) -> Result<&DeviceInfo> {
            Err(Error::GpuOutOfRange { idx, count: 0 })
        }

        pub(crate) fn make_current(&self, _ordinal: i32) -> Result<()> {
            Err(off())
        }
    }

    pub fn cuda() -> Result<&'static Cuda> {
        Err(off())
    }

    pub fn status() -> std::result::Result<&'static Cuda, String> {
        Err(off().to_string())
    }
}

pub mod memory {
    use super::*;

    pub use crate::gpu_kinds::MemKind;

    pub fn classify(_ptr: u64) -> Result<MemKind> {
        Ok(MemKind::Host)
    }

    pub fn copy_blocking(_dst: u64, _src: u64, _len: usize) -> Result<()> {
        Err(off())
    }

    pub fn dmabuf_fd(_ordinal: i32, _alloc_base: u64, _alloc_len: usize) -> Result<i32> {
        Err(off())
    }

    pub fn copy_throughput(
        _ordinal: i32,
        _dst: u64,
        _src: u64,
        _size: usize,
        _slots: usize,
        _batch: usize,
        _secs: f64,
    ) -> Result<f64> {
        Err(off())
    }

    pub(crate) struct DeviceBuf {
        pub ptr: u64,
    }

    impl DeviceBuf {
        pub fn new(_ordinal: i32, _len: usize) -> Result<Self> {
            Err(off())
        }
    }

    pub(crate) struct PinnedBuf {
        pub ptr: *mut u8,
    }

    // SAFETY: never constructed in this build.
    unsafe impl Send for PinnedBuf {}
    // SAFETY: never constructed in this build.
    unsafe impl Sync for PinnedBuf {}

    impl PinnedBuf {
        pub fn new(_len: usize) -> Result<Self> {
            Err(off())
        }
    }
}

pub(crate) mod copy {
    use super::*;

    pub(crate) struct Entry {
        pub then: crate::reactor::Then,
        pub mapping: Option<super::ipc::MapKey>,
        pub keep: Option<std::sync::Arc<crate::region::Region>>,
        #[allow(dead_code)]
        pub keep2: Option<std::sync::Arc<crate::region::Region>>,
    }

    pub(crate) struct Copier;

    type Staged = std::result::Result<(), (Error, Vec<Entry>)>;

    impl Copier {
        pub fn new(_ordinal: i32, _streams: usize) -> Result<Self> {
            Err(off())
        }
        pub fn ordinal(&self) -> i32 {
            0
        }
        pub fn busy(&self) -> bool {
            false
        }
        pub fn stage(&mut self, e: Entry, _dst: u64, _src: u64, _len: usize) -> Staged {
            Err((off(), vec![e]))
        }
        pub fn flush(&mut self) -> Staged {
            Ok(())
        }
        pub fn poll(&mut self, _out: impl FnMut(Entry, Result<()>)) -> usize {
            0
        }
    }
}

pub(crate) mod ipc {
    use super::*;

    pub(crate) type MapKey = (u64, u64);

    pub(crate) use crate::gpu_kinds::IpcCounters;
    pub use crate::gpu_kinds::IpcStats;

    pub(crate) fn export(_ordinal: i32, _alloc_base: u64) -> Result<[u8; 64]> {
        Err(off())
    }

    pub(crate) struct IpcCache;

    impl IpcCache {
        pub fn new(_c: std::sync::Arc<IpcCounters>) -> Self {
            IpcCache
        }
        pub fn acquire(&mut self, _b: &crate::wire::IpcBuf) -> Result<(u64, Option<MapKey>)> {
            Err(off())
        }
        pub fn release(&mut self, _key: MapKey) {}
        pub fn revoke(&mut self, _owner_id: u64, _alloc_base: u64) {}
        pub fn revoke_owner(&mut self, _owner_id: u64) {}
    }
}

pub use crate::wire::normalize_bus_id;
pub use driver::{cuda, Cuda, DeviceInfo};
pub use ipc::IpcStats;
pub use memory::MemKind;

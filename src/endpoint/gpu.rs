//! The GPU side of the public API: GPU and pinned allocations, CUDA IPC
//! advertisement, and write_ipc/read_ipc (single, vectored, async) — the
//! seed's `advertise_ipc` / `write_ipc` / `read_ipc` family.

use std::sync::Arc;

use super::{Endpoint, Inner, MemoryRegion, Peer};
use crate::error::{ConnId, Error, OpKind, Result};
use crate::gpu::memory::{DeviceBuf, PinnedBuf};
use crate::gpu::{IpcStats, MemKind};
use crate::reactor::{Command, IpcCmd, IpcDesc, IpcParts, RegionCmd, Transfer};
use crate::region::{Access, Backing};
use crate::wire::IpcBuf;

/// # GPU memory and CUDA IPC windows
impl Endpoint {
    /// The endpoint's GPU: given to the builder, or picked by the first
    /// registered GPU pointer (lazy mode); `None` until then.
    pub fn gpu(&self) -> Option<usize> {
        self.inner.gpus.ordinal.get().map(|&g| g as usize)
    }

    /// Allocates and registers `len` bytes of memory on the endpoint's GPU
    /// (GPU 0 if none is chosen yet, which then becomes the endpoint's).
    /// The contents are undefined until written.
    pub fn alloc_gpu(&self, len: usize) -> Result<MemoryRegion> {
        let ordinal = *self.inner.gpus.ordinal.get_or_init(|| 0);
        self.alloc_gpu_on(ordinal, len)
    }

    /// `alloc_gpu` on GPU `ordinal` (a bounce buffer beside the memory it
    /// serves).
    pub(super) fn alloc_gpu_on(&self, ordinal: i32, len: usize) -> Result<MemoryRegion> {
        crate::gpu::cuda()?.device(ordinal as usize)?;
        let buf = DeviceBuf::new(ordinal, len)?;
        let ptr = buf.ptr() as *mut u8;
        // SAFETY: the device allocation of `len` bytes is the backing.
        unsafe {
            self.inner
                .add_region(ptr, len, Access::all(), Backing::Device(buf))
        }
    }

    /// Allocates and registers `len` zeroed bytes of pinned (page-locked)
    /// host memory: the host side of the fastest host↔GPU copies.
    pub fn alloc_pinned(&self, len: usize) -> Result<MemoryRegion> {
        let buf = PinnedBuf::new(len)?;
        let ptr = buf.ptr();
        // SAFETY: the pinned allocation of `len` bytes is the backing.
        unsafe {
            self.inner
                .add_region(ptr, len, Access::all(), Backing::Pinned(buf))
        }
    }

    /// Where the bytes of `mr` live (host, pinned host, or which GPU).
    pub fn mem_kind(&self, mr: &MemoryRegion) -> MemKind {
        mr.inner.mem
    }

    /// Describes `[offset, offset + len)` of GPU memory `mr` for the
    /// same-host peer on `conn` (the seed's `advertise_ipc`): a CUDA IPC
    /// handle of the allocation, the window's offset in it and its size.
    /// The peer maps the allocation itself, so (as with any CUDA IPC
    /// handle) nothing but the window check in `write_ipc`/`read_ipc`
    /// limits it to the window; deregistering `mr` tells same-host peers to
    /// close their mappings.
    pub fn advertise_ipc(
        &self,
        conn: ConnId,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
    ) -> Result<IpcBuf> {
        self.conn_status(conn)?;
        mr.advertise_ipc(offset, len)
    }

    /// `advertise_ipc` for several windows.
    pub fn advertisev_ipc(
        &self,
        conn: ConnId,
        windows: &[(&MemoryRegion, usize, usize)],
    ) -> Result<Vec<IpcBuf>> {
        windows
            .iter()
            .map(|(m, o, l)| self.advertise_ipc(conn, m, *o, *l))
            .collect()
    }

    /// CUDA IPC counters: handles opened (cache misses), cache hits,
    /// handles closed, same-process shortcuts, mappings open now.
    pub fn ipc_stats(&self) -> IpcStats {
        self.inner.gpus.ipc_counters.snapshot()
    }
}

impl MemoryRegion {
    /// The IPC description of `[offset, offset + len)` of this GPU memory,
    /// for any same-host peer (see [`Endpoint::advertise_ipc`]).
    pub fn advertise_ipc(&self, offset: usize, len: usize) -> Result<IpcBuf> {
        self.check_range(offset, len)?;
        let MemKind::Device {
            ordinal,
            alloc_base,
            alloc_len,
        } = self.inner.mem
        else {
            return Err(Error::Unsupported {
                what: "advertise_ipc of host memory",
                reason: format!(
                    "region {:#x} is {:?}; CUDA IPC exports GPU memory only (use advertise)",
                    self.addr(),
                    self.inner.mem
                ),
            });
        };
        let ep = self.ep.upgrade().ok_or(Error::Shutdown)?;
        // Exported once per registration and marked for revocation.
        let handle = self.inner.export_ipc()?;
        Ok(IpcBuf {
            device: ordinal as u16,
            owner_id: ep.me.id,
            host_token: ep.me.host_token,
            owner_pid: std::process::id(),
            alloc_id: self.inner.tag,
            alloc_base,
            alloc_len: alloc_len as u64,
            offset: self.addr() - alloc_base + offset as u64,
            len: len as u64,
            handle,
        })
    }
}

/// The GPU side.
pub(super) struct GpuSide {
    /// The endpoint's GPU ordinal, once given or picked (lazy mode).
    pub(super) ordinal: std::sync::OnceLock<i32>,
    /// GPUs (bit = ordinal, < 64) with memory registered here: an RDMA
    /// peer may write into them, so a notification from a verbs connection
    /// flushes them first (`flush_rdma_writes`).
    pub(super) registered: std::sync::atomic::AtomicU64,
    pub(super) ipc_counters: Arc<crate::gpu::ipc::IpcCounters>,
}

impl Inner {
    /// The endpoint at the other end of `conn` when it is a same-host
    /// peer (asked once per op: each piece's window must be its).
    pub(super) fn local_peer_of(&self, conn: ConnId) -> Option<u64> {
        let live = self.conns.live.lock().expect("lock");
        match live.get(&conn).map(|c| c.peer) {
            Some(Peer::Local { endpoint_id, .. }) => Some(endpoint_id),
            _ => None,
        }
    }

    /// One piece of an IPC op, checked: our slice, the window's length and
    /// host, and that the window is the peer's (`peer`: `local_peer_of`).
    pub(super) fn ipc_desc(
        &self,
        conn: ConnId,
        peer: Option<u64>,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: &IpcBuf,
    ) -> Result<IpcDesc> {
        let local = mr.slice(offset, len)?;
        if len as u64 > remote.len {
            return Err(Error::RemoteTooSmall {
                len,
                remote_size: remote.len.min(u32::MAX as u64) as u32,
            });
        }
        if remote.host_token != self.me.host_token {
            return Err(Error::Unsupported {
                what: "CUDA IPC with another host",
                reason: format!(
                    "the window was advertised by endpoint {:016x} on another host (or network namespace)",
                    remote.owner_id
                ),
            });
        }
        if let Some(endpoint_id) = peer {
            if endpoint_id != remote.owner_id && remote.owner_pid != std::process::id() {
                return Err(Error::Unsupported {
                    what: "an IPC window of another endpoint",
                    reason: format!(
                        "{conn} leads to endpoint {endpoint_id:016x}, the window belongs to {:016x}",
                        remote.owner_id
                    ),
                });
            }
        }
        Ok(IpcDesc {
            local,
            remote: *remote,
        })
    }

    /// Submits an IPC op (or a local copy) to `conn`'s shard; `note`, of
    /// kind `note_kind` (`NOTE_APP` or `NOTE_CTL`), goes to the peer once
    /// it ended well.
    pub(super) fn submit_ipc(
        &self,
        conn: ConnId,
        kind: OpKind,
        parts: IpcParts,
        note: Option<&[u8]>,
        note_kind: u8,
    ) -> Result<Transfer> {
        super::lanes::check_note(note)?;
        let cuda = crate::gpu::cuda()?;
        // Copies run on the local buffer's GPU when it has one, else on the
        // endpoint's (GPU 0 in lazy mode).
        let ordinal = match &parts {
            IpcParts::One(d) => d.local.region().mem,
            IpcParts::Many(v) => v[0].local.region().mem,
            IpcParts::Planned { keep, .. } => keep[0].region().mem,
            IpcParts::Local { dst, .. } => dst.region().mem,
        };
        let ordinal = match ordinal {
            MemKind::Device { ordinal, .. } => ordinal,
            _ => *self.gpus.ordinal.get_or_init(|| 0),
        };
        cuda.device(ordinal as usize)?;
        let t = self.shards.table.claim().ok_or(Error::TooManyInflight {
            max: self.shards.table.capacity(),
        })?;
        if let Some(n) = note {
            self.attach_note(&t, conn, note_kind, n);
        }
        let cmd = IpcCmd {
            conn,
            kind,
            slot: t.slot(),
            ordinal,
            parts,
        };
        match self.shard_of(conn).submit(Command::Ipc(cmd)) {
            Ok(()) => Ok(t),
            Err((e, _)) => {
                self.shards.table.cancel_note(t.slot());
                self.shards.table.complete(t.slot(), Ok(()));
                drop(t);
                Err(e)
            }
        }
    }

    /// After deregistering IPC-exported GPU memory: same-host peers close
    /// their mappings of its allocation.
    pub(crate) fn revoke_ipc(self: &Arc<Self>, mem: MemKind) {
        if let MemKind::Device { alloc_base, .. } = mem {
            // Same-host connections live on every shard: each tells its own.
            // (A shard that is gone has no connections left to tell.)
            for s in &self.shards.shards {
                let _ = s.region(RegionCmd::RevokeIpc(alloc_base));
            }
        }
    }
}

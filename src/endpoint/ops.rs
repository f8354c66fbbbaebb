//! The one-sided operations, once: `write`, `read`, `writev`, `readv` and
//! their `_async` forms, over any [`Window`] a peer advertised — a
//! [`RemoteBuf`] (a key window: tcp, shm or verbs, whichever the connection
//! uses) or an [`IpcBuf`] (a CUDA IPC window on this host, copied by this
//! endpoint's GPU streams; the seed's `write_ipc`/`read_ipc`).

use super::lanes::Via;
use super::{Endpoint, MemoryRegion};
use crate::error::{ConnId, Error, OpKind, Result};
use crate::reactor::OpDesc;
use crate::reactor::{IpcParts, OpParts, Transfer};
use crate::region::Access;
use crate::wire::{AnyWindow, IpcBuf, RemoteBuf};

/// A peer's advertised memory that one-sided operations can target.
/// Sealed: implemented by [`RemoteBuf`], [`IpcBuf`] and [`AnyWindow`]
/// (either, decoded from bytes; a vectored op's windows are then all of
/// one kind).
pub trait Window: sealed::Sealed {}

impl Window for RemoteBuf {}
impl Window for IpcBuf {}
impl Window for AnyWindow {}

/// A vectored op pairs each local slice with one window, and has some.
pub(super) fn check_pairs<W>(
    locals: &[(&MemoryRegion, usize, usize)],
    remotes: &[W],
) -> Result<()> {
    if locals.len() != remotes.len() {
        return Err(Error::VectorMismatch {
            locals: locals.len(),
            remotes: remotes.len(),
        });
    }
    if locals.is_empty() {
        return Err(Error::EmptyVector);
    }
    Ok(())
}

/// A READ writes into our memory: a registration its owner holds
/// read-only (registered without `Access::LOCAL_WRITE`) is refused as its
/// destination, in every form of READ.
pub(super) fn check_local(kind: OpKind, locals: &[(&MemoryRegion, usize, usize)]) -> Result<()> {
    if kind != OpKind::Read {
        return Ok(());
    }
    match locals
        .iter()
        .find(|(mr, ..)| !mr.inner.access.contains(Access::LOCAL_WRITE))
    {
        Some((mr, ..)) => Err(Error::ReadOnlyDestination {
            addr: mr.inner.addr(),
            len: mr.inner.len(),
        }),
        None => Ok(()),
    }
}

/// One part of an op on a window. `same_host` says whether the
/// connection is a same-host one (asked only for GPU memory). `borrow`:
/// the op is queued now, so its slice need not hold a count of the region
/// (`RegionSlice::borrowed`; its shard adopts it).
pub(super) fn desc(
    mr: &MemoryRegion,
    offset: usize,
    len: usize,
    remote: &RemoteBuf,
    same_host: &dyn Fn() -> bool,
    borrow: bool,
) -> Result<OpDesc> {
    let local = if borrow {
        mr.slice_borrowed(offset, len)?
    } else {
        mr.slice(offset, len)?
    };
    desc_of(local, remote, same_host)
}

/// One part of an op from a checked slice of ours (see [`desc`]).
pub(super) fn desc_of(
    local: crate::region::RegionSlice,
    remote: &RemoteBuf,
    same_host: &dyn Fn() -> bool,
) -> Result<OpDesc> {
    let len = local.len();
    if local.is_device() && same_host() {
        // A same-host target reaches GPU memory through its IPC handle;
        // export it now so that a failure is this call's error. Over tcp
        // and verbs nothing is exported: memory that cannot be (VMM,
        // cudaMallocAsync pools) still moves there.
        local.region().export_ipc()?;
    }
    if len > remote.size as usize {
        return Err(Error::RemoteTooSmall {
            len,
            remote_size: remote.size,
        });
    }
    Ok(OpDesc {
        remote_addr: remote.addr,
        rkey: remote.rkey,
        tag: remote.key_tag(),
        remote_device: remote.is_device(),
        nic_rkeys: remote.nic_rkeys(),
        dtype: remote
            .dtype()
            .and_then(crate::codec::FloatType::from_u8)
            .or_else(|| local.region().dtype()),
        local,
    })
}

mod sealed {
    use super::*;

    pub trait Sealed: Sized {
        /// Checks and submits one operation: one part per (local slice,
        /// window) pair.
        fn submit(
            ep: &Endpoint,
            conn: ConnId,
            kind: OpKind,
            locals: &[(&MemoryRegion, usize, usize)],
            remotes: &[Self],
            via: &mut Via<'_>,
        ) -> Result<Transfer>;
    }

    impl Sealed for RemoteBuf {
        fn submit(
            ep: &Endpoint,
            conn: ConnId,
            kind: OpKind,
            locals: &[(&MemoryRegion, usize, usize)],
            remotes: &[Self],
            via: &mut Via<'_>,
        ) -> Result<Transfer> {
            if via.is_now() {
                ep.inner.prepare_submit(conn);
            }
            check_local(kind, locals)?;
            let same_host = || matches!(ep.peer(conn), Some(crate::endpoint::Peer::Local { .. }));
            let borrow = via.is_now();
            let d = |mr, off, len, r| desc(mr, off, len, r, &same_host, borrow);
            let parts = match (locals, remotes) {
                ([(mr, off, len)], [r]) => OpParts::One(d(mr, *off, *len, r)?),
                _ => {
                    check_pairs(locals, remotes)?;
                    let v = locals.iter().zip(remotes);
                    OpParts::Many(
                        v.map(|((m, o, l), r)| d(m, *o, *l, r))
                            .collect::<Result<_>>()?,
                    )
                }
            };
            ep.inner.submit(conn, kind, parts, via)
        }
    }

    impl Sealed for IpcBuf {
        fn submit(
            ep: &Endpoint,
            conn: ConnId,
            kind: OpKind,
            locals: &[(&MemoryRegion, usize, usize)],
            remotes: &[Self],
            via: &mut Via<'_>,
        ) -> Result<Transfer> {
            check_local(kind, locals)?;
            let peer = ep.inner.local_peer_of(conn);
            let parts = match (locals, remotes) {
                ([(mr, off, len)], [r]) => {
                    IpcParts::One(ep.inner.ipc_desc(conn, peer, mr, *off, *len, r)?)
                }
                _ => {
                    check_pairs(locals, remotes)?;
                    let v = locals.iter().zip(remotes);
                    let d = v.map(|((m, o, l), r)| ep.inner.ipc_desc(conn, peer, m, *o, *l, r));
                    IpcParts::Many(d.collect::<Result<_>>()?)
                }
            };
            // A CUDA IPC op is this endpoint's own GPU copy, queued at
            // once even from a batch; the shard of its connection ends it
            // (its ledger), and sends its note then.
            ep.inner
                .submit_ipc(conn, kind, parts, via.note(), via.note_kind())
        }
    }

    impl Sealed for AnyWindow {
        fn submit(
            ep: &Endpoint,
            conn: ConnId,
            kind: OpKind,
            locals: &[(&MemoryRegion, usize, usize)],
            remotes: &[Self],
            via: &mut Via<'_>,
        ) -> Result<Transfer> {
            match remotes {
                [AnyWindow::Key(r)] => RemoteBuf::submit(ep, conn, kind, locals, &[*r], via),
                [AnyWindow::Ipc(i)] => IpcBuf::submit(ep, conn, kind, locals, &[*i], via),
                _ => {
                    let keys: Option<Vec<RemoteBuf>> =
                        remotes.iter().map(|w| w.key().copied()).collect();
                    if let Some(keys) = keys {
                        return RemoteBuf::submit(ep, conn, kind, locals, &keys, via);
                    }
                    let ipcs: Option<Vec<IpcBuf>> =
                        remotes.iter().map(|w| w.ipc().copied()).collect();
                    match ipcs {
                        Some(ipcs) => IpcBuf::submit(ep, conn, kind, locals, &ipcs, via),
                        None => Err(Error::Unsupported {
                            what: "a vectored op",
                            reason: "its windows mix key windows and CUDA IPC windows".into(),
                        }),
                    }
                }
            }
        }
    }
}

/// # One-sided operations
///
/// WRITE and READ of a window a peer advertised (a `RemoteBuf` or an
/// `IpcBuf`): `*_async` start one and return its [`Transfer`]; `write`,
/// `read`, `writev`, `readv` are the same waited on; `*_on` apply it on the
/// calling thread's own shard.
impl Endpoint {
    /// Starts a WRITE of `mr[offset..offset + len]` to the start of
    /// `remote`. With an [`IpcBuf`] it is a CUDA IPC copy (the seed's
    /// `write_ipc`): `mr` may be GPU or host memory (pinned is fastest).
    #[doc(alias = "write_ipc_async")]
    pub fn write_async<W: Window>(
        &self,
        conn: ConnId,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: &W,
    ) -> Result<Transfer> {
        W::submit(
            self,
            conn,
            OpKind::Write,
            &[(mr, offset, len)],
            std::slice::from_ref(remote),
            &mut Via::now(),
        )
    }

    /// Starts a READ of the start of `remote` into `mr[offset..offset + len]`.
    #[doc(alias = "read_ipc_async")]
    pub fn read_async<W: Window>(
        &self,
        conn: ConnId,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: &W,
    ) -> Result<Transfer> {
        W::submit(
            self,
            conn,
            OpKind::Read,
            &[(mr, offset, len)],
            std::slice::from_ref(remote),
            &mut Via::now(),
        )
    }

    /// Embedded mode: [`write_async`](Endpoint::write_async) applied at
    /// once by `shard`, the shard this thread drives, instead of through
    /// its command queue (no queue push, no wake, nothing to wait for the
    /// next [`Shard::poll`](crate::Shard::poll)'s drain): the shortest
    /// path from a call to the wire. Ops stay in order with what this
    /// thread queued before. A connection served by another shard (or
    /// `shard` of another endpoint) goes through that shard's queue, as
    /// with `write_async`; CUDA IPC windows too.
    pub fn write_async_on<W: Window>(
        &self,
        shard: &mut crate::reactor::Shard,
        conn: ConnId,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: &W,
    ) -> Result<Transfer> {
        self.one_on(shard, conn, OpKind::Write, mr, offset, len, remote)
    }

    /// Embedded mode: [`read_async`](Endpoint::read_async) applied at once
    /// by `shard` (see [`write_async_on`](Endpoint::write_async_on)).
    pub fn read_async_on<W: Window>(
        &self,
        shard: &mut crate::reactor::Shard,
        conn: ConnId,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: &W,
    ) -> Result<Transfer> {
        self.one_on(shard, conn, OpKind::Read, mr, offset, len, remote)
    }

    /// One op of `kind` applied by `shard` (see `write_async_on`).
    #[allow(clippy::too_many_arguments)]
    fn one_on<W: Window>(
        &self,
        shard: &mut crate::reactor::Shard,
        conn: ConnId,
        kind: OpKind,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: &W,
    ) -> Result<Transfer> {
        let locals = [(mr, offset, len)];
        let remotes = std::slice::from_ref(remote);
        W::submit(self, conn, kind, &locals, remotes, &mut Via::on(shard))
    }

    /// Starts one WRITE per (local slice, window) pair, as one transfer.
    #[doc(alias = "writev_ipc_async")]
    pub fn writev_async<W: Window>(
        &self,
        conn: ConnId,
        locals: &[(&MemoryRegion, usize, usize)],
        remotes: &[W],
    ) -> Result<Transfer> {
        W::submit(self, conn, OpKind::Write, locals, remotes, &mut Via::now())
    }

    /// Starts one READ per (local slice, window) pair, as one transfer.
    #[doc(alias = "readv_ipc_async")]
    pub fn readv_async<W: Window>(
        &self,
        conn: ConnId,
        locals: &[(&MemoryRegion, usize, usize)],
        remotes: &[W],
    ) -> Result<Transfer> {
        W::submit(self, conn, OpKind::Read, locals, remotes, &mut Via::now())
    }

    /// Starts one `kind` (WRITE or READ) per (local slice, window) pair,
    /// as one transfer, and has the shard send `notify` (at most 4096
    /// bytes) to the peer once the transfer ended well: after the data is
    /// in place (a WRITE: the peer applied it; a READ: it is here), whether
    /// or not anyone polls the transfer. A transfer that fails sends none.
    /// Key windows only (a CUDA IPC op is refused). To a same-host peer a
    /// WRITE of one piece carries the notification in its request, and
    /// the peer takes it in as the data lands (no reply's and note's trip
    /// more): should the connection die between that and the reply, the
    /// peer has the notification while this transfer fails.
    pub fn transfer_notify_async<W: Window>(
        &self,
        conn: ConnId,
        kind: OpKind,
        locals: &[(&MemoryRegion, usize, usize)],
        remotes: &[W],
        notify: &[u8],
    ) -> Result<Transfer> {
        let mut via = Via::now().noting(notify);
        W::submit(self, conn, kind, locals, remotes, &mut via)
    }

    /// WRITE and wait. Needs managed shards, or embedded ones polled by
    /// another thread.
    #[doc(alias = "write_ipc")]
    pub fn write<W: Window>(
        &self,
        conn: ConnId,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: &W,
    ) -> Result<()> {
        self.write_async(conn, mr, offset, len, remote)?.wait()
    }

    /// READ and wait (see [`write`](Endpoint::write)).
    #[doc(alias = "read_ipc")]
    pub fn read<W: Window>(
        &self,
        conn: ConnId,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: &W,
    ) -> Result<()> {
        self.read_async(conn, mr, offset, len, remote)?.wait()
    }

    /// Vectored WRITE and wait.
    #[doc(alias = "writev_ipc")]
    pub fn writev<W: Window>(
        &self,
        conn: ConnId,
        locals: &[(&MemoryRegion, usize, usize)],
        remotes: &[W],
    ) -> Result<()> {
        self.writev_async(conn, locals, remotes)?.wait()
    }

    /// Vectored READ and wait.
    #[doc(alias = "readv_ipc")]
    pub fn readv<W: Window>(
        &self,
        conn: ConnId,
        locals: &[(&MemoryRegion, usize, usize)],
        remotes: &[W],
    ) -> Result<()> {
        self.readv_async(conn, locals, remotes)?.wait()
    }
}

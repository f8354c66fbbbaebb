//! Batches: several one-sided ops handed to the shards at once. Each op
//! still gets its own [`Transfer`] and outcome; what is shared is the
//! queueing: one command (one queue push, at most one wake) per shard per
//! `MAX_BATCH` ops, instead of one each, and the shard hands the command's
//! vector back for the next batch (no allocation once warm). What it does
//! not save is the op's own cost (its command's bytes and its completion
//! slot cross cores either way): with the one-CAS command queue a thread
//! feeding four shards spends no less per small op in a batch than alone,
//! and less alone since a submit fetches its queue slot early, which a
//! staged op does not (docs/benchmarks-log.md, issue 29, 2026-12-03).

use super::lanes::Via;
use super::ops::Window;
use super::{Endpoint, MemoryRegion};
use crate::error::{ConnId, OpKind, Result};
use crate::reactor::{OpCmd, Transfer};

/// Ops staged to be queued together: made by [`Endpoint::batch`]. An op
/// added here is checked at once (a bad range or an unknown window is that
/// call's error) and gets its [`Transfer`], but reaches its shard only when
/// the batch is submitted or dropped (or when `MAX_BATCH` ops for one shard
/// are staged): do not wait on a transfer of a batch still being filled.
///
/// A command its shard's queue refuses (the queue is full) fails each of
/// its ops through its transfer with [`Error::QueueFull`](crate::Error::QueueFull).
/// CUDA IPC ops ([`IpcBuf`](crate::IpcBuf) windows) are queued at once.
///
/// ```no_run
/// # fn f(ep: &ferry::Endpoint, c: ferry::ConnId, mr: &ferry::MemoryRegion,
/// #      w: &ferry::RemoteBuf) -> ferry::Result<()> {
/// let mut batch = ep.batch();
/// let mut transfers = Vec::new();
/// for i in 0..32u32 {
///     let window = w.slice(i * 4096, 4096).expect("inside the window");
///     transfers.push(batch.write(c, mr, i as usize * 4096, 4096, &window)?);
/// }
/// batch.submit()?;
/// for t in transfers {
///     t.wait()?;
/// }
/// # Ok(()) }
/// ```
pub struct Batch<'a> {
    ep: &'a Endpoint,
    /// Per shard, the ops staged for it.
    staged: Vec<Vec<OpCmd>>,
}

impl std::fmt::Debug for Batch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("staged", &self.staged.iter().map(Vec::len).sum::<usize>())
            .finish()
    }
}

/// # Batches of operations
impl Endpoint {
    /// A batch of ops to queue together (see [`Batch`]).
    pub fn batch(&self) -> Batch<'_> {
        Batch {
            ep: self,
            staged: (0..self.inner.shards.shards.len())
                .map(|_| Vec::new())
                .collect(),
        }
    }
}

impl Batch<'_> {
    fn add<W: Window>(
        &mut self,
        conn: ConnId,
        kind: OpKind,
        locals: &[(&MemoryRegion, usize, usize)],
        remotes: &[W],
    ) -> Result<Transfer> {
        W::submit(
            self.ep,
            conn,
            kind,
            locals,
            remotes,
            &mut Via::staged(&mut self.staged),
        )
    }

    /// Stages a WRITE of `mr[offset..offset + len]` to the start of
    /// `remote` (as [`Endpoint::write_async`]).
    pub fn write<W: Window>(
        &mut self,
        conn: ConnId,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: &W,
    ) -> Result<Transfer> {
        let remotes = std::slice::from_ref(remote);
        self.add(conn, OpKind::Write, &[(mr, offset, len)], remotes)
    }

    /// Stages a READ of the start of `remote` into `mr[offset..offset +
    /// len]` (as [`Endpoint::read_async`]).
    pub fn read<W: Window>(
        &mut self,
        conn: ConnId,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: &W,
    ) -> Result<Transfer> {
        let remotes = std::slice::from_ref(remote);
        self.add(conn, OpKind::Read, &[(mr, offset, len)], remotes)
    }

    /// Stages a vectored WRITE (as [`Endpoint::writev_async`]).
    pub fn writev<W: Window>(
        &mut self,
        conn: ConnId,
        locals: &[(&MemoryRegion, usize, usize)],
        remotes: &[W],
    ) -> Result<Transfer> {
        self.add(conn, OpKind::Write, locals, remotes)
    }

    /// Stages a vectored READ (as [`Endpoint::readv_async`]).
    pub fn readv<W: Window>(
        &mut self,
        conn: ConnId,
        locals: &[(&MemoryRegion, usize, usize)],
        remotes: &[W],
    ) -> Result<Transfer> {
        self.add(conn, OpKind::Read, locals, remotes)
    }

    /// Ops staged and not yet queued.
    pub fn len(&self) -> usize {
        self.staged.iter().map(Vec::len).sum()
    }

    /// Whether nothing is queued in it.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues every staged op: one command per shard. The first refusal is
    /// returned; every op of a refused command fails through its transfer.
    pub fn submit(mut self) -> Result<()> {
        self.queue_all()
    }

    fn queue_all(&mut self) -> Result<()> {
        let mut first = Ok(());
        for (shard, q) in self.staged.iter_mut().enumerate() {
            if let Err(e) = self.ep.inner.queue_staged(shard, q) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
            if q.capacity() > 0 {
                // A buffer that went out as one op: back for the next batch.
                self.ep.inner.shards.shards[shard]
                    .wake
                    .bufs
                    .give(std::mem::take(q));
            }
        }
        first
    }
}

impl Drop for Batch<'_> {
    /// A batch dropped unsubmitted queues its ops: none is lost.
    fn drop(&mut self) {
        let _ = self.queue_all();
    }
}

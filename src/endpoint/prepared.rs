//! Ops checked once and posted many times: a NIXL transfer handle, a
//! KV-cache layout sent per request. [`Endpoint::prepare`] checks every
//! piece (local bounds and access, the window's length, host and owner)
//! and, for CUDA IPC windows, plans the op for the shard — its pieces by
//! index into the distinct local regions and peer allocations — so that
//! [`Endpoint::post`] checks and copies nothing per piece: it sends the
//! shared plan, the shard opens each peer allocation once and stages every
//! copy into one batch (one gather-kernel launch) that ends the op.

use std::collections::HashMap;
use std::sync::Arc;

use super::ops::{check_local, check_pairs};
use super::{Endpoint, MemoryRegion};
use crate::error::{ConnId, OpKind, Result};
use crate::gpu::MemKind;
use crate::reactor::{IpcParts, IpcPlan, PlannedPiece, Transfer};
use crate::wire::{AnyWindow, IpcBuf};

/// An op checked by [`Endpoint::prepare`], posted by [`Endpoint::post`]
/// as often as wanted. It borrows its local regions: they stay registered
/// while it lives.
pub struct Prepared<'r> {
    conn: ConnId,
    kind: OpKind,
    pieces: usize,
    how: How<'r>,
}

enum How<'r> {
    /// CUDA IPC pieces, planned for the shard.
    Ipc {
        plan: Arc<IpcPlan>,
        regions: Vec<&'r MemoryRegion>,
    },
    /// Anything else: the checked pieces, posted as one vectored op.
    Pieces {
        locals: Vec<(&'r MemoryRegion, usize, usize)>,
        windows: Vec<AnyWindow>,
    },
}

impl std::fmt::Debug for Prepared<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("conn", &self.conn)
            .field("kind", &self.kind)
            .field("pieces", &self.pieces)
            .field("planned", &matches!(self.how, How::Ipc { .. }))
            .finish()
    }
}

impl Prepared<'_> {
    /// The connection it goes on.
    pub fn conn(&self) -> ConnId {
        self.conn
    }

    /// WRITE or READ.
    pub fn kind(&self) -> OpKind {
        self.kind
    }

    /// Its pieces (local slice, window) as given.
    pub fn pieces(&self) -> usize {
        self.pieces
    }

    /// Whether posting it sends a plan (CUDA IPC windows, pieces below
    /// 8 MiB) rather than its pieces.
    pub fn is_planned(&self) -> bool {
        matches!(self.how, How::Ipc { .. })
    }
}

/// Pieces this long or longer are split over streams, one op each: such
/// an op is posted piece by piece, not planned.
const PLAN_MAX_PIECE: usize = crate::gpu::copy::SPLIT_MIN_BYTES;

/// # Prepared ops
impl Endpoint {
    /// Checks a vectored op once — `locals[i]` (region, offset, length)
    /// with `windows[i]` — for posting many times with [`Endpoint::post`].
    /// Fails as `writev_async`/`readv_async` would for the same pieces.
    ///
    /// ```no_run
    /// # fn f(ep: &ferry::Endpoint, conn: ferry::ConnId, mr: &ferry::MemoryRegion,
    /// #      w: &[ferry::AnyWindow]) -> ferry::Result<()> {
    /// let locals: Vec<_> = (0..w.len()).map(|i| (mr, i * 4096, 4096)).collect();
    /// let p = ep.prepare(conn, ferry::OpKind::Write, &locals, w)?;
    /// for _ in 0..10 {
    ///     ep.post(&p, None)?.wait()?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn prepare<'r>(
        &self,
        conn: ConnId,
        kind: OpKind,
        locals: &[(&'r MemoryRegion, usize, usize)],
        windows: &[AnyWindow],
    ) -> Result<Prepared<'r>> {
        check_pairs(locals, windows)?;
        check_local(kind, locals)?;
        let ipcs: Option<Vec<&IpcBuf>> = windows.iter().map(AnyWindow::ipc).collect();
        let small = locals.iter().all(|&(_, _, len)| len < PLAN_MAX_PIECE);
        let how = match ipcs {
            Some(ipcs) if small => self.plan_ipc(conn, locals, &ipcs)?,
            _ => {
                // Checked now as a post would (bounds, windows), then kept.
                for (&(mr, off, len), w) in locals.iter().zip(windows) {
                    mr.slice(off, len)?;
                    if len as u64 > w.len() {
                        return Err(crate::error::Error::RemoteTooSmall {
                            len,
                            remote_size: w.len().min(u32::MAX as u64) as u32,
                        });
                    }
                }
                How::Pieces {
                    locals: locals.to_vec(),
                    windows: windows.to_vec(),
                }
            }
        };
        Ok(Prepared {
            conn,
            kind,
            pieces: locals.len(),
            how,
        })
    }

    fn plan_ipc<'r>(
        &self,
        conn: ConnId,
        locals: &[(&'r MemoryRegion, usize, usize)],
        ipcs: &[&IpcBuf],
    ) -> Result<How<'r>> {
        let peer = self.inner.local_peer_of(conn);
        let mut regions: Vec<&'r MemoryRegion> = Vec::new();
        let mut region_gpu = Vec::new();
        let mut region_of: HashMap<*const crate::region::Region, u32> = HashMap::new();
        let mut remotes: Vec<IpcBuf> = Vec::new();
        let mut remote_of: HashMap<(u64, u64, [u8; 64]), u32> = HashMap::new();
        let mut pieces = Vec::with_capacity(locals.len());
        for (&(mr, off, len), w) in locals.iter().zip(ipcs) {
            // The checks of a post, once.
            let d = self.inner.ipc_desc(conn, peer, mr, off, len, w)?;
            let region = *region_of.entry(Arc::as_ptr(&mr.inner)).or_insert_with(|| {
                regions.push(mr);
                region_gpu.push(match mr.inner.mem {
                    MemKind::Device { ordinal, .. } => ordinal,
                    _ => -1,
                });
                regions.len() as u32 - 1
            });
            let key = (w.owner_id, w.alloc_base, w.handle);
            let remote = *remote_of.entry(key).or_insert_with(|| {
                remotes.push(IpcBuf {
                    offset: 0,
                    len: w.alloc_len,
                    ..**w
                });
                remotes.len() as u32 - 1
            });
            pieces.push(PlannedPiece {
                local: d.local.addr(),
                region,
                remote,
                remote_off: w.offset,
                len: len as u64,
            });
        }
        Ok(How::Ipc {
            plan: Arc::new(IpcPlan {
                remotes,
                region_gpu,
                bytes: pieces.iter().map(|p| p.len).sum(),
                pieces,
            }),
            regions,
        })
    }

    /// Posts a prepared op, with a notification sent once it ended well
    /// (`note`, as `transfer_notify_async`). A planned op checks nothing
    /// per piece and holds its local regions and the peer's mappings until
    /// its copies end.
    pub fn post(&self, p: &Prepared<'_>, note: Option<&[u8]>) -> Result<Transfer> {
        match &p.how {
            How::Ipc { plan, regions } => {
                let keep = regions
                    .iter()
                    .map(|r| r.slice(0, r.len()))
                    .collect::<Result<Vec<_>>>()?;
                let parts = IpcParts::Planned {
                    plan: plan.clone(),
                    keep,
                };
                self.inner
                    .submit_ipc(p.conn, p.kind, parts, note, crate::wire::NOTE_APP)
            }
            How::Pieces { locals, windows } => match (note, p.kind) {
                (Some(n), kind) => self.transfer_notify_async(p.conn, kind, locals, windows, n),
                (None, OpKind::Write) => self.writev_async(p.conn, locals, windows),
                (None, OpKind::Read) => self.readv_async(p.conn, locals, windows),
            },
        }
    }
}

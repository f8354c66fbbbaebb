//! A shard's GPU work: CUDA IPC copies started from its queue, issued in
//! batches once per drain, and finished by polling their events in the
//! loop; and the shard's cache of opened IPC handles.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::queue::{IpcCmd, IpcDesc, IpcParts};
use crate::error::{Error, OpKind, Result};
use crate::gpu::copy::{Copier, Entry};
use crate::gpu::ipc::{IpcCache, IpcCounters};

type Done = Vec<(u32, Result<()>)>;

pub(crate) struct GpuWork {
    /// One stream pool per device this shard has copied on.
    copiers: Vec<Copier>,
    cache: IpcCache,
    streams: usize,
}

impl GpuWork {
    pub fn new(counters: Arc<IpcCounters>, streams: usize) -> Self {
        Self {
            copiers: Vec::new(),
            cache: IpcCache::new(counters),
            streams,
        }
    }

    pub fn busy(&self) -> bool {
        self.copiers.iter().any(|c| c.busy())
    }

    fn copier(&mut self, ordinal: i32) -> Result<usize> {
        if let Some(i) = self.copiers.iter().position(|c| c.ordinal() == ordinal) {
            return Ok(i);
        }
        self.copiers.push(Copier::new(ordinal, self.streams)?);
        Ok(self.copiers.len() - 1)
    }

    /// Stages every piece of `cmd`; each piece reports to `done` once (now,
    /// if it could not start).
    pub fn start(&mut self, cmd: IpcCmd, done: &mut Done) {
        let slot = cmd.slot;
        let ci = match self.copier(cmd.ordinal) {
            Ok(i) => i,
            Err(e) => {
                for _ in 0..cmd.parts.len() {
                    done.push((slot, Err(e.duplicate())));
                }
                return;
            }
        };
        let kind = cmd.kind;
        match cmd.parts {
            IpcParts::One(d) => self.start_one(ci, kind, slot, d, done),
            IpcParts::Many(v) => {
                for d in v {
                    self.start_one(ci, kind, slot, d, done);
                }
            }
        }
    }

    fn start_one(&mut self, ci: usize, kind: OpKind, slot: u32, d: IpcDesc, done: &mut Done) {
        let (remote, key) = match self.acquire(ci, &d) {
            Ok(x) => x,
            Err(e) => return done.push((slot, Err(e))),
        };
        let local = d.local.addr() + d.local_off as u64;
        let (dst, src) = match kind {
            OpKind::Write => (remote, local),
            OpKind::Read => (local, remote),
        };
        let entry = Entry {
            slot,
            mapping: key,
            keep: Some(d.local),
        };
        if let Err((e, failed)) = self.copiers[ci].stage(entry, dst, src, d.len) {
            self.fail(e, failed, done);
        }
    }

    fn acquire(&mut self, ci: usize, d: &IpcDesc) -> Result<(u64, Option<(u64, u64)>)> {
        crate::gpu::cuda()?.make_current(self.copiers[ci].ordinal())?;
        self.cache.acquire(&d.remote)
    }

    fn fail(&mut self, e: Error, failed: Vec<Entry>, done: &mut Done) {
        for en in failed {
            if let Some(k) = en.mapping {
                self.cache.release(k);
            }
            done.push((en.slot, Err(e.duplicate())));
        }
    }

    /// Issues the copies staged since the last flush (once per drain).
    pub fn flush(&mut self, done: &mut Done) {
        for ci in 0..self.copiers.len() {
            if let Err((e, failed)) = self.copiers[ci].flush() {
                self.fail(e, failed, done);
            }
        }
    }

    /// Reports finished copies to `done`; returns how many finished.
    pub fn poll(&mut self, done: &mut Done) -> usize {
        let cache = &mut self.cache;
        self.copiers
            .iter_mut()
            .map(|c| {
                c.poll(|en, r| {
                    if let Some(k) = en.mapping {
                        cache.release(k);
                    }
                    done.push((en.slot, r));
                })
            })
            .sum()
    }

    /// Waits (up to `max`) for every copy in flight, reporting each.
    pub fn finish_all(&mut self, done: &mut Done, max: Duration) {
        self.flush(done);
        let deadline = Instant::now() + max;
        while self.busy() && Instant::now() < deadline {
            self.poll(done);
            std::thread::yield_now();
        }
    }

    pub fn revoke(&mut self, owner_id: u64, alloc_base: u64) {
        self.cache.revoke(owner_id, alloc_base);
    }

    pub fn revoke_owner(&mut self, owner_id: u64) {
        self.cache.revoke_owner(owner_id);
    }
}

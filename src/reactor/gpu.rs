//! A shard's GPU work: CUDA IPC copies started from its queue and finished
//! by polling their events in the loop, and the shard's cache of opened
//! IPC handles.

use std::sync::Arc;

use super::queue::{IpcCmd, IpcDesc, IpcParts};
use crate::error::{OpKind, Result};
use crate::gpu::copy::{Copier, CopyJob};
use crate::gpu::ipc::{IpcCache, IpcCounters};

pub(crate) struct GpuWork {
    /// One stream pool per device this shard has copied on.
    copiers: Vec<Copier>,
    cache: IpcCache,
    /// Copies in flight, with the index of their copier.
    jobs: Vec<(usize, CopyJob)>,
    streams: usize,
}

impl GpuWork {
    pub fn new(counters: Arc<IpcCounters>, streams: usize) -> Self {
        Self {
            copiers: Vec::new(),
            cache: IpcCache::new(counters),
            jobs: Vec::with_capacity(256),
            streams,
        }
    }

    pub fn busy(&self) -> bool {
        !self.jobs.is_empty()
    }

    fn copier(&mut self, ordinal: i32) -> Result<usize> {
        if let Some(i) = self.copiers.iter().position(|c| c.ordinal() == ordinal) {
            return Ok(i);
        }
        self.copiers.push(Copier::new(ordinal, self.streams)?);
        Ok(self.copiers.len() - 1)
    }

    /// Starts every piece of `cmd`; each piece reports to `done` once (now,
    /// if it could not start).
    pub fn start(&mut self, cmd: IpcCmd, done: &mut Vec<(u32, Result<()>)>) {
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
        let mut one = |d: IpcDesc| {
            if let Err(e) = self.start_one(ci, cmd.kind, slot, d) {
                done.push((slot, Err(e)));
            }
        };
        match cmd.parts {
            IpcParts::One(d) => one(d),
            IpcParts::Many(v) => v.into_iter().for_each(one),
        }
    }

    fn start_one(&mut self, ci: usize, kind: OpKind, slot: u32, d: IpcDesc) -> Result<()> {
        let copier = &mut self.copiers[ci];
        crate::gpu::cuda()?.make_current(copier.ordinal())?;
        let (remote, key) = self.cache.acquire(&d.remote)?;
        let local = d.local.addr() + d.local_off as u64;
        let (dst, src) = match kind {
            OpKind::Write => (remote, local),
            OpKind::Read => (local, remote),
        };
        match copier.start(slot, dst, src, d.len) {
            Ok(mut job) => {
                job.mapping = key;
                job.keep = Some(d.local);
                self.jobs.push((ci, job));
                Ok(())
            }
            Err(e) => {
                if let Some(k) = key {
                    self.cache.release(k);
                }
                Err(e)
            }
        }
    }

    /// Reports finished copies to `done`; returns how many finished.
    pub fn poll(&mut self, done: &mut Vec<(u32, Result<()>)>) -> usize {
        let mut n = 0;
        let mut i = 0;
        while i < self.jobs.len() {
            let (ci, job) = &mut self.jobs[i];
            let Some(r) = self.copiers[*ci].query(job) else {
                i += 1;
                continue;
            };
            let (ci, job) = self.jobs.swap_remove(i);
            done.push((job.slot, r));
            if let Some(k) = job.mapping {
                self.cache.release(k);
            }
            self.copiers[ci].finish(job);
            n += 1;
        }
        n
    }

    pub fn revoke(&mut self, owner_id: u64, alloc_base: u64) {
        self.cache.revoke(owner_id, alloc_base);
    }

    pub fn revoke_owner(&mut self, owner_id: u64) {
        self.cache.revoke_owner(owner_id);
    }
}

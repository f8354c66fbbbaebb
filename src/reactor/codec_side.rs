//! A shard's end of the codec pool: handing its streams' codec jobs over,
//! and taking their ends back (`TcpSide` routes them to the streams).

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;

use super::codec_pool::{self, CodecDone, CodecPool, LazyCodecPool, Reply};
use super::queue::WakeState;
use crate::codec::Codec;
use crate::error::{ConnId, Error, Result};
use crate::tcp::{PackShared, Stream};
use crate::xfer::CodecOutcome;

pub(crate) struct CodecSide {
    lazy: Arc<LazyCodecPool>,
    /// The pool, once a connection of this shard needed it.
    pool: Option<Arc<CodecPool>>,
    tx: Sender<CodecDone>,
    rx: Receiver<CodecDone>,
    wake: Arc<WakeState>,
    /// For the rare job the pool's full queue gives back: run here.
    inline: Option<Codec>,
}

impl CodecSide {
    pub fn new(lazy: Arc<LazyCodecPool>, wake: Arc<WakeState>) -> Self {
        let (tx, rx) = mpsc::channel();
        Self {
            lazy,
            pool: None,
            tx,
            rx,
            wake,
            inline: None,
        }
    }

    /// What a stream that packs shares with the others.
    pub fn shared(&self) -> PackShared {
        self.lazy.shared().clone()
    }

    /// Gives stream `s`'s queued jobs (of connection `conn` at slab index
    /// `idx`) to the pool (started by the first). One the full queue gives
    /// back, or every one when no codec thread could start, runs here, now:
    /// its end is read on the next pass like any other.
    pub fn hand_over(&mut self, idx: usize, conn: ConnId, s: &mut Stream) {
        if self.pool.is_none() {
            self.pool = self.lazy.get();
        }
        for job in s.take_codec_jobs() {
            let reply = Reply {
                idx,
                conn,
                to: self.tx.clone(),
                wake: self.wake.clone(),
            };
            let given = match &self.pool {
                Some(pool) => pool.try_submit(job, reply),
                None => Err(Box::new(job)),
            };
            if let Err(job) = given {
                let codec = match &mut self.inline {
                    Some(c) => c,
                    None => match Codec::new() {
                        Ok(c) => self.inline.insert(c),
                        Err(e) => {
                            tracing::error!("no zstd context for a codec job: {e}");
                            continue;
                        }
                    },
                };
                let job = *job;
                let outcome = codec_pool::run(codec, job.work);
                let _ = self.tx.send(CodecDone {
                    idx,
                    conn,
                    ticket: job.ticket,
                    outcome,
                });
            }
        }
    }

    pub fn next_done(&mut self) -> Option<CodecDone> {
        self.rx.try_recv().ok()
    }

    /// The end of a job whose connection is gone: a READ's op still
    /// completes (its connection's failure did not count it: it had left
    /// the stream's queue); the peer's frame stops counting as held when
    /// the ticket drops.
    pub fn orphan(&mut self, d: CodecDone, done: &mut Vec<(u32, Result<()>)>) {
        if let CodecOutcome::Decoded { result, .. } = d.outcome {
            if d.ticket.gate == 0 {
                let r = result.map_err(|cause| Error::ConnFailed {
                    conn: d.conn,
                    cause,
                });
                done.push((d.ticket.slot, r));
            }
        }
    }
}

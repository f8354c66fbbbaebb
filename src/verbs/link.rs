//! One connection's verbs side (feature `rdma`): its RC data queue pairs
//! (`DataQps`, queue pair `i` on NIC `i % n`, connected from the peer's
//! `VerbsInfo`: INIT → RTR → RTS, then both sides confirm in `exchange`)
//! and the `Link` the shard drives: striped WRs posted as linked lists (one
//! doorbell per post), completions from the shard's shared queues routed
//! here, never waited for. The NICs themselves are `device.rs`.

use super::device::{verbs_err, Nic, NicSet, SharedCq, INLINE_MAX};
use super::plan::{self, Piece, Post, WcOutcome};
use super::VerbsConfig;
use crate::error::{ConnFault, Error, Result};
use crate::region::RegionSlice;
use crate::wire::{NicKeys, VerbsInfo};
use sideway::ibverbs::address::AddressHandleAttribute;
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, SetInlineData,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;
use std::sync::Arc;

/// One peer's data queue pairs (`i` on NIC `i % cqs.len()`).
pub struct DataQps {
    qps: Vec<ExtendedQueuePair>,
    /// WRITEs up to this many bytes go inline (0: the NICs took none).
    inline_max: u32,
    /// The shard's shared completion queue on each NIC used.
    cqs: Vec<Arc<SharedCq>>,
    psns: Vec<u32>,
    // Reused plan buffers: posting allocates nothing once warm.
    pieces: Vec<Piece>,
    wrs: Vec<Piece>,
    signaled: Vec<bool>,
    posts: Vec<Post>,
}

/// One local slice and the remote window of a one-sided op, with the
/// keys of every NIC on both sides (a WR on queue pair `i` uses key
/// `i % n` of each).
pub struct Sge {
    pub lkeys: NicKeys,
    pub laddr: u64,
    pub rkeys: NicKeys,
    pub raddr: u64,
    /// The local memory is host memory (the CPU may read it: inline).
    pub host: bool,
}

/// sideway's `Drop` for queue pairs asserts that the destroy call
/// succeeded: a NIC that refuses one (a driver bug, a device gone) would
/// panic the shard that drops a connection's link. Each is dropped on its
/// own here, a refusal logged and its resources left to the process's
/// exit, and the shard goes on. (The shared completion queues live as long
/// as the endpoint's NICs.)
impl Drop for DataQps {
    fn drop(&mut self) {
        fn quietly<T>(what: &str, v: T) {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(v))).is_err() {
                tracing::error!(
                    "RDMA: destroying a {what} failed; it is left to the process's exit"
                );
            }
        }
        for qp in self.qps.drain(..) {
            quietly("queue pair", qp);
        }
    }
}

impl DataQps {
    /// INIT → RTR → RTS against the peer's queue pairs: ours `i` (on our
    /// NIC `i % ours`) to theirs `i` (on their NIC `i % theirs`).
    pub fn connect(&mut self, set: &NicSet, remote: &VerbsInfo, cfg: &VerbsConfig) -> Result<()> {
        if remote.qps.len() != self.qps.len() {
            return Err(verbs_err(
                "connecting queue pairs",
                format!(
                    "peer has {} data QPs, we have {}",
                    remote.qps.len(),
                    self.qps.len()
                ),
            ));
        }
        let used = self.cqs.len();
        for (i, qp) in self.qps.iter_mut().enumerate() {
            let nic = &set.nics[i % used];
            let peer = remote.nic_of(i);
            let grh = super::plan::address_plan(
                (nic.link_layer, nic.gid),
                (peer.link_layer, peer.gid, peer.lid),
            )
            .map_err(|e| verbs_err("connecting queue pairs", e))?;
            let mtu = Mtu::from(peer.mtu.min(nic.mtu) as u32);
            let (dest_rd, init_rd) = super::plan::read_depths(
                cfg.max_rd_atomic,
                nic.rd_atom.0,
                nic.rd_atom.1,
                remote.max_rd_atomic,
            );
            let (rqpn, rpsn) = remote.qps[i];
            let mut a = QueuePairAttribute::new();
            a.setup_state(QueuePairState::Init)
                .setup_pkey_index(0)
                .setup_port(nic.port)
                .setup_access_flags(
                    AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
                );
            qp.modify(&a).map_err(|e| verbs_err("QP to INIT", e))?;
            let mut ah = AddressHandleAttribute::new();
            ah.setup_port(nic.port)
                .setup_dest_lid(peer.lid)
                // Our own service level: the fabric's QoS is configured per
                // host, and a peer must not pick our lane.
                .setup_service_level(cfg.service_level);
            if grh {
                let gid = sideway::ibverbs::address::Gid { raw: peer.gid };
                // Our own traffic class (RoCE QoS: DSCP/ECN), flow label 0.
                ah.setup_grh(&gid, 0, nic.gid_index as u8, 64, cfg.traffic_class);
            }
            let mut a = QueuePairAttribute::new();
            a.setup_state(QueuePairState::ReadyToReceive)
                .setup_path_mtu(mtu)
                .setup_dest_qp_num(rqpn)
                .setup_rq_psn(rpsn)
                .setup_max_dest_read_atomic(dest_rd)
                .setup_min_rnr_timer(12)
                .setup_address_vector(&ah);
            qp.modify(&a).map_err(|e| verbs_err("QP to RTR", e))?;
            let mut a = QueuePairAttribute::new();
            a.setup_state(QueuePairState::ReadyToSend)
                .setup_sq_psn(self.psns[i])
                .setup_timeout(cfg.timeout)
                .setup_retry_cnt(cfg.retry_cnt)
                .setup_rnr_retry(7)
                .setup_max_read_atomic(init_rd);
            qp.modify(&a).map_err(|e| verbs_err("QP to RTS", e))?;
        }
        Ok(())
    }
}

/// The verbs side of one connection: its data QPs and what is in flight
/// on them. Lives in the shard that owns the connection.
pub(crate) struct Link {
    nic: Arc<NicSet>,
    /// NICs the peer's queue pairs are on.
    remote_nics: usize,
    qps: DataQps,
    cfg: VerbsConfig,
    chunk: u32,
    next_qp: usize,
    /// WRs posted and not yet retired, per QP (bounded by the QP depth).
    wr_out: Vec<u32>,
    /// Per op slot: completions still owed, and the first error seen. An op
    /// completes once (one `done` per slot) when its last one arrives.
    owed: plan::Owed,
    /// The parts of the op being built (reused).
    items: Vec<Sge>,
    /// Its index in its shard (`attach`), carried in every `wr_id` so that
    /// the shard routes completions of its shared queues here.
    id: u32,
    /// Set by the first error completion: the link is done.
    broken: Option<ConnFault>,
}

// SAFETY: the verbs objects are used by one shard at a time (they move with
// it); libibverbs handles are usable from any thread.
unsafe impl Send for Link {}

impl super::QpLink for Link {
    /// Can `n_pieces` more WRs go out without overrunning a send queue?
    fn has_room(&self, n_pieces: usize) -> bool {
        let per_qp = n_pieces.div_ceil(self.wr_out.len()) as u32 + 1;
        // The send queues, and the shared completion queues (at most one
        // completion per WR).
        self.wr_out.iter().all(|&o| o + per_qp <= self.cfg.qp_depth)
            && self.qps.cqs.iter().all(|c| {
                c.owed.load(std::sync::atomic::Ordering::Relaxed) as usize + n_pieces
                    <= c.cap as usize
            })
    }

    fn fits(&self, n_pieces: usize) -> bool {
        plan::fits_queues(n_pieces, self.wr_out.len(), self.cfg.qp_depth)
    }

    fn busy(&self) -> bool {
        !self.owed.is_empty()
    }

    /// WRs an op piece of `len` bytes becomes.
    fn pieces(&self, len: u64) -> usize {
        if len == 0 {
            1
        } else {
            len.div_ceil(self.chunk as u64) as usize
        }
    }

    /// The local registration's keys, registering `r` with the NICs on
    /// first use (the registration cache: one MR per NIC per registration,
    /// dropped with it).
    fn lkeys(&self, r: &crate::region::Region) -> Result<NicKeys> {
        super::keys_of(&self.nic, r).map(|(lkeys, _)| lkeys)
    }

    fn takes(&self, rkeys: &NicKeys) -> bool {
        rkeys.len() >= self.remote_nics
    }

    fn nic_events(&self) -> u64 {
        self.nic.poll_events()
    }

    fn broken(&self) -> Option<ConnFault> {
        let mut st = self
            .nic
            .events
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let used = self.qps.cqs.len();
        for k in 0..used {
            if st.down & (1 << k) != 0 {
                return Some(ConnFault::device(
                    "the RDMA port (async event)",
                    format_args!("the port of RDMA device {} is down", self.nic.nics[k].name),
                ));
            }
        }
        let mine: Vec<u32> = self.qps.qps.iter().map(|q| q.qp_number()).collect();
        if let Some(q) = mine.iter().find(|q| st.fatal_qps.contains(q)) {
            let why = ConnFault::device(
                "an RDMA queue pair (async event)",
                format_args!("the NIC moved queue pair {q} to the error state"),
            );
            for q in &mine {
                st.fatal_qps.remove(q);
            }
            return Some(why);
        }
        None
    }

    /// Adds one part of an op (`len` bytes between `laddr` under `lkeys`
    /// and the peer's `raddr` under `rkeys`) to the op being built; `post`
    /// sends them all.
    fn add(&mut self, lkeys: NicKeys, local: &RegionSlice, rkeys: NicKeys, raddr: u64) {
        let (laddr, len) = (local.addr(), local.len() as u64);
        let host = !local.region().mem.is_device();
        let n_qps = self.wr_out.len();
        let item = self.items.len() as u32;
        let first = self.next_qp;
        self.next_qp = (first + self.pieces(len)) % n_qps;
        self.qps
            .pieces
            .extend(plan::stripe_item(item, len, self.chunk, n_qps, first));
        self.items.push(Sge {
            lkeys,
            laddr,
            rkeys,
            raddr,
            host,
        });
    }

    /// Forgets the parts gathered so far (the op failed before posting).
    fn discard(&mut self) {
        self.qps.pieces.clear();
        self.items.clear();
    }

    /// Posts the parts `add` gathered as op `slot`: all its WRs for one QP
    /// go as linked lists of at most `max_wr_per_post` (one doorbell each),
    /// so a vectored op rings each QP's doorbell once, not once per part.
    /// Returns the completions it will produce.
    fn post(&mut self, write: bool, slot: u32) -> Result<u32> {
        plan::batch(
            &self.qps.pieces,
            self.cfg.max_wr_per_post,
            self.cfg.signal_every,
            &mut self.qps.wrs,
            &mut self.qps.signaled,
            &mut self.qps.posts,
        );
        self.qps.pieces.clear();
        let mut signaled = 0u32;
        let mut retires = plan::retires(&self.qps.posts, &self.qps.signaled);
        let mut result = Ok(());
        for p in &self.qps.posts {
            let mut g = self.qps.qps[p.qp].start_post_send();
            let mut in_post = 0u32;
            for k in p.start..p.start + p.count {
                let w = self.qps.wrs[k];
                let it = &self.items[w.item as usize];
                let n = retires.next().expect("one per WR");
                let id = plan::wr_id(slot, self.id, p.qp, n);
                let flags = if self.qps.signaled[k] {
                    in_post += 1;
                    WorkRequestFlags::Signaled
                } else {
                    WorkRequestFlags::none()
                };
                let h = g.construct_wr(id, flags);
                // Queue pair p is on our NIC p % ours and their NIC
                // p % theirs: each side's key of that NIC.
                let (lkey, rkey) = (it.lkeys.for_qp(p.qp), it.rkeys.for_qp(p.qp));
                if write && it.host && w.len > 0 && w.len <= self.qps.inline_max {
                    // Small host-memory WRITEs go inline: the NIC takes the
                    // bytes with the WR (no DMA read of our memory, no
                    // lkey), which is most of an 8-byte op's latency.
                    let mut buf = [0u8; INLINE_MAX as usize];
                    let n = w.len as usize;
                    // SAFETY: the range lies in a live host registration
                    // the op holds; n <= INLINE_MAX bytes are copied.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            (it.laddr + w.off) as *const u8,
                            buf.as_mut_ptr(),
                            n,
                        )
                    };
                    h.setup_write(rkey, it.raddr + w.off)
                        .setup_inline_data(&buf[..n]);
                } else {
                    let h = if write {
                        h.setup_write(rkey, it.raddr + w.off)
                    } else {
                        h.setup_read(rkey, it.raddr + w.off)
                    };
                    // SAFETY: the local range lies in a registration the op
                    // holds (its OpCmd) until its completions arrive.
                    unsafe { h.setup_sge(lkey, it.laddr + w.off, w.len) };
                }
            }
            if let Err(e) = g.post() {
                // Nothing of this list went out; earlier lists did, and
                // their completions still arrive.
                result = Err(verbs_err("ibv_wr_complete (post)", e));
                break;
            }
            signaled += in_post;
            self.wr_out[p.qp] += p.count as u32;
            self.qps.cqs[p.qp % self.qps.cqs.len()]
                .owed
                .fetch_add(in_post, std::sync::atomic::Ordering::Relaxed);
        }
        self.items.clear();
        if signaled > 0 {
            self.owed.entry(slot).or_insert((0, None)).0 += signaled;
        }
        result.map(|()| signaled)
    }

    /// Records a failure of op `slot` found while posting; the op completes
    /// with it (now, if nothing of it is in flight).
    fn fail_slot(&mut self, slot: u32, err: Error, done: &mut Vec<(u32, Result<()>)>) {
        match self.owed.get_mut(&slot) {
            Some((n, e)) if *n > 0 => {
                e.get_or_insert(err);
            }
            _ => {
                self.owed.remove(&slot);
                done.push((slot, Err(err)));
            }
        }
    }

    /// Reports completions to `done`. `Err` (with the reason) after any
    /// error completion: the QPs are in the error state and every later WR
    /// would be flushed; the caller fails the link (`fail_all`), which
    /// ends every op still owed once.
    fn poll(
        &mut self,
        _done: &mut Vec<(u32, Result<()>)>,
    ) -> std::result::Result<usize, ConnFault> {
        match &self.broken {
            Some(reason) => Err(reason.clone()),
            None => Ok(0),
        }
    }

    fn attach(&mut self, id: u32) {
        self.id = id;
    }

    fn shared_cqs(&self) -> Vec<Arc<dyn super::CqPoll>> {
        self.qps
            .cqs
            .iter()
            .map(|c| c.clone() as Arc<dyn super::CqPoll>)
            .collect()
    }

    /// One completion the shard routed here (its `wr_id` names this link).
    fn on_wc(
        &mut self,
        id: u64,
        outcome: WcOutcome,
        name: &'static str,
        done: &mut Vec<(u32, Result<()>)>,
    ) {
        let (slot, _, qp, retires) = plan::split_wr_id(id);
        if let Some(o) = self.wr_out.get_mut(qp) {
            *o = o.saturating_sub(retires);
        }
        let r = match outcome {
            WcOutcome::Ok => Ok(()),
            WcOutcome::RemoteRefused => Err(Error::Verbs {
                what: "RDMA operation",
                reason: format!(
                    "{name}: the target's NIC refused it (unknown key, outside the registration, or not permitted)"
                ),
            }),
            WcOutcome::ConnBroken => Err(Error::Verbs {
                what: "RDMA operation",
                reason: name.to_owned(),
            }),
        };
        // Any error completion leaves an RC queue pair in error: the
        // link is done, and its ops end through `fail_all`.
        if r.is_err() {
            self.broken
                .get_or_insert_with(|| ConnFault::device("an RDMA completion", name));
        }
        plan::settle(&mut self.owed, slot, r, done);
    }

    /// The link is going away: every completion still owed fails with `err`.
    fn fail_all(&mut self, err: &Error, done: &mut Vec<(u32, Result<()>)>) {
        plan::fail_owed(&mut self.owed, err, done);
    }
}

/// What a connection needs of the NICs: its queue pairs and their info.
impl NicSet {
    /// Creates `cfg.n_qps` RC queue pairs, queue pair `i` on NIC
    /// `i % used`, on the completion queues `shard` shares.
    pub fn data_qps(&self, cfg: &VerbsConfig, shard: usize) -> Result<DataQps> {
        let depth = cfg.qp_depth;
        let used = self.used(cfg.n_qps);
        let cqs = (0..used)
            .map(|k| self.shared_cq(shard, k))
            .collect::<Result<Vec<_>>>()?;
        let mut qps = Vec::with_capacity(cfg.n_qps);
        // Inline data if every NIC takes it; a NIC that refuses the QP
        // with it gets all of them again without.
        let mut inline_max = INLINE_MAX;
        'attempt: loop {
            qps.clear();
            for i in 0..cfg.n_qps {
                let (nic, cq) = (&self.nics[i % used], &cqs[i % used].cq);
                let qp = nic
                    .pd
                    .create_qp_builder()
                    .setup_max_send_wr(depth)
                    .setup_max_recv_wr(1)
                    .setup_max_send_sge(1)
                    .setup_max_inline_data(inline_max)
                    .setup_send_cq(cq.clone())
                    .setup_recv_cq(cq.clone())
                    .build_ex();
                match qp {
                    Ok(qp) => qps.push(qp),
                    Err(_) if inline_max > 0 => {
                        inline_max = 0;
                        continue 'attempt;
                    }
                    Err(e) => return Err(verbs_err("ibv_create_qp_ex", e)),
                }
            }
            break;
        }
        let psns = qps
            .iter()
            .map(|_| crate::sys::random_u32() & 0xff_ffff)
            .collect();
        Ok(DataQps {
            qps,
            inline_max,
            cqs,
            psns,
            pieces: Vec::new(),
            wrs: Vec::new(),
            signaled: Vec::new(),
            posts: Vec::new(),
        })
    }

    /// What the peer needs to connect to `qps`.
    pub fn info(&self, qps: &DataQps, cfg: &VerbsConfig) -> VerbsInfo {
        let used = &self.nics[..qps.cqs.len()];
        VerbsInfo {
            nics: used.iter().map(Nic::addr).collect(),
            sl: cfg.service_level,
            traffic_class: cfg.traffic_class,
            // What we accept: the peer sends at most this many READs
            // (the least any of our NICs takes).
            max_rd_atomic: used
                .iter()
                .map(|n| {
                    super::plan::read_depths(cfg.max_rd_atomic, n.rd_atom.0, n.rd_atom.1, u8::MAX).0
                })
                .min()
                .unwrap_or(1),
            qps: qps
                .qps
                .iter()
                .zip(&qps.psns)
                .map(|(q, &psn)| (q.qp_number(), psn))
                .collect(),
        }
    }
}

/// Sets up this connection's verbs link over its first control stream:
/// both sides send their QP info (or a refusal), then read the other's,
/// then connect (INIT → RTR → RTS), then say whether that worked
/// (`VerbsReady`) and read the other's answer. Verbs is used only when both
/// are ready: neither side posts before the other is at RTR, and a side
/// whose setup failed never leaves the other on verbs. Any failure leaves
/// the connection on tcp (`None`) on both sides.
pub(crate) fn exchange(
    nic: &Arc<NicSet>,
    cfg: &VerbsConfig,
    chunk: u32,
    shard: usize,
    send: impl Fn(&crate::wire::ControlFrame) -> Result<()>,
    recv: impl Fn() -> Result<crate::wire::ControlFrame>,
) -> Result<Option<Link>> {
    use crate::wire::ControlFrame;
    let mine = nic.data_qps(cfg, shard);
    let frame = match &mine {
        Ok(q) => ControlFrame::Verbs(Some(nic.info(q, cfg))),
        Err(e) => {
            tracing::warn!("RDMA queue pairs could not be created, using tcp: {e}");
            ControlFrame::Verbs(None)
        }
    };
    send(&frame)?;
    let theirs = match recv()? {
        ControlFrame::Verbs(Some(v)) => v,
        ControlFrame::Verbs(None) => return Ok(None),
        other => {
            return Err(verbs_err(
                "the verbs exchange",
                format!("expected the peer's QP info, got {other:?}"),
            ))
        }
    };
    // We sent a refusal: both know verbs is off, no more frames.
    let Ok(mut qps) = mine else { return Ok(None) };
    // Both sent their info, so both wait for each other's answer.
    let connected = qps.connect(nic, &theirs, cfg).map(|()| qps);
    if let Err(e) = &connected {
        tracing::warn!("RDMA queue pairs did not connect, using tcp: {e}");
    }
    send(&ControlFrame::VerbsReady(connected.is_ok()))?;
    let peer_ready = match recv()? {
        ControlFrame::VerbsReady(r) => r,
        other => {
            return Err(verbs_err(
                "the verbs exchange",
                format!("expected the peer's ready answer, got {other:?}"),
            ))
        }
    };
    let Ok(qps) = connected else { return Ok(None) };
    if !peer_ready {
        tracing::warn!("the peer's RDMA queue pairs did not connect; using tcp");
        return Ok(None);
    }
    let n = qps.qps.len();
    Ok(Some(Link {
        nic: nic.clone(),
        remote_nics: theirs.nics.len(),
        qps,
        cfg: cfg.clone(),
        chunk,
        next_qp: 0,
        wr_out: vec![0; n],
        owed: Default::default(),
        items: Vec::new(),
        id: 0,
        broken: None,
    }))
}

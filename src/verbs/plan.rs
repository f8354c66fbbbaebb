//! How a one-sided operation becomes work requests: chunks of at most
//! `chunk` bytes, striped round-robin over the data queue pairs, and
//! grouped per queue pair into linked lists posted with one doorbell, with
//! selective signalling (only some WRs ask for a completion, so the send
//! queue is drained without a CQE per WR). Pure arithmetic: tested without
//! a NIC; the verbs layer only turns the plan into `ibv_wr_*` calls.

/// One work request: bytes `[off, off + len)` of part `item` of the
/// operation (a vectored op has several parts), on queue pair `qp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub qp: usize,
    pub item: u32,
    pub off: u64,
    pub len: u32,
}

/// Splits `len` bytes into chunks of at most `chunk` bytes, dealt to queue
/// pairs `first_qp, first_qp + 1, …` (mod `n_qps`). A zero-length op is one
/// zero-length piece (RDMA allows it, and the op must still complete).
pub fn stripe(len: u64, chunk: u32, n_qps: usize, first_qp: usize) -> impl Iterator<Item = Piece> {
    stripe_item(0, len, chunk, n_qps, first_qp)
}

/// `stripe` for part `item` of a vectored op.
pub fn stripe_item(
    item: u32,
    len: u64,
    chunk: u32,
    n_qps: usize,
    first_qp: usize,
) -> impl Iterator<Item = Piece> {
    let chunk = chunk.max(1) as u64;
    let n_qps = n_qps.max(1);
    let count = if len == 0 { 1 } else { len.div_ceil(chunk) };
    (0..count).map(move |i| {
        let off = i * chunk;
        Piece {
            qp: (first_qp + i as usize) % n_qps,
            item,
            off,
            len: (len - off).min(chunk) as u32,
        }
    })
}

/// One doorbell: `count` consecutive WRs of `wrs` (after grouping) on queue
/// pair `qp`, posted as one linked list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Post {
    pub qp: usize,
    pub start: usize,
    pub count: usize,
}

/// Orders `pieces` by queue pair (stable, so each QP keeps the op's order)
/// into `wrs`, marks which WRs are signalled, and cuts each QP's list into
/// posts of at most `max_per_post` WRs. The last WR of every post is
/// signalled (its completion retires the post), and so is every
/// `signal_every`-th WR within one (so a long post still frees send-queue
/// slots as it goes). Output vectors are cleared and reused: steady state
/// allocates nothing.
pub fn batch(
    pieces: &[Piece],
    max_per_post: usize,
    signal_every: usize,
    wrs: &mut Vec<Piece>,
    signaled: &mut Vec<bool>,
    posts: &mut Vec<Post>,
) {
    let max_per_post = max_per_post.max(1);
    let signal_every = signal_every.max(1);
    wrs.clear();
    signaled.clear();
    posts.clear();
    wrs.extend_from_slice(pieces);
    wrs.sort_by_key(|p| p.qp);
    let mut i = 0;
    while i < wrs.len() {
        let qp = wrs[i].qp;
        let end = i + wrs[i..].iter().take_while(|p| p.qp == qp).count();
        let mut start = i;
        while start < end {
            let count = (end - start).min(max_per_post);
            posts.push(Post { qp, start, count });
            for k in 0..count {
                signaled.push(k + 1 == count || (k + 1) % signal_every == 0);
            }
            start += count;
        }
        i = end;
    }
}

/// A WR's `wr_id`: op slot (20 bits: the ledger holds at most 2^20 ops)
/// | link (20 bits: the connection's index in its shard, which routes a
/// completion of the shard's shared completion queue to its link) | queue
/// pair (8 bits) | how many WRs of that QP its completion retires (16 bits;
/// 0 for unsignalled WRs; a QP holds at most 32768).
pub fn wr_id(slot: u32, link: u32, qp: usize, retires: u32) -> u64 {
    debug_assert!(slot < 1 << 20 && link < 1 << 20 && qp < 256 && retires < 1 << 16);
    ((slot as u64 & 0xf_ffff) << 44)
        | ((link as u64 & 0xf_ffff) << 24)
        | ((qp as u64 & 0xff) << 16)
        | (retires as u64 & 0xffff)
}

/// The fields `wr_id` packed: (slot, link, qp, retires).
pub fn split_wr_id(id: u64) -> (u32, u32, usize, u32) {
    (
        (id >> 44) as u32,
        ((id >> 24) & 0xf_ffff) as u32,
        ((id >> 16) & 0xff) as usize,
        (id & 0xffff) as u32,
    )
}

/// Links (connections) one shard can address in a `wr_id`.
pub const MAX_LINKS: usize = 1 << 20;

/// For each WR of `posts`, how many WRs its completion retires: a
/// signalled WR retires itself and the unsignalled ones before it in its
/// post (0 for unsignalled WRs). Their sum is the number of WRs.
pub fn retires<'a>(posts: &'a [Post], signaled: &'a [bool]) -> impl Iterator<Item = u32> + 'a {
    posts.iter().flat_map(move |p| {
        let mut since = 0u32;
        (p.start..p.start + p.count).map(move |k| {
            since += 1;
            if signaled[k] {
                std::mem::replace(&mut since, 0)
            } else {
                0
            }
        })
    })
}

/// The name of an `ibv_wc_status` (for errors and logs).
pub fn wc_status_name(status: u32) -> &'static str {
    const NAMES: [&str; 23] = [
        "IBV_WC_SUCCESS",
        "IBV_WC_LOC_LEN_ERR",
        "IBV_WC_LOC_QP_OP_ERR",
        "IBV_WC_LOC_EEC_OP_ERR",
        "IBV_WC_LOC_PROT_ERR",
        "IBV_WC_WR_FLUSH_ERR",
        "IBV_WC_MW_BIND_ERR",
        "IBV_WC_BAD_RESP_ERR",
        "IBV_WC_LOC_ACCESS_ERR",
        "IBV_WC_REM_INV_REQ_ERR",
        "IBV_WC_REM_ACCESS_ERR",
        "IBV_WC_REM_OP_ERR",
        "IBV_WC_RETRY_EXC_ERR",
        "IBV_WC_RNR_RETRY_EXC_ERR",
        "IBV_WC_LOC_RDD_VIOL_ERR",
        "IBV_WC_REM_INV_RD_REQ_ERR",
        "IBV_WC_REM_ABORT_ERR",
        "IBV_WC_INV_EECN_ERR",
        "IBV_WC_INV_EEC_STATE_ERR",
        "IBV_WC_FATAL_ERR",
        "IBV_WC_RESP_TIMEOUT_ERR",
        "IBV_WC_GENERAL_ERR",
        "IBV_WC_TM_ERR",
    ];
    NAMES
        .get(status as usize)
        .copied()
        .unwrap_or("IBV_WC_(unknown)")
}

/// What a failed completion means for the operation: the target's NIC
/// refused the access (bad key, out of bounds or no permission: verbs does
/// not tell them apart), or the connection is broken (everything else: a
/// flushed or timed-out QP does not recover).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcOutcome {
    Ok,
    RemoteRefused,
    ConnBroken,
}

pub fn wc_outcome(status: u32) -> WcOutcome {
    match status {
        0 => WcOutcome::Ok,
        // REM_INV_REQ, REM_ACCESS, REM_INV_RD_REQ
        9 | 10 | 15 => WcOutcome::RemoteRefused,
        _ => WcOutcome::ConnBroken,
    }
}

/// How to address a peer's queue pairs: whether the address vector needs
/// a GRH, or why the two ports cannot talk at all. RoCE (Ethernet) always
/// routes by GID; InfiniBand routes by LID inside a subnet and needs a GRH
/// only to cross subnets (the GIDs' 64-bit prefixes differ). Ports of
/// different link layers, or an InfiniBand peer without a LID, cannot
/// connect.
pub fn address_plan(
    ours: (u8, [u8; 16]),
    theirs: (u8, [u8; 16], u16),
) -> Result<bool, Unreachable> {
    use crate::wire::{LINK_ETHERNET, LINK_INFINIBAND};
    let ((our_ll, our_gid), (ll, gid, lid)) = (ours, theirs);
    if our_ll != ll {
        return Err(Unreachable::LinkLayers {
            ours: link_name(our_ll),
            theirs: link_name(ll),
        });
    }
    match ll {
        LINK_ETHERNET if gid == [0u8; 16] => Err(Unreachable::NoGid),
        LINK_ETHERNET => Ok(true),
        LINK_INFINIBAND if lid == 0 => Err(Unreachable::NoLid),
        LINK_INFINIBAND => Ok(gid != [0u8; 16] && gid[..8] != our_gid[..8]),
        other => Err(Unreachable::UnknownLinkLayer(other)),
    }
}

/// Why two NIC ports cannot reach each other (`address_plan`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unreachable {
    /// One is Ethernet (RoCE), the other InfiniBand.
    #[error("link layers differ (ours {ours}, the peer's {theirs})")]
    LinkLayers {
        /// Ours.
        ours: &'static str,
        /// The peer's.
        theirs: &'static str,
    },
    /// A RoCE port is addressed by GID, and the peer's has none.
    #[error("the peer's RoCE port has no GID")]
    NoGid,
    /// An InfiniBand port is addressed by LID, and the peer's has none.
    #[error("the peer's InfiniBand port has no LID")]
    NoLid,
    /// A link layer we do not know.
    #[error("unknown link layer {0}")]
    UnknownLinkLayer(u8),
}

fn link_name(ll: u8) -> &'static str {
    match ll {
        crate::wire::LINK_ETHERNET => "Ethernet",
        crate::wire::LINK_INFINIBAND => "InfiniBand",
        _ => "unknown",
    }
}

/// The dma-buf span of GPU memory for `cuMemGetHandleForAddressRange`,
/// which wants a start and size aligned to the host page: the allocation
/// `[alloc_base, alloc_base + alloc_len)` widened to pages. Returns
/// (aligned base, aligned length, the region's offset in it) for a region
/// starting at `addr`; the MR then starts at that offset of the dma-buf.
pub fn dmabuf_span(alloc_base: u64, alloc_len: u64, addr: u64, page: u64) -> (u64, u64, u64) {
    let page = page.max(1);
    let base = alloc_base - alloc_base % page;
    let end = (alloc_base + alloc_len).div_ceil(page) * page;
    (base, end - base, addr - base)
}

/// Per op slot: signalled completions still owed, and the first error.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))] // used by device.rs
pub(crate) type Owed = crate::sys::IntMap<u32, (u32, Option<crate::error::Error>)>;

/// Applies one work completion to the op it names. A success pays one
/// owed completion, and the op ends with the last (with its first error,
/// if any). An error completion — signalled or not: mlx5 reports the
/// faulting work request's id either way, and flushes every one after it —
/// only records the error: an RC queue pair is in error after any error
/// completion, so the caller fails the link and every op still owed ends
/// once, with its first error (`fail_owed`). A completion for an op no
/// longer owed (a late flush) changes nothing.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))] // used by device.rs
pub(crate) fn settle(
    owed: &mut Owed,
    slot: u32,
    result: crate::error::Result<()>,
    done: &mut Vec<(u32, crate::error::Result<()>)>,
) {
    let Some((left, first)) = owed.get_mut(&slot) else {
        return;
    };
    match result {
        Ok(()) => {
            *left = left.saturating_sub(1);
            if *left == 0 {
                let (_, err) = owed.remove(&slot).expect("present");
                done.push((slot, err.map_or(Ok(()), Err)));
            }
        }
        Err(e) => {
            first.get_or_insert(e);
        }
    }
}

/// The link is gone: every op still owed ends once, with its first error
/// or `err`.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))] // used by device.rs
pub(crate) fn fail_owed(
    owed: &mut Owed,
    err: &crate::error::Error,
    done: &mut Vec<(u32, crate::error::Result<()>)>,
) {
    for (slot, (_, first)) in owed.drain() {
        done.push((slot, Err(first.unwrap_or_else(|| err.duplicate()))));
    }
}

/// Whether an op of `n_pieces` work requests, striped over `n_qps` send
/// queues of `depth` entries, fits them at all (when they are empty): a
/// queue takes its share plus one more entry. One that never fits goes
/// over the connection's tcp streams instead of waiting forever.
pub fn fits_queues(n_pieces: usize, n_qps: usize, depth: u32) -> bool {
    n_qps > 0 && (n_pieces.div_ceil(n_qps) as u64 + 1) <= depth as u64
}

/// The READ depths of a queue pair: how many incoming READs it accepts
/// (RTR `max_dest_rd_atomic`: ours, within the device's
/// `max_qp_rd_atom`) and how many it keeps outstanding (RTS
/// `max_rd_atomic`: ours, within the device's `max_qp_init_rd_atom` and
/// what the peer said it accepts). A value over a device cap fails the
/// transition; one over the peer's accepted depth makes the peer's NIC
/// refuse READs (REM_INV_REQ). At least 1 each.
pub fn read_depths(ours: u8, dev_rd_atom: i32, dev_init_rd_atom: i32, peer_dest: u8) -> (u8, u8) {
    let cap = |v: i32| u8::try_from(v.max(1)).unwrap_or(u8::MAX);
    let dest = ours.min(cap(dev_rd_atom)).max(1);
    let init = ours.min(cap(dev_init_rd_atom)).min(peer_dest).max(1);
    (dest, init)
}

/// What a NIC registration of a region allows, from the region's own
/// access rights: local write always (the NIC writes READ results into
/// local memory), remote write and remote read only where the
/// registration grants them, so the NIC refuses what ferry's own checks
/// refuse on tcp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrAccess {
    pub local_write: bool,
    pub remote_write: bool,
    pub remote_read: bool,
}

pub fn mr_access(a: crate::region::Access) -> MrAccess {
    use crate::region::Access;
    MrAccess {
        local_write: true,
        remote_write: a.contains(Access::REMOTE_WRITE),
        remote_read: a.contains(Access::REMOTE_READ),
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn grh_only_where_routing_needs_it_and_mismatched_ports_are_refused() {
        use crate::wire::{LINK_ETHERNET, LINK_INFINIBAND};
        let sub_a = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8];
        let mut sub_b = sub_a;
        sub_b[7] = 9;
        // RoCE: always a GRH.
        assert_eq!(
            address_plan((LINK_ETHERNET, sub_a), (LINK_ETHERNET, sub_a, 0)),
            Ok(true)
        );
        // InfiniBand, one subnet: LID routing, no GRH; across subnets: GRH.
        assert_eq!(
            address_plan((LINK_INFINIBAND, sub_a), (LINK_INFINIBAND, sub_a, 7)),
            Ok(false)
        );
        assert_eq!(
            address_plan((LINK_INFINIBAND, sub_a), (LINK_INFINIBAND, sub_b, 7)),
            Ok(true)
        );
        assert!(
            address_plan((LINK_INFINIBAND, sub_a), (LINK_INFINIBAND, sub_a, 0))
                .unwrap_err()
                .to_string()
                .contains("no LID")
        );
        assert!(
            address_plan((LINK_ETHERNET, sub_a), (LINK_INFINIBAND, sub_a, 7))
                .unwrap_err()
                .to_string()
                .contains("link layers differ")
        );
        assert!(address_plan((LINK_ETHERNET, sub_a), (LINK_ETHERNET, [0; 16], 0)).is_err());
    }

    #[test]
    fn dmabuf_spans_are_page_aligned_and_keep_the_regions_offset() {
        // cudaMalloc'd: already aligned.
        assert_eq!(
            dmabuf_span(0x7f00_0020_0000, 1 << 20, 0x7f00_0020_1000, 4096),
            (0x7f00_0020_0000, 1 << 20, 0x1000)
        );
        // An allocation that starts and ends inside pages (a sub-allocation
        // reported by the driver): widened both ways, offset measured from
        // the aligned start.
        assert_eq!(
            dmabuf_span(0x1000_0100, 0x2000, 0x1000_0180, 4096),
            (0x1000_0000, 0x3000, 0x180)
        );
        assert_eq!(dmabuf_span(0x10000, 1, 0x10000, 65536), (0x10000, 65536, 0));
    }

    #[test]
    fn error_completions_end_ops_once_through_the_failed_link() {
        use crate::error::Error;
        let e = |r: &str| Error::Verbs {
            what: "RDMA operation",
            reason: r.to_owned(),
        };
        let mut owed = Owed::default();
        let mut done = Vec::new();
        owed.insert(1, (2, None));
        owed.insert(2, (1, None));
        // Op 1: one success, then an (unsignalled) error completion: not
        // ended early, and the error is its own.
        settle(&mut owed, 1, Ok(()), &mut done);
        settle(&mut owed, 1, Err(e("IBV_WC_REM_ACCESS_ERR")), &mut done);
        assert!(done.is_empty());
        // Op 2 sees only flushes.
        settle(&mut owed, 2, Err(e("IBV_WC_WR_FLUSH_ERR")), &mut done);
        settle(&mut owed, 2, Err(e("IBV_WC_WR_FLUSH_ERR")), &mut done);
        assert!(done.is_empty());
        fail_owed(&mut owed, &e("link failed"), &mut done);
        done.sort_by_key(|d| d.0);
        assert_eq!(done.len(), 2, "each op ends exactly once");
        let msg = |i: usize| done[i].1.as_ref().unwrap_err().to_string();
        assert!(msg(0).contains("REM_ACCESS"), "{}", msg(0));
        assert!(msg(1).contains("FLUSH"), "{}", msg(1));
        // A late flush for an op already ended changes nothing.
        settle(&mut owed, 1, Err(e("IBV_WC_WR_FLUSH_ERR")), &mut done);
        assert_eq!(done.len(), 2);
        // Successes alone end an op when the last owed one arrives.
        owed.insert(3, (2, None));
        settle(&mut owed, 3, Ok(()), &mut done);
        assert_eq!(done.len(), 2);
        settle(&mut owed, 3, Ok(()), &mut done);
        assert!(matches!(done[2], (3, Ok(()))));
    }

    #[test]
    fn an_op_that_can_never_fit_the_send_queues_is_told_apart() {
        // 4 QPs of 1024: 4 x 1023 pieces fit, one more does not.
        assert!(fits_queues(4 * 1023, 4, 1024));
        assert!(!fits_queues(4 * 1023 + 1, 4, 1024));
        assert!(fits_queues(1, 1, 2));
        assert!(!fits_queues(1, 1, 1));
        assert!(!fits_queues(1, 0, 1024));
    }

    #[test]
    fn read_depths_stay_within_device_caps_and_the_peers_acceptance() {
        // ConnectX-6: max_qp_rd_atom 16, max_qp_init_rd_atom 16.
        assert_eq!(read_depths(16, 16, 16, 16), (16, 16));
        assert_eq!(read_depths(32, 16, 16, 32), (16, 16));
        // A peer that accepts fewer READs than we would send.
        assert_eq!(read_depths(16, 16, 16, 4), (16, 4));
        // A device that reports less (or nonsense) than asked.
        assert_eq!(read_depths(16, 8, 4, 16), (8, 4));
        assert_eq!(read_depths(16, 0, -1, 0), (1, 1));
        assert_eq!(read_depths(16, 1 << 20, 1 << 20, 255), (16, 16));
    }

    #[test]
    fn nic_registrations_grant_only_the_regions_rights() {
        use crate::region::Access;
        let ro = mr_access(Access::REMOTE_READ);
        assert!(ro.local_write && ro.remote_read && !ro.remote_write);
        let wo = mr_access(Access::REMOTE_WRITE);
        assert!(wo.remote_write && !wo.remote_read);
        let none = mr_access(Access::empty());
        assert!(none.local_write && !none.remote_write && !none.remote_read);
        assert_eq!(
            mr_access(Access::all()),
            MrAccess {
                local_write: true,
                remote_write: true,
                remote_read: true
            }
        );
    }

    use super::*;

    #[test]
    fn stripes_cover_the_op_exactly_and_rotate_over_qps() {
        let p: Vec<Piece> = stripe(10 << 20, 4 << 20, 3, 2).collect();
        assert_eq!(
            p,
            [
                Piece {
                    qp: 2,
                    item: 0,
                    off: 0,
                    len: 4 << 20
                },
                Piece {
                    qp: 0,
                    item: 0,
                    off: 4 << 20,
                    len: 4 << 20
                },
                Piece {
                    qp: 1,
                    item: 0,
                    off: 8 << 20,
                    len: 2 << 20
                },
            ]
        );
        assert_eq!(
            stripe(0, 4096, 4, 1).collect::<Vec<_>>(),
            [Piece {
                qp: 1,
                item: 0,
                off: 0,
                len: 0
            }]
        );
        // Property: contiguous, complete, each at most a chunk, QPs rotate.
        let mut seed = 0x9e37_79b9u64;
        for _ in 0..2000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let len = seed % (64 << 20);
            let chunk = (seed >> 40) as u32 % (8 << 20) + 1;
            let n = (seed >> 20) as usize % 8 + 1;
            let first = (seed >> 10) as usize % n;
            let v: Vec<Piece> = stripe(len, chunk, n, first).collect();
            let mut at = 0u64;
            for (i, p) in v.iter().enumerate() {
                assert_eq!(p.off, at);
                assert!(p.len <= chunk);
                assert_eq!(p.qp, (first + i) % n);
                at += p.len as u64;
            }
            assert_eq!(at, len);
        }
    }

    #[test]
    fn batches_group_per_qp_keep_order_and_signal_the_last() {
        let pieces: Vec<Piece> = stripe(10 * 4096, 4096, 2, 0).collect();
        let (mut wrs, mut sig, mut posts) = (vec![], vec![], vec![]);
        batch(&pieces, 3, 2, &mut wrs, &mut sig, &mut posts);
        // QP 0 gets pieces 0,2,4,6,8 in order; QP 1 gets 1,3,5,7,9.
        let offs: Vec<u64> = wrs.iter().map(|p| p.off / 4096).collect();
        assert_eq!(offs, [0, 2, 4, 6, 8, 1, 3, 5, 7, 9]);
        assert_eq!(
            posts,
            [
                Post {
                    qp: 0,
                    start: 0,
                    count: 3
                },
                Post {
                    qp: 0,
                    start: 3,
                    count: 2
                },
                Post {
                    qp: 1,
                    start: 5,
                    count: 3
                },
                Post {
                    qp: 1,
                    start: 8,
                    count: 2
                },
            ]
        );
        // Every 2nd and the last of each post.
        assert_eq!(
            sig,
            [false, true, true, false, true, false, true, true, false, true]
        );
        // Each post ends signalled, whatever the sizes.
        for max in 1..6 {
            for every in 1..6 {
                batch(&pieces, max, every, &mut wrs, &mut sig, &mut posts);
                assert_eq!(posts.iter().map(|p| p.count).sum::<usize>(), pieces.len());
                for p in &posts {
                    assert!(p.count <= max);
                    assert!(sig[p.start + p.count - 1]);
                    assert!(wrs[p.start..p.start + p.count].iter().all(|w| w.qp == p.qp));
                }
            }
        }
    }

    #[test]
    fn a_vectored_op_rings_one_doorbell_per_qp() {
        // writev of 8 parts of 4 KiB over 4 QPs, dealt on from QP 0: every
        // part's WR joins its QP's one list (a doorbell per QP, not per part).
        let mut pieces = Vec::new();
        let mut next = 0;
        for item in 0..8u32 {
            pieces.extend(stripe_item(item, 4096, 1 << 20, 4, next));
            next = (next + 1) % 4;
        }
        let (mut wrs, mut sig, mut posts) = (vec![], vec![], vec![]);
        batch(&pieces, 32, 16, &mut wrs, &mut sig, &mut posts);
        assert_eq!(posts.len(), 4);
        for (q, p) in posts.iter().enumerate() {
            assert_eq!((p.qp, p.count), (q, 2));
            let items: Vec<u32> = wrs[p.start..p.start + 2].iter().map(|w| w.item).collect();
            assert_eq!(
                items,
                [q as u32, q as u32 + 4],
                "parts keep their order on a QP"
            );
        }
        assert_eq!(
            sig.iter().filter(|&&s| s).count(),
            4,
            "one completion per QP"
        );
    }

    #[test]
    fn wr_ids_pack_and_retire_counts_add_up() {
        for (slot, link, qp, r) in [
            (0, 0, 0, 0),
            ((1 << 20) - 1, (1 << 20) - 1, 255, (1 << 16) - 1),
            (77, 5, 3, 16),
        ] {
            assert_eq!(split_wr_id(wr_id(slot, link, qp, r)), (slot, link, qp, r));
        }
        let pieces: Vec<Piece> = stripe(37 * 4096, 4096, 4, 1).collect();
        let (mut wrs, mut sig, mut posts) = (vec![], vec![], vec![]);
        for (max, every) in [(32, 16), (5, 2), (1, 1), (8, 3)] {
            batch(&pieces, max, every, &mut wrs, &mut sig, &mut posts);
            let r: Vec<u32> = retires(&posts, &sig).collect();
            assert_eq!(r.len(), wrs.len());
            assert_eq!(
                r.iter().sum::<u32>() as usize,
                pieces.len(),
                "every WR is retired once"
            );
            for (k, &n) in r.iter().enumerate() {
                assert_eq!(n > 0, sig[k]);
            }
        }
    }

    #[test]
    fn completion_statuses_map_to_outcomes() {
        assert_eq!(wc_outcome(0), WcOutcome::Ok);
        assert_eq!(wc_outcome(10), WcOutcome::RemoteRefused);
        assert_eq!(wc_outcome(12), WcOutcome::ConnBroken);
        assert_eq!(wc_outcome(5), WcOutcome::ConnBroken);
        assert_eq!(wc_status_name(12), "IBV_WC_RETRY_EXC_ERR");
        assert_eq!(wc_status_name(999), "IBV_WC_(unknown)");
    }
}

//! `VerbsInfo`: what two endpoints exchange over the control path to
//! connect their RC queue pairs (the seed exchanges the same in its OOB
//! handshake): service level, traffic class, outstanding-READ depth, the
//! address of each NIC the connection uses (GID, LID, port, MTU, link
//! layer), and one (QPN, PSN) per data queue pair. Queue pair `i` lives on
//! NIC `i % n_nics` (on each side, by its own table).
//!
//! ```text
//! 0  magic "FVRB" u32 | 4 version u16 (2) | 6 n_qps u16 (1..=64)
//! 8  n_nics u8 (1..=4, <= n_qps) | 9 sl u8 (< 16) | 10 traffic class u8
//! 11 max_rd_atomic u8
//! 12 + 21 k: gid [u8; 16] | lid u16 | port u8 (>= 1) | mtu u8 (1..=5: 256..4096)
//!            | link layer u8 (1 InfiniBand, 2 Ethernet/RoCE)
//! then 8 i:  qpn u32 (< 2^24) | psn u32 (< 2^24)
//! ```

use super::cursor::{DecodeError, Reader};

pub const VERBS_MAGIC: u32 = u32::from_le_bytes(*b"FVRB");
pub const VERBS_VERSION: u16 = 2;
pub const MAX_DATA_QPS: usize = 64;
/// NICs one endpoint stripes a connection's queue pairs over.
pub const MAX_NICS: usize = 4;
const NIC_LEN: usize = 21;
const WHAT: &str = "verbs connection info";

/// Where one NIC port is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NicAddr {
    pub gid: [u8; 16],
    pub lid: u16,
    pub port: u8,
    pub mtu: u8,
    pub link_layer: u8,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsInfo {
    /// The NICs (1..=`MAX_NICS`); queue pair `i` is on `nics[i % len]`.
    pub nics: Vec<NicAddr>,
    pub sl: u8,
    pub traffic_class: u8,
    pub max_rd_atomic: u8,
    /// (QP number, initial packet sequence number) per data queue pair.
    pub qps: Vec<(u32, u32)>,
}

pub const LINK_INFINIBAND: u8 = 1;
pub const LINK_ETHERNET: u8 = 2;

impl VerbsInfo {
    pub fn encoded_len(&self) -> usize {
        12 + NIC_LEN * self.nics.len() + 8 * self.qps.len()
    }

    /// The NIC queue pair `qp` lives on.
    pub fn nic_of(&self, qp: usize) -> &NicAddr {
        &self.nics[qp % self.nics.len()]
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut o = Vec::with_capacity(self.encoded_len());
        o.extend_from_slice(&VERBS_MAGIC.to_le_bytes());
        o.extend_from_slice(&VERBS_VERSION.to_le_bytes());
        o.extend_from_slice(&(self.qps.len() as u16).to_le_bytes());
        o.extend_from_slice(&[
            self.nics.len() as u8,
            self.sl,
            self.traffic_class,
            self.max_rd_atomic,
        ]);
        for n in &self.nics {
            o.extend_from_slice(&n.gid);
            o.extend_from_slice(&n.lid.to_le_bytes());
            o.extend_from_slice(&[n.port, n.mtu, n.link_layer]);
        }
        for (qpn, psn) in &self.qps {
            o.extend_from_slice(&qpn.to_le_bytes());
            o.extend_from_slice(&psn.to_le_bytes());
        }
        o
    }

    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        let bad = |reason: String| DecodeError::Invalid { what: WHAT, reason };
        let mut r = Reader::new(buf, WHAT);
        let magic = r.u32_le()?;
        if magic != VERBS_MAGIC {
            return Err(DecodeError::BadMagic {
                what: WHAT,
                got: magic,
                expected: VERBS_MAGIC,
            });
        }
        let version = r.u16_le()?;
        if version != VERBS_VERSION {
            return Err(DecodeError::UnsupportedVersion {
                what: WHAT,
                got: version,
                supported: VERBS_VERSION,
            });
        }
        let n = r.u16_le()? as usize;
        if n == 0 || n > MAX_DATA_QPS {
            return Err(bad(format!("{n} queue pairs (1..={MAX_DATA_QPS})")));
        }
        let [n_nics, sl, traffic_class, max_rd_atomic] = r.array()?;
        let n_nics = n_nics as usize;
        if n_nics == 0 || n_nics > MAX_NICS || n_nics > n {
            return Err(bad(format!(
                "{n_nics} NICs for {n} queue pairs (1..={MAX_NICS}, at most one per queue pair)"
            )));
        }
        if sl >= 16 {
            return Err(bad(format!("service level {sl} (< 16)")));
        }
        let mut nics = Vec::with_capacity(n_nics);
        for k in 0..n_nics {
            let gid = r.array()?;
            let lid = r.u16_le()?;
            let [port, mtu, link_layer] = r.array()?;
            if port == 0 {
                return Err(bad(format!("NIC {k}: port 0 (ports count from 1)")));
            }
            if !(1..=5).contains(&mtu) {
                return Err(bad(format!("NIC {k}: MTU code {mtu} (1..=5)")));
            }
            if link_layer != LINK_INFINIBAND && link_layer != LINK_ETHERNET {
                return Err(bad(format!("NIC {k}: link layer {link_layer}")));
            }
            nics.push(NicAddr {
                gid,
                lid,
                port,
                mtu,
                link_layer,
            });
        }
        let mut qps = Vec::with_capacity(n);
        for i in 0..n {
            let (qpn, psn) = (r.u32_le()?, r.u32_le()?);
            if qpn >= 1 << 24 || psn >= 1 << 24 {
                return Err(bad(format!(
                    "queue pair {i}: QPN {qpn:#x} / PSN {psn:#x} exceed 24 bits"
                )));
            }
            qps.push((qpn, psn));
        }
        r.finish()?;
        Ok(VerbsInfo {
            nics,
            sl,
            traffic_class,
            max_rd_atomic,
            qps,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::wire::testrng::Rng;

    pub(crate) fn sample(rng: &mut Rng) -> VerbsInfo {
        let n = rng.below(MAX_DATA_QPS as u64) as usize + 1;
        let n_nics = 1 + rng.below(MAX_NICS.min(n) as u64) as usize;
        VerbsInfo {
            nics: (0..n_nics)
                .map(|_| NicAddr {
                    gid: rng.bytes(16).try_into().unwrap(),
                    lid: rng.next() as u16,
                    port: rng.below(2) as u8 + 1,
                    mtu: rng.below(5) as u8 + 1,
                    link_layer: if rng.below(2) == 0 {
                        LINK_INFINIBAND
                    } else {
                        LINK_ETHERNET
                    },
                })
                .collect(),
            sl: rng.below(16) as u8,
            traffic_class: rng.next() as u8,
            max_rd_atomic: rng.next() as u8,
            qps: (0..n)
                .map(|_| (rng.below(1 << 24) as u32, rng.below(1 << 24) as u32))
                .collect(),
        }
    }

    #[test]
    fn round_trips() {
        let mut rng = Rng(0x5eed);
        for _ in 0..1000 {
            let v = sample(&mut rng);
            let b = v.encode();
            assert_eq!(b.len(), v.encoded_len());
            assert_eq!(VerbsInfo::decode(&b).unwrap(), v);
        }
    }

    #[test]
    fn the_fuzz_seeds_decode() {
        for f in ["two_qps", "two_nics_four_qps"] {
            let path = format!("{}/fuzz/corpus/verbs_info/{f}", env!("CARGO_MANIFEST_DIR"));
            let b = std::fs::read(&path).unwrap();
            let v = VerbsInfo::decode(&b).unwrap_or_else(|e| panic!("{f}: {e}"));
            assert_eq!(v.encode(), b, "{f}");
        }
    }

    #[test]
    fn queue_pairs_rotate_over_the_nics() {
        let mut rng = Rng(3);
        let mut v = sample(&mut rng);
        v.qps = vec![(1, 1); 6];
        v.nics.truncate(1);
        let second = NicAddr {
            lid: 77,
            ..v.nics[0]
        };
        v.nics.push(second);
        assert_eq!(v.nic_of(0), &v.nics[0]);
        assert_eq!(v.nic_of(1).lid, 77);
        assert_eq!(v.nic_of(4), &v.nics[0]);
        assert_eq!(VerbsInfo::decode(&v.encode()).unwrap(), v);
    }

    #[test]
    fn rejects_what_would_misconfigure_a_qp() {
        let mut rng = Rng(1);
        let mut good = sample(&mut rng);
        good.qps = vec![(5, 6); 8];
        type Mutate = Box<dyn Fn(&mut VerbsInfo)>;
        let cases: Vec<(&str, Mutate)> = vec![
            ("no qps", Box::new(|v| v.qps.clear())),
            ("no nics", Box::new(|v| v.nics.clear())),
            ("5 nics", Box::new(|v| v.nics = vec![v.nics[0]; 5])),
            (
                "more nics than qps",
                Box::new(|v| {
                    v.nics = vec![v.nics[0]; 3];
                    v.qps.truncate(2)
                }),
            ),
            ("port 0", Box::new(|v| v.nics[0].port = 0)),
            ("mtu 0", Box::new(|v| v.nics[0].mtu = 0)),
            ("mtu 6", Box::new(|v| v.nics[0].mtu = 6)),
            ("link 3", Box::new(|v| v.nics[0].link_layer = 3)),
            ("sl 16", Box::new(|v| v.sl = 16)),
            ("qpn 2^24", Box::new(|v| v.qps[0].0 = 1 << 24)),
            ("psn 2^24", Box::new(|v| v.qps[0].1 = 1 << 24)),
            ("65 qps", Box::new(|v| v.qps = vec![(1, 1); 65])),
        ];
        for (what, f) in cases {
            let mut v = good.clone();
            f(&mut v);
            assert!(VerbsInfo::decode(&v.encode()).is_err(), "{what} accepted");
        }
        let b = good.encode();
        assert!(VerbsInfo::decode(&b[..b.len() - 1]).is_err());
        let mut long = b.clone();
        long.push(0);
        assert!(VerbsInfo::decode(&long).is_err());
    }
}

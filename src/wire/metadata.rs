//! `EndpointMetadata`: the bytes a peer needs to reach an endpoint, laid out
//! exactly as the seed's `get_metadata()` so a UCCL peer's metadata parses:
//!
//! ```text
//! IPv4: addr[4] | port u16 (network order) | bdf_len u8 | bdf[bdf_len]
//! IPv6: addr[16]| port u16 (network order) | bdf_len u8 | bdf[bdf_len]
//! ```
//!
//! The format has no tag for the address family. Decoding follows the seed:
//! the input is IPv4 when `len == 7 + byte[6]`, else IPv6 when
//! `len == 19 + byte[18]`. Where both rules match (possible for some IPv6
//! addresses whose seventh byte happens to equal `len - 7`), ferry takes
//! IPv4 first, as the seed does, but only if the bus-id bytes it would then
//! read are a valid bus id; otherwise it tries IPv6. Encoding then gives back
//! the same bytes either way, so decode-then-encode is the identity on every
//! accepted input.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::cursor::{DecodeError, Reader};

/// Longest GPU PCI bus id accepted. Real ones ("0000:1b:00.0") are 12 bytes;
/// the cap keeps a hostile length byte from meaning anything.
pub const MAX_BDF_LEN: usize = 64;

const WHAT: &str = "endpoint metadata";

/// Where an endpoint listens, and which GPU (by PCI bus id) it serves.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EndpointMetadata {
    /// The address it listens on (and advertises).
    pub addr: IpAddr,
    /// Its listening port.
    pub port: u16,
    /// Normalized PCI bus id of the endpoint's GPU; empty for host-only endpoints.
    pub gpu_bdf: String,
}

impl EndpointMetadata {
    /// Builds metadata, checking the bus id so that `encode` cannot fail.
    pub fn new(addr: IpAddr, port: u16, gpu_bdf: &str) -> Result<Self, DecodeError> {
        check_bdf(gpu_bdf.as_bytes())?;
        Ok(Self {
            addr,
            port,
            gpu_bdf: gpu_bdf.to_owned(),
        })
    }

    /// `addr:port`, to connect to.
    pub fn socket_addr(&self) -> SocketAddr {
        SocketAddr::new(self.addr, self.port)
    }

    /// The length of `encode`'s bytes.
    pub fn encoded_len(&self) -> usize {
        let ip = if self.addr.is_ipv4() { 4 } else { 16 };
        ip + 2 + 1 + self.gpu_bdf.len()
    }

    /// The seed's bytes: IPv4 (4) or IPv6 (16), port (2, network order),
    /// bus id length (1), bus id.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        match self.addr {
            IpAddr::V4(a) => out.extend_from_slice(&a.octets()),
            IpAddr::V6(a) => out.extend_from_slice(&a.octets()),
        }
        out.extend_from_slice(&self.port.to_be_bytes());
        // `new` and `decode` both cap the bus id, so it fits in a byte.
        out.push(self.gpu_bdf.len() as u8);
        out.extend_from_slice(self.gpu_bdf.as_bytes());
        out
    }

    /// Parses the seed's bytes (a UCCL peer's too); trailing bytes, a bad
    /// length or a bus id that is not one are refused.
    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        let v4_rule = buf.len() >= 7 && buf.len() == 7 + buf[6] as usize;
        let v6_rule = buf.len() >= 19 && buf.len() == 19 + buf[18] as usize;
        if v4_rule {
            match decode_family(buf, 4) {
                Ok(m) => return Ok(m),
                Err(e) if !v6_rule => return Err(e),
                Err(_) => {}
            }
        }
        if v6_rule {
            return decode_family(buf, 16);
        }
        Err(DecodeError::BadLength {
            what: WHAT,
            len: buf.len(),
            expected: "7 + bdf_len (IPv4) or 19 + bdf_len (IPv6), bdf_len at byte 6 or 18",
        })
    }
}

fn decode_family(buf: &[u8], ip_len: usize) -> Result<EndpointMetadata, DecodeError> {
    let mut r = Reader::new(buf, WHAT);
    let addr = if ip_len == 4 {
        IpAddr::V4(Ipv4Addr::from(r.array::<4>()?))
    } else {
        IpAddr::V6(Ipv6Addr::from(r.array::<16>()?))
    };
    let port = r.u16_be()?;
    let bdf_len = r.u8()? as usize;
    let bdf = r.bytes(bdf_len)?;
    r.finish()?;
    check_bdf(bdf)?;
    // check_bdf admits only ASCII, which is valid UTF-8.
    let gpu_bdf = String::from_utf8_lossy(bdf).into_owned();
    Ok(EndpointMetadata {
        addr,
        port,
        gpu_bdf,
    })
}

fn check_bdf(bdf: &[u8]) -> Result<(), DecodeError> {
    if bdf.len() > MAX_BDF_LEN {
        return Err(DecodeError::TooLong {
            what: "gpu bus id",
            len: bdf.len() as u64,
            max: MAX_BDF_LEN as u64,
        });
    }
    if let Some(pos) = bdf.iter().position(|b| !b.is_ascii_graphic()) {
        return Err(DecodeError::Invalid {
            what: "gpu bus id",
            reason: format!("byte {pos} is {:#04x}, not printable ASCII", bdf[pos]),
        });
    }
    Ok(())
}

/// Normalises a PCI bus id as the seed does: lower case, with the 4-digit
/// domain (`0000:1A:00.0` → `0000:1a:00.0`; `1a:00.0` → `0000:1a:00.0`).
pub fn normalize_bus_id(raw: &str) -> String {
    let s = raw.trim().to_ascii_lowercase();
    let parts: Vec<&str> = s.split(':').collect();
    match parts.as_slice() {
        [bus, devfn] => format!("0000:{bus:0>2}:{devfn}"),
        [dom, bus, devfn] => {
            let dom = dom.trim_start_matches('0');
            format!("{dom:0>4}:{bus:0>2}:{devfn}")
        }
        _ => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_are_normalised() {
        assert_eq!(normalize_bus_id("0000:1A:00.0"), "0000:1a:00.0");
        assert_eq!(normalize_bus_id("1a:00.0"), "0000:1a:00.0");
        assert_eq!(normalize_bus_id("00000000:9B:00.0"), "0000:9b:00.0");
        assert_eq!(normalize_bus_id(" 0001:03:00.1\n"), "0001:03:00.1");
    }

    use crate::wire::testrng::Rng;

    #[test]
    fn ipv4_bytes_match_the_seed_layout() {
        let m = EndpointMetadata::new("10.1.2.3".parse().unwrap(), 0x1234, "0000:1b:00.0").unwrap();
        let b = m.encode();
        assert_eq!(&b[..4], &[10, 1, 2, 3]);
        assert_eq!(&b[4..6], &[0x12, 0x34], "port is network order");
        assert_eq!(b[6], 12);
        assert_eq!(&b[7..], b"0000:1b:00.0");
        assert_eq!(EndpointMetadata::decode(&b).unwrap(), m);
    }

    #[test]
    fn ipv6_round_trip() {
        let m = EndpointMetadata::new("::1".parse().unwrap(), 9000, "").unwrap();
        let b = m.encode();
        assert_eq!(b.len(), 19);
        assert_eq!(EndpointMetadata::decode(&b).unwrap(), m);
    }

    #[test]
    fn truncated_oversized_and_garbage_are_errors() {
        let m = EndpointMetadata::new("127.0.0.1".parse().unwrap(), 80, "0000:01:00.0").unwrap();
        let b = m.encode();
        for cut in 0..b.len() {
            assert!(EndpointMetadata::decode(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = b.clone();
        long.push(b'x');
        let e = EndpointMetadata::decode(&long).unwrap_err();
        assert!(matches!(e, DecodeError::BadLength { len: 20, .. }), "{e}");
        assert!(EndpointMetadata::decode(&[0xff; 300]).is_err());
        let mut bad = b.clone();
        bad[8] = 0;
        assert!(matches!(
            EndpointMetadata::decode(&bad),
            Err(DecodeError::Invalid { .. })
        ));
        assert!(EndpointMetadata::new("1.2.3.4".parse().unwrap(), 1, &"a".repeat(65)).is_err());
    }

    #[test]
    fn property_encode_decode_encode() {
        let mut rng = Rng(0x5eed);
        for _ in 0..5000 {
            let addr = if rng.below(2) == 0 {
                IpAddr::V4(Ipv4Addr::from(rng.next() as u32))
            } else {
                IpAddr::V6(Ipv6Addr::from(
                    ((rng.next() as u128) << 64) | rng.next() as u128,
                ))
            };
            let n = rng.below(20) as usize;
            let bdf: String = (0..n)
                .map(|_| (b'!' + rng.below(94) as u8) as char)
                .collect();
            let m = EndpointMetadata::new(addr, rng.next() as u16, &bdf).unwrap();
            let b = m.encode();
            let d = EndpointMetadata::decode(&b).unwrap();
            assert_eq!(d.encode(), b);
        }
    }

    #[test]
    fn property_random_bytes_never_panic_and_round_trip() {
        let mut rng = Rng(42);
        for _ in 0..20000 {
            let n = rng.below(40) as usize;
            let mut b = rng.bytes(n);
            if n > 7 && rng.below(2) == 0 {
                b[6] = (n - 7) as u8;
            }
            if let Ok(m) = EndpointMetadata::decode(&b) {
                assert_eq!(m.encode(), b);
            }
        }
    }
}

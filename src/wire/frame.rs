//! Control-path frames, exchanged over a fresh socket before it carries data.
//!
//! ```text
//! header (12 B): magic u32 LE | version u16 LE | kind u8 | flags u8 (0) | body_len u32 LE
//! Hello / HelloAck body (44 B): endpoint_id u64 | caps u32 | conn_nonce u64
//!                               | stream_idx u16 | stream_count u16 | max_inflight u32
//!                               | host_token u64 | auth_nonce u64
//! Error body: code u16 | msg_len u16 | msg (UTF-8, <= 1024 B)
//! Auth body: mac [32]          AuthOk body: empty
//! Vouch body (16 B): conn_nonce u64 | challenge u64
//! Vouched body: family u8 (0: none, 4, 6) | ip [0/4/16] | port u16 (absent for 0) | mac [32]
//! ```
//!
//! A connection of N streams opens N sockets; each sends a `Hello` naming the
//! connection's nonce and its index, and gets a `HelloAck` or an `Error`.

use super::cursor::{DecodeError, Reader};

pub const CONTROL_MAGIC: u32 = u32::from_le_bytes(*b"FRY1");
/// 2: each side keeps at most min(its own, the peer's) requests in flight
/// per stream (1 let the peer's declaration size our queues). 3: the
/// client sends every stream's Hello before reading an ack; the server
/// acknowledges a connection only once all its streams have arrived. 4: the
/// verbs exchange ends with `VerbsReady` from both sides, and `VerbsInfo`
/// carries a NIC table (queue pairs striped over several NICs). 5: every
/// notification's payload starts with a kind byte (`NOTE_APP` / `NOTE_CTL`:
/// the engine's own two-sided messages travel beside the application's).
pub const PROTOCOL_VERSION: u16 = 5;
pub const CONTROL_HEADER_LEN: usize = 12;
/// No control frame body is longer; a peer claiming more is refused before
/// any of it is read.
pub const MAX_CONTROL_BODY: usize = 2048;
const MAX_ERROR_MSG: usize = 1024;
const HELLO_BODY_LEN: usize = 44;
/// Streams a connection may have; the handshake rejects more.
pub const MAX_STREAMS: u16 = 64;

const KIND_HELLO: u8 = 1;
const KIND_HELLO_ACK: u8 = 2;
const KIND_ERROR: u8 = 3;
const KIND_AUTH: u8 = 4;
const KIND_AUTH_OK: u8 = 5;
const KIND_VERBS: u8 = 6;
const KIND_VERBS_READY: u8 = 7;
const KIND_VOUCH: u8 = 8;
const KIND_VOUCHED: u8 = 9;

/// One side's introduction on a new stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub endpoint_id: u64,
    /// Capability bits (`CAP_*`); unknown ones are ignored.
    pub caps: u32,
    /// Chosen by the connecting side; ties the streams of one connection.
    pub conn_nonce: u64,
    pub stream_idx: u16,
    pub stream_count: u16,
    /// Requests the sender will have outstanding on this stream at most;
    /// the receiver sizes its response queue by it.
    pub max_inflight: u32,
    /// Identifies the sender's host and /dev/shm; equal non-zero tokens mean
    /// the two endpoints can use the same-host path. 0: unknown.
    pub host_token: u64,
    /// Random challenge for the peer's authentication proof.
    pub auth_nonce: u64,
}

impl Hello {
    /// Whether both hellos of a handshake offer `cap`: the one rule both
    /// sides apply to the same pair, so they decide alike (a side that
    /// offered nothing never finds the other set up for it).
    pub fn both_offer(&self, other: &Hello, cap: u32) -> bool {
        self.caps & other.caps & cap != 0
    }
}

/// The sender can take same-host (shared-memory) connections.
pub const CAP_SHM: u32 = 1;
/// The sender has a shared secret and requires the peer to prove it too.
pub const CAP_AUTH: u32 = 2;
/// The sender has a usable RDMA NIC and offers verbs queue pairs.
pub const CAP_VERBS: u32 = 4;
/// The sender asks for MACs over payloads too (`FERRY_INTEGRITY=full`);
/// with `CAP_AUTH` on both sides, either side asking is enough.
pub const CAP_INTEGRITY_FULL: u32 = 8;
/// The sender decodes packed data frames (`FLAG_PACKED`, the float-aware
/// codec) and may send them (`FERRY_COMPRESS` is not `off`). Packed frames
/// flow only when both hellos carry it, so a peer that predates the codec
/// (or turned it off) gets plain frames, not an error: a capability rather
/// than a version bump, which would refuse such a peer outright.
pub const CAP_CODEC: u32 = 16;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlFrame {
    Hello(Hello),
    HelloAck(Hello),
    Error {
        code: u16,
        message: String,
    },
    /// HMAC proof of the shared secret.
    Auth([u8; 32]),
    /// The peer's proof was accepted.
    AuthOk,
    /// RDMA queue pairs for this connection (after the handshake, on stream
    /// 0, when both hellos carry `CAP_VERBS`); `None`: this side will not
    /// use verbs for it, and both fall back to tcp.
    Verbs(Option<super::VerbsInfo>),
    /// After both sides moved their queue pairs to RTS (or failed to):
    /// `true` when ours are ready. Verbs is used only when both say so, so
    /// neither side posts before the other reaches RTR, and a side whose
    /// setup failed never leaves the other on verbs against a dead QP.
    VerbsReady(bool),
    /// Sent instead of a `Hello` on a socket of its own: "did you dial the
    /// connection whose nonce is `conn_nonce`, and to which address?" (an
    /// endpoint checking who is at the other end of a connection it
    /// accepted, `Endpoint::vouch`). `challenge` goes into the answer's MAC.
    Vouch {
        conn_nonce: u64,
        challenge: u64,
    },
    /// The answer to `Vouch`: the address the connection was dialed to,
    /// `None` when no connection of ours has that nonce. `mac` is the
    /// HMAC of the answer under the shared secret (zeros without one).
    Vouched {
        dialed: Option<std::net::SocketAddr>,
        mac: [u8; 32],
    },
}

impl ControlFrame {
    pub fn encode(&self) -> Vec<u8> {
        let (kind, body) = match self {
            ControlFrame::Hello(h) => (KIND_HELLO, encode_hello(h)),
            ControlFrame::HelloAck(h) => (KIND_HELLO_ACK, encode_hello(h)),
            ControlFrame::Error { code, message } => {
                // Longer messages are cut at a char boundary so decode accepts them.
                let mut end = message.len().min(MAX_ERROR_MSG);
                while !message.is_char_boundary(end) {
                    end -= 1;
                }
                let msg = &message.as_bytes()[..end];
                let mut b = Vec::with_capacity(4 + msg.len());
                b.extend_from_slice(&code.to_le_bytes());
                b.extend_from_slice(&(msg.len() as u16).to_le_bytes());
                b.extend_from_slice(msg);
                (KIND_ERROR, b)
            }
            ControlFrame::Auth(mac) => (KIND_AUTH, mac.to_vec()),
            ControlFrame::AuthOk => (KIND_AUTH_OK, Vec::new()),
            ControlFrame::Verbs(v) => {
                (KIND_VERBS, v.as_ref().map_or_else(Vec::new, |v| v.encode()))
            }
            ControlFrame::VerbsReady(ok) => (KIND_VERBS_READY, vec![u8::from(*ok)]),
            ControlFrame::Vouch {
                conn_nonce,
                challenge,
            } => {
                let mut b = conn_nonce.to_le_bytes().to_vec();
                b.extend_from_slice(&challenge.to_le_bytes());
                (KIND_VOUCH, b)
            }
            ControlFrame::Vouched { dialed, mac } => {
                let mut b = encode_dialed(*dialed);
                b.extend_from_slice(mac);
                (KIND_VOUCHED, b)
            }
        };
        let mut out = Vec::with_capacity(CONTROL_HEADER_LEN + body.len());
        out.extend_from_slice(&CONTROL_MAGIC.to_le_bytes());
        out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out.push(kind);
        out.push(0);
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Checks a frame header and returns the body length that follows it.
    pub fn body_len(header: &[u8; CONTROL_HEADER_LEN]) -> Result<usize, DecodeError> {
        let what = "control frame header";
        let mut r = Reader::new(header, what);
        let magic = r.u32_le()?;
        if magic != CONTROL_MAGIC {
            return Err(DecodeError::BadMagic {
                what,
                got: magic,
                expected: CONTROL_MAGIC,
            });
        }
        let version = r.u16_le()?;
        if version != PROTOCOL_VERSION {
            return Err(DecodeError::UnsupportedVersion {
                what,
                got: version,
                supported: PROTOCOL_VERSION,
            });
        }
        let kind = r.u8()?;
        if !(KIND_HELLO..=KIND_VOUCHED).contains(&kind) {
            return Err(DecodeError::UnknownKind { what, got: kind });
        }
        let flags = r.u8()?;
        if flags != 0 {
            return Err(DecodeError::Invalid {
                what,
                reason: format!("flags {flags:#04x} set; none are defined"),
            });
        }
        let len = r.u32_le()? as usize;
        if len > MAX_CONTROL_BODY {
            return Err(DecodeError::TooLong {
                what,
                len: len as u64,
                max: MAX_CONTROL_BODY as u64,
            });
        }
        Ok(len)
    }

    /// Decodes exactly one whole frame.
    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(buf, "control frame");
        let header: [u8; CONTROL_HEADER_LEN] = r.array()?;
        let len = Self::body_len(&header)?;
        let body = r.bytes(len)?;
        r.finish()?;
        match header[6] {
            KIND_HELLO => Ok(ControlFrame::Hello(decode_hello(body)?)),
            KIND_HELLO_ACK => Ok(ControlFrame::HelloAck(decode_hello(body)?)),
            KIND_AUTH => {
                let mac: [u8; 32] = body.try_into().map_err(|_| DecodeError::BadLength {
                    what: "auth frame",
                    len: body.len(),
                    expected: "exactly 32",
                })?;
                Ok(ControlFrame::Auth(mac))
            }
            KIND_AUTH_OK if body.is_empty() => Ok(ControlFrame::AuthOk),
            KIND_AUTH_OK => Err(DecodeError::TrailingBytes {
                what: "auth-ok frame",
                extra: body.len(),
            }),
            KIND_VERBS if body.is_empty() => Ok(ControlFrame::Verbs(None)),
            KIND_VERBS => Ok(ControlFrame::Verbs(Some(super::VerbsInfo::decode(body)?))),
            KIND_VERBS_READY => match body {
                [0] => Ok(ControlFrame::VerbsReady(false)),
                [1] => Ok(ControlFrame::VerbsReady(true)),
                _ => Err(DecodeError::Invalid {
                    what: "verbs-ready frame",
                    reason: format!("body {body:02x?}; expected exactly one byte, 0 or 1"),
                }),
            },
            KIND_VOUCH => {
                let mut r = Reader::new(body, "vouch frame");
                let (conn_nonce, challenge) = (r.u64_le()?, r.u64_le()?);
                r.finish()?;
                Ok(ControlFrame::Vouch {
                    conn_nonce,
                    challenge,
                })
            }
            KIND_VOUCHED => {
                let mut r = Reader::new(body, "vouched frame");
                let dialed = decode_dialed(&mut r)?;
                let mac = r.array()?;
                r.finish()?;
                Ok(ControlFrame::Vouched { dialed, mac })
            }
            _ => {
                let what = "control error frame";
                let mut r = Reader::new(body, what);
                let code = r.u16_le()?;
                let n = r.u16_le()? as usize;
                if n > MAX_ERROR_MSG {
                    return Err(DecodeError::TooLong {
                        what,
                        len: n as u64,
                        max: MAX_ERROR_MSG as u64,
                    });
                }
                let msg = r.bytes(n)?;
                r.finish()?;
                let message = std::str::from_utf8(msg)
                    .map_err(|e| DecodeError::Invalid {
                        what,
                        reason: format!("message is not UTF-8: {e}"),
                    })?
                    .to_owned();
                Ok(ControlFrame::Error { code, message })
            }
        }
    }
}

/// A vouch answer's address: the bytes its MAC covers too.
pub fn encode_dialed(dialed: Option<std::net::SocketAddr>) -> Vec<u8> {
    use std::net::IpAddr;
    let mut b = Vec::with_capacity(19);
    match dialed {
        None => b.push(0),
        Some(a) => {
            match a.ip() {
                IpAddr::V4(ip) => {
                    b.push(4);
                    b.extend_from_slice(&ip.octets());
                }
                IpAddr::V6(ip) => {
                    b.push(6);
                    b.extend_from_slice(&ip.octets());
                }
            }
            b.extend_from_slice(&a.port().to_le_bytes());
        }
    }
    b
}

fn decode_dialed(r: &mut Reader<'_>) -> Result<Option<std::net::SocketAddr>, DecodeError> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
    let ip = match r.u8()? {
        0 => return Ok(None),
        4 => IpAddr::V4(Ipv4Addr::from(r.array::<4>()?)),
        6 => IpAddr::V6(Ipv6Addr::from(r.array::<16>()?)),
        got => {
            return Err(DecodeError::Invalid {
                what: "vouched frame",
                reason: format!("address family {got}; expected 0, 4 or 6"),
            })
        }
    };
    Ok(Some(SocketAddr::new(ip, r.u16_le()?)))
}

fn encode_hello(h: &Hello) -> Vec<u8> {
    let mut b = Vec::with_capacity(HELLO_BODY_LEN);
    b.extend_from_slice(&h.endpoint_id.to_le_bytes());
    b.extend_from_slice(&h.caps.to_le_bytes());
    b.extend_from_slice(&h.conn_nonce.to_le_bytes());
    b.extend_from_slice(&h.stream_idx.to_le_bytes());
    b.extend_from_slice(&h.stream_count.to_le_bytes());
    b.extend_from_slice(&h.max_inflight.to_le_bytes());
    b.extend_from_slice(&h.host_token.to_le_bytes());
    b.extend_from_slice(&h.auth_nonce.to_le_bytes());
    b
}

fn decode_hello(body: &[u8]) -> Result<Hello, DecodeError> {
    let what = "hello frame";
    let mut r = Reader::new(body, what);
    let h = Hello {
        endpoint_id: r.u64_le()?,
        caps: r.u32_le()?,
        conn_nonce: r.u64_le()?,
        stream_idx: r.u16_le()?,
        stream_count: r.u16_le()?,
        max_inflight: r.u32_le()?,
        host_token: r.u64_le()?,
        auth_nonce: r.u64_le()?,
    };
    r.finish()?;
    if h.stream_count == 0 || h.stream_count > MAX_STREAMS || h.stream_idx >= h.stream_count {
        return Err(DecodeError::Invalid {
            what,
            reason: format!(
                "stream {} of {} (count must be 1..={MAX_STREAMS}, index below it)",
                h.stream_idx, h.stream_count
            ),
        });
    }
    if h.max_inflight == 0 || h.max_inflight > 1 << 20 {
        return Err(DecodeError::Invalid {
            what,
            reason: format!("max_inflight {} outside 1..=1048576", h.max_inflight),
        });
    }
    Ok(h)
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_capability_counts_only_when_both_hellos_offer_it() {
        let h = |caps| Hello {
            endpoint_id: 1,
            caps,
            auth_nonce: 0,
            host_token: 0,
            conn_nonce: 0,
            stream_idx: 0,
            stream_count: 1,
            max_inflight: 1,
        };
        let (v, s) = (CAP_VERBS, CAP_SHM);
        assert!(h(v | s).both_offer(&h(v), v));
        // The fallback hello drops a bit: neither side may then use it.
        assert!(!h(v).both_offer(&h(0), v));
        assert!(!h(0).both_offer(&h(v), v));
        assert!(!h(v).both_offer(&h(s), v));
    }

    use super::*;
    use crate::wire::testrng::Rng;

    fn hello(rng: &mut Rng) -> Hello {
        let count = 1 + rng.below(MAX_STREAMS as u64) as u16;
        Hello {
            endpoint_id: rng.next(),
            caps: rng.next() as u32,
            conn_nonce: rng.next(),
            stream_idx: rng.below(count as u64) as u16,
            stream_count: count,
            max_inflight: 1 + rng.below(1 << 20) as u32,
            host_token: rng.next(),
            auth_nonce: rng.next(),
        }
    }

    #[test]
    fn property_round_trip() {
        let mut rng = Rng(99);
        for i in 0..3000 {
            let f = match i % 11 {
                0 => ControlFrame::Hello(hello(&mut rng)),
                8 => ControlFrame::Vouch {
                    conn_nonce: rng.next(),
                    challenge: rng.next(),
                },
                9 => ControlFrame::Vouched {
                    dialed: None,
                    mac: rng.bytes(32).try_into().unwrap(),
                },
                10 => ControlFrame::Vouched {
                    dialed: Some(if rng.next() & 1 == 1 {
                        std::net::SocketAddr::from((
                            [127, 0, 0, rng.next() as u8],
                            rng.next() as u16,
                        ))
                    } else {
                        std::net::SocketAddr::from((
                            std::net::Ipv6Addr::from(rng.next() as u128),
                            rng.next() as u16,
                        ))
                    }),
                    mac: rng.bytes(32).try_into().unwrap(),
                },
                7 => ControlFrame::VerbsReady(rng.next() & 1 == 1),
                5 => ControlFrame::Verbs(None),
                6 => ControlFrame::Verbs(Some(crate::wire::verbs_sample(&mut rng))),
                1 => ControlFrame::HelloAck(hello(&mut rng)),
                3 => ControlFrame::Auth(rng.bytes(32).try_into().unwrap()),
                4 => ControlFrame::AuthOk,
                _ => ControlFrame::Error {
                    code: rng.next() as u16,
                    message: "é".repeat(rng.below(700) as usize),
                },
            };
            let b = f.encode();
            let d = ControlFrame::decode(&b).unwrap();
            assert_eq!(d.encode(), b);
            if !matches!(f, ControlFrame::Error { .. }) {
                assert_eq!(d, f);
            }
        }
    }

    #[test]
    fn a_vouched_frame_with_an_unknown_family_or_a_short_body_is_refused() {
        let mut b = ControlFrame::Vouched {
            dialed: Some("127.0.0.1:9".parse().unwrap()),
            mac: [0; 32],
        }
        .encode();
        b[CONTROL_HEADER_LEN] = 5;
        assert!(matches!(
            ControlFrame::decode(&b),
            Err(DecodeError::Invalid { .. })
        ));
        let mut short = ControlFrame::Vouch {
            conn_nonce: 1,
            challenge: 2,
        }
        .encode();
        short.pop();
        short[8..12].copy_from_slice(&15u32.to_le_bytes());
        assert!(ControlFrame::decode(&short).is_err());
    }

    #[test]
    fn header_checks() {
        let b = ControlFrame::Hello(hello(&mut Rng(1))).encode();
        let mut h: [u8; 12] = b[..12].try_into().unwrap();
        assert_eq!(ControlFrame::body_len(&h).unwrap(), 44);
        h[0] ^= 1;
        assert!(matches!(
            ControlFrame::body_len(&h),
            Err(DecodeError::BadMagic { .. })
        ));
        h[0] ^= 1;
        h[4] = 9;
        assert!(matches!(
            ControlFrame::body_len(&h),
            Err(DecodeError::UnsupportedVersion {
                got: 9,
                supported: PROTOCOL_VERSION,
                ..
            })
        ));
        h[4] = PROTOCOL_VERSION as u8;
        h[8..12].copy_from_slice(&100_000u32.to_le_bytes());
        assert!(matches!(
            ControlFrame::body_len(&h),
            Err(DecodeError::TooLong { len: 100_000, .. })
        ));
    }

    #[test]
    fn trailing_and_truncated_and_invalid_streams() {
        let mut b = ControlFrame::Hello(hello(&mut Rng(2))).encode();
        for cut in 0..b.len() {
            assert!(ControlFrame::decode(&b[..cut]).is_err());
        }
        b.push(0);
        assert!(ControlFrame::decode(&b).is_err());
        let bad = Hello {
            stream_idx: 3,
            stream_count: 3,
            ..hello(&mut Rng(3))
        };
        assert!(ControlFrame::decode(&ControlFrame::Hello(bad).encode()).is_err());
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut rng = Rng(5);
        for _ in 0..20000 {
            let n = rng.below(60) as usize;
            let mut b = rng.bytes(n);
            if n >= 12 {
                b[..4].copy_from_slice(&CONTROL_MAGIC.to_le_bytes());
                b[4..6].copy_from_slice(&1u16.to_le_bytes());
                b[6] = 1 + rng.below(5) as u8;
                b[7] = 0;
                b[8..12].copy_from_slice(&((n - 12) as u32).to_le_bytes());
            }
            if let Ok(f) = ControlFrame::decode(&b) {
                assert_eq!(f.encode(), b);
            }
        }
    }
}

//! The stream handshake: the connecting side opens a connection's N
//! sockets and sends `Hello` on each; the accepting side (`gate.rs`) waits
//! until all N have arrived and then answers each with `HelloAck` (or an
//! `Error` frame saying why not). With a shared secret both sides then
//! prove it on every stream.
//!
//! The client's blocking exchange is a thin layer on `Ctl`; the server's
//! runs on the gate's event loop, reading frames with `FrameReader`.

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::Ctl;
use crate::auth::{ct_eq, proof};
use crate::error::{Error, Result};
use crate::wire::{ControlFrame, DecodeError, Hello, CAP_AUTH, CONTROL_HEADER_LEN};

/// Error codes carried in `ControlFrame::Error` during the handshake.
pub const REJECT_PROTOCOL: u16 = 1;

/// Reads one whole control frame.
pub(crate) fn read_frame(ctl: &mut Ctl, s: &TcpStream, deadline: Instant) -> Result<ControlFrame> {
    let mut header = [0u8; CONTROL_HEADER_LEN];
    ctl.recv_exact(s, &mut header, deadline)?;
    let len = ControlFrame::body_len(&header)?;
    let mut frame = vec![0u8; CONTROL_HEADER_LEN + len];
    frame[..CONTROL_HEADER_LEN].copy_from_slice(&header);
    ctl.recv_exact(s, &mut frame[CONTROL_HEADER_LEN..], deadline)?;
    Ok(ControlFrame::decode(&frame)?)
}

/// Checks the accepting side's answer to our `Hello`.
pub(crate) fn check_ack(ours: &Hello, answer: ControlFrame, peer: SocketAddr) -> Result<Hello> {
    match answer {
        ControlFrame::HelloAck(h)
            if h.conn_nonce == ours.conn_nonce && h.stream_idx == ours.stream_idx =>
        {
            Ok(h)
        }
        ControlFrame::HelloAck(h) => Err(Error::Handshake {
            peer,
            reason: format!(
                "ack names connection {:#x} stream {}, we sent {:#x} stream {}",
                h.conn_nonce, h.stream_idx, ours.conn_nonce, ours.stream_idx
            ),
        }),
        ControlFrame::Error { code, message } => Err(Error::Handshake {
            peer,
            reason: format!("refused by peer (code {code}): {message}"),
        }),
        other => Err(Error::Handshake {
            peer,
            reason: format!("peer answered Hello with {other:?}"),
        }),
    }
}

/// A connected side's sockets, and each stream's (our hello, the ack).
pub(crate) type Handshaken = (Vec<TcpStream>, Vec<(Hello, Hello)>);

/// Asks the endpoint listening at `addr` whether it dialed the connection
/// of nonce `conn_nonce`, and to which address (`ControlFrame::Vouch`).
/// With a shared secret the answer must carry its MAC over our fresh
/// challenge, else it is an error.
pub(crate) fn vouch(
    ctl: &mut Ctl,
    addr: SocketAddr,
    conn_nonce: u64,
    timeout: Duration,
    key: Option<&[u8]>,
) -> Result<Option<SocketAddr>> {
    let deadline = Instant::now() + timeout;
    let challenge = crate::sys::random_u64();
    let fail = |reason: String| Error::Handshake { peer: addr, reason };
    let s = ctl.connect(addr, timeout)?;
    let question = ControlFrame::Vouch {
        conn_nonce,
        challenge,
    };
    ctl.send_all(&s, &question.encode(), deadline)?;
    match read_frame(ctl, &s, deadline)? {
        ControlFrame::Vouched { dialed, mac } => {
            if let Some(k) = key {
                let bytes = crate::wire::encode_dialed(dialed);
                let expected = crate::auth::vouch_mac(k, conn_nonce, challenge, &bytes);
                if !ct_eq(&mac, &expected) {
                    return Err(fail(
                        "a vouch answer without a valid MAC of FERRY_AUTH_KEY".into(),
                    ));
                }
            }
            Ok(dialed)
        }
        ControlFrame::Error { code, message } => Err(fail(format!(
            "vouch refused by peer (code {code}): {message}"
        ))),
        other => Err(fail(format!("peer answered Vouch with {other:?}"))),
    }
}

/// Opens the `count` sockets of one connection, sends every `Hello`, then
/// reads each ack (the peer acknowledges none before all have arrived).
/// Returns the sockets (in stream order) and each stream's (our hello,
/// the peer's ack). With a shared secret, each stream also runs the mutual
/// HMAC exchange.
pub(crate) fn connect(
    ctl: &mut Ctl,
    addr: SocketAddr,
    mut hello: Hello,
    timeout: Duration,
    key: Option<&[u8]>,
) -> Result<Handshaken> {
    let deadline = Instant::now() + timeout;
    let mut streams = Vec::with_capacity(hello.stream_count as usize);
    let map_timeout = |e: Error| match e {
        Error::Timeout { .. } => Error::ConnectTimeout {
            addr,
            timeout_ms: super::ms(timeout),
        },
        e => e,
    };
    let mut hellos = Vec::with_capacity(hello.stream_count as usize);
    for idx in 0..hello.stream_count {
        hello.stream_idx = idx;
        if idx > 0 {
            // Each stream proves the secret with its own challenge.
            hello.auth_nonce = crate::sys::random_u64();
        }
        let left = super::remaining(deadline).ok_or(Error::ConnectTimeout {
            addr,
            timeout_ms: super::ms(timeout),
        })?;
        let s = ctl.connect(addr, left)?;
        ctl.send_all(&s, &ControlFrame::Hello(hello).encode(), deadline)
            .map_err(map_timeout)?;
        streams.push(s);
        hellos.push(hello);
    }
    let mut pairs = Vec::with_capacity(streams.len());
    for (s, ours) in streams.iter().zip(&hellos) {
        let answer = read_frame(ctl, s, deadline).map_err(map_timeout)?;
        let ack = check_ack(ours, answer, addr)?;
        if let Some(key) = key {
            prove_to_server(ctl, s, addr, key, ours, &ack, deadline).map_err(map_timeout)?;
        }
        pairs.push((*ours, ack));
    }
    Ok((streams, pairs))
}

/// The client's half of the exchange: check the server's proof, send ours,
/// wait for the verdict.
fn prove_to_server(
    ctl: &mut Ctl,
    s: &TcpStream,
    peer: SocketAddr,
    key: &[u8],
    ours: &Hello,
    ack: &Hello,
    deadline: Instant,
) -> Result<()> {
    let fail = |reason: String| Error::Handshake { peer, reason };
    if ack.caps & CAP_AUTH == 0 {
        return Err(fail(
            "this endpoint requires authentication (FERRY_AUTH_KEY) and the peer has none".into(),
        ));
    }
    let expected = proof(
        key,
        "server",
        ours.auth_nonce,
        ack.auth_nonce,
        ack.endpoint_id,
        ours.endpoint_id,
    );
    match read_frame(ctl, s, deadline)? {
        ControlFrame::Auth(mac) if ct_eq(&mac, &expected) => {}
        ControlFrame::Auth(_) => {
            return Err(fail(
                "the peer's authentication proof is wrong (different FERRY_AUTH_KEY?)".into(),
            ))
        }
        ControlFrame::Error { code, message } => {
            return Err(fail(format!("refused by peer (code {code}): {message}")))
        }
        other => {
            return Err(fail(format!(
                "expected the peer's authentication proof, got {other:?}"
            )))
        }
    }
    let mine = proof(
        key,
        "client",
        ack.auth_nonce,
        ours.auth_nonce,
        ours.endpoint_id,
        ack.endpoint_id,
    );
    ctl.send_all(s, &ControlFrame::Auth(mine).encode(), deadline)?;
    match read_frame(ctl, s, deadline)? {
        ControlFrame::AuthOk => Ok(()),
        ControlFrame::Error { code, message } => {
            Err(fail(format!("refused by peer (code {code}): {message}")))
        }
        other => Err(fail(format!("expected the peer's verdict, got {other:?}"))),
    }
}

/// Reads one control frame from a non-blocking socket, a piece at a time,
/// never past the frame's end (what follows belongs to the data stream).
pub(crate) struct FrameReader {
    /// Sized to what the current frame needs: the header, then header and body.
    buf: Vec<u8>,
    have: usize,
}

impl FrameReader {
    pub fn new() -> Self {
        Self {
            buf: vec![0; CONTROL_HEADER_LEN],
            have: 0,
        }
    }

    /// Where the next bytes go: exactly what the frame still lacks.
    pub fn want(&mut self) -> &mut [u8] {
        &mut self.buf[self.have..]
    }

    /// Takes `n` bytes written into `want()`; returns the frame once whole.
    pub fn filled(&mut self, n: usize) -> std::result::Result<Option<ControlFrame>, DecodeError> {
        self.have += n;
        if self.have < self.buf.len() {
            return Ok(None);
        }
        if self.buf.len() == CONTROL_HEADER_LEN {
            let header: &[u8; CONTROL_HEADER_LEN] = self.buf[..].try_into().expect("header length");
            let body = ControlFrame::body_len(header)?;
            if body > 0 {
                self.buf.resize(CONTROL_HEADER_LEN + body, 0);
                return Ok(None);
            }
        }
        let frame = ControlFrame::decode(&self.buf)?;
        self.buf.truncate(CONTROL_HEADER_LEN);
        self.have = 0;
        Ok(Some(frame))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(nonce: u64, idx: u16, count: u16) -> Hello {
        Hello {
            endpoint_id: 1,
            caps: 0,
            conn_nonce: nonce,
            stream_idx: idx,
            stream_count: count,
            max_inflight: 64,
            host_token: 0,
            auth_nonce: 0,
        }
    }

    #[test]
    fn frame_reader_takes_any_split_and_stops_at_the_frame_end() {
        let mut bytes = ControlFrame::Hello(hello(9, 1, 3)).encode();
        bytes.extend_from_slice(&ControlFrame::AuthOk.encode());
        bytes.extend_from_slice(b"data after the frames");
        for step in [1, 5, 12, 13, 100] {
            let mut r = FrameReader::new();
            let mut at = 0;
            let mut got = Vec::new();
            while got.len() < 2 {
                let want = r.want();
                let n = want.len().min(step);
                want[..n].copy_from_slice(&bytes[at..at + n]);
                at += n;
                if let Some(f) = r.filled(n).unwrap() {
                    got.push(f);
                }
            }
            assert_eq!(
                got,
                vec![ControlFrame::Hello(hello(9, 1, 3)), ControlFrame::AuthOk]
            );
            assert_eq!(&bytes[at..], b"data after the frames", "step {step}");
        }
    }

    #[test]
    fn frame_reader_refuses_a_bad_header_before_reading_a_body() {
        let mut r = FrameReader::new();
        let mut h = ControlFrame::Hello(hello(1, 0, 1)).encode();
        h[8..12].copy_from_slice(&1_000_000u32.to_le_bytes());
        r.want().copy_from_slice(&h[..CONTROL_HEADER_LEN]);
        assert!(matches!(
            r.filled(CONTROL_HEADER_LEN),
            Err(DecodeError::TooLong { .. })
        ));
    }

    #[test]
    fn ack_checks() {
        let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let ours = hello(5, 0, 1);
        assert!(check_ack(&ours, ControlFrame::HelloAck(hello(5, 0, 1)), peer).is_ok());
        assert!(check_ack(&ours, ControlFrame::HelloAck(hello(6, 0, 1)), peer).is_err());
        let e = check_ack(
            &ours,
            ControlFrame::Error {
                code: 1,
                message: "no".into(),
            },
            peer,
        )
        .unwrap_err();
        assert!(e.to_string().contains("refused by peer"));
    }
}

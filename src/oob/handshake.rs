//! The stream handshake: the connecting side sends `Hello` on each of a
//! connection's N sockets, the accepting side answers `HelloAck` (or an
//! `Error` frame saying why not) and groups the sockets by the connection's
//! nonce until all N have arrived.
//!
//! The grouping and the checks are sans-IO (`Assembler`, `check_*`); the
//! blocking exchange over a socket is a thin layer on `Ctl`.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::Ctl;
use crate::auth::{ct_eq, proof};
use crate::error::{Error, Result};
use crate::wire::{ControlFrame, Hello, CAP_AUTH, CONTROL_HEADER_LEN};

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

/// Opens the `count` sockets of one connection and handshakes each.
/// Returns the sockets (in stream order) and the peer's ack of stream 0.
/// With a shared secret, each stream also runs the mutual HMAC exchange.
pub(crate) fn connect(
    ctl: &mut Ctl,
    addr: SocketAddr,
    mut hello: Hello,
    timeout: Duration,
    key: Option<&[u8]>,
) -> Result<(Vec<TcpStream>, Hello)> {
    let deadline = Instant::now() + timeout;
    let mut streams = Vec::with_capacity(hello.stream_count as usize);
    let mut first = None;
    let map_timeout = |e: Error| match e {
        Error::Timeout { .. } => Error::ConnectTimeout {
            addr,
            timeout_ms: super::ms(timeout),
        },
        e => e,
    };
    for idx in 0..hello.stream_count {
        hello.stream_idx = idx;
        let left = super::remaining(deadline).ok_or(Error::ConnectTimeout {
            addr,
            timeout_ms: super::ms(timeout),
        })?;
        let s = ctl.connect(addr, left)?;
        ctl.send_all(&s, &ControlFrame::Hello(hello).encode(), deadline)
            .map_err(map_timeout)?;
        let answer = read_frame(ctl, &s, deadline).map_err(map_timeout)?;
        let ack = check_ack(&hello, answer, addr)?;
        if let Some(key) = key {
            prove_to_server(ctl, &s, addr, key, &hello, &ack, deadline).map_err(map_timeout)?;
        }
        first.get_or_insert(ack);
        streams.push(s);
    }
    Ok((
        streams,
        first.expect("stream_count >= 1 is checked by the codec"),
    ))
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

/// Serves the handshake on one accepted socket: reads its `Hello`, answers,
/// runs the HMAC exchange when a secret is configured, and returns the
/// `Hello`. Anything wrong is answered with an `Error` frame.
pub(crate) fn serve(
    ctl: &mut Ctl,
    s: &TcpStream,
    peer: SocketAddr,
    mut ours: Hello,
    deadline: Instant,
    key: Option<&[u8]>,
) -> Result<Hello> {
    let theirs = match read_frame(ctl, s, deadline) {
        Ok(ControlFrame::Hello(h)) => h,
        Ok(other) => {
            let reason = format!("expected Hello, got {other:?}");
            refuse(ctl, s, &reason, deadline);
            return Err(Error::Handshake { peer, reason });
        }
        Err(Error::Decode(e)) => {
            refuse(ctl, s, &e.to_string(), deadline);
            return Err(Error::Handshake {
                peer,
                reason: e.to_string(),
            });
        }
        Err(e) => return Err(e),
    };
    let mut deny = |reason: &str| {
        refuse(ctl, s, reason, deadline);
        Err(Error::Handshake {
            peer,
            reason: reason.to_owned(),
        })
    };
    match (key.is_some(), theirs.caps & CAP_AUTH != 0) {
        (true, false) => {
            return deny("authentication required: this endpoint has FERRY_AUTH_KEY set")
        }
        (false, true) => {
            return deny("the peer requires authentication and this endpoint has no FERRY_AUTH_KEY")
        }
        _ => {}
    }
    ours.conn_nonce = theirs.conn_nonce;
    ours.stream_idx = theirs.stream_idx;
    ours.stream_count = theirs.stream_count;
    ctl.send_all(s, &ControlFrame::HelloAck(ours).encode(), deadline)?;
    if let Some(key) = key {
        let mine = proof(
            key,
            "server",
            theirs.auth_nonce,
            ours.auth_nonce,
            ours.endpoint_id,
            theirs.endpoint_id,
        );
        ctl.send_all(s, &ControlFrame::Auth(mine).encode(), deadline)?;
        let expected = proof(
            key,
            "client",
            ours.auth_nonce,
            theirs.auth_nonce,
            theirs.endpoint_id,
            ours.endpoint_id,
        );
        match read_frame(ctl, s, deadline)? {
            ControlFrame::Auth(mac) if ct_eq(&mac, &expected) => {}
            _ => {
                let reason = "authentication failed: wrong or missing proof of FERRY_AUTH_KEY";
                refuse(ctl, s, reason, deadline);
                return Err(Error::Handshake {
                    peer,
                    reason: reason.to_owned(),
                });
            }
        }
        ctl.send_all(s, &ControlFrame::AuthOk.encode(), deadline)?;
    }
    Ok(theirs)
}

/// Answers a handshake with an `Error` frame saying why it is refused.
pub(crate) fn refuse(ctl: &mut Ctl, s: &TcpStream, reason: &str, deadline: Instant) {
    let frame = ControlFrame::Error {
        code: REJECT_PROTOCOL,
        message: reason.to_owned(),
    };
    // Best effort: the peer may already be gone.
    let _ = ctl.send_all(s, &frame.encode(), deadline);
}

/// A connection whose sockets have all arrived.
#[derive(Debug)]
pub(crate) struct Group<S> {
    pub hello: Hello,
    pub peer: SocketAddr,
    pub streams: Vec<S>,
}

struct Partial<S> {
    hello: Hello,
    peer: SocketAddr,
    streams: Vec<Option<S>>,
    arrived: usize,
    started: Instant,
}

/// Groups accepted sockets into connections by (peer endpoint, nonce).
/// Bounded: at most `max_partial` connections may be half-assembled, and a
/// partial connection older than `ttl` is dropped.
pub(crate) struct Assembler<S> {
    partial: HashMap<(u64, u64), Partial<S>>,
    max_partial: usize,
    ttl: Duration,
}

impl<S> Assembler<S> {
    pub fn new(max_partial: usize, ttl: Duration) -> Self {
        Self {
            partial: HashMap::new(),
            max_partial,
            ttl,
        }
    }

    /// Adds one handshaken socket; returns the connection once complete.
    pub fn offer(
        &mut self,
        hello: Hello,
        peer: SocketAddr,
        stream: S,
        now: Instant,
    ) -> Result<Option<Group<S>>, String> {
        self.partial
            .retain(|_, p| now.duration_since(p.started) < self.ttl);
        if hello.stream_count == 1 {
            return Ok(Some(Group {
                hello,
                peer,
                streams: vec![stream],
            }));
        }
        let key = (hello.endpoint_id, hello.conn_nonce);
        if !self.partial.contains_key(&key) && self.partial.len() >= self.max_partial {
            return Err(format!(
                "{} connections are already half-open; refusing more",
                self.max_partial
            ));
        }
        let p = self.partial.entry(key).or_insert_with(|| Partial {
            hello,
            peer,
            streams: (0..hello.stream_count).map(|_| None).collect(),
            arrived: 0,
            started: now,
        });
        if p.hello.stream_count != hello.stream_count {
            return Err(format!(
                "stream {} says {} streams, earlier ones said {}",
                hello.stream_idx, hello.stream_count, p.hello.stream_count
            ));
        }
        let slot = &mut p.streams[hello.stream_idx as usize];
        if slot.is_some() {
            return Err(format!("stream {} arrived twice", hello.stream_idx));
        }
        *slot = Some(stream);
        p.arrived += 1;
        if p.arrived < p.streams.len() {
            return Ok(None);
        }
        let p = self.partial.remove(&key).expect("present");
        let streams = p
            .streams
            .into_iter()
            .map(|s| s.expect("all arrived"))
            .collect();
        Ok(Some(Group {
            hello: p.hello,
            peer: p.peer,
            streams,
        }))
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
    fn groups_streams_in_any_order() {
        let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let now = Instant::now();
        let mut a = Assembler::new(4, Duration::from_secs(5));
        assert!(a.offer(hello(9, 2, 3), peer, "c", now).unwrap().is_none());
        assert!(a.offer(hello(9, 0, 3), peer, "a", now).unwrap().is_none());
        assert!(a.offer(hello(8, 0, 1), peer, "x", now).unwrap().is_some());
        let g = a.offer(hello(9, 1, 3), peer, "b", now).unwrap().unwrap();
        assert_eq!(g.streams, vec!["a", "b", "c"]);
    }

    #[test]
    fn duplicates_mismatches_limits_and_expiry() {
        let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let now = Instant::now();
        let mut a = Assembler::new(1, Duration::from_secs(5));
        a.offer(hello(1, 0, 2), peer, 0, now).unwrap();
        assert!(a
            .offer(hello(1, 0, 2), peer, 0, now)
            .unwrap_err()
            .contains("twice"));
        assert!(a
            .offer(hello(1, 1, 3), peer, 0, now)
            .unwrap_err()
            .contains("3 streams"));
        assert!(a
            .offer(hello(2, 0, 2), peer, 0, now)
            .unwrap_err()
            .contains("half-open"));
        let later = now + Duration::from_secs(6);
        assert!(
            a.offer(hello(2, 0, 2), peer, 0, later).unwrap().is_none(),
            "expired partial freed its place"
        );
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

//! The accepting side of one stream's handshake, with no I/O: bytes in
//! (`rx_buf` then `received`), bytes out (`to_send` then `sent`). The
//! connecting side is `handshake.rs`; the gate (`gate.rs`) drives one of
//! these per accepted socket on its epoll loop, and `admission.rs` decides
//! when a connection is whole and whom to evict.
//!
//! Read the peer's `Hello` (refused when exactly one side has a secret);
//! the caller files it under its connection and, once every stream is
//! here and the connection is admitted, `acknowledge`s each stream: our
//! `HelloAck` (and our proof with a secret). With a secret, read the
//! peer's proof and answer `AuthOk`. `finished` once all of it is sent.
//!
//! A socket may instead open with a `Vouch` question (another endpoint
//! asking who dialed one of its connections, `Endpoint::vouch`): the
//! caller looks the answer up and `answer`s it; the socket then closes.

use super::handshake::FrameReader;
use crate::auth::{ct_eq, proof};
use crate::wire::{ControlFrame, Hello, CAP_AUTH};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Reading the peer's `Hello`.
    Hello,
    /// `Hello` read; waiting for the connection's other streams.
    Waiting,
    /// Ack (and our proof) queued; with a secret, reading the peer's proof.
    Proving,
    /// Everything sent once the output drains.
    Finished,
}

/// What a socket's bytes amounted to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Heard {
    /// Not a whole frame yet, or nothing the caller acts on.
    Nothing,
    /// The peer's `Hello`: the caller files it under its connection.
    Hello(Hello),
    /// A vouch question: the caller `answer`s it.
    Vouch { conn_nonce: u64, challenge: u64 },
}

pub(crate) struct AcceptHs {
    phase: Phase,
    rx: FrameReader,
    tx: Vec<u8>,
    tx_at: usize,
    /// Whether any byte has arrived (the first-bytes deadline).
    heard: bool,
    theirs: Option<Hello>,
    ours: Option<Hello>,
}

impl AcceptHs {
    pub fn new() -> Self {
        Self {
            phase: Phase::Hello,
            rx: FrameReader::new(),
            tx: Vec::new(),
            tx_at: 0,
            heard: false,
            theirs: None,
            ours: None,
        }
    }

    #[cfg(test)]
    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn heard(&self) -> bool {
        self.heard
    }

    /// The peer's `Hello`, once read.
    pub fn theirs(&self) -> Option<Hello> {
        self.theirs
    }

    /// Our `HelloAck`, once acknowledged.
    pub fn ours(&self) -> Option<Hello> {
        self.ours
    }

    /// Bytes to send now.
    pub fn to_send(&self) -> &[u8] {
        &self.tx[self.tx_at..]
    }

    /// The socket took `n` of them.
    pub fn sent(&mut self, n: usize) {
        self.tx_at = (self.tx_at + n).min(self.tx.len());
    }

    /// Whether it waits for bytes from the peer.
    pub fn reading(&self) -> bool {
        matches!(self.phase, Phase::Hello | Phase::Proving)
    }

    /// Where the next received bytes go.
    pub fn rx_buf(&mut self) -> &mut [u8] {
        self.rx.want()
    }

    /// `n` bytes landed in `rx_buf`. `Err`: the reason to refuse the
    /// stream.
    pub fn received(&mut self, n: usize, key: Option<&[u8]>) -> Result<Heard, String> {
        self.heard |= n > 0;
        match self.rx.filled(n) {
            Ok(None) => Ok(Heard::Nothing),
            Ok(Some(frame)) => self.on_frame(frame, key),
            Err(e) => Err(e.to_string()),
        }
    }

    fn on_frame(&mut self, frame: ControlFrame, key: Option<&[u8]>) -> Result<Heard, String> {
        match (self.phase, frame) {
            (
                Phase::Hello,
                ControlFrame::Vouch {
                    conn_nonce,
                    challenge,
                },
            ) => {
                self.phase = Phase::Waiting;
                Ok(Heard::Vouch {
                    conn_nonce,
                    challenge,
                })
            }
            (Phase::Hello, ControlFrame::Hello(theirs)) => {
                match (key.is_some(), theirs.caps & CAP_AUTH != 0) {
                    (true, false) => {
                        return Err(
                            "authentication required: this endpoint has FERRY_AUTH_KEY set".into(),
                        )
                    }
                    (false, true) => return Err(
                        "the peer requires authentication and this endpoint has no FERRY_AUTH_KEY"
                            .into(),
                    ),
                    _ => {}
                }
                self.theirs = Some(theirs);
                self.phase = Phase::Waiting;
                Ok(Heard::Hello(theirs))
            }
            (Phase::Proving, ControlFrame::Auth(mac)) => {
                let (Some(key), Some(ours), Some(theirs)) = (key, self.ours, self.theirs) else {
                    return Err("a proof where none was asked for".into());
                };
                let expected = proof(
                    key,
                    "client",
                    ours.auth_nonce,
                    theirs.auth_nonce,
                    theirs.endpoint_id,
                    ours.endpoint_id,
                );
                if !ct_eq(&mac, &expected) {
                    return Err(
                        "authentication failed: wrong or missing proof of FERRY_AUTH_KEY".into(),
                    );
                }
                self.tx.extend_from_slice(&ControlFrame::AuthOk.encode());
                self.phase = Phase::Finished;
                Ok(Heard::Nothing)
            }
            (Phase::Hello, other) => Err(format!("expected Hello, got {other:?}")),
            (_, _) => Err("authentication failed: wrong or missing proof of FERRY_AUTH_KEY".into()),
        }
    }

    /// The connection is whole and admitted: queues our `HelloAck` (built
    /// from `ours`, this stream's numbers copied from the peer's) and, with
    /// a secret, our proof. Only after the peer's `Hello`.
    pub fn acknowledge(&mut self, mut ours: Hello, key: Option<&[u8]>) {
        let t = self.theirs.expect("acknowledged after the peer's Hello");
        ours.conn_nonce = t.conn_nonce;
        ours.stream_idx = t.stream_idx;
        ours.stream_count = t.stream_count;
        self.tx
            .extend_from_slice(&ControlFrame::HelloAck(ours).encode());
        self.ours = Some(ours);
        match key {
            Some(k) => {
                let mine = proof(
                    k,
                    "server",
                    t.auth_nonce,
                    ours.auth_nonce,
                    ours.endpoint_id,
                    t.endpoint_id,
                );
                self.tx
                    .extend_from_slice(&ControlFrame::Auth(mine).encode());
                self.phase = Phase::Proving;
            }
            None => self.phase = Phase::Finished,
        }
    }

    /// Answers a vouch question (only after `Heard::Vouch`): the socket is
    /// finished once the answer is sent.
    pub fn answer(&mut self, answer: ControlFrame) {
        debug_assert!(self.theirs.is_none() && self.phase == Phase::Waiting);
        self.tx.extend_from_slice(&answer.encode());
        self.phase = Phase::Finished;
    }

    /// Done, and all of it sent.
    pub fn finished(&self) -> bool {
        self.phase == Phase::Finished && self.to_send().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(id: u64, auth: bool) -> Hello {
        Hello {
            endpoint_id: id,
            caps: if auth { CAP_AUTH } else { 0 },
            conn_nonce: 77,
            stream_idx: 1,
            stream_count: 2,
            max_inflight: 8,
            host_token: 0,
            auth_nonce: 1234,
        }
    }

    /// Feeds `bytes` in pieces of `step`, as a socket might.
    fn feed(
        hs: &mut AcceptHs,
        bytes: &[u8],
        step: usize,
        key: Option<&[u8]>,
    ) -> Result<Option<Hello>, String> {
        Ok(match feed_any(hs, bytes, step, key)? {
            Heard::Hello(h) => Some(h),
            _ => None,
        })
    }

    fn feed_any(
        hs: &mut AcceptHs,
        bytes: &[u8],
        step: usize,
        key: Option<&[u8]>,
    ) -> Result<Heard, String> {
        let mut at = 0;
        let mut got = Heard::Nothing;
        while at < bytes.len() {
            let buf = hs.rx_buf();
            let n = buf.len().min(step).min(bytes.len() - at);
            buf[..n].copy_from_slice(&bytes[at..at + n]);
            at += n;
            match hs.received(n, key)? {
                Heard::Nothing => {}
                h => got = h,
            }
        }
        Ok(got)
    }

    #[test]
    fn a_vouch_question_is_answered_once_and_the_socket_is_done() {
        let mut hs = AcceptHs::new();
        let q = ControlFrame::Vouch {
            conn_nonce: 7,
            challenge: 8,
        };
        let got = feed_any(&mut hs, &q.encode(), 5, None).unwrap();
        assert_eq!(
            got,
            Heard::Vouch {
                conn_nonce: 7,
                challenge: 8
            }
        );
        assert!(!hs.reading() && !hs.finished());
        let a = ControlFrame::Vouched {
            dialed: None,
            mac: [1; 32],
        };
        hs.answer(a.clone());
        assert_eq!(frames(&mut hs), vec![a]);
        assert!(hs.finished());
        // A second question is not read: the socket is done.
        let mut again = AcceptHs::new();
        feed_any(&mut again, &q.encode(), 64, None).unwrap();
        assert!(feed_any(&mut again, &q.encode(), 64, None).is_err() || !again.reading());
    }

    /// The frames queued to send, decoded.
    fn frames(hs: &mut AcceptHs) -> Vec<ControlFrame> {
        let mut out = Vec::new();
        let mut r = FrameReader::new();
        let bytes = hs.to_send().to_vec();
        hs.sent(bytes.len());
        let mut at = 0;
        while at < bytes.len() {
            let buf = r.want();
            let n = buf.len().min(bytes.len() - at);
            buf[..n].copy_from_slice(&bytes[at..at + n]);
            at += n;
            if let Some(f) = r.filled(n).unwrap() {
                out.push(f);
            }
        }
        out
    }

    #[test]
    fn without_a_secret_a_hello_is_acked_and_done() {
        let mut hs = AcceptHs::new();
        assert!(hs.reading() && !hs.heard());
        let h = hello(9, false);
        let got = feed(&mut hs, &ControlFrame::Hello(h).encode(), 3, None).unwrap();
        assert_eq!(got, Some(h));
        assert_eq!(hs.phase(), Phase::Waiting);
        assert!(!hs.reading() && hs.heard());
        hs.acknowledge(hello(5, false), None);
        assert!(!hs.finished(), "not until it is sent");
        match frames(&mut hs).as_slice() {
            [ControlFrame::HelloAck(a)] => {
                assert_eq!(
                    (a.endpoint_id, a.conn_nonce, a.stream_idx, a.stream_count),
                    (5, 77, 1, 2)
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(hs.finished());
    }

    #[test]
    fn with_a_secret_both_sides_prove_it() {
        let key = b"0123456789abcdef".as_slice();
        let mut hs = AcceptHs::new();
        let theirs = hello(9, true);
        feed(
            &mut hs,
            &ControlFrame::Hello(theirs).encode(),
            1000,
            Some(key),
        )
        .unwrap();
        hs.acknowledge(hello(5, true), Some(key));
        let ours = match frames(&mut hs).as_slice() {
            [ControlFrame::HelloAck(a), ControlFrame::Auth(_)] => *a,
            other => panic!("{other:?}"),
        };
        assert_eq!(hs.phase(), Phase::Proving);
        // A wrong proof is refused ...
        let mut bad = AcceptHs::new();
        feed(
            &mut bad,
            &ControlFrame::Hello(theirs).encode(),
            1000,
            Some(key),
        )
        .unwrap();
        bad.acknowledge(ours, Some(key));
        let e = feed(
            &mut bad,
            &ControlFrame::Auth([7; 32]).encode(),
            1000,
            Some(key),
        )
        .unwrap_err();
        assert!(e.contains("authentication failed"), "{e}");
        // ... the right one answered.
        let mac = proof(key, "client", ours.auth_nonce, theirs.auth_nonce, 9, 5);
        feed(&mut hs, &ControlFrame::Auth(mac).encode(), 5, Some(key)).unwrap();
        assert!(matches!(frames(&mut hs).as_slice(), [ControlFrame::AuthOk]));
        assert!(hs.finished());
    }

    #[test]
    fn a_secret_on_one_side_only_or_a_wrong_frame_is_refused() {
        let key = b"0123456789abcdef".as_slice();
        for (theirs_auth, ours_key, want) in [
            (false, Some(key), "authentication required"),
            (true, None, "has no FERRY_AUTH_KEY"),
        ] {
            let mut hs = AcceptHs::new();
            let e = feed(
                &mut hs,
                &ControlFrame::Hello(hello(1, theirs_auth)).encode(),
                1000,
                ours_key,
            )
            .unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        let mut hs = AcceptHs::new();
        let e = feed(&mut hs, &ControlFrame::AuthOk.encode(), 1000, None).unwrap_err();
        assert!(e.contains("expected Hello"), "{e}");
    }
}

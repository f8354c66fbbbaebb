//! The same-host CONNECT protocol, beside the tcp handshake's
//! (`oob/handshake.rs`): what a connector puts in its CONNECT (pushed into
//! the peer's accept ring) and what it checks of the CONNECT_ACK (popped
//! from the ring it made for the answer); what an acceptor checks of a
//! CONNECT and puts in its answer. Messages and proofs only: the endpoint
//! makes the rings and adopts the connection.
//!
//! With a shared secret, CONNECT carries the connector's proof of it and
//! the answer the acceptor's (`auth::proof`, domain-separated from the tcp
//! ones), each over the other side's id and the connector's nonce.

use std::time::{Duration, Instant};

use super::cma::CMA_CANARY;
use super::named_ring::ShmRing;
use super::ring::SLOT_PAYLOAD;
use crate::auth::{ct_eq, proof};
use crate::error::{ConnFault, Error, Result};
use crate::sys::this_pid;
use crate::wire::shm_msg::{Msg, MsgKind, MAX_INLINE};

/// A side delivers a notification that rides in a WRITE request
/// (`local::REQ_NOTE`) once that request's copy has landed.
pub(crate) const FEATURE_NOTES_RIDE: u32 = 1;
/// What this build understands.
const FEATURES: u32 = FEATURE_NOTES_RIDE;

/// What one side says of itself in CONNECT or its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Side {
    pub endpoint_id: u64,
    pub pid: u32,
    /// Its number for the connection (echoed in every message).
    pub conn: u32,
    /// Requests it lets the other have in flight.
    pub inflight: u32,
    /// What it understands beyond the base protocol (`FEATURE_*`; an
    /// older peer says 0).
    pub features: u32,
    /// An address in its memory the other side reads with CMA to check
    /// that it can (`cma::probe_cma`).
    pub canary: u64,
}

/// The CONNECT a connector sends, with its proof (if it has the secret).
pub(crate) fn connect_msg(
    me: &Side,
    nonce: u64,
    peer_id: u64,
    key: Option<&[u8]>,
) -> (Msg, Vec<u8>) {
    let mut m = Msg::new(MsgKind::Connect);
    m.conn = me.conn;
    m.addr = u64::from(me.pid);
    m.aux = me.endpoint_id;
    m.aux2 = nonce;
    m.src_key = me.inflight;
    m.src_addr = me.canary;
    m.rkey = me.features;
    let p = key.map_or_else(Vec::new, |k| {
        proof(k, "local-client", peer_id, nonce, me.endpoint_id, peer_id).to_vec()
    });
    (m, p)
}

/// This process, as a side of a connection `conn` letting `inflight`
/// requests in.
pub(crate) fn this_side(endpoint_id: u64, conn: u32, inflight: u32) -> Side {
    Side {
        endpoint_id,
        pid: this_pid(),
        conn,
        inflight,
        canary: &CMA_CANARY as *const u64 as u64,
        features: FEATURES,
    }
}

/// The connector's side as its CONNECT says, once its proof checks out
/// (`Err`: why it is refused).
pub(crate) fn check_connect(
    m: &Msg,
    inline: &[u8],
    my_id: u64,
    key: Option<&[u8]>,
) -> std::result::Result<Side, ConnFault> {
    if let Some(k) = key {
        let expected = proof(k, "local-client", my_id, m.aux2, m.aux, my_id);
        if !ct_eq(inline, &expected) {
            return Err(ConnFault::refused(
                "authentication failed: wrong or missing proof of FERRY_AUTH_KEY",
            ));
        }
    }
    Ok(Side {
        endpoint_id: m.aux,
        pid: m.addr as u32,
        conn: m.conn,
        inflight: m.src_key,
        canary: m.src_addr,
        features: m.rkey,
    })
}

/// The acceptor's answer to a CONNECT (nonce `nonce`): `Ok` with its side
/// and proof, or a refusal with its reason.
pub(crate) fn ack_msg(
    me: &Side,
    answer: std::result::Result<u64, &str>,
    key: Option<&[u8]>,
    peer_id: u64,
) -> (Msg, Vec<u8>) {
    let mut ack = Msg::new(MsgKind::ConnectAck);
    ack.aux = me.endpoint_id;
    ack.addr = u64::from(me.pid);
    match answer {
        Err(why) => {
            ack.status = 1;
            let text = why.as_bytes();
            (ack, text[..text.len().min(MAX_INLINE)].to_vec())
        }
        Ok(nonce) => {
            ack.conn = me.conn;
            ack.src_key = me.inflight;
            ack.src_addr = me.canary;
            ack.rkey = me.features;
            let p = key.map_or_else(Vec::new, |k| {
                proof(k, "local-server", nonce, 0, me.endpoint_id, peer_id).to_vec()
            });
            (ack, p)
        }
    }
}

/// The acceptor's side as its answer says, once it checks out: from
/// `peer_id`, not a refusal, with the right proof.
pub(crate) fn check_ack(
    ack: &Msg,
    inline: &[u8],
    peer_id: u64,
    my_id: u64,
    nonce: u64,
    key: Option<&[u8]>,
) -> std::result::Result<Side, ConnFault> {
    if ack.kind != MsgKind::ConnectAck || ack.aux != peer_id {
        return Err(ConnFault::misbehaved(format!(
            "peer answered {:?} from {:#x}",
            ack.kind, ack.aux
        )));
    }
    if ack.status != 0 {
        return Err(ConnFault::refused(format!(
            "peer refused: {}",
            String::from_utf8_lossy(inline)
        )));
    }
    if let Some(k) = key {
        let expected = proof(k, "local-server", nonce, 0, peer_id, my_id);
        if !ct_eq(inline, &expected) {
            return Err(ConnFault::misbehaved(
                "the peer's authentication proof is wrong or missing",
            ));
        }
    }
    Ok(Side {
        endpoint_id: ack.aux,
        pid: ack.addr as u32,
        conn: ack.conn,
        inflight: ack.src_key,
        canary: ack.src_addr,
        features: ack.rkey,
    })
}

/// Pushes one message, waiting for room until `deadline`.
pub(crate) fn push_msg(ring: &ShmRing, m: &Msg, inline: &[u8], deadline: Instant) -> Result<()> {
    let mut buf = [0u8; SLOT_PAYLOAD];
    let n = m.encode(inline, &mut buf);
    while ring.push(&buf[..n]).is_err() {
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: "room in a local peer's ring",
                timeout_ms: 0,
            });
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    Ok(())
}

/// Waits until `deadline` for the one message a fresh ring gets (the
/// answer to CONNECT): the message and its inline bytes.
pub(crate) fn await_msg(
    rx: &ShmRing,
    deadline: Instant,
    timeout_ms: u64,
) -> Result<(Msg, Vec<u8>)> {
    let mut buf = [0u8; SLOT_PAYLOAD];
    loop {
        if let Some(n) = rx.ring.pop(&mut buf) {
            let (m, inline) = Msg::decode(&buf[..n])?;
            return Ok((m, inline.to_vec()));
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: "a local peer's CONNECT answer",
                timeout_ms,
            });
        }
        std::thread::sleep(Duration::from_micros(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"a shared secret!";

    fn side(id: u64, conn: u32) -> Side {
        Side {
            endpoint_id: id,
            pid: 4242,
            conn,
            inflight: 64,
            canary: 0x1000,
            features: FEATURES,
        }
    }

    /// Encodes and decodes, as the ring would.
    fn wire(m: &Msg, inline: &[u8]) -> (Msg, Vec<u8>) {
        let mut buf = [0u8; SLOT_PAYLOAD];
        let n = m.encode(inline, &mut buf);
        let (m, i) = Msg::decode(&buf[..n]).unwrap();
        (m, i.to_vec())
    }

    #[test]
    fn a_connection_with_and_without_the_secret() {
        for key in [None, Some(KEY)] {
            let (a, b) = (side(1, 7), side(2, 9));
            let (m, p) = connect_msg(&a, 555, 2, key);
            let (m, p) = wire(&m, &p);
            let seen = check_connect(&m, &p, 2, key).unwrap();
            assert_eq!(seen, a);
            let (ack, ap) = ack_msg(&b, Ok(m.aux2), key, 1);
            let (ack, ap) = wire(&ack, &ap);
            assert_eq!(check_ack(&ack, &ap, 2, 1, 555, key).unwrap(), b);
            // The answer to another nonce, or from another endpoint, fails.
            if key.is_some() {
                assert!(check_ack(&ack, &ap, 2, 1, 556, key)
                    .unwrap_err()
                    .to_string()
                    .contains("proof"));
            }
            assert!(check_ack(&ack, &ap, 3, 1, 555, key)
                .unwrap_err()
                .to_string()
                .contains("from 0x2"));
        }
    }

    #[test]
    fn a_wrong_or_missing_proof_and_a_refusal_say_why() {
        let a = side(1, 7);
        let (m, _) = connect_msg(&a, 555, 2, None);
        let e = check_connect(&m, &[], 2, Some(KEY)).unwrap_err();
        assert!(e.to_string().contains("authentication failed"), "{e}");
        let (m, p) = connect_msg(&a, 555, 2, Some(b"another secret!!"));
        assert!(check_connect(&m, &p, 2, Some(KEY)).is_err());
        let (ack, text) = ack_msg(&side(2, 0), Err("too many connections"), None, 1);
        let (ack, text) = wire(&ack, &text);
        let e = check_ack(&ack, &text, 2, 1, 555, None).unwrap_err();
        assert!(
            e.to_string().contains("peer refused: too many connections"),
            "{e}"
        );
    }
}

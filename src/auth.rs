//! Peer authentication and frame integrity over a shared secret
//! (`FERRY_AUTH_KEY`): HMAC-SHA256 (RustCrypto's `hmac` and `sha2`, which
//! use the CPU's SHA extensions where it has them) for the handshake's
//! challenge-response and for the per-frame MACs of an authenticated
//! connection. The tests check it against the standard vectors (FIPS 180-2,
//! RFC 4231).

use hmac::{Hmac, Mac as _};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// A 32-byte MAC.
pub type Mac = [u8; 32];

/// Bytes of a frame MAC on the wire (HMAC-SHA256 cut to 128 bits).
pub const TAG_LEN: usize = 16;

/// A frame tag.
pub type Tag = [u8; TAG_LEN];

/// HMAC-SHA256 of the concatenation of `parts` (RFC 2104).
pub fn hmac(key: &[u8], parts: &[&[u8]]) -> Mac {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// One direction of one stream's frame MACs: a key derived from the shared
/// secret and both sides' handshake nonces, so tags from another session,
/// stream or direction never verify. Keyed once; each tag clones the keyed
/// state (no per-frame key schedule).
#[derive(Clone)]
pub struct FrameKey(HmacSha256);

impl std::fmt::Debug for FrameKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FrameKey(..)")
    }
}

/// Which way a frame goes on a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    ClientToServer,
    ServerToClient,
}

impl FrameKey {
    /// The key for `dir` on the stream whose handshake carried these
    /// nonces and endpoint ids.
    pub fn derive(
        secret: &[u8],
        dir: Direction,
        client_nonce: u64,
        server_nonce: u64,
        client_id: u64,
        server_id: u64,
    ) -> FrameKey {
        let label: &[u8] = match dir {
            Direction::ClientToServer => b"c2s",
            Direction::ServerToClient => b"s2c",
        };
        let k = hmac(
            secret,
            &[
                b"ferry-frames-v1:",
                label,
                &client_nonce.to_le_bytes(),
                &server_nonce.to_le_bytes(),
                &client_id.to_le_bytes(),
                &server_id.to_le_bytes(),
            ],
        );
        FrameKey(HmacSha256::new_from_slice(&k).expect("32-byte key"))
    }

    /// Starts the tag of frame number `seq` (frames of one direction of a
    /// stream are numbered from 0, so a replayed, dropped or reordered
    /// frame does not verify).
    pub fn start(&self, seq: u64) -> TagRun {
        let mut m = self.0.clone();
        m.update(&seq.to_le_bytes());
        TagRun(m)
    }

    /// The tag of frame `seq` over `parts`.
    pub fn tag(&self, seq: u64, parts: &[&[u8]]) -> Tag {
        let mut r = self.start(seq);
        for p in parts {
            r.update(p);
        }
        r.finish()
    }
}

/// A tag being computed over bytes that arrive in pieces.
pub struct TagRun(HmacSha256);

impl TagRun {
    pub fn update(&mut self, b: &[u8]) {
        self.0.update(b);
    }

    pub fn finish(self) -> Tag {
        let full: Mac = self.0.finalize().into_bytes().into();
        full[..TAG_LEN].try_into().expect("16 of 32 bytes")
    }
}

/// Equality that takes the same time wherever the inputs differ.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The proof one side sends: HMAC over a role label, both nonces (the
/// sender's peer's first, so each side signs the other's challenge) and
/// both endpoint ids.
pub fn proof(
    key: &[u8],
    role: &str,
    their_nonce: u64,
    my_nonce: u64,
    my_id: u64,
    their_id: u64,
) -> Mac {
    hmac(
        key,
        &[
            b"ferry-auth-v1:",
            role.as_bytes(),
            &their_nonce.to_le_bytes(),
            &my_nonce.to_le_bytes(),
            &my_id.to_le_bytes(),
            &their_id.to_le_bytes(),
        ],
    )
}

/// The MAC of a vouch answer (`ControlFrame::Vouched`): over the asked
/// connection nonce, the asker's fresh challenge and the answer's address
/// bytes, so an answer cannot be replayed for another question or altered
/// on the way.
pub fn vouch_mac(key: &[u8], conn_nonce: u64, challenge: u64, dialed: &[u8]) -> Mac {
    hmac(
        key,
        &[
            b"ferry-vouch-v1:",
            &conn_nonce.to_le_bytes(),
            &challenge.to_le_bytes(),
            dialed,
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::Digest;

    fn sha256(data: &[u8]) -> [u8; 32] {
        Sha256::digest(data).into()
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn sha256_standard_vectors() {
        assert_eq!(
            hex(&sha256(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            hex(&sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex(&sha256(
                b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"
            )),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        let million = vec![b'a'; 1_000_000];
        assert_eq!(
            hex(&sha256(&million)),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"
        );
    }

    #[test]
    fn hmac_rfc4231_vectors() {
        // Test case 1.
        let m = hmac(&[0x0b; 20], &[b"Hi There"]);
        assert_eq!(
            hex(&m),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        // Test case 2, message split into parts.
        let m = hmac(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
        assert_eq!(
            hex(&m),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Test case 6: a key longer than the block.
        let m = hmac(
            &[0xaa; 131],
            &[b"Test Using Larger Than Block-Size Key - Hash Key First"],
        );
        assert_eq!(
            hex(&m),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn frame_tags_are_truncated_hmac_and_bound_to_seq_direction_and_session() {
        let k = FrameKey::derive(b"secret", Direction::ClientToServer, 1, 2, 3, 4);
        let t = k.tag(7, &[b"head", b"er"]);
        let mut run = k.start(7);
        run.update(b"header");
        assert_eq!(run.finish(), t, "pieces or whole: the same tag");
        let raw = hmac(
            &hmac(
                b"secret",
                &[
                    b"ferry-frames-v1:",
                    b"c2s",
                    &1u64.to_le_bytes(),
                    &2u64.to_le_bytes(),
                    &3u64.to_le_bytes(),
                    &4u64.to_le_bytes(),
                ],
            ),
            &[&7u64.to_le_bytes(), b"header"],
        );
        assert_eq!(&raw[..TAG_LEN], &t[..]);
        assert_ne!(k.tag(8, &[b"header"]), t, "another seq");
        let back = FrameKey::derive(b"secret", Direction::ServerToClient, 1, 2, 3, 4);
        assert_ne!(back.tag(7, &[b"header"]), t, "the other direction");
        let other = FrameKey::derive(b"secret", Direction::ClientToServer, 1, 9, 3, 4);
        assert_ne!(other.tag(7, &[b"header"]), t, "another session");
    }

    #[test]
    fn proofs_differ_by_role_nonce_and_key() {
        let p = proof(b"k", "client", 1, 2, 3, 4);
        assert!(ct_eq(&p, &proof(b"k", "client", 1, 2, 3, 4)));
        assert!(!ct_eq(&p, &proof(b"k", "server", 1, 2, 3, 4)));
        assert!(!ct_eq(&p, &proof(b"k", "client", 9, 2, 3, 4)));
        assert!(!ct_eq(&p, &proof(b"x", "client", 1, 2, 3, 4)));
        assert!(!ct_eq(&p, &p[..31]));
    }
}

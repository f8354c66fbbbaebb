//! The engine's own messages for two-sided send/recv, carried as
//! notifications of kind `NOTE_CTL` (never shown to the application).
//!
//! A receive is a buffer the receiver offers: it grants the peer a write
//! window over it and says so (`Cts`, clear to send, numbered in posting
//! order per connection); the sender matches its sends to those numbers,
//! WRITEs each message into its window (one-sided, bounds-checked by the
//! receiver's shard like any WRITE) and, once the WRITE completed, says
//! `Fin` with the length. Nothing lands where no buffer was posted, and a
//! message longer than its buffer is refused before a byte moves.
//!
//! ```text
//! Cts: 1 u8 | seq u64 | window 64 bytes (RemoteBuf: the buffer)  = 73 bytes
//! Fin: 2 u8 | seq u64 | status u8 | len u64                      = 18 bytes
//! ```

use super::cursor::{DecodeError, Reader};
use super::remote_buf::{RemoteBuf, REMOTE_BUF_LEN};

const WHAT: &str = "two-sided message";

/// How a receive ended, as the receiver tells the sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FinStatus {
    /// The message (`len` bytes) is in the receiver's buffer.
    Ok = 0,
    /// The message (`len` bytes) was longer than the buffer; nothing moved.
    TooLarge = 1,
    /// The buffer was not used: the sender's WRITE failed, or the offer
    /// was refused (more unmatched offers than the peer holds).
    Failed = 2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtlMsg {
    /// Receive buffer `seq` of this connection, writable at `window`.
    Cts { seq: u64, window: RemoteBuf },
    /// Buffer `seq` got its message (or never will); its window can go.
    Fin {
        seq: u64,
        status: FinStatus,
        len: u64,
    },
}

impl CtlMsg {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + 16 + REMOTE_BUF_LEN);
        match self {
            CtlMsg::Cts { seq, window } => {
                out.push(1);
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&window.encode());
            }
            CtlMsg::Fin { seq, status, len } => {
                out.push(2);
                out.extend_from_slice(&seq.to_le_bytes());
                out.push(*status as u8);
                out.extend_from_slice(&len.to_le_bytes());
            }
        }
        out
    }

    pub fn decode(buf: &[u8]) -> Result<CtlMsg, DecodeError> {
        let mut r = Reader::new(buf, WHAT);
        let msg = match r.u8()? {
            1 => CtlMsg::Cts {
                seq: r.u64_le()?,
                window: RemoteBuf::decode(r.bytes(REMOTE_BUF_LEN)?)?,
            },
            2 => {
                let seq = r.u64_le()?;
                let status = match r.u8()? {
                    0 => FinStatus::Ok,
                    1 => FinStatus::TooLarge,
                    2 => FinStatus::Failed,
                    got => {
                        return Err(DecodeError::Invalid {
                            what: WHAT,
                            reason: format!("unknown status {got}"),
                        })
                    }
                };
                CtlMsg::Fin {
                    seq,
                    status,
                    len: r.u64_le()?,
                }
            }
            got => return Err(DecodeError::UnknownKind { what: WHAT, got }),
        };
        r.finish()?;
        Ok(msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_bad_ones_are_refused() {
        let window = RemoteBuf {
            addr: 0x1000,
            size: 100,
            rkey: 7,
            ..Default::default()
        };
        for m in [
            CtlMsg::Cts { seq: 3, window },
            CtlMsg::Fin {
                seq: 9,
                status: FinStatus::TooLarge,
                len: 64,
            },
        ] {
            assert_eq!(CtlMsg::decode(&m.encode()).unwrap(), m);
        }
        let mut cts = CtlMsg::Cts { seq: 0, window }.encode();
        cts.pop();
        assert!(CtlMsg::decode(&cts).is_err(), "a short window");
        let mut fin = CtlMsg::Fin {
            seq: 1,
            status: FinStatus::Ok,
            len: 0,
        }
        .encode();
        fin[9] = 7;
        assert!(CtlMsg::decode(&fin).is_err(), "unknown status");
        assert!(CtlMsg::decode(&[3]).is_err(), "unknown kind");
        assert!(CtlMsg::decode(&[2, 0]).is_err(), "truncated");
        let mut extra = CtlMsg::Fin {
            seq: 1,
            status: FinStatus::Ok,
            len: 0,
        }
        .encode();
        extra.push(0);
        assert!(CtlMsg::decode(&extra).is_err(), "trailing bytes");
    }
}

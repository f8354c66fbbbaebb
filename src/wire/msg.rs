//! The engine's own messages for two-sided send/recv, carried as
//! notifications of kind `NOTE_CTL` (never shown to the application).
//!
//! A send is a rendezvous the receiver pulls: the sender grants the peer a
//! read window over the message and says so (`Rts`); the receiver matches
//! it, in sequence order per connection, to its oldest posted receive,
//! READs the bytes into that buffer (one-sided, bounds-checked like any
//! READ), and answers `Fin`. No receiver holds a byte it did not post a
//! buffer for, and a sender's memory is read only through its own grant.
//!
//! ```text
//! Rts: 1 u8 | seq u64 | len u64 | window 64 bytes (RemoteBuf)   = 81 bytes
//! Fin: 2 u8 | seq u64 | status u8 | posted u64                  = 18 bytes
//! ```

use super::cursor::{DecodeError, Reader};
use super::remote_buf::{RemoteBuf, REMOTE_BUF_LEN};

const WHAT: &str = "two-sided message";

/// How a receive ended, as the receiver tells the sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FinStatus {
    /// The bytes are in the receiver's buffer.
    Ok = 0,
    /// The message was longer than the buffer posted for it (`posted`).
    TooLarge = 1,
    /// The receiver's READ failed (its reason stays with the receiver).
    Failed = 2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtlMsg {
    /// Message `seq` of this connection: `len` bytes, readable at `window`.
    Rts {
        seq: u64,
        len: u64,
        window: RemoteBuf,
    },
    /// Message `seq` was taken (or refused); its window can go.
    Fin {
        seq: u64,
        status: FinStatus,
        posted: u64,
    },
}

impl CtlMsg {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + 16 + REMOTE_BUF_LEN);
        match self {
            CtlMsg::Rts { seq, len, window } => {
                out.push(1);
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
                out.extend_from_slice(&window.encode());
            }
            CtlMsg::Fin {
                seq,
                status,
                posted,
            } => {
                out.push(2);
                out.extend_from_slice(&seq.to_le_bytes());
                out.push(*status as u8);
                out.extend_from_slice(&posted.to_le_bytes());
            }
        }
        out
    }

    pub fn decode(buf: &[u8]) -> Result<CtlMsg, DecodeError> {
        let mut r = Reader::new(buf, WHAT);
        let msg = match r.u8()? {
            1 => {
                let seq = r.u64_le()?;
                let len = r.u64_le()?;
                let window = RemoteBuf::decode(r.bytes(REMOTE_BUF_LEN)?)?;
                if len > window.size as u64 {
                    return Err(DecodeError::Invalid {
                        what: WHAT,
                        reason: format!("{len} bytes in a window of {}", window.size),
                    });
                }
                CtlMsg::Rts { seq, len, window }
            }
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
                    posted: r.u64_le()?,
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
            CtlMsg::Rts {
                seq: 3,
                len: 100,
                window,
            },
            CtlMsg::Fin {
                seq: 9,
                status: FinStatus::TooLarge,
                posted: 64,
            },
        ] {
            assert_eq!(CtlMsg::decode(&m.encode()).unwrap(), m);
        }
        let long = CtlMsg::Rts {
            seq: 0,
            len: 101,
            window,
        };
        assert!(
            CtlMsg::decode(&long.encode()).is_err(),
            "len past its window"
        );
        let mut fin = CtlMsg::Fin {
            seq: 1,
            status: FinStatus::Ok,
            posted: 0,
        }
        .encode();
        fin[9] = 7;
        assert!(CtlMsg::decode(&fin).is_err(), "unknown status");
        assert!(CtlMsg::decode(&[3]).is_err(), "unknown kind");
        assert!(CtlMsg::decode(&[2, 0]).is_err(), "truncated");
        let mut extra = CtlMsg::Fin {
            seq: 1,
            status: FinStatus::Ok,
            posted: 0,
        }
        .encode();
        extra.push(0);
        assert!(CtlMsg::decode(&extra).is_err(), "trailing bytes");
    }
}

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
//! A small message (at most [`MAX_EAGER_BYTES`]) may instead travel inside
//! the notification itself (`Eager`), without waiting for the offer: the
//! receiver copies it into the buffer posted for its number (or holds it,
//! within bounds of its own, until that buffer is posted) and answers
//! `Ack`; `Again` in the answer means "not taken, send it the usual way"
//! (no room to hold it, or a buffer the CPU cannot write).
//!
//! Past that, between processes of one host, a message may go eagerly
//! into a bounce buffer the receiver owns and offered once (`Grant`: a
//! window of `slots` slots of `slot_bytes`): the sender WRITEs it into a
//! free slot with `Landed` riding on the WRITE, the receiver copies it out
//! into the buffer posted for its number, answers `Ack` as for `Eager`,
//! and says `Released` once the slot is free again.
//!
//! ```text
//! Cts:      1 u8 | seq u64 | window 64 bytes (RemoteBuf: the buffer) = 73 bytes
//! Fin:      2 u8 | seq u64 | status u8 | len u64                     = 18 bytes
//! Eager:    3 u8 | seq u64 | the message (0..=MAX_EAGER_BYTES)       = 9 + len
//! Ack:      4 u8 | seq u64 | status u8 | len u64                     = 18 bytes
//! Grant:    5 u8 | slots u16 | slot_bytes u32 | window (64 or 136)   = 71 or 143
//! Landed:   6 u8 | seq u64 | slot u16 | len u32                      = 15 bytes
//! Released: 7 u8 | slot u16                                          = 3 bytes
//! ```

use super::cursor::{DecodeError, Reader};
use super::remote_buf::{RemoteBuf, REMOTE_BUF_LEN};
use super::window::AnyWindow;

const WHAT: &str = "two-sided message";

/// The longest message sent eagerly (inside one notification).
pub const MAX_EAGER_BYTES: usize = 8192;
/// An `Eager` message's bytes before the payload (kind and number).
pub const EAGER_HEADER_LEN: usize = 9;
/// The most slots a `Grant` may offer (a sender keeps them in a `u64`).
pub const MAX_BOUNCE_SLOTS: u16 = 64;
/// The largest bounce slot a `Grant` may offer.
pub const MAX_BOUNCE_SLOT_BYTES: u32 = 1 << 20;

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
    /// (`Ack` only) The eager message was not taken: the receiver had no
    /// room to hold it or its buffer is not host memory. The sender sends
    /// it again the usual way (into the offered window).
    Again = 3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtlMsg<'a> {
    /// Receive buffer `seq` of this connection, writable at `window`.
    Cts { seq: u64, window: RemoteBuf },
    /// Buffer `seq` got its message (or never will); its window can go.
    Fin {
        seq: u64,
        status: FinStatus,
        len: u64,
    },
    /// Message `seq` itself, sent without waiting for its buffer's offer.
    Eager { seq: u64, payload: &'a [u8] },
    /// What became of eager message `seq`: `Ok` (`len` bytes are in the
    /// buffer), `TooLarge` (`len` is the buffer's size; the receive failed
    /// too), `Again` (send it the usual way) or `Failed`.
    Ack {
        seq: u64,
        status: FinStatus,
        len: u64,
    },
    /// A bounce buffer of the receiver's: `window` holds `slots` slots of
    /// `slot_bytes` each, where the sender may WRITE messages eagerly.
    Grant {
        slots: u16,
        slot_bytes: u32,
        window: AnyWindow,
    },
    /// (Riding on the WRITE into the slot.) Message `seq`, `len` bytes, is
    /// in bounce slot `slot`.
    Landed { seq: u64, slot: u16, len: u32 },
    /// The receiver is done with bounce slot `slot`: it may be written again.
    Released { slot: u16 },
}

impl CtlMsg<'_> {
    /// The message as a notification payload: `prefix` (the notification's
    /// kind byte) first.
    pub fn encode_after(&self, prefix: u8) -> Vec<u8> {
        let payload = match self {
            CtlMsg::Eager { payload, .. } => payload.len(),
            _ => 0,
        };
        let mut out = Vec::with_capacity(2 + 16 + REMOTE_BUF_LEN + payload);
        out.push(prefix);
        self.encode_into(&mut out);
        out
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + 16 + REMOTE_BUF_LEN);
        self.encode_into(&mut out);
        out
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
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
            CtlMsg::Eager { seq, payload } => {
                out.push(3);
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(payload);
            }
            CtlMsg::Ack { seq, status, len } => {
                out.push(4);
                out.extend_from_slice(&seq.to_le_bytes());
                out.push(*status as u8);
                out.extend_from_slice(&len.to_le_bytes());
            }
            CtlMsg::Grant {
                slots,
                slot_bytes,
                window,
            } => {
                out.push(5);
                out.extend_from_slice(&slots.to_le_bytes());
                out.extend_from_slice(&slot_bytes.to_le_bytes());
                out.extend_from_slice(&window.encode());
            }
            CtlMsg::Landed { seq, slot, len } => {
                out.push(6);
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&slot.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
            }
            CtlMsg::Released { slot } => {
                out.push(7);
                out.extend_from_slice(&slot.to_le_bytes());
            }
        }
    }

    pub fn decode(buf: &[u8]) -> Result<CtlMsg<'_>, DecodeError> {
        let mut r = Reader::new(buf, WHAT);
        let msg = match r.u8()? {
            1 => CtlMsg::Cts {
                seq: r.u64_le()?,
                window: RemoteBuf::decode(r.bytes(REMOTE_BUF_LEN)?)?,
            },
            2 => {
                let seq = r.u64_le()?;
                let status = status(r.u8()?, false)?;
                CtlMsg::Fin {
                    seq,
                    status,
                    len: r.u64_le()?,
                }
            }
            3 => {
                let seq = r.u64_le()?;
                // The rest is the message (the kind and seq were read).
                let len = buf.len() - EAGER_HEADER_LEN;
                if len > MAX_EAGER_BYTES {
                    return Err(DecodeError::TooLong {
                        what: WHAT,
                        len: len as u64,
                        max: MAX_EAGER_BYTES as u64,
                    });
                }
                CtlMsg::Eager {
                    seq,
                    payload: r.bytes(len)?,
                }
            }
            4 => {
                let seq = r.u64_le()?;
                let status = status(r.u8()?, true)?;
                CtlMsg::Ack {
                    seq,
                    status,
                    len: r.u64_le()?,
                }
            }
            5 => {
                let slots = r.u16_le()?;
                let slot_bytes = r.u32_le()?;
                let window = AnyWindow::decode(r.rest())?;
                grant_fits(slots, slot_bytes, &window)?;
                CtlMsg::Grant {
                    slots,
                    slot_bytes,
                    window,
                }
            }
            6 => CtlMsg::Landed {
                seq: r.u64_le()?,
                slot: r.u16_le()?,
                len: r.u32_le()?,
            },
            7 => CtlMsg::Released { slot: r.u16_le()? },
            got => return Err(DecodeError::UnknownKind { what: WHAT, got }),
        };
        r.finish()?;
        Ok(msg)
    }
}

/// A `Grant`'s claims, checked: 1 to `MAX_BOUNCE_SLOTS` slots of 1 to
/// `MAX_BOUNCE_SLOT_BYTES`, all inside the window.
fn grant_fits(slots: u16, slot_bytes: u32, window: &AnyWindow) -> Result<(), DecodeError> {
    let need = u64::from(slots) * u64::from(slot_bytes);
    if slots == 0
        || slots > MAX_BOUNCE_SLOTS
        || slot_bytes == 0
        || slot_bytes > MAX_BOUNCE_SLOT_BYTES
        || need > window.len()
    {
        return Err(DecodeError::Invalid {
            what: WHAT,
            reason: format!(
                "a bounce grant of {slots} slots of {slot_bytes} bytes in a {}-byte window \
                 (1 to {MAX_BOUNCE_SLOTS} slots of 1 to {MAX_BOUNCE_SLOT_BYTES} bytes that fit)",
                window.len()
            ),
        });
    }
    Ok(())
}

/// A status byte; `Again` only in an `Ack`.
fn status(got: u8, ack: bool) -> Result<FinStatus, DecodeError> {
    Ok(match got {
        0 => FinStatus::Ok,
        1 => FinStatus::TooLarge,
        2 => FinStatus::Failed,
        3 if ack => FinStatus::Again,
        got => {
            return Err(DecodeError::Invalid {
                what: WHAT,
                reason: format!("unknown status {got}"),
            })
        }
    })
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
            CtlMsg::Eager {
                seq: 4,
                payload: &[1, 2, 3],
            },
            CtlMsg::Eager {
                seq: 5,
                payload: &[],
            },
            CtlMsg::Eager {
                seq: 6,
                payload: &[7; MAX_EAGER_BYTES],
            },
            CtlMsg::Ack {
                seq: 2,
                status: FinStatus::Again,
                len: 0,
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
        assert!(CtlMsg::decode(&[5]).is_err(), "unknown kind");
        assert!(
            CtlMsg::decode(&[3, 0, 0]).is_err(),
            "an eager message cut in its number"
        );
        let long = CtlMsg::Eager {
            seq: 1,
            payload: &[0; MAX_EAGER_BYTES + 1],
        };
        assert!(
            matches!(
                CtlMsg::decode(&long.encode()),
                Err(DecodeError::TooLong { .. })
            ),
            "an eager message past the bound"
        );
        let again_in_fin = CtlMsg::Fin {
            seq: 1,
            status: FinStatus::Again,
            len: 0,
        };
        assert!(
            CtlMsg::decode(&again_in_fin.encode()).is_err(),
            "Again is an Ack's only"
        );
        let with_prefix = CtlMsg::Ack {
            seq: 8,
            status: FinStatus::Ok,
            len: 3,
        };
        assert_eq!(
            with_prefix.encode_after(9)[1..],
            with_prefix.encode()[..],
            "encode_after puts the prefix first"
        );
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

    /// Bounce messages round-trip; a grant whose slots do not fit its
    /// window, or that offers none or too many, is refused.
    #[test]
    fn bounce_messages_round_trip_and_bad_grants_are_refused() {
        let window = AnyWindow::Key(RemoteBuf {
            addr: 0x1000,
            size: 16 * 4096,
            rkey: 7,
            ..Default::default()
        });
        let ipc = AnyWindow::Ipc(crate::wire::IpcBuf {
            device: 0,
            owner_id: 1,
            host_token: 2,
            owner_pid: 3,
            alloc_id: 4,
            alloc_base: 0x7000_0000,
            alloc_len: 2 << 20,
            offset: 0,
            len: 1 << 20,
            handle: [5; 64],
        });
        for m in [
            CtlMsg::Grant {
                slots: 16,
                slot_bytes: 4096,
                window,
            },
            CtlMsg::Grant {
                slots: MAX_BOUNCE_SLOTS,
                slot_bytes: 16384,
                window: ipc,
            },
            CtlMsg::Landed {
                seq: 9,
                slot: 3,
                len: 4096,
            },
            CtlMsg::Released { slot: 15 },
        ] {
            assert_eq!(CtlMsg::decode(&m.encode()).unwrap(), m);
        }
        for (slots, slot_bytes) in [
            (17, 4096),
            (0, 4096),
            (16, 0),
            (MAX_BOUNCE_SLOTS + 1, 1),
            (1, MAX_BOUNCE_SLOT_BYTES + 1),
        ] {
            let bad = CtlMsg::Grant {
                slots,
                slot_bytes,
                window,
            }
            .encode();
            assert!(
                matches!(CtlMsg::decode(&bad), Err(DecodeError::Invalid { .. })),
                "{slots} slots of {slot_bytes}"
            );
        }
        let mut cut = CtlMsg::Grant {
            slots: 1,
            slot_bytes: 1,
            window,
        }
        .encode();
        cut.pop();
        assert!(CtlMsg::decode(&cut).is_err(), "a window cut short");
        assert!(CtlMsg::decode(&[7, 1]).is_err(), "a slot cut short");
    }
}

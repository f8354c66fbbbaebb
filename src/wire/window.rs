//! Either kind of window a peer advertises, told apart by length: the
//! 64-byte key window (`RemoteBuf`) or the 136-byte CUDA IPC window
//! (`IpcBuf`). Every face that takes a window as bytes (Python, the bench,
//! C) decodes it here, once.

use super::{DecodeError, IpcBuf, RemoteBuf, IPC_BUF_LEN, REMOTE_BUF_LEN};

/// A decoded window of either kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AnyWindow {
    /// A key window: moved over tcp, shm or verbs, whichever the
    /// connection uses.
    Key(RemoteBuf),
    /// A CUDA IPC window on this host, copied by the initiator's GPU.
    Ipc(IpcBuf),
}

impl AnyWindow {
    /// Decodes `REMOTE_BUF_LEN` or `IPC_BUF_LEN` bytes.
    pub fn decode(buf: &[u8]) -> Result<AnyWindow, DecodeError> {
        match buf.len() {
            REMOTE_BUF_LEN => RemoteBuf::decode(buf).map(AnyWindow::Key),
            IPC_BUF_LEN => IpcBuf::decode(buf).map(AnyWindow::Ipc),
            len => Err(DecodeError::BadLength {
                what: "window",
                len,
                expected: "64 bytes (advertise) or 136 (advertise_ipc)",
            }),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        match self {
            AnyWindow::Key(r) => r.encode().to_vec(),
            AnyWindow::Ipc(i) => i.encode().to_vec(),
        }
    }

    /// Bytes of the peer's memory it covers.
    pub fn len(&self) -> u64 {
        match self {
            AnyWindow::Key(r) => u64::from(r.size),
            AnyWindow::Ipc(i) => i.len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The window of `len` bytes from `offset` of this one, or `None` if
    /// it does not fit.
    pub fn slice(&self, offset: u64, len: u64) -> Option<AnyWindow> {
        match self {
            AnyWindow::Key(r) => {
                let (o, l) = (u32::try_from(offset).ok()?, u32::try_from(len).ok()?);
                r.slice(o, l).map(AnyWindow::Key)
            }
            AnyWindow::Ipc(i) => i.slice(offset, len).map(AnyWindow::Ipc),
        }
    }

    pub fn key(&self) -> Option<&RemoteBuf> {
        match self {
            AnyWindow::Key(r) => Some(r),
            AnyWindow::Ipc(_) => None,
        }
    }

    pub fn ipc(&self) -> Option<&IpcBuf> {
        match self {
            AnyWindow::Ipc(i) => Some(i),
            AnyWindow::Key(_) => None,
        }
    }
}

impl From<RemoteBuf> for AnyWindow {
    fn from(r: RemoteBuf) -> Self {
        AnyWindow::Key(r)
    }
}

impl From<IpcBuf> for AnyWindow {
    fn from(i: IpcBuf) -> Self {
        AnyWindow::Ipc(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_by_length_and_round_trips() {
        let r = RemoteBuf {
            addr: 0x1000,
            size: 77,
            rkey: 5,
            ..Default::default()
        };
        let w = AnyWindow::decode(&r.encode()).unwrap();
        assert_eq!(w, AnyWindow::Key(r));
        assert_eq!(w.len(), 77);
        assert_eq!(AnyWindow::decode(&w.encode()).unwrap(), w);
        assert_eq!(w.slice(7, 70).unwrap().len(), 70);
        assert!(w.slice(8, 70).is_none() && w.slice(1 << 32, 1).is_none());
        for n in [0, 63, 65, 135, 137] {
            let e = AnyWindow::decode(&vec![0u8; n]).unwrap_err();
            assert!(e.to_string().contains(&format!("{n} bytes")), "{e}");
        }
    }
}

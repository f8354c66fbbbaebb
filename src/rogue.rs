//! A peer that fails on purpose, so every face (Rust, C, Python, NIXL) can
//! show the three causes a connection dies of as three different reports:
//! a peer that goes silent (a timeout), one that sends bytes the protocol
//! forbids (misbehaving) and one that hangs up (gone). It speaks the real
//! handshake over a real socket on 127.0.0.1, then does its one wrong
//! thing. Test support: hidden from the docs, bounded (it serves at most
//! `MAX_STREAMS` streams, each for at most `LINGER`), never used by the
//! engine itself.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use crate::wire::{ControlFrame, Hello, CONTROL_HEADER_LEN};

/// What the peer does once the handshake is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// Reads everything and answers nothing: the initiator's op timeout.
    Silent,
    /// Sends a frame header of garbage: a protocol violation.
    Garbage,
    /// Closes the connection: the peer is gone.
    HangUp,
    /// Dials `to` with each stream's hello as it came (the connection's
    /// nonce included) and holds both: a third party passing off a
    /// connection someone dialed to it as theirs (`Endpoint::vouch`).
    Relay {
        /// Whom it dials.
        to: SocketAddr,
    },
}

impl std::str::FromStr for Behaviour {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "silent" => Ok(Behaviour::Silent),
            "garbage" => Ok(Behaviour::Garbage),
            "hangup" => Ok(Behaviour::HangUp),
            other => Err(format!(
                "unknown behaviour {other:?}: silent, garbage or hangup"
            )),
        }
    }
}

/// Streams one rogue serves before its listener closes.
const MAX_STREAMS: usize = 64;
/// How long a stream is held open at most (then the rogue lets go).
const LINGER: Duration = Duration::from_secs(30);

/// Starts a rogue peer on 127.0.0.1 (a thread; it ends by itself after
/// `MAX_STREAMS` streams) and returns its address.
pub fn spawn(how: Behaviour) -> io::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    std::thread::Builder::new()
        .name("ferry-rogue".into())
        .spawn(move || {
            for s in l.incoming().take(MAX_STREAMS).flatten() {
                let _ = std::thread::Builder::new()
                    .name("ferry-rogue-stream".into())
                    .spawn(move || serve(s, how));
            }
        })?;
    Ok(addr)
}

fn serve(mut s: TcpStream, how: Behaviour) -> io::Result<()> {
    s.set_read_timeout(Some(LINGER))?;
    s.set_write_timeout(Some(LINGER))?;
    let mut header = [0u8; CONTROL_HEADER_LEN];
    s.read_exact(&mut header)?;
    let body = ControlFrame::body_len(&header).map_err(io::Error::other)?;
    // `body_len` refused anything past MAX_CONTROL_BODY.
    let mut frame = vec![0u8; CONTROL_HEADER_LEN + body];
    frame[..CONTROL_HEADER_LEN].copy_from_slice(&header);
    s.read_exact(&mut frame[CONTROL_HEADER_LEN..])?;
    let ControlFrame::Hello(h) = ControlFrame::decode(&frame).map_err(io::Error::other)? else {
        return Ok(());
    };
    // The same hello, onwards: nothing of it is ours to prove.
    let _onwards = match how {
        Behaviour::Relay { to } => {
            let mut o = TcpStream::connect_timeout(&to, LINGER)?;
            o.write_all(
                &ControlFrame::Hello(Hello {
                    caps: 0,
                    host_token: 0,
                    ..h
                })
                .encode(),
            )?;
            Some(o)
        }
        _ => None,
    };
    // No capabilities and no host token: the plain tcp protocol.
    let ack = Hello {
        endpoint_id: 7,
        caps: 0,
        host_token: 0,
        ..h
    };
    s.write_all(&ControlFrame::HelloAck(ack).encode())?;
    match how {
        Behaviour::HangUp => return Ok(()),
        Behaviour::Garbage => s.write_all(&[0xEE; 64])?,
        Behaviour::Silent | Behaviour::Relay { .. } => {}
    }
    // Swallow what comes until the initiator lets go (or `LINGER`).
    let mut sink = [0u8; 64 << 10];
    while s.read(&mut sink)? > 0 {}
    Ok(())
}

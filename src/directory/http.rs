//! A small blocking HTTP/1.1 client for etcd's JSON gateway: one POST per
//! connection (`Connection: close`), over TCP or TLS, a deadline on every
//! step, bodies of `Content-Length` or chunked encoding, and a bound on
//! what a response may make us hold. Responses are read incrementally for
//! streams (watch).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// The most a response body (or one streamed message) may hold.
pub const MAX_BODY: usize = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("{addr}: {what}: {source}")]
    Io {
        addr: SocketAddr,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("{addr}: {0}", addr = .1)]
    Protocol(String, SocketAddr),
    #[error("{addr}{path}: HTTP {status}: {body}")]
    Status {
        addr: SocketAddr,
        path: String,
        status: u16,
        body: String,
    },
}

/// Where requests go: an address, and TLS to it when set.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub addr: SocketAddr,
    pub tls: Option<Tls>,
}

/// A TLS client setup for one etcd member: the configuration and the name
/// its certificate must carry (made by `tls.rs` from the settings).
#[derive(Debug, Clone)]
pub(crate) struct Tls {
    pub config: std::sync::Arc<rustls::ClientConfig>,
    pub name: rustls::pki_types::ServerName<'static>,
}

/// A connection: plain, or TLS over it (boxed: rustls's state is large).
enum Stream {
    Plain(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Stream {
    fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(t) => t.get_ref(),
        }
    }
}

impl Stream {
    /// Why a send failed: under TLS 1.3 the server checks our certificate
    /// after our side of the handshake ended, so a refusal shows first as
    /// a broken pipe on our request; the alert that says why is already in
    /// the socket's receive queue (Linux keeps queued bytes readable after
    /// a reset). Reads it (within the socket's read timeout) and reports
    /// the alert instead; `e` when there is none.
    fn why_closed(&mut self, e: std::io::Error) -> std::io::Error {
        let Stream::Tls(t) = self else { return e };
        // A few records at most: an alert follows at most a session ticket
        // or two; anything more is not a refusal.
        for _ in 0..8 {
            match t.conn.read_tls(&mut t.sock) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if let Err(alert) = t.conn.process_new_packets() {
                        return std::io::Error::new(std::io::ErrorKind::InvalidData, alert);
                    }
                }
            }
        }
        e
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(t) => t.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(t) => t.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Tls(t) => t.flush(),
        }
    }
}

/// An open response: status checked, headers read, body still coming.
pub struct Response {
    addr: SocketAddr,
    r: BufReader<Stream>,
    chunked: bool,
    /// Content-Length bytes left, or of the current chunk.
    left: usize,
    done: bool,
    /// The most body bytes taken (`MAX_BODY` unless `limit` lowered it).
    cap: usize,
}

fn io(addr: SocketAddr, what: &'static str) -> impl FnOnce(std::io::Error) -> HttpError {
    move |source| HttpError::Io { addr, what, source }
}

/// POSTs `body` to `path` and returns the response once its headers are
/// in; `timeout` bounds connecting, the TLS handshake and each read (a
/// stream's reads wait at most that long for the next bytes). `token`:
/// etcd's auth token, sent as `Authorization`.
pub(crate) fn post(
    to: &Target,
    path: &str,
    body: &[u8],
    timeout: Duration,
    token: Option<&str>,
) -> Result<Response, HttpError> {
    let addr = to.addr;
    let s = TcpStream::connect_timeout(&addr, timeout).map_err(io(addr, "connect"))?;
    s.set_read_timeout(Some(timeout))
        .map_err(io(addr, "set timeout"))?;
    s.set_write_timeout(Some(timeout))
        .map_err(io(addr, "set timeout"))?;
    s.set_nodelay(true).map_err(io(addr, "nodelay"))?;
    let mut s = match &to.tls {
        None => Stream::Plain(s),
        Some(tls) => {
            let conn = rustls::ClientConnection::new(tls.config.clone(), tls.name.clone())
                .map_err(|e| HttpError::Protocol(format!("TLS: {e}"), addr))?;
            let mut t = rustls::StreamOwned::new(conn, s);
            // The handshake now, so a refused certificate says so (not a
            // failed first write).
            while t.conn.is_handshaking() {
                t.conn
                    .complete_io(&mut t.sock)
                    .map_err(io(addr, "TLS handshake"))?;
            }
            Stream::Tls(Box::new(t))
        }
    };
    let auth = token.map_or(String::new(), |t| format!("Authorization: {t}\r\n"));
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         {auth}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let sent = s
        .write_all(head.as_bytes())
        .and_then(|()| s.write_all(body))
        .and_then(|()| s.flush());
    if let Err(e) = sent {
        return Err(io(addr, "send")(s.why_closed(e)));
    }
    let mut r = BufReader::new(s);
    let line = read_line(&mut r, addr)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| HttpError::Protocol(format!("bad status line {line:?}"), addr))?;
    let (mut chunked, mut len) = (false, None);
    for _ in 0..100 {
        let h = read_line(&mut r, addr)?;
        if h.is_empty() {
            let mut resp = Response {
                addr,
                r,
                chunked,
                left: len.unwrap_or(usize::MAX),
                done: false,
                cap: MAX_BODY,
            };
            if status != 200 {
                let body = resp.read_all().unwrap_or_default();
                return Err(HttpError::Status {
                    addr,
                    path: path.to_owned(),
                    status,
                    body: String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
                });
            }
            return Ok(resp);
        }
        let (k, v) = h.split_once(':').unwrap_or((&h, ""));
        if k.eq_ignore_ascii_case("transfer-encoding") && v.trim().eq_ignore_ascii_case("chunked") {
            chunked = true;
        } else if k.eq_ignore_ascii_case("content-length") {
            len = Some(
                v.trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| n <= MAX_BODY)
                    .ok_or_else(|| {
                        HttpError::Protocol(format!("bad Content-Length {v:?}"), addr)
                    })?,
            );
        }
    }
    Err(HttpError::Protocol(
        "more than 100 header lines".into(),
        addr,
    ))
}

fn read_line(r: &mut BufReader<Stream>, addr: SocketAddr) -> Result<String, HttpError> {
    let mut buf = Vec::new();
    r.by_ref()
        .take(8192)
        .read_until(b'\n', &mut buf)
        .map_err(io(addr, "receive"))?;
    if buf.last() != Some(&b'\n') {
        return Err(HttpError::Protocol(
            "header line too long or cut".into(),
            addr,
        ));
    }
    Ok(String::from_utf8_lossy(&buf).trim_end().to_owned())
}

impl Response {
    /// Refuses a body (or any one chunk of it) over `cap` bytes, below
    /// `MAX_BODY`: a caller that knows what it asked for bounds the answer.
    pub fn limit(&mut self, cap: usize) {
        self.cap = cap.min(MAX_BODY);
    }

    /// The next piece of body (a chunk, or what is there of a plain
    /// body); `None` at its end.
    pub fn next_piece(&mut self) -> Result<Option<Vec<u8>>, HttpError> {
        if self.done {
            return Ok(None);
        }
        let addr = self.addr;
        if self.chunked {
            let size_line = read_line(&mut self.r, addr)?;
            let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("").trim(), 16)
                .ok()
                .filter(|&n| n <= self.cap)
                .ok_or_else(|| {
                    HttpError::Protocol(format!("bad chunk size {size_line:?}"), addr)
                })?;
            if size == 0 {
                self.done = true;
                return Ok(None);
            }
            let mut buf = vec![0u8; size];
            self.r.read_exact(&mut buf).map_err(io(addr, "receive"))?;
            let mut crlf = [0u8; 2];
            self.r.read_exact(&mut crlf).map_err(io(addr, "receive"))?;
            return Ok(Some(buf));
        }
        let mut buf = Vec::new();
        let want = self.left.min(self.cap + 1);
        self.r
            .by_ref()
            .take(want as u64)
            .read_to_end(&mut buf)
            .map_err(io(addr, "receive"))?;
        if buf.len() > self.cap {
            return Err(HttpError::Protocol(
                format!("body over {} bytes", self.cap),
                addr,
            ));
        }
        self.done = true;
        Ok(Some(buf))
    }

    /// The whole body (at most `MAX_BODY` bytes, or the `limit` set).
    pub fn read_all(&mut self) -> Result<Vec<u8>, HttpError> {
        let mut out = Vec::new();
        while let Some(p) = self.next_piece()? {
            out.extend_from_slice(&p);
            if out.len() > self.cap {
                return Err(HttpError::Protocol(
                    format!("body over {} bytes", self.cap),
                    self.addr,
                ));
            }
        }
        Ok(out)
    }

    /// Stops waiting for more bytes after `deadline` (for a stream's reads).
    pub fn set_read_timeout(&self, t: Duration) {
        let _ = self
            .r
            .get_ref()
            .tcp()
            .set_read_timeout(Some(t.max(Duration::from_millis(1))));
    }
}

/// Splits a gateway stream's bytes into JSON messages: the gateway writes
/// one object per message, and a chunk may hold a part of one or several.
#[derive(Default)]
pub struct Messages {
    buf: Vec<u8>,
}

impl Messages {
    pub fn push(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.buf.extend_from_slice(bytes);
        if self.buf.len() > MAX_BODY {
            return Err(format!("a streamed message over {MAX_BODY} bytes"));
        }
        Ok(())
    }

    /// The next complete message, if one is in.
    pub fn next(&mut self) -> Option<Vec<u8>> {
        let start = self.buf.iter().position(|&b| b == b'{')?;
        let (mut depth, mut in_str, mut esc) = (0usize, false, false);
        for (i, &b) in self.buf.iter().enumerate().skip(start) {
            if in_str {
                match (esc, b) {
                    (true, _) => esc = false,
                    (false, b'\\') => esc = true,
                    (false, b'"') => in_str = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => in_str = true,
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        let msg = self.buf[start..=i].to_vec();
                        self.buf.drain(..=i);
                        return Some(msg);
                    }
                }
                _ => {}
            }
        }
        None
    }
}

/// Deadline helper: time left, or `None` when passed.
pub fn left(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_messages_are_split_whole_whatever_the_chunking() {
        let mut m = Messages::default();
        m.push(br#"{"result":{"a":"}{"},"#).unwrap();
        assert!(m.next().is_none());
        m.push(br#""b":[1,{"c":"\"}"}]}}{"result":{}}"#).unwrap();
        let one = m.next().unwrap();
        assert!(
            serde_json::from_slice::<serde_json::Value>(&one).is_ok(),
            "{}",
            String::from_utf8_lossy(&one)
        );
        assert_eq!(m.next().unwrap(), br#"{"result":{}}"#);
        assert!(m.next().is_none());
    }

    /// A TLS 1.3 server that wants a client certificate refuses ours only
    /// after our side of the handshake ended: its alert comes while we
    /// send. With a request larger than the sockets can hold, the send
    /// always breaks on the reset that follows the server's close (before
    /// the fix, CI saw "send: Broken pipe" from etcd in this race); the
    /// error must still name the alert, which is what tells a user their
    /// certificate was refused.
    #[test]
    fn a_certificate_refused_mid_send_is_reported_as_the_alert() {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        use std::sync::Arc;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/directory/testdata");
        let pem = |f: &str| std::fs::read(dir.join(f)).unwrap();
        let ca: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem("ca.pem"))
            .collect::<Result<_, _>>()
            .unwrap();
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(&pem("server.pem"))
                .collect::<Result<_, _>>()
                .unwrap();
        let key = PrivateKeyDer::from_pem_slice(&pem("server.key")).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca[0].clone()).unwrap();
        #[allow(deprecated)]
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .build()
        .unwrap();
        let server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let serve = std::thread::spawn(move || {
            let (mut sock, _) = listener.accept().unwrap();
            let mut conn = rustls::ServerConnection::new(Arc::new(server)).unwrap();
            // Until the handshake fails on our missing certificate;
            // complete_io writes the alert before it returns the error.
            while conn.complete_io(&mut sock).is_ok() {}
            // Closed with the request unread: the kernel answers it with
            // a reset.
        });
        let sec = crate::directory::EtcdSecurity {
            ca: Some(dir.join("ca.pem")),
            ..Default::default()
        };
        let to = Target {
            addr,
            tls: Some(crate::directory::tls::setup(&sec, "127.0.0.1").unwrap()),
        };
        let body = vec![b' '; 32 << 20];
        let err = post(&to, "/v3/kv/put", &body, Duration::from_secs(10), None)
            .err()
            .expect("the server refused us")
            .to_string();
        serve.join().unwrap();
        assert!(err.contains("CertificateRequired"), "{err}");
    }
}

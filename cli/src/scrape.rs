//! Reading a metrics endpoint (`ferry serve --metrics`): one HTTP GET and
//! the samples of the Prometheus text format. Shared by `ferry stat` and
//! the test suites.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// How long connecting and reading may take (past the listener's own
/// bound per client, so one client it is waiting out does not fail us).
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// `GET /metrics` from `addr`: the body.
pub fn fetch(addr: &str) -> Result<String> {
    let sa: SocketAddr = addr
        .parse()
        .with_context(|| format!("{addr}: not HOST:PORT"))?;
    let mut s = TcpStream::connect_timeout(&sa, IO_TIMEOUT)
        .with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = Vec::new();
    // A bound of ours: a scrape is a few tens of KiB.
    s.take(16 << 20).read_to_end(&mut out)?;
    let text = String::from_utf8(out).context("the answer is not UTF-8")?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("the answer has no HTTP head")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!("{addr}: {}", head.lines().next().unwrap_or(""));
    }
    Ok(body.to_string())
}

/// The samples of a scrape whose name is `name`: (labels, value).
pub fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = (&'a str, f64)> + 'a {
    text.lines().filter_map(move |l| {
        let rest = l.strip_prefix(name)?;
        let (labels, value) = match rest.strip_prefix('{') {
            Some(r) => r.split_once("} ")?,
            None => ("", rest.strip_prefix(' ')?),
        };
        Some((labels, value.trim().parse().ok()?))
    })
}

/// The sum of `name`'s samples whose labels contain every one of `with`.
pub fn total(text: &str, name: &str, with: &[&str]) -> f64 {
    samples(text, name)
        .filter(|(labels, _)| with.iter().all(|w| labels.contains(w)))
        .map(|(_, v)| v)
        .sum()
}

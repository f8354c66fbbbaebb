//! The operator's view of a running endpoint: `ferry serve --metrics ADDR`
//! serves its Prometheus text over HTTP (`GET /metrics`), `ferry stat ADDR`
//! reads it and prints a summary, and `ferry serve` prints the same
//! summary to stderr on SIGUSR1.
//!
//! The HTTP side is the least a scraper needs: one request per connection,
//! GET only, a request of at most `MAX_REQUEST_BYTES` read within
//! `IO_TIMEOUT`, up to `MAX_CLIENTS` clients at once (more are answered
//! 503 at once).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use ferry::Endpoint;
use ferry_cli::scrape::{fetch, samples, total};

pub const HELP: &str = "\
ferry stat: what a running endpoint is doing

Usage: ferry stat HOST:PORT

Reads the metrics that `ferry serve --metrics HOST:PORT` serves
(GET /metrics, the Prometheus text format) and prints its connections,
ops in flight and the oldest one's age, stalled ops, ops and bytes so
far, and failures by cause. `kill -USR1` of a `ferry serve` prints the
same to its stderr.";

/// The longest request head the metrics listener reads.
const MAX_REQUEST_BYTES: usize = 8192;
/// How long one client may take to send its request or read the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Clients answered at once.
const MAX_CLIENTS: usize = 16;
/// The answer past them.
const BUSY: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
/// How often the listener looks at its stop flag.
const STOP_POLL: Duration = Duration::from_millis(50);

/// Binds the metrics listener at `addr` (`--metrics`).
pub fn bind(addr: &str) -> Result<TcpListener> {
    let addr: SocketAddr = addr
        .parse()
        .with_context(|| format!("--metrics {addr}: not HOST:PORT"))?;
    let l = TcpListener::bind(addr).with_context(|| format!("--metrics {addr}: bind"))?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Answers scrapes of `ep`'s metrics on `l` until `stop` is set: each
/// client on a thread of its own, at most `MAX_CLIENTS` at once (one that
/// finds them all busy is answered 503 at once), so clients that connect
/// and send nothing hold up nobody for longer than it takes to refuse them.
pub fn serve(l: &TcpListener, ep: &Endpoint, stop: &AtomicBool) {
    let busy = AtomicUsize::new(0);
    std::thread::scope(|s| {
        while !stop.load(Ordering::Relaxed) {
            match l.accept() {
                Ok((mut c, _)) => {
                    if busy.fetch_add(1, Ordering::AcqRel) >= MAX_CLIENTS {
                        busy.fetch_sub(1, Ordering::AcqRel);
                        let _ = c.set_nonblocking(false);
                        let _ = c.set_write_timeout(Some(IO_TIMEOUT));
                        let _ = c.write_all(BUSY);
                        continue;
                    }
                    let busy = &busy;
                    s.spawn(move || {
                        if let Err(e) = answer(c, ep) {
                            tracing::debug!("metrics client: {e:#}");
                        }
                        busy.fetch_sub(1, Ordering::AcqRel);
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(STOP_POLL)
                }
                Err(e) => {
                    tracing::warn!("metrics listener: {e}");
                    std::thread::sleep(STOP_POLL);
                }
            }
        }
    });
}

/// What a request head asks for, or the status that refuses it.
fn route(head: &[u8]) -> std::result::Result<(), (&'static str, &'static str)> {
    let line = head
        .split(|&b| b == b'\r' || b == b'\n')
        .next()
        .unwrap_or(&[]);
    let mut parts = line.split(|&b| b == b' ');
    let (method, path) = (parts.next(), parts.next());
    match (method, path) {
        (Some(b"GET"), Some(b"/metrics" | b"/")) => Ok(()),
        (Some(b"GET"), _) => Err(("404 Not Found", "not found: GET /metrics\n")),
        _ => Err(("405 Method Not Allowed", "only GET /metrics\n")),
    }
}

fn answer(mut s: TcpStream, ep: &Endpoint) -> Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    let verdict = loop {
        if head.windows(4).any(|w| w == b"\r\n\r\n") {
            break route(&head);
        }
        if head.len() >= MAX_REQUEST_BYTES {
            break Err(("431 Request Header Fields Too Large", "request too large\n"));
        }
        let n = s.read(&mut buf).context("reading the request")?;
        if n == 0 {
            bail!("closed before a whole request");
        }
        head.extend_from_slice(&buf[..n]);
    };
    let (status, ctype, body) = match verdict {
        Ok(()) => ("200 OK", ferry::metrics::CONTENT_TYPE, ep.metrics_text()),
        Err((status, why)) => (status, "text/plain; charset=utf-8", why.to_string()),
    };
    let allow = if status.starts_with("405") {
        "Allow: GET\r\n"
    } else {
        ""
    };
    write!(
        s,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\n{allow}Connection: close\r\n\r\n{body}",
        body.len()
    )?;
    Ok(())
}

/// What an operator looks at first, from a scrape.
pub fn summary(text: &str) -> String {
    let mut out = String::new();
    let line = |out: &mut String, s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    let conns: Vec<String> = samples(text, "ferry_connections")
        .filter(|(_, v)| *v > 0.0)
        .map(|(l, v)| {
            format!(
                "{v} {}",
                l.replace("transport=", "")
                    .replace("\",state=\"up\"", "")
                    .replace('"', "")
            )
        })
        .collect();
    let conns = if conns.is_empty() {
        "none".to_string()
    } else {
        conns.join(", ")
    };
    line(&mut out, format!("connections   {conns}"));
    line(
        &mut out,
        format!(
            "in flight     {} ops, oldest {:.3} s; stalled so far {}",
            total(text, "ferry_ops_in_flight", &[]),
            total(text, "ferry_oldest_op_age_seconds", &[]),
            total(text, "ferry_stalled_ops_total", &[]),
        ),
    );
    for role in ["initiator", "target"] {
        let role_label = format!("role=\"{role}\"");
        let bytes_out = total(
            text,
            "ferry_bytes_total",
            &[&role_label, "direction=\"out\""],
        );
        let bytes_in = total(
            text,
            "ferry_bytes_total",
            &[&role_label, "direction=\"in\""],
        );
        line(
            &mut out,
            format!("bytes {role:<9} out {bytes_out} in {bytes_in}"),
        );
    }
    line(
        &mut out,
        format!(
            "ops           {} ok, {} failed; requests served {} ok, {} refused",
            total(text, "ferry_ops_total", &["result=\"ok\""]),
            total(text, "ferry_ops_total", &["result=\"failed\""]),
            total(text, "ferry_requests_served_total", &["result=\"ok\""]),
            total(text, "ferry_requests_served_total", &["result=\"refused\""]),
        ),
    );
    let failures: Vec<String> = samples(text, "ferry_op_failures_total")
        .chain(samples(text, "ferry_connection_failures_total"))
        .filter(|(_, v)| *v > 0.0)
        .map(|(l, v)| format!("{v} {}", l.replace("cause=", "").replace('"', "")))
        .collect();
    if !failures.is_empty() {
        line(&mut out, format!("failures      {}", failures.join(", ")));
    }
    out
}

/// `ferry stat ADDR`.
pub fn run(rest: &[String]) -> Result<()> {
    let [addr] = rest else {
        bail!("usage: ferry stat HOST:PORT (see ferry stat --help)");
    };
    print!("{}", summary(&fetch(addr)?));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_get_of_the_metrics_path_is_served() {
        assert!(route(b"GET /metrics HTTP/1.1\r\n\r\n").is_ok());
        assert_eq!(
            route(b"POST /metrics HTTP/1.1\r\n\r\n").unwrap_err().0,
            "405 Method Not Allowed"
        );
        assert_eq!(
            route(b"GET /other HTTP/1.1\r\n\r\n").unwrap_err().0,
            "404 Not Found"
        );
    }

    #[test]
    fn totals_add_the_samples_whose_labels_match() {
        let text = "ferry_ops_total{op=\"write\",result=\"ok\"} 3\nferry_ops_total{op=\"read\",result=\"ok\"} 2\nferry_ops_total{op=\"read\",result=\"failed\"} 1\nferry_ops_in_flight 4\n";
        assert_eq!(total(text, "ferry_ops_total", &["result=\"ok\""]), 5.0);
        assert_eq!(total(text, "ferry_ops_in_flight", &[]), 4.0);
        assert!(
            summary(text).contains("5 ok, 1 failed"),
            "{}",
            summary(text)
        );
    }
}

//! Where the directory's etcd is: the URL's parts, and the target they
//! make with the TLS settings.

use std::net::{SocketAddr, ToSocketAddrs};

use super::error::{DirError, Result};
use super::http;
use super::tls::{self, EtcdSecurity};

/// Parses `http://host:port`, `https://host:port` (or `host:port`): the
/// member's address.
pub fn parse_url(url: &str) -> Result<SocketAddr> {
    Ok(split_url(url)?.2)
}

/// The URL's parts: whether it is https, its host as written, and the
/// address it resolves to.
fn split_url(url: &str) -> Result<(bool, String, SocketAddr)> {
    let bad = |why: &str| DirError::Bad {
        what: "etcd URL",
        value: url.to_owned(),
        why: why.to_owned(),
    };
    let (https, rest) = match url.strip_prefix("https://") {
        Some(r) => (true, r),
        None => (false, url.strip_prefix("http://").unwrap_or(url)),
    };
    let hostport = rest.trim_end_matches('/');
    let host = match hostport.rsplit_once(':') {
        Some((h, _)) => h.to_owned(),
        None => return Err(bad("no port")),
    };
    let addr = hostport
        .to_socket_addrs()
        .map_err(|e| bad(&e.to_string()))?
        .next()
        .ok_or_else(|| bad("no address"))?;
    Ok((https, host, addr))
}

/// Where the directory's calls go, and how: TLS for `https://` (which
/// needs a CA), refused cleartext where a CA is configured.
pub(super) fn target(url: &str, sec: &EtcdSecurity) -> Result<http::Target> {
    let (https, host, addr) = split_url(url)?;
    if !https && sec.ca.is_some() {
        return Err(DirError::Bad {
            what: "etcd URL",
            value: url.to_owned(),
            why:
                "a CA is configured (FERRY_ETCD_CA, --etcd-ca): plain http is refused; use https://"
                    .to_owned(),
        });
    }
    let tls = if https {
        Some(tls::setup(sec, &host)?)
    } else {
        if sec.cert.is_some() || sec.key.is_some() {
            return Err(DirError::Bad {
                what: "etcd URL",
                value: url.to_owned(),
                why: "a client certificate is configured: it needs https://".to_owned(),
            });
        }
        None
    };
    Ok(http::Target { addr, tls })
}

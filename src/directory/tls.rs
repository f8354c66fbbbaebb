//! How the directory reaches a production etcd: TLS (rustls, with the CA
//! that signed etcd's certificate and, where etcd asks for one, our client
//! certificate) and etcd's user authentication (a token from
//! `/v3/auth/authenticate`, sent with every call and fetched again when
//! etcd says it expired).
//!
//! Settings: `FERRY_ETCD_CA`, `FERRY_ETCD_CERT`, `FERRY_ETCD_KEY` (PEM
//! files), `FERRY_ETCD_USER`, `FERRY_ETCD_PASSWORD`, or the same in code
//! ([`EtcdSecurity`]). A configured CA refuses a plain `http://` URL: a
//! deployment that has one never falls back to cleartext by a typo.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use super::error::{DirError, Result};
use super::http::Tls;

/// TLS and authentication settings for etcd.
#[derive(Clone, Default)]
pub struct EtcdSecurity {
    /// The CA (PEM) that signed etcd's server certificate; required for
    /// `https://`, and makes `http://` refused.
    pub ca: Option<PathBuf>,
    /// Our client certificate (PEM), for an etcd run with
    /// `--client-cert-auth`; goes with `key`.
    pub cert: Option<PathBuf>,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: Option<PathBuf>,
    /// An etcd user (etcd run with `auth enable`); goes with `password`.
    pub user: Option<String>,
    /// Its password.
    pub password: Option<String>,
}

impl std::fmt::Debug for EtcdSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdSecurity")
            .field("ca", &self.ca)
            .field("cert", &self.cert)
            .field("key", &self.key)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<hidden>"))
            .finish()
    }
}

impl EtcdSecurity {
    /// From `FERRY_ETCD_CA`, `FERRY_ETCD_CERT`, `FERRY_ETCD_KEY`,
    /// `FERRY_ETCD_USER` and `FERRY_ETCD_PASSWORD` (unset or empty: none).
    pub fn from_env() -> EtcdSecurity {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        EtcdSecurity {
            ca: var("FERRY_ETCD_CA").map(PathBuf::from),
            cert: var("FERRY_ETCD_CERT").map(PathBuf::from),
            key: var("FERRY_ETCD_KEY").map(PathBuf::from),
            user: var("FERRY_ETCD_USER"),
            password: var("FERRY_ETCD_PASSWORD"),
        }
    }

    /// The user and password, when both are set (one alone is refused).
    pub(super) fn credentials(&self) -> Result<Option<(String, String)>> {
        match (&self.user, &self.password) {
            (Some(u), Some(p)) => Ok(Some((u.clone(), p.clone()))),
            (None, None) => Ok(None),
            _ => Err(bad(
                "etcd credentials",
                "a user and a password go together (FERRY_ETCD_USER, FERRY_ETCD_PASSWORD)",
            )),
        }
    }
}

fn bad(what: &'static str, why: impl Into<String>) -> DirError {
    DirError::Bad {
        what,
        value: String::new(),
        why: why.into(),
    }
}

fn read_pem(what: &'static str, path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| DirError::Tls {
        what,
        why: format!("{}: {e}", path.display()),
    })
}

fn certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let pem = read_pem(what, path)?;
    let certs: std::result::Result<Vec<_>, _> = CertificateDer::pem_slice_iter(&pem).collect();
    match certs {
        Ok(c) if !c.is_empty() => Ok(c),
        Ok(_) => Err(DirError::Tls {
            what,
            why: format!("{}: no certificate in it", path.display()),
        }),
        Err(e) => Err(DirError::Tls {
            what,
            why: format!("{}: {e}", path.display()),
        }),
    }
}

/// The TLS setup for `host` (the URL's host: a name or an address) from
/// `sec`, which must name a CA.
pub(crate) fn setup(sec: &EtcdSecurity, host: &str) -> Result<Tls> {
    let Some(ca) = &sec.ca else {
        return Err(bad(
            "etcd URL",
            "https needs the CA that signed etcd's certificate (FERRY_ETCD_CA, --etcd-ca)",
        ));
    };
    let mut roots = rustls::RootCertStore::empty();
    for c in certs("etcd CA", ca)? {
        roots.add(c).map_err(|e| DirError::Tls {
            what: "etcd CA",
            why: format!("{}: {e}", ca.display()),
        })?;
    }
    // ring's primitives (no cmake, no large C build, as the Cargo.toml
    // says). rustls 0.23.48 deprecates its ring provider for lacking
    // post-quantum key exchange; the link to an etcd member of one's own
    // cluster does not need it today.
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| DirError::Tls {
            what: "TLS setup",
            why: e.to_string(),
        })?
        .with_root_certificates(roots);
    let config = match (&sec.cert, &sec.key) {
        (Some(cert), Some(key)) => {
            let chain = certs("etcd client certificate", cert)?;
            let pem = read_pem("etcd client key", key)?;
            let key_der = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| DirError::Tls {
                what: "etcd client key",
                why: format!("{}: {e}", key.display()),
            })?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| DirError::Tls {
                    what: "etcd client certificate",
                    why: e.to_string(),
                })?
        }
        (None, None) => builder.with_no_client_auth(),
        _ => {
            return Err(bad(
                "etcd client certificate",
                "a certificate and its key go together (FERRY_ETCD_CERT, FERRY_ETCD_KEY)",
            ))
        }
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let name = ServerName::try_from(host.to_owned()).map_err(|e| DirError::Bad {
        what: "etcd URL",
        value: host.to_owned(),
        why: format!("not a name a certificate can carry: {e}"),
    })?;
    Ok(Tls {
        config: Arc::new(config),
        name,
    })
}

//! The directory in the tool: `serve --directory`, `bench --directory
//! --peer`, `ls`. Without the `directory` feature each says how to get it.

use std::time::Duration;

use anyhow::Result;
use ferry::Endpoint;
use ferry_cli::testkit::Served;

use crate::args::Args;

pub const LS_HELP: &str = "\
ferry ls: the endpoints published in an etcd directory

Flags:
  --directory URL   etcd (v3 JSON gateway), e.g. http://127.0.0.1:2379
                    or https://etcd.example:2379
  --cluster C       cluster (default ferry)
  --json            one JSON object per endpoint
Prints each name with its address, incarnation and windows.";

/// The etcd TLS flags every directory command takes.
pub const ETCD_FLAGS: &str = "\
etcd over TLS and with authentication (serve, bench and ls):
  --etcd-ca FILE    the CA (PEM) that signed etcd's certificate: needed for
                    https://, and plain http:// is then refused
  --etcd-cert FILE --etcd-key FILE
                    our client certificate and key (PEM), for an etcd run
                    with --client-cert-auth
  The same as FERRY_ETCD_CA, FERRY_ETCD_CERT, FERRY_ETCD_KEY; an etcd user
  comes from FERRY_ETCD_USER and FERRY_ETCD_PASSWORD (not flags: a
  command line is visible to every user of the host).";

/// Takes `--etcd-ca/--etcd-cert/--etcd-key FILE` out of `argv` into the
/// `FERRY_ETCD_*` variables the directory reads (before any thread
/// starts).
pub fn take_etcd_flags(argv: &mut Vec<String>) -> Result<()> {
    for (flag, var) in [
        ("--etcd-ca", "FERRY_ETCD_CA"),
        ("--etcd-cert", "FERRY_ETCD_CERT"),
        ("--etcd-key", "FERRY_ETCD_KEY"),
    ] {
        while let Some(i) = argv
            .iter()
            .position(|a| a == flag || a.starts_with(&format!("{flag}=")))
        {
            let value = match argv[i].split_once('=') {
                Some((_, v)) => {
                    let v = v.to_owned();
                    argv.remove(i);
                    v
                }
                None => {
                    anyhow::ensure!(i + 1 < argv.len(), "{flag} needs a value");
                    argv.remove(i);
                    argv.remove(i)
                }
            };
            std::env::set_var(var, value);
        }
    }
    Ok(())
}

#[cfg(not(feature = "directory"))]
fn missing() -> anyhow::Error {
    anyhow::anyhow!(
        "this ferry was built without the directory feature \
         (cargo build --release -p ferry-cli --features directory)"
    )
}

#[cfg(not(feature = "directory"))]
pub fn publish(
    _: &Endpoint,
    _: &str,
    _: &str,
    _: &str,
    _: Duration,
    _: bool,
    _: &[(&str, Vec<u8>)],
) -> Result<()> {
    Err(missing())
}

#[cfg(not(feature = "directory"))]
pub fn served_by_name(_: &str, _: &str, _: &str) -> Result<Served> {
    Err(missing())
}

#[cfg(not(feature = "directory"))]
pub fn ls(_: Args) -> Result<()> {
    Err(missing())
}

#[cfg(feature = "directory")]
pub fn publish(
    ep: &Endpoint,
    url: &str,
    cluster: &str,
    name: &str,
    ttl: Duration,
    replace: bool,
    windows: &[(&str, Vec<u8>)],
) -> Result<ferry::directory::Publication> {
    let d = ferry::directory::Directory::new(url, cluster)?;
    let p = if replace {
        d.publish_replacing(ep, name, ttl)?
    } else {
        d.publish(ep, name, ttl)?
    };
    for (w, b) in windows {
        p.add_window(w, b)?;
    }
    Ok(p)
}

#[cfg(feature = "directory")]
pub fn served_by_name(url: &str, cluster: &str, peer: &str) -> Result<Served> {
    use anyhow::Context;
    let d = ferry::directory::Directory::new(url, cluster)?;
    let e = d.lookup(peer)?;
    let win = |w: &str| {
        e.windows
            .iter()
            .find(|(n, _)| n == w)
            .map(|(_, b)| b.clone())
    };
    let rb = |w: &str| -> Result<ferry::RemoteBuf> {
        let b = win(w).with_context(|| format!("{peer} published no window {w:?}"))?;
        Ok(ferry::RemoteBuf::decode(&b)?)
    };
    Ok(Served {
        meta: e.metadata.clone(),
        rbuf: rb("main")?,
        rbuf_ro: rb("ro")?,
        rbuf_wo: rb("wo")?,
        ipc: win("ipc").map(|b| ferry::IpcBuf::decode(&b)).transpose()?,
        gpu_rbuf: win("gpu")
            .map(|b| ferry::RemoteBuf::decode(&b))
            .transpose()?,
        metrics: None,
    })
}

#[cfg(feature = "directory")]
pub fn ls(mut a: Args) -> Result<()> {
    let url = a
        .value("directory")
        .ok_or_else(|| anyhow::anyhow!("--directory URL is required"))?;
    let cluster = a.value("cluster").unwrap_or_else(|| "ferry".into());
    let json = a.switch("json");
    a.finish()?;
    let d = ferry::directory::Directory::new(&url, &cluster)?;
    let all = d.list()?;
    for e in &all {
        let ws: Vec<&str> = e.windows.iter().map(|(n, _)| n.as_str()).collect();
        if json {
            println!(
                "{{\"name\":\"{}\",\"addr\":\"{}\",\"incarnation\":\"{:016x}\",\"windows\":[{}]}}",
                e.name,
                e.addr,
                e.incarnation,
                ws.iter()
                    .map(|w| format!("\"{w}\""))
                    .collect::<Vec<_>>()
                    .join(",")
            );
        } else {
            println!(
                "{:<24} {:<24} {:016x}  {}",
                e.name,
                e.addr,
                e.incarnation,
                ws.join(",")
            );
        }
    }
    if all.is_empty() && !json {
        eprintln!("(no endpoint published in cluster {cluster:?})");
    }
    Ok(())
}

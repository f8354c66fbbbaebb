//! `UCCL_P2P_*` environment names as aliases of ferry's `FERRY_*` ones, so
//! a deployment tuned for the seed keeps its settings. A `FERRY_*` value
//! wins over its alias; each alias used is reported once.

use std::sync::Once;

/// (seed's name, ferry's name). Values mean the same on both sides, except
/// `UCCL_P2P_TRANSPORT` (see [`transport`]).
pub(crate) const ALIASES: &[(&str, &str)] = &[
    ("UCCL_P2P_MAX_INFLIGHT_OPS", "FERRY_MAX_INFLIGHT_OPS"),
    ("UCCL_P2P_RDMA_DEV", "FERRY_RDMA_DEV"),
    ("UCCL_P2P_RDMA_GID_INDEX", "FERRY_RDMA_GID_INDEX"),
    ("UCCL_P2P_RDMA_MAX_RD_ATOMIC", "FERRY_RDMA_MAX_RD_ATOMIC"),
    ("UCCL_P2P_RDMA_SL", "FERRY_RDMA_SL"),
    ("UCCL_P2P_RDMA_TC", "FERRY_RDMA_TC"),
    ("UCCL_P2P_LOG_LEVEL", "FERRY_LOG"),
];

/// The seed's transport names that have a ferry equivalent.
fn transport(v: &str) -> Option<&'static str> {
    match v.trim().to_ascii_lowercase().as_str() {
        "tcp" => Some("tcp"),
        "auto" | "" => Some("auto"),
        _ => None,
    }
}

/// Reads `FERRY_*` variables through `get`, falling back to the seed's
/// alias; returns the value and, when an alias supplied it, a line saying so.
pub(crate) fn lookup(
    get: &dyn Fn(&str) -> Option<String>,
    name: &str,
) -> (Option<String>, Option<String>) {
    if let Some(v) = get(name) {
        return (Some(v), None);
    }
    if name == "FERRY_TRANSPORT" {
        if let Some(v) = get("UCCL_P2P_TRANSPORT") {
            return match transport(&v) {
                Some(t) => (
                    Some(t.to_owned()),
                    Some(format!(
                        "UCCL_P2P_TRANSPORT={v} read as FERRY_TRANSPORT={t}"
                    )),
                ),
                None => (
                    None,
                    Some(format!(
                        "UCCL_P2P_TRANSPORT={v} has no ferry equivalent (ferry picks \
                         verbs, tcp or shm by itself); ignored"
                    )),
                ),
            };
        }
    }
    for (alias, ours) in ALIASES {
        if *ours == name {
            if let Some(v) = get(alias) {
                return (Some(v), Some(format!("{alias} read as {ours}")));
            }
        }
    }
    (None, None)
}

static SAID: Once = Once::new();

/// The endpoint configuration from the environment, aliases included.
pub(crate) fn config(py: pyo3::Python<'_>) -> ferry::Result<ferry::Config> {
    let notes = std::cell::RefCell::new(Vec::new());
    let get = |k: &str| std::env::var(k).ok();
    let cfg = ferry::Config::from_lookup(|name| {
        let (v, note) = lookup(&get, name);
        if let Some(n) = note {
            notes.borrow_mut().push(n);
        }
        v
    });
    SAID.call_once(|| {
        for n in notes.borrow().iter() {
            crate::log(py, "info", &format!("environment: {n}"));
        }
    });
    cfg
}

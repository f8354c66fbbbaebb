//! `Config`: every knob of an endpoint, settable from code or read once from
//! `FERRY_*` environment variables.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::oob::IoPreference;

/// How shards are driven.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The endpoint starts one thread per shard.
    Managed,
    /// The caller takes the shards (`Endpoint::take_shards`) and polls them.
    Embedded,
}

/// Which data path connections use (`FERRY_TRANSPORT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Shared memory for a peer on this host, tcp otherwise.
    Auto,
    /// Always tcp.
    Tcp,
    /// Shared memory only: connecting to a peer on another host is an error.
    Shm,
}

/// What the frame MACs of an authenticated connection cover
/// (`FERRY_INTEGRITY`; only with `FERRY_AUTH_KEY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Integrity {
    /// Every frame header (key, address, length, op id, sequence): a relay
    /// cannot inject, replay, reorder or redirect requests. Payload bytes
    /// are not covered.
    Headers,
    /// Headers and payloads: altered data fails its op (a READ) or is
    /// never acknowledged (a WRITE; the bytes may already be in the
    /// target's window) and the connection dies. Costs a MAC pass over
    /// every payload on both sides. Used when either side asks for it.
    Full,
}

/// A shared secret; its bytes never appear in `Debug` output or logs.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// At least 8 bytes; longer is better.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Secret> {
        let b = bytes.into();
        if b.len() < 8 {
            return Err(Error::Config {
                name: "FERRY_AUTH_KEY",
                value: "<redacted>".into(),
                reason: format!("{} bytes; use at least 8", b.len()),
            });
        }
        Ok(Secret(b))
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Every knob of an endpoint. Start from `Config::default()` or
/// `Config::from_env()` and set fields; `EndpointBuilder::build` checks the
/// result with [`Config::validate`]. `#[non_exhaustive]`: new knobs are
/// not breaking changes, so build one by assignment, not a struct literal.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Config {
    /// Address the control listener binds (`FERRY_LISTEN_ADDR`, default 0.0.0.0).
    pub listen_addr: IpAddr,
    /// Port it binds; 0 picks a free one (`FERRY_LISTEN_PORT`).
    pub listen_port: u16,
    /// Address put in the metadata (`FERRY_ADVERTISE_ADDR`). Default: the
    /// listen address, or when that is unspecified the first non-loopback
    /// IPv4 address of an up interface, else 127.0.0.1.
    pub advertise_addr: Option<IpAddr>,
    /// Number of shards (`FERRY_SHARDS`, default 1).
    pub shards: usize,
    pub mode: Mode,
    /// Operations in flight across the endpoint (`FERRY_MAX_INFLIGHT_OPS`, default 4096).
    pub max_inflight_ops: usize,
    /// Request frames outstanding per stream (`FERRY_STREAM_INFLIGHT`, default 1024).
    pub stream_inflight: usize,
    /// Depth of each shard's submission queue (`FERRY_SQ_DEPTH`, default 4096);
    /// also the most commands one connection may have waiting for room.
    pub sq_depth: usize,
    /// TCP streams per connection (`FERRY_STREAMS`, default 1).
    pub streams_per_conn: u16,
    /// The most shards one tcp connection's streams are spread over
    /// (`FERRY_LANES`, default 0: as many as streams and shards allow; 1:
    /// every connection on one shard). Each lane is a group of the
    /// connection's streams on its own shard; large operations (≥ 2
    /// chunks) are split over the lanes, vectored ones dealt over them,
    /// and each application thread's small ones go to one lane (threads
    /// are dealt lanes round-robin).
    pub lanes: usize,
    /// Operations larger than this are split into frames of this size,
    /// dealt round-robin over the streams (`FERRY_CHUNK_BYTES`, default 4 MiB).
    pub chunk_bytes: usize,
    /// Connect and handshake deadline (`FERRY_CONNECT_TIMEOUT_MS`, default 5000).
    pub connect_timeout_ms: u64,
    /// A request with no response for this long fails its connection
    /// (`FERRY_OP_TIMEOUT_MS`, default 10000).
    pub op_timeout_ms: u64,
    /// How long an idle shard spins before it parks (`FERRY_SPIN_US`, default 50).
    pub spin_us: u64,
    /// How much of that spin polls without giving up the core; the rest
    /// yields the core on each idle pass (`FERRY_SPIN_YIELD_US`, default
    /// 20; 0: yield on every idle pass).
    pub spin_yield_us: u64,
    /// Control-path backend (`FERRY_IO=auto|uring|epoll`).
    pub io: IoPreference,
    /// Data path (`FERRY_TRANSPORT=auto|tcp|shm`).
    pub transport: Transport,
    /// Pin managed shard threads to cores (`FERRY_PIN=1`, default off).
    pub pin_cores: bool,
    /// Notifications held for the application (`FERRY_INBOX_DEPTH`, default 1024).
    pub inbox_depth: usize,
    /// Open connections at most, incoming and outgoing (`FERRY_MAX_CONNS`, default 4096).
    pub max_conns: usize,
    /// Connections one remote address may hold at most, so no single peer
    /// takes every slot (`FERRY_MAX_CONNS_PER_PEER`, default 1024; at most
    /// `max_conns`).
    pub max_conns_per_peer: usize,
    /// A connection with nothing in flight and no traffic for this long is
    /// closed (`FERRY_IDLE_TIMEOUT_MS`; default 0: never).
    pub idle_timeout_ms: u64,
    /// Live registrations at most (`FERRY_MAX_REGISTRATIONS`, default 65536).
    pub max_registrations: usize,
    /// Operations in flight on one connection at most
    /// (`FERRY_MAX_CONN_INFLIGHT_OPS`, default 4096).
    pub max_conn_inflight_ops: usize,
    /// Shared secret peers must prove in the handshake (`FERRY_AUTH_KEY`):
    /// an HMAC-SHA256 challenge-response both ways; a peer without it, or
    /// with another, is refused. `None`: no authentication.
    pub auth_key: Option<Secret>,
    /// What the frame MACs cover on authenticated connections
    /// (`FERRY_INTEGRITY=headers|full`, default headers). Secrecy is not
    /// offered: use a private network or a tunnel for that.
    pub integrity: Integrity,
    /// The endpoint's GPU (`FERRY_GPU`, an index into the visible devices).
    /// `None`: lazy — the first registered GPU pointer picks it, else GPU 0
    /// when GPU work needs one.
    pub gpu: Option<usize>,
    /// CUDA streams per device that split large IPC copies
    /// (`FERRY_GPU_STREAMS`, default 4, at most 8).
    pub gpu_streams: usize,
    /// Pinned bounce memory per shard for GPU memory on tcp
    /// (`FERRY_GPU_BOUNCE_BYTES`, default 256 MiB), in buffers of
    /// `chunk_bytes` (at least 2).
    pub gpu_bounce_bytes: usize,
    /// RDMA devices to use, best first (`FERRY_RDMA_DEV=name[,name]`);
    /// default: the NICs nearest the GPU on the PCIe tree.
    pub rdma_dev: Option<String>,
    /// GID table index (`FERRY_RDMA_GID_INDEX`). `None` (the default):
    /// searched in the port's GID table — a RoCE v2 IPv4-mapped GID first,
    /// then another RoCE v2 one, else index 0 (`verbs::nic::best_gid`).
    pub rdma_gid_index: Option<u32>,
    /// Data queue pairs per connection (`FERRY_RDMA_QPS`, default 4, at most 64).
    pub rdma_qps: usize,
    /// Work requests each data queue pair holds (`FERRY_RDMA_QP_DEPTH`,
    /// default 256, 16..=32768): what a connection pins on the NIC grows
    /// with it (256: about 128 KiB per connection with 4 queue pairs).
    pub rdma_qp_depth: u32,
    /// NICs an endpoint opens and stripes each connection's queue pairs
    /// over (`FERRY_RDMA_MAX_NICS`, default 4, 1..=4): the ones nearest its
    /// GPU, or those `FERRY_RDMA_DEV` names.
    pub rdma_max_nics: usize,
    /// Outstanding RDMA READs per queue pair (`FERRY_RDMA_MAX_RD_ATOMIC`, default 16).
    pub rdma_max_rd_atomic: u8,
    /// Service level and traffic class (`FERRY_RDMA_SL`, `FERRY_RDMA_TC`, default 0).
    pub rdma_sl: u8,
    pub rdma_tc: u8,
    /// Log filter for the `ferry` binary (`FERRY_LOG`, default "warn"); the
    /// library itself only emits `tracing` events.
    pub log: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen_addr: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            listen_port: 0,
            advertise_addr: None,
            shards: 1,
            mode: Mode::Managed,
            max_inflight_ops: 4096,
            stream_inflight: 1024,
            sq_depth: 4096,
            streams_per_conn: 1,
            lanes: 0,
            chunk_bytes: 4 << 20,
            connect_timeout_ms: 5000,
            op_timeout_ms: 10_000,
            spin_us: 50,
            spin_yield_us: 20,
            io: IoPreference::Auto,
            transport: Transport::Auto,
            pin_cores: false,
            inbox_depth: 1024,
            max_conns: 4096,
            max_conns_per_peer: 1024,
            idle_timeout_ms: 0,
            max_registrations: 65536,
            max_conn_inflight_ops: 4096,
            auth_key: None,
            integrity: Integrity::Headers,
            gpu: None,
            gpu_streams: 4,
            gpu_bounce_bytes: 256 << 20,
            rdma_dev: None,
            rdma_gid_index: None,
            rdma_qps: 4,
            rdma_max_nics: 4,
            rdma_qp_depth: 256,
            rdma_max_rd_atomic: 16,
            rdma_sl: 0,
            rdma_tc: 0,
            log: "warn".to_owned(),
        }
    }
}

fn bad(name: &'static str, value: &str, reason: impl Into<String>) -> Error {
    Error::Config {
        name,
        value: value.to_owned(),
        reason: reason.into(),
    }
}

/// Parses a number; its range is checked by `validate`.
fn num<T: std::str::FromStr>(name: &'static str, v: &str) -> Result<T> {
    v.trim().parse().map_err(|_| bad(name, v, "not a number"))
}

/// `min <= v <= max`, or an error naming the field (and its variable).
/// The numeric settings: each field, its variable, and the range it must
/// lie in. One table: `validate` and `from_lookup` both come from it.
macro_rules! numeric_settings {
    ($then:ident) => {
        $then! {
            shards: "FERRY_SHARDS", 1, 256;
            max_inflight_ops: "FERRY_MAX_INFLIGHT_OPS", 1, 1 << 20;
            stream_inflight: "FERRY_STREAM_INFLIGHT", 1, 1 << 20;
            sq_depth: "FERRY_SQ_DEPTH", 1, 1 << 20;
            streams_per_conn: "FERRY_STREAMS", 1, crate::wire::MAX_STREAMS;
            lanes: "FERRY_LANES", 0, 255;
            chunk_bytes: "FERRY_CHUNK_BYTES", 4096, 1 << 30;
            connect_timeout_ms: "FERRY_CONNECT_TIMEOUT_MS", 1, 3_600_000;
            op_timeout_ms: "FERRY_OP_TIMEOUT_MS", 1, 3_600_000;
            spin_us: "FERRY_SPIN_US", 0, 10_000_000;
            spin_yield_us: "FERRY_SPIN_YIELD_US", 0, 10_000_000;
            inbox_depth: "FERRY_INBOX_DEPTH", 1, 1 << 20;
            max_conns: "FERRY_MAX_CONNS", 1, 1 << 20;
            max_conns_per_peer: "FERRY_MAX_CONNS_PER_PEER", 1, 1 << 20;
            idle_timeout_ms: "FERRY_IDLE_TIMEOUT_MS", 0, 86_400_000;
            max_registrations: "FERRY_MAX_REGISTRATIONS", 1, 1 << 24;
            max_conn_inflight_ops: "FERRY_MAX_CONN_INFLIGHT_OPS", 1, 1 << 20;
            gpu_streams: "FERRY_GPU_STREAMS", 1, 8;
            gpu_bounce_bytes: "FERRY_GPU_BOUNCE_BYTES", 1, 1 << 40;
            rdma_qp_depth: "FERRY_RDMA_QP_DEPTH", 16, 32768;
            rdma_max_nics: "FERRY_RDMA_MAX_NICS", 1, crate::wire::MAX_NICS;
            rdma_qps: "FERRY_RDMA_QPS", 1, crate::wire::MAX_DATA_QPS;
            rdma_max_rd_atomic: "FERRY_RDMA_MAX_RD_ATOMIC", 1, 255;
            rdma_sl: "FERRY_RDMA_SL", 0, 15;
            rdma_tc: "FERRY_RDMA_TC", 0, 255;
        }
    };
}

fn within<T>(name: &'static str, v: T, min: T, max: T) -> Result<()>
where
    T: PartialOrd + std::fmt::Display + Copy,
{
    if v < min || v > max {
        return Err(bad(
            name,
            &v.to_string(),
            format!("must be in {min}..={max}"),
        ));
    }
    Ok(())
}

impl Config {
    /// The verbs settings these fields give.
    pub fn verbs(&self) -> crate::verbs::VerbsConfig {
        crate::verbs::VerbsConfig {
            gid_index: self.rdma_gid_index,
            n_qps: self.rdma_qps,
            max_nics: self.rdma_max_nics,
            qp_depth: self.rdma_qp_depth,
            max_rd_atomic: self.rdma_max_rd_atomic,
            service_level: self.rdma_sl,
            traffic_class: self.rdma_tc,
            ..Default::default()
        }
    }

    /// Checks every field against its bounds. `EndpointBuilder::build` calls it, and so does `from_env`, so
    /// a value set in code meets the same rules as one from a variable.
    /// The error names the field, its variable and the value.
    pub fn validate(&self) -> Result<()> {
        macro_rules! check {
            ($($field:ident: $var:literal, $min:expr, $max:expr;)*) => {$(
                within(
                    concat!(stringify!($field), " (", $var, ")"),
                    self.$field,
                    $min,
                    $max,
                )?;
            )*};
        }
        numeric_settings!(check);
        if let Some(g) = self.gpu {
            within("gpu (FERRY_GPU)", g, 0, 1023)?;
        }
        if let Some(g) = self.rdma_gid_index {
            within("rdma_gid_index (FERRY_RDMA_GID_INDEX)", g, 0, 255)?;
        }
        if let Some(d) = &self.rdma_dev {
            if d.split(',').all(|s| s.trim().is_empty()) {
                return Err(bad("rdma_dev (FERRY_RDMA_DEV)", d, "names no device"));
            }
        }
        if let Some(a) = self.advertise_addr {
            if a.is_unspecified() || a.is_multicast() {
                return Err(bad(
                    "advertise_addr (FERRY_ADVERTISE_ADDR)",
                    &a.to_string(),
                    "peers cannot connect to an unspecified or multicast address",
                ));
            }
        }
        Ok(())
    }

    /// Defaults overridden by every `FERRY_*` variable that is set,
    /// validated.
    pub fn from_env() -> Result<Config> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// As `from_env`, reading variables through `get` (for tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let mut c = Config::default();
        let addr = |name: &'static str, v: &str| -> Result<IpAddr> {
            v.trim()
                .parse()
                .map_err(|_| bad(name, v, "not an IP address"))
        };
        if let Some(v) = get("FERRY_LISTEN_ADDR") {
            c.listen_addr = addr("FERRY_LISTEN_ADDR", &v)?;
        }
        if let Some(v) = get("FERRY_LISTEN_PORT") {
            c.listen_port = num("FERRY_LISTEN_PORT", &v)?;
        }
        if let Some(v) = get("FERRY_ADVERTISE_ADDR") {
            c.advertise_addr = Some(addr("FERRY_ADVERTISE_ADDR", &v)?);
        }
        macro_rules! read {
            ($($field:ident: $var:literal, $min:expr, $max:expr;)*) => {$(
                if let Some(v) = get($var) {
                    c.$field = num($var, &v)?;
                }
            )*};
        }
        numeric_settings!(read);
        if let Some(v) = get("FERRY_RDMA_GID_INDEX") {
            c.rdma_gid_index = Some(num("FERRY_RDMA_GID_INDEX", &v)?);
        }
        if let Some(v) = get("FERRY_GPU") {
            c.gpu = Some(num("FERRY_GPU", &v)?);
        }
        if let Some(v) = get("FERRY_IO") {
            c.io = match v.trim() {
                "auto" => IoPreference::Auto,
                "uring" | "io_uring" => IoPreference::Uring,
                "epoll" => IoPreference::Epoll,
                _ => return Err(bad("FERRY_IO", &v, "expected auto, uring or epoll")),
            };
        }
        if let Some(v) = get("FERRY_TRANSPORT") {
            c.transport = match v.trim() {
                "auto" => Transport::Auto,
                "tcp" => Transport::Tcp,
                "shm" => Transport::Shm,
                _ => return Err(bad("FERRY_TRANSPORT", &v, "expected auto, tcp or shm")),
            };
        }
        if let Some(v) = get("FERRY_PIN") {
            c.pin_cores = match v.trim() {
                "1" | "true" | "yes" => true,
                "0" | "false" | "no" => false,
                _ => return Err(bad("FERRY_PIN", &v, "expected 0 or 1")),
            };
        }
        if let Some(v) = get("FERRY_RDMA_DEV") {
            c.rdma_dev = Some(v);
        }
        if let Some(v) = get("FERRY_INTEGRITY") {
            c.integrity = match v.trim() {
                "headers" => Integrity::Headers,
                "full" => Integrity::Full,
                _ => return Err(bad("FERRY_INTEGRITY", &v, "expected headers or full")),
            };
        }
        if let Some(v) = get("FERRY_AUTH_KEY") {
            c.auth_key = Some(Secret::new(v.into_bytes())?);
        }
        if let Some(v) = get("FERRY_LOG") {
            c.log = v;
        }
        c.validate()?;
        Ok(c)
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    pub fn op_timeout(&self) -> Duration {
        Duration::from_millis(self.op_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let v: Vec<(String, String)> = pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        move |k| v.iter().find(|(a, _)| a == k).map(|(_, b)| b.clone())
    }

    #[test]
    fn reads_and_validates_variables() {
        let c = Config::from_lookup(env(&[
            ("FERRY_SHARDS", "3"),
            ("FERRY_IO", "epoll"),
            ("FERRY_MAX_INFLIGHT_OPS", "77"),
            ("FERRY_LISTEN_ADDR", "::1"),
        ]))
        .unwrap();
        assert_eq!(c.shards, 3);
        assert_eq!(c.io, IoPreference::Epoll);
        assert_eq!(c.max_inflight_ops, 77);
        assert!(c.listen_addr.is_ipv6());
        let e = Config::from_lookup(env(&[("FERRY_SHARDS", "0")])).unwrap_err();
        assert!(e.to_string().contains("FERRY_SHARDS"), "{e}");
        assert!(e.to_string().contains("\"0\""), "{e}");
        let c = Config::from_lookup(env(&[("FERRY_TRANSPORT", "shm")])).unwrap();
        assert_eq!(c.transport, Transport::Shm);
        let e = Config::from_lookup(env(&[("FERRY_TRANSPORT", "carrier-pigeon")])).unwrap_err();
        assert!(e.to_string().contains("carrier-pigeon"), "{e}");
        assert!(Config::from_lookup(env(&[("FERRY_OP_TIMEOUT_MS", "x")])).is_err());
    }

    #[test]
    fn validate_names_each_zero_field() {
        type Set = fn(&mut Config);
        let cases: [(&str, Set); 8] = [
            ("advertise_addr", |c| {
                c.advertise_addr = Some("0.0.0.0".parse().unwrap())
            }),
            ("shards", |c| c.shards = 0),
            ("max_inflight_ops", |c| c.max_inflight_ops = 0),
            ("streams_per_conn", |c| c.streams_per_conn = 0),
            ("chunk_bytes", |c| c.chunk_bytes = 0),
            ("sq_depth", |c| c.sq_depth = 0),
            ("stream_inflight", |c| c.stream_inflight = 0),
            ("inbox_depth", |c| c.inbox_depth = 0),
        ];
        assert!(Config::default().validate().is_ok());
        for (field, set) in cases {
            let mut c = Config::default();
            set(&mut c);
            let e = c.validate().unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("invalid {field} (FERRY_")),
                "{field}: {e}"
            );
        }
    }
}

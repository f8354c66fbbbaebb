//! `Config`: every knob of an endpoint, settable from code or read once from
//! `FERRY_*` environment variables.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::gpu::GpuCopy;
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

/// Whether tcp frames of typed values are compressed (`FERRY_COMPRESS`;
/// UCCL's `UCCL_P2P_COMPRESS_STRATEGY` is read when it is unset: `none`,
/// `off` or `0` is `Off`, any strategy `On`). Only between peers that both
/// allow it, only memory registered with a value type
/// (`MemoryRegion::set_dtype`), never on shm, CUDA IPC or RDMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compress {
    /// Never; the handshake tells the peer not to either.
    Off,
    /// While a connection's measured link rate (how fast its socket
    /// drains when full) is below what the codec threads sustain: a slow
    /// link gains, loopback and fast links are left alone.
    Auto,
    /// Every chunk of typed values (at least 16 KiB) is tried.
    On,
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

/// The settings: each field with its doc, type, default, variable and how
/// a value is read and checked (`range(min, max)`: a number in that range;
/// `opt_range`: the same, optional; `with(f)`: parsed by `f`, checked in
/// `validate` if at all; `code`: set in code only). The struct, its
/// defaults, `from_lookup` and the range checks of `validate` all come
/// from this one table.
macro_rules! settings {
    ($then:ident) => {
        $then! {
            /// Address the control listener binds (`FERRY_LISTEN_ADDR`, default 0.0.0.0).
            listen_addr: IpAddr = IpAddr::V4(Ipv4Addr::UNSPECIFIED), "FERRY_LISTEN_ADDR", with(addr);
            /// Port it binds; 0 picks a free one (`FERRY_LISTEN_PORT`).
            listen_port: u16 = 0, "FERRY_LISTEN_PORT", with(num);
            /// Address put in the metadata (`FERRY_ADVERTISE_ADDR`). Default: the
            /// listen address, or when that is unspecified the first non-loopback
            /// IPv4 address of an up interface, else 127.0.0.1.
            advertise_addr: Option<IpAddr> = None, "FERRY_ADVERTISE_ADDR", with(some_addr);
            /// Number of shards (`FERRY_SHARDS`, default 1).
            shards: usize = 1, "FERRY_SHARDS", range(1, 256);
            /// Who runs the shards: ferry's threads (`Managed`) or the caller
            /// (`Embedded`, `take_shards`); set in code.
            mode: Mode = Mode::Managed, "", code;
            /// Operations in flight across the endpoint (`FERRY_MAX_INFLIGHT_OPS`, default 4096).
            max_inflight_ops: usize = 4096, "FERRY_MAX_INFLIGHT_OPS", range(1, 1 << 20);
            /// Request frames outstanding per stream (`FERRY_STREAM_INFLIGHT`, default 1024).
            stream_inflight: usize = 1024, "FERRY_STREAM_INFLIGHT", range(1, 1 << 20);
            /// Depth of each shard's submission queue (`FERRY_SQ_DEPTH`, default 4096);
            /// also the most commands one connection may have waiting for room.
            sq_depth: usize = 4096, "FERRY_SQ_DEPTH", range(1, 1 << 20);
            /// TCP streams per connection (`FERRY_STREAMS`, default 1).
            streams_per_conn: u16 = 1, "FERRY_STREAMS", range(1, crate::wire::MAX_STREAMS);
            /// The most shards one tcp connection's streams are spread over
            /// (`FERRY_LANES`, default 0: as many as streams and shards allow; 1:
            /// every connection on one shard). Each lane is a group of the
            /// connection's streams on its own shard; large operations (≥ 2
            /// chunks) are split over the lanes, vectored ones dealt over them,
            /// and each application thread's small ones go to one lane (threads
            /// are dealt lanes round-robin).
            lanes: usize = 0, "FERRY_LANES", range(0, 255);
            /// Operations larger than this are split into frames of this size,
            /// dealt round-robin over the streams (`FERRY_CHUNK_BYTES`, default 4 MiB).
            chunk_bytes: usize = 4 << 20, "FERRY_CHUNK_BYTES", range(4096, 1 << 30);
            /// Connect and handshake deadline (`FERRY_CONNECT_TIMEOUT_MS`, default 5000).
            connect_timeout_ms: u64 = 5000, "FERRY_CONNECT_TIMEOUT_MS", range(1, 3_600_000);
            /// A request with no response for this long fails its connection
            /// (`FERRY_OP_TIMEOUT_MS`, default 10000).
            op_timeout_ms: u64 = 10_000, "FERRY_OP_TIMEOUT_MS", range(1, 3_600_000);
            /// A tcp connection whose peer answers nothing for this long —
            /// idle or not — is failed (PeerGone): keepalive probes find a
            /// peer that vanished without a FIN (power cut, pulled link)
            /// while nothing is in flight (`FERRY_LIVENESS_MS`, default 5000,
            /// at least 1000).
            liveness_ms: u64 = 5_000, "FERRY_LIVENESS_MS", range(1_000, 3_600_000);
            /// An op in flight this long is reported stalled, once: a warning
            /// naming its connection, peer, size and age, and
            /// `ferry_stalled_ops_total` (`FERRY_STALL_MS`; default 0: half
            /// the op timeout).
            stall_ms: u64 = 0, "FERRY_STALL_MS", range(0, 3_600_000);
            /// How long an idle shard spins before it parks (`FERRY_SPIN_US`, default 50).
            spin_us: u64 = 50, "FERRY_SPIN_US", range(0, 10_000_000);
            /// How much of that spin polls without giving up the core; the rest
            /// yields the core on each idle pass (`FERRY_SPIN_YIELD_US`, default
            /// 20; 0: yield on every idle pass).
            spin_yield_us: u64 = 20, "FERRY_SPIN_YIELD_US", range(0, 10_000_000);
            /// Of that spin, how many idle passes right after work poll again
            /// without the CPU's pause hint (`FERRY_SPIN_EAGER_PASSES`, default
            /// 32; 0: every spinning pass pauses first).
            spin_eager_passes: u32 = 32, "FERRY_SPIN_EAGER_PASSES", range(0, 1_000_000);
            /// Control-path backend (`FERRY_IO=auto|uring|epoll`).
            io: IoPreference = IoPreference::Auto, "FERRY_IO", with(io_preference);
            /// Data path (`FERRY_TRANSPORT=auto|tcp|shm`).
            transport: Transport = Transport::Auto, "FERRY_TRANSPORT", with(transport);
            /// Pin managed shard threads to cores (`FERRY_PIN=1`, default off).
            pin_cores: bool = false, "FERRY_PIN", with(flag);
            /// Notifications held for the application (`FERRY_INBOX_DEPTH`, default 1024).
            inbox_depth: usize = 1024, "FERRY_INBOX_DEPTH", range(1, 1 << 20);
            /// Notifications one connection may have accepted and not yet handed
            /// to its stream or ring (`FERRY_NOTIFY_OUTBOX`, default 1024); past
            /// it `send_notification` refuses with `NotifyOutboxFull` (busy).
            notify_outbox: usize = 1024, "FERRY_NOTIFY_OUTBOX", range(1, 1 << 20);
            /// Open connections at most, incoming and outgoing (`FERRY_MAX_CONNS`, default 4096).
            max_conns: usize = 4096, "FERRY_MAX_CONNS", range(1, 1 << 20);
            /// Connections one remote address may hold at most, so no single peer
            /// takes every slot (`FERRY_MAX_CONNS_PER_PEER`, default 1024; at most
            /// `max_conns`).
            max_conns_per_peer: usize = 1024, "FERRY_MAX_CONNS_PER_PEER", range(1, 1 << 20);
            /// A connection with nothing in flight and no traffic for this long is
            /// closed (`FERRY_IDLE_TIMEOUT_MS`; default 0: never).
            idle_timeout_ms: u64 = 0, "FERRY_IDLE_TIMEOUT_MS", range(0, 86_400_000);
            /// Live registrations at most (`FERRY_MAX_REGISTRATIONS`, default 65536).
            max_registrations: usize = 65536, "FERRY_MAX_REGISTRATIONS", range(1, 1 << 24);
            /// Operations in flight on one connection at most
            /// (`FERRY_MAX_CONN_INFLIGHT_OPS`, default 4096).
            max_conn_inflight_ops: usize = 4096, "FERRY_MAX_CONN_INFLIGHT_OPS", range(1, 1 << 20);
            /// Shared secret peers must prove in the handshake (`FERRY_AUTH_KEY`):
            /// an HMAC-SHA256 challenge-response both ways; a peer without it, or
            /// with another, is refused. `None`: no authentication.
            auth_key: Option<Secret> = None, "FERRY_AUTH_KEY", with(secret);
            /// What the frame MACs cover on authenticated connections
            /// (`FERRY_INTEGRITY=headers|full`, default headers). Secrecy is not
            /// offered: use a private network or a tunnel for that.
            integrity: Integrity = Integrity::Headers, "FERRY_INTEGRITY", with(integrity);
            /// The endpoint's GPU (`FERRY_GPU`, an index into the visible devices).
            /// `None`: lazy — the first registered GPU pointer picks it, else GPU 0
            /// when GPU work needs one.
            gpu: Option<usize> = None, "FERRY_GPU", opt_range(0, 1023);
            /// CUDA streams per device that split large IPC copies
            /// (`FERRY_GPU_STREAMS`, default 4, at most 8).
            gpu_streams: usize = 4, "FERRY_GPU_STREAMS", range(1, 8);
            /// How a batch of small GPU copies runs (`FERRY_GPU_COPY=auto|kernel|engine`,
            /// default auto: each copier times the gather kernel against the copy
            /// engine and takes the faster).
            gpu_copy: GpuCopy = GpuCopy::Auto, "FERRY_GPU_COPY", with(gpu_copy);
            /// How long the copy runner, a kernel that stays resident to make a
            /// lone small copy (≤ 64 KiB) without a launch, waits for the next
            /// one before it ends (`FERRY_GPU_RUNNER_US`, default 100; 0: off,
            /// every copy is launched). It also ends after twenty such spans
            /// alive, so a device-wide synchronisation never waits longer.
            gpu_runner_us: u64 = 100, "FERRY_GPU_RUNNER_US", range(0, 100_000);
            /// Batches of at least this many small GPU copies give the gather
            /// kernel its descriptors in device memory (one more copy before
            /// the launch); smaller ones from pinned host memory, read by the
            /// kernel over the bus (`FERRY_GPU_DEVICE_DESCS`, default 256).
            gpu_device_descs: usize = 256, "FERRY_GPU_DEVICE_DESCS", range(1, 1 << 30);
            /// Bounce slots of host memory a receiver grants each same-host
            /// connection for two-sided messages sent before their receive
            /// is posted (`FERRY_MSG_BOUNCE_SLOTS`, default 16, at most 64;
            /// 0: none, every such message waits for its offer).
            msg_bounce_slots: u16 = 16, "FERRY_MSG_BOUNCE_SLOTS", range(0, 64);
            /// The same for receives of GPU memory, in slots of its GPU
            /// (`FERRY_MSG_BOUNCE_GPU_SLOTS`, default 0: off, since on an H100
            /// they made UCCL's request loop slower; docs/benchmarks-log.md).
            msg_bounce_gpu_slots: u16 = 0, "FERRY_MSG_BOUNCE_GPU_SLOTS", range(0, 64);
            /// Pinned bounce memory per shard for GPU memory on tcp
            /// (`FERRY_GPU_BOUNCE_BYTES`, default 256 MiB), in buffers of
            /// `chunk_bytes` (at least 2).
            gpu_bounce_bytes: usize = 256 << 20, "FERRY_GPU_BOUNCE_BYTES", range(1, 1 << 40);
            /// RDMA devices to use, best first (`FERRY_RDMA_DEV=name[,name]`);
            /// default: the NICs nearest the GPU on the PCIe tree.
            rdma_dev: Option<String> = None, "FERRY_RDMA_DEV", with(some_string);
            /// GID table index (`FERRY_RDMA_GID_INDEX`). `None` (the default):
            /// searched in the port's GID table — a RoCE v2 IPv4-mapped GID first,
            /// then another RoCE v2 one, else index 0 (`verbs::nic::best_gid`).
            rdma_gid_index: Option<u32> = None, "FERRY_RDMA_GID_INDEX", opt_range(0, 255);
            /// Data queue pairs per connection (`FERRY_RDMA_QPS`, default 4, at most 64).
            rdma_qps: usize = 4, "FERRY_RDMA_QPS", range(1, crate::wire::MAX_DATA_QPS);
            /// Work requests each data queue pair holds (`FERRY_RDMA_QP_DEPTH`,
            /// default 256, 16..=32768): what a connection pins on the NIC grows
            /// with it (256: about 128 KiB per connection with 4 queue pairs).
            rdma_qp_depth: u32 = 256, "FERRY_RDMA_QP_DEPTH", range(16, 32768);
            /// NICs an endpoint opens and stripes each connection's queue pairs
            /// over (`FERRY_RDMA_MAX_NICS`, default 4, 1..=4): the ones nearest its
            /// GPU, or those `FERRY_RDMA_DEV` names.
            rdma_max_nics: usize = 4, "FERRY_RDMA_MAX_NICS", range(1, crate::wire::MAX_NICS);
            /// Outstanding RDMA READs per queue pair (`FERRY_RDMA_MAX_RD_ATOMIC`, default 16).
            rdma_max_rd_atomic: u8 = 16, "FERRY_RDMA_MAX_RD_ATOMIC", range(1, 255);
            /// Service level of the queue pairs (`FERRY_RDMA_SL`, default 0).
            rdma_sl: u8 = 0, "FERRY_RDMA_SL", range(0, 15);
            /// Traffic class of the queue pairs (`FERRY_RDMA_TC`, default 0).
            rdma_tc: u8 = 0, "FERRY_RDMA_TC", range(0, 255);
            /// Log filter for the `ferry` binary (`FERRY_LOG`, default "warn"); the
            /// library itself only emits `tracing` events.
            log: String = "warn".to_owned(), "FERRY_LOG", with(string);
            /// Lossless compression of typed values on tcp
            /// (`FERRY_COMPRESS=off|auto|on`, default auto; see [`Compress`]).
            compress: Compress = Compress::Auto, "FERRY_COMPRESS", with(compress);
            /// Codec threads of the endpoint (`FERRY_COMPRESS_THREADS`, default
            /// 0: half the cores, 1 to 8); they start with the first chunk
            /// packed or unpacked.
            compress_threads: usize = 0, "FERRY_COMPRESS_THREADS", range(0, 256);
            /// Threads that share one large same-host host-memory copy, its
            /// shard included (`FERRY_COPY_THREADS`; 0: half the cores, at most 8;
            /// 1: the shard alone). Copies of 2 MiB or more are cut into slices
            /// of at least 1 MiB; the threads start with the first such copy.
            copy_threads: usize = 0, "FERRY_COPY_THREADS", range(0, 64);
        }
    };
}

/// Declares `Config` and its `Default` from the table.
macro_rules! declare {
    ($(
        $(#[$meta:meta])*
        $field:ident: $ty:ty = $default:expr, $var:literal, $how:ident $(($($arg:expr),*))?;
    )*) => {
        /// Every knob of an endpoint. Start from `Config::default()` or
        /// `Config::from_env()` and set fields; `EndpointBuilder::build` checks the
        /// result with [`Config::validate`]. `#[non_exhaustive]`: new knobs are
        /// not breaking changes, so build one by assignment, not a struct literal.
        #[derive(Debug, Clone)]
        #[non_exhaustive]
        pub struct Config {
            $($(#[$meta])* pub $field: $ty,)*
        }

        impl Default for Config {
            fn default() -> Self {
                Self { $($field: $default,)* }
            }
        }

        /// Every variable a setting is read from.
        #[cfg(test)]
        const VARIABLES: &[&str] = &[$($var),*];

        impl Config {
            /// Sets every field whose variable `get` knows.
            fn read_vars(&mut self, get: &impl Fn(&str) -> Option<String>) -> Result<()> {
                $(setting!(read $how $(($($arg),*))?, self.$field, $var, get);)*
                Ok(())
            }

            /// Checks every field that has a range.
            fn check_ranges(&self) -> Result<()> {
                $(setting!(check $how $(($($arg),*))?, self.$field,
                    concat!(stringify!($field), " (", $var, ")"));)*
                Ok(())
            }
        }
    };
}

/// How one setting is read from its variable and checked.
macro_rules! setting {
    (read range($min:expr, $max:expr), $slot:expr, $var:literal, $get:expr) => {
        if let Some(v) = $get($var) {
            $slot = num($var, v)?;
        }
    };
    (read opt_range($min:expr, $max:expr), $slot:expr, $var:literal, $get:expr) => {
        if let Some(v) = $get($var) {
            $slot = Some(num($var, v)?);
        }
    };
    (read with($f:expr), $slot:expr, $var:literal, $get:expr) => {
        if let Some(v) = $get($var) {
            $slot = $f($var, v)?;
        }
    };
    (read code, $slot:expr, $var:literal, $get:expr) => {};
    (check range($min:expr, $max:expr), $v:expr, $name:expr) => {
        within($name, $v, $min, $max)?;
    };
    (check opt_range($min:expr, $max:expr), $v:expr, $name:expr) => {
        if let Some(x) = $v {
            within($name, x, $min, $max)?;
        }
    };
    (check with($f:expr), $v:expr, $name:expr) => {};
    (check code, $v:expr, $name:expr) => {};
}

settings!(declare);

fn bad(name: &'static str, value: &str, reason: impl Into<String>) -> Error {
    Error::Config {
        name,
        value: value.to_owned(),
        reason: reason.into(),
    }
}

/// Parses a number; its range is checked by `validate`.
fn num<T: std::str::FromStr>(name: &'static str, v: String) -> Result<T> {
    v.trim().parse().map_err(|_| bad(name, &v, "not a number"))
}

fn addr(name: &'static str, v: String) -> Result<IpAddr> {
    v.trim()
        .parse()
        .map_err(|_| bad(name, &v, "not an IP address"))
}

fn some_addr(name: &'static str, v: String) -> Result<Option<IpAddr>> {
    addr(name, v).map(Some)
}

fn gpu_copy(name: &'static str, v: String) -> Result<GpuCopy> {
    Ok(match v.trim().to_ascii_lowercase().as_str() {
        "auto" => GpuCopy::Auto,
        "kernel" => GpuCopy::Kernel,
        "engine" => GpuCopy::Engine,
        _ => return Err(bad(name, &v, "expected auto, kernel or engine")),
    })
}

fn io_preference(name: &'static str, v: String) -> Result<IoPreference> {
    Ok(match v.trim() {
        "auto" => IoPreference::Auto,
        "uring" | "io_uring" => IoPreference::Uring,
        "epoll" => IoPreference::Epoll,
        _ => return Err(bad(name, &v, "expected auto, uring or epoll")),
    })
}

fn transport(name: &'static str, v: String) -> Result<Transport> {
    Ok(match v.trim() {
        "auto" => Transport::Auto,
        "tcp" => Transport::Tcp,
        "shm" => Transport::Shm,
        _ => return Err(bad(name, &v, "expected auto, tcp or shm")),
    })
}

fn compress(name: &'static str, v: String) -> Result<Compress> {
    Ok(match v.trim().to_ascii_lowercase().as_str() {
        "off" | "none" | "0" => Compress::Off,
        "auto" => Compress::Auto,
        "on" | "1" => Compress::On,
        _ => return Err(bad(name, &v, "expected off, auto or on")),
    })
}

/// UCCL's variable: any strategy it knows compresses.
fn uccl_compress(name: &'static str, v: String) -> Result<Compress> {
    Ok(match v.trim().to_ascii_lowercase().as_str() {
        "" | "none" | "off" | "0" => Compress::Off,
        "split" | "split_only" | "encode" | "full" | "split_encode" => Compress::On,
        _ => return Err(bad(name, &v, "expected none, split_only, encode or full")),
    })
}

fn flag(name: &'static str, v: String) -> Result<bool> {
    match v.trim() {
        "1" | "true" | "yes" => Ok(true),
        "0" | "false" | "no" => Ok(false),
        _ => Err(bad(name, &v, "expected 0 or 1")),
    }
}

fn integrity(name: &'static str, v: String) -> Result<Integrity> {
    match v.trim() {
        "headers" => Ok(Integrity::Headers),
        "full" => Ok(Integrity::Full),
        _ => Err(bad(name, &v, "expected headers or full")),
    }
}

fn secret(_name: &'static str, v: String) -> Result<Option<Secret>> {
    Secret::new(v.into_bytes()).map(Some)
}

fn some_string(_name: &'static str, v: String) -> Result<Option<String>> {
    Ok(Some(v))
}

fn string(_name: &'static str, v: String) -> Result<String> {
    Ok(v)
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
        self.check_ranges()?;
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
        c.read_vars(&get)?;
        if get("FERRY_COMPRESS").is_none() {
            if let Some(v) = get("UCCL_P2P_COMPRESS_STRATEGY") {
                c.compress = uccl_compress("UCCL_P2P_COMPRESS_STRATEGY", v)?;
            }
        }
        c.validate()?;
        Ok(c)
    }

    /// `connect_timeout_ms` as a `Duration`.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// When an op in flight is reported stalled (`stall_ms`, or half the
    /// op timeout).
    pub fn stall(&self) -> Duration {
        match self.stall_ms {
            0 => self.op_timeout() / 2,
            ms => Duration::from_millis(ms),
        }
    }

    /// `op_timeout_ms` as a `Duration`.
    pub fn op_timeout(&self) -> Duration {
        Duration::from_millis(self.op_timeout_ms)
    }

    /// Threads that share one large same-host copy under this config,
    /// its shard included: `copy_threads`, or for 0 its default on this
    /// machine (half the cores, at most 8).
    pub fn copy_share(&self) -> usize {
        match self.copy_threads {
            0 => crate::reactor::copy_pool::default_share(
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            ),
            n => n,
        }
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
            ("FERRY_GPU_COPY", "Kernel"),
            ("FERRY_MAX_INFLIGHT_OPS", "77"),
            ("FERRY_LISTEN_ADDR", "::1"),
        ]))
        .unwrap();
        assert_eq!(c.shards, 3);
        assert_eq!(c.io, IoPreference::Epoll);
        assert_eq!(c.gpu_copy, GpuCopy::Kernel);
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
        let e = Config::from_lookup(env(&[("FERRY_GPU_COPY", "dma")])).unwrap_err();
        assert!(
            e.to_string().contains("expected auto, kernel or engine"),
            "{e}"
        );
    }

    /// The table names each variable once, and the README documents each.
    #[test]
    fn every_variable_is_distinct_and_documented() {
        let readme = include_str!("../../README.md");
        let vars: Vec<&str> = VARIABLES
            .iter()
            .copied()
            .filter(|v| !v.is_empty())
            .collect();
        let mut seen = std::collections::HashSet::new();
        for v in &vars {
            assert!(seen.insert(*v), "{v} twice in the table");
            assert!(readme.contains(v), "{v} is not in the README");
        }
        assert!(vars.len() >= 35, "{}", vars.len());
    }

    /// The README's table of bad values: each `FERRY_*` row's input is
    /// refused with the message the row quotes.
    #[test]
    fn every_bad_value_in_the_readme_gets_what_it_says() {
        let readme = include_str!("../../README.md");
        let table = readme
            .split("### What a bad value gets")
            .nth(1)
            .expect("the README has the table")
            .split("\n#")
            .next()
            .unwrap();
        let mut n = 0;
        for row in table.lines().filter(|l| l.starts_with("| `FERRY_")) {
            let quoted: Vec<&str> = row.split('`').skip(1).step_by(2).collect();
            let (input, want) = (quoted[0], quoted[quoted.len() - 1]);
            let (var, value) = input.split_once('=').expect("VAR=value");
            if var == "FERRY_LOG" {
                continue; // the binary's (cli/tests/bad_values.rs)
            }
            let e = Config::from_lookup(env(&[(var, value)]))
                .err()
                .unwrap_or_else(|| panic!("{input} was accepted"));
            assert!(e.to_string().contains(want), "{input}: {e}");
            n += 1;
        }
        assert!(n >= 35, "{n} rows");
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

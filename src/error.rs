//! The library's error type. Every variant carries the values that were
//! wrong, so a log line or a test failure says what happened without a
//! debugger.

use std::fmt;
use std::io;
use std::net::SocketAddr;

use thiserror::Error;

use crate::wire::{DecodeError, Status};

/// Identifies a connection within one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "conn#{}", self.0)
    }
}

/// Which one-sided operation an error belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    Write,
    Read,
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OpKind::Write => "WRITE",
            OpKind::Read => "READ",
        })
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Status::Ok => "ok",
            Status::UnknownKey => "no live registration has this rkey",
            Status::OutOfBounds => "range lies outside the registration",
            Status::AccessDenied => "registration does not permit this access",
            Status::PeerMemory => {
                "the target could not reach the initiator's memory (process_vm_readv/writev)"
            }
            Status::DeviceMemory => {
                "the registration is GPU memory, which this path cannot reach (use write_ipc/read_ipc)"
            }
        })
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    #[error("bad bytes: {0}")]
    Decode(#[from] DecodeError),
    #[error("{op} failed: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("connect to {addr} timed out after {timeout_ms} ms")]
    ConnectTimeout { addr: SocketAddr, timeout_ms: u64 },
    #[error("connect to {addr} failed: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("no connection arrived within {timeout_ms} ms")]
    AcceptTimeout { timeout_ms: u64 },
    #[error("handshake with {peer} failed: {reason}")]
    Handshake { peer: SocketAddr, reason: String },
    #[error("{conn} is unknown (never opened here, or removed)")]
    UnknownConn { conn: ConnId },
    /// The connection is dead; every later operation on it gets this error.
    #[error("{conn} failed: {reason}")]
    ConnFailed { conn: ConnId, reason: String },
    #[error("target refused {op} of {len} bytes at {addr:#x} (rkey {rkey:#x}): {status}")]
    Remote {
        op: OpKind,
        status: Status,
        rkey: u32,
        addr: u64,
        len: u64,
    },
    #[error("range offset {offset} + len {len} is outside the {region_len}-byte region")]
    OutOfRange {
        offset: usize,
        len: usize,
        region_len: usize,
    },
    #[error("{len} bytes do not fit the {remote_size}-byte remote buffer")]
    RemoteTooSmall { len: usize, remote_size: u32 },
    #[error("the region at {addr:#x} ({len} bytes) is read-only here: a READ cannot land in it")]
    ReadOnlyDestination { addr: u64, len: usize },
    #[error("[{addr:#x}, +{len}) cannot be registered: {reason}")]
    BadRange {
        addr: u64,
        len: usize,
        reason: String,
    },
    #[error("vectored op has {locals} local slices but {remotes} remote buffers")]
    VectorMismatch { locals: usize, remotes: usize },
    #[error("vectored op is empty")]
    EmptyVector,
    #[error("submission queue of shard {shard} is full ({capacity} entries)")]
    QueueFull { shard: usize, capacity: usize },
    /// One connection may hold at most `FERRY_SQ_DEPTH` commands waiting
    /// for room; more are refused at once (its peer is not keeping up).
    #[error("{conn} already has {waiting} commands waiting for room (FERRY_SQ_DEPTH): its peer is not keeping up")]
    Backlogged { conn: ConnId, waiting: usize },
    #[error("all {max} in-flight operation slots are taken (FERRY_MAX_INFLIGHT_OPS)")]
    TooManyInflight { max: usize },
    #[error("timed out after {timeout_ms} ms waiting for {what}")]
    Timeout { what: &'static str, timeout_ms: u64 },
    #[error("notification of {len} bytes exceeds the {max}-byte limit")]
    NotifyTooLong { len: usize, max: usize },
    /// Two-sided: the message (`len` bytes) was longer than the buffer the
    /// receiver posted for it (`posted` bytes); both sides get this.
    #[error(
        "a message of {len} bytes does not fit the {posted}-byte receive buffer posted for it"
    )]
    MessageTooLarge { len: u64, posted: u64 },
    #[error("invalid {name} = {value:?}: {reason}")]
    Config {
        name: &'static str,
        value: String,
        reason: String,
    },
    #[error("{what} is not possible: {reason}")]
    Unsupported { what: &'static str, reason: String },
    #[error("limit {limit}={max} reached")]
    LimitReached { limit: &'static str, max: usize },
    #[error("the endpoint is shut down")]
    Shutdown,
    /// No GPU path: no driver, no device, or a build without `gpu`.
    #[error("no GPU: {why}")]
    NoGpu { why: String },
    #[error("GPU index {idx} is out of range: {count} GPU(s) visible")]
    GpuOutOfRange { idx: usize, count: usize },
    #[error("RDMA verbs: {what} failed: {reason}")]
    Verbs { what: &'static str, reason: String },
    #[error("CUDA {call} failed: {name} ({code})")]
    Cuda {
        call: &'static str,
        code: u32,
        name: String,
    },
}

impl Error {
    pub(crate) fn io(op: &'static str, source: io::Error) -> Self {
        Error::Io { op, source }
    }

    /// A copy for the cases where one failure must be reported to many
    /// waiters (a dead connection fails every op on it).
    pub(crate) fn duplicate(&self) -> Error {
        match self {
            Error::ConnFailed { conn, reason } => Error::ConnFailed {
                conn: *conn,
                reason: reason.clone(),
            },
            Error::Remote {
                op,
                status,
                rkey,
                addr,
                len,
            } => Error::Remote {
                op: *op,
                status: *status,
                rkey: *rkey,
                addr: *addr,
                len: *len,
            },
            Error::Timeout { what, timeout_ms } => Error::Timeout {
                what,
                timeout_ms: *timeout_ms,
            },
            Error::Shutdown => Error::Shutdown,
            Error::UnknownConn { conn } => Error::UnknownConn { conn: *conn },
            Error::Backlogged { conn, waiting } => Error::Backlogged {
                conn: *conn,
                waiting: *waiting,
            },
            Error::LimitReached { limit, max } => Error::LimitReached { limit, max: *max },
            Error::MessageTooLarge { len, posted } => Error::MessageTooLarge {
                len: *len,
                posted: *posted,
            },
            Error::QueueFull { shard, capacity } => Error::QueueFull {
                shard: *shard,
                capacity: *capacity,
            },
            other => Error::ConnFailed {
                conn: ConnId(u64::MAX),
                reason: other.to_string(),
            },
        }
    }
}

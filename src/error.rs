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
    /// Bytes from here into the peer's window.
    Write,
    /// Bytes from the peer's window into here.
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

/// The library's `Result`: its error is [`enum@Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why an optional path is off on this machine (RDMA verbs, the same-host
/// path, io_uring): not a failure of any call — the endpoint uses the
/// other paths — but what the log, `ferry info` and the `*_status` calls
/// say.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{why}")]
pub struct PathOff {
    /// What is missing or refused, in words.
    pub why: String,
}

impl From<String> for PathOff {
    fn from(why: String) -> Self {
        PathOff { why }
    }
}

impl From<&str> for PathOff {
    fn from(why: &str) -> Self {
        PathOff {
            why: why.to_owned(),
        }
    }
}

/// Why a connection failed: a cause a caller can match, carried unchanged
/// from where the failure is found to every face (Rust `Error::ConnFailed`,
/// the Python exception class, the C status, the NIXL status).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ConnFault {
    /// Nothing came back within a deadline of ours (`FERRY_OP_TIMEOUT_MS`,
    /// `FERRY_IDLE_TIMEOUT_MS`, a handshake's).
    #[error("{what}: nothing within {timeout_ms} ms")]
    Timeout {
        /// What did not come (and the setting that bounds it).
        what: &'static str,
        /// The deadline that passed.
        timeout_ms: u64,
    },
    /// The peer went away: it closed its end, reset it, or its process died.
    #[error("the peer is gone: {how}")]
    PeerGone {
        /// How it went: closed, reset, its process died, the network.
        how: &'static str,
    },
    /// An I/O failure on our side of the connection that is not the peer
    /// leaving (`errno` as the kernel gave it).
    #[error("{op} failed: {}", io::Error::from_raw_os_error(*errno))]
    Io {
        /// The call that failed.
        op: &'static str,
        /// Its `errno`.
        errno: i32,
    },
    /// The peer sent what the protocol forbids (bytes, requests, counts);
    /// `what` says which rule it broke, for a human.
    #[error("the peer broke the protocol: {what}")]
    PeerMisbehaved {
        /// The rule it broke.
        what: String,
    },
    /// Bytes failed their integrity check (a frame's MAC).
    #[error("integrity check failed: {what}")]
    Integrity {
        /// Which bytes (the frame's number).
        what: String,
    },
    /// A bound of ours, or the peer, refused what the connection needed
    /// (`why` names it).
    #[error("refused: {why}")]
    Refused {
        /// The bound, or the peer's refusal.
        why: String,
    },
    /// Closed on this side: `remove_remote`, or the endpoint shut down.
    #[error("closed here: {why}")]
    Closed {
        /// Who closed it: `remove_remote`, a shutdown, another lane.
        why: &'static str,
    },
    /// The NIC, the GPU or the OS failed a resource the connection needs.
    #[error("{what} failed: {detail}")]
    Device {
        /// The resource or call.
        what: &'static str,
        /// What it said.
        detail: String,
    },
}

/// What kind of failure an error is: the one mapping every face reports
/// from (the C status, the Python exception class, the NIXL status).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureKind {
    /// A bad argument, range, buffer or setting: the call did nothing.
    Invalid,
    /// A wait of the caller's ran out; what it waited for goes on.
    Timeout,
    /// No room now (back-pressure): the call did nothing; try again later.
    Busy,
    /// The target refused the operation (key, bounds or access).
    Remote,
    /// The connection is unknown, was closed here, or its peer left.
    Disconnected,
    /// The connection failed: its peer did not answer within our deadline.
    PeerTimeout,
    /// The connection failed: its peer broke the protocol, or its bytes
    /// failed their integrity check.
    PeerMisbehaved,
    /// Anything else: a device, the OS, an unsupported request.
    Other,
}

impl ConnFault {
    /// The kind a connection that failed for this reports.
    pub fn kind(&self) -> FailureKind {
        match self {
            ConnFault::Timeout { .. } => FailureKind::PeerTimeout,
            ConnFault::PeerMisbehaved { .. } | ConnFault::Integrity { .. } => {
                FailureKind::PeerMisbehaved
            }
            ConnFault::PeerGone { .. }
            | ConnFault::Closed { .. }
            | ConnFault::Refused { .. }
            | ConnFault::Io { .. }
            | ConnFault::Device { .. } => FailureKind::Disconnected,
        }
    }

    /// The peer broke a rule; `what` is the rule, for a human.
    pub fn misbehaved(what: impl Into<String>) -> Self {
        ConnFault::PeerMisbehaved { what: what.into() }
    }

    /// A bound of ours refused it.
    pub fn refused(why: impl Into<String>) -> Self {
        ConnFault::Refused { why: why.into() }
    }

    /// A device or resource failure.
    pub fn device(what: &'static str, detail: impl fmt::Display) -> Self {
        ConnFault::Device {
            what,
            detail: detail.to_string(),
        }
    }

    /// An OS error of `op` on the connection's socket or mapping: the
    /// errors that mean the peer left are `PeerGone`, the rest `Io`.
    pub fn from_io(op: &'static str, e: &io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::ECONNRESET) => ConnFault::PeerGone {
                how: "it reset the connection",
            },
            Some(libc::EPIPE) | Some(libc::ENOTCONN) | Some(libc::ESHUTDOWN) => {
                Self::closed_by_peer()
            }
            Some(libc::ECONNABORTED) | Some(libc::EHOSTUNREACH) | Some(libc::ENETUNREACH) => {
                ConnFault::PeerGone {
                    how: "the network dropped the connection",
                }
            }
            Some(libc::ETIMEDOUT) => ConnFault::PeerGone {
                how: "the kernel gave up on the connection (no acknowledgement)",
            },
            Some(errno) => ConnFault::Io { op, errno },
            None => ConnFault::Io {
                op,
                errno: libc::EIO,
            },
        }
    }

    /// The peer closed its end (end of file where a frame was expected).
    pub const fn closed_by_peer() -> Self {
        ConnFault::PeerGone {
            how: "it closed the connection",
        }
    }

    /// The peer's process is no longer alive (same host).
    pub const fn process_died() -> Self {
        ConnFault::PeerGone {
            how: "its process died",
        }
    }
}

/// Every failure of the library, with the values that were wrong.
/// [`Error::kind`] says which kind it is (what the C, Python and NIXL
/// faces report); a dead connection's cause is a [`ConnFault`].
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// Bytes from outside (metadata, a window, a frame) that do not parse.
    #[error("bad bytes: {0}")]
    Decode(#[from] DecodeError),
    /// A system call failed.
    #[error("{op} failed: {source}")]
    Io {
        /// The call.
        op: &'static str,
        /// What the OS said.
        #[source]
        source: io::Error,
    },
    /// Connecting (and the handshake) took longer than
    /// `FERRY_CONNECT_TIMEOUT_MS`.
    #[error("connect to {addr} timed out after {timeout_ms} ms")]
    ConnectTimeout {
        /// The peer's address.
        addr: SocketAddr,
        /// The deadline.
        timeout_ms: u64,
    },
    /// The peer could not be reached.
    #[error("connect to {addr} failed: {source}")]
    Connect {
        /// The peer's address.
        addr: SocketAddr,
        /// What the OS said.
        #[source]
        source: io::Error,
    },
    /// `accept` waited its whole timeout.
    #[error("no connection arrived within {timeout_ms} ms")]
    AcceptTimeout {
        /// The wait.
        timeout_ms: u64,
    },
    /// The peer answered the handshake with a refusal or nonsense.
    #[error("handshake with {peer} failed: {reason}")]
    Handshake {
        /// The peer's address.
        peer: SocketAddr,
        /// What went wrong, for a human.
        reason: String,
    },
    /// No such connection here (never opened, or removed by
    /// `remove_remote`).
    #[error("{conn} is unknown (never opened here, or removed)")]
    UnknownConn {
        /// The id asked for.
        conn: ConnId,
    },
    /// The connection is dead; every later operation on it gets this error
    /// (`cause` says why: match it).
    #[error("{conn} failed: {cause}")]
    ConnFailed {
        /// The connection.
        conn: ConnId,
        /// Why it died.
        cause: ConnFault,
    },
    /// The target checked the request and refused it.
    #[error("target refused {op} of {len} bytes at {addr:#x} (rkey {rkey:#x}): {status}")]
    Remote {
        /// WRITE or READ.
        op: OpKind,
        /// The target's answer.
        status: Status,
        /// The key the request named.
        rkey: u32,
        /// The remote address it named.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// A range outside its region.
    #[error("range offset {offset} + len {len} is outside the {region_len}-byte region")]
    OutOfRange {
        /// The range's start in the region.
        offset: usize,
        /// Its length.
        len: usize,
        /// The region's length.
        region_len: usize,
    },
    /// More bytes than the peer's window holds.
    #[error("{len} bytes do not fit the {remote_size}-byte remote buffer")]
    RemoteTooSmall {
        /// The op's length.
        len: usize,
        /// The window's.
        remote_size: u32,
    },
    /// A READ into memory registered read-only.
    #[error("the region at {addr:#x} ({len} bytes) is read-only here: a READ cannot land in it")]
    ReadOnlyDestination {
        /// The region's address.
        addr: u64,
        /// Its length.
        len: usize,
    },
    /// Memory that cannot be registered (unmapped, wrong access, empty).
    #[error("[{addr:#x}, +{len}) cannot be registered: {reason}")]
    BadRange {
        /// The range's address.
        addr: u64,
        /// Its length.
        len: usize,
        /// Why, for a human.
        reason: String,
    },
    /// A vectored op whose two lists differ in length.
    #[error("vectored op has {locals} local slices but {remotes} remote buffers")]
    VectorMismatch {
        /// Local pieces given.
        locals: usize,
        /// Remote windows given.
        remotes: usize,
    },
    /// A vectored op with no piece.
    #[error("vectored op is empty")]
    EmptyVector,
    /// Back-pressure: the shard's submission queue is full (`FERRY_SQ_DEPTH`).
    #[error("submission queue of shard {shard} is full ({capacity} entries)")]
    QueueFull {
        /// The shard.
        shard: usize,
        /// Its queue's entries.
        capacity: usize,
    },
    /// One connection may hold at most `FERRY_SQ_DEPTH` commands waiting
    /// for room; more are refused at once (its peer is not keeping up).
    #[error("{conn} already has {waiting} commands waiting for room (FERRY_SQ_DEPTH): its peer is not keeping up")]
    Backlogged {
        /// The connection.
        conn: ConnId,
        /// Its commands waiting.
        waiting: usize,
    },
    /// Back-pressure: every in-flight slot is taken.
    #[error("all {max} in-flight operation slots are taken (FERRY_MAX_INFLIGHT_OPS)")]
    TooManyInflight {
        /// `FERRY_MAX_INFLIGHT_OPS`.
        max: usize,
    },
    /// A wait of the caller's ran out; what it waited for goes on.
    #[error("timed out after {timeout_ms} ms waiting for {what}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// The wait.
        timeout_ms: u64,
    },
    /// Back-pressure: `conn` already has `queued` notifications accepted
    /// and not yet sent (its peer is not reading); try again later.
    #[error("{conn} has {queued} notifications not yet sent (FERRY_NOTIFY_OUTBOX = {max}): its peer is not reading; try again")]
    NotifyOutboxFull {
        /// The connection.
        conn: ConnId,
        /// Its notifications not yet sent.
        queued: usize,
        /// `FERRY_NOTIFY_OUTBOX`.
        max: usize,
    },
    /// A notification longer than a notification may be.
    #[error("notification of {len} bytes exceeds the {max}-byte limit")]
    NotifyTooLong {
        /// Its length.
        len: usize,
        /// The limit (4096).
        max: usize,
    },
    /// Two-sided: the message (`len` bytes) was longer than the buffer the
    /// receiver posted for it (`posted` bytes); both sides get this.
    #[error(
        "a message of {len} bytes does not fit the {posted}-byte receive buffer posted for it"
    )]
    MessageTooLarge {
        /// The message's length.
        len: u64,
        /// The buffer's.
        posted: u64,
    },
    /// A setting with a bad value.
    #[error("invalid {name} = {value:?}: {reason}")]
    Config {
        /// The setting (field and variable).
        name: &'static str,
        /// The value given.
        value: String,
        /// What it must be.
        reason: String,
    },
    /// Not possible here or on this path.
    #[error("{what} is not possible: {reason}")]
    Unsupported {
        /// What was asked.
        what: &'static str,
        /// Why not.
        reason: String,
    },
    /// A bound of ours is reached (connections, registrations, messages).
    #[error("limit {limit}={max} reached")]
    LimitReached {
        /// The bound's name.
        limit: &'static str,
        /// Its value.
        max: usize,
    },
    /// The endpoint is shut down.
    #[error("the endpoint is shut down")]
    Shutdown,
    /// No GPU path: no driver, no device, or a build without `gpu`.
    #[error("no GPU: {why}")]
    NoGpu {
        /// Which of those.
        why: String,
    },
    /// A GPU index past the GPUs there are.
    #[error("GPU index {idx} is out of range: {count} GPU(s) visible")]
    GpuOutOfRange {
        /// The index asked for.
        idx: usize,
        /// The GPUs visible.
        count: usize,
    },
    /// An RDMA verbs call failed.
    #[error("RDMA verbs: {what} failed: {reason}")]
    Verbs {
        /// The call.
        what: &'static str,
        /// What it said.
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA {call} failed: {name} ({code})")]
    Cuda {
        /// The call.
        call: &'static str,
        /// Its `CUresult`.
        code: u32,
        /// The result's name.
        name: String,
    },
}

impl Error {
    pub(crate) fn io(op: &'static str, source: io::Error) -> Self {
        Error::Io { op, source }
    }

    /// What kind of failure this is (what the C, Python and NIXL faces
    /// report).
    pub fn kind(&self) -> FailureKind {
        use Error as E;
        match self {
            E::ConnFailed { cause, .. } => cause.kind(),
            E::Timeout { .. } | E::AcceptTimeout { .. } | E::ConnectTimeout { .. } => {
                FailureKind::Timeout
            }
            E::UnknownConn { .. } | E::Shutdown | E::Connect { .. } | E::Handshake { .. } => {
                FailureKind::Disconnected
            }
            E::Remote { .. } => FailureKind::Remote,
            E::QueueFull { .. }
            | E::TooManyInflight { .. }
            | E::Backlogged { .. }
            | E::LimitReached { .. }
            | E::NotifyOutboxFull { .. } => FailureKind::Busy,
            E::OutOfRange { .. }
            | E::RemoteTooSmall { .. }
            | E::ReadOnlyDestination { .. }
            | E::BadRange { .. }
            | E::VectorMismatch { .. }
            | E::EmptyVector
            | E::NotifyTooLong { .. }
            | E::MessageTooLarge { .. }
            | E::Config { .. }
            | E::GpuOutOfRange { .. }
            | E::Decode(_) => FailureKind::Invalid,
            _ => FailureKind::Other,
        }
    }

    /// The connection fault this error amounts to when it ends a
    /// connection (a device call that failed under it, a timeout).
    pub fn as_fault(&self) -> ConnFault {
        match self {
            Error::ConnFailed { cause, .. } => cause.clone(),
            Error::Io { op, source } => ConnFault::from_io(op, source),
            Error::Timeout { what, timeout_ms } => ConnFault::Timeout {
                what,
                timeout_ms: *timeout_ms,
            },
            Error::Verbs { what, reason } => ConnFault::device(what, reason),
            Error::Cuda { call, .. } => ConnFault::device(call, self),
            Error::Decode(e) => ConnFault::misbehaved(e.to_string()),
            Error::Shutdown => ConnFault::Closed {
                why: "the endpoint shut down",
            },
            other => ConnFault::device("the operation", other),
        }
    }

    /// A copy for the cases where one failure must be reported to many
    /// waiters (a dead connection fails every op on it).
    pub(crate) fn duplicate(&self) -> Error {
        match self {
            Error::ConnFailed { conn, cause } => Error::ConnFailed {
                conn: *conn,
                cause: cause.clone(),
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
                cause: other.as_fault(),
            },
        }
    }
}

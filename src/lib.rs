//! # ferry
//!
//! An embeddable engine that moves bytes between registered memory regions
//! of this process, another process or another host, with one-sided WRITE
//! and READ: the initiator names a peer's advertised buffer and the peer's
//! application does nothing per transfer. It re-implements the UCCL P2P
//! engine's `Endpoint` as a Rust library, keeping its byte formats
//! (endpoint metadata, the 64-byte `FifoItem` as [`RemoteBuf`]).
//!
//! ## The loop
//!
//! An [`Endpoint`] owns a control listener and N [`Shard`]s. A shard is one
//! thread's worth of engine: it owns a set of connections and, in one
//! run-to-completion loop ([`Shard::poll`]), applies registration updates,
//! takes operations from its bounded submission queue, polls each of its
//! event sources — tcp sockets (and RDMA completion queues), shared-memory
//! rings, CUDA events — and publishes completions to a fixed table that
//! [`Transfer`] handles poll or wait on. Each source also says whether the
//! shard may sleep. Nothing on that path takes a lock or allocates per
//! operation. In *managed* mode the endpoint runs each
//! shard on its own thread, which spins briefly when idle and then parks in
//! `epoll_wait`; in *embedded* mode ([`Mode::Embedded`]) the caller takes the
//! shards and polls them from its own loop, and ferry starts no thread.
//!
//! ## The paths
//!
//! * **control** ([`oob`]): connect, accept and the handshake, on io_uring,
//!   or on epoll where io_uring is refused (`FERRY_IO`).
//! * **tcp**: one-sided WRITE/READ over kernel TCP, payload sent from and
//!   received into registered memory; the target checks key, bounds and
//!   access of every request.
//! * **shm**: between processes of one host, messages on shared-memory
//!   rings and one copy by the target: a memcpy out of or into the peer's
//!   memfd memory (`alloc_host`, shared by fd passing), or
//!   `process_vm_readv/writev` for other memory. `add_remote` picks it by
//!   itself when the peer is on this host (`FERRY_TRANSPORT`).
//! * **cuda-ipc**: GPU memory of a same-host peer, through its CUDA IPC
//!   handle ([`IpcBuf`]); GPU memory also moves over tcp and shm.
//! * **verbs** (feature `rdma`): RC queue pairs beside a tcp connection
//!   when both ends have an RDMA NIC.
//!
//! One operation family — [`Endpoint::write`], [`Endpoint::read`], their
//! vectored and `_async` forms — serves every [`Window`] a peer advertises:
//! a [`RemoteBuf`] or an [`IpcBuf`].
//!
//! ## Example
//!
//! ```
//! use std::time::Duration;
//! use ferry::{Config, Endpoint};
//!
//! # fn main() -> ferry::Result<()> {
//! let mut cfg = Config::default();
//! cfg.listen_addr = "127.0.0.1".parse().unwrap();
//! let target = Endpoint::builder().config(cfg.clone()).build()?;
//! let initiator = Endpoint::builder().config(cfg).build()?;
//! target.start_passive_accept()?;
//!
//! // The target registers memory and advertises a window of it.
//! let dst = target.alloc(4096)?;
//! let window = dst.advertise(0, 4096)?; // send window.encode() to the peer
//!
//! // The initiator connects from the target's metadata and writes.
//! let conn = initiator.add_remote(&target.metadata_bytes())?;
//! let src = initiator.register(b"hello, ferry".to_vec())?;
//! initiator.write(conn, &src, 0, 12, &window)?;
//!
//! let mut got = [0u8; 12];
//! dst.read_at(0, &mut got)?;
//! assert_eq!(&got, b"hello, ferry");
//! # let _ = Duration::ZERO;
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub(crate) mod auth;
pub mod codec;
#[cfg(feature = "directory")]
pub mod directory;
pub mod endpoint;
pub mod error;
pub mod gpu;
pub mod metrics;
pub mod oob;
pub mod reactor;
pub(crate) mod region;
#[doc(hidden)]
pub mod rogue;
pub(crate) mod shm;
pub mod stage_trace;
pub(crate) mod sync;
pub(crate) mod sys;
pub(crate) mod tcp;
pub mod verbs;
// The wire formats: public for the CLI, the fuzz targets and the faces
// (C, Python, NIXL), not a user's API; what a user handles of them
// (metadata, windows) is re-exported below.
#[doc(hidden)]
pub mod wire;
pub(crate) mod xfer;

pub use endpoint::{
    Batch, Compress, Config, Endpoint, EndpointBuilder, Integrity, MemoryRegion, MessageOp, Mode,
    Peer, Prepared, RegCacheStats, Secret, SharedRegion, Transport, Window,
};
pub use error::{ConnFault, ConnId, Error, FailureKind, OpKind, PathOff, Result};
pub use gpu::{GpuCopy, IpcStats, MemKind};
pub use metrics::Metrics;
pub use reactor::{CompressStats, Shard, SpinStats, Transfer};
pub use region::Access;
pub use wire::{AnyWindow, EndpointMetadata, IpcBuf, RemoteBuf};

/// Whether the same-host (shared-memory) path can work on this machine;
/// `Err` says why not.
pub fn probe_shm() -> std::result::Result<(), String> {
    shm::probe().map_err(|e| e.to_string())
}

/// The address an endpoint puts in its metadata when none is configured:
/// the first non-loopback IPv4 address of an interface that is up, else
/// 127.0.0.1 (the seed's `get_oob_ip`).
pub fn oob_ip() -> std::net::IpAddr {
    sys::primary_ipv4().unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST))
}

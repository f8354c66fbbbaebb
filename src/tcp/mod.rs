//! One-sided WRITE and READ over kernel TCP: the default path between hosts.
//!
//! Each stream carries request frames one way and response frames the other,
//! both sides acting as initiator and target at once. A frame is a 40-byte
//! `DataHeader` plus, for `WriteReq`, `ReadResp` and `Notify`, its payload.
//!
//! * The initiator sends `WriteReq` header and payload with one `writev`
//!   straight from registered memory; many frames share a syscall.
//! * The target checks key, bounds and access of every request against its
//!   region table (`RegionTable::check`) before touching memory. A refused
//!   WRITE's payload is read and discarded so the stream stays in step, and
//!   the refusal goes back as a status: the connection stays usable.
//! * Payload is received with `readv` straight into the destination, with
//!   the rest of the read buffer as a second iovec for the headers that
//!   follow. Payload bytes that arrive in the same read as a header land in
//!   that buffer and are copied once; for large operations that is a few KiB
//!   out of each operation, for 4 KiB operations it is most of them, and
//!   the copy is cheaper than the syscall it saves.
//! * Responses come back in request order per stream, so the initiator
//!   matches each to the oldest outstanding request (and checks its op id).
//! * Each side declares in the handshake how many requests it keeps in
//!   flight per stream; the other side sizes its response queue by it and
//!   drops a peer that exceeds it. Queues never grow.

//!
//! The protocol is a sans-IO state machine (`proto.rs`: bytes, time and
//! copy completions in; what to send and where to read out); `stream.rs`
//! is the thin driver that makes its syscalls.

pub(crate) mod conn;
#[cfg(test)]
mod pair;
pub(crate) mod proto;
mod stream;

pub(crate) use proto::{CodecCounters, Integrity, PackChoice, PackMode, PackShared, StreamLimits};
pub(crate) use stream::Stream;

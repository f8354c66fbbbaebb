//! Same-host paths: shared-memory rings between local endpoints, memfd host
//! memory shared by fd passing, and the same-host connection state.
//!
//! Rings live in `/dev/shm` with mode 0600: `ferry-<id>` is an endpoint's
//! accept ring (CONNECT messages from any local peer), and
//! `ferry-<sender>-<receiver>` carries one connection's messages in one
//! direction. The receiver creates (and on drop removes) each ring; a ring
//! left by a process that died is detected by its owner pid and re-created.
//! `ferry-<id>-bell<shard>` (and its `.fifo`) is a shard's doorbell: how a
//! producer wakes a consumer that stopped polling a quiet ring (`bell.rs`).

pub(crate) mod bell;
pub(crate) mod cma;
pub(crate) mod connect;
pub(crate) mod copy_path;
pub(crate) mod fdpass;
pub(crate) mod local;
pub(crate) mod named_ring;
pub(crate) mod object;
pub(crate) mod peers;
pub(crate) mod ring;

/// Whether same-host connections can work here: a ring can be created in
/// /dev/shm and an abstract Unix socket bound. `Err` says why not.
pub fn probe() -> crate::error::Result<()> {
    let name = format!("/ferry-probe-{:x}", std::process::id());
    named_ring::ShmRing::create(&name, 2, 0)?;
    fdpass::FdListener::bind(u64::from(std::process::id()) << 32 | 0xfeed)
        .map_err(|e| crate::error::Error::io("an abstract Unix socket for fd passing", e))?;
    Ok(())
}

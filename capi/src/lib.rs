//! ferry's C face: `libferry.so` / `libferry.a`, declared in
//! `include/ferry.h` (generated from this crate by cbindgen; a test fails
//! when the checked-in header is stale).
//!
//! Every function returns a status (`FERRY_OK`, `FERRY_PENDING`, or a
//! negative `FERRY_ERR_*`), with the reason of the last failure on this
//! thread in [`ferry_last_error`]. Every entry catches panics
//! (`FERRY_ERR_PANIC`); a null handle or pointer, or a buffer shorter than
//! what it must hold, is `FERRY_ERR_INVALID`, never undefined behaviour.
//! Handles are opaque, generation-checked slot numbers (`handles.rs`): one
//! released twice, used after its release or made up is
//! `FERRY_ERR_INVALID`, never a read of freed memory. Each `*_create`/`register`/`post` is paired with its
//! `*_destroy`/`deregister`/`release`. An endpoint lives until its last
//! region and transfer are released, so no order of releases is unsafe.

// The C names are the C face's (`ferry_endpoint`, not `FerryEndpoint`).
#![allow(non_camel_case_types)]

mod drive;
mod endpoint;
mod handles;
mod msg;
mod prepared;
mod status;
mod xfer;

pub use endpoint::*;
pub use msg::*;
pub use prepared::*;
pub use status::*;
pub use xfer::*;

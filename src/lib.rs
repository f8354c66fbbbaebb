pub mod endpoint;
pub mod error;
pub mod oob;
pub mod reactor;
pub(crate) mod region;
pub(crate) mod tcp;
pub mod wire;

pub use endpoint::{Config, Endpoint, EndpointBuilder, MemoryRegion, Mode, Transport};
pub use error::{ConnId, Error, OpKind, Result};
pub use reactor::{Shard, Transfer};
pub use region::Access;
pub use wire::{EndpointMetadata, RemoteBuf};
#[doc(hidden)]
pub mod testkit;

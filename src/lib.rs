pub mod error;
pub mod oob;
pub mod reactor;
pub(crate) mod region;
pub(crate) mod tcp;
pub mod wire;

pub use error::{ConnId, Error, OpKind, Result};
pub use region::Access;

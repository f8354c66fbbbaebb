//! What a directory call says when it fails.

use super::etcd::EtcdError;

/// Why a directory call failed.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    /// etcd could not be reached, or refused or garbled the call.
    #[error("directory: {0}")]
    Etcd(#[from] EtcdError),
    /// A name, cluster or record that is not one we accept.
    #[error("directory: {what} {value:?}: {why}")]
    Bad {
        /// What it is ("name", "cluster", "record", …).
        what: &'static str,
        /// The value given (or found).
        value: String,
        /// What is wrong with it.
        why: String,
    },
    /// A TLS setting could not be used (a file unreadable, no certificate
    /// in it, a key that does not fit its certificate).
    #[error("directory: {what}: {why}")]
    Tls {
        /// Which setting ("etcd CA", "etcd client key", …).
        what: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// Nothing is published under the name.
    #[error("directory: no endpoint named {name:?} in cluster {cluster:?}")]
    NotFound {
        /// The cluster looked in.
        cluster: String,
        /// The name looked for.
        name: String,
    },
    /// The endpoint has no window of that name.
    #[error("directory: {name:?} has no window {window:?}")]
    NoWindow {
        /// The endpoint's name.
        name: String,
        /// The window asked for.
        window: String,
    },
    /// A live endpoint holds the name.
    #[error(
        "directory: {name:?} is held by a live endpoint (incarnation {incarnation:016x}); \
         publish_replacing (ferry serve --replace) takes it over"
    )]
    Taken {
        /// The name.
        name: String,
        /// The holder's incarnation.
        incarnation: u64,
    },
    /// The endpoint failed (connecting to a name found).
    #[error("directory: {0}")]
    Endpoint(#[from] crate::error::Error),
}

/// A directory call's result.
pub type Result<T> = std::result::Result<T, DirError>;

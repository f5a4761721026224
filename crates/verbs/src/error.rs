//! Errors of the loader and of the safe layer.

use std::io;

/// Why a verbs operation failed.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// libibverbs could not be loaded.
    #[error("cannot load {library}: {reason} (install libibverbs1, e.g. `apt-get install ibverbs-providers`)")]
    Load {
        /// The library name that was tried.
        library: String,
        /// What the dynamic loader said.
        reason: String,
    },
    /// libibverbs was loaded but does not export a verb this crate needs.
    #[error("libibverbs does not export `{symbol}`")]
    MissingSymbol {
        /// The symbol's name.
        symbol: &'static str,
    },
    /// No RDMA device matched.
    #[error("no RDMA device {wanted} (found: {found})")]
    NoDevice {
        /// What was asked for (`named rxe0` or `at all`).
        wanted: String,
        /// The devices that exist, comma-separated.
        found: String,
    },
    /// A verb returned an error.
    #[error("{verb} failed: {source}")]
    Verb {
        /// The verb that failed, with its object if that helps (e.g. `ibv_modify_qp(RTR)`).
        verb: String,
        /// The error number it reported.
        #[source]
        source: io::Error,
    },
    /// An argument was refused before any verb was called.
    #[error("{0}")]
    InvalidArgument(String),
}

impl VerbsError {
    /// A failed verb that reported its error through `errno`.
    pub(crate) fn from_errno(verb: impl Into<String>) -> Self {
        VerbsError::Verb {
            verb: verb.into(),
            source: io::Error::last_os_error(),
        }
    }

    /// A failed verb that returned its error number (rdma-core returns errno values
    /// directly from post, modify and destroy calls).
    pub(crate) fn from_code(verb: impl Into<String>, code: i32) -> Self {
        VerbsError::Verb {
            verb: verb.into(),
            source: io::Error::from_raw_os_error(code.abs()),
        }
    }
}

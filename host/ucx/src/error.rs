//! Errors of the UCX layer: every failure (bad address, UCX status, peer gone, timeout, layer
//! stopped) is a [`UcxError`] value naming the peer and UCX's own status text, so that a caller can
//! fall back to another transport instead of crashing.

use std::ffi::CStr;
use std::time::Duration;

use wrk_ucx_sys::{ucs_status_string, ucs_status_t};

/// A UCX status code with its text from `ucs_status_string`, e.g. `Destination is unreachable (-6)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The raw `ucs_status_t` value (negative for errors).
    pub code: i8,
    /// UCX's description of the code.
    pub text: String,
}

impl Status {
    pub(crate) fn new(code: ucs_status_t) -> Status {
        // SAFETY: ucs_status_string accepts any status value and returns a pointer to a static,
        // NUL-terminated string (a generic text for unknown codes), never NULL.
        let text = unsafe { CStr::from_ptr(ucs_status_string(code)) };
        Status {
            code,
            text: text.to_string_lossy().into_owned(),
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.text, self.code)
    }
}

/// What can go wrong in the UCX layer.
#[derive(Debug, thiserror::Error)]
pub enum UcxError {
    /// A UCX call while setting up the context or worker failed.
    #[error("UCX {call} failed: {status}")]
    Setup {
        /// The UCX function that failed.
        call: &'static str,
        /// Its status.
        status: Status,
    },
    /// A configuration entry was refused by `ucp_config_modify` or could not be passed to C.
    #[error("UCX configuration {name}={value} refused: {reason}")]
    Config {
        /// Option name without the `UCX_` prefix, e.g. `TLS`.
        name: String,
        /// The value given.
        value: String,
        /// UCX's status text, or why the string could not be passed.
        reason: String,
    },
    /// The peer address bytes are not an address published by [`crate::Ucx::address`].
    #[error("invalid UCX peer address: {reason}")]
    InvalidAddress {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Creating the endpoint to the peer failed.
    #[error("UCX connect to peer {peer} failed: {status}")]
    Connect {
        /// The peer's id (a hash of its address, as in logs).
        peer: String,
        /// UCX's status.
        status: Status,
    },
    /// UCX reported the send failed (peer gone, endpoint failure, cancelled, ...).
    #[error("UCX send to peer {peer} failed: {status}")]
    Send {
        /// The peer's id (a hash of its address, as in logs).
        peer: String,
        /// UCX's status.
        status: Status,
    },
    /// The send did not complete within the configured send timeout; it was cancelled.
    #[error("UCX send to peer {peer} did not complete within {after:?}")]
    TimedOut {
        /// The peer's id (a hash of its address, as in logs).
        peer: String,
        /// The timeout that elapsed.
        after: Duration,
    },
    /// The message header is larger than this worker's active-message header limit.
    #[error("message header of {len} bytes exceeds the UCX limit of {max} bytes")]
    HeaderTooLarge {
        /// Header length asked for.
        len: usize,
        /// The most the worker accepts.
        max: usize,
    },
    /// The payload is larger than [`crate::UcxConfig::max_message_bytes`].
    #[error("message payload of {len} bytes exceeds the limit of {max} bytes")]
    MessageTooLarge {
        /// Payload length asked for.
        len: u64,
        /// The configured limit.
        max: u64,
    },
    /// The UCX layer has shut down (or its thread stopped); nothing more can be sent.
    #[error("the UCX layer is shut down")]
    Closed,
    /// An operating-system resource of the layer (thread, eventfd) could not be created.
    #[error("UCX layer setup: {0}")]
    Io(#[from] std::io::Error),
}

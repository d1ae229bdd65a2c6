//! The one error type of the SDK: a WIT `error` (code and message) from the host, or a task's
//! own failure.

use std::fmt;

use crate::bindings::wrk::task::types::Error as RawError;
pub use crate::bindings::wrk::task::types::ErrorCode;

/// The result type of every fallible SDK call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error reported by the host, or raised by the task itself.
///
/// It carries a WIT error code and a message; returning it from [`Task::run`](crate::Task::run)
/// hands both back to the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    code: ErrorCode,
    message: String,
}

impl Error {
    /// An error with an explicit code.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// A task author's own error.
    ///
    /// The WIT contract has no code reserved for failures raised by the task itself, so these
    /// carry [`ErrorCode::InvalidArgument`]; use [`Error::new`] to pick another code.
    pub fn msg(message: impl fmt::Display) -> Self {
        Self::new(ErrorCode::InvalidArgument, message.to_string())
    }

    /// The error's code.
    pub fn code(&self) -> ErrorCode {
        self.code
    }

    /// The error's message, without the code.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same error with `context` prefixed to its message (`"context: message"`).
    #[must_use]
    pub fn context(self, context: impl fmt::Display) -> Self {
        Self {
            code: self.code,
            message: format!("{context}: {}", self.message),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for Error {}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorCode::UnknownColumn => "unknown-column",
            ErrorCode::TypeMismatch => "type-mismatch",
            ErrorCode::InvalidArgument => "invalid-argument",
            ErrorCode::Io => "io",
            ErrorCode::ResourceExhausted => "resource-exhausted",
            ErrorCode::Internal => "internal",
        })
    }
}

impl From<RawError> for Error {
    fn from(raw: RawError) -> Self {
        Self::new(raw.code, raw.message)
    }
}

impl From<Error> for RawError {
    fn from(error: Error) -> Self {
        RawError {
            code: error.code,
            message: error.message,
        }
    }
}

impl From<String> for Error {
    fn from(message: String) -> Self {
        Self::msg(message)
    }
}

impl From<&str> for Error {
    fn from(message: &str) -> Self {
        Self::msg(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_shows_code_and_message() {
        let error = Error::new(ErrorCode::UnknownColumn, "no column `x`");
        assert_eq!(error.to_string(), "unknown-column: no column `x`");
    }

    #[test]
    fn context_prefixes_the_message_and_keeps_the_code() {
        let error = Error::new(ErrorCode::Io, "denied").context("reading `trips`");
        assert_eq!(error.code(), ErrorCode::Io);
        assert_eq!(error.message(), "reading `trips`: denied");
    }

    #[test]
    fn round_trips_through_the_wit_error() {
        let raw = RawError::from(Error::msg("bad stage"));
        assert_eq!(raw.code, ErrorCode::InvalidArgument);
        assert_eq!(Error::from(raw), Error::msg("bad stage"));
    }
}

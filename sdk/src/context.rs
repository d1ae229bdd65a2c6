//! Who and where the running task is, its parameters, and logging to the host.
//!
//! The logging macros ([`info!`](crate::info), [`warn!`](crate::warn), ...) take `format!`
//! arguments.

use std::fmt::Display;
use std::str::FromStr;

use crate::bindings::wrk::task::context as raw;
pub use crate::bindings::wrk::task::context::LogLevel;
use crate::error::{Error, Result};

/// The job's id.
pub fn job_id() -> String {
    raw::job_id()
}

/// The job's name.
pub fn job_name() -> String {
    raw::job_name()
}

/// The name of the stage this task belongs to.
pub fn stage_name() -> String {
    raw::stage_name()
}

/// This task's index within its stage, from 0.
pub fn task_index() -> u32 {
    raw::task_index()
}

/// The number of tasks in this task's stage.
pub fn task_count() -> u32 {
    raw::task_count()
}

/// A job or stage parameter.
pub fn param(name: &str) -> Option<String> {
    raw::param(name)
}

/// A job or stage parameter parsed as `T`; `Ok(None)` when it is not set, an error naming the
/// parameter and its value when it does not parse.
pub fn param_as<T>(name: &str) -> Result<Option<T>>
where
    T: FromStr,
    T::Err: Display,
{
    param(name)
        .map(|value| parse_param(name, &value))
        .transpose()
}

/// Every job and stage parameter, as `(name, value)` pairs.
pub fn params() -> Vec<(String, String)> {
    raw::params()
}

/// Sends `message` to the host's log at `level`.
pub fn log(level: LogLevel, message: &str) {
    raw::log(level, message);
}

fn parse_param<T>(name: &str, value: &str) -> Result<T>
where
    T: FromStr,
    T::Err: Display,
{
    value.parse().map_err(|e: T::Err| {
        Error::msg(format!(
            "parameter `{name}` has the value {value:?}, which does not parse as {}: {e}",
            std::any::type_name::<T>()
        ))
    })
}

/// Logs a `format!` message at trace level.
#[macro_export]
macro_rules! trace {
    ($($arg:tt)+) => {
        $crate::context::log($crate::context::LogLevel::Trace, &::std::format!($($arg)+))
    };
}

/// Logs a `format!` message at debug level.
#[macro_export]
macro_rules! debug {
    ($($arg:tt)+) => {
        $crate::context::log($crate::context::LogLevel::Debug, &::std::format!($($arg)+))
    };
}

/// Logs a `format!` message at info level.
#[macro_export]
macro_rules! info {
    ($($arg:tt)+) => {
        $crate::context::log($crate::context::LogLevel::Info, &::std::format!($($arg)+))
    };
}

/// Logs a `format!` message at warn level.
#[macro_export]
macro_rules! warn {
    ($($arg:tt)+) => {
        $crate::context::log($crate::context::LogLevel::Warn, &::std::format!($($arg)+))
    };
}

/// Logs a `format!` message at error level.
#[macro_export]
macro_rules! error {
    ($($arg:tt)+) => {
        $crate::context::log($crate::context::LogLevel::Error, &::std::format!($($arg)+))
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_parse_into_the_requested_type() {
        assert_eq!(parse_param::<u32>("limit", "42"), Ok(42));
        assert_eq!(parse_param::<f64>("radius", "6371.0"), Ok(6371.0));
        assert_eq!(parse_param::<bool>("dry_run", "true"), Ok(true));
    }

    #[test]
    fn a_bad_value_is_reported_with_the_parameter_name() {
        let error = parse_param::<u32>("limit", "lots").unwrap_err();
        let message = error.message();
        assert!(message.contains("parameter `limit`"), "{message}");
        assert!(message.contains("\"lots\""), "{message}");
        assert!(message.contains("u32"), "{message}");
    }
}

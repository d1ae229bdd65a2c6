//! The gRPC contract between `wrk` clients, the scheduler and workers (`proto/wrk.proto`).
//!
//! Generated with `tonic`/`prost`; this crate adds only small conveniences on the generated types.

#![allow(clippy::all, clippy::pedantic)]

/// Generated messages and services of package `wrk.v1`.
pub mod v1 {
    tonic::include_proto!("wrk.v1");
}

pub use v1::*;

/// Largest gRPC message either side accepts: job specs carry component bytes.
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024 * 1024;

impl std::fmt::Display for TaskId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}#{}",
            self.job_id, self.stage, self.index, self.attempt
        )
    }
}

impl std::fmt::Display for PartitionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}/{}",
            self.job_id, self.stage, self.task, self.output
        )
    }
}

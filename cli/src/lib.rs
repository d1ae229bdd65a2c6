//! The `wrk` command line, as a library so tests and tools can drive the same code.
//!
//! - [`job`]: job files and their translation into job graphs.
//! - [`client`]: submitting jobs, following progress, fetching results.
//! - [`datasets`]: persisted datasets (list, release, rebalance) and retiring workers.
//! - [`local`]: the embedded local cluster.
//! - [`taxi`]: the deterministic taxi-trip data generator.
//! - [`output`]: printing and writing results.
//! - [`report`]: the HTML performance report of `wrk submit --report`.
//! - [`reuse`]: the buffer-reuse benchmark of `wrk bench-reuse`.

pub mod client;
pub mod datasets;
pub mod job;
pub mod local;
pub mod output;
pub mod report;
pub mod reuse;
pub mod taxi;

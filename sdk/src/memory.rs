//! The worker's memory pool: statistics, and leases that declare a task's working set before it
//! starts heavy work.
//!
//! ```no_run
//! use wrk_sdk::prelude::*;
//!
//! fn heavy(trips: &Table) -> Result<Table> {
//!     // Room for the input and about as much again for the join's output.
//!     let _lease = memory::lease(2 * memory::stats().task_bytes)?;
//!     trips.join(trips, ["id"], JoinType::Inner)
//! } // the lease goes back to the pool here
//! ```

use crate::bindings::wrk::task::memory as raw;
use crate::error::Result;

/// A snapshot of the worker's pool, as this task sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// The configured size of the pool, in bytes.
    pub size: u64,
    /// Bytes in use: the tables the worker holds, plus the unfilled part of leases.
    pub used: u64,
    /// The most bytes that were in use.
    pub peak: u64,
    /// Bytes of partitions spilled out of the pool now, to host memory and to disk.
    pub spilled_host: u64,
    pub spilled_disk: u64,
    /// Partitions spilled, and read back, since the worker started.
    pub spills: u64,
    pub unspills: u64,
    /// This task's working set: its leases, or the tables it holds when that is more.
    pub task_bytes: u64,
}

impl PoolStats {
    /// Bytes of the pool not in use.
    pub fn free(&self) -> u64 {
        self.size.saturating_sub(self.used)
    }
}

/// The pool's statistics now.
pub fn stats() -> PoolStats {
    let raw = raw::stats();
    PoolStats {
        size: raw.size,
        used: raw.used,
        peak: raw.peak,
        spilled_host: raw.spilled_host,
        spilled_disk: raw.spilled_disk,
        spills: raw.spills,
        unspills: raw.unspills,
        task_bytes: raw.task_bytes,
    }
}

/// Pool bytes reserved for this task; they go back when the lease is dropped (or the task
/// ends).
#[derive(Debug)]
#[must_use = "the reservation ends when the lease is dropped"]
pub struct Lease(raw::Lease);

impl Lease {
    /// The bytes reserved.
    pub fn bytes(&self) -> u64 {
        self.0.bytes()
    }
}

/// Reserves `bytes` of the pool for this task's working set (the tables it holds count
/// towards it), spilling other data to make room and waiting for other tasks when needed.
///
/// Fails with [`ErrorCode::ResourceExhausted`](crate::ErrorCode::ResourceExhausted), naming
/// the sizes, when the working set can never fit in the pool, or when no room can be had
/// without a deadlock (the worker may run the task again later).
pub fn lease(bytes: u64) -> Result<Lease> {
    Ok(Lease(raw::take_lease(bytes)?))
}

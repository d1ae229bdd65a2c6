//! Per-task resource limits enforced inside wasmtime: a linear-memory cap that fails with a typed,
//! reportable error (rather than the guest allocator's anonymous abort).

use wasmtime::ResourceLimiter;

/// The error a guest's memory growth traps with when it would pass its cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "guest memory limit exceeded: growing linear memory to {requested} bytes, the limit is {limit} bytes"
)]
pub struct MemoryLimitExceeded {
    pub requested: usize,
    pub limit: usize,
}

/// Caps every linear memory and table of one task's store.
#[derive(Debug, Clone, Copy)]
pub struct MemoryLimiter {
    pub memory_limit: usize,
    /// Largest linear memory the guest reached, in bytes.
    pub peak: usize,
}

impl MemoryLimiter {
    pub fn new(memory_limit: usize) -> Self {
        MemoryLimiter {
            memory_limit,
            peak: 0,
        }
    }
}

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.memory_limit {
            return Err(MemoryLimitExceeded {
                requested: desired,
                limit: self.memory_limit,
            }
            .into());
        }
        self.peak = self.peak.max(desired);
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 1_000_000)
    }
}

//! The CUDA backend: device selection, the device memory pool, NVRTC-compiled kernels, device
//! tables and their operators, and NVML telemetry.
//!
//! - [`detect`]: `--device cpu|gpu:N|auto` and a probe that never panics without a driver.
//! - [`nvml`]: telemetry of the worker's GPU (and its MIG profile).
//! - [`pool`]: the worker's device memory budget, with an eviction hook for the spiller.
//! - [`kernels`]: fused expression kernels generated per expression, and the fixed kernels.
//! - [`table`]: columns in device memory; counted host<->device transfers.
//! - [`exec`]: kernel launches, prefix sums, compaction, gathers and the radix sort.
//! - [`ops`]: filter, hash-partition, group-by, join, sort and concat on device tables.
//! - [`selftest`]: every device operator checked against the CPU backend; a worker runs it at
//!   start on its GPU and falls back to the CPU (or refuses to start) if it fails.
//!
//! Nothing here needs a CUDA toolkit at build time: `libcuda`, `libnvrtc` and `libnvidia-ml`
//! are loaded at run time, and only after checking that they load.

#[cfg(test)]
mod bench;
pub mod detect;
pub mod exec;
pub mod kernels;
pub mod nvml;
pub mod ops;
pub mod pool;
pub mod selftest;
pub mod table;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::CudaStream;

use crate::metrics::DeviceTransferMetrics;
use detect::ProbedGpu;
use kernels::{KernelCache, KernelError};
use pool::{DevicePool, PoolError};

/// Why the GPU runtime could not start on a device that was found.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Kernels(#[from] KernelError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error("querying the device's free memory failed: {0}")]
    Memory(String),
}

/// Which way a transfer went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    ToDevice,
    ToHost,
}

impl Direction {
    pub fn label(self) -> &'static str {
        match self {
            Direction::ToDevice => "to_device",
            Direction::ToHost => "to_host",
        }
    }
}

/// Counts of the bytes and copies that crossed between host and device memory.
#[derive(Default)]
pub struct Transfers {
    to_device_bytes: AtomicU64,
    to_device_count: AtomicU64,
    to_host_bytes: AtomicU64,
    to_host_count: AtomicU64,
    metrics: Option<DeviceTransferMetrics>,
}

impl Transfers {
    pub fn with_metrics(metrics: DeviceTransferMetrics) -> Self {
        Transfers {
            metrics: Some(metrics),
            ..Transfers::default()
        }
    }

    /// Records one transfer of `bytes`.
    pub fn record(&self, direction: Direction, bytes: u64) {
        let (total, count) = match direction {
            Direction::ToDevice => (&self.to_device_bytes, &self.to_device_count),
            Direction::ToHost => (&self.to_host_bytes, &self.to_host_count),
        };
        total.fetch_add(bytes, Ordering::Relaxed);
        count.fetch_add(1, Ordering::Relaxed);
        if let Some(metrics) = &self.metrics {
            metrics.record(direction.label(), bytes);
        }
    }

    /// (bytes, transfers) in `direction` so far.
    pub fn totals(&self, direction: Direction) -> (u64, u64) {
        let (total, count) = match direction {
            Direction::ToDevice => (&self.to_device_bytes, &self.to_device_count),
            Direction::ToHost => (&self.to_host_bytes, &self.to_host_count),
        };
        (total.load(Ordering::Relaxed), count.load(Ordering::Relaxed))
    }
}

/// A worker's GPU, ready to run operators: its context and stream, memory pool, kernels and
/// transfer counters.
pub struct GpuRuntime {
    pub device: ProbedGpu,
    pub stream: Arc<CudaStream>,
    pub pool: DevicePool,
    pub kernels: KernelCache,
    pub transfers: Transfers,
}

impl GpuRuntime {
    /// Starts the runtime on a probed device: sizes the pool (`pool_bytes` from `--pool-size`,
    /// see [`pool::pool_budget`]) and compiles the fixed kernels.
    pub fn start(
        device: ProbedGpu,
        pool_bytes: Option<u64>,
        transfers: Transfers,
    ) -> Result<Arc<Self>, StartError> {
        let (free, total) = device
            .context
            .mem_get_info()
            .map_err(|e| StartError::Memory(e.to_string()))?;
        let (budget, warning) = pool::pool_budget(pool_bytes, total as u64, free as u64);
        if let Some(warning) = warning {
            tracing::warn!("{warning}");
        }
        let stream = device.context.default_stream();
        let pool = DevicePool::new(stream.clone(), budget)?;
        let kernels = KernelCache::new(device.context.clone())?;
        Ok(Arc::new(GpuRuntime {
            device,
            stream,
            pool,
            kernels,
            transfers,
        }))
    }
}

/// For tests that need a GPU: the runtime on device 0, or `None` after printing why the test is
/// skipped. With `WRK_REQUIRE_GPU=1` a missing GPU fails the test instead.
#[cfg(test)]
pub(crate) fn test_runtime(test: &str) -> Option<Arc<GpuRuntime>> {
    let required = std::env::var("WRK_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match detect::probe(0) {
        Ok(device) => match GpuRuntime::start(device, Some(1 << 30), Transfers::default()) {
            Ok(runtime) => Some(runtime),
            Err(e) => panic!("{test}: a GPU was found but the runtime did not start: {e}"),
        },
        Err(reason) => {
            assert!(
                !required,
                "{test}: WRK_REQUIRE_GPU=1 but no GPU can be used: {reason}"
            );
            println!(
                "SKIPPED {test}: no CUDA device found ({reason}); set WRK_REQUIRE_GPU=1 to make this a failure"
            );
            None
        }
    }
}

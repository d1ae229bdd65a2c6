//! The CUDA backend: device selection, the device memory pool, NVRTC-compiled kernels, device
//! tables and their operators, and NVML telemetry.
//!
//! - [`detect`]: `--device cpu|gpu:N|auto|emulated-gpu` and a probe that never panics without a
//!   driver.
//! - [`backend`]: allocations, copies and synchronisation on a CUDA device or the emulated one.
//! - [`emulator`]: the CUDA execution model on the CPU, which runs the same kernels without a
//!   GPU (for tests and for developing the backend).
//! - [`nvml`]: telemetry of the worker's GPU (and its MIG profile).
//! - [`pool`]: the worker's device memory budget, with an eviction hook for the spiller.
//! - [`kernels`]: fused expression kernels generated per expression, and the fixed kernels.
//! - [`table`]: columns in device memory; counted host<->device transfers.
//! - [`exec`]: kernel launches, prefix sums, compaction, gathers and the radix sort.
//! - [`ops`]: filter, hash-partition, group-by, join, sort and concat on device tables.
//! - [`join_index`]: a join's build side, and the cache of those built on broadcast tables.
//! - [`resident`]: the device tables of running tasks, spilled to host memory when the pool
//!   needs room and uploaded again when next used.
//! - [`selftest`]: every device operator checked against the CPU backend; a worker runs it at
//!   start on its GPU and falls back to the CPU (or refuses to start) if it fails.
//!
//! Nothing here needs a CUDA toolkit at build time: `libcuda`, `libnvrtc` and `libnvidia-ml`
//! are loaded at run time, and only after checking that they load.

pub mod backend;
#[cfg(test)]
mod bench;
pub mod detect;
pub mod emulator;
pub mod exec;
pub mod join_index;
pub mod kernels;
pub mod nvml;
pub mod ops;
pub mod pool;
pub mod resident;
pub mod selftest;
pub mod table;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::metrics::{DeviceOperatorMetrics, DeviceTransferMetrics, GpuMetrics};
use backend::Backend;
use detect::{GpuIdentity, ProbedGpu};
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

/// Where an operator of a guest ran on a GPU worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RanOn {
    Device,
    /// On the CPU backend: no kernel covers the operator or its input's types.
    Host,
}

impl RanOn {
    pub fn label(self) -> &'static str {
        match self {
            RanOn::Device => "device",
            RanOn::Host => "host",
        }
    }
}

/// Counts of the guests' operators by where they ran.
#[derive(Default)]
pub struct OperatorCounts {
    device: AtomicU64,
    host: AtomicU64,
    metrics: Option<DeviceOperatorMetrics>,
}

impl OperatorCounts {
    pub fn record(&self, operator: &str, ran_on: RanOn) {
        let count = match ran_on {
            RanOn::Device => &self.device,
            RanOn::Host => &self.host,
        };
        count.fetch_add(1, Ordering::Relaxed);
        if let Some(metrics) = &self.metrics {
            metrics.record(operator, ran_on.label());
        }
    }

    /// Operators run so far on the device and on the host.
    pub fn totals(&self) -> (u64, u64) {
        (
            self.device.load(Ordering::Relaxed),
            self.host.load(Ordering::Relaxed),
        )
    }
}

/// What a GPU runtime counts: transfers and operators.
#[derive(Default)]
pub struct DeviceCounters {
    pub transfers: Transfers,
    pub operators: OperatorCounts,
}

impl DeviceCounters {
    /// Counters that also feed the worker's metrics.
    pub fn with_metrics(metrics: &GpuMetrics) -> Self {
        DeviceCounters {
            transfers: Transfers::with_metrics(metrics.transfers.clone()),
            operators: OperatorCounts {
                metrics: Some(metrics.operators.clone()),
                ..OperatorCounts::default()
            },
        }
    }
}

/// What a runtime's tasks did with the device up to a moment: operators by where they ran, and
/// the copies between host and device memory. `wrk run` prints the change over its task.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceActivity {
    pub operators_on_device: u64,
    pub operators_on_host: u64,
    pub uploads: u64,
    pub uploaded_bytes: u64,
    pub downloads: u64,
    pub downloaded_bytes: u64,
}

impl DeviceActivity {
    pub fn of(runtime: &GpuRuntime) -> Self {
        let (operators_on_device, operators_on_host) = runtime.operators.totals();
        let (uploaded_bytes, uploads) = runtime.transfers.totals(Direction::ToDevice);
        let (downloaded_bytes, downloads) = runtime.transfers.totals(Direction::ToHost);
        DeviceActivity {
            operators_on_device,
            operators_on_host,
            uploads,
            uploaded_bytes,
            downloads,
            downloaded_bytes,
        }
    }

    /// What happened between `earlier` and this one.
    pub fn since(&self, earlier: &DeviceActivity) -> DeviceActivity {
        DeviceActivity {
            operators_on_device: self.operators_on_device - earlier.operators_on_device,
            operators_on_host: self.operators_on_host - earlier.operators_on_host,
            uploads: self.uploads - earlier.uploads,
            uploaded_bytes: self.uploaded_bytes - earlier.uploaded_bytes,
            downloads: self.downloads - earlier.downloads,
            downloaded_bytes: self.downloaded_bytes - earlier.downloaded_bytes,
        }
    }
}

impl std::fmt::Display for DeviceActivity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let size = |bytes: u64| bytesize::ByteSize::b(bytes).display().iec();
        write!(
            f,
            "{} operator(s) on the device, {} on the CPU backend; {} upload(s) ({}), {} download(s) ({})",
            self.operators_on_device,
            self.operators_on_host,
            self.uploads,
            size(self.uploaded_bytes),
            self.downloads,
            size(self.downloaded_bytes)
        )
    }
}

/// A worker's GPU, ready to run operators: its backend (context and stream), memory pool,
/// kernels, the device tables of running tasks, and counters.
pub struct GpuRuntime {
    pub device: GpuIdentity,
    pub backend: Arc<Backend>,
    pub pool: DevicePool,
    pub kernels: KernelCache,
    pub resident: resident::Residents,
    /// Join indexes on the tables the worker's tasks share (broadcast inputs).
    pub join_indexes: join_index::JoinIndexCache,
    pub transfers: Transfers,
    pub operators: OperatorCounts,
}

/// The emulated device's pool when no `--device-pool-size` is given.
pub const EMULATED_POOL_BYTES: u64 = 1 << 30;

impl std::fmt::Debug for GpuRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuRuntime")
            .field("device", &self.device)
            .field("pool", &self.pool.stats())
            .finish_non_exhaustive()
    }
}

impl GpuRuntime {
    /// Starts the runtime on a probed device: sizes the pool (`pool_bytes` from `--pool-size`,
    /// see [`pool::pool_budget`]) and compiles the fixed kernels.
    pub fn start(
        device: ProbedGpu,
        pool_bytes: Option<u64>,
        counters: DeviceCounters,
    ) -> Result<Arc<Self>, StartError> {
        let ProbedGpu { identity, context } = device;
        let (free, total) = context
            .mem_get_info()
            .map_err(|e| StartError::Memory(e.to_string()))?;
        let (budget, warning) = pool::pool_budget(pool_bytes, total as u64, free as u64);
        if let Some(warning) = warning {
            tracing::warn!("{warning}");
        }
        // Every copy and launch of the runtime goes to the context's default stream, which
        // orders them: cudarc's per-buffer events, made for ordering work across streams, would
        // only add two event creations to every allocation.
        // SAFETY: no buffer of this context is used on another stream (none is ever created).
        unsafe { context.disable_event_tracking() };
        let stream = context.default_stream();
        let kernels = KernelCache::new(context.clone())?;
        let backend = Arc::new(Backend::Cuda { context, stream });
        Self::assemble(identity, backend, budget, kernels, counters)
    }

    /// Starts the runtime on the emulated device ([`emulator`]): the kernels compiled for the
    /// host, a pool of `pool_bytes` (default [`EMULATED_POOL_BYTES`]) in host memory.
    pub fn emulated(
        pool_bytes: Option<u64>,
        counters: DeviceCounters,
    ) -> Result<Arc<Self>, StartError> {
        let capacity = pool_bytes.unwrap_or(EMULATED_POOL_BYTES);
        let identity = GpuIdentity {
            ordinal: 0,
            name: emulator::DEVICE_NAME.into(),
            uuid: emulator::DEVICE_UUID.into(),
            total_memory: capacity,
            compute_capability: kernels::MIN_ARCH,
        };
        Self::assemble(
            identity,
            Arc::new(Backend::Emulated),
            capacity,
            KernelCache::emulated()?,
            counters,
        )
    }

    /// The runtime over `backend`, with a pool of `pool_bytes` that spills resident device
    /// tables to host memory when full.
    fn assemble(
        device: GpuIdentity,
        backend: Arc<Backend>,
        pool_bytes: u64,
        kernels: KernelCache,
        counters: DeviceCounters,
    ) -> Result<Arc<Self>, StartError> {
        let pool = DevicePool::new(backend.clone(), pool_bytes)?;
        let runtime = Arc::new(GpuRuntime {
            device,
            backend,
            pool,
            kernels,
            resident: resident::Residents::default(),
            join_indexes: join_index::JoinIndexCache::default(),
            transfers: counters.transfers,
            operators: counters.operators,
        });
        runtime
            .pool
            .set_eviction_hook(Arc::new(resident::Spiller::new(&runtime)));
        Ok(runtime)
    }
}

/// The runtime on GPU 0 with a pool of `pool_bytes`, or why there is none (a failure under
/// `WRK_REQUIRE_GPU=1`).
#[cfg(test)]
fn probe_for_test(test: &str, pool_bytes: Option<u64>) -> Result<Arc<GpuRuntime>, detect::NoGpu> {
    match detect::probe(0) {
        Ok(device) => match GpuRuntime::start(device, pool_bytes, DeviceCounters::default()) {
            Ok(runtime) => Ok(runtime),
            Err(e) => panic!("{test}: a GPU was found but the runtime did not start: {e}"),
        },
        Err(reason) => {
            let required = std::env::var("WRK_REQUIRE_GPU").is_ok_and(|v| v == "1");
            assert!(
                !required,
                "{test}: WRK_REQUIRE_GPU=1 but no GPU can be used: {reason}"
            );
            Err(reason)
        }
    }
}

/// For tests of the device operators: the runtime on GPU 0, or on the emulated device where
/// there is no GPU (saying so), or `None` after printing why the test is skipped (no GPU and no
/// C++ compiler). With `WRK_REQUIRE_GPU=1` only a real GPU will do.
#[cfg(test)]
pub(crate) fn test_device(test: &str) -> Option<Arc<GpuRuntime>> {
    test_device_with_pool(test, Some(1 << 30))
}

/// As [`test_device`], with a device pool of `pool_bytes` (`None`: sized as a worker sizes it,
/// from the GPU's free memory, or [`EMULATED_POOL_BYTES`] on the emulator).
#[cfg(test)]
pub(crate) fn test_device_with_pool(
    test: &str,
    pool_bytes: Option<u64>,
) -> Option<Arc<GpuRuntime>> {
    if let Ok(runtime) = probe_for_test(test, pool_bytes) {
        return Some(runtime);
    }
    if !emulator::compiler_present() {
        println!(
            "SKIPPED {test}: no CUDA device found and no C++ compiler for the CUDA emulator; set WRK_REQUIRE_GPU=1 to make this a failure"
        );
        return None;
    }
    println!("{test}: no CUDA device found; running on the CUDA emulator (host CPU)");
    match GpuRuntime::emulated(pool_bytes, DeviceCounters::default()) {
        Ok(runtime) => Some(runtime),
        Err(e) => panic!("{test}: the emulated device did not start: {e}"),
    }
}

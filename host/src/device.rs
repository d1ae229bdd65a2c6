//! The device a worker drives: the CPU backend, or a GPU with its runtime (pool, kernels),
//! NVML telemetry and metrics. Chosen once at start from `--device`, logged with the reason,
//! and reported to the scheduler in `Register.device` / `Register.gpu` and in heartbeats.

use std::sync::{Arc, Mutex};

use wrk_proto::{GpuInfo, GpuTelemetry};

use crate::gpu::detect::{self, DeviceRequest, DeviceUnavailable, Selected};
use crate::gpu::nvml::Telemetry;
use crate::gpu::{DeviceCounters, GpuRuntime, StartError, selftest};
use crate::metrics::{GpuMetrics, WorkerMetrics};

/// What the worker was asked for.
#[derive(Debug, Clone, Default)]
pub struct DeviceConfig {
    pub request: DeviceRequest,
    /// The device pool's size (`--pool-size`); by default 80% of the device's free memory.
    pub pool_bytes: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error(transparent)]
    Unavailable(#[from] DeviceUnavailable),
    #[error("--device {request}: GPU {ordinal} ({name}) was found but cannot be used: {detail}")]
    Unusable {
        request: DeviceRequest,
        ordinal: u32,
        name: String,
        detail: String,
    },
}

/// A worker's GPU, as the worker loop uses it.
pub struct GpuWorker {
    pub runtime: Arc<GpuRuntime>,
    info: GpuInfo,
    telemetry: Option<Arc<Mutex<Telemetry>>>,
    metrics: GpuMetrics,
}

/// The worker's device.
pub enum WorkerDevice {
    Cpu,
    Gpu(Box<GpuWorker>),
}

impl WorkerDevice {
    /// Chooses and starts the device. A GPU that was asked for explicitly and cannot be used is
    /// an error; with `auto` the worker falls back to the CPU and logs why.
    pub fn start(
        config: &DeviceConfig,
        metrics: &mut WorkerMetrics,
    ) -> Result<WorkerDevice, DeviceError> {
        let request = config.request;
        let probed = match detect::select(request, detect::probe)? {
            Selected::Cpu { reason } => {
                tracing::info!("the worker uses the CPU backend: {reason}");
                return Ok(WorkerDevice::Cpu);
            }
            Selected::Emulated => return Self::start_emulated(config, metrics),
            Selected::Gpu(probed) => probed,
        };
        let (ordinal, name) = (probed.identity.ordinal, probed.identity.name.clone());
        let unusable = |detail: String| DeviceError::Unusable {
            request,
            ordinal,
            name: name.clone(),
            detail,
        };
        // Registered before the runtime starts, so the self-test's copies are counted too (a
        // worker that then falls back to the CPU exports these families without any series).
        let gpu_metrics = metrics.register_gpu(ordinal);
        let counters = DeviceCounters::with_metrics(&gpu_metrics);
        let started = GpuRuntime::start(probed, config.pool_bytes, counters)
            .map_err(|e: StartError| e.to_string())
            .and_then(self_tested);
        let runtime = match started {
            Ok(runtime) => runtime,
            Err(detail) if request == DeviceRequest::Auto => {
                tracing::warn!(
                    "the worker uses the CPU backend: --device auto found GPU {ordinal} ({name}) but cannot use it: {detail}"
                );
                return Ok(WorkerDevice::Cpu);
            }
            Err(detail) => return Err(unusable(detail)),
        };
        let telemetry = match Telemetry::open_cuda_device(ordinal, &runtime.device.uuid) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!("GPU {ordinal} runs without NVML telemetry: {e}");
                None
            }
        };
        let identity = telemetry.as_ref().map(|t| t.identity().clone());
        let mut info = gpu_info(&runtime);
        if let Some(identity) = identity {
            info.name = identity.name;
            info.uuid = identity.uuid;
            info.mig_profile = identity.mig_profile.unwrap_or_default();
        }
        Ok(Self::gpu(runtime, info, telemetry, gpu_metrics))
    }

    /// The GPU backend on the CUDA emulator (`--device emulated-gpu`): the same start-up
    /// (pool, kernels, self-test) and reports as a GPU worker, without NVML.
    fn start_emulated(
        config: &DeviceConfig,
        metrics: &mut WorkerMetrics,
    ) -> Result<WorkerDevice, DeviceError> {
        let unusable = |detail: String| DeviceError::Unusable {
            request: DeviceRequest::Emulated,
            ordinal: 0,
            name: crate::gpu::emulator::DEVICE_NAME.into(),
            detail,
        };
        if !crate::gpu::emulator::compiler_present() {
            return Err(unusable(
                "the emulator compiles its kernels with the host C++ compiler, and neither $CXX nor `c++` runs".into(),
            ));
        }
        let gpu_metrics = metrics.register_gpu(0);
        let counters = DeviceCounters::with_metrics(&gpu_metrics);
        let runtime = GpuRuntime::emulated(config.pool_bytes, counters)
            .map_err(|e| e.to_string())
            .and_then(self_tested)
            .map_err(unusable)?;
        tracing::warn!(
            "the worker uses the CUDA emulator on the host CPU (--device emulated-gpu): GPU kernels run one CUDA thread at a time, for testing, not for speed"
        );
        let info = gpu_info(&runtime);
        Ok(Self::gpu(runtime, info, None, gpu_metrics))
    }

    fn gpu(
        runtime: Arc<GpuRuntime>,
        info: GpuInfo,
        telemetry: Option<Telemetry>,
        gpu_metrics: GpuMetrics,
    ) -> WorkerDevice {
        let pool = runtime.pool.stats();
        gpu_metrics.observe_pool(&pool);
        tracing::info!(
            gpu = info.ordinal,
            uuid = %info.uuid,
            mig_profile = %info.mig_profile,
            pool_bytes = pool.capacity,
            "the worker uses GPU {}: {} (compute capability {}, {} MiB)",
            info.ordinal,
            info.name,
            info.compute_capability,
            info.memory_total_bytes >> 20
        );
        WorkerDevice::Gpu(Box::new(GpuWorker {
            runtime,
            info,
            telemetry: telemetry.map(|t| Arc::new(Mutex::new(t))),
            metrics: gpu_metrics,
        }))
    }

    /// The GPU runtime the worker's tasks run their operators on, if it has a GPU.
    pub fn runtime(&self) -> Option<Arc<GpuRuntime>> {
        match self {
            WorkerDevice::Cpu => None,
            WorkerDevice::Gpu(gpu) => Some(gpu.runtime.clone()),
        }
    }

    /// `cpu`, `gpu:N` or `emulated-gpu`, as registered with the scheduler.
    pub fn name(&self) -> String {
        match self {
            WorkerDevice::Cpu => "cpu".into(),
            WorkerDevice::Gpu(gpu) if gpu.runtime.backend.is_emulated() => {
                DeviceRequest::Emulated.to_string()
            }
            WorkerDevice::Gpu(gpu) => format!("gpu:{}", gpu.info.ordinal),
        }
    }

    pub fn gpu_info(&self) -> Option<GpuInfo> {
        match self {
            WorkerDevice::Cpu => None,
            WorkerDevice::Gpu(gpu) => Some(gpu.info.clone()),
        }
    }

    /// A GPU worker's telemetry for its next heartbeat (and its metrics updated); `None` on a
    /// CPU worker.
    pub async fn sample(&self) -> Option<GpuTelemetry> {
        let WorkerDevice::Gpu(gpu) = self else {
            return None;
        };
        // Before the pool: a reader who sees the pool's use settle sees these counters too.
        gpu.metrics
            .observe_join_indexes(&gpu.runtime.join_indexes.stats());
        let pool = gpu.runtime.pool.stats();
        gpu.metrics.observe_pool(&pool);
        let mut sample = match &gpu.telemetry {
            Some(telemetry) => {
                let telemetry = telemetry.clone();
                // NVML calls block for up to milliseconds: keep them off the runtime's threads.
                let sampled = tokio::task::spawn_blocking(move || {
                    telemetry.lock().unwrap_or_else(|e| e.into_inner()).sample()
                })
                .await;
                match sampled {
                    Ok(Ok(sample)) => sample,
                    Ok(Err(e)) => {
                        tracing::debug!("NVML sample failed: {e}");
                        GpuTelemetry::default()
                    }
                    Err(e) => {
                        tracing::debug!("NVML sampling task failed: {e}");
                        GpuTelemetry::default()
                    }
                }
            }
            None => GpuTelemetry {
                memory_total_bytes: gpu.info.memory_total_bytes,
                ..GpuTelemetry::default()
            },
        };
        sample.device_pool_used_bytes = pool.used;
        gpu.metrics.observe(&sample);
        Some(sample)
    }
}

/// The runtime, once its self-test passed.
fn self_tested(runtime: Arc<GpuRuntime>) -> Result<Arc<GpuRuntime>, String> {
    selftest::run(&runtime)
        .map(|()| runtime)
        .map_err(|e| format!("the device self-test failed: {e}"))
}

/// What the scheduler is told about the runtime's device (NVML may name it better).
fn gpu_info(runtime: &GpuRuntime) -> GpuInfo {
    let (major, minor) = runtime.device.compute_capability;
    GpuInfo {
        ordinal: runtime.device.ordinal,
        name: runtime.device.name.clone(),
        uuid: runtime.device.uuid.clone(),
        memory_total_bytes: runtime.device.total_memory,
        compute_capability: format!("{major}.{minor}"),
        mig_profile: String::new(),
        device_pool_bytes: runtime.pool.stats().capacity,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::compile_cache_counter;

    #[test]
    fn a_cpu_worker_has_no_gpu_and_no_gpu_series() {
        let mut metrics = WorkerMetrics::new(compile_cache_counter());
        let device = WorkerDevice::start(
            &DeviceConfig {
                request: DeviceRequest::Cpu,
                pool_bytes: None,
            },
            &mut metrics,
        )
        .unwrap();
        assert_eq!(device.name(), "cpu");
        assert!(device.gpu_info().is_none());
        assert!(!metrics.render().contains("wrk_gpu_"));
    }

    #[test]
    fn an_explicit_gpu_fails_clearly_without_one_and_auto_falls_back() {
        // Two workers' devices: each registers its device series in its own metrics.
        let explicit = WorkerDevice::start(
            &DeviceConfig {
                request: DeviceRequest::Gpu(0),
                pool_bytes: None,
            },
            &mut WorkerMetrics::new(compile_cache_counter()),
        );
        let auto = WorkerDevice::start(
            &DeviceConfig::default(),
            &mut WorkerMetrics::new(compile_cache_counter()),
        );
        if detect::probe(0).is_err() {
            let err = explicit.err().expect("gpu:0 without a GPU must fail");
            assert!(
                err.to_string()
                    .contains("--device gpu:0 was asked for but no GPU can be used"),
                "{err}"
            );
            assert_eq!(auto.unwrap().name(), "cpu");
        } else {
            // With a GPU both use it.
            assert_eq!(explicit.unwrap().name(), "gpu:0");
            assert_eq!(auto.unwrap().name(), "gpu:0");
        }
    }

    #[tokio::test]
    async fn an_emulated_gpu_worker_starts_self_tested_and_reports_as_a_gpu_worker() {
        if crate::gpu::emulator::skipped_without_compiler(
            "an_emulated_gpu_worker_starts_self_tested",
        ) {
            return;
        }
        let mut metrics = WorkerMetrics::new(compile_cache_counter());
        let device = WorkerDevice::start(
            &DeviceConfig {
                request: DeviceRequest::Emulated,
                pool_bytes: Some(64 << 20),
            },
            &mut metrics,
        )
        .unwrap();
        assert_eq!(device.name(), "emulated-gpu");
        let info = device.gpu_info().unwrap();
        assert_eq!(info.name, crate::gpu::emulator::DEVICE_NAME);
        assert_eq!(info.device_pool_bytes, 64 << 20);
        // The self-test's uploads and downloads were counted; its buffers all went back.
        let sample = device.sample().await.unwrap();
        assert_eq!(sample.device_pool_used_bytes, 0);
        let text = metrics.render();
        for series in [
            "wrk_worker_device_transfers_total{direction=\"to_device\"",
            "wrk_worker_device_pool_size_bytes",
        ] {
            assert!(text.contains(series), "{series} missing from:\n{text}");
        }
    }
}

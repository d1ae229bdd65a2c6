//! The device a worker drives: the CPU backend, or a GPU with its runtime (pool, kernels),
//! NVML telemetry and metrics. Chosen once at start from `--device`, logged with the reason,
//! and reported to the scheduler in `Register.device` / `Register.gpu` and in heartbeats.

use std::sync::{Arc, Mutex};

use wrk_proto::{GpuInfo, GpuTelemetry};

use crate::gpu::detect::{self, DeviceRequest, DeviceUnavailable, Selected};
use crate::gpu::nvml::{Telemetry, nvml_lookup_keys};
use crate::gpu::{GpuRuntime, StartError, Transfers, selftest};
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
            Selected::Gpu(probed) => probed,
        };
        let (ordinal, name) = (probed.ordinal, probed.name.clone());
        let unusable = |detail: String| DeviceError::Unusable {
            request,
            ordinal,
            name: name.clone(),
            detail,
        };
        // Registered before the runtime starts, so the self-test's copies are counted too (a
        // worker that then falls back to the CPU exports these families without any series).
        let gpu_metrics = metrics.register_gpu(ordinal);
        let transfers = Transfers::with_metrics(gpu_metrics.transfers.clone());
        let started = GpuRuntime::start(probed, config.pool_bytes, transfers)
            .map_err(|e: StartError| e.to_string())
            .and_then(|runtime| {
                selftest::run(&runtime)
                    .map(|()| runtime)
                    .map_err(|e| format!("the device self-test failed: {e}"))
            });
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
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let keys = nvml_lookup_keys(ordinal, &runtime.device.uuid, visible.as_deref());
        let telemetry = match Telemetry::open(&keys) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!("GPU {ordinal} runs without NVML telemetry: {e}");
                None
            }
        };
        let identity = telemetry.as_ref().map(|t| t.identity().clone());
        let pool = runtime.pool.stats();
        let (major, minor) = runtime.device.compute_capability;
        let info = GpuInfo {
            ordinal,
            name: identity
                .as_ref()
                .map_or_else(|| runtime.device.name.clone(), |i| i.name.clone()),
            uuid: identity
                .as_ref()
                .map_or_else(|| runtime.device.uuid.clone(), |i| i.uuid.clone()),
            memory_total_bytes: runtime.device.total_memory,
            compute_capability: format!("{major}.{minor}"),
            mig_profile: identity.and_then(|i| i.mig_profile).unwrap_or_default(),
            device_pool_bytes: pool.capacity,
        };
        gpu_metrics.observe_pool(pool.capacity, pool.used, pool.peak);
        tracing::info!(
            gpu = ordinal,
            uuid = %info.uuid,
            mig_profile = %info.mig_profile,
            pool_bytes = pool.capacity,
            "the worker uses GPU {ordinal}: {} (compute capability {}, {} MiB)",
            info.name,
            info.compute_capability,
            info.memory_total_bytes >> 20
        );
        Ok(WorkerDevice::Gpu(Box::new(GpuWorker {
            runtime,
            info,
            telemetry: telemetry.map(|t| Arc::new(Mutex::new(t))),
            metrics: gpu_metrics,
        })))
    }

    /// `cpu` or `gpu:N`, as registered with the scheduler.
    pub fn name(&self) -> String {
        match self {
            WorkerDevice::Cpu => "cpu".into(),
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
        let pool = gpu.runtime.pool.stats();
        gpu.metrics
            .observe_pool(pool.capacity, pool.used, pool.peak);
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
        let mut metrics = WorkerMetrics::new(compile_cache_counter());
        let explicit = WorkerDevice::start(
            &DeviceConfig {
                request: DeviceRequest::Gpu(0),
                pool_bytes: None,
            },
            &mut metrics,
        );
        let auto = WorkerDevice::start(&DeviceConfig::default(), &mut metrics);
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
}

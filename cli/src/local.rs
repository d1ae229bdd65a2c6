//! The embedded local cluster: the real scheduler and N real workers in this process, talking
//! gRPC over 127.0.0.1, exactly as they do across machines.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use wrk_host::engine::EngineConfig;
use wrk_host::memory::{MachineMemory, SizeSpec};
use wrk_host::worker::{self, WorkerConfig};
use wrk_scheduler::SchedulerConfig;

#[derive(Debug, Clone)]
pub struct LocalClusterConfig {
    pub workers: usize,
    pub slots_per_worker: u32,
    /// Where the scheduler listens; port 0 picks a free one.
    pub listen: SocketAddr,
    pub cache_dir: Option<PathBuf>,
    /// Where the scheduler serves HTTP (metrics, health); workers then serve their metrics on
    /// free ports. `None`: no HTTP at all.
    pub http: Option<SocketAddr>,
    /// Each worker's memory pool: bytes, or a fraction of the machine's memory shared by all
    /// workers; `None` shares 70% of it.
    pub pool: Option<SizeSpec>,
    /// Where workers spill (each in its own subdirectory); `None`: the default spill root.
    pub spill_root: Option<PathBuf>,
    /// The first worker's device; the others use the CPU backend (one worker per GPU).
    pub device: wrk_host::gpu::detect::DeviceRequest,
}

/// How long the workers of a local cluster whose first worker drives `device` may take to
/// register: a GPU worker compiles its kernels and runs its self-test first (minutes on the
/// CUDA emulator in a debug build).
pub fn start_timeout(device: wrk_host::gpu::detect::DeviceRequest) -> Duration {
    match device {
        wrk_host::gpu::detect::DeviceRequest::Cpu => Duration::from_secs(30),
        _ => Duration::from_secs(180),
    }
}

/// Each of `workers` workers' pool, checked against the machine.
pub fn worker_pool_bytes(pool: Option<SizeSpec>, workers: usize) -> Result<u64> {
    let workers = workers.max(1) as u64;
    let total = match pool {
        Some(SizeSpec::Bytes(bytes)) => Some(SizeSpec::Bytes(bytes.saturating_mul(workers))),
        other => other,
    };
    let settings = wrk_host::memory::size::resolve(None, total, MachineMemory::detect()?)
        .with_context(|| format!("the pools of {workers} local workers do not fit"))?;
    Ok(settings.pool / workers)
}

/// A running local cluster; dropping it does not stop it, [`LocalCluster::shutdown`] does.
pub struct LocalCluster {
    pub scheduler_url: String,
    /// The scheduler's HTTP address, when it serves one.
    pub http_url: Option<String>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

/// Binds `address`, or a free port on the same IP when it is taken (as Dask does for its
/// dashboard), logging the move.
pub async fn bind_with_fallback(address: SocketAddr) -> Result<TcpListener> {
    match TcpListener::bind(address).await {
        Ok(listener) => Ok(listener),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && address.port() != 0 => {
            let listener = TcpListener::bind(SocketAddr::new(address.ip(), 0))
                .await
                .with_context(|| format!("cannot listen on {}", address.ip()))?;
            tracing::warn!(
                "{address} is in use; serving HTTP on {} instead",
                listener.local_addr()?
            );
            Ok(listener)
        }
        Err(e) => Err(e).with_context(|| format!("cannot listen on {address}")),
    }
}

async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

impl LocalCluster {
    pub async fn start(config: LocalClusterConfig) -> Result<Self> {
        let listener = TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        let address = listener.local_addr()?;
        let scheduler_url = format!("http://{address}");
        let http = match config.http {
            Some(address) => Some(bind_with_fallback(address).await?),
            None => None,
        };
        let http_url = match &http {
            Some(listener) => Some(format!("http://{}", listener.local_addr()?)),
            None => None,
        };
        let pool_bytes = worker_pool_bytes(config.pool, config.workers)?;
        let spill_root = config
            .spill_root
            .clone()
            .unwrap_or_else(wrk_host::memory::spill::default_root);
        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = Vec::new();
        let scheduler_stop = stop_rx.clone();
        tasks.push(tokio::spawn(async move {
            if let Err(e) = wrk_scheduler::serve(
                listener,
                http,
                SchedulerConfig::default(),
                stopped(scheduler_stop),
            )
            .await
            {
                tracing::error!("scheduler stopped: {e}");
            }
        }));
        for index in 0..config.workers.max(1) {
            let worker_config = WorkerConfig {
                scheduler: scheduler_url.clone(),
                listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                advertise_host: None,
                worker_id: Some(format!("local-{index}")),
                slots: config.slots_per_worker,
                engine: EngineConfig {
                    cache_dir: config.cache_dir.clone(),
                    max_concurrent_tasks: config.slots_per_worker,
                    ..EngineConfig::default()
                },
                connect_timeout: Duration::from_secs(10),
                metrics_listen: config.http.map(|_| SocketAddr::from(([127, 0, 0, 1], 0))),
                token: None,
                shuffle_port: 0,
                transport: wrk_host::shuffle::TransportChoice::Tcp,
                ucx_part_threshold: None,
                pool_bytes,
                spill_root: spill_root.clone(),
                // Many local workers share one machine: one GPU is driven by one worker (with
                // the pool it sizes from the GPU's free memory), the others use the CPU.
                device: wrk_host::device::DeviceConfig {
                    request: if index == 0 {
                        config.device
                    } else {
                        wrk_host::gpu::detect::DeviceRequest::Cpu
                    },
                    pool_bytes: None,
                },
                tags: Vec::new(),
            };
            let worker_stop = stop_rx.clone();
            tasks.push(tokio::spawn(async move {
                if let Err(e) = worker::run(worker_config, stopped(worker_stop)).await {
                    tracing::error!("local worker {index} stopped: {e}");
                }
            }));
        }
        Ok(LocalCluster {
            scheduler_url,
            http_url,
            stop,
            tasks,
        })
    }

    /// Waits until `workers` workers have registered (or fails after `timeout`).
    pub async fn wait_for_workers(&self, workers: usize, timeout: Duration) -> Result<()> {
        let started = std::time::Instant::now();
        loop {
            let status = crate::client::cluster_status(&self.scheduler_url, None).await;
            if let Ok(status) = &status
                && status.workers.len() >= workers
            {
                return Ok(());
            }
            if started.elapsed() > timeout {
                anyhow::bail!(
                    "local cluster: only {:?} of {workers} workers registered after {timeout:?}",
                    status.map(|s| s.workers.len())
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

//! `wrk`: submit jobs, run a local cluster, a scheduler or a worker, run one task, generate data.

/// Workers allocate and free large column buffers all the time; mimalloc reuses freed memory
/// instead of returning it to the OS and faulting fresh pages in for the next partition.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (its `mi_option_e` in `include/mimalloc.h`, v2 and v3).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// How long mimalloc keeps freed memory before giving it back to the OS, in milliseconds.
///
/// Its default (10 ms, times 10 for large blocks) let a worker's resident memory run ahead of
/// its pool, which frees partitions as it spills them (measured: 100 MiB more at peak, in
/// `tests/tests/integration/memory.rs`). Giving memory back at once (0) made every buffer the Parquet
/// decoder allocates and frees per page (the compressed page, its decompressed copy, the
/// dictionary) fault its pages in again: a fifth of the group-by query. One millisecond keeps
/// those buffers within a page's decoding and still returns a spilled partition's memory
/// at once on the scale of a task.
const PURGE_DELAY_MS: std::os::raw::c_long = 1;

/// Sets [`PURGE_DELAY_MS`].
fn return_freed_memory_promptly() {
    // SAFETY: sets a plain integer option of the allocator, from `main` before any other
    // thread exists.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) }
}

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use wrk_cli::job::{self, Overrides};
use wrk_cli::local::{LocalCluster, LocalClusterConfig};
use wrk_cli::{client, datasets, output, taxi};
use wrk_host::device::{DeviceConfig, WorkerDevice};
use wrk_host::engine::{EngineConfig, TaskEngine, TaskLimits, module_hash};
use wrk_host::gpu::DeviceActivity;
use wrk_host::gpu::detect::DeviceRequest;
use wrk_host::guest_api::{TaskInfo, TaskTable};
use wrk_host::memory::size::{self, MachineMemory, SizeSpec};
use wrk_host::memory::spill::{self as spill, SpillDir};
use wrk_host::metrics::{WorkerMetrics, compile_cache_counter};
use wrk_host::shuffle::TransportChoice;
use wrk_host::store::PartitionStore;
use wrk_host::table::Table;
use wrk_host::worker::WorkerConfig;
use wrk_proto::{JobRef, JobState};
use wrk_scheduler::SchedulerConfig;

#[derive(Parser)]
#[command(
    name = "wrk",
    version,
    about = "Sandboxed WebAssembly dataframe tasks on a pool of GPU (or CPU) workers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a job file, on the scheduler given or on an embedded local cluster.
    Submit(SubmitArgs),
    /// Start a local cluster (scheduler + workers in this process) and keep it up.
    Up {
        #[command(flatten)]
        cluster: ClusterArgs,
        /// Where the scheduler listens.
        #[arg(long, default_value = "127.0.0.1:7070")]
        listen: SocketAddr,
        /// Where the scheduler serves its dashboard, /metrics and /healthz (a free port if taken).
        #[arg(long, default_value = "127.0.0.1:8787")]
        http_listen: SocketAddr,
    },
    /// Run the scheduler.
    Scheduler {
        #[arg(long, default_value = "0.0.0.0:7070")]
        listen: SocketAddr,
        /// Where the scheduler serves its dashboard, /metrics and /healthz (a free port if taken).
        #[arg(long, default_value = "0.0.0.0:8787")]
        http_listen: SocketAddr,
        /// How often workers heartbeat, in milliseconds.
        #[arg(long, default_value_t = 1000)]
        heartbeat_ms: u64,
        /// Seconds without a heartbeat before a worker is declared lost.
        #[arg(long, default_value_t = 10.0)]
        worker_timeout_secs: f64,
        /// A TOML file of tenants and their tokens, read again when it changes (a removed
        /// tenant's datasets are released); without it the scheduler is open to anyone who can
        /// reach it, so it listens on loopback only unless --insecure-no-auth.
        #[arg(long)]
        tenants: Option<PathBuf>,
        /// The token workers must present.
        #[arg(long, env = "WRK_WORKER_TOKEN", hide_env_values = true)]
        worker_token: Option<String>,
        /// Serve without tenants on an address other machines can reach (without it, a
        /// scheduler with no --tenants file listens on loopback only).
        #[arg(long)]
        insecure_no_auth: bool,
    },
    /// Run a worker attached to a scheduler.
    Worker(WorkerArgs),
    /// Show the workers, jobs and scaling advice of a cluster.
    Status {
        #[arg(long, env = "WRK_SCHEDULER", default_value = "http://127.0.0.1:7070")]
        scheduler: String,
        /// `text` for people, `json` for scripts.
        #[arg(long, value_enum, default_value_t = StatusFormat::Text)]
        output: StatusFormat,
        /// Your tenant token, for schedulers that require one.
        #[arg(long, env = "WRK_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
    /// Cancel a job.
    Cancel {
        job_id: String,
        #[arg(long, env = "WRK_SCHEDULER", default_value = "http://127.0.0.1:7070")]
        scheduler: String,
        /// Your tenant token, for schedulers that require one.
        #[arg(long, env = "WRK_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
    /// List your persisted datasets: partitions, rows, bytes and the workers holding them.
    Datasets {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Release a persisted dataset: workers drop its partitions.
    ReleaseDataset {
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Move a dataset's partitions between workers (peer to peer) so its bytes are even.
    Rebalance {
        name: String,
        #[command(flatten)]
        client: ClientArgs,
        /// How long to wait for the moves, in seconds.
        #[arg(long, default_value_t = 300.0)]
        timeout_secs: f64,
    },
    /// Retire a worker: move the data it holds that is still needed to other workers, let its
    /// tasks finish, then let it exit.
    Retire {
        worker_id: String,
        #[command(flatten)]
        client: ClientArgs,
        /// How long to wait for the worker to leave, in seconds.
        #[arg(long, default_value_t = 600.0)]
        timeout_secs: f64,
    },
    /// Run one task on one Parquet file, without a cluster.
    Run(RunArgs),
    /// The Kubernetes operator: print its CRDs or installation manifests, or run it.
    Operator {
        #[command(subcommand)]
        command: wrk_operator::cli::OperatorCommand,
    },
    /// Write a deterministic taxi-trip dataset (Parquet) for the haversine example.
    GenTaxi {
        #[arg(long, default_value = "data/taxi")]
        out: PathBuf,
        #[arg(long, default_value_t = 10_000_000)]
        rows: u64,
        #[arg(long, default_value_t = 8)]
        files: u32,
        #[arg(long, default_value_t = 1_000_000)]
        row_group_rows: usize,
        #[arg(long, default_value_t = 2024)]
        seed: u64,
        /// Distinct `driver_id`s in the trips (default: a quarter of the rows).
        #[arg(long)]
        drivers: Option<u64>,
        /// Also write the `zones` and `drivers` dimension tables under this directory.
        #[arg(long)]
        dimensions: Option<PathBuf>,
    },
    /// Measure what reusing operators' output buffers saves on a repeated operator.
    #[command(hide = true)]
    BenchReuse {
        #[arg(long, default_value_t = 4_000_000)]
        rows: usize,
        #[arg(long, default_value_t = 40)]
        iterations: u32,
    },
}

/// Where the scheduler is, and who is asking.
#[derive(clap::Args)]
struct ClientArgs {
    #[arg(long, env = "WRK_SCHEDULER", default_value = "http://127.0.0.1:7070")]
    scheduler: String,
    /// Your tenant token, for schedulers that require one.
    #[arg(long, env = "WRK_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum StatusFormat {
    Text,
    Json,
}

#[derive(clap::Args, Clone)]
struct ClusterArgs {
    /// Workers of the embedded cluster (default: one per core).
    #[arg(long)]
    workers: Option<usize>,
    /// Tasks each worker runs at once.
    #[arg(long, default_value_t = 2)]
    slots: u32,
    /// Where compiled components are cached (default: $WRK_CACHE_DIR or ~/.cache/wrk/components).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Each worker's memory pool: bytes (`2GiB`) or a fraction of the machine's memory shared by
    /// all workers (default 0.7).
    #[arg(long)]
    pool_size: Option<SizeSpec>,
    /// Where workers spill partitions (default: wrk-spill under the system's temporary
    /// directory).
    #[arg(long)]
    spill_dir: Option<PathBuf>,
    /// The device of the first worker (one worker drives one GPU; the others use the CPU):
    /// `cpu`, `gpu:N`, `auto` (the first GPU, else the CPU) or `emulated-gpu` (the GPU backend
    /// on the CUDA emulator: for testing, slow; needs a C++ compiler).
    #[arg(long, default_value = "cpu")]
    device: DeviceRequest,
}

#[derive(clap::Args)]
struct SubmitArgs {
    /// The job file (TOML).
    job: PathBuf,
    /// A running scheduler; without it the job runs on an embedded local cluster.
    #[arg(long, env = "WRK_SCHEDULER")]
    scheduler: Option<String>,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Write the result to this Parquet file instead of printing it.
    #[arg(long, short)]
    output: Option<PathBuf>,
    /// Rows of the result to print.
    #[arg(long, default_value_t = 50)]
    max_rows: usize,
    /// Set a job parameter (KEY=VALUE), overriding the job file.
    #[arg(long = "param", value_parser = job::key_value)]
    params: Vec<(String, String)>,
    /// Point a source at another path (NAME=PATH).
    #[arg(long = "source", value_parser = job::key_value)]
    sources: Vec<(String, String)>,
    /// Point a sink at another path (NAME=PATH).
    #[arg(long = "sink", value_parser = job::key_value)]
    sinks: Vec<(String, String)>,
    /// Run this component instead of the job's default `module`.
    #[arg(long)]
    module: Option<PathBuf>,
    /// No progress bars.
    #[arg(long, short)]
    quiet: bool,
    /// Write a self-contained HTML performance report of the job here (task stream, stage
    /// durations and throughput, transfers, slowest tasks, worker memory), even if it fails.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Your tenant token, for schedulers that require one.
    #[arg(long, env = "WRK_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Keep the job's output on the workers as your dataset NAME (instead of fetching it),
    /// for later jobs to read with `dataset = "NAME"`. Needs --scheduler.
    #[arg(long)]
    persist: Option<String>,
    /// The job's priority among your jobs: higher starts first (default: the job file's
    /// `priority`, else 0).
    #[arg(long, allow_negative_numbers = true)]
    priority: Option<i32>,
}

#[derive(clap::Args)]
struct WorkerArgs {
    #[arg(long, env = "WRK_SCHEDULER", default_value = "http://127.0.0.1:7070")]
    scheduler: String,
    /// Where the worker serves its partitions to peers.
    #[arg(long, default_value = "0.0.0.0:0")]
    listen: SocketAddr,
    /// Host name or IP peers use to reach this worker (default: the listen IP, or 127.0.0.1).
    #[arg(long, env = "WRK_ADVERTISE_HOST")]
    advertise_host: Option<String>,
    #[arg(long)]
    id: Option<String>,
    #[arg(long, default_value_t = 2)]
    slots: u32,
    /// Where compiled components are cached (default: $WRK_CACHE_DIR or ~/.cache/wrk/components).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Default linear-memory cap of one task, in MiB.
    #[arg(long, default_value_t = 1024)]
    task_memory_mib: u64,
    /// Default time limit of one task, in seconds.
    #[arg(long, default_value_t = 600.0)]
    task_timeout_secs: f64,
    /// Serve /metrics and /healthz here (for example 0.0.0.0:9090).
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// The worker token the scheduler requires, if any.
    #[arg(long, env = "WRK_WORKER_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The port receiving shuffle pieces from peers, on the listen IP (0 picks a free one).
    #[arg(long, env = "WRK_SHUFFLE_PORT", default_value_t = 0)]
    shuffle_port: u16,
    /// The transport of shuffles between workers: auto (UCX when this build has it and both
    /// workers of a pair do, else TCP), tcp, or ucx (fail at start without it).
    #[arg(long, env = "WRK_TRANSPORT", default_value = "auto")]
    transport: TransportChoice,
    /// Over UCX, send each Arrow buffer of at least this size (`1MiB`) as its own rendezvous:
    /// one copy instead of two, but all of it on the receiver's side. Measured slower between
    /// two processes of one 2-core host (docs/shuffle.md); for fabrics with RDMA.
    #[arg(long, env = "WRK_UCX_PART_THRESHOLD")]
    ucx_part_threshold: Option<bytesize::ByteSize>,
    /// What this worker may use in all (the container's memory limit), with a unit (`16GiB`);
    /// default: the machine's memory, or its cgroup's limit when lower.
    #[arg(long, env = "WRK_MEMORY_LIMIT_BYTES")]
    memory_limit: Option<SizeSpec>,
    /// The worker's memory pool: bytes (`512MiB`, `12GiB`) or a fraction of the memory limit
    /// (default 0.7, leaving 30% for the runtime, guests and transient buffers).
    #[arg(long, env = "WRK_POOL_BYTES")]
    pool_size: Option<SizeSpec>,
    /// Where to spill partitions under memory pressure; the worker uses its own subdirectory
    /// (default: wrk-spill under the system's temporary directory).
    #[arg(long, env = "WRK_SPILL_DIR")]
    spill_dir: Option<PathBuf>,
    /// The device to drive: `cpu`, `gpu:N` (CUDA device N; fails at start if it cannot be used),
    /// `auto` (the first GPU, else the CPU) or `emulated-gpu` (the GPU backend on the CUDA
    /// emulator, on the CPU: for testing, slow; needs a C++ compiler).
    #[arg(long, env = "WRK_DEVICE", default_value = "auto")]
    device: DeviceRequest,
    /// The device memory pool's size in bytes (`20GiB`, `512MiB`); by
    /// default 80% of the GPU's free memory, and never more than 90% of it. (`WRK_POOL_BYTES`,
    /// which the operator sets from the pod's memory limit, sizes host memory, not this.)
    #[arg(long, env = "WRK_DEVICE_POOL_BYTES")]
    device_pool_size: Option<SizeSpec>,
    /// Tags this worker offers to stages that require them (`requires = ["gpu"]` in a job
    /// file), comma-separated, each of `a-z 0-9 . _ : -`; `gpu` with the GPU's model and MIG
    /// profile, or `cpu`, are added automatically.
    #[arg(long, env = "WRK_WORKER_TAGS", value_delimiter = ',', value_parser = parse_tag)]
    tags: Vec<String>,
}

/// One `--tags` entry, checked as the scheduler checks it.
fn parse_tag(text: &str) -> Result<String, String> {
    wrk_scheduler::tags::check(text)
        .map(|()| text.to_string())
        .map_err(|e| e.to_string())
}

/// The device pool's size from `--device-pool-size`: bytes only (the default already is a share
/// of the GPU's free memory).
fn device_pool_bytes(spec: Option<SizeSpec>) -> Result<Option<u64>> {
    match spec {
        None => Ok(None),
        Some(SizeSpec::Bytes(bytes)) => Ok(Some(bytes)),
        Some(SizeSpec::Fraction(fraction)) => bail!(
            "--device-pool-size takes bytes (e.g. 20GiB), not a fraction ({fraction}); without it the pool is 80% of the GPU's free memory"
        ),
    }
}

#[derive(clap::Args)]
struct RunArgs {
    /// The task component (.wasm).
    module: PathBuf,
    /// Parquet input files, one input table each.
    #[arg(long = "input")]
    inputs: Vec<PathBuf>,
    /// The stage name the task sees.
    #[arg(long, default_value = "main")]
    stage: String,
    #[arg(long = "param", value_parser = job::key_value)]
    params: Vec<(String, String)>,
    /// Grant a source (NAME=PATH).
    #[arg(long = "source", value_parser = job::key_value)]
    sources: Vec<(String, String)>,
    /// Grant a sink (NAME=PATH).
    #[arg(long = "sink", value_parser = job::key_value)]
    sinks: Vec<(String, String)>,
    /// Write the first output table to this Parquet file instead of printing it.
    #[arg(long, short)]
    output: Option<PathBuf>,
    #[arg(long, default_value_t = 50)]
    max_rows: usize,
    #[arg(long, default_value_t = 1024)]
    task_memory_mib: u64,
    #[arg(long, default_value_t = 600.0)]
    task_timeout_secs: f64,
    /// Where the task's table operators run: `cpu`, `gpu:N`, `auto` (the first GPU, else the
    /// CPU) or `emulated-gpu` (the GPU backend on the CUDA emulator: for testing, slow). With a
    /// GPU, a line on stderr says which operators ran on it and what crossed to and from it.
    #[arg(long, default_value = "cpu")]
    device: DeviceRequest,
    /// The device memory pool's size in bytes (`2GiB`); by default 80% of the GPU's free
    /// memory.
    #[arg(long)]
    device_pool_size: Option<SizeSpec>,
}

fn default_workers() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
}

/// A GPU worker's device for `wrk status --output json`.
fn gpu_json(
    gpu: &wrk_proto::GpuInfo,
    telemetry: Option<&wrk_proto::GpuTelemetry>,
) -> serde_json::Value {
    serde_json::json!({
        "name": gpu.name,
        "uuid": gpu.uuid,
        "mig_profile": gpu.mig_profile,
        "compute_capability": gpu.compute_capability,
        "memory_total_bytes": gpu.memory_total_bytes,
        "device_pool_bytes": gpu.device_pool_bytes,
        "memory_used_bytes": telemetry.map(|t| t.memory_used_bytes),
        "sm_utilization": telemetry.and_then(|t| t.sm_utilization),
        "temperature_celsius": telemetry.and_then(|t| t.temperature_celsius),
        "power_watts": telemetry.and_then(|t| t.power_watts),
    })
}

/// A GPU worker's device in one line of `wrk status`.
fn gpu_line(gpu: &wrk_proto::GpuInfo, telemetry: Option<&wrk_proto::GpuTelemetry>) -> String {
    let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
    let mut line = gpu.name.clone();
    if !gpu.mig_profile.is_empty() {
        line.push_str(&format!(" (MIG {})", gpu.mig_profile));
    }
    if let Some(t) = telemetry {
        line.push_str(&format!(
            "  memory {:.1}/{:.1} GiB",
            gib(t.memory_used_bytes),
            gib(t.memory_total_bytes)
        ));
        if let Some(sm) = t.sm_utilization {
            line.push_str(&format!("  SM {:.0}%", sm * 100.0));
        }
        if let Some(c) = t.temperature_celsius {
            line.push_str(&format!("  {c:.0} C"));
        }
        if let Some(w) = t.power_watts {
            line.push_str(&format!("  {w:.0} W"));
        }
    } else {
        line.push_str(&format!("  memory {:.1} GiB", gib(gpu.memory_total_bytes)));
    }
    line
}

/// Logs go to stderr; `WRK_LOG` overrides the default filter (`info` for long-running services,
/// `warn` for one-shot commands).
fn init_tracing(default: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("WRK_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

fn main() -> Result<()> {
    return_freed_memory_promptly();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(run())
}

async fn run() -> Result<()> {
    let cli = Cli::parse();
    let service = matches!(
        cli.command,
        Command::Up { .. }
            | Command::Scheduler { .. }
            | Command::Worker(_)
            | Command::Operator { .. }
    );
    // One-shot commands report failures themselves; their embedded cluster only logs errors.
    init_tracing(if service {
        "info"
    } else {
        "error,wrk_cli=warn"
    });
    match cli.command {
        Command::Submit(args) => submit(args).await,
        Command::Up {
            cluster,
            listen,
            http_listen,
        } => up(cluster, listen, http_listen).await,
        Command::Scheduler {
            listen,
            http_listen,
            heartbeat_ms,
            worker_timeout_secs,
            tenants,
            worker_token,
            insecure_no_auth,
        } => {
            check_auth(listen, tenants.is_some(), insecure_no_auth)?;
            let tenants_file = tenants.clone();
            let tenants = match tenants {
                Some(path) => Some(Arc::new(wrk_scheduler::tenants::Tenants::load(&path)?)),
                None => {
                    tracing::warn!(
                        "no --tenants file: any client that can reach this scheduler may submit, watch and cancel jobs"
                    );
                    None
                }
            };
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("cannot listen on {listen}"))?;
            let http = wrk_cli::local::bind_with_fallback(http_listen).await?;
            eprintln!("wrk scheduler http on {}", http.local_addr()?);
            tracing::info!(
                "dashboard on http://{}/ (metrics at /metrics)",
                http.local_addr()?
            );
            eprintln!("wrk scheduler listening on {}", listener.local_addr()?);
            let config = SchedulerConfig {
                heartbeat_interval: Duration::from_millis(heartbeat_ms.max(10)),
                worker_timeout: Duration::from_secs_f64(worker_timeout_secs.max(0.1)),
                tenants,
                tenants_file,
                worker_token,
            };
            wrk_scheduler::serve(listener, Some(http), config, shutdown_signal()).await?;
            Ok(())
        }
        Command::Worker(args) => {
            let memory = size::resolve(args.memory_limit, args.pool_size, MachineMemory::detect()?)
                .context("the worker's memory settings (--memory-limit, --pool-size) do not fit")?;
            tracing::info!(
                "memory limit {}, pool {}",
                size::Bytes(memory.limit),
                size::Bytes(memory.pool)
            );
            let config = WorkerConfig {
                scheduler: args.scheduler,
                listen: args.listen,
                advertise_host: args.advertise_host,
                worker_id: args.id,
                slots: args.slots,
                engine: EngineConfig {
                    cache_dir: args.cache_dir.or_else(wrk_host::engine::default_cache_dir),
                    max_concurrent_tasks: args.slots,
                    default_task_memory: args.task_memory_mib << 20,
                    default_task_timeout: Duration::from_secs_f64(args.task_timeout_secs.max(0.01)),
                },
                connect_timeout: Duration::from_secs(30),
                metrics_listen: args.metrics_listen,
                token: args.token,
                shuffle_port: args.shuffle_port,
                transport: args.transport,
                ucx_part_threshold: args.ucx_part_threshold.map(|size| size.0 as usize),
                pool_bytes: memory.pool,
                spill_root: args.spill_dir.unwrap_or_else(spill::default_root),
                device: DeviceConfig {
                    request: args.device,
                    pool_bytes: device_pool_bytes(args.device_pool_size)?,
                },
                tags: args.tags,
            };
            wrk_host::worker::run_retirable(config, shutdown_signal(), terminated()).await?;
            Ok(())
        }
        Command::Status {
            scheduler,
            output,
            token,
        } => status(&scheduler, token.as_deref(), output).await,
        Command::Cancel {
            job_id,
            scheduler,
            token,
        } => {
            client::connect(&scheduler, token.as_deref())
                .await?
                .cancel_job(JobRef {
                    job_id: job_id.clone(),
                })
                .await
                .with_context(|| format!("cannot cancel job `{job_id}`"))?;
            println!("cancelled {job_id}");
            Ok(())
        }
        Command::Datasets { client } => {
            let list = datasets::list(&client.scheduler, client.token.as_deref()).await?;
            print!("{}", datasets::format_datasets(&list));
            Ok(())
        }
        Command::ReleaseDataset { name, client } => {
            datasets::release(&client.scheduler, client.token.as_deref(), &name).await?;
            println!("released dataset {name}");
            Ok(())
        }
        Command::Rebalance {
            name,
            client,
            timeout_secs,
        } => {
            let moves = datasets::rebalance(
                &client.scheduler,
                client.token.as_deref(),
                &name,
                Duration::from_secs_f64(timeout_secs.max(0.0)),
            )
            .await?;
            println!("rebalanced dataset {name}: {moves} partitions moved");
            Ok(())
        }
        Command::Retire {
            worker_id,
            client,
            timeout_secs,
        } => {
            let retired = datasets::retire(
                &client.scheduler,
                client.token.as_deref(),
                &worker_id,
                Duration::from_secs_f64(timeout_secs.max(0.0)),
            )
            .await?;
            println!(
                "retired worker {worker_id}: moved the outputs of {} tasks, waited for {} tasks",
                retired.moves, retired.running_tasks
            );
            Ok(())
        }
        Command::Run(args) => run_one(args).await,
        Command::Operator { command } => Ok(wrk_operator::cli::run(command).await?),
        Command::BenchReuse { rows, iterations } => {
            let (off, on) =
                tokio::task::spawn_blocking(move || wrk_cli::reuse::run(rows, iterations))
                    .await??;
            for (mode, f) in [("fresh buffers", off), ("reused buffers", on)] {
                println!(
                    "{mode:>15}: {:>8.3} ms per evaluation, {:>8.0} minor page faults per evaluation, {} blocks reused",
                    f.per_evaluation.as_secs_f64() * 1e3,
                    f.page_faults_per_evaluation,
                    f.reused_blocks
                );
            }
            println!(
                "reuse saves {:.1}% of the time on {rows} rows",
                100.0
                    * (1.0
                        - on.per_evaluation.as_secs_f64()
                            / off.per_evaluation.as_secs_f64().max(1e-12))
            );
            Ok(())
        }
        Command::GenTaxi {
            out,
            rows,
            files,
            row_group_rows,
            seed,
            drivers,
            dimensions,
        } => {
            let drivers = drivers.unwrap_or((rows / 4).max(1));
            let config = taxi::TaxiConfig {
                rows,
                files,
                row_group_rows,
                seed,
                drivers,
            };
            let started = std::time::Instant::now();
            tokio::task::spawn_blocking(move || {
                taxi::generate(&out, &config)?;
                match dimensions {
                    Some(dir) => taxi::generate_dimensions(&dir, drivers, seed),
                    None => Ok(()),
                }
            })
            .await??;
            eprintln!("wrote {rows} trips in {:.1?}", started.elapsed());
            Ok(())
        }
    }
}

async fn shutdown_signal() {
    let _ = tokio::signal::ctrl_c().await;
}

/// Completes on SIGTERM (what Kubernetes sends a pod it stops); never where it cannot be watched.
async fn terminated() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            term.recv().await;
        }
        Err(_) => std::future::pending::<()>().await,
    }
}

/// Authentication is on by default: a scheduler without tenants listens on loopback only,
/// unless told `--insecure-no-auth`.
fn check_auth(listen: SocketAddr, has_tenants: bool, insecure_no_auth: bool) -> Result<()> {
    if has_tenants || listen.ip().is_loopback() {
        return Ok(());
    }
    if insecure_no_auth {
        tracing::warn!(
            "--insecure-no-auth: serving {listen} without tenants; anyone who can reach it may run code on the workers"
        );
        return Ok(());
    }
    bail!(
        "refusing to listen on {listen} without authentication: give --tenants FILE (tenants and their tokens), listen on loopback (--listen 127.0.0.1:7070), or accept an open scheduler with --insecure-no-auth"
    )
}

async fn submit(args: SubmitArgs) -> Result<()> {
    let overrides = Overrides {
        params: args.params,
        sources: args.sources,
        sinks: args.sinks,
        module: args.module,
        persist: args.persist,
        priority: args.priority,
    };
    let job_path = args.job.clone();
    let job::Plan { spec, priority } =
        tokio::task::spawn_blocking(move || job::plan_job(&job_path, &overrides)).await??;
    let name = spec.name.clone();
    let persist = spec.persist.clone();
    let (url, cluster) = match args.scheduler {
        Some(url) => (url, None),
        None if !persist.is_empty() => bail!(
            "job `{name}` persists dataset `{persist}`, which needs a cluster that stays up: give --scheduler (see `wrk up`)"
        ),
        None => {
            let workers = args.cluster.workers.unwrap_or_else(default_workers);
            let timeout = wrk_cli::local::start_timeout(args.cluster.device);
            let cluster = LocalCluster::start(LocalClusterConfig {
                workers,
                slots_per_worker: args.cluster.slots,
                listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                cache_dir: args
                    .cluster
                    .cache_dir
                    .or_else(wrk_host::engine::default_cache_dir),
                http: None,
                pool: args.cluster.pool_size,
                spill_root: args.cluster.spill_dir,
                device: args.cluster.device,
            })
            .await?;
            cluster.wait_for_workers(workers, timeout).await?;
            (cluster.scheduler_url.clone(), Some(cluster))
        }
    };
    let outcome = client::run_job_with_report(
        &url,
        args.token.as_deref(),
        spec,
        priority,
        !args.quiet,
        args.report.as_deref(),
    )
    .await;
    if let Some(cluster) = cluster {
        cluster.shutdown().await;
    }
    let outcome = outcome?;
    let seconds = outcome.elapsed.as_secs_f64();
    eprintln!(
        "job `{name}` ({}) succeeded: {} tasks in {seconds:.3} s ({:.0} tasks/s)",
        outcome.job_id,
        outcome.tasks,
        outcome.tasks as f64 / seconds.max(1e-9)
    );
    if let Some(path) = &args.report {
        eprintln!("wrote the performance report to {}", path.display());
    }
    if !persist.is_empty() {
        let dataset = datasets::find(&url, args.token.as_deref(), &persist).await?;
        eprintln!(
            "persisted dataset `{persist}`: {} partitions, {} rows, {} bytes on {} workers",
            dataset.partitions,
            dataset.rows,
            dataset.bytes,
            dataset.workers.len()
        );
        return Ok(());
    }
    let Some(batch) = output::combine(&outcome.tables)? else {
        eprintln!("the job returned no tables");
        return Ok(());
    };
    match args.output {
        Some(path) => {
            output::write_parquet(&path, &batch)?;
            eprintln!("wrote {} rows to {}", batch.num_rows(), path.display());
        }
        None => output::print(&batch, args.max_rows)?,
    }
    Ok(())
}

async fn up(cluster: ClusterArgs, listen: SocketAddr, http_listen: SocketAddr) -> Result<()> {
    let workers = cluster.workers.unwrap_or_else(default_workers);
    let timeout = wrk_cli::local::start_timeout(cluster.device);
    let local = LocalCluster::start(LocalClusterConfig {
        workers,
        slots_per_worker: cluster.slots,
        listen,
        cache_dir: cluster
            .cache_dir
            .or_else(wrk_host::engine::default_cache_dir),
        http: Some(http_listen),
        pool: cluster.pool_size,
        spill_root: cluster.spill_dir,
        device: cluster.device,
    })
    .await?;
    local.wait_for_workers(workers, timeout).await?;
    eprintln!(
        "wrk local cluster up: scheduler {} with {workers} workers, dashboard on {}/ (metrics at /metrics); Ctrl-C stops it",
        local.scheduler_url,
        local.http_url.as_deref().unwrap_or("(none)")
    );
    shutdown_signal().await;
    local.shutdown().await;
    Ok(())
}

async fn status(url: &str, token: Option<&str>, format: StatusFormat) -> Result<()> {
    let mut client = client::connect(url, token).await?;
    let status = client
        .get_cluster_status(wrk_proto::Empty {})
        .await?
        .into_inner();
    let advice = client
        .get_scaling_advice(wrk_proto::ScalingRequest {
            target_duration_ms: 0,
        })
        .await?
        .into_inner();
    let job_state = |state: i32| JobState::try_from(state).unwrap_or(JobState::Unspecified);
    if let StatusFormat::Json = format {
        let workers: Vec<serde_json::Value> = status
            .workers
            .iter()
            .map(|w| {
                serde_json::json!({
                    "id": w.worker_id,
                    "data_address": w.data_address,
                    "http_address": w.http_address,
                    "device": w.device,
                    "slots": w.slots,
                    "assigned_tasks": w.running_tasks,
                    "partitions": w.partitions,
                    "memory_used_bytes": w.pool_used_bytes,
                    "pool_bytes": w.pool_bytes,
                    "pool": {
                        "size_bytes": w.pool_bytes,
                        "used_bytes": w.pool_used_bytes,
                        "peak_bytes": w.pool_peak_bytes,
                        "spilled_bytes": w.spilled_bytes,
                        "spilled_partitions": w.spilled_partitions,
                        "spills": w.spill_count,
                        "unspills": w.unspill_count,
                    },
                    "gpu": w.gpu.as_ref().map(|g| gpu_json(g, w.gpu_telemetry.as_ref())),
                    "tags": w.tags,
                })
            })
            .collect();
        let jobs: Vec<serde_json::Value> = status
            .jobs
            .iter()
            .map(|j| {
                let state = job_state(j.state)
                    .as_str_name()
                    .trim_start_matches("JOB_STATE_")
                    .to_lowercase();
                serde_json::json!({
                    "id": j.job_id,
                    "name": j.name,
                    "state": state,
                    "priority": j.priority,
                    "waiting": j.waiting,
                })
            })
            .collect();
        let document = serde_json::json!({
            "workers": workers,
            "jobs": jobs,
            "scaling": {
                "current_workers": advice.current_workers,
                "desired_workers": advice.desired_workers,
                "retirable_workers": advice.retirable_workers,
                "backlog_tasks": advice.backlog_tasks,
                "backlog_seconds": advice.backlog_seconds,
            },
        });
        println!("{}", serde_json::to_string_pretty(&document)?);
        return Ok(());
    }
    println!("workers: {}", status.workers.len());
    for w in &status.workers {
        let mib = |bytes: u64| bytes as f64 / (1 << 20) as f64;
        println!(
            "  {:<24} {:<28} {:<6} tasks {}/{}  partitions {}  pool {:.1}/{:.1} MiB (peak {:.1})  spilled {:.1} MiB in {} partitions ({} out, {} back)  {}",
            w.worker_id,
            w.data_address,
            w.device,
            w.running_tasks,
            w.slots,
            w.partitions,
            mib(w.pool_used_bytes),
            mib(w.pool_bytes),
            mib(w.pool_peak_bytes),
            mib(w.spilled_bytes),
            w.spilled_partitions,
            w.spill_count,
            w.unspill_count,
            if w.http_address.is_empty() {
                String::new()
            } else {
                format!("metrics {}/metrics", w.http_address)
            }
        );
        if let Some(gpu) = &w.gpu {
            println!("    {}", gpu_line(gpu, w.gpu_telemetry.as_ref()));
        }
        println!("    tags: {}", w.tags.join(", "));
    }
    println!(
        "scaling: backlog {} tasks (~{:.1} task-seconds); {} workers wanted to finish it within 60 s; retirable: {}",
        advice.backlog_tasks,
        advice.backlog_seconds,
        advice.desired_workers,
        if advice.retirable_workers.is_empty() {
            "none".to_string()
        } else {
            advice.retirable_workers.join(", ")
        }
    );
    println!("jobs: {}", status.jobs.len());
    for j in &status.jobs {
        println!(
            "  {:<12} {:<24} {}{}",
            j.job_id,
            j.name,
            job_state(j.state).as_str_name(),
            if j.priority == 0 {
                String::new()
            } else {
                format!("  priority {}", j.priority)
            }
        );
        if !j.waiting.is_empty() {
            println!("    {}", j.waiting);
        }
    }
    Ok(())
}

async fn run_one(args: RunArgs) -> Result<()> {
    let wasm = std::fs::read(&args.module)
        .with_context(|| format!("cannot read module `{}`", args.module.display()))?;
    let name = args
        .module
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| args.module.display().to_string());
    let inputs = args.inputs.clone();
    let engine = Arc::new(TaskEngine::new(EngineConfig::default())?);
    let device = DeviceConfig {
        request: args.device,
        pool_bytes: device_pool_bytes(args.device_pool_size)?,
    };
    // Starting a GPU compiles its kernels and runs the self-test: off the async threads.
    let gpu = tokio::task::spawn_blocking(move || {
        let mut metrics = WorkerMetrics::new(compile_cache_counter());
        WorkerDevice::start(&device, &mut metrics).map(|device| device.runtime())
    })
    .await??;
    let activity_before = gpu.as_deref().map(DeviceActivity::of);
    let limits = TaskLimits {
        memory_bytes: args.task_memory_mib << 20,
        timeout: Duration::from_secs_f64(args.task_timeout_secs.max(0.01)),
    };
    let info = Arc::new(TaskInfo {
        job_id: "local".into(),
        job_name: "run".into(),
        stage_name: args.stage.clone(),
        task_index: 0,
        task_count: 1,
        params: args.params.into_iter().collect(),
        sources: args.sources.into_iter().collect(),
        sinks: args.sinks.into_iter().collect(),
        module_name: name.clone(),
        shuffle: None,
        gpu: gpu.clone(),
    });
    let pool = size::resolve(None, None, MachineMemory::detect()?)?.pool;
    let spill = SpillDir::open(
        &spill::default_root(),
        &format!("run-{}", std::process::id()),
    )?;
    let store = Arc::new(PartitionStore::new(pool, spill));
    let run = tokio::task::spawn_blocking(move || -> Result<_> {
        let tables = inputs
            .iter()
            .map(|path| {
                wrk_host::io::read_source(&path.to_string_lossy(), &[], None, None).map(Table::new)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let compiled = engine.prepare(&name, &module_hash(&wasm), &wasm)?;
        let never_cancelled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let memory = store.begin_task("run");
        for table in &tables {
            memory.track(table.batch())?;
        }
        let inputs = tables.into_iter().map(TaskTable::from).collect();
        Ok(engine.run(&compiled, info, inputs, limits, never_cancelled, memory)?)
    })
    .await??;
    // Outputs left on the device come down here (counted); host ones are not copied.
    let outputs = run
        .outputs
        .iter()
        .map(TaskTable::host)
        .collect::<Result<Vec<Table>, _>>()?;
    eprintln!(
        "task finished in {:.1?} (instantiation {:.1?}); {} output table(s)",
        run.duration,
        run.instantiate,
        run.outputs.len()
    );
    if let (Some(gpu), Some(before)) = (&gpu, activity_before) {
        eprintln!(
            "on GPU {} ({}): {}",
            gpu.device.ordinal,
            gpu.device.name,
            DeviceActivity::of(gpu).since(&before)
        );
    }
    match (args.output, outputs.first()) {
        (Some(path), Some(first)) => {
            output::write_parquet(&path, first.batch())?;
            eprintln!("wrote {} rows to {}", first.num_rows(), path.display());
        }
        _ => {
            for table in &outputs {
                output::print(table.batch(), args.max_rows)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scheduler_without_tenants_listens_on_loopback_unless_told_otherwise() {
        let loopback: SocketAddr = "127.0.0.1:7070".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:7070".parse().unwrap();
        let v6: SocketAddr = "[::]:7070".parse().unwrap();
        assert!(check_auth(loopback, false, false).is_ok());
        assert!(check_auth(any, true, false).is_ok());
        assert!(check_auth(any, false, true).is_ok());
        for open in [any, v6] {
            let error = check_auth(open, false, false).unwrap_err().to_string();
            assert!(
                error.contains(&format!(
                    "refusing to listen on {open} without authentication"
                )) && error.contains("--insecure-no-auth"),
                "{error}"
            );
        }
    }

    #[test]
    fn the_device_flag_and_its_environment_variable_parse() {
        let cli = Cli::try_parse_from([
            "wrk",
            "worker",
            "--device",
            "gpu:1",
            "--device-pool-size",
            "2GiB",
        ])
        .unwrap();
        let Command::Worker(args) = cli.command else {
            panic!("not a worker command");
        };
        assert_eq!(args.device, DeviceRequest::Gpu(1));
        assert_eq!(
            device_pool_bytes(args.device_pool_size).unwrap(),
            Some(2 << 30)
        );
        let err = Cli::try_parse_from(["wrk", "worker", "--device", "tpu"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("expected `cpu`, `gpu:N`"), "{err}");
    }
}

//! The worker process: it serves its partitions to peers, attaches to the scheduler, registers,
//! heartbeats, and runs the tasks it is assigned, keeping their outputs in its partition store.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint, Server};
use wrk_proto::auth::{AuthChannel, BearerToken};
use wrk_proto::scheduler_client::SchedulerClient;
use wrk_proto::scheduler_message::Kind as FromScheduler;
use wrk_proto::task_input::Kind as InputKind;
use wrk_proto::worker_message::Kind as ToScheduler;
use wrk_proto::worker_server::WorkerServer;
use wrk_proto::{
    AssignTask, FetchPartitions, GetModuleRequest, Heartbeat, MAX_MESSAGE_BYTES, OutputMeta,
    PartitionsFetched, Register, RetireRequest, Retracted, TaskDone, TaskFailed, TaskId,
    TaskReports, TaskStats, WorkerMessage,
};

use crate::device::{DeviceConfig, DeviceError, WorkerDevice};
use crate::engine::{CompiledTask, EngineConfig, EngineError, TaskEngine, TaskLimits};
use crate::gpu::GpuRuntime;
use crate::gpu::resident::ResidentTable;
use crate::guest_api::{TaskInfo, TaskTable, WIT_VERSION};
use crate::memory::spill::{SpillDir, SpillError};
use crate::metrics::WorkerMetrics;
use crate::shuffle::pieces::PieceStore;
use crate::shuffle::tcp::TcpReceiver;
use crate::shuffle::{ShuffleService, TaskShuffle, TransportChoice, UcxUnavailable};
use crate::store::{PartitionId, PartitionStore, PoolError, StoreStats, TaskMemory};
use crate::table::Table;
use crate::transfer::{DataService, PeerClient};

mod attempts;
mod outbox;
mod slots;

use attempts::Attempts;
use outbox::Coalesced;
use slots::SlotQueue;

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The scheduler's gRPC address, e.g. `http://127.0.0.1:7070`.
    pub scheduler: String,
    /// Where the data service listens; port 0 picks a free one.
    pub listen: SocketAddr,
    /// The host peers use to reach this worker; defaults to the listen address's IP.
    pub advertise_host: Option<String>,
    pub worker_id: Option<String>,
    /// Tasks run at once.
    pub slots: u32,
    pub engine: EngineConfig,
    /// How long to keep trying to reach the scheduler at start.
    pub connect_timeout: Duration,
    /// Where to serve `/metrics` (Prometheus) and `/healthz`; `None` serves no HTTP.
    pub metrics_listen: Option<SocketAddr>,
    /// The worker token the scheduler requires, if any.
    pub token: Option<String>,
    /// The port receiving shuffle pieces (on the listen address's IP); 0 picks a free one.
    pub shuffle_port: u16,
    /// The transport between workers for shuffles.
    pub transport: TransportChoice,
    /// Over UCX, send each Arrow buffer of at least this many bytes as its own rendezvous
    /// (single copy) instead of the whole push as one I/O vector (see `docs/shuffle.md`).
    pub ucx_part_threshold: Option<usize>,
    /// Size of the worker's memory pool (see `crate::memory::size` for choosing it).
    pub pool_bytes: u64,
    /// Where the worker spills partitions: its own directory under this root.
    pub spill_root: PathBuf,
    /// The device to drive (`--device`) and its pool size.
    pub device: DeviceConfig,
    /// Tags offered to stages that require them (`--tags`); the scheduler adds the automatic
    /// ones (`gpu` and the GPU's model and MIG profile, or `cpu`).
    pub tags: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error("cannot listen on {address}: {source}")]
    Listen {
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot reach the scheduler at {address} (gave up after {waited:?}): {detail}")]
    Connect {
        address: String,
        waited: Duration,
        detail: String,
    },
    #[error("the scheduler at {address} refused worker {worker_id}: {detail}")]
    Rejected {
        address: String,
        worker_id: String,
        detail: String,
    },
    #[error(transparent)]
    Spill(#[from] SpillError),
    #[error("lost the connection to the scheduler at {address}: {detail}")]
    SchedulerGone { address: String, detail: String },
    #[error(transparent)]
    Transport(#[from] UcxUnavailable),
    #[error("cannot start the threads of the worker's slots: {0}")]
    Slots(std::io::Error),
}

/// A broadcast table, fetched once per worker and shared by the tasks that read it (on a GPU
/// worker, uploaded once to the device).
type BroadcastCell = Arc<tokio::sync::OnceCell<TaskTable>>;

/// What every task of this worker shares.
struct Shared {
    worker_id: String,
    engine: TaskEngine,
    store: Arc<PartitionStore>,
    shuffle: Arc<ShuffleService>,
    /// Broadcast tables by job and input stage.
    broadcasts: std::sync::Mutex<HashMap<(String, u32), BroadcastCell>>,
    peers: PeerClient,
    scheduler: SchedulerClient<AuthChannel>,
    outbox: mpsc::Sender<WorkerMessage>,
    metrics: WorkerMetrics,
    /// The attempts assigned here: their cancel flags, and which still wait for a slot.
    attempts: Attempts,
    /// Tasks assigned here, waiting for a slot's thread (the scheduler may queue more tasks
    /// here than run at once).
    queue: SlotQueue<Assigned>,
    running: std::sync::atomic::AtomicU32,
    /// The GPU the tasks' operators run on, if the worker has one.
    gpu: Option<Arc<GpuRuntime>>,
}

/// A task assigned to this worker and the flag that cancels it.
struct Assigned {
    task: AssignTask,
    cancel: Arc<AtomicBool>,
}

/// A task failure, and whether another attempt might succeed.
struct Failure {
    message: String,
    retriable: bool,
}

impl Failure {
    fn fatal(message: impl ToString) -> Self {
        Failure {
            message: message.to_string(),
            retriable: false,
        }
    }

    fn retriable(message: impl ToString) -> Self {
        Failure {
            message: message.to_string(),
            retriable: true,
        }
    }
}

/// Runs a worker until `shutdown` resolves or the scheduler goes away.
pub async fn run(
    config: WorkerConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), WorkerError> {
    run_retirable(config, shutdown, std::future::pending()).await
}

/// [`run`], asking the scheduler to retire the worker when `retire` resolves (SIGTERM): it
/// moves the worker's data to other workers and lets its tasks finish, then tells it to exit,
/// and this returns `Ok`.
pub async fn run_retirable(
    config: WorkerConfig,
    shutdown: impl Future<Output = ()>,
    retire: impl Future<Output = ()>,
) -> Result<(), WorkerError> {
    let worker_id = config.worker_id.clone().unwrap_or_else(default_worker_id);
    let engine = TaskEngine::new(config.engine.clone())?;
    let spill = SpillDir::open(&config.spill_root, &worker_id)?;
    // Up to an eighth of the pool may be free blocks kept for operators to reuse.
    let buffers = crate::memory::buffers::global();
    buffers.set_limit(config.pool_bytes / 8);
    let store =
        Arc::new(PartitionStore::new(config.pool_bytes, spill).with_buffers(buffers.clone()));
    let mut metrics = WorkerMetrics::new(engine.cache_outcomes());
    metrics.slots.set(i64::from(config.slots.max(1)));
    // First, so that a worker asked for a GPU it cannot have fails before it listens anywhere.
    let device = WorkerDevice::start(&config.device, &mut metrics)?;

    let listener =
        TcpListener::bind(config.listen)
            .await
            .map_err(|source| WorkerError::Listen {
                address: config.listen,
                source,
            })?;
    let local = listener
        .local_addr()
        .map_err(|source| WorkerError::Listen {
            address: config.listen,
            source,
        })?;
    let host = config
        .advertise_host
        .clone()
        .unwrap_or_else(|| advertise_ip(local));
    let data_address = format!("http://{host}:{}", local.port());
    let (stop_data, data_stopped) = tokio::sync::oneshot::channel::<()>();
    let data_service = WorkerServer::new(DataService::new(
        worker_id.clone(),
        store.clone(),
        metrics.clone(),
        config.token.as_ref().map(|t| t.as_bytes().to_vec()),
    ))
    .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let data_server = tokio::spawn(
        Server::builder()
            .add_service(data_service)
            // Without TCP_NODELAY a small HTTP/2 frame can wait ~40 ms for a delayed ACK.
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                async {
                    let _ = data_stopped.await;
                },
            ),
    );

    let shuffle_listen = SocketAddr::new(config.listen.ip(), config.shuffle_port);
    let shuffle_listener =
        TcpListener::bind(shuffle_listen)
            .await
            .map_err(|source| WorkerError::Listen {
                address: shuffle_listen,
                source,
            })?;
    let shuffle_port = shuffle_listener
        .local_addr()
        .map_err(|source| WorkerError::Listen {
            address: shuffle_listen,
            source,
        })?
        .port();
    let secret = config.token.as_ref().map(|t| t.as_bytes().to_vec());
    let pieces = Arc::new(PieceStore::new(store.clone()));
    let shuffle_server = tokio::spawn(
        Arc::new(TcpReceiver {
            store: pieces.clone(),
            secret: secret.clone(),
            metrics: metrics.clone(),
        })
        .serve(shuffle_listener),
    );
    let shuffle = Arc::new(ShuffleService::start(
        worker_id.clone(),
        pieces,
        secret,
        metrics.clone(),
        config.transport,
        config.ucx_part_threshold,
    )?);

    let (metrics_server, http_address) = match config.metrics_listen {
        Some(address) => {
            let (server, bound) = serve_metrics(address, metrics.clone(), store.clone()).await?;
            let host = config
                .advertise_host
                .clone()
                .unwrap_or_else(|| advertise_ip(bound));
            (Some(server), format!("http://{host}:{}", bound.port()))
        }
        None => (None, String::new()),
    };
    let channel = connect_with_retry(&config.scheduler, config.connect_timeout).await?;
    let token = BearerToken::new(config.token.as_deref()).map_err(|e| WorkerError::Connect {
        address: config.scheduler.clone(),
        waited: Duration::ZERO,
        detail: format!("invalid worker token: {e}"),
    })?;
    let mut scheduler = SchedulerClient::with_interceptor(channel, token)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let (outbox, outgoing) = mpsc::channel::<WorkerMessage>(4096);
    let register = Register {
        worker_id: worker_id.clone(),
        data_address: data_address.clone(),
        slots: config.slots.max(1),
        device: device.name(),
        pool_bytes: config.pool_bytes,
        wit_version: WIT_VERSION.into(),
        http_address,
        shuffle_address: format!("{host}:{shuffle_port}"),
        ucx_address: shuffle.ucx_address(),
        gpu: device.gpu_info(),
        tags: config.tags.clone(),
    };
    let _ = outbox
        .send(WorkerMessage {
            kind: Some(ToScheduler::Register(register)),
        })
        .await;
    let gone = |detail: String| WorkerError::SchedulerGone {
        address: config.scheduler.clone(),
        detail,
    };
    let mut inbound = scheduler
        .attach(Coalesced::new(outgoing))
        .await
        .map_err(|status| WorkerError::Rejected {
            address: config.scheduler.clone(),
            worker_id: worker_id.clone(),
            detail: status.message().to_string(),
        })?
        .into_inner();
    let heartbeat_every = match inbound.message().await {
        Ok(Some(message)) => match message.kind {
            Some(FromScheduler::Registered(registered)) => {
                Duration::from_millis(registered.heartbeat_interval_ms.max(50))
            }
            other => {
                return Err(gone(format!(
                    "expected a registration answer, got {other:?}"
                )));
            }
        },
        Ok(None) => return Err(gone("the scheduler closed the channel".into())),
        Err(status) => {
            return Err(WorkerError::Rejected {
                address: config.scheduler.clone(),
                worker_id,
                detail: status.message().to_string(),
            });
        }
    };
    tracing::info!(worker = %worker_id, data = %data_address, slots = config.slots, device = %device.name(), "worker registered with {}", config.scheduler);

    let shared = Arc::new(Shared {
        worker_id: worker_id.clone(),
        engine,
        store,
        shuffle,
        broadcasts: Default::default(),
        peers: PeerClient::with_metrics(metrics.clone()),
        metrics,
        scheduler,
        outbox: outbox.clone(),
        attempts: Attempts::default(),
        queue: SlotQueue::default(),
        running: Default::default(),
        gpu: device.runtime(),
    });
    let runtime = tokio::runtime::Handle::current();
    for slot in 0..config.slots.max(1) {
        let (shared, runtime) = (shared.clone(), runtime.clone());
        std::thread::Builder::new()
            .name(format!("wrk-slot-{slot}"))
            .spawn(move || {
                while let Some(assigned) = shared.queue.pop() {
                    run_assigned(&shared, &runtime, assigned);
                }
            })
            .map_err(WorkerError::Slots)?;
    }
    let mut heartbeat = tokio::time::interval(heartbeat_every);
    tokio::pin!(shutdown);
    tokio::pin!(retire);
    let mut retire_asked = false;
    let result = loop {
        tokio::select! {
            _ = &mut shutdown => break Ok(()),
            _ = &mut retire, if !retire_asked => {
                retire_asked = true;
                tracing::info!(worker = %worker_id, "asked to stop: asking the scheduler to retire this worker first");
                let request = RetireRequest { reason: "the worker was asked to stop".into() };
                let _ = outbox.send(WorkerMessage { kind: Some(ToScheduler::Retire(request)) }).await;
            }
            _ = heartbeat.tick() => {
                let beat = Heartbeat {
                    gpu: device.sample().await,
                    transfer_bytes_per_second: shared.peers.transfer_bytes_per_second(),
                    ..heartbeat_of(
                        &shared.store.stats(),
                        shared.running.load(std::sync::atomic::Ordering::Relaxed),
                    )
                };
                let _ = outbox.send(WorkerMessage { kind: Some(ToScheduler::Heartbeat(beat)) }).await;
            }
            message = inbound.message() => match message {
                Ok(Some(message)) => match message.kind {
                    Some(FromScheduler::Assign(assign)) => {
                        // Registered here, in message order, so a cancel that follows the
                        // assignment always finds the task.
                        let assigned: Vec<Assigned> = assign.tasks.into_iter().map(|task| {
                            let cancel = shared.attempts.register(&task.task.clone().unwrap_or_default());
                            Assigned { task, cancel }
                        }).collect();
                        shared.queue.push(assigned);
                    }
                    Some(FromScheduler::Release(release)) => {
                        shared.attempts.cancel_where(|job, _, _| job == release.job_id);
                        let dropped = shared.store.release_job(&release.job_id);
                        let exchanges = shared.shuffle.store().release_job(&release.job_id);
                        if let Ok(mut broadcasts) = shared.broadcasts.lock() {
                            broadcasts.retain(|(job, _), _| *job != release.job_id);
                        }
                        // Join indexes on the job's broadcast tables go with them.
                        let mut indexes = shared.store.build_cache().purge_dropped();
                        if let Some(gpu) = &shared.gpu {
                            indexes += gpu.join_indexes.purge_dropped();
                        }
                        tracing::debug!(job = %release.job_id, dropped, exchanges, indexes, "released job partitions");
                    }
                    Some(FromScheduler::ReleaseTasks(release)) => {
                        for task in &release.tasks {
                            shared.store.release_task(&release.job_id, task.stage, task.index);
                        }
                    }
                    Some(FromScheduler::Retract(retract)) => {
                        if let Some(task) = retract.task {
                            let dropped = shared.attempts.retract(&task);
                            tracing::debug!(task = %task, dropped, "retract requested");
                            let _ = outbox.send(WorkerMessage {
                                kind: Some(ToScheduler::Retracted(Retracted { task: Some(task), dropped })),
                            }).await;
                        }
                    }
                    Some(FromScheduler::Cancel(cancel)) => {
                        if let Some(task) = cancel.task {
                            shared.attempts.cancel_where(|job, stage, index| job == task.job_id && stage == task.stage && index == task.index);
                        }
                    }
                    Some(FromScheduler::Fetch(fetch)) => {
                        let shared = shared.clone();
                        tokio::spawn(async move { fetch_partitions(shared, fetch).await });
                    }
                    Some(FromScheduler::Shutdown(shutdown)) => {
                        if shutdown.retired {
                            tracing::info!(worker = %worker_id, "retired: the scheduler moved this worker's data away; exiting");
                        } else {
                            tracing::warn!(worker = %worker_id, "the scheduler tells this worker to exit without retiring it: {}", shutdown.reason);
                        }
                        break Ok(());
                    }
                    Some(FromScheduler::Registered(_)) | None => {}
                },
                Ok(None) => break Err(gone("the scheduler closed the channel".into())),
                Err(status) => break Err(gone(status.message().to_string())),
            },
        }
    };
    // The slots' threads end with the queue; a guest still running is stopped (its outcome has
    // nowhere to go).
    shared.queue.close();
    shared.attempts.cancel_where(|_, _, _| true);
    let _ = stop_data.send(());
    let _ = data_server.await;
    shuffle_server.abort();
    if let Some(server) = metrics_server {
        server.abort();
    }
    result
}

/// Serves `/metrics` and `/healthz` on `address` until aborted.
async fn serve_metrics(
    address: SocketAddr,
    metrics: WorkerMetrics,
    store: Arc<PartitionStore>,
) -> Result<(tokio::task::JoinHandle<()>, SocketAddr), WorkerError> {
    let listener = TcpListener::bind(address)
        .await
        .map_err(|source| WorkerError::Listen { address, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| WorkerError::Listen { address, source })?;
    let router = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let (metrics, store) = (metrics.clone(), store.clone());
                async move {
                    let stats = store.stats();
                    metrics.partitions.set(stats.partitions as i64);
                    metrics.partition_bytes.set(stats.bytes as i64);
                    metrics
                        .spilled_partitions
                        .set(stats.spilled_partitions as i64);
                    metrics.shuffle_pieces.set(stats.pieces as i64);
                    metrics.observe_pool(&stats.pool);
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        metrics.render(),
                    )
                }
            }),
        )
        .route("/healthz", axum::routing::get(|| async { "ok\n" }));
    tracing::info!("worker metrics on http://{bound}/metrics");
    let server = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::warn!("worker metrics server stopped: {e}");
        }
    });
    Ok((server, bound))
}

/// What a heartbeat tells the scheduler about this worker's store (its device's telemetry and
/// fetch rate apart).
fn heartbeat_of(stats: &StoreStats, running_tasks: u32) -> Heartbeat {
    Heartbeat {
        gpu: None,
        transfer_bytes_per_second: None,
        pool_used_bytes: stats.pool.used,
        running_tasks,
        partitions: stats.partitions,
        pool_bytes: stats.pool.size,
        pool_peak_bytes: stats.pool.peak,
        spilled_bytes: stats.pool.spilled_host + stats.pool.spilled_disk,
        spilled_partitions: stats.spilled_partitions,
        spill_count: stats.pool.spills,
        unspill_count: stats.pool.unspills,
    }
}

fn default_worker_id() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "worker".into());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{host}-{}-{nanos:08x}", std::process::id())
}

fn advertise_ip(local: SocketAddr) -> String {
    let ip = local.ip();
    if ip.is_unspecified() {
        "127.0.0.1".to_string()
    } else if ip.is_ipv6() {
        format!("[{ip}]")
    } else {
        ip.to_string()
    }
}

async fn connect_with_retry(address: &str, timeout: Duration) -> Result<Channel, WorkerError> {
    let started = Instant::now();
    let fail = |detail: String| WorkerError::Connect {
        address: address.to_string(),
        waited: started.elapsed(),
        detail,
    };
    let endpoint = Endpoint::from_shared(address.to_string()).map_err(|e| fail(e.to_string()))?;
    loop {
        match endpoint.connect().await {
            Ok(channel) => return Ok(channel),
            Err(e) if started.elapsed() >= timeout => return Err(fail(e.to_string())),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Runs one assigned task on a slot's thread, unless it was retracted meanwhile, and reports
/// its outcome to the scheduler.
fn run_assigned(shared: &Arc<Shared>, runtime: &tokio::runtime::Handle, assigned: Assigned) {
    use std::sync::atomic::Ordering;
    let Assigned { task, cancel } = assigned;
    let id = task.task.clone().unwrap_or_default();
    if !shared.attempts.begin(&id) {
        // Retracted while queued: the scheduler gave it to another worker.
        return;
    }
    shared.running.fetch_add(1, Ordering::Relaxed);
    shared.metrics.running_tasks.inc();
    tracing::debug!(worker = %shared.worker_id, task = %id, stage = %task.stage_name, "task started");
    let started = Instant::now();
    let outcome = if cancel.load(Ordering::Relaxed) {
        Err(Failure::fatal("the task was cancelled before it started"))
    } else {
        execute(shared, runtime, task, cancel)
    };
    shared.attempts.finish(&id);
    shared.metrics.running_tasks.dec();
    shared.running.fetch_sub(1, Ordering::Relaxed);
    if outcome.is_ok() {
        shared.metrics.tasks_succeeded.inc();
    } else {
        shared.metrics.tasks_failed.inc();
    }
    let mut report = TaskReports::default();
    match outcome {
        Ok((outputs, stats)) => {
            let metas = outputs
                .iter()
                .map(|t| OutputMeta {
                    rows: t.num_rows() as u64,
                    bytes: t.memory_bytes(),
                })
                .collect();
            for (index, table) in outputs.into_iter().enumerate() {
                let partition = PartitionId {
                    job_id: id.job_id.clone(),
                    stage: id.stage,
                    task: id.index,
                    output: index as u32,
                };
                shared.store.insert(partition, table);
            }
            report.done.push(TaskDone {
                task: Some(id),
                outputs: metas,
                stats: Some(stats),
            });
        }
        Err(failure) => {
            tracing::warn!(worker = %shared.worker_id, task = %id, "task failed: {}", failure.message);
            report.failed.push(TaskFailed {
                task: Some(id),
                error: failure.message,
                retriable: failure.retriable,
                duration_us: started.elapsed().as_micros() as u64,
            });
        }
    }
    // Reports waiting in the outbox go out together (see `outbox`). A slot's thread is no
    // async context: it waits for room in the outbox only when it is full.
    let message = WorkerMessage {
        kind: Some(ToScheduler::Reports(report)),
    };
    if let Err(mpsc::error::TrySendError::Full(message)) = shared.outbox.try_send(message) {
        let _ = shared.outbox.blocking_send(message);
    }
}

/// What a task needs before its guest runs: the compiled component, its memory account, its
/// inputs and its shuffle exchanges.
struct Prepared {
    compiled: Arc<CompiledTask>,
    memory: Arc<TaskMemory>,
    inputs: Vec<TaskTable>,
    shuffle: Option<Arc<TaskShuffle>>,
}

/// Fetches (or compiles) the component and loads the inputs; from a slot's thread, through the
/// runtime (immediate when the component is cached and the task has no inputs).
async fn prepare(
    shared: &Arc<Shared>,
    task: &AssignTask,
    id: &TaskId,
) -> Result<Prepared, Failure> {
    let compiled = compiled_module(shared, task).await?;
    let memory = shared
        .store
        .begin_task(format!("{}/{}/{}", id.job_id, id.stage, id.index));
    let mut inputs = Vec::with_capacity(task.inputs.len());
    for input in &task.inputs {
        inputs.push(load_input(shared, input, &memory).await?);
    }
    let shuffle = if task.sends.is_empty() && task.receives.is_empty() {
        None
    } else {
        let shuffle = Arc::new(TaskShuffle::new(
            shared.shuffle.clone(),
            tokio::runtime::Handle::current(),
            id,
            task.sends.clone(),
            task.receives.clone(),
        ));
        shuffle.check_inputs().map_err(Failure::retriable)?;
        Some(shuffle)
    };
    Ok(Prepared {
        compiled,
        memory,
        inputs,
        shuffle,
    })
}

/// Runs `future` to its end on a slot's thread. It is polled once in the runtime's context
/// first, which is all most preparations need (the component cached, no inputs to fetch), without
/// entering the runtime the way `block_on` does (a lock shared by the slots to seed the entered
/// runtime's random numbers, the blocking region); a future not done then goes to `block_on`,
/// whose polls pass it a real waker.
fn complete<F: Future>(runtime: &tokio::runtime::Handle, future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    {
        let _context = runtime.enter();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if let std::task::Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
    }
    runtime.block_on(future)
}

/// Prepares and runs one task attempt on the calling slot's thread.
fn execute(
    shared: &Arc<Shared>,
    runtime: &tokio::runtime::Handle,
    task: AssignTask,
    cancel: Arc<AtomicBool>,
) -> Result<(Vec<TaskTable>, TaskStats), Failure> {
    let started = Instant::now();
    let id = task.task.clone().unwrap_or_default();
    let Prepared {
        compiled,
        memory,
        inputs,
        shuffle,
    } = complete(runtime, prepare(shared, &task, &id))?;
    let prepare = started.elapsed();
    let input_rows: u64 = inputs.iter().map(|t| t.num_rows() as u64).sum();
    let grants =
        |g: &std::collections::HashMap<String, wrk_proto::Grant>| -> BTreeMap<String, String> {
            g.iter().map(|(k, v)| (k.clone(), v.uri.clone())).collect()
        };
    let defaults = shared.engine.config();
    let limits = task.limits.unwrap_or_default();
    let limits = TaskLimits {
        memory_bytes: if limits.task_memory_bytes > 0 {
            limits.task_memory_bytes
        } else {
            defaults.default_task_memory
        },
        timeout: if limits.task_timeout_ms > 0 {
            Duration::from_millis(limits.task_timeout_ms)
        } else {
            defaults.default_task_timeout
        },
    };
    let info = Arc::new(TaskInfo {
        job_id: id.job_id,
        job_name: task.job_name,
        stage_name: task.stage_name,
        task_index: id.index,
        task_count: task.task_count,
        params: task.params.into_iter().collect(),
        sources: grants(&task.sources),
        sinks: grants(&task.sinks),
        module_name: task.module_name,
        shuffle: shuffle.clone(),
        gpu: shared.gpu.clone(),
    });
    let run = shared
        .engine
        .run(&compiled, info, inputs, limits, cancel, memory);
    let run = match (run, &shuffle) {
        (Ok(run), _) => run,
        // The guest failed on a shuffle problem another attempt may not meet (a peer lost,
        // pieces missing): say so, so the task is retried rather than failing its job.
        (Err(e), Some(shuffle)) if shuffle.retriable_failure().is_some() => {
            return Err(Failure::retriable(e));
        }
        (Err(e), _) => {
            return Err(Failure {
                retriable: e.retriable(),
                message: e.to_string(),
            });
        }
    };
    if let Some(shuffle) = &shuffle {
        runtime
            .block_on(shuffle.finish())
            .map_err(Failure::retriable)?;
        shuffle.release_received();
    }
    let metrics = &shared.metrics;
    metrics
        .task_duration
        .observe(started.elapsed().as_secs_f64());
    metrics
        .instantiate_duration
        .observe(run.instantiate.as_secs_f64());
    metrics
        .copied_into_guest
        .inc_by(run.copies.into_guest_bytes);
    metrics
        .copied_out_of_guest
        .inc_by(run.copies.out_of_guest_bytes);
    let stats = TaskStats {
        duration_us: started.elapsed().as_micros() as u64,
        prepare_us: (prepare + run.instantiate).as_micros() as u64,
        copied_into_guest_bytes: run.copies.into_guest_bytes,
        copied_out_of_guest_bytes: run.copies.out_of_guest_bytes,
        input_rows,
    };
    Ok((run.outputs, stats))
}

/// The task's component, compiled once per content hash; fetched from the scheduler if new.
async fn compiled_module(
    shared: &Arc<Shared>,
    task: &AssignTask,
) -> Result<Arc<CompiledTask>, Failure> {
    if let Some(compiled) = shared.engine.cached(&task.module_hash) {
        return Ok(compiled);
    }
    let module = shared
        .scheduler
        .clone()
        .get_module(GetModuleRequest {
            hash: task.module_hash.clone(),
        })
        .await
        .map_err(|s| {
            Failure::retriable(format!(
                "cannot fetch module `{}` from the scheduler: {}",
                task.module_name,
                s.message()
            ))
        })?
        .into_inner();
    let runner = shared.clone();
    let (name, hash) = (task.module_name.clone(), task.module_hash.clone());
    tokio::task::spawn_blocking(move || runner.engine.prepare(&name, &hash, &module.wasm))
        .await
        .map_err(|e| Failure::fatal(format!("compile thread failed: {e}")))?
        .map_err(Failure::fatal)
}

/// A pool failure as a task failure: retriable when other tasks were in the way.
fn pool_failure(e: PoolError) -> Failure {
    Failure {
        retriable: e.retriable(),
        message: e.to_string(),
    }
}

/// A task's input. Called on the task's slot thread (see [`prepare`]), which pool operations
/// that spill, read back or wait for memory may block.
async fn load_input(
    shared: &Arc<Shared>,
    input: &wrk_proto::TaskInput,
    memory: &Arc<TaskMemory>,
) -> Result<TaskTable, Failure> {
    match &input.kind {
        Some(InputKind::Parquet(partition)) => {
            // Room for the decoded batches and the table they are combined into.
            let estimate = partition.estimated_bytes;
            let size = memory.store().pool_size();
            let reading = memory
                .lease(estimate.saturating_mul(2).min(size.max(estimate)))
                .map_err(pool_failure)?;
            let table = crate::io::read_partition(partition)
                .map(Table::new)
                .map_err(Failure::fatal)?;
            memory.track(table.batch()).map_err(pool_failure)?;
            drop(reading);
            Ok(table.into())
        }
        Some(InputKind::Partition(location)) => load_partition(shared, location, memory).await,
        Some(InputKind::Broadcast(broadcast)) => load_broadcast(shared, broadcast, memory).await,
        None => Err(Failure::fatal("a task input has no kind")),
    }
}

/// Copies a task's outputs from the worker holding them into this worker's store, under the
/// same keys, and tells the scheduler (which then points them here).
async fn fetch_partitions(shared: Arc<Shared>, fetch: FetchPartitions) {
    let mut error = String::new();
    for location in &fetch.partitions {
        let key = location.key.clone().unwrap_or_default();
        match shared
            .peers
            .fetch(&location.address, &key, &location.ticket)
            .await
        {
            Ok(table) => shared.store.insert(PartitionId::from(&key), table),
            Err(e) => {
                error = format!(
                    "cannot fetch partition {} from worker {}: {e}",
                    PartitionId::from(&key),
                    location.worker_id
                );
                break;
            }
        }
    }
    if !error.is_empty() {
        // Keep none of a partial copy.
        shared
            .store
            .release_task(&fetch.job_id, fetch.stage, fetch.task);
    }
    let fetched = PartitionsFetched {
        job_id: fetch.job_id,
        stage: fetch.stage,
        task: fetch.task,
        error,
    };
    let _ = shared
        .outbox
        .send(WorkerMessage {
            kind: Some(ToScheduler::Fetched(fetched)),
        })
        .await;
}

/// A partition held here (read back if it was spilled; on a GPU worker, maybe on the device) or
/// by a peer, counted in the task's memory; on the task's slot thread, like [`load_input`].
async fn load_partition(
    shared: &Arc<Shared>,
    location: &wrk_proto::PartitionLocation,
    memory: &Arc<TaskMemory>,
) -> Result<TaskTable, Failure> {
    let key = location.key.clone().unwrap_or_default();
    if location.worker_id == shared.worker_id {
        return shared
            .store
            .get(&PartitionId::from(&key), Some(memory))
            .map_err(pool_failure)?
            .ok_or_else(|| {
                Failure::retriable(format!(
                    "partition {key} is no longer held by worker {}",
                    shared.worker_id
                ))
            });
    }
    let table = shared
        .peers
        .fetch(&location.address, &key, &location.ticket)
        .await
        .map_err(Failure::retriable)?;
    memory.track(table.batch()).map_err(pool_failure)?;
    Ok(table.into())
}

/// A broadcast input: the first task of the worker to need it fetches and concatenates the
/// stage's outputs; the others wait for that and share the table (marked shared, so that a
/// join builds its hash index on it once per worker). On a GPU worker the table goes to the
/// device once, and the tasks' device operators share that copy.
async fn load_broadcast(
    shared: &Arc<Shared>,
    broadcast: &wrk_proto::BroadcastInput,
    memory: &Arc<TaskMemory>,
) -> Result<TaskTable, Failure> {
    let job_id = broadcast
        .partitions
        .first()
        .and_then(|p| p.key.as_ref())
        .map(|k| k.job_id.clone())
        .unwrap_or_default();
    let cell = shared
        .broadcasts
        .lock()
        .map_err(|_| Failure::fatal("the broadcast cache is poisoned"))?
        .entry((job_id, broadcast.stage))
        .or_default()
        .clone();
    cell.get_or_try_init(|| async {
        // In host memory: the tasks share it, and a join builds its index on it once.
        let mut tables = Vec::with_capacity(broadcast.partitions.len());
        for location in &broadcast.partitions {
            let table = load_partition(shared, location, memory).await?;
            tables.push(table.host().map_err(|e| {
                Failure::retriable(format!(
                    "broadcast input from stage #{}: copying a partition from the device failed: {e}",
                    broadcast.stage
                ))
            })?);
        }
        let Some(first) = tables.first() else {
            return Err(Failure::fatal(format!(
                "broadcast input from stage #{} has no partitions",
                broadcast.stage
            )));
        };
        let table = if tables.len() == 1 {
            first.clone().into_shared()
        } else {
            let batches: Vec<&arrow::record_batch::RecordBatch> =
                tables.iter().map(Table::batch).collect();
            crate::cpu::ops::concat(&batches)
                .map(|batch| Table::new(batch).into_shared())
                .map_err(|e| {
                    Failure::fatal(format!(
                        "broadcast input from stage #{}: its outputs do not concatenate: {e}",
                        broadcast.stage
                    ))
                })?
        };
        Ok(on_the_device(shared.gpu.as_ref(), table))
    })
    .await
    .cloned()
}

/// A shared table for the worker's GPU, uploaded by the first device operator that reads it
/// (one counted upload, the table staying its host copy; see [`ResidentTable::on_host`]), or
/// a host table without a GPU or when the device has no layout for its columns.
fn on_the_device(gpu: Option<&Arc<GpuRuntime>>, table: Table) -> TaskTable {
    match gpu {
        Some(gpu) if crate::gpu::table::uploadable(&table.schema()) => {
            TaskTable::Device(ResidentTable::on_host(gpu, table, None))
        }
        _ => table.into(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::complete;

    #[test]
    fn futures_complete_on_a_plain_thread_whether_ready_at_once_or_not() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        // Ready at its first poll, which runs in the runtime's context.
        let workers = complete(runtime.handle(), async {
            tokio::runtime::Handle::current().metrics().num_workers()
        });
        assert_eq!(workers, 1);
        // Pending at its first poll (a timer of the runtime): `block_on` finishes it.
        let (sender, receiver) = tokio::sync::oneshot::channel();
        runtime.spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let _ = sender.send(7);
        });
        let value = complete(runtime.handle(), async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            receiver.await
        });
        assert_eq!(value, Ok(7));
    }
}

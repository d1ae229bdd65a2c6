//! The scheduler's gRPC service: the thin layer between tonic streams and the [`State`] machine.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::Server;
use tonic::{Request, Response, Status, Streaming};
use wrk_proto::scheduler_message::Kind as ToWorker;
use wrk_proto::scheduler_server::{Scheduler, SchedulerServer};
use wrk_proto::worker_message::Kind as FromWorker;
use wrk_proto::{
    ClusterStatus, DatasetList, DatasetRef, Empty, GetModuleRequest, JobProgress, JobRef,
    JobResult, JobTimeline, MAX_MESSAGE_BYTES, ModuleBytes, RebalanceResponse, Registered,
    RetireResponse, ScalingAdvice, ScalingRequest, SchedulerMessage, SubmitJobRequest,
    SubmitJobResponse, WorkerMessage, WorkerRef,
};

use crate::graph;
use crate::state::{Outgoing, State, StateError, WORKER_LEFT};
use crate::tenants::Tenants;

mod progress;
mod reload;

/// How soon the backlog should drain when a scaling request names no target.
const DEFAULT_SCALING_TARGET: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// How often workers heartbeat.
    pub heartbeat_interval: Duration,
    /// A worker silent for this long is declared lost.
    pub worker_timeout: Duration,
    /// When set, every client call must carry a known tenant's token, and a tenant sees only its
    /// own jobs. When not, the scheduler is open: every caller is the tenant `default`.
    pub tenants: Option<Arc<Tenants>>,
    /// The file `tenants` was read from: read again when it changes, and the datasets of
    /// tenants no longer in it are released.
    pub tenants_file: Option<PathBuf>,
    /// When set, workers must present this token to attach and to fetch modules.
    pub worker_token: Option<String>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            heartbeat_interval: Duration::from_secs(1),
            worker_timeout: Duration::from_secs(10),
            tenants: None,
            tenants_file: None,
            worker_token: None,
        }
    }
}

/// The scheduler service; clones share one state.
#[derive(Clone)]
pub struct SchedulerService {
    state: Arc<Mutex<State>>,
    config: SchedulerConfig,
    /// The tenants now (the configured ones, as reloaded since).
    tenants: Arc<RwLock<Option<Arc<Tenants>>>>,
}

fn status(e: StateError) -> Status {
    match e {
        StateError::DuplicateWorker(_) => Status::already_exists(e.to_string()),
        StateError::UnknownJob(_)
        | StateError::UnknownModule(_)
        | StateError::UnknownDataset(_)
        | StateError::UnknownWorker(_) => Status::not_found(e.to_string()),
        StateError::DatasetExists(_) => Status::already_exists(e.to_string()),
        StateError::NoTimeline(_)
        | StateError::DatasetUnavailable { .. }
        | StateError::NoOtherWorker(_) => Status::failed_precondition(e.to_string()),
        StateError::InvalidTag { .. } => Status::invalid_argument(e.to_string()),
    }
}

/// A refused submission, naming the job.
fn job_status(job: &str, e: StateError) -> Status {
    let status = status(e);
    Status::new(status.code(), format!("job `{job}`: {}", status.message()))
}

/// A worker asked to be retired (it is stopping): retire it, or tell it to go at once when
/// no other worker can take its data.
fn retire_on_request(state: &mut State, worker_id: &str, reason: &str) -> Outgoing {
    match state.retire_worker(worker_id) {
        Ok((out, response)) => {
            tracing::info!(worker = %worker_id, moves = response.moves, running = response.running_tasks, "worker asked to be retired ({reason})");
            out
        }
        Err(e) => {
            tracing::warn!(worker = %worker_id, "worker asked to be retired ({reason}), which is refused: {e}; it exits anyway");
            state.exit_now(worker_id, &e.to_string())
        }
    }
}

/// The tenant every caller is when the scheduler has no tenants file.
pub const OPEN_TENANT: &str = "default";

/// The bearer token of a request, if it carries one.
fn bearer<T>(request: &Request<T>) -> Option<&str> {
    request
        .metadata()
        .get("authorization")?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

/// Compares secrets in time independent of where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn send(out: Outgoing) {
    for (outbox, message) in out {
        let _ = outbox.send(Ok(message));
    }
}

impl SchedulerService {
    pub fn new(config: SchedulerConfig) -> Self {
        SchedulerService {
            state: Arc::new(Mutex::new({
                let mut state = State::new();
                state
                    .set_ticket_secret(config.worker_token.as_ref().map(|t| t.as_bytes().to_vec()));
                for (tenant, policy) in config.tenants.iter().flat_map(|t| t.policies()) {
                    state.set_tenant_policy(tenant, *policy);
                }
                state
            })),
            tenants: Arc::new(RwLock::new(config.tenants.clone())),
            config,
        }
    }

    /// The tenant making a client call.
    fn tenant<T>(&self, request: &Request<T>) -> Result<String, Status> {
        let tenants = self
            .tenants
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        let Some(tenants) = tenants else {
            return Ok(OPEN_TENANT.to_string());
        };
        match bearer(request) {
            None => Err(Status::unauthenticated(
                "this scheduler requires a tenant token (wrk: --token or WRK_TOKEN)",
            )),
            Some(token) => tenants
                .tenant_of(token)
                .map(str::to_string)
                .ok_or_else(|| Status::unauthenticated("unknown tenant token")),
        }
    }

    /// Checks that a worker call carries the worker token, when one is required.
    fn check_worker<T>(&self, request: &Request<T>) -> Result<(), Status> {
        match (&self.config.worker_token, bearer(request)) {
            (None, _) => Ok(()),
            (Some(expected), Some(token))
                if constant_time_eq(expected.as_bytes(), token.as_bytes()) =>
            {
                Ok(())
            }
            (Some(_), Some(_)) => Err(Status::unauthenticated("unknown worker token")),
            (Some(_), None) => Err(Status::unauthenticated(
                "this scheduler requires a worker token (wrk worker: --token or WRK_WORKER_TOKEN)",
            )),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent-enough state for reads; keep serving.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Declares workers lost when they stop heartbeating; runs until the service is dropped.
    fn spawn_reaper(&self) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(&self.state);
        let config = self.config.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(config.heartbeat_interval);
            loop {
                tick.tick().await;
                let Some(state) = weak.upgrade() else { break };
                let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
                for worker in state.silent_workers(config.worker_timeout) {
                    let reason = format!("no heartbeat for {:?}", config.worker_timeout);
                    let out = state.worker_lost(&worker, &reason);
                    send(out);
                }
            }
        })
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Scheduler for SchedulerService {
    type AttachStream = BoxStream<SchedulerMessage>;
    type WatchJobStream = BoxStream<JobProgress>;

    async fn attach(
        &self,
        request: Request<Streaming<WorkerMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        self.check_worker(&request)?;
        let mut inbound = request.into_inner();
        let register = match inbound.message().await? {
            Some(WorkerMessage {
                kind: Some(FromWorker::Register(register)),
            }) => register,
            _ => return Err(Status::invalid_argument("a worker must register first")),
        };
        if register.worker_id.is_empty() || register.data_address.is_empty() {
            return Err(Status::invalid_argument(
                "registration needs a worker id and a data address",
            ));
        }
        let (outbox, messages) = mpsc::unbounded_channel();
        let worker_id = register.worker_id.clone();
        {
            let mut state = self.state();
            state
                .register_worker(&register, outbox.clone())
                .map_err(status)?;
            let _ = outbox.send(Ok(SchedulerMessage {
                kind: Some(ToWorker::Registered(Registered {
                    heartbeat_interval_ms: self.config.heartbeat_interval.as_millis() as u64,
                })),
            }));
            send(state.dispatch());
        }
        tracing::info!(worker = %worker_id, address = %register.data_address, slots = register.slots, "worker joined");
        let service = self.clone();
        tokio::spawn(async move {
            let reason = loop {
                match inbound.message().await {
                    Ok(Some(message)) => {
                        let mut state = service.state();
                        let out = match message.kind {
                            Some(FromWorker::Heartbeat(beat)) => {
                                state.heartbeat(&worker_id, &beat);
                                Vec::new()
                            }
                            Some(FromWorker::Reports(reports)) => {
                                state.tasks_ended(&worker_id, reports)
                            }
                            Some(FromWorker::Fetched(fetched)) => {
                                state.partitions_fetched(&worker_id, fetched)
                            }
                            Some(FromWorker::Retire(request)) => {
                                retire_on_request(&mut state, &worker_id, &request.reason)
                            }
                            Some(FromWorker::Retracted(retracted)) => {
                                state.retracted(&worker_id, retracted)
                            }
                            Some(FromWorker::Register(_)) | None => Vec::new(),
                        };
                        send(out);
                        // Whatever happened may let a retiring worker's retirement go on.
                        send(state.retirements());
                    }
                    Ok(None) => break WORKER_LEFT.to_string(),
                    Err(status) => break format!("its channel failed: {}", status.message()),
                }
            };
            let out = service.state().worker_lost(&worker_id, &reason);
            send(out);
        });
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(
            messages,
        ))))
    }

    async fn get_module(
        &self,
        request: Request<GetModuleRequest>,
    ) -> Result<Response<ModuleBytes>, Status> {
        self.check_worker(&request)?;
        let hash = request.into_inner().hash;
        let module = self.state().module(&hash).map_err(status)?;
        Ok(Response::new(ModuleBytes {
            hash,
            wasm: module.wasm,
            name: module.name,
        }))
    }

    async fn submit_job(
        &self,
        request: Request<SubmitJobRequest>,
    ) -> Result<Response<SubmitJobResponse>, Status> {
        let tenant = self.tenant(&request)?;
        let request = request.into_inner();
        let keep_timeline = request.keep_timeline;
        let priority = request.priority;
        let Some(mut spec) = request.job else {
            return Err(Status::invalid_argument("the request has no job"));
        };
        let (known, reads) = {
            let state = self.state();
            let reads = state
                .resolve_datasets(&tenant, &mut spec)
                .map_err(|e| job_status(&spec.name, e))?;
            (state.known_modules(), reads)
        };
        // Hashing modules can take a while: do it outside the lock.
        graph::validate(&spec, &known)
            .map_err(|e| Status::invalid_argument(format!("job `{}`: {e}", spec.name)))?;
        let mut state = self.state();
        // Again under the lock the job is submitted under: a name may have been taken or
        // released meanwhile.
        if state
            .resolve_datasets(&tenant, &mut spec)
            .map_err(|e| job_status(&spec.name, e))?
            != reads
        {
            return Err(Status::aborted(format!(
                "job `{}`: a dataset it reads was replaced while it was submitted; submit it again",
                spec.name
            )));
        }
        let name = spec.name.clone();
        let persist = spec.persist.clone();
        let (job_id, _) = state.submit_at(&tenant, spec, priority);
        state
            .register_datasets(&tenant, &job_id, reads, &persist)
            .map_err(status)?;
        if keep_timeline {
            state.keep_timeline(&tenant, &job_id).map_err(status)?;
        }
        tracing::info!(job = %job_id, %name, priority, "job submitted");
        send(state.dispatch());
        Ok(Response::new(SubmitJobResponse { job_id }))
    }

    async fn watch_job(
        &self,
        request: Request<JobRef>,
    ) -> Result<Response<Self::WatchJobStream>, Status> {
        let tenant = self.tenant(&request)?;
        let receiver = self
            .state()
            .watch(&tenant, &request.into_inner().job_id)
            .map_err(status)?;
        let stream = progress::updates(receiver).map(Ok);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_job_result(
        &self,
        request: Request<JobRef>,
    ) -> Result<Response<JobResult>, Status> {
        let tenant = self.tenant(&request)?;
        let result = self
            .state()
            .result(&tenant, &request.into_inner().job_id)
            .map_err(status)?;
        Ok(Response::new(result))
    }

    async fn cancel_job(&self, request: Request<JobRef>) -> Result<Response<Empty>, Status> {
        let tenant = self.tenant(&request)?;
        let out = self
            .state()
            .cancel(&tenant, &request.into_inner().job_id)
            .map_err(status)?;
        send(out);
        Ok(Response::new(Empty {}))
    }

    async fn release_job(&self, request: Request<JobRef>) -> Result<Response<Empty>, Status> {
        let tenant = self.tenant(&request)?;
        let out = self
            .state()
            .release(&tenant, &request.into_inner().job_id)
            .map_err(status)?;
        send(out);
        Ok(Response::new(Empty {}))
    }

    async fn get_scaling_advice(
        &self,
        request: Request<ScalingRequest>,
    ) -> Result<Response<ScalingAdvice>, Status> {
        // Any tenant may see the cluster-wide advice; it names no jobs.
        self.tenant(&request)?;
        let target = match request.into_inner().target_duration_ms {
            0 => DEFAULT_SCALING_TARGET,
            ms => Duration::from_millis(ms),
        };
        Ok(Response::new(self.state().scaling_advice(target)))
    }

    async fn get_job_timeline(
        &self,
        request: Request<JobRef>,
    ) -> Result<Response<JobTimeline>, Status> {
        let tenant = self.tenant(&request)?;
        let timeline = self
            .state()
            .job_timeline(&tenant, &request.into_inner().job_id)
            .map_err(status)?;
        Ok(Response::new(timeline))
    }

    async fn persisted_datasets(
        &self,
        request: Request<Empty>,
    ) -> Result<Response<DatasetList>, Status> {
        let tenant = self.tenant(&request)?;
        Ok(Response::new(self.state().datasets(&tenant)))
    }

    async fn release_dataset(
        &self,
        request: Request<DatasetRef>,
    ) -> Result<Response<Empty>, Status> {
        let tenant = self.tenant(&request)?;
        let out = self
            .state()
            .release_dataset(&tenant, &request.into_inner().name)
            .map_err(status)?;
        send(out);
        Ok(Response::new(Empty {}))
    }

    async fn rebalance_dataset(
        &self,
        request: Request<DatasetRef>,
    ) -> Result<Response<RebalanceResponse>, Status> {
        let tenant = self.tenant(&request)?;
        let (out, moves) = self
            .state()
            .rebalance_dataset(&tenant, &request.into_inner().name)
            .map_err(status)?;
        send(out);
        Ok(Response::new(RebalanceResponse { moves }))
    }

    async fn retire_worker(
        &self,
        request: Request<WorkerRef>,
    ) -> Result<Response<RetireResponse>, Status> {
        // Retiring is an operator's act, but names no tenant's data: any tenant may ask, as for
        // the scaling advice.
        self.tenant(&request)?;
        let worker_id = request.into_inner().worker_id;
        let (out, response) = self.state().retire_worker(&worker_id).map_err(status)?;
        send(out);
        Ok(Response::new(response))
    }

    async fn get_cluster_status(
        &self,
        request: Request<Empty>,
    ) -> Result<Response<ClusterStatus>, Status> {
        let tenant = self.tenant(&request)?;
        Ok(Response::new(self.state().status(&tenant)))
    }
}

/// The content type of the Prometheus text format.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

impl SchedulerService {
    /// The scheduler's metrics in the Prometheus text format.
    pub fn metrics_text(&self) -> String {
        self.state().render_metrics()
    }

    /// The HTTP endpoints: `/metrics` (Prometheus), `/healthz`, `/scaling` and the dashboard
    /// (`/`, `/api/*`, see [`crate::dashboard`]).
    fn http_router(&self) -> axum::Router {
        let service = self.clone();
        crate::dashboard::router(self.state.clone())
            .route(
                "/metrics",
                axum::routing::get(move || {
                    let service = service.clone();
                    async move {
                        (
                            [(axum::http::header::CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE)],
                            service.metrics_text(),
                        )
                    }
                }),
            )
            .route("/healthz", axum::routing::get(|| async { "ok\n" }))
            .route(
                "/scaling",
                axum::routing::get({
                    let service = self.clone();
                    move |query: axum::extract::Query<ScalingQuery>| {
                        let service = service.clone();
                        async move {
                            let target = query
                                .target_secs
                                .filter(|s| s.is_finite() && *s > 0.0)
                                .map(Duration::from_secs_f64)
                                .unwrap_or(DEFAULT_SCALING_TARGET);
                            let advice = service.state().scaling_advice(target);
                            axum::Json(scaling_json(&advice, target))
                        }
                    }
                }),
            )
    }
}

/// Query of `GET /scaling?target_secs=N`.
#[derive(Debug, Default, serde::Deserialize)]
struct ScalingQuery {
    target_secs: Option<f64>,
}

/// The scaling advice as JSON, for autoscalers that do not speak gRPC.
fn scaling_json(advice: &ScalingAdvice, target: Duration) -> serde_json::Value {
    serde_json::json!({
        "target_secs": target.as_secs_f64(),
        "current_workers": advice.current_workers,
        "desired_workers": advice.desired_workers,
        "retirable_workers": advice.retirable_workers,
        "backlog_tasks": advice.backlog_tasks,
        "backlog_seconds": advice.backlog_seconds,
    })
}

/// Why the scheduler stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("the gRPC server failed: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("the HTTP server failed: {0}")]
    Http(#[from] std::io::Error),
}

/// Serves the scheduler's gRPC API on `listener`, and its HTTP endpoints (metrics, health) on
/// `http` when given, until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    http: Option<TcpListener>,
    config: SchedulerConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let service = SchedulerService::new(config);
    let reaper = service.spawn_reaper();
    let reloader = service.spawn_tenants_reload();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let http_server = http.map(|listener| {
        let router = service.http_router();
        let mut stopped = stopped.clone();
        tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
        })
    });
    let server = SchedulerServer::new(service)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let result = Server::builder()
        .add_service(server)
        // Without TCP_NODELAY a small HTTP/2 frame can wait ~40 ms for a delayed ACK.
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            async {
                shutdown.await;
                let _ = stop.send(true);
            },
        )
        .await;
    let _ = stop.send(true);
    reaper.abort();
    if let Some(reloader) = reloader {
        reloader.abort();
    }
    result?;
    if let Some(http) = http_server {
        match http.await {
            Ok(result) => result?,
            Err(join) => return Err(ServeError::Http(std::io::Error::other(join))),
        }
    }
    Ok(())
}

//! The custom resources: `WrkCluster` (a scheduler and groups of one-GPU workers) and `WrkJob` (a
//! job file run against a named cluster or an ephemeral one), with their status types.
//!
//! Schemas come from `schemars` through kube's derive; bounds the API server can enforce (pool
//! fraction, replica counts) are in the schema, the rest is checked by [`crate::validate`].

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The API group of both resources.
pub const GROUP: &str = "wrk.dev";

/// A `wrk` cluster: one scheduler and groups of workers, one worker per GPU (or MIG slice).
// Each `printcolumn(...)` repeats `type_`: not a duplicate, though clippy reads it so.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "wrk.dev",
    version = "v1alpha1",
    kind = "WrkCluster",
    namespaced,
    status = "WrkClusterStatus",
    shortname = "wrkc",
    category = "wrk",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = r#".status.conditions[?(@.type=="Ready")].status"#
    ),
    printcolumn(
        name = "Workers",
        type_ = "integer",
        json_path = ".status.readyWorkers",
        description = "workers whose pod is ready"
    ),
    printcolumn(
        name = "Desired",
        type_ = "integer",
        json_path = ".status.desiredWorkers"
    ),
    printcolumn(
        name = "Pending",
        type_ = "integer",
        json_path = ".status.pendingWorkers",
        description = "worker pods pending past the timeout"
    ),
    printcolumn(
        name = "Scheduler",
        type_ = "string",
        json_path = ".status.schedulerAddress",
        priority = "1"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct WrkClusterSpec {
    /// The image holding the `wrk` binary, for the scheduler and the workers.
    pub image: String,
    /// `Always`, `IfNotPresent` or `Never` (Kubernetes' default when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    #[serde(default)]
    pub scheduler: SchedulerSpec,
    /// Worker groups; each worker is one pod holding exactly one GPU or one MIG slice.
    #[schemars(length(min = 1))]
    pub worker_groups: Vec<WorkerGroupSpec>,
    /// Once the scheduler has reported no work (no unfinished task) for this long, every worker
    /// group goes to its floor: `autoscaling.minReplicas`, or zero for a group without
    /// autoscaling. Until then idle groups keep their workers (warm for the next job); they come
    /// back as soon as the scheduler reports work again. Workers holding data are still retired
    /// only when the scheduler reports them safe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub idle_timeout_seconds: Option<u64>,
    /// Bearer tokens from a Secret: the scheduler requires them (tenants and a worker token) and
    /// the operator, workers and `WrkJob`s present them. Without it the scheduler is open to
    /// anyone who can reach its Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<AuthSpec>,
}

/// Where a cluster's tokens live: keys of one Secret in the cluster's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AuthSpec {
    /// The Secret holding the keys below.
    pub secret_name: String,
    /// The tenants file (`wrk scheduler --tenants`), mounted into the scheduler pod.
    #[serde(default = "default_tenants_key")]
    pub tenants_key: String,
    /// The token workers present (`WRK_WORKER_TOKEN` of the scheduler and the workers); it also
    /// signs partition tickets.
    #[serde(default = "default_worker_token_key")]
    pub worker_token_key: String,
    /// A tenant token (listed in the tenants file) the operator asks for scaling advice with,
    /// and the token `WrkJob`s on this cluster submit with unless they name their own.
    #[serde(default = "default_client_token_key")]
    pub client_token_key: String,
}

/// Default key of the tenants file in an [`AuthSpec`] Secret.
pub const DEFAULT_TENANTS_KEY: &str = "tenants.toml";
/// Default key of the worker token in an [`AuthSpec`] Secret.
pub const DEFAULT_WORKER_TOKEN_KEY: &str = "worker-token";
/// Default key of the client (tenant) token in an [`AuthSpec`] Secret.
pub const DEFAULT_CLIENT_TOKEN_KEY: &str = "client-token";

fn default_tenants_key() -> String {
    DEFAULT_TENANTS_KEY.to_string()
}

fn default_worker_token_key() -> String {
    DEFAULT_WORKER_TOKEN_KEY.to_string()
}

fn default_client_token_key() -> String {
    DEFAULT_CLIENT_TOKEN_KEY.to_string()
}

impl AuthSpec {
    /// The Secret key holding the client token.
    pub fn client_token(&self) -> SecretKeyRef {
        SecretKeyRef {
            name: self.secret_name.clone(),
            key: self.client_token_key.clone(),
        }
    }

    /// The Secret key holding the worker token.
    pub fn worker_token(&self) -> SecretKeyRef {
        SecretKeyRef {
            name: self.secret_name.clone(),
            key: self.worker_token_key.clone(),
        }
    }
}

/// One key of a Secret in the object's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct SecretKeyRef {
    pub name: String,
    pub key: String,
}

/// Where and how the scheduler runs.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SchedulerSpec {
    /// Defaults to 1 CPU and 1 GiB, requests equal to limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    #[serde(default)]
    pub service_type: ServiceType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Defaults to a *preferred* affinity for nodes labelled `dedicated=scheduler`, so the
    /// scheduler lands on a cheaper node when there is one and anywhere otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Added to a default toleration of `dedicated=scheduler:NoSchedule`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub termination_grace_period_seconds: Option<i64>,
}

/// How the scheduler's Service is exposed.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ServiceType {
    #[default]
    ClusterIP,
    NodePort,
    LoadBalancer,
}

impl ServiceType {
    pub fn as_str(self) -> &'static str {
        match self {
            ServiceType::ClusterIP => "ClusterIP",
            ServiceType::NodePort => "NodePort",
            ServiceType::LoadBalancer => "LoadBalancer",
        }
    }
}

/// A group of identical workers.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkerGroupSpec {
    /// A DNS label, unique within the cluster.
    pub name: String,
    /// Workers to run; with `autoscaling` the starting point, clamped to its bounds.
    #[schemars(range(min = 0, max = 10000))]
    pub replicas: u32,
    #[serde(default)]
    pub gpu: GpuSpec,
    /// Merged with the GPU product selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Added to a default toleration of `nvidia.com/gpu:NoSchedule`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    /// Share of the worker's memory limit given to its memory pool; the rest (20-40% is the usual
    /// headroom) stays free for the runtime and the system.
    #[serde(default = "default_pool_fraction")]
    #[schemars(range(min = 0.05, max = 0.95))]
    pub pool_fraction: f64,
    #[serde(default)]
    pub transport: Transport,
    /// Defaults to 2 CPUs and 8 GiB, requests equal to limits. A memory limit is required: the
    /// worker's memory limit and pool size derive from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub termination_grace_period_seconds: Option<i64>,
}

/// The pool fraction used when a worker group names none: 30% headroom.
pub const DEFAULT_POOL_FRACTION: f64 = 0.7;

fn default_pool_fraction() -> f64 {
    DEFAULT_POOL_FRACTION
}

/// The accelerator each worker of a group holds.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuSpec {
    /// The extended resource a worker requests one of: `nvidia.com/gpu`, or a MIG slice such as
    /// `nvidia.com/mig-1g.5gb`.
    #[serde(default = "default_gpu_resource")]
    pub resource: String,
    /// Required value of the node label `nvidia.com/gpu.product` (GPU feature discovery), e.g.
    /// `NVIDIA-A100-SXM4-80GB`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
}

impl Default for GpuSpec {
    fn default() -> Self {
        GpuSpec {
            resource: default_gpu_resource(),
            product: None,
        }
    }
}

/// The whole-GPU extended resource of NVIDIA's device plugin.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

fn default_gpu_resource() -> String {
    GPU_RESOURCE.to_string()
}

/// How workers exchange partitions.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    #[default]
    Tcp,
    Ucx,
}

impl Transport {
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Ucx => "ucx",
        }
    }
}

/// Bounds within which the operator follows the scheduler's recommendation.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingSpec {
    #[schemars(range(min = 0, max = 10000))]
    pub min_replicas: u32,
    #[schemars(range(min = 0, max = 10000))]
    pub max_replicas: u32,
}

/// What the operator last saw of a `WrkCluster`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WrkClusterStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `SchedulerAvailable`, `WorkersReady`, `PodsPending`, `Autoscaling`, `Idle`.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// Where clients reach the scheduler's gRPC service (`http://NAME.NAMESPACE.svc:PORT`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler_address: Option<String>,
    #[serde(default)]
    pub desired_workers: u32,
    #[serde(default)]
    pub ready_workers: u32,
    /// Worker pods pending for longer than the operator's pending timeout.
    #[serde(default)]
    pub pending_workers: u32,
    #[serde(default)]
    pub worker_groups: Vec<WorkerGroupStatus>,
    /// Pods (scheduler or workers) pending past the timeout, with the reason from their events.
    #[serde(default)]
    pub pending_pods: Vec<PendingPod>,
    /// RFC 3339 time since which the scheduler has reported no work (with `idleTimeoutSeconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_since: Option<String>,
}

/// Counts for one worker group.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkerGroupStatus {
    pub name: String,
    pub desired: u32,
    /// Pods that exist (not being deleted).
    pub current: u32,
    /// Pods bound to a node.
    pub scheduled: u32,
    pub ready: u32,
    /// Workers above `desired` kept because the scheduler has not reported them safe to retire.
    #[serde(default)]
    pub held: u32,
}

/// A pod stuck in `Pending` past the timeout, and why.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PendingPod {
    pub name: String,
    /// Seconds since the pod was created.
    pub pending_seconds: u64,
    /// From the pod's latest warning event (e.g. `FailedScheduling`), else its conditions.
    pub reason: String,
    pub message: String,
}

/// A job file run on a `wrk` cluster: an existing one named by `cluster`, or an ephemeral one
/// created from `ephemeralCluster` and deleted with the job.
// Each `printcolumn(...)` repeats `type_`: not a duplicate, though clippy reads it so.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "wrk.dev",
    version = "v1alpha1",
    kind = "WrkJob",
    namespaced,
    status = "WrkJobStatus",
    shortname = "wrkj",
    category = "wrk",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Cluster", type_ = "string", json_path = ".status.cluster"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct WrkJobSpec {
    /// The image holding `wrk` that submits the job (defaults to the cluster's image).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    pub source: JobSource,
    /// Run on this existing `WrkCluster` of the namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    /// Or on a cluster created for this job and deleted with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ephemeral_cluster: Option<WrkClusterSpec>,
    /// Job parameters (`--param KEY=VALUE`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub params: BTreeMap<String, String>,
    /// The tenant token to submit with; defaults to the cluster's `auth` client token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<SecretKeyRef>,
    /// Fail the job if it has not finished this many seconds after the `WrkJob` was created
    /// (waiting for its cluster included): the submitting Job gets what is left as its
    /// `activeDeadlineSeconds`, and the operator fails the `WrkJob` with reason
    /// `DeadlineExceeded` if it is still not done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub deadline_seconds: Option<i64>,
    /// Delete the `WrkJob` (and everything it owns) this long after it finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub ttl_seconds_after_finished: Option<i64>,
}

/// Where the job file and its modules come from.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobSource {
    /// A ConfigMap holding the job file and its modules (`binaryData`), mounted at `/job`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<String>,
    /// The job file: a key of the ConfigMap, or a path inside `image`.
    pub job_file: String,
}

/// Where a `WrkJob` is in its life.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum JobPhase {
    #[default]
    Pending,
    Running,
    Succeeded,
    Failed,
}

/// What the operator last saw of a `WrkJob`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WrkJobStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default)]
    pub phase: JobPhase,
    /// The cluster the job runs on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    /// `Ready` (the cluster is up and the submitting Job created), `Running` (its pod runs),
    /// `Complete` or `Failed` (with the reason: `DeadlineExceeded`, `BackoffLimitExceeded`, ...).
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// RFC 3339 time the submitting Job started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    /// RFC 3339 time the job finished (succeeded or failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
}

impl JobPhase {
    /// Succeeded or failed: nothing more will happen but the TTL.
    pub fn is_finished(self) -> bool {
        matches!(self, JobPhase::Succeeded | JobPhase::Failed)
    }
}

//! Pure rendering of a `WrkCluster` into the Kubernetes objects that run it: the scheduler
//! Deployment and Service, and one Pod per worker. No API calls here: every function maps a
//! custom resource to objects, so all of it is unit-tested and validated offline.

pub mod job;
pub mod scheduler;
pub mod worker;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ContainerPort, EnvVar, EnvVarSource, HTTPGetAction, Probe, ResourceRequirements,
    SecretKeySelector, Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};

use crate::Error;
use crate::crd::WrkCluster;

/// The scheduler's gRPC port (`wrk scheduler --listen`).
pub const GRPC_PORT: i32 = 7070;
/// The scheduler's HTTP port (`wrk scheduler --http-listen`): dashboard, `/metrics`, `/healthz`.
/// The Service offers it as `dashboard` on this port and as `metrics` on [`METRICS_PORT`].
pub const DASHBOARD_PORT: i32 = 8787;
/// The metrics port: the scheduler Service's `metrics` port, and each worker's
/// `--metrics-listen` (`/metrics`, `/healthz`).
pub const METRICS_PORT: i32 = 9090;
/// The worker's data port (`wrk worker --listen`), where peers fetch partitions.
pub const WORKER_DATA_PORT: i32 = 7071;
/// Where the scheduler mounts its cluster's tenants file.
pub const AUTH_DIR: &str = "/etc/wrk/auth";
/// The file name of the mounted tenants file.
pub const TENANTS_FILE: &str = "tenants.toml";

/// Field manager of the operator's server-side applies.
pub const FIELD_MANAGER: &str = "wrk-operator";

pub const LABEL_NAME: &str = "app.kubernetes.io/name";
pub const LABEL_INSTANCE: &str = "app.kubernetes.io/instance";
pub const LABEL_COMPONENT: &str = "app.kubernetes.io/component";
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const LABEL_CLUSTER: &str = "wrk.dev/cluster";
pub const LABEL_GROUP: &str = "wrk.dev/worker-group";
/// Annotation holding a hash of the rendered worker pod, to spot pods of an older spec.
pub const ANNOTATION_SPEC_HASH: &str = "wrk.dev/spec-hash";

/// The object names derived from a cluster's name.
pub fn scheduler_name(cluster: &str) -> String {
    format!("{cluster}-scheduler")
}

pub fn worker_pod_name(cluster: &str, group: &str, index: u32) -> String {
    format!("{cluster}-{group}-{index}")
}

/// Where pods of the cluster's namespace (and others, by the full name) reach the scheduler.
pub fn scheduler_address(cluster: &str, namespace: &str) -> String {
    format!(
        "http://{}.{namespace}.svc:{GRPC_PORT}",
        scheduler_name(cluster)
    )
}

/// Labels every object of a cluster carries; `kubectl -l wrk.dev/cluster=NAME` and Prometheus'
/// Kubernetes service discovery select on them.
pub fn common_labels(cluster: &str, component: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_NAME.to_string(), "wrk".to_string()),
        (LABEL_INSTANCE.to_string(), cluster.to_string()),
        (LABEL_COMPONENT.to_string(), component.to_string()),
        (LABEL_MANAGED_BY.to_string(), FIELD_MANAGER.to_string()),
        (LABEL_CLUSTER.to_string(), cluster.to_string()),
    ])
}

/// The selector of one component of a cluster (a subset of [`common_labels`]).
pub fn component_selector(cluster: &str, component: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_CLUSTER.to_string(), cluster.to_string()),
        (LABEL_COMPONENT.to_string(), component.to_string()),
    ])
}

/// A label selector string (`k=v,k=v`) for list calls.
pub fn selector_string(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Name, namespace and controller owner reference of a cluster: what every child needs.
pub(crate) struct Owner {
    pub name: String,
    pub namespace: String,
    pub reference: OwnerReference,
}

impl Owner {
    pub fn of(cluster: &WrkCluster) -> Result<Owner, Error> {
        let namespace = cluster
            .namespace()
            .ok_or(Error::MissingField("metadata.namespace"))?;
        let reference = cluster
            .controller_owner_ref(&())
            .ok_or(Error::MissingField("metadata.uid"))?;
        Ok(Owner {
            name: cluster.name_any(),
            namespace,
            reference,
        })
    }

    pub fn meta(&self, name: String, labels: BTreeMap<String, String>) -> ObjectMeta {
        ObjectMeta {
            name: Some(name),
            namespace: Some(self.namespace.clone()),
            labels: Some(labels),
            owner_references: Some(vec![self.reference.clone()]),
            ..ObjectMeta::default()
        }
    }
}

/// `resources` with defaults filled in: limits for CPU and memory when missing, and requests equal
/// to the limits where none are given (Guaranteed QoS, and extended resources need request ==
/// limit).
pub(crate) fn resources_with_defaults(
    given: Option<&ResourceRequirements>,
    default_cpu: &str,
    default_memory: &str,
    extra_limits: &[(&str, &str)],
) -> ResourceRequirements {
    let mut resources = given.cloned().unwrap_or_default();
    let limits = resources.limits.get_or_insert_with(BTreeMap::new);
    limits
        .entry("cpu".to_string())
        .or_insert_with(|| Quantity(default_cpu.to_string()));
    limits
        .entry("memory".to_string())
        .or_insert_with(|| Quantity(default_memory.to_string()));
    for (name, value) in extra_limits {
        limits.insert((*name).to_string(), Quantity((*value).to_string()));
    }
    let limits = limits.clone();
    let requests = resources.requests.get_or_insert_with(BTreeMap::new);
    for (name, value) in limits {
        requests.entry(name).or_insert(value);
    }
    resources
}

/// User tolerations after the operator's default one.
pub(crate) fn tolerations(default: Toleration, extra: Option<&Vec<Toleration>>) -> Vec<Toleration> {
    let mut all = vec![default];
    if let Some(extra) = extra {
        all.extend(extra.iter().cloned());
    }
    all
}

/// Prometheus' conventional scrape annotations (`prometheus.io/scrape`, `port`, `path`), read by
/// the usual `kubernetes_sd_configs` relabelling rules.
pub fn prometheus_annotations(port: i32) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("prometheus.io/scrape".to_string(), "true".to_string()),
        ("prometheus.io/port".to_string(), port.to_string()),
        ("prometheus.io/path".to_string(), "/metrics".to_string()),
    ])
}

/// An environment variable read from a Secret key.
pub(crate) fn env_from_secret(name: &str, secret: &crate::crd::SecretKeyRef) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.name.clone(),
                key: secret.key.clone(),
                optional: Some(false),
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A probe GETting `/healthz` on the named container port.
pub(crate) fn healthz_probe(port: &str, period: i32, initial_delay: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some("/healthz".to_string()),
            port: IntOrString::String(port.to_string()),
            scheme: Some("HTTP".to_string()),
            ..Default::default()
        }),
        initial_delay_seconds: (initial_delay > 0).then_some(initial_delay),
        period_seconds: Some(period),
        timeout_seconds: Some(2),
        failure_threshold: Some(3),
        ..Default::default()
    }
}

/// A named TCP container port.
pub(crate) fn container_port(name: &str, number: i32) -> ContainerPort {
    ContainerPort {
        name: Some(name.to_string()),
        container_port: number,
        protocol: Some("TCP".to_string()),
        ..Default::default()
    }
}

/// A stable 64-bit FNV-1a hash, hex-encoded (for the spec-hash annotation; stable across builds,
/// unlike `DefaultHasher`).
pub(crate) fn stable_hash(bytes: &[u8]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:016x}")
}

#[cfg(test)]
pub(crate) mod testing {
    //! A cluster as the API server would return it (namespace and uid set), for render tests.

    use crate::crd::{AuthSpec, GpuSpec, WorkerGroupSpec, WrkCluster, WrkClusterSpec};

    /// Auth from `secret` with the default keys.
    pub fn auth(secret: &str) -> AuthSpec {
        serde_json::from_value(serde_json::json!({ "secretName": secret }))
            .unwrap_or_else(|e| panic!("auth spec: {e}"))
    }

    pub fn group(name: &str, replicas: u32, resource: &str) -> WorkerGroupSpec {
        WorkerGroupSpec {
            name: name.to_string(),
            replicas,
            gpu: GpuSpec {
                resource: resource.to_string(),
                product: None,
            },
            node_selector: None,
            affinity: None,
            tolerations: None,
            pool_fraction: crate::crd::DEFAULT_POOL_FRACTION,
            transport: Default::default(),
            resources: None,
            autoscaling: None,
            termination_grace_period_seconds: None,
        }
    }

    pub fn cluster(groups: Vec<WorkerGroupSpec>) -> WrkCluster {
        let mut cluster = WrkCluster::new(
            "demo",
            WrkClusterSpec {
                image: "example.org/wrk:0.1.0".to_string(),
                image_pull_policy: None,
                scheduler: Default::default(),
                worker_groups: groups,
                idle_timeout_seconds: None,
                auth: None,
            },
        );
        cluster.metadata.namespace = Some("data".to_string());
        cluster.metadata.uid = Some("0b6f1f62-5a39-4c1c-a5b5-0c1b7b0e7d11".to_string());
        cluster
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_address() {
        assert_eq!(scheduler_name("demo"), "demo-scheduler");
        assert_eq!(worker_pod_name("demo", "a100", 3), "demo-a100-3");
        assert_eq!(
            scheduler_address("demo", "data"),
            "http://demo-scheduler.data.svc:7070"
        );
    }

    #[test]
    fn owner_needs_namespace_and_uid() {
        let mut cluster = testing::cluster(vec![]);
        assert!(Owner::of(&cluster).is_ok());
        cluster.metadata.uid = None;
        assert!(matches!(
            Owner::of(&cluster),
            Err(Error::MissingField("metadata.uid"))
        ));
    }

    #[test]
    fn default_resources_make_requests_equal_limits() {
        let r = resources_with_defaults(None, "2", "8Gi", &[("nvidia.com/gpu", "1")]);
        let limits = r.limits.unwrap_or_default();
        let requests = r.requests.unwrap_or_default();
        assert_eq!(limits, requests);
        assert_eq!(limits["memory"].0, "8Gi");
        assert_eq!(limits["nvidia.com/gpu"].0, "1");
    }

    #[test]
    fn given_requests_are_kept() {
        let given = ResourceRequirements {
            requests: Some(BTreeMap::from([("cpu".to_string(), Quantity("1".into()))])),
            limits: Some(BTreeMap::from([("cpu".to_string(), Quantity("4".into()))])),
            ..Default::default()
        };
        let r = resources_with_defaults(Some(&given), "2", "8Gi", &[]);
        assert_eq!(r.requests.unwrap_or_default()["cpu"].0, "1");
        assert_eq!(r.limits.unwrap_or_default()["cpu"].0, "4");
    }

    #[test]
    fn hash_is_stable_and_sensitive() {
        assert_eq!(stable_hash(b""), "cbf29ce484222325");
        assert_ne!(stable_hash(b"a"), stable_hash(b"b"));
    }
}

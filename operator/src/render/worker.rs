//! Worker pods: one pod per worker, each requesting exactly one GPU (`nvidia.com/gpu`) or one MIG
//! slice, with the worker's flags and environment derived from the pod's limits (seed 000: the
//! worker's memory limit matches the container's, and its pool leaves headroom below it). Each
//! serves `/metrics` and `/healthz` on its metrics port (probed, and annotated for Prometheus)
//! and, with `auth`, presents the worker token from the cluster's Secret.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Container, EmptyDirVolumeSource, EnvVar, EnvVarSource, ObjectFieldSelector, Pod,
    PodSpec, Toleration, TopologySpreadConstraint, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::scheduler::restricted_security_context;
use super::{
    ANNOTATION_SPEC_HASH, LABEL_GROUP, METRICS_PORT, Owner, WORKER_DATA_PORT, common_labels,
    container_port, env_from_secret, healthz_probe, prometheus_annotations,
    resources_with_defaults, scheduler_address, stable_hash, tolerations, worker_pod_name,
};
use crate::Error;
use crate::crd::{GPU_RESOURCE, WorkerGroupSpec, WrkCluster};
use crate::quantity;

pub const COMPONENT: &str = "worker";
/// The node label GPU feature discovery sets to the GPU's product name.
pub const GPU_PRODUCT_LABEL: &str = "nvidia.com/gpu.product";
/// The zone label worker pods are spread across.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
pub const DEFAULT_CPU: &str = "2";
pub const DEFAULT_MEMORY: &str = "8Gi";
const CACHE_DIR: &str = "/var/cache/wrk";

/// What a worker is told about the resources its pod holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerSizing {
    /// The container's memory limit.
    pub memory_limit_bytes: u64,
    /// `pool_fraction` of the memory limit.
    pub pool_bytes: u64,
    /// Concurrent tasks: the whole CPUs of the limit, at least one.
    pub slots: u32,
}

/// The sizing of a group's workers from its (defaulted) limits.
pub fn sizing(group: &WorkerGroupSpec) -> Result<WorkerSizing, Error> {
    let resources =
        resources_with_defaults(group.resources.as_ref(), DEFAULT_CPU, DEFAULT_MEMORY, &[]);
    let limits = resources.limits.unwrap_or_default();
    let limit = |name: &str| {
        limits
            .get(name)
            .map(|q| q.0.as_str())
            .ok_or(Error::MissingField("resources.limits"))
    };
    let memory_limit_bytes = quantity::bytes(limit("memory")?)?;
    let cpus = quantity::parse(limit("cpu")?)?;
    let pool_bytes = (memory_limit_bytes as f64 * group.pool_fraction).floor() as u64;
    let slots = (cpus.floor() as u32).max(1);
    Ok(WorkerSizing {
        memory_limit_bytes,
        pool_bytes,
        slots,
    })
}

fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: Some(value.into()),
        ..Default::default()
    }
}

fn env_field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.to_string(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Labels of a group's pods (and its selector).
pub fn group_labels(cluster: &str, group: &str) -> BTreeMap<String, String> {
    let mut labels = common_labels(cluster, COMPONENT);
    labels.insert(LABEL_GROUP.to_string(), group.to_string());
    labels
}

/// Worker `index` of `group`.
pub fn pod(cluster: &WrkCluster, group: &WorkerGroupSpec, index: u32) -> Result<Pod, Error> {
    let owner = Owner::of(cluster)?;
    let size = sizing(group)?;
    let labels = group_labels(&owner.name, &group.name);
    let resources = resources_with_defaults(
        group.resources.as_ref(),
        DEFAULT_CPU,
        DEFAULT_MEMORY,
        &[(group.gpu.resource.as_str(), "1")],
    );
    let mut env = vec![
        env_field("WRK_WORKER_ID", "metadata.name"),
        env_field("WRK_ADVERTISE_HOST", "status.podIP"),
        // The limit the kubelet enforces and the pool inside it (`wrk worker` reads them as
        // `--memory-limit` and `--pool-size`); the device and the shuffle transport are for the
        // worker to adopt (its command line has no such flags yet).
        env(
            "WRK_MEMORY_LIMIT_BYTES",
            size.memory_limit_bytes.to_string(),
        ),
        env("WRK_POOL_BYTES", size.pool_bytes.to_string()),
        env("WRK_DEVICE", "cuda"),
        env("WRK_TRANSPORT", group.transport.as_str()),
    ];
    if let Some(auth) = &cluster.spec.auth {
        env.push(env_from_secret("WRK_WORKER_TOKEN", &auth.worker_token()));
    }
    let container = Container {
        name: COMPONENT.to_string(),
        image: Some(cluster.spec.image.clone()),
        image_pull_policy: cluster.spec.image_pull_policy.clone(),
        // Kubernetes expands $(WRK_WORKER_ID) from the environment below: the worker's id is its
        // pod's name, so the scheduler's "safe to retire" answers name pods.
        args: Some(
            [
                "worker",
                "--scheduler",
                &scheduler_address(&owner.name, &owner.namespace),
                "--listen",
                &format!("0.0.0.0:{WORKER_DATA_PORT}"),
                "--id",
                "$(WRK_WORKER_ID)",
                "--slots",
                &size.slots.to_string(),
                "--cache-dir",
                CACHE_DIR,
                "--metrics-listen",
                &format!("0.0.0.0:{METRICS_PORT}"),
            ]
            .map(String::from)
            .to_vec(),
        ),
        env: Some(env),
        ports: Some(vec![
            container_port("data", WORKER_DATA_PORT),
            container_port("metrics", METRICS_PORT),
        ]),
        resources: Some(resources),
        // The worker's HTTP listener: up once the worker runs.
        readiness_probe: Some(healthz_probe("metrics", 5, 0)),
        liveness_probe: Some(healthz_probe("metrics", 10, 10)),
        volume_mounts: Some(vec![VolumeMount {
            name: "cache".to_string(),
            mount_path: CACHE_DIR.to_string(),
            ..Default::default()
        }]),
        security_context: Some(restricted_security_context()),
        ..Default::default()
    };

    let mut node_selector = group.node_selector.clone().unwrap_or_default();
    if let Some(product) = &group.gpu.product {
        node_selector.insert(GPU_PRODUCT_LABEL.to_string(), product.clone());
    }
    let gpu_toleration = Toleration {
        key: Some(GPU_RESOURCE.to_string()),
        operator: Some("Exists".to_string()),
        effect: Some("NoSchedule".to_string()),
        ..Default::default()
    };
    let spread = TopologySpreadConstraint {
        max_skew: 1,
        topology_key: ZONE_LABEL.to_string(),
        when_unsatisfiable: "ScheduleAnyway".to_string(),
        label_selector: Some(LabelSelector {
            match_labels: Some(labels.clone()),
            ..Default::default()
        }),
        ..Default::default()
    };
    let spec = PodSpec {
        containers: vec![container],
        // A failed worker is replaced by the operator (a fresh pod, maybe elsewhere) rather than
        // restarted in place over and over (seed 000).
        restart_policy: Some("Never".to_string()),
        node_selector: (!node_selector.is_empty()).then_some(node_selector),
        affinity: group.affinity.clone().filter(|a| *a != Affinity::default()),
        tolerations: Some(tolerations(gpu_toleration, group.tolerations.as_ref())),
        topology_spread_constraints: Some(vec![spread]),
        termination_grace_period_seconds: group.termination_grace_period_seconds,
        automount_service_account_token: Some(false),
        volumes: Some(vec![Volume {
            name: "cache".to_string(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Default::default()
        }]),
        ..Default::default()
    };
    let hash = stable_hash(&serde_json::to_vec(&spec)?);
    let mut metadata = owner.meta(worker_pod_name(&owner.name, &group.name, index), labels);
    let mut annotations = prometheus_annotations(METRICS_PORT);
    annotations.insert(ANNOTATION_SPEC_HASH.to_string(), hash);
    metadata.annotations = Some(annotations);
    Ok(Pod {
        metadata,
        spec: Some(spec),
        status: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::Transport;
    use crate::render::testing;
    use k8s_openapi::api::core::v1::ResourceRequirements;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    fn container(p: &Pod) -> &Container {
        &p.spec.as_ref().unwrap().containers[0]
    }

    fn env_value<'a>(p: &'a Pod, name: &str) -> Option<&'a str> {
        container(p)
            .env
            .as_ref()?
            .iter()
            .find(|e| e.name == name)?
            .value
            .as_deref()
    }

    #[test]
    fn one_gpu_per_worker_with_requests_equal_limits() {
        let g = testing::group("a100", 2, "nvidia.com/gpu");
        let p = pod(&testing::cluster(vec![g.clone()]), &g, 1).unwrap();
        assert_eq!(p.metadata.name.as_deref(), Some("demo-a100-1"));
        let r = container(&p).resources.as_ref().unwrap();
        assert_eq!(r.limits.as_ref().unwrap()["nvidia.com/gpu"].0, "1");
        assert_eq!(r.requests.as_ref().unwrap()["nvidia.com/gpu"].0, "1");
        assert_eq!(r.limits, r.requests);
    }

    #[test]
    fn mig_slice_replaces_the_whole_gpu() {
        let g = testing::group("mig", 7, "nvidia.com/mig-1g.5gb");
        let p = pod(&testing::cluster(vec![g.clone()]), &g, 0).unwrap();
        let limits = container(&p)
            .resources
            .as_ref()
            .unwrap()
            .limits
            .clone()
            .unwrap();
        assert_eq!(limits["nvidia.com/mig-1g.5gb"].0, "1");
        assert!(!limits.contains_key("nvidia.com/gpu"));
    }

    #[test]
    fn flags_and_environment_derive_from_limits() {
        let mut g = testing::group("a100", 1, "nvidia.com/gpu");
        g.pool_fraction = 0.75;
        g.transport = Transport::Ucx;
        g.resources = Some(ResourceRequirements {
            limits: Some(BTreeMap::from([
                ("cpu".to_string(), Quantity("6500m".into())),
                ("memory".to_string(), Quantity("16Gi".into())),
            ])),
            ..Default::default()
        });
        let p = pod(&testing::cluster(vec![g.clone()]), &g, 0).unwrap();
        let args = container(&p).args.clone().unwrap();
        let flag = |name: &str| {
            let i = args.iter().position(|a| a == name).unwrap();
            args[i + 1].clone()
        };
        assert_eq!(args[0], "worker");
        assert_eq!(flag("--scheduler"), "http://demo-scheduler.data.svc:7070");
        assert_eq!(flag("--listen"), "0.0.0.0:7071");
        assert_eq!(flag("--slots"), "6");
        assert_eq!(flag("--id"), "$(WRK_WORKER_ID)");
        assert_eq!(flag("--metrics-listen"), "0.0.0.0:9090");
        assert_eq!(env_value(&p, "WRK_MEMORY_LIMIT_BYTES"), Some("17179869184"));
        assert_eq!(env_value(&p, "WRK_POOL_BYTES"), Some("12884901888"));
        assert_eq!(env_value(&p, "WRK_TRANSPORT"), Some("ucx"));
        assert_eq!(env_value(&p, "WRK_DEVICE"), Some("cuda"));
        let advertise = container(&p)
            .env
            .as_ref()
            .unwrap()
            .iter()
            .find(|e| e.name == "WRK_ADVERTISE_HOST")
            .unwrap();
        let field = advertise
            .value_from
            .as_ref()
            .unwrap()
            .field_ref
            .as_ref()
            .unwrap();
        assert_eq!(field.field_path, "status.podIP");
        // The memory limit the worker is told is the one the kubelet enforces.
        let limits = container(&p)
            .resources
            .as_ref()
            .unwrap()
            .limits
            .clone()
            .unwrap();
        assert_eq!(quantity::bytes(&limits["memory"].0).unwrap(), 17179869184);
    }

    #[test]
    fn probes_and_scrape_annotations_use_the_metrics_port() {
        let g = testing::group("a100", 1, "nvidia.com/gpu");
        let p = pod(&testing::cluster(vec![g.clone()]), &g, 0).unwrap();
        let c = container(&p);
        let ports: Vec<(&str, i32)> = c
            .ports
            .as_ref()
            .unwrap()
            .iter()
            .map(|p| (p.name.as_deref().unwrap(), p.container_port))
            .collect();
        assert_eq!(ports, [("data", 7071), ("metrics", 9090)]);
        for probe in [&c.readiness_probe, &c.liveness_probe] {
            let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
            assert_eq!(get.path.as_deref(), Some("/healthz"));
            assert_eq!(get.port, IntOrString::String("metrics".into()));
        }
        let annotations = p.metadata.annotations.as_ref().unwrap();
        assert_eq!(annotations["prometheus.io/scrape"], "true");
        assert_eq!(annotations["prometheus.io/port"], "9090");
        assert!(
            !c.env
                .as_ref()
                .unwrap()
                .iter()
                .any(|e| e.name == "WRK_WORKER_TOKEN")
        );
    }

    #[test]
    fn auth_gives_workers_the_worker_token_from_the_secret() {
        let g = testing::group("a100", 1, "nvidia.com/gpu");
        let mut cluster = testing::cluster(vec![g.clone()]);
        let mut auth = testing::auth("demo-tokens");
        auth.worker_token_key = "workers".to_string();
        cluster.spec.auth = Some(auth);
        let p = pod(&cluster, &g, 0).unwrap();
        let token = container(&p)
            .env
            .as_ref()
            .unwrap()
            .iter()
            .find(|e| e.name == "WRK_WORKER_TOKEN")
            .unwrap();
        assert!(token.value.is_none(), "never the token itself");
        let key = token
            .value_from
            .as_ref()
            .unwrap()
            .secret_key_ref
            .as_ref()
            .unwrap();
        assert_eq!(
            (key.name.as_str(), key.key.as_str()),
            ("demo-tokens", "workers")
        );
    }

    #[test]
    fn default_sizing_leaves_thirty_percent_headroom() {
        let g = testing::group("g", 1, "nvidia.com/gpu");
        let s = sizing(&g).unwrap();
        assert_eq!(s.memory_limit_bytes, 8 << 30);
        assert_eq!(s.pool_bytes, ((8u64 << 30) as f64 * 0.7) as u64);
        assert_eq!(s.slots, 2);
    }

    #[test]
    fn fractional_cpu_still_gets_one_slot() {
        let mut g = testing::group("g", 1, "nvidia.com/gpu");
        g.resources = Some(ResourceRequirements {
            limits: Some(BTreeMap::from([(
                "cpu".to_string(),
                Quantity("500m".into()),
            )])),
            ..Default::default()
        });
        assert_eq!(sizing(&g).unwrap().slots, 1);
    }

    #[test]
    fn bad_memory_quantity_is_an_error() {
        let mut g = testing::group("g", 1, "nvidia.com/gpu");
        g.resources = Some(ResourceRequirements {
            limits: Some(BTreeMap::from([(
                "memory".to_string(),
                Quantity("lots".into()),
            )])),
            ..Default::default()
        });
        assert!(matches!(sizing(&g), Err(Error::Quantity(_))));
    }

    #[test]
    fn product_selector_spread_and_labels() {
        let mut g = testing::group("a100", 1, "nvidia.com/gpu");
        g.gpu.product = Some("NVIDIA-A100-SXM4-80GB".to_string());
        g.node_selector = Some(BTreeMap::from([("pool".to_string(), "gpu".to_string())]));
        let p = pod(&testing::cluster(vec![g.clone()]), &g, 0).unwrap();
        let spec = p.spec.as_ref().unwrap();
        let selector = spec.node_selector.clone().unwrap();
        assert_eq!(selector["nvidia.com/gpu.product"], "NVIDIA-A100-SXM4-80GB");
        assert_eq!(selector["pool"], "gpu");
        let spread = &spec.topology_spread_constraints.as_ref().unwrap()[0];
        assert_eq!(spread.topology_key, "topology.kubernetes.io/zone");
        let labels = p.metadata.labels.clone().unwrap();
        assert_eq!(
            spread
                .label_selector
                .as_ref()
                .unwrap()
                .match_labels
                .as_ref(),
            Some(&labels)
        );
        assert_eq!(labels["wrk.dev/worker-group"], "a100");
        assert_eq!(labels["app.kubernetes.io/component"], "worker");
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    }

    #[test]
    fn spec_hash_changes_with_the_spec() {
        let g = testing::group("g", 1, "nvidia.com/gpu");
        let a = pod(&testing::cluster(vec![g.clone()]), &g, 0).unwrap();
        let mut cluster = testing::cluster(vec![g.clone()]);
        cluster.spec.image = "example.org/wrk:0.2.0".to_string();
        let b = pod(&cluster, &g, 0).unwrap();
        let hash = |p: &Pod| p.metadata.annotations.as_ref().unwrap()[ANNOTATION_SPEC_HASH].clone();
        assert_ne!(hash(&a), hash(&b));
        assert_eq!(
            hash(&a),
            hash(&pod(&testing::cluster(vec![g.clone()]), &g, 0).unwrap())
        );
    }
}

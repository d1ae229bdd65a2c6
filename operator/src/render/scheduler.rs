//! The scheduler: a one-replica Deployment (recreated, never two at once: it holds the cluster's
//! state) and a Service with its ports. Placed by default with a *preferred* affinity for nodes
//! labelled `dedicated=scheduler` (seed 002: the scheduler needs no large GPU node). Probes GET
//! `/healthz` on its HTTP port; with `auth`, it reads its tenants file from the cluster's Secret
//! and the worker token from the same Secret's key.

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy};
use k8s_openapi::api::core::v1::{
    Affinity, Container, KeyToPath, NodeAffinity, NodeSelectorRequirement, NodeSelectorTerm,
    PodSpec, PodTemplateSpec, PreferredSchedulingTerm, SecretVolumeSource, SecurityContext,
    Service, ServicePort, ServiceSpec, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{
    AUTH_DIR, DASHBOARD_PORT, GRPC_PORT, METRICS_PORT, Owner, TENANTS_FILE, common_labels,
    component_selector, container_port, env_from_secret, healthz_probe, prometheus_annotations,
    resources_with_defaults, scheduler_name, tolerations,
};
use crate::Error;
use crate::crd::WrkCluster;

pub const COMPONENT: &str = "scheduler";
/// The node label (and taint) of a node pool dedicated to schedulers.
pub const DEDICATED_KEY: &str = "dedicated";
pub const DEDICATED_VALUE: &str = "scheduler";

/// Nodes labelled `dedicated=scheduler` preferred, any node accepted.
pub fn default_affinity() -> Affinity {
    Affinity {
        node_affinity: Some(NodeAffinity {
            preferred_during_scheduling_ignored_during_execution: Some(vec![
                PreferredSchedulingTerm {
                    weight: 100,
                    preference: NodeSelectorTerm {
                        match_expressions: Some(vec![NodeSelectorRequirement {
                            key: DEDICATED_KEY.to_string(),
                            operator: "In".to_string(),
                            values: Some(vec![DEDICATED_VALUE.to_string()]),
                        }]),
                        ..Default::default()
                    },
                },
            ]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The scheduler Deployment of a cluster.
pub fn deployment(cluster: &WrkCluster) -> Result<Deployment, Error> {
    let owner = Owner::of(cluster)?;
    let spec = &cluster.spec.scheduler;
    let labels = common_labels(&owner.name, COMPONENT);
    let mut args = vec![
        "scheduler".to_string(),
        "--listen".to_string(),
        format!("0.0.0.0:{GRPC_PORT}"),
        "--http-listen".to_string(),
        format!("0.0.0.0:{DASHBOARD_PORT}"),
    ];
    let mut env = Vec::new();
    let mut mounts = Vec::new();
    let mut volumes = Vec::new();
    if cluster.spec.auth.is_none() {
        // A scheduler without tenants refuses a non-loopback address unless told so: a cluster
        // without `auth` is open by the user's choice, and its manifest says so.
        args.push("--insecure-no-auth".to_string());
    }
    if let Some(auth) = &cluster.spec.auth {
        args.push("--tenants".to_string());
        args.push(format!("{AUTH_DIR}/{TENANTS_FILE}"));
        env.push(env_from_secret("WRK_WORKER_TOKEN", &auth.worker_token()));
        volumes.push(Volume {
            name: "auth".to_string(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(auth.secret_name.clone()),
                items: Some(vec![KeyToPath {
                    key: auth.tenants_key.clone(),
                    path: TENANTS_FILE.to_string(),
                    ..Default::default()
                }]),
                default_mode: Some(0o400),
                ..Default::default()
            }),
            ..Default::default()
        });
        mounts.push(VolumeMount {
            name: "auth".to_string(),
            mount_path: AUTH_DIR.to_string(),
            read_only: Some(true),
            ..Default::default()
        });
    }
    let container = Container {
        name: COMPONENT.to_string(),
        image: Some(cluster.spec.image.clone()),
        image_pull_policy: cluster.spec.image_pull_policy.clone(),
        args: Some(args),
        env: (!env.is_empty()).then_some(env),
        // One HTTP listener serves the dashboard, /metrics and /healthz.
        ports: Some(vec![
            container_port("grpc", GRPC_PORT),
            container_port("http", DASHBOARD_PORT),
        ]),
        resources: Some(resources_with_defaults(
            spec.resources.as_ref(),
            "1",
            "1Gi",
            &[],
        )),
        readiness_probe: Some(healthz_probe("http", 5, 0)),
        liveness_probe: Some(healthz_probe("http", 10, 10)),
        volume_mounts: (!mounts.is_empty()).then_some(mounts),
        security_context: Some(restricted_security_context()),
        ..Default::default()
    };
    let toleration = Toleration {
        key: Some(DEDICATED_KEY.to_string()),
        operator: Some("Equal".to_string()),
        value: Some(DEDICATED_VALUE.to_string()),
        effect: Some("NoSchedule".to_string()),
        ..Default::default()
    };
    Ok(Deployment {
        metadata: owner.meta(scheduler_name(&owner.name), labels.clone()),
        spec: DeploymentSpec {
            replicas: Some(1),
            selector: LabelSelector {
                match_labels: Some(component_selector(&owner.name, COMPONENT)),
                ..Default::default()
            },
            strategy: Some(DeploymentStrategy {
                type_: Some("Recreate".to_string()),
                ..Default::default()
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    annotations: Some(prometheus_annotations(DASHBOARD_PORT)),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    volumes: (!volumes.is_empty()).then_some(volumes),
                    node_selector: spec.node_selector.clone(),
                    affinity: Some(spec.affinity.clone().unwrap_or_else(default_affinity)),
                    tolerations: Some(tolerations(toleration, spec.tolerations.as_ref())),
                    termination_grace_period_seconds: spec.termination_grace_period_seconds,
                    automount_service_account_token: Some(false),
                    ..Default::default()
                }),
            },
            ..Default::default()
        },
        status: None,
    })
}

/// Non-root, no privilege escalation, read-only root file system, no capabilities.
pub(crate) fn restricted_security_context() -> SecurityContext {
    SecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(65532),
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        capabilities: Some(k8s_openapi::api::core::v1::Capabilities {
            drop: Some(vec!["ALL".to_string()]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The scheduler Service: gRPC for workers and clients, the dashboard, and the metrics port (the
/// same HTTP listener as the dashboard, named `metrics` for service monitors), with Prometheus'
/// scrape annotations.
pub fn service(cluster: &WrkCluster) -> Result<Service, Error> {
    let owner = Owner::of(cluster)?;
    let service_port = |name: &str, number: i32, target: &str| ServicePort {
        name: Some(name.to_string()),
        port: number,
        target_port: Some(IntOrString::String(target.to_string())),
        // Server-side apply (1.20 at least) rejects Service ports without a protocol.
        protocol: Some("TCP".to_string()),
        ..Default::default()
    };
    let mut metadata = owner.meta(
        scheduler_name(&owner.name),
        common_labels(&owner.name, COMPONENT),
    );
    metadata.annotations = Some(prometheus_annotations(METRICS_PORT));
    Ok(Service {
        metadata,
        spec: Some(ServiceSpec {
            type_: Some(cluster.spec.scheduler.service_type.as_str().to_string()),
            selector: Some(component_selector(&owner.name, COMPONENT)),
            ports: Some(vec![
                service_port("grpc", GRPC_PORT, "grpc"),
                service_port("dashboard", DASHBOARD_PORT, "http"),
                service_port("metrics", METRICS_PORT, "http"),
            ]),
            ..Default::default()
        }),
        status: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::ServiceType;
    use crate::render::testing;

    #[test]
    fn deployment_runs_the_scheduler_command() {
        let cluster = testing::cluster(vec![]);
        let d = deployment(&cluster).unwrap();
        assert_eq!(d.metadata.name.as_deref(), Some("demo-scheduler"));
        assert_eq!(d.metadata.namespace.as_deref(), Some("data"));
        let owner = &d.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(owner.kind, "WrkCluster");
        assert_eq!(owner.controller, Some(true));
        let pod = d.spec.template.spec.unwrap();
        let c = &pod.containers[0];
        assert_eq!(
            c.args.as_ref().unwrap(),
            &[
                "scheduler",
                "--listen",
                "0.0.0.0:7070",
                "--http-listen",
                "0.0.0.0:8787",
                "--insecure-no-auth"
            ]
        );
        assert_eq!(c.image.as_deref(), Some("example.org/wrk:0.1.0"));
        for probe in [&c.readiness_probe, &c.liveness_probe] {
            let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
            assert_eq!(get.path.as_deref(), Some("/healthz"));
            assert_eq!(get.port, IntOrString::String("http".into()));
        }
        let http = c
            .ports
            .as_ref()
            .unwrap()
            .iter()
            .find(|p| p.name.as_deref() == Some("http"))
            .unwrap();
        assert_eq!(http.container_port, 8787);
        let annotations = d.spec.template.metadata.unwrap().annotations.unwrap();
        assert_eq!(annotations["prometheus.io/scrape"], "true");
        assert_eq!(annotations["prometheus.io/port"], "8787");
        assert_eq!(annotations["prometheus.io/path"], "/metrics");
        assert!(
            c.env.is_none() && pod.volumes.is_none(),
            "no auth, no secrets"
        );
        assert_eq!(d.spec.replicas, Some(1));
        assert_eq!(d.spec.strategy.unwrap().type_.as_deref(), Some("Recreate"));
    }

    #[test]
    fn auth_mounts_the_tenants_file_and_reads_the_worker_token_from_the_secret() {
        let mut cluster = testing::cluster(vec![]);
        cluster.spec.auth = Some(testing::auth("demo-tokens"));
        let d = deployment(&cluster).unwrap();
        let pod = d.spec.template.spec.unwrap();
        let c = &pod.containers[0];
        let args = c.args.as_ref().unwrap();
        let tenants = args.iter().position(|a| a == "--tenants").unwrap();
        assert_eq!(args[tenants + 1], "/etc/wrk/auth/tenants.toml");
        let env = &c.env.as_ref().unwrap()[0];
        assert_eq!(env.name, "WRK_WORKER_TOKEN");
        let key = env
            .value_from
            .as_ref()
            .unwrap()
            .secret_key_ref
            .as_ref()
            .unwrap();
        assert_eq!(
            (key.name.as_str(), key.key.as_str()),
            ("demo-tokens", "worker-token")
        );
        let volume = &pod.volumes.unwrap()[0];
        let secret = volume.secret.as_ref().unwrap();
        assert_eq!(secret.secret_name.as_deref(), Some("demo-tokens"));
        let item = &secret.items.as_ref().unwrap()[0];
        assert_eq!(
            (item.key.as_str(), item.path.as_str()),
            ("tenants.toml", "tenants.toml")
        );
        let mount = &c.volume_mounts.as_ref().unwrap()[0];
        assert_eq!(mount.mount_path, "/etc/wrk/auth");
        assert_eq!(mount.name, volume.name);
    }

    #[test]
    fn selector_matches_template_labels() {
        let d = deployment(&testing::cluster(vec![])).unwrap();
        let selector = d.spec.selector.match_labels.unwrap();
        let labels = d.spec.template.metadata.unwrap().labels.unwrap();
        for (k, v) in &selector {
            assert_eq!(labels.get(k), Some(v));
        }
        assert_eq!(labels["app.kubernetes.io/component"], "scheduler");
        assert_eq!(labels["wrk.dev/cluster"], "demo");
    }

    #[test]
    fn default_placement_prefers_dedicated_scheduler_nodes() {
        let d = deployment(&testing::cluster(vec![])).unwrap();
        let pod = d.spec.template.spec.unwrap();
        let node = pod.affinity.unwrap().node_affinity.unwrap();
        assert!(
            node.required_during_scheduling_ignored_during_execution
                .is_none()
        );
        let preferred = node
            .preferred_during_scheduling_ignored_during_execution
            .unwrap();
        let expr = &preferred[0].preference.match_expressions.as_ref().unwrap()[0];
        assert_eq!(expr.key, "dedicated");
        assert_eq!(expr.values.as_ref().unwrap(), &["scheduler"]);
        let tolerations = pod.tolerations.unwrap();
        assert_eq!(tolerations[0].key.as_deref(), Some("dedicated"));
    }

    #[test]
    fn given_affinity_replaces_the_default() {
        let mut cluster = testing::cluster(vec![]);
        cluster.spec.scheduler.affinity = Some(Affinity::default());
        let d = deployment(&cluster).unwrap();
        assert_eq!(
            d.spec.template.spec.unwrap().affinity,
            Some(Affinity::default())
        );
    }

    #[test]
    fn service_ports_all_have_protocols() {
        let mut cluster = testing::cluster(vec![]);
        cluster.spec.scheduler.service_type = ServiceType::LoadBalancer;
        let s = service(&cluster).unwrap();
        let spec = s.spec.unwrap();
        assert_eq!(spec.type_.as_deref(), Some("LoadBalancer"));
        let ports = spec.ports.unwrap();
        assert_eq!(ports.len(), 3);
        assert!(ports.iter().all(|p| p.protocol.as_deref() == Some("TCP")));
        let named: Vec<(&str, i32, IntOrString)> = ports
            .iter()
            .map(|p| {
                (
                    p.name.as_deref().unwrap(),
                    p.port,
                    p.target_port.clone().unwrap(),
                )
            })
            .collect();
        let by_name = |n: &str| IntOrString::String(n.to_string());
        assert_eq!(
            named,
            [
                ("grpc", 7070, by_name("grpc")),
                ("dashboard", 8787, by_name("http")),
                ("metrics", 9090, by_name("http")),
            ]
        );
        assert_eq!(
            s.metadata.annotations.unwrap()["prometheus.io/port"],
            "9090"
        );
        assert_eq!(
            spec.selector.unwrap()["app.kubernetes.io/component"],
            "scheduler"
        );
    }
}

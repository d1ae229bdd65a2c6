//! The scheduler: a one-replica Deployment (recreated, never two at once: it holds the cluster's
//! state) and a Service with its ports. Placed by default with a *preferred* affinity for nodes
//! labelled `dedicated=scheduler` (seed 002: the scheduler needs no large GPU node).

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy};
use k8s_openapi::api::core::v1::{
    Affinity, Container, ContainerPort, NodeAffinity, NodeSelectorRequirement, NodeSelectorTerm,
    PodSpec, PodTemplateSpec, PreferredSchedulingTerm, Probe, SecurityContext, Service,
    ServicePort, ServiceSpec, TCPSocketAction, Toleration,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{
    DASHBOARD_PORT, GRPC_PORT, METRICS_PORT, Owner, common_labels, component_selector,
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

fn tcp_probe(port: &str, period: i32) -> Probe {
    Probe {
        tcp_socket: Some(TCPSocketAction {
            port: IntOrString::String(port.to_string()),
            ..Default::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(3),
        ..Default::default()
    }
}

fn port(name: &str, number: i32) -> ContainerPort {
    ContainerPort {
        name: Some(name.to_string()),
        container_port: number,
        protocol: Some("TCP".to_string()),
        ..Default::default()
    }
}

/// The scheduler Deployment of a cluster.
pub fn deployment(cluster: &WrkCluster) -> Result<Deployment, Error> {
    let owner = Owner::of(cluster)?;
    let spec = &cluster.spec.scheduler;
    let labels = common_labels(&owner.name, COMPONENT);
    let container = Container {
        name: COMPONENT.to_string(),
        image: Some(cluster.spec.image.clone()),
        image_pull_policy: cluster.spec.image_pull_policy.clone(),
        args: Some(vec![
            "scheduler".to_string(),
            "--listen".to_string(),
            format!("0.0.0.0:{GRPC_PORT}"),
        ]),
        ports: Some(vec![
            port("grpc", GRPC_PORT),
            port("dashboard", DASHBOARD_PORT),
            port("metrics", METRICS_PORT),
        ]),
        resources: Some(resources_with_defaults(
            spec.resources.as_ref(),
            "1",
            "1Gi",
            &[],
        )),
        // The gRPC listener is the endpoint the scheduler serves today: it accepts connections
        // once the scheduler is up.
        readiness_probe: Some(tcp_probe("grpc", 5)),
        liveness_probe: Some(Probe {
            initial_delay_seconds: Some(10),
            ..tcp_probe("grpc", 10)
        }),
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
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![container],
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

/// The scheduler Service: gRPC for workers and clients, plus the dashboard and metrics ports.
pub fn service(cluster: &WrkCluster) -> Result<Service, Error> {
    let owner = Owner::of(cluster)?;
    let service_port = |name: &str, number: i32| ServicePort {
        name: Some(name.to_string()),
        port: number,
        target_port: Some(IntOrString::String(name.to_string())),
        // Server-side apply (1.20 at least) rejects Service ports without a protocol.
        protocol: Some("TCP".to_string()),
        ..Default::default()
    };
    Ok(Service {
        metadata: owner.meta(
            scheduler_name(&owner.name),
            common_labels(&owner.name, COMPONENT),
        ),
        spec: Some(ServiceSpec {
            type_: Some(cluster.spec.scheduler.service_type.as_str().to_string()),
            selector: Some(component_selector(&owner.name, COMPONENT)),
            ports: Some(vec![
                service_port("grpc", GRPC_PORT),
                service_port("dashboard", DASHBOARD_PORT),
                service_port("metrics", METRICS_PORT),
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
            &["scheduler", "--listen", "0.0.0.0:7070"]
        );
        assert_eq!(c.image.as_deref(), Some("example.org/wrk:0.1.0"));
        let probe = c
            .readiness_probe
            .as_ref()
            .unwrap()
            .tcp_socket
            .as_ref()
            .unwrap();
        assert_eq!(probe.port, IntOrString::String("grpc".into()));
        assert_eq!(d.spec.replicas, Some(1));
        assert_eq!(d.spec.strategy.unwrap().type_.as_deref(), Some("Recreate"));
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
        assert_eq!(ports[0].port, 7070);
        assert_eq!(
            spec.selector.unwrap()["app.kubernetes.io/component"],
            "scheduler"
        );
    }
}

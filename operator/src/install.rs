//! What installs the operator: the two CRDs, and its namespace, service account, RBAC and
//! Deployment. `wrk operator crds` / `wrk operator manifests` print these, and the Helm chart under
//! `operator/chart/` holds the same content (checked by the tests).

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Container, EnvVar, Namespace, PodSpec, PodTemplateSpec, ResourceRequirements, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::CustomResourceExt;
use serde::Serialize;

use crate::Error;
use crate::crd::{GROUP, WrkCluster, WrkJob};
use crate::render::scheduler::restricted_security_context;
use crate::render::{LABEL_COMPONENT, LABEL_NAME};

/// The operator's name: its ServiceAccount, ClusterRole(Binding) and Deployment.
pub const OPERATOR_NAME: &str = "wrk-operator";

/// Settings of the rendered operator installation.
#[derive(Debug, Clone)]
pub struct InstallOptions {
    pub namespace: String,
    pub image: String,
    pub pending_timeout_secs: u64,
}

/// The CRDs of `WrkCluster` and `WrkJob`.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![WrkCluster::crd(), WrkJob::crd()]
}

fn labels() -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_NAME.to_string(), OPERATOR_NAME.to_string()),
        (LABEL_COMPONENT.to_string(), "operator".to_string()),
    ])
}

fn meta(name: &str, namespace: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        namespace: namespace.map(String::from),
        labels: Some(labels()),
        ..Default::default()
    }
}

fn rule(groups: &[&str], resources: &[&str], verbs: &[&str]) -> PolicyRule {
    let strings = |items: &[&str]| Some(items.iter().map(|s| s.to_string()).collect());
    PolicyRule {
        api_groups: strings(groups),
        resources: strings(resources),
        verbs: verbs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// What the controllers touch, and nothing more.
pub fn cluster_role() -> ClusterRole {
    const MANAGE: &[&str] = &[
        "get", "list", "watch", "create", "update", "patch", "delete",
    ];
    ClusterRole {
        metadata: meta(OPERATOR_NAME, None),
        rules: Some(vec![
            rule(&[GROUP], &["wrkclusters", "wrkjobs"], MANAGE),
            rule(
                &[GROUP],
                &["wrkclusters/status", "wrkjobs/status"],
                &["get", "update", "patch"],
            ),
            // Owner references with blockOwnerDeletion need this where the admission plugin
            // OwnerReferencesPermissionEnforcement is on.
            rule(
                &[GROUP],
                &["wrkclusters/finalizers", "wrkjobs/finalizers"],
                &["update"],
            ),
            rule(&["apps"], &["deployments"], MANAGE),
            rule(&[""], &["services", "pods"], MANAGE),
            rule(&["batch"], &["jobs"], MANAGE),
            rule(&[""], &["events"], &["get", "list", "watch"]),
            // The client token of a cluster's `auth` Secret, read by name: never listed.
            rule(&[""], &["secrets"], &["get"]),
        ]),
        ..Default::default()
    }
}

/// The operator's namespace, service account, RBAC and Deployment.
pub fn operator_manifests(options: &InstallOptions) -> Result<Vec<serde_json::Value>, Error> {
    let ns = options.namespace.as_str();
    let namespace = Namespace {
        metadata: meta(ns, None),
        ..Default::default()
    };
    let account = ServiceAccount {
        metadata: meta(OPERATOR_NAME, Some(ns)),
        ..Default::default()
    };
    let binding = ClusterRoleBinding {
        metadata: meta(OPERATOR_NAME, None),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".to_string()),
            kind: "ClusterRole".to_string(),
            name: OPERATOR_NAME.to_string(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".to_string(),
            name: OPERATOR_NAME.to_string(),
            namespace: Some(ns.to_string()),
            ..Default::default()
        }]),
    };
    let quantities = |cpu: &str, memory: &str| {
        Some(BTreeMap::from([
            ("cpu".to_string(), Quantity(cpu.to_string())),
            ("memory".to_string(), Quantity(memory.to_string())),
        ]))
    };
    let deployment = Deployment {
        metadata: meta(OPERATOR_NAME, Some(ns)),
        spec: DeploymentSpec {
            replicas: Some(1),
            selector: LabelSelector {
                match_labels: Some(labels()),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels()),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(OPERATOR_NAME.to_string()),
                    containers: vec![Container {
                        name: "operator".to_string(),
                        image: Some(options.image.clone()),
                        args: Some(vec![
                            "operator".to_string(),
                            "run".to_string(),
                            "--pending-timeout-secs".to_string(),
                            options.pending_timeout_secs.to_string(),
                        ]),
                        env: Some(vec![EnvVar {
                            name: "WRK_LOG".to_string(),
                            value: Some("info".to_string()),
                            ..Default::default()
                        }]),
                        resources: Some(ResourceRequirements {
                            requests: quantities("100m", "128Mi"),
                            limits: quantities("500m", "256Mi"),
                            ..Default::default()
                        }),
                        security_context: Some(restricted_security_context()),
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
            },
            ..Default::default()
        },
        status: None,
    };
    Ok(vec![
        serde_json::to_value(&namespace)?,
        serde_json::to_value(&account)?,
        serde_json::to_value(cluster_role())?,
        serde_json::to_value(&binding)?,
        serde_json::to_value(&deployment)?,
    ])
}

/// Objects as one YAML stream (`---` between documents).
pub fn to_yaml<T: Serialize>(objects: &[T]) -> Result<String, Error> {
    let mut out = String::new();
    for object in objects {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(object).map_err(|e| Error::Yaml(e.to_string()))?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> InstallOptions {
        InstallOptions {
            namespace: "wrk-system".to_string(),
            image: "example.org/wrk:0.1.0".to_string(),
            pending_timeout_secs: 120,
        }
    }

    #[test]
    fn crds_have_status_printer_columns_and_short_names() {
        let crds = crds();
        assert_eq!(
            crds[0].metadata.name.as_deref(),
            Some("wrkclusters.wrk.dev")
        );
        assert_eq!(crds[1].metadata.name.as_deref(), Some("wrkjobs.wrk.dev"));
        let version = &crds[0].spec.versions[0];
        assert!(version.subresources.as_ref().unwrap().status.is_some());
        let columns: Vec<&str> = version
            .additional_printer_columns
            .as_ref()
            .unwrap()
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(
            columns,
            ["Ready", "Workers", "Desired", "Pending", "Scheduler", "Age"]
        );
        assert_eq!(crds[0].spec.names.short_names.as_ref().unwrap(), &["wrkc"]);
        let schema = serde_json::to_value(&version.schema).unwrap();
        let status = &schema["openAPIV3Schema"]["properties"]["status"]["properties"];
        assert!(status["observedGeneration"].is_object());
        assert!(status["conditions"].is_object());
        let pool = &schema["openAPIV3Schema"]["properties"]["spec"]["properties"]["workerGroups"]["items"]
            ["properties"]["poolFraction"];
        assert_eq!(pool["maximum"], 0.95);
    }

    #[test]
    fn manifests_bind_the_role_to_the_operator_account() {
        let objects = operator_manifests(&options()).unwrap();
        let kinds: Vec<&str> = objects
            .iter()
            .map(|o| o["kind"].as_str().unwrap())
            .collect();
        assert_eq!(
            kinds,
            [
                "Namespace",
                "ServiceAccount",
                "ClusterRole",
                "ClusterRoleBinding",
                "Deployment"
            ]
        );
        assert_eq!(objects[3]["subjects"][0]["namespace"], "wrk-system");
        assert_eq!(objects[3]["roleRef"]["name"], "wrk-operator");
        let pod = &objects[4]["spec"]["template"]["spec"];
        assert_eq!(pod["serviceAccountName"], "wrk-operator");
        assert_eq!(pod["containers"][0]["args"][0], "operator");
        assert_eq!(pod["containers"][0]["args"][3], "120");
    }

    #[test]
    fn role_covers_what_the_controllers_touch() {
        let rules = cluster_role().rules.unwrap();
        let allows = |group: &str, resource: &str, verb: &str| {
            rules.iter().any(|r| {
                r.api_groups.as_ref().unwrap().iter().any(|g| g == group)
                    && r.resources.as_ref().unwrap().iter().any(|x| x == resource)
                    && r.verbs.iter().any(|v| v == verb)
            })
        };
        assert!(allows("wrk.dev", "wrkclusters/status", "patch"));
        assert!(allows("", "pods", "delete"));
        assert!(allows("apps", "deployments", "patch"));
        assert!(allows("", "events", "list"));
        assert!(allows("batch", "jobs", "create"));
        assert!(allows("", "secrets", "get"));
        assert!(!allows("", "secrets", "list"));
        assert!(!allows("", "secrets", "watch"));
    }

    #[test]
    fn yaml_stream_round_trips() {
        let yaml = to_yaml(&crds()).unwrap();
        assert_eq!(yaml.matches("---\n").count(), 2);
        let docs: Vec<serde_json::Value> = yaml
            .split("---\n")
            .filter(|d| !d.trim().is_empty())
            .map(|d| serde_saphyr::from_str(d).unwrap())
            .collect();
        assert_eq!(docs[0], serde_json::to_value(&crds()[0]).unwrap());
    }
}

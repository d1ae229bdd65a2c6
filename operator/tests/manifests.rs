//! Every manifest the operator renders, validated offline: built-in objects with PyPI's
//! `kubernetes-validate --strict`, and `WrkCluster` / `WrkJob` instances against the generated CRD
//! schema (JSON Schema, with the `jsonschema` package kubernetes-validate brings). Each check is
//! also shown to reject a broken object, so a pass means something.
//!
//! Needs `python3` and PyPI: the virtual environment is created once under the target directory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::CustomResourceExt;
use wrk_operator::crd::{
    AuthSpec, AutoscalingSpec, GpuSpec, JobSource, SecretKeyRef, Transport, WorkerGroupSpec,
    WrkCluster, WrkClusterSpec, WrkJob, WrkJobSpec,
};
use wrk_operator::install::{self, InstallOptions};
use wrk_operator::render;

const KUBERNETES_VALIDATE: &str = "kubernetes-validate==1.37.0";

fn venv() -> &'static Path {
    static VENV: OnceLock<PathBuf> = OnceLock::new();
    VENV.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kubernetes-validate-venv");
        if !dir.join("bin/kubernetes-validate").exists() {
            eprintln!(
                "creating a virtualenv with {KUBERNETES_VALIDATE} in {}",
                dir.display()
            );
            let ok = Command::new("python3")
                .args(["-m", "venv"])
                .arg(&dir)
                .status()
                .expect("run python3 -m venv")
                .success();
            assert!(ok, "python3 -m venv failed");
            let ok = Command::new(dir.join("bin/pip"))
                .args(["install", "--quiet", KUBERNETES_VALIDATE])
                .status()
                .expect("run pip")
                .success();
            assert!(ok, "pip install {KUBERNETES_VALIDATE} failed");
        }
        dir
    })
}

fn sample_cluster() -> WrkCluster {
    let limits = |cpu: &str, memory: &str| ResourceRequirements {
        limits: Some(BTreeMap::from([
            ("cpu".to_string(), Quantity(cpu.to_string())),
            ("memory".to_string(), Quantity(memory.to_string())),
        ])),
        ..Default::default()
    };
    let group = |name: &str, resource: &str| WorkerGroupSpec {
        name: name.to_string(),
        replicas: 2,
        gpu: GpuSpec {
            resource: resource.to_string(),
            product: Some("NVIDIA-A100-SXM4-80GB".to_string()),
        },
        node_selector: None,
        affinity: None,
        tolerations: None,
        pool_fraction: 0.75,
        transport: Transport::Ucx,
        resources: Some(limits("8", "64Gi")),
        autoscaling: Some(AutoscalingSpec {
            min_replicas: 1,
            max_replicas: 8,
        }),
        termination_grace_period_seconds: Some(30),
    };
    let mut cluster = WrkCluster::new(
        "taxi",
        WrkClusterSpec {
            image: "registry.example/wrk:0.1.0".to_string(),
            image_pull_policy: Some("IfNotPresent".to_string()),
            scheduler: Default::default(),
            worker_groups: vec![
                group("a100", "nvidia.com/gpu"),
                group("mig", "nvidia.com/mig-1g.10gb"),
            ],
            idle_timeout_seconds: Some(1800),
            auth: Some(AuthSpec {
                secret_name: "taxi-tokens".to_string(),
                tenants_key: "tenants.toml".to_string(),
                worker_token_key: "worker-token".to_string(),
                client_token_key: "client-token".to_string(),
            }),
        },
    );
    cluster.metadata.namespace = Some("data".to_string());
    cluster.metadata.uid = Some("0b6f1f62-5a39-4c1c-a5b5-0c1b7b0e7d11".to_string());
    cluster
}

fn sample_job(cluster: &WrkCluster) -> WrkJob {
    let mut job = WrkJob::new(
        "taxi-2024",
        WrkJobSpec {
            image: None,
            source: JobSource {
                config_map: Some("taxi-job".to_string()),
                job_file: "job.toml".to_string(),
            },
            cluster: None,
            ephemeral_cluster: Some(cluster.spec.clone()),
            params: BTreeMap::from([("year".to_string(), "2024".to_string())]),
            token: Some(SecretKeyRef {
                name: "alice".to_string(),
                key: "token".to_string(),
            }),
            deadline_seconds: Some(3600),
            ttl_seconds_after_finished: Some(600),
        },
    );
    job.metadata.namespace = Some("data".to_string());
    job.metadata.uid = Some("6c1e8a1e-2f7a-4b55-9f0c-1b8f4a3c2d10".to_string());
    job
}

/// Every built-in object the operator renders or installs.
fn rendered_objects() -> Vec<(String, serde_json::Value)> {
    let cluster = sample_cluster();
    let job = sample_job(&cluster);
    let mut objects: Vec<(String, serde_json::Value)> = Vec::new();
    let mut push = |name: &str, value: serde_json::Value| objects.push((name.to_string(), value));
    for crd in install::crds() {
        push("crd", serde_json::to_value(&crd).unwrap());
    }
    let manifests = install::operator_manifests(&InstallOptions {
        namespace: "wrk-system".to_string(),
        image: "registry.example/wrk:0.1.0".to_string(),
        pending_timeout_secs: 120,
    })
    .unwrap();
    for m in manifests {
        push("operator", m);
    }
    push(
        "scheduler-deployment",
        serde_json::to_value(render::scheduler::deployment(&cluster).unwrap()).unwrap(),
    );
    push(
        "scheduler-service",
        serde_json::to_value(render::scheduler::service(&cluster).unwrap()).unwrap(),
    );
    for group in &cluster.spec.worker_groups {
        let pod = render::worker::pod(&cluster, group, 0).unwrap();
        push("worker-pod", serde_json::to_value(pod).unwrap());
    }
    push(
        "submit-job",
        serde_json::to_value(render::job::submit_job(&job, &cluster, Some(3600)).unwrap()).unwrap(),
    );
    objects
}

fn write_files(dir: &Path, objects: &[(String, serde_json::Value)]) -> Vec<PathBuf> {
    objects
        .iter()
        .enumerate()
        .map(|(i, (name, value))| {
            let path = dir.join(format!("{i:02}-{name}.yaml"));
            std::fs::write(
                &path,
                install::to_yaml(std::slice::from_ref(value)).unwrap(),
            )
            .unwrap();
            path
        })
        .collect()
}

fn kubernetes_validate(files: &[PathBuf]) -> (bool, String) {
    let output = Command::new(venv().join("bin/kubernetes-validate"))
        .arg("--strict")
        .args(files)
        .output()
        .expect("run kubernetes-validate");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

#[test]
fn rendered_manifests_pass_kubernetes_validate_strict() {
    let dir = tempfile::tempdir().unwrap();
    let objects = rendered_objects();
    let files = write_files(dir.path(), &objects);
    let (ok, text) = kubernetes_validate(&files);
    assert!(ok, "kubernetes-validate --strict failed:\n{text}");
    assert_eq!(
        text.matches(" passed for resource ").count(),
        files.len(),
        "every file validated:\n{text}"
    );

    // The same check rejects an unknown field (strict) in a rendered pod.
    let mut pod = objects
        .iter()
        .find(|(n, _)| n == "worker-pod")
        .unwrap()
        .1
        .clone();
    pod["spec"]["containers"][0]["gpus"] = serde_json::json!(1);
    let bad = write_files(dir.path(), &[("bad-pod".to_string(), pod)]);
    let (ok, text) = kubernetes_validate(&bad);
    assert!(!ok, "a pod with an unknown field passed:\n{text}");
}

/// Validates `instance` against the schema of `crd` with Python's jsonschema.
fn schema_check(crd: &serde_json::Value, instance: &serde_json::Value) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    std::fs::write(dir.path().join("schema.json"), schema.to_string()).unwrap();
    std::fs::write(dir.path().join("instance.json"), instance.to_string()).unwrap();
    let script = "import json, sys, jsonschema\n\
        schema = json.load(open(sys.argv[1])); instance = json.load(open(sys.argv[2]))\n\
        errors = list(jsonschema.Draft4Validator(schema).iter_errors(instance))\n\
        [print(e.json_path, e.message) for e in errors]\n\
        sys.exit(1 if errors else 0)\n";
    let output = Command::new(venv().join("bin/python"))
        .args(["-c", script])
        .arg(dir.path().join("schema.json"))
        .arg(dir.path().join("instance.json"))
        .output()
        .expect("run python");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr),
    )
}

#[test]
fn custom_resources_match_the_generated_crd_schema() {
    let cluster = sample_cluster();
    let job = sample_job(&cluster);
    let cluster_crd = serde_json::to_value(WrkCluster::crd()).unwrap();
    let job_crd = serde_json::to_value(WrkJob::crd()).unwrap();
    let cluster_value = serde_json::to_value(&cluster).unwrap();
    let (ok, text) = schema_check(&cluster_crd, &cluster_value);
    assert!(ok, "WrkCluster does not match its schema:\n{text}");
    let (ok, text) = schema_check(&job_crd, &serde_json::to_value(&job).unwrap());
    assert!(ok, "WrkJob does not match its schema:\n{text}");

    // The schema enforces the pool fraction's bounds and the transport's values.
    let mut bad = cluster_value.clone();
    bad["spec"]["workerGroups"][0]["poolFraction"] = serde_json::json!(1.5);
    bad["spec"]["workerGroups"][1]["transport"] = serde_json::json!("carrier-pigeon");
    let (ok, text) = schema_check(&cluster_crd, &bad);
    assert!(!ok, "an out-of-bounds WrkCluster passed");
    assert!(
        text.contains("poolFraction") && text.contains("transport"),
        "{text}"
    );
}

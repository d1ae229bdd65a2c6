//! The operator against a real Kubernetes control plane: etcd, kube-apiserver, kube-scheduler and
//! kube-controller-manager built from Debian's `kubernetes` source package by
//! `operator/testenv/k8s.sh` (once, into a cache: the first run takes ~20 minutes) and started on
//! 127.0.0.1. Fake GPU nodes (no kubelet: pods are bound but never run) let the real scheduler place
//! the pods the operator (`wrk operator run`, the real binary) creates:
//!
//! - the CRDs printed by `wrk operator crds` are accepted and established;
//! - a `WrkCluster` gets its scheduler Deployment and Service and its worker pods; the scheduler pod
//!   lands on the `dedicated=scheduler` node, each worker holds exactly one GPU (or MIG slice) and
//!   the worker that finds no GPU left shows in the cluster's status with the scheduler's
//!   `FailedScheduling ... Insufficient nvidia.com/gpu`;
//! - scaling a group down deletes pods; an invalid spec is reported, not applied;
//! - a `WrkJob` with an ephemeral cluster creates that cluster and waits for its scheduler;
//! - deleting a `WrkCluster` (or a `WrkJob`) garbage-collects everything it owns.

mod common;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use wrk_operator::crd::{WrkCluster, WrkJob};

const NAMESPACE: &str = "default";

fn script() -> PathBuf {
    common::workspace_root().join("operator/testenv/k8s.sh")
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A running control plane, stopped (by the process ids the script recorded) on drop.
struct ControlPlane {
    dir: tempfile::TempDir,
}

impl ControlPlane {
    fn start() -> ControlPlane {
        let cache = std::env::var("WRK_K8S_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|_| {
                PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/wrk-k8s")
            });
        if !cache.join("bin/kube-apiserver").exists() {
            eprintln!(
                "operator_k8s: building kube-apiserver, kube-scheduler and kube-controller-manager \
                 from Debian's kubernetes source package into {} (one time, ~20 minutes)",
                cache.display()
            );
        }
        let status = Command::new("bash")
            .arg(script())
            .arg("build")
            .status()
            .expect("run k8s.sh build");
        assert!(status.success(), "k8s.sh build failed");
        let dir = tempfile::tempdir().expect("temp dir");
        let output = Command::new("bash")
            .arg(script())
            .arg("start")
            .arg(dir.path())
            .env("WRK_K8S_API_PORT", free_port().to_string())
            .env("WRK_K8S_ETCD_PORT", free_port().to_string())
            .env("WRK_K8S_ETCD_PEER_PORT", free_port().to_string())
            .output()
            .expect("run k8s.sh start");
        let plane = ControlPlane { dir };
        assert!(
            output.status.success(),
            "k8s.sh start failed:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        eprint!("{}", String::from_utf8_lossy(&output.stdout));
        plane
    }

    fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    async fn client(&self) -> Client {
        let kubeconfig = Kubeconfig::read_from(self.kubeconfig()).expect("read kubeconfig");
        let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .expect("kubeconfig");
        Client::try_from(config).expect("client")
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(script())
            .arg("stop")
            .arg(self.dir.path())
            .status();
    }
}

/// `wrk operator run`, killed on drop; its log is printed if the test fails.
struct Operator {
    child: Child,
    log: PathBuf,
}

impl Operator {
    fn start(kubeconfig: &Path, log: PathBuf) -> Operator {
        let file = std::fs::File::create(&log).expect("operator log");
        let child = Command::new(common::wrk())
            .args(["operator", "run", "--pending-timeout-secs", "3"])
            .env("KUBECONFIG", kubeconfig)
            .env("WRK_LOG", "info,kube=warn")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start wrk operator run");
        Operator { child, log }
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "--- wrk operator log ---\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

/// Polls `check` every 500 ms until it returns `Some`, or panics with `what` after `limit`.
async fn wait_for<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A kubelet-less node advertising `capacity` and `labels`, ready and untainted.
async fn fake_node(
    nodes: &Api<Node>,
    name: &str,
    labels: &[(&str, &str)],
    capacity: &[(&str, &str)],
) {
    let mut all_labels: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    all_labels.insert("kubernetes.io/hostname".to_string(), name.to_string());
    let mut resources: BTreeMap<&str, &str> =
        BTreeMap::from([("cpu", "16"), ("memory", "64Gi"), ("pods", "110")]);
    resources.extend(capacity.iter().copied());
    let node: Node = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": name, "labels": all_labels },
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "fake node", "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                "lastTransitionTime": "2026-01-01T00:00:00Z"
            }]
        }
    }))
    .expect("node json");
    nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("create node");
    // The API server taints new nodes not-ready; with no kubelet nothing would lift it.
    nodes
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"taints": null}})),
        )
        .await
        .expect("untaint node");
}

fn node_of(pod: &Pod) -> Option<String> {
    pod.spec.as_ref()?.node_name.clone()
}

fn gpu_limits(pod: &Pod) -> BTreeMap<String, String> {
    pod.spec
        .as_ref()
        .map(|s| &s.containers[0])
        .and_then(|c| c.resources.as_ref()?.limits.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| k.starts_with("nvidia.com/"))
        .map(|(k, v)| (k, v.0))
        .collect()
}

async fn pods_with(pods: &Api<Pod>, selector: &str) -> Vec<Pod> {
    pods.list(&ListParams::default().labels(selector))
        .await
        .expect("list pods")
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect()
}

fn cluster_manifest(name: &str, a100_replicas: u32) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "wrk.dev/v1alpha1",
        "kind": "WrkCluster",
        "metadata": { "name": name, "namespace": NAMESPACE },
        "spec": {
            "image": "registry.example/wrk:test",
            "scheduler": { "terminationGracePeriodSeconds": 0 },
            "workerGroups": [
                {
                    "name": "a100",
                    "replicas": a100_replicas,
                    "gpu": { "resource": "nvidia.com/gpu", "product": "NVIDIA-A100-SXM4-80GB" },
                    "resources": { "limits": { "cpu": "2", "memory": "4Gi" } },
                    "terminationGracePeriodSeconds": 0
                },
                {
                    "name": "mig",
                    "replicas": 2,
                    "gpu": { "resource": "nvidia.com/mig-1g.5gb" },
                    "resources": { "limits": { "cpu": "1", "memory": "2Gi" } },
                    "terminationGracePeriodSeconds": 0
                }
            ]
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_against_a_real_api_server() {
    let plane = ControlPlane::start();
    let client = plane.client().await;

    // CRDs as `wrk operator crds` prints them.
    let output = Command::new(common::wrk())
        .args(["operator", "crds"])
        .output()
        .expect("run wrk operator crds");
    assert!(output.status.success(), "wrk operator crds failed");
    let yaml = String::from_utf8(output.stdout).expect("utf-8 CRDs");
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let apply = PatchParams::apply("operator-k8s-test").force();
    let mut names = Vec::new();
    for doc in yaml.split("---\n").filter(|d| !d.trim().is_empty()) {
        let crd: CustomResourceDefinition = serde_saphyr::from_str(doc).expect("CRD YAML");
        let name = crd.metadata.name.clone().expect("CRD name");
        crds.patch(&name, &apply, &Patch::Apply(&crd))
            .await
            .expect("apply CRD");
        names.push(name);
    }
    assert_eq!(names, ["wrkclusters.wrk.dev", "wrkjobs.wrk.dev"]);
    for name in &names {
        wait_for(
            &format!("CRD {name} established"),
            Duration::from_secs(30),
            || async {
                let crd = crds.get(name).await.ok()?;
                let established = crd
                    .status?
                    .conditions?
                    .into_iter()
                    .any(|c| c.type_ == "Established" && c.status == "True");
                established.then_some(())
            },
        )
        .await;
    }

    // Nodes: a small one dedicated to schedulers, a plain CPU node, GPU nodes.
    let nodes: Api<Node> = Api::all(client.clone());
    fake_node(
        &nodes,
        "sched-node",
        &[
            ("dedicated", "scheduler"),
            ("topology.kubernetes.io/zone", "zone-a"),
        ],
        &[("cpu", "4"), ("memory", "16Gi")],
    )
    .await;
    fake_node(
        &nodes,
        "cpu-node",
        &[("topology.kubernetes.io/zone", "zone-b")],
        &[("cpu", "64"), ("memory", "256Gi")],
    )
    .await;
    fake_node(
        &nodes,
        "a100-node",
        &[
            ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB"),
            ("topology.kubernetes.io/zone", "zone-a"),
        ],
        &[("nvidia.com/gpu", "2")],
    )
    .await;
    fake_node(
        &nodes,
        "t4-node",
        &[
            ("nvidia.com/gpu.product", "Tesla-T4"),
            ("topology.kubernetes.io/zone", "zone-b"),
        ],
        &[("nvidia.com/gpu", "4")],
    )
    .await;
    fake_node(
        &nodes,
        "mig-node",
        &[
            ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-40GB"),
            ("topology.kubernetes.io/zone", "zone-b"),
        ],
        &[("nvidia.com/mig-1g.5gb", "2")],
    )
    .await;

    let _operator = Operator::start(&plane.kubeconfig(), plane.dir.path().join("operator.log"));
    let clusters: Api<WrkCluster> = Api::namespaced(client.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
    let services: Api<Service> = Api::namespaced(client.clone(), NAMESPACE);

    // Three A100 workers for two A100 GPUs: one cannot be placed.
    let cluster: WrkCluster = serde_json::from_value(cluster_manifest("demo", 3)).expect("cluster");
    clusters
        .create(&PostParams::default(), &cluster)
        .await
        .expect("create WrkCluster");

    let service = wait_for("scheduler Service", Duration::from_secs(60), || async {
        services.get_opt("demo-scheduler").await.ok().flatten()
    })
    .await;
    let ports = service.spec.and_then(|s| s.ports).unwrap_or_default();
    assert_eq!(
        ports.iter().map(|p| p.port).collect::<Vec<_>>(),
        [7070, 8787, 9090]
    );
    assert!(ports.iter().all(|p| p.protocol.as_deref() == Some("TCP")));
    let deployment = deployments
        .get("demo-scheduler")
        .await
        .expect("scheduler Deployment");
    let owner = &deployment
        .metadata
        .owner_references
        .clone()
        .unwrap_or_default()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("WrkCluster", "demo")
    );

    // The scheduler pod (Deployment -> ReplicaSet -> Pod by the controller-manager) is bound to the
    // dedicated node by the real kube-scheduler.
    let scheduler_node = wait_for("scheduler pod bound", Duration::from_secs(60), || async {
        pods_with(
            &pods,
            "wrk.dev/cluster=demo,app.kubernetes.io/component=scheduler",
        )
        .await
        .first()
        .and_then(node_of)
    })
    .await;
    assert_eq!(scheduler_node, "sched-node");

    // Workers: two A100 pods on the A100 node (one GPU each), the MIG pods on the MIG node.
    let (a100, mig) = wait_for("worker pods bound", Duration::from_secs(60), || async {
        let a100 = pods_with(&pods, "wrk.dev/cluster=demo,wrk.dev/worker-group=a100").await;
        let mig = pods_with(&pods, "wrk.dev/cluster=demo,wrk.dev/worker-group=mig").await;
        let bound = |ps: &[Pod]| ps.iter().filter(|p| node_of(p).is_some()).count();
        (a100.len() == 3 && bound(&a100) == 2 && mig.len() == 2 && bound(&mig) == 2)
            .then_some((a100, mig))
    })
    .await;
    for pod in &a100 {
        assert_eq!(
            gpu_limits(pod),
            BTreeMap::from([("nvidia.com/gpu".to_string(), "1".to_string())])
        );
        if let Some(node) = node_of(pod) {
            assert_eq!(
                node, "a100-node",
                "the product selector keeps A100 workers off the T4 node"
            );
        }
    }
    for pod in &mig {
        assert_eq!(
            gpu_limits(pod),
            BTreeMap::from([("nvidia.com/mig-1g.5gb".to_string(), "1".to_string())])
        );
        assert_eq!(node_of(pod).as_deref(), Some("mig-node"));
    }
    let unplaced = a100
        .iter()
        .find(|p| node_of(p).is_none())
        .and_then(|p| p.metadata.name.clone())
        .expect("an unplaced worker");

    // The stuck worker shows in the status with the scheduler's reason.
    let status = wait_for(
        "FailedScheduling in the WrkCluster status",
        Duration::from_secs(60),
        || async {
            let status = clusters.get("demo").await.ok()?.status?;
            let stuck = status.pending_pods.iter().find(|p| p.name == unplaced)?;
            (stuck.reason == "FailedScheduling").then_some(status)
        },
    )
    .await;
    let stuck = status
        .pending_pods
        .iter()
        .find(|p| p.name == unplaced)
        .expect("stuck pod");
    assert!(
        stuck.message.contains("Insufficient nvidia.com/gpu"),
        "message: {}",
        stuck.message
    );
    let condition = |type_: &str| status.conditions.iter().find(|c| c.type_ == type_).cloned();
    let pending = condition("PodsPending").expect("PodsPending condition");
    assert_eq!(pending.status, "True");
    assert_eq!(
        condition("Ready").map(|c| c.status).as_deref(),
        Some("False")
    );
    assert_eq!(status.desired_workers, 5);
    assert_eq!(
        status.observed_generation,
        clusters.get("demo").await.expect("get").metadata.generation
    );
    assert_eq!(
        status.scheduler_address.as_deref(),
        Some("http://demo-scheduler.default.svc:7070")
    );

    // Scaling the A100 group down to one deletes two pods (none is ready, so none holds data).
    clusters
        .patch(
            "demo",
            &PatchParams::default(),
            &Patch::Json::<()>(
                serde_json::from_value(serde_json::json!([
                    {"op": "replace", "path": "/spec/workerGroups/0/replicas", "value": 1}
                ]))
                .expect("json patch"),
            ),
        )
        .await
        .expect("scale down");
    wait_for(
        "A100 group scaled to one pod",
        Duration::from_secs(60),
        || async {
            let a100 = pods_with(&pods, "wrk.dev/cluster=demo,wrk.dev/worker-group=a100").await;
            let status = clusters.get("demo").await.ok()?.status?;
            (a100.len() == 1 && status.desired_workers == 3).then_some(())
        },
    )
    .await;

    // An invalid spec is reported in the status and nothing is created for it.
    let mut invalid = cluster_manifest("broken", 1);
    invalid["spec"]["workerGroups"][1]["gpu"]["resource"] = serde_json::json!("nvidia.com/mig-");
    let invalid: WrkCluster = serde_json::from_value(invalid).expect("cluster");
    clusters
        .create(&PostParams::default(), &invalid)
        .await
        .expect("create invalid WrkCluster");
    let message = wait_for("InvalidSpec reported", Duration::from_secs(30), || async {
        let status = clusters.get("broken").await.ok()?.status?;
        let ready = status.conditions.into_iter().find(|c| c.type_ == "Ready")?;
        (ready.reason == "InvalidSpec").then_some(ready.message)
    })
    .await;
    assert!(message.contains("nvidia.com/mig-"), "{message}");
    assert!(
        deployments
            .get_opt("broken-scheduler")
            .await
            .expect("get")
            .is_none()
    );

    // A WrkJob on an ephemeral cluster: the cluster is created, owned by the job, and the job waits
    // for its scheduler (which never runs here: no kubelet).
    let jobs: Api<WrkJob> = Api::namespaced(client.clone(), NAMESPACE);
    let job: WrkJob = serde_json::from_value(serde_json::json!({
        "apiVersion": "wrk.dev/v1alpha1",
        "kind": "WrkJob",
        "metadata": { "name": "taxi", "namespace": NAMESPACE },
        "spec": {
            "source": { "configMap": "taxi-job", "jobFile": "job.toml" },
            "ephemeralCluster": cluster_manifest("unused", 1)["spec"],
            "deadlineSeconds": 600,
            "ttlSecondsAfterFinished": 60
        }
    }))
    .expect("job");
    jobs.create(&PostParams::default(), &job)
        .await
        .expect("create WrkJob");
    wait_for(
        "WrkJob waiting for its ephemeral cluster",
        Duration::from_secs(60),
        || async {
            let status = jobs.get("taxi").await.ok()?.status?;
            let ready = status.conditions.iter().find(|c| c.type_ == "Ready")?;
            let ephemeral = clusters.get_opt("taxi").await.ok()??;
            let owned = ephemeral
                .metadata
                .owner_references?
                .iter()
                .any(|o| o.kind == "WrkJob" && o.name == "taxi");
            (ready.reason == "WaitingForScheduler"
                && owned
                && status.cluster.as_deref() == Some("taxi"))
            .then_some(())
        },
    )
    .await;
    wait_for(
        "the ephemeral cluster's scheduler Deployment",
        Duration::from_secs(60),
        || async { deployments.get_opt("taxi-scheduler").await.ok()? },
    )
    .await;

    // Deleting owners garbage-collects what they own.
    for (api_delete, name) in [("cluster", "demo"), ("job", "taxi")] {
        let result = match api_delete {
            "cluster" => clusters
                .delete(name, &DeleteParams::background())
                .await
                .map(|_| ()),
            _ => jobs
                .delete(name, &DeleteParams::background())
                .await
                .map(|_| ()),
        };
        result.expect("delete owner");
    }
    wait_for(
        "everything owned garbage-collected",
        Duration::from_secs(90),
        || async {
            let left_pods = pods_with(&pods, "app.kubernetes.io/managed-by=wrk-operator")
                .await
                .len()
                + pods_with(&pods, "app.kubernetes.io/component=scheduler")
                    .await
                    .len();
            let left_deployments = deployments
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .len();
            let left_services = services
                .list(&ListParams::default().labels("app.kubernetes.io/managed-by=wrk-operator"))
                .await
                .ok()?
                .items
                .len();
            let ephemeral = clusters.get_opt("taxi").await.ok()?;
            (left_pods == 0 && left_deployments == 0 && left_services == 0 && ephemeral.is_none())
                .then_some(())
        },
    )
    .await;
}

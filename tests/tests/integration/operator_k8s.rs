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
//! - scheduler and worker pods probe `/healthz` on their HTTP ports and carry Prometheus' scrape
//!   annotations; the Service offers the gRPC, dashboard and metrics ports;
//! - scaling a group down deletes pods; an invalid spec is reported, not applied;
//! - autoscaling follows a real `wrk scheduler` (with tenants and a worker token from a Secret,
//!   a real `wrk worker` and a real `wrk submit`): the advice is split over three groups within
//!   their bounds, a busy worker is held until the scheduler reports it safe, and the idle timeout
//!   takes every group to its floor;
//! - `WrkJob`s run to the end: a job on an ephemeral cluster starts its submitting Job once the
//!   scheduler is available, runs, succeeds, deletes its cluster and, after its TTL, itself; a
//!   job past its deadline fails with `DeadlineExceeded` (waiting for its cluster, or running);
//!   a failed submission fails the job with the Job controller's reason;
//! - deleting a `WrkCluster` garbage-collects everything it owns.
//!
//! No kubelet runs, so no container ever starts: where a test needs a pod to be running, ready,
//! succeeded or failed, it patches the pod's `status` subresource as a kubelet would, and the
//! real controllers (ReplicaSet, Deployment, Job) take it from there.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Container, Node, Pod, Secret, Service};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use wrk_operator::crd::{WrkCluster, WrkJob};

const NAMESPACE: &str = "default";

fn script() -> PathBuf {
    crate::common::workspace_root().join("operator/testenv/k8s.sh")
}

/// `N` distinct free ports: each listener is held until all are chosen, so the system cannot
/// hand out one port twice (etcd once got the API server's port, and the API server failed).
fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free port"))
        .collect();
    std::array::from_fn(|i| {
        listeners[i]
            .local_addr()
            .map(|a| a.port())
            .expect("a listener's address")
    })
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
        let [api_port, etcd_port, etcd_peer_port] = free_ports();
        let output = Command::new("bash")
            .arg(script())
            .arg("start")
            .arg(dir.path())
            .env("WRK_K8S_API_PORT", api_port.to_string())
            .env("WRK_K8S_ETCD_PORT", etcd_port.to_string())
            .env("WRK_K8S_ETCD_PEER_PORT", etcd_peer_port.to_string())
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
    /// The operator, reaching the scheduler of `default/scale` at `scale_scheduler` (a real
    /// `wrk scheduler` on this machine) and asking for advice every second, for a backlog done
    /// within a second.
    fn start(kubeconfig: &Path, log: PathBuf, scale_scheduler: &str) -> Operator {
        let file = std::fs::File::create(&log).expect("operator log");
        let child = Command::new(crate::common::wrk())
            .args(["operator", "run", "--pending-timeout-secs", "3"])
            .args(["--advice-interval-secs", "1", "--scaling-target-secs", "1"])
            .arg("--scheduler-address")
            .arg(format!("{NAMESPACE}/scale={scale_scheduler}"))
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
    let output = Command::new(crate::common::wrk())
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

    fake_node(
        &nodes,
        "l4-node",
        &[
            ("nvidia.com/gpu.product", "NVIDIA-L4"),
            ("topology.kubernetes.io/zone", "zone-a"),
        ],
        &[("nvidia.com/gpu", "2")],
    )
    .await;

    // A real scheduler for the `scale` cluster, requiring tenant tokens and a worker token.
    let dir = tempfile::tempdir().expect("temp dir");
    let tenants = format!(
        "[[tenant]]\nname = \"wrk-operator\"\ntoken = \"{CLIENT_TOKEN}\"\n\
         [[tenant]]\nname = \"analyst\"\ntoken = \"{USER_TOKEN}\"\n"
    );
    let tenants_file = dir.path().join("tenants.toml");
    std::fs::write(&tenants_file, &tenants).expect("write tenants");
    let mut processes = crate::common::Processes(Vec::new());
    let scheduler = crate::common::start_scheduler(
        &mut processes,
        &["--tenants", tenants_file.to_str().expect("UTF-8 path")],
        &[("WRK_WORKER_TOKEN", WORKER_TOKEN)],
    );

    let _operator = Operator::start(
        &plane.kubeconfig(),
        plane.dir.path().join("operator.log"),
        &scheduler.url,
    );
    let apis = Apis::new(&client);

    placement_status_and_probes(&apis).await;
    invalid_spec_is_reported(&apis).await;
    scaling_follows_the_real_scheduler(&apis, &scheduler.url, &tenants, &dir, &mut processes).await;
    jobs_run_to_the_end(&apis).await;
    owners_garbage_collect_what_they_own(&apis).await;
}

const CLIENT_TOKEN: &str = "operator-client-token-0123456789";
const USER_TOKEN: &str = "analyst-token-0123456789";
const WORKER_TOKEN: &str = "worker-token-0123456789abcdef";

/// The APIs the checks use.
struct Apis {
    clusters: Api<WrkCluster>,
    jobs: Api<WrkJob>,
    pods: Api<Pod>,
    deployments: Api<Deployment>,
    services: Api<Service>,
    batch: Api<Job>,
    secrets: Api<Secret>,
}

impl Apis {
    fn new(client: &Client) -> Apis {
        Apis {
            clusters: Api::namespaced(client.clone(), NAMESPACE),
            jobs: Api::namespaced(client.clone(), NAMESPACE),
            pods: Api::namespaced(client.clone(), NAMESPACE),
            deployments: Api::namespaced(client.clone(), NAMESPACE),
            services: Api::namespaced(client.clone(), NAMESPACE),
            batch: Api::namespaced(client.clone(), NAMESPACE),
            secrets: Api::namespaced(client.clone(), NAMESPACE),
        }
    }

    /// Worker pods of `group` of `cluster`, not being deleted.
    async fn group(&self, cluster: &str, group: &str) -> Vec<Pod> {
        pods_with(
            &self.pods,
            &format!("wrk.dev/cluster={cluster},wrk.dev/worker-group={group}"),
        )
        .await
    }

    /// Names of the worker pods of `group` of `cluster`, sorted.
    async fn group_names(&self, cluster: &str, group: &str) -> Vec<String> {
        let mut names: Vec<String> = self
            .group(cluster, group)
            .await
            .into_iter()
            .filter_map(|p| p.metadata.name)
            .collect();
        names.sort();
        names
    }

    /// The scheduler pod of `cluster`.
    async fn scheduler_pod(&self, cluster: &str) -> Option<Pod> {
        pods_with(
            &self.pods,
            &format!("wrk.dev/cluster={cluster},app.kubernetes.io/component=scheduler"),
        )
        .await
        .into_iter()
        .next()
    }

    /// Makes the scheduler of `cluster` ready, as its kubelet would, and waits for the cluster to
    /// report it available (ReplicaSet and Deployment controllers in between).
    async fn make_scheduler_ready(&self, cluster: &str) {
        let pod = wait_for(
            &format!("the scheduler pod of {cluster}"),
            Duration::from_secs(60),
            || async { self.scheduler_pod(cluster).await },
        )
        .await;
        set_pod_status(&self.pods, &name_of(&pod), "Running", true).await;
        wait_for(
            &format!("{cluster}: SchedulerAvailable"),
            Duration::from_secs(60),
            || async {
                let status = self.clusters.get(cluster).await.ok()?.status?;
                let available = condition(&status.conditions, "SchedulerAvailable")?;
                (available.status == "True").then_some(())
            },
        )
        .await;
    }
}

fn name_of(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

fn container(pod: &Pod) -> Container {
    pod.spec
        .as_ref()
        .map(|s| s.containers[0].clone())
        .expect("a container")
}

fn condition(
    conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    type_: &str,
) -> Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    conditions.iter().find(|c| c.type_ == type_).cloned()
}

/// What a kubelet would report for `name`: `phase`, and whether the pod is ready. (There is no
/// kubelet here: the test plays its part on the status subresource.)
async fn set_pod_status(pods: &Api<Pod>, name: &str, phase: &str, ready: bool) {
    let now = "2026-01-01T00:00:00Z";
    let status = if ready { "True" } else { "False" };
    let patch = serde_json::json!({
        "status": {
            "phase": phase,
            "conditions": [
                { "type": "Ready", "status": status, "lastTransitionTime": now },
                { "type": "ContainersReady", "status": status, "lastTransitionTime": now },
                { "type": "Initialized", "status": "True", "lastTransitionTime": now }
            ]
        }
    });
    pods.patch_status(name, &PatchParams::default(), &Patch::Strategic(patch))
        .await
        .unwrap_or_else(|e| panic!("patch the status of pod {name}: {e}"));
}

/// The `name` env var of `container`: its value, or `secret/key` where it comes from a Secret.
fn env_of(container: &Container, name: &str) -> Option<String> {
    let var = container.env.as_ref()?.iter().find(|e| e.name == name)?;
    if let Some(value) = &var.value {
        return Some(value.clone());
    }
    let key = var.value_from.as_ref()?.secret_key_ref.as_ref()?;
    Some(format!("secret:{}/{}", key.name, key.key))
}

/// `/healthz` GETs on `port` for readiness and liveness.
fn assert_healthz_probes(container: &Container, port: &str) {
    for (what, probe) in [
        ("readiness", &container.readiness_probe),
        ("liveness", &container.liveness_probe),
    ] {
        let get = probe
            .as_ref()
            .and_then(|p| p.http_get.clone())
            .unwrap_or_else(|| panic!("{what} probe is an HTTP GET"));
        assert_eq!(get.path.as_deref(), Some("/healthz"), "{what}");
        assert_eq!(
            serde_json::to_value(&get.port).expect("port"),
            serde_json::json!(port),
            "{what}"
        );
    }
}

fn annotations(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> BTreeMap<String, String> {
    meta.annotations.clone().unwrap_or_default()
}

/// The `demo` cluster: placement by the real kube-scheduler, status of a stuck worker, probes,
/// ports and annotations on the applied objects, and a scale-down.
async fn placement_status_and_probes(apis: &Apis) {
    let Apis {
        clusters,
        deployments,
        services,
        ..
    } = apis;
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
    let service_annotations = annotations(&service.metadata);
    let ports = service.spec.and_then(|s| s.ports).unwrap_or_default();
    let named: Vec<(String, i32, serde_json::Value)> = ports
        .iter()
        .map(|p| {
            (
                p.name.clone().unwrap_or_default(),
                p.port,
                serde_json::to_value(&p.target_port).expect("target port"),
            )
        })
        .collect();
    assert_eq!(
        named,
        [
            ("grpc".to_string(), 7070, serde_json::json!("grpc")),
            ("dashboard".to_string(), 8787, serde_json::json!("http")),
            ("metrics".to_string(), 9090, serde_json::json!("http")),
        ]
    );
    assert!(ports.iter().all(|p| p.protocol.as_deref() == Some("TCP")));
    assert_eq!(service_annotations["prometheus.io/scrape"], "true");
    assert_eq!(service_annotations["prometheus.io/port"], "9090");
    // The controller applies the Service and the Deployment one after the other: wait for both.
    let deployment = wait_for("scheduler Deployment", Duration::from_secs(60), || async {
        deployments.get_opt("demo-scheduler").await.ok().flatten()
    })
    .await;
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
    // dedicated node by the real kube-scheduler, and probes the scheduler's HTTP port.
    let scheduler_pod = wait_for("scheduler pod bound", Duration::from_secs(60), || async {
        apis.scheduler_pod("demo")
            .await
            .filter(|p| node_of(p).is_some())
    })
    .await;
    assert_eq!(node_of(&scheduler_pod).as_deref(), Some("sched-node"));
    let scheduler_container = container(&scheduler_pod);
    assert_healthz_probes(&scheduler_container, "http");
    let http_port = scheduler_container
        .ports
        .clone()
        .unwrap_or_default()
        .into_iter()
        .find(|p| p.name.as_deref() == Some("http"))
        .expect("an http port");
    assert_eq!(http_port.container_port, 8787);
    let args = scheduler_container.args.clone().unwrap_or_default();
    assert!(
        args.windows(2)
            .any(|w| w == ["--http-listen", "0.0.0.0:8787"]),
        "{args:?}"
    );
    let pod_annotations = annotations(&scheduler_pod.metadata);
    assert_eq!(pod_annotations["prometheus.io/port"], "8787");
    assert_eq!(pod_annotations["prometheus.io/path"], "/metrics");
    assert!(
        env_of(&scheduler_container, "WRK_WORKER_TOKEN").is_none(),
        "no auth, no tokens"
    );

    // Workers: two A100 pods on the A100 node (one GPU each), the MIG pods on the MIG node.
    let (a100, mig) = wait_for("worker pods bound", Duration::from_secs(60), || async {
        let a100 = apis.group("demo", "a100").await;
        let mig = apis.group("demo", "mig").await;
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
        let worker = container(pod);
        assert_healthz_probes(&worker, "metrics");
        let args = worker.args.clone().unwrap_or_default();
        assert!(
            args.windows(2)
                .any(|w| w == ["--metrics-listen", "0.0.0.0:9090"]),
            "{args:?}"
        );
        let pod_annotations = annotations(&pod.metadata);
        assert_eq!(pod_annotations["prometheus.io/scrape"], "true");
        assert_eq!(pod_annotations["prometheus.io/port"], "9090");
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels["app.kubernetes.io/name"], "wrk");
        assert_eq!(labels["app.kubernetes.io/component"], "worker");
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
    let pending = condition(&status.conditions, "PodsPending").expect("PodsPending condition");
    assert_eq!(pending.status, "True");
    assert_eq!(
        condition(&status.conditions, "Ready")
            .map(|c| c.status)
            .as_deref(),
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
            let a100 = apis.group("demo", "a100").await;
            let status = clusters.get("demo").await.ok()?.status?;
            (a100.len() == 1 && status.desired_workers == 3).then_some(())
        },
    )
    .await;
}

/// An invalid spec is reported in the status and nothing is created for it.
async fn invalid_spec_is_reported(apis: &Apis) {
    let mut invalid = cluster_manifest("broken", 1);
    invalid["spec"]["workerGroups"][1]["gpu"]["resource"] = serde_json::json!("nvidia.com/mig-");
    let invalid: WrkCluster = serde_json::from_value(invalid).expect("cluster");
    apis.clusters
        .create(&PostParams::default(), &invalid)
        .await
        .expect("create invalid WrkCluster");
    let message = wait_for("InvalidSpec reported", Duration::from_secs(30), || async {
        let status = apis.clusters.get("broken").await.ok()?.status?;
        let ready = condition(&status.conditions, "Ready")?;
        (ready.reason == "InvalidSpec").then_some(ready.message)
    })
    .await;
    assert!(message.contains("nvidia.com/mig-"), "{message}");
    assert!(
        apis.deployments
            .get_opt("broken-scheduler")
            .await
            .expect("get")
            .is_none()
    );
    apis.clusters
        .delete("broken", &DeleteParams::background())
        .await
        .expect("delete the invalid cluster");
}

/// The `scale` cluster's groups: `fixed` (one worker, no autoscaling) and `first` (1..3) on the
/// T4 node, `second` (0..2) on the L4 node.
fn scale_manifest() -> serde_json::Value {
    let group = |name: &str, replicas: u32, product: &str, bounds: Option<(u32, u32)>| {
        let mut group = serde_json::json!({
            "name": name,
            "replicas": replicas,
            "gpu": { "product": product },
            "resources": { "limits": { "cpu": "1", "memory": "2Gi" } },
            "terminationGracePeriodSeconds": 0
        });
        if let Some((min, max)) = bounds {
            group["autoscaling"] = serde_json::json!({ "minReplicas": min, "maxReplicas": max });
        }
        group
    };
    serde_json::json!({
        "apiVersion": "wrk.dev/v1alpha1",
        "kind": "WrkCluster",
        "metadata": { "name": "scale", "namespace": NAMESPACE },
        "spec": {
            "image": "registry.example/wrk:test",
            "scheduler": { "terminationGracePeriodSeconds": 0 },
            "auth": { "secretName": "scale-tokens" },
            "idleTimeoutSeconds": SCALE_IDLE_SECS,
            "workerGroups": [
                group("fixed", 1, "Tesla-T4", None),
                group("first", 1, "Tesla-T4", Some((1, 3))),
                group("second", 0, "NVIDIA-L4", Some((0, 2))),
            ]
        }
    })
}

const SCALE_IDLE_SECS: u64 = 15;

/// The `scale` cluster's desired counts per group, from its status.
async fn desired_by_group(apis: &Apis) -> Option<Vec<(String, u32, u32)>> {
    let status = apis.clusters.get("scale").await.ok()?.status?;
    Some(
        status
            .worker_groups
            .into_iter()
            .map(|g| (g.name, g.desired, g.held))
            .collect(),
    )
}

/// Autoscaling against a real `wrk scheduler` (tokens from a Secret), a real worker and a real
/// `wrk submit`; the worker pods themselves never run (no kubelet).
async fn scaling_follows_the_real_scheduler(
    apis: &Apis,
    scheduler_url: &str,
    tenants: &str,
    dir: &tempfile::TempDir,
    processes: &mut crate::common::Processes,
) {
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": { "name": "scale-tokens", "namespace": NAMESPACE },
        "stringData": {
            "tenants.toml": tenants,
            "worker-token": WORKER_TOKEN,
            // As `echo TOKEN | kubectl create secret ...` would store it: the operator trims it.
            "client-token": format!("{CLIENT_TOKEN}\n"),
        }
    }))
    .expect("secret");
    apis.secrets
        .create(&PostParams::default(), &secret)
        .await
        .expect("create the token Secret");
    let cluster: WrkCluster = serde_json::from_value(scale_manifest()).expect("cluster");
    apis.clusters
        .create(&PostParams::default(), &cluster)
        .await
        .expect("create the scale cluster");

    // Before the scheduler is up there is no advice: groups at their replicas within bounds.
    let status = wait_for(
        "scale: AdviceUnavailable before the scheduler runs",
        Duration::from_secs(60),
        || async {
            let status = apis.clusters.get("scale").await.ok()?.status?;
            let autoscaling = condition(&status.conditions, "Autoscaling")?;
            (autoscaling.reason == "AdviceUnavailable" && status.desired_workers == 2)
                .then_some(status)
        },
    )
    .await;
    assert!(
        condition(&status.conditions, "Autoscaling")
            .is_some_and(|c| c.message.contains("not available yet")),
        "{:?}",
        status.conditions
    );

    // Tokens reach the pods from the Secret, never as values.
    let deployment = apis
        .deployments
        .get("scale-scheduler")
        .await
        .expect("scale scheduler Deployment");
    let pod_spec = deployment.spec.template.spec.clone().expect("pod spec");
    let scheduler_container = pod_spec.containers[0].clone();
    assert_eq!(
        env_of(&scheduler_container, "WRK_WORKER_TOKEN").as_deref(),
        Some("secret:scale-tokens/worker-token")
    );
    let args = scheduler_container.args.clone().unwrap_or_default();
    assert!(
        args.windows(2)
            .any(|w| w == ["--tenants", "/etc/wrk/auth/tenants.toml"]),
        "{args:?}"
    );
    let volume = pod_spec.volumes.unwrap_or_default()[0].clone();
    assert_eq!(
        volume.secret.and_then(|s| s.secret_name).as_deref(),
        Some("scale-tokens")
    );
    let fixed_pod = wait_for("scale-fixed-0", Duration::from_secs(30), || async {
        apis.group("scale", "fixed").await.into_iter().next()
    })
    .await;
    assert_eq!(
        env_of(&container(&fixed_pod), "WRK_WORKER_TOKEN").as_deref(),
        Some("secret:scale-tokens/worker-token")
    );

    // `scale-first-0` is a real worker: its pod is marked ready and a `wrk worker` of that id
    // attaches to the real scheduler with the worker token.
    wait_for("scale-first-0", Duration::from_secs(30), || async {
        let names = apis.group_names("scale", "first").await;
        (names == ["scale-first-0"]).then_some(())
    })
    .await;
    set_pod_status(&apis.pods, "scale-first-0", "Running", true).await;
    let cache = dir.path().join("cache");
    processes.0.push(
        Command::new(crate::common::wrk())
            .args([
                "worker",
                "--scheduler",
                scheduler_url,
                "--listen",
                "127.0.0.1:0",
                "--slots",
                "1",
                "--id",
                "scale-first-0",
            ])
            .arg("--cache-dir")
            .arg(&cache)
            .env("WRK_WORKER_TOKEN", WORKER_TOKEN)
            .stderr(Stdio::null())
            .spawn()
            .expect("start wrk worker"),
    );
    crate::common::wait_for_workers(scheduler_url, 1, Some(USER_TOKEN));

    // The scheduler becomes available: the operator asks it (with the client token) and, the
    // cluster having no work, the idle timeout takes every group to its floor: the fixed group
    // to zero, `first` to its minimum of one.
    apis.make_scheduler_ready("scale").await;
    let status = wait_for(
        "scale: idle timeout reached",
        Duration::from_secs(60),
        || async {
            let status = apis.clusters.get("scale").await.ok()?.status?;
            let idle = condition(&status.conditions, "Idle")?;
            (idle.status == "True" && idle.reason == "IdleTimeout").then_some(status)
        },
    )
    .await;
    let autoscaling = condition(&status.conditions, "Autoscaling").expect("Autoscaling");
    assert_eq!(
        (autoscaling.status.as_str(), autoscaling.reason.as_str()),
        ("True", "Following"),
        "{}",
        autoscaling.message
    );
    assert!(status.idle_since.is_some());
    wait_for(
        "scale: groups at their floor",
        Duration::from_secs(30),
        || async {
            let fixed = apis.group_names("scale", "fixed").await;
            let first = apis.group_names("scale", "first").await;
            let second = apis.group_names("scale", "second").await;
            (fixed.is_empty() && first == ["scale-first-0"] && second.is_empty()).then_some(())
        },
    )
    .await;

    // Work arrives (a real `wrk submit` as a tenant): 400 tasks of 250 ms for a backlog to be done
    // within a second want far more workers than the bounds allow. The fixed group comes back,
    // `first` grows to its max of 3, and the rest goes to `second` (max 2).
    let job_file = dir.path().join("backlog.toml");
    std::fs::write(
        &job_file,
        format!(
            "name = \"backlog\"\nmodule = \"{}\"\n[params]\ndelay_ms = \"250\"\n\
             [[stage]]\nname = \"work\"\ntasks = 400\n",
            crate::common::guest("test-guest-slow").display()
        ),
    )
    .expect("write the job file");
    let submit = Command::new(crate::common::wrk())
        .arg("submit")
        .arg(&job_file)
        .args(["--scheduler", scheduler_url, "--quiet"])
        .env("WRK_TOKEN", USER_TOKEN)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start wrk submit");
    let submit_pid = submit.id();
    processes.0.push(submit);
    wait_for(
        "scale: the backlog split over the groups",
        Duration::from_secs(60),
        || async {
            let desired = desired_by_group(apis).await?;
            let fixed = apis.group_names("scale", "fixed").await;
            let first = apis.group_names("scale", "first").await;
            let second = apis.group_names("scale", "second").await;
            let status = apis.clusters.get("scale").await.ok()?.status?;
            let idle = condition(&status.conditions, "Idle")?;
            (desired
                == [
                    ("fixed".to_string(), 1, 0),
                    ("first".to_string(), 3, 0),
                    ("second".to_string(), 2, 0),
                ]
                && fixed.len() == 1
                && first.len() == 3
                && second.len() == 2
                && idle.reason == "Working")
                .then_some(())
        },
    )
    .await;

    // `first` may no longer have any worker: the pods that never became ready go at once, the
    // busy real worker is held (it runs tasks and holds outputs the job still needs).
    apis.clusters
        .patch(
            "scale",
            &PatchParams::default(),
            &Patch::Json::<()>(
                serde_json::from_value(serde_json::json!([
                    {"op": "replace", "path": "/spec/workerGroups/1/autoscaling",
                     "value": {"minReplicas": 0, "maxReplicas": 0}}
                ]))
                .expect("json patch"),
            ),
        )
        .await
        .expect("lower first's bounds");
    let status = wait_for(
        "scale: the busy worker held",
        Duration::from_secs(60),
        || async {
            let first = apis.group_names("scale", "first").await;
            let desired = desired_by_group(apis).await?;
            let status = apis.clusters.get("scale").await.ok()?.status?;
            (first == ["scale-first-0"] && desired[1] == ("first".to_string(), 0, 1))
                .then_some(status)
        },
    )
    .await;
    let autoscaling = condition(&status.conditions, "Autoscaling").expect("Autoscaling");
    assert_eq!(
        autoscaling.reason, "RetirementHeld",
        "{}",
        autoscaling.message
    );
    assert_eq!(apis.group("scale", "second").await.len(), 2);

    // SIGTERM to `wrk submit` (what a stopped pod gets) cancels the job: the worker is idle and
    // holds nothing, so the scheduler reports it safe and it is retired. The cluster is idle: its
    // groups keep their workers for the idle timeout, then go to their floor.
    let killed = Command::new("kill")
        .args(["-TERM", &submit_pid.to_string()])
        .status()
        .expect("run kill");
    assert!(killed.success());
    let submit = processes
        .0
        .iter_mut()
        .find(|c| c.id() == submit_pid)
        .expect("the submit process");
    let exit = submit.wait().expect("wait for wrk submit");
    assert!(!exit.success(), "a cancelled submit fails");
    let mut stderr = String::new();
    if let Some(mut pipe) = submit.stderr.take() {
        use std::io::Read;
        pipe.read_to_string(&mut stderr)
            .expect("read submit stderr");
    }
    assert!(stderr.contains("cancelled by SIGTERM"), "{stderr}");
    wait_for(
        "scale: the worker retired once safe, the rest kept while idle",
        Duration::from_secs(30),
        || async {
            let first = apis.group_names("scale", "first").await;
            let second = apis.group_names("scale", "second").await;
            let status = apis.clusters.get("scale").await.ok()?.status?;
            let idle = condition(&status.conditions, "Idle")?;
            (first.is_empty() && second.len() == 2 && idle.reason == "Idle").then_some(())
        },
    )
    .await;
    wait_for(
        "scale: idle timeout after the job",
        Duration::from_secs(60),
        || async {
            let fixed = apis.group_names("scale", "fixed").await;
            let second = apis.group_names("scale", "second").await;
            let status = apis.clusters.get("scale").await.ok()?.status?;
            let idle = condition(&status.conditions, "Idle")?;
            (fixed.is_empty() && second.is_empty() && idle.reason == "IdleTimeout").then_some(())
        },
    )
    .await;
}

/// A `WrkJob` manifest named `name` on `cluster` (an existing one) or an ephemeral one.
fn job_manifest(name: &str, on: serde_json::Value, extra: serde_json::Value) -> WrkJob {
    let mut spec = serde_json::json!({
        "source": { "configMap": format!("{name}-files"), "jobFile": "job.toml" },
    });
    for (key, value) in on
        .as_object()
        .into_iter()
        .flatten()
        .chain(extra.as_object().into_iter().flatten())
    {
        spec[key] = value.clone();
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "wrk.dev/v1alpha1",
        "kind": "WrkJob",
        "metadata": { "name": name, "namespace": NAMESPACE },
        "spec": spec
    }))
    .expect("job")
}

/// The phase of WrkJob `name` and one of its conditions, once the condition is there.
async fn job_state(
    apis: &Apis,
    name: &str,
    type_: &str,
) -> Option<(
    wrk_operator::crd::WrkJobStatus,
    k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition,
)> {
    let status = apis.jobs.get(name).await.ok()?.status?;
    let found = condition(&status.conditions, type_)?;
    Some((status, found))
}

/// The pod the Job controller made for the submitting Job of WrkJob `name`.
async fn submit_pod(apis: &Apis, name: &str) -> Pod {
    wait_for(
        &format!("the submitting pod of {name}"),
        Duration::from_secs(60),
        || async {
            pods_with(&apis.pods, &format!("job-name={name}-submit"))
                .await
                .into_iter()
                .next()
        },
    )
    .await
}

/// `WrkJob`s from start to end.
async fn jobs_run_to_the_end(apis: &Apis) {
    use wrk_operator::crd::JobPhase;

    // A job on an ephemeral cluster: the cluster is created, owned by the job, and the job waits
    // for its scheduler.
    let mut ephemeral = cluster_manifest("unused", 1)["spec"].clone();
    ephemeral["auth"] = serde_json::json!({ "secretName": "scale-tokens" });
    let taxi = job_manifest(
        "taxi",
        serde_json::json!({ "ephemeralCluster": ephemeral }),
        serde_json::json!({ "deadlineSeconds": 600, "ttlSecondsAfterFinished": 4 }),
    );
    apis.jobs
        .create(&PostParams::default(), &taxi)
        .await
        .expect("create WrkJob taxi");
    wait_for(
        "WrkJob waiting for its ephemeral cluster",
        Duration::from_secs(60),
        || async {
            let (status, ready) = job_state(apis, "taxi", "Ready").await?;
            let cluster = apis.clusters.get_opt("taxi").await.ok()??;
            let owned = cluster
                .metadata
                .owner_references?
                .iter()
                .any(|o| o.kind == "WrkJob" && o.name == "taxi");
            (ready.reason == "WaitingForScheduler"
                && owned
                && status.phase == JobPhase::Pending
                && status.cluster.as_deref() == Some("taxi"))
            .then_some(())
        },
    )
    .await;
    assert!(
        apis.batch
            .get_opt("taxi-submit")
            .await
            .expect("get")
            .is_none(),
        "nothing is submitted before the scheduler is available"
    );

    // The scheduler becomes ready: the submitting Job is created, with the deadline left and the
    // cluster's client token; the Job controller makes its pod.
    apis.make_scheduler_ready("taxi").await;
    let submitted = wait_for(
        "the submitting Job of taxi",
        Duration::from_secs(60),
        || async { apis.batch.get_opt("taxi-submit").await.ok()? },
    )
    .await;
    let spec = submitted.spec.clone().expect("job spec");
    let deadline = spec.active_deadline_seconds.expect("activeDeadlineSeconds");
    assert!((500..=600).contains(&deadline), "{deadline}");
    assert_eq!(spec.backoff_limit, Some(0));
    let submit = spec.template.spec.expect("pod spec").containers[0].clone();
    let args = submit.args.clone().unwrap_or_default();
    assert_eq!(
        args[..4],
        [
            "submit",
            "/job/job.toml",
            "--scheduler",
            "http://taxi-scheduler.default.svc:7070"
        ]
    );
    assert_eq!(
        env_of(&submit, "WRK_TOKEN").as_deref(),
        Some("secret:scale-tokens/client-token")
    );
    // The controller creates the Job, then records it in the WrkJob's status: wait for both.
    let (status, _) = wait_for("taxi Submitted", Duration::from_secs(60), || async {
        job_state(apis, "taxi", "Ready")
            .await
            .filter(|(_, ready)| ready.reason == "Submitted")
    })
    .await;
    assert_eq!(status.phase, JobPhase::Pending, "the pod does not run yet");

    // Its pod runs, then succeeds (played here, as its kubelet would report it).
    let pod = submit_pod(apis, "taxi").await;
    set_pod_status(&apis.pods, &name_of(&pod), "Running", true).await;
    let (status, _) = wait_for("taxi Running", Duration::from_secs(60), || async {
        job_state(apis, "taxi", "Running")
            .await
            .filter(|(s, c)| s.phase == JobPhase::Running && c.status == "True")
    })
    .await;
    assert!(status.started_at.is_some());
    assert_eq!(
        status.observed_generation,
        apis.jobs
            .get("taxi")
            .await
            .expect("get")
            .metadata
            .generation
    );
    set_pod_status(&apis.pods, &name_of(&pod), "Succeeded", false).await;
    let (status, complete) = wait_for("taxi Succeeded", Duration::from_secs(60), || async {
        job_state(apis, "taxi", "Complete")
            .await
            .filter(|(s, _)| s.phase == JobPhase::Succeeded)
    })
    .await;
    assert_eq!(complete.status, "True");
    assert!(status.finished_at.is_some());
    assert_eq!(
        condition(&status.conditions, "Running")
            .map(|c| c.status)
            .as_deref(),
        Some("False")
    );

    // The ephemeral cluster goes at once; the WrkJob (with its Job) after its TTL of 4 s.
    wait_for(
        "the ephemeral cluster deleted",
        Duration::from_secs(60),
        || async {
            apis.clusters
                .get_opt("taxi")
                .await
                .ok()?
                .is_none()
                .then_some(())
        },
    )
    .await;
    wait_for(
        "taxi deleted after its TTL, with its Job",
        Duration::from_secs(60),
        || async {
            let job = apis.jobs.get_opt("taxi").await.ok()?;
            let submit = apis.batch.get_opt("taxi-submit").await.ok()?;
            (job.is_none() && submit.is_none()).then_some(())
        },
    )
    .await;

    // A job whose cluster's scheduler never comes up fails at its deadline, having started
    // nothing.
    let waiting = job_manifest(
        "late",
        serde_json::json!({ "cluster": "demo" }),
        serde_json::json!({ "deadlineSeconds": 3 }),
    );
    apis.jobs
        .create(&PostParams::default(), &waiting)
        .await
        .expect("create WrkJob late");
    let (status, failed) = wait_for(
        "late: DeadlineExceeded",
        Duration::from_secs(60),
        || async {
            job_state(apis, "late", "Failed")
                .await
                .filter(|(s, _)| s.phase == JobPhase::Failed)
        },
    )
    .await;
    assert_eq!(failed.reason, "DeadlineExceeded", "{}", failed.message);
    assert!(status.finished_at.is_some());
    assert!(
        apis.batch
            .get_opt("late-submit")
            .await
            .expect("get")
            .is_none()
    );

    // A job that runs past its deadline fails with DeadlineExceeded (from the Job controller's
    // activeDeadlineSeconds or from the operator, whichever acts first), and its Job is stopped.
    let slow = job_manifest(
        "slow",
        serde_json::json!({ "cluster": "scale" }),
        serde_json::json!({ "deadlineSeconds": 6, "token": { "name": "scale-tokens", "key": "client-token" } }),
    );
    apis.jobs
        .create(&PostParams::default(), &slow)
        .await
        .expect("create WrkJob slow");
    let submitted = wait_for(
        "the submitting Job of slow",
        Duration::from_secs(30),
        || async { apis.batch.get_opt("slow-submit").await.ok()? },
    )
    .await;
    let deadline = submitted
        .spec
        .as_ref()
        .and_then(|s| s.active_deadline_seconds)
        .expect("activeDeadlineSeconds");
    assert!((1..=6).contains(&deadline), "{deadline}");
    let pod = submit_pod(apis, "slow").await;
    set_pod_status(&apis.pods, &name_of(&pod), "Running", true).await;
    let (_, failed) = wait_for(
        "slow: DeadlineExceeded",
        Duration::from_secs(60),
        || async {
            job_state(apis, "slow", "Failed")
                .await
                .filter(|(s, _)| s.phase == JobPhase::Failed)
        },
    )
    .await;
    assert_eq!(failed.reason, "DeadlineExceeded", "{}", failed.message);
    wait_for("slow: its pod stopped", Duration::from_secs(60), || async {
        let gone = apis
            .pods
            .get_opt(&name_of(&pod))
            .await
            .ok()?
            .is_none_or(|p| p.metadata.deletion_timestamp.is_some());
        gone.then_some(())
    })
    .await;

    // A submission that fails (its pod fails: the scheduler refused or failed the job) is not
    // retried: the WrkJob fails with the Job controller's reason.
    let broken = job_manifest(
        "refused",
        serde_json::json!({ "cluster": "scale" }),
        serde_json::json!({}),
    );
    apis.jobs
        .create(&PostParams::default(), &broken)
        .await
        .expect("create WrkJob refused");
    let pod = submit_pod(apis, "refused").await;
    set_pod_status(&apis.pods, &name_of(&pod), "Failed", false).await;
    let (_, failed) = wait_for("refused: Failed", Duration::from_secs(60), || async {
        job_state(apis, "refused", "Failed")
            .await
            .filter(|(s, _)| s.phase == JobPhase::Failed)
    })
    .await;
    assert_eq!(failed.reason, "BackoffLimitExceeded", "{}", failed.message);
}

/// Deleting owners garbage-collects what they own.
async fn owners_garbage_collect_what_they_own(apis: &Apis) {
    for job in ["late", "slow", "refused"] {
        apis.jobs
            .delete(job, &DeleteParams::background())
            .await
            .expect("delete WrkJob");
    }
    for cluster in ["demo", "scale"] {
        apis.clusters
            .delete(cluster, &DeleteParams::background())
            .await
            .expect("delete WrkCluster");
    }
    wait_for(
        "everything owned garbage-collected",
        Duration::from_secs(90),
        || async {
            let left_pods = pods_with(&apis.pods, "app.kubernetes.io/managed-by=wrk-operator")
                .await
                .len()
                + pods_with(&apis.pods, "app.kubernetes.io/component=scheduler")
                    .await
                    .len();
            let left_deployments = apis
                .deployments
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .len();
            let left_services = apis
                .services
                .list(&ListParams::default().labels("app.kubernetes.io/managed-by=wrk-operator"))
                .await
                .ok()?
                .items
                .len();
            let left_jobs = apis
                .batch
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .len();
            let left_clusters = apis
                .clusters
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .len();
            (left_pods == 0
                && left_deployments == 0
                && left_services == 0
                && left_jobs == 0
                && left_clusters == 0)
                .then_some(())
        },
    )
    .await;
}

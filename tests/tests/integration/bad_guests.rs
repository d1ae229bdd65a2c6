//! Bad modules and misbehaving guests fail their task with an error naming the module and the
//! cause, and the worker that ran them goes on serving the next job.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use crate::common::*;
use wrk_cli::job::{self, Overrides};
use wrk_cli::local::{LocalCluster, LocalClusterConfig};

fn write_job(dir: &Path, name: &str, module: &Path, extra: &str) -> std::path::PathBuf {
    let path = dir.join(format!("{name}.toml"));
    let text = format!(
        "name = \"{name}\"\nmodule = \"{}\"\n{extra}\n[[stage]]\nname = \"main\"\ntasks = 2\n",
        module.display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

async fn run(cluster: &LocalCluster, job_file: &Path) -> Result<usize, String> {
    let spec = job::plan(job_file, &Overrides::default()).map_err(|e| format!("{e:#}"))?;
    wrk_cli::client::run_job(&cluster.scheduler_url, None, spec, false)
        .await
        .map(|outcome| outcome.tables.len())
        .map_err(|e| format!("{e:#}"))
}

/// An embedded cluster of one worker with two slots, ready.
async fn one_worker_cluster() -> LocalCluster {
    let cluster = LocalCluster::start(LocalClusterConfig {
        workers: 1,
        slots_per_worker: 2,
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        cache_dir: None,
        http: None,
        pool: None,
        spill_root: None,
        device: wrk_host::gpu::detect::DeviceRequest::Cpu,
    })
    .await
    .unwrap();
    cluster
        .wait_for_workers(1, Duration::from_secs(30))
        .await
        .unwrap();
    cluster
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_guests_fail_their_task_and_the_worker_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let noop = write_job(dir.path(), "noop", &guest("noop"), "");
    let cluster = one_worker_cluster().await;
    assert_eq!(
        run(&cluster, &noop).await,
        Ok(0),
        "a healthy job runs first"
    );

    let broken_module = dir.path().join("broken.wasm");
    std::fs::write(&broken_module, b"\0asm\x0d\0\x01\0 truncated garbage").unwrap();
    let cases = [
        (
            write_job(dir.path(), "broken", &broken_module, ""),
            vec!["module `broken.wasm` is not a valid wrk:task component"],
        ),
        (
            write_job(dir.path(), "trap", &guest("test-guest-trap"), ""),
            vec![
                "module `test_guest_trap.wasm` trapped",
                "deliberate failure in test guest",
            ],
        ),
        (
            write_job(
                dir.path(),
                "spin",
                &guest("test-guest-spin"),
                "[limits]\ntask_timeout_secs = 1",
            ),
            vec!["module `test_guest_spin.wasm` exceeded its time limit of 1s"],
        ),
        (
            write_job(
                dir.path(),
                "hog",
                &guest("test-guest-hog"),
                "[limits]\ntask_memory_mib = 64",
            ),
            vec![
                "module `test_guest_hog.wasm` was stopped",
                "memory limit exceeded",
                "limit is 67108864 bytes",
            ],
        ),
        (
            // A guest's own error: the taxi module has no stage `main`.
            write_job(dir.path(), "wrong-stage", &guest("taxi-haversine"), ""),
            vec![
                "module `taxi_haversine.wasm` returned an error",
                "no stage `main`",
            ],
        ),
    ];
    for (job_file, expected) in cases {
        let err = run(&cluster, &job_file)
            .await
            .expect_err("a bad guest must fail its job");
        assert!(
            err.contains("stage `main` task"),
            "the failing stage is named: {err}"
        );
        for fragment in expected {
            assert!(err.contains(fragment), "expected `{fragment}` in: {err}");
        }
        assert_eq!(
            run(&cluster, &noop).await,
            Ok(0),
            "the worker still serves jobs after: {err}"
        );
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_job_stops_its_running_tasks_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let noop = write_job(dir.path(), "noop", &guest("noop"), "");
    // Two looping tasks that would hold both slots for two minutes.
    let spin = write_job(
        dir.path(),
        "spin",
        &guest("test-guest-spin"),
        "[limits]\ntask_timeout_secs = 120",
    );
    let cluster = one_worker_cluster().await;
    let mut client = wrk_cli::client::connect(&cluster.scheduler_url, None)
        .await
        .unwrap();
    let spec = job::plan(&spin, &Overrides::default()).unwrap();
    let job_id = client
        .submit_job(wrk_proto::SubmitJobRequest {
            job: Some(spec),
            keep_timeline: false,
            priority: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .job_id;
    let mut progress = client
        .watch_job(wrk_proto::JobRef {
            job_id: job_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let both_running = async {
        while let Some(p) = progress.message().await.unwrap() {
            if p.stages.first().is_some_and(|s| s.running == 2) {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), both_running)
        .await
        .expect("progress reports both looping tasks running");
    client
        .cancel_job(wrk_proto::JobRef { job_id })
        .await
        .unwrap();
    // An open client connection would hold the cluster's graceful shutdown.
    drop((progress, client));
    // With the looping tasks stopped, a new job gets the slots at once.
    let noop_run = tokio::time::timeout(Duration::from_secs(20), run(&cluster, &noop)).await;
    assert_eq!(
        noop_run,
        Ok(Ok(0)),
        "the cancelled tasks kept the worker's slots"
    );
    cluster.shutdown().await;
}

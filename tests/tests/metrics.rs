//! Prometheus metrics of a running local cluster: the scheduler's and every worker's `/metrics`
//! pass `promtool check metrics` (Debian's `prometheus` package; `tests/run.sh` installs it), and
//! their values move as a job runs.
//!
//! A test binary of its own: it reads a fresh embedded cluster's pool counters, and the
//! process-wide buffer cache (`wrk_host::memory::buffers::global`) that the other tests'
//! embedded clusters fill would show in them.

#[allow(dead_code)]
#[path = "integration/common.rs"]
mod common;

use std::io::Write;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use wrk_cli::job::{self, Overrides};
use wrk_cli::local::{LocalCluster, LocalClusterConfig};
use wrk_host::memory::SizeSpec;

/// Each worker's memory pool: small enough for the job to fill a good part of it.
const POOL: u64 = 4 << 20;

/// `/metrics` of `base`, after checking its content type.
fn scrape(base: &str) -> String {
    let (head, body) = http_get(base, "/metrics");
    assert!(
        head.to_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    body
}

/// `promtool check metrics` on the exposition; panics with its findings.
fn promtool_check(what: &str, text: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is needed: install Debian's `prometheus` package (tests/run.sh does)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "promtool rejects the {what} metrics:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_valid_prometheus_text_and_move_as_a_job_runs() {
    let data = taxi_dataset(40_000, 2, 10_000);
    let cluster = LocalCluster::start(LocalClusterConfig {
        workers: 2,
        slots_per_worker: 2,
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        cache_dir: None,
        http: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        pool: Some(SizeSpec::Bytes(POOL)),
        spill_root: None,
        device: wrk_host::gpu::detect::DeviceRequest::Cpu,
    })
    .await
    .unwrap();
    cluster
        .wait_for_workers(2, Duration::from_secs(30))
        .await
        .unwrap();
    let scheduler_http = cluster.http_url.clone().expect("the scheduler serves HTTP");

    let before = scrape(&scheduler_http);
    promtool_check("scheduler", &before);
    assert_eq!(metric_value(&before, "wrk_scheduler_workers"), 2.0);
    assert_eq!(
        metric_value(&before, "wrk_scheduler_jobs_submitted_total"),
        0.0
    );

    // The workers' pools, before any work.
    let status = wrk_cli::client::cluster_status(&cluster.scheduler_url, None)
        .await
        .unwrap();
    for worker in &status.workers {
        let text = scrape(&worker.http_address);
        promtool_check(&format!("worker {}", worker.worker_id), &text);
        assert_eq!(
            metric_value(&text, "wrk_worker_pool_size_bytes"),
            POOL as f64
        );
        assert_eq!(
            metric_value(&text, "wrk_worker_pool_peak_bytes"),
            0.0,
            "{text}"
        );
        for series in [
            "wrk_worker_pool_used_bytes",
            "wrk_worker_pool_leased_bytes",
            "wrk_worker_spilled_partitions",
            r#"wrk_worker_pool_spilled_bytes{tier="disk"}"#,
            r#"wrk_worker_spilled_bytes_total{tier="disk"}"#,
            r#"wrk_worker_spilled_bytes_total{tier="host"}"#,
            "wrk_worker_unspilled_bytes_total",
            "wrk_worker_spills_total",
            "wrk_worker_unspills_total",
            "wrk_worker_spill_seconds_total",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(&format!("{series} "))),
                "{series} in\n{text}"
            );
        }
    }

    let overrides = Overrides {
        sources: vec![("trips".into(), data.path().display().to_string())],
        module: Some(guest("taxi-haversine")),
        ..Overrides::default()
    };
    let _ = guest("taxi-haversine");
    let spec = job::plan(
        &workspace_root().join("guest-examples/taxi-haversine/job.toml"),
        &overrides,
    )
    .unwrap();
    let outcome = wrk_cli::client::run_job(&cluster.scheduler_url, None, spec, false)
        .await
        .unwrap();
    assert_eq!(
        outcome.tasks, 3,
        "two files: two `distance` tasks and one `summary`"
    );

    let after = scrape(&scheduler_http);
    promtool_check("scheduler", &after);
    assert_eq!(
        metric_value(&after, "wrk_scheduler_jobs_submitted_total"),
        1.0
    );
    assert_eq!(
        metric_value(
            &after,
            r#"wrk_scheduler_tasks_finished_total{outcome="succeeded",stage="distance"}"#
        ),
        2.0,
        "{after}"
    );
    assert_eq!(
        metric_value(
            &after,
            r#"wrk_scheduler_tasks_finished_total{outcome="succeeded",stage="summary"}"#
        ),
        1.0
    );
    assert_eq!(
        metric_value(
            &after,
            r#"wrk_scheduler_task_duration_seconds_count{stage="distance"}"#
        ),
        2.0
    );
    assert!(
        metric_value(
            &after,
            r#"wrk_scheduler_task_duration_seconds_sum{stage="distance"}"#
        ) > 0.0
    );

    // Every worker serves its own metrics, at the address it registered.
    let status = wrk_cli::client::cluster_status(&cluster.scheduler_url, None)
        .await
        .unwrap();
    let mut worker_tasks = 0.0;
    for worker in &status.workers {
        assert!(
            !worker.http_address.is_empty(),
            "worker {} registered no metrics address",
            worker.worker_id
        );
        let text = scrape(&worker.http_address);
        promtool_check(&format!("worker {}", worker.worker_id), &text);
        worker_tasks += metric_value(
            &text,
            r#"wrk_worker_tasks_finished_total{outcome="succeeded"}"#,
        );
        assert_eq!(metric_value(&text, "wrk_worker_slots"), 2.0);
        // The pool counted the tables the tasks held.
        let peak = metric_value(&text, "wrk_worker_pool_peak_bytes");
        assert!(peak > 0.0 && peak <= POOL as f64 * 1.2, "{text}");
        assert_eq!(
            metric_value(&text, "wrk_worker_pool_size_bytes"),
            POOL as f64
        );
    }
    assert_eq!(worker_tasks, 3.0, "the workers ran the job's three tasks");
    cluster.shutdown().await;
}

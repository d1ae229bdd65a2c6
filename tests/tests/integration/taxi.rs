//! The taxi haversine job end to end: through `wrk submit` on an embedded cluster, and across a
//! scheduler process and two worker processes; both must match the reference computed in Rust.

use std::process::Command;

use crate::common::*;

fn taxi_job() -> std::path::PathBuf {
    workspace_root().join("guest-examples/taxi-haversine/job.toml")
}

/// `wrk submit` of the taxi job with `args`, over `data`, its result written to `result`.
fn submit_taxi(
    args: &[&str],
    data: &std::path::Path,
    result: &std::path::Path,
) -> std::process::Output {
    Command::new(wrk())
        .arg("submit")
        .arg(taxi_job())
        .args(args)
        .arg("--quiet")
        .arg("--output")
        .arg(result)
        .arg("--source")
        .arg(format!("trips={}", data.display()))
        .arg("--module")
        .arg(guest("taxi-haversine"))
        .output()
        .expect("run wrk submit")
}

#[test]
fn taxi_job_on_an_embedded_cluster_matches_the_reference() {
    let _ = guest("taxi-haversine");
    // Three files: three `distance` tasks (a partition never spans files) for two workers.
    let data = taxi_dataset(120_000, 3, 10_000);
    let out = tempfile::tempdir().unwrap();
    let result = out.path().join("summary.parquet");
    let run = submit_taxi(&["--workers", "2"], data.path(), &result);
    assert!(
        run.status.success(),
        "wrk submit failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("succeeded"), "{stderr}");
    assert_summaries_match(&read_summary(&result), &taxi_reference(data.path()));
}

#[test]
fn taxi_job_across_scheduler_and_worker_processes_matches_the_reference() {
    let _ = guest("taxi-haversine");
    let data = taxi_dataset(90_000, 2, 15_000);
    let mut processes = Processes(Vec::new());
    let scheduler = start_scheduler(&mut processes, &[], &[]);
    let (url, http) = (scheduler.url.clone(), scheduler.http.clone());
    for id in ["w1", "w2"] {
        processes.0.push(start_worker(&url, id, &[]));
    }
    wait_for_workers(&url, 2, None);
    let out = tempfile::tempdir().unwrap();
    let result = out.path().join("summary.parquet");
    let run = submit_taxi(&["--scheduler", &url], data.path(), &result);
    assert!(
        run.status.success(),
        "wrk submit failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_summaries_match(&read_summary(&result), &taxi_reference(data.path()));

    let status = Command::new(wrk())
        .args(["status", "--scheduler", &url])
        .output()
        .expect("wrk status");
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(status.contains("JOB_STATE_SUCCEEDED"), "{status}");
    assert!(status.contains("w1") && status.contains("w2"), "{status}");

    // The same for scripts, as JSON.
    let json = Command::new(wrk())
        .args(["status", "--scheduler", &url, "--output", "json"])
        .output()
        .expect("wrk status --output json");
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).expect("status is JSON");
    assert_eq!(json["jobs"][0]["state"], "succeeded", "{json}");
    let ids: Vec<&str> = json["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["w1", "w2"]);

    // Scaling advice over HTTP: no backlog, and the results were fetched and released, so both
    // workers may retire.
    let (_, advice) = http_get(&http, "/scaling?target_secs=30");
    let advice: serde_json::Value = serde_json::from_str(&advice).expect("scaling advice is JSON");
    assert_eq!(advice["target_secs"], 30.0);
    assert_eq!(advice["current_workers"], 2);
    assert_eq!(advice["backlog_tasks"], 0);
    assert_eq!(
        advice["retirable_workers"],
        serde_json::json!(["w1", "w2"]),
        "{advice}"
    );
}

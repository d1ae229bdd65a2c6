//! The taxi haversine job end to end: through `wrk submit` on an embedded cluster, and across a
//! scheduler process and two worker processes; both must match the reference computed in Rust.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn taxi_job() -> std::path::PathBuf {
    workspace_root().join("guest-examples/taxi-haversine/job.toml")
}

#[test]
fn taxi_job_on_an_embedded_cluster_matches_the_reference() {
    let _ = guest("taxi-haversine");
    // Three files: three `distance` tasks (a partition never spans files) for two workers.
    let data = taxi_dataset(120_000, 3, 10_000);
    let out = tempfile::tempdir().unwrap();
    let result = out.path().join("summary.parquet");
    let run = Command::new(wrk())
        .arg("submit")
        .arg(taxi_job())
        .args(["--workers", "2", "--quiet", "--output"])
        .arg(&result)
        .arg("--source")
        .arg(format!("trips={}", data.path().display()))
        .output()
        .expect("run wrk submit");
    assert!(
        run.status.success(),
        "wrk submit failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("succeeded"), "{stderr}");
    assert_summaries_match(&read_summary(&result), &taxi_reference(data.path()));
}

/// Kills its child processes when dropped, so a failing test leaves nothing running.
struct Processes(Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn taxi_job_across_scheduler_and_worker_processes_matches_the_reference() {
    let _ = guest("taxi-haversine");
    let data = taxi_dataset(90_000, 2, 15_000);
    let mut processes = Processes(Vec::new());
    let mut scheduler = Command::new(wrk())
        .args([
            "scheduler",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .expect("start wrk scheduler");
    let stderr = scheduler.stderr.take().expect("scheduler stderr");
    processes.0.push(scheduler);
    let mut lines = BufReader::new(stderr).lines();
    let mut http = None;
    let address = loop {
        let line = lines
            .next()
            .expect("scheduler exited early")
            .expect("read scheduler output");
        if let Some(address) = line.strip_prefix("wrk scheduler http on ") {
            http = Some(address.trim().to_string());
        }
        if let Some(address) = line.strip_prefix("wrk scheduler listening on ") {
            break address.trim().to_string();
        }
    };
    let http = http.expect("the scheduler announces its HTTP address first");
    // Keep draining the scheduler's log so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    let url = format!("http://{address}");
    for id in ["w1", "w2"] {
        let worker = Command::new(wrk())
            .args([
                "worker",
                "--scheduler",
                &url,
                "--listen",
                "127.0.0.1:0",
                "--id",
                id,
            ])
            .stderr(Stdio::null())
            .spawn()
            .expect("start wrk worker");
        processes.0.push(worker);
    }
    let started = Instant::now();
    loop {
        let status = Command::new(wrk())
            .args(["status", "--scheduler", &url])
            .output()
            .expect("wrk status");
        if String::from_utf8_lossy(&status.stdout).contains("workers: 2") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "workers did not register"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = tempfile::tempdir().unwrap();
    let result = out.path().join("summary.parquet");
    let run = Command::new(wrk())
        .arg("submit")
        .arg(taxi_job())
        .args(["--scheduler", &url, "--quiet", "--output"])
        .arg(&result)
        .arg("--source")
        .arg(format!("trips={}", data.path().display()))
        .output()
        .expect("run wrk submit");
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
    let advice = http_get(&http, "/scaling?target_secs=30");
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

/// A plain HTTP/1.1 GET; returns the body of a 200 answer.
fn http_get(address: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream =
        std::net::TcpStream::connect(address).expect("connect to the scheduler's HTTP port");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .expect("read the response");
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

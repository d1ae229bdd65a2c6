//! The data lifecycle across real processes (a `wrk scheduler`, `wrk worker`s and the `wrk`
//! client over gRPC on 127.0.0.1): persisted datasets read by later jobs, rebalanced, recomputed
//! after their worker is killed and released; workers retired by command and by SIGTERM; a task
//! whose workers keep dying poisons its job; and a scheduler without tenants refuses to listen
//! beyond loopback.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

const COLUMNS: &str = r#"["pickup_longitude", "pickup_latitude", "dropoff_longitude", "dropoff_latitude", "passenger_count"]"#;

/// What both dataset tests start from: the taxi trips and their reference summary, the jobs
/// persisting and reading them, a component cache path, and a scheduler (heartbeats every
/// 100 ms) that declares a worker lost after `worker_timeout_secs`.
struct DatasetCluster {
    data: tempfile::TempDir,
    reference: Summary,
    dir: tempfile::TempDir,
    persist_job: PathBuf,
    read_job: PathBuf,
    cache: String,
    processes: Processes,
    scheduler: SchedulerProcess,
}

impl DatasetCluster {
    fn start(worker_timeout_secs: &str) -> Self {
        let data = taxi_dataset(30_000, 6, 5_000);
        let reference = taxi_reference(data.path());
        let dir = tempfile::tempdir().unwrap();
        let (persist_job, read_job) = dataset_jobs(dir.path(), data.path());
        let cache = dir.path().join("cache").to_string_lossy().into_owned();
        let mut processes = Processes(Vec::new());
        let scheduler = start_scheduler(
            &mut processes,
            &[
                "--heartbeat-ms",
                "100",
                "--worker-timeout-secs",
                worker_timeout_secs,
            ],
            &[],
        );
        DatasetCluster {
            data,
            reference,
            dir,
            persist_job,
            read_job,
            cache,
            processes,
            scheduler,
        }
    }
}

/// Writes the job persisting the trips of `data` (six partitions, kept as read) and the job
/// reading them back into the taxi summary; returns their paths.
fn dataset_jobs(dir: &Path, data: &Path) -> (PathBuf, PathBuf) {
    let persist = dir.join("persist.toml");
    std::fs::write(
        &persist,
        format!(
            r#"
name = "persist-trips"
persist = "trips"
[params]
delay_ms = "1"
[sources.trips]
path = "{data}"
[[stage]]
name = "read"
module = "{slow}"
source = "trips"
columns = {COLUMNS}
"#,
            data = data.display(),
            slow = guest("test-guest-slow").display(),
        ),
    )
    .unwrap();
    let read = dir.join("read.toml");
    std::fs::write(
        &read,
        format!(
            r#"
name = "read-trips"
module = "{taxi}"
[[stage]]
name = "distance"
dataset = "trips"
[[stage]]
name = "summary"
inputs = ["distance"]
"#,
            taxi = guest("taxi-haversine").display(),
        ),
    )
    .unwrap();
    (persist, read)
}

/// Runs `wrk ARGS --scheduler url`.
fn wrk_at(url: &str, args: &[&str]) -> Output {
    Command::new(wrk())
        .args(args)
        .args(["--scheduler", url])
        .env_remove("WRK_TOKEN")
        .output()
        .expect("run wrk")
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// `wrk datasets`, checked to succeed.
fn datasets(url: &str) -> String {
    let output = wrk_at(url, &["datasets"]);
    assert!(output.status.success(), "wrk datasets: {}", text(&output));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The partitions of dataset `trips` each worker holds, from `wrk datasets`.
fn holders(url: &str) -> Vec<(String, u32)> {
    let list = datasets(url);
    let line = list
        .lines()
        .find(|l| l.starts_with("trips "))
        .unwrap_or_else(|| panic!("no dataset trips in:\n{list}"));
    let mut holders: Vec<(String, u32)> = line
        .split_whitespace()
        .filter_map(|field| {
            let (worker, rest) = field.split_once(':')?;
            let (partitions, _) = rest.split_once('/')?;
            Some((worker.to_string(), partitions.parse().ok()?))
        })
        .collect();
    holders.sort();
    holders
}

/// Reads the dataset back into the taxi summary and checks it against the reference.
fn read_back(url: &str, job: &Path, result: &Path, reference: &Summary, when: &str) {
    let output = spawn_submit(url, job, result, &[])
        .wait_with_output()
        .expect("wait for wrk submit");
    assert!(
        output.status.success(),
        "{when}: reading the dataset failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_summaries_match(&read_summary(result), reference);
}

fn persist(url: &str, job: &Path) {
    let output = Command::new(wrk())
        .arg("submit")
        .arg(job)
        .args(["--scheduler", url, "--quiet"])
        .output()
        .expect("run wrk submit");
    assert!(output.status.success(), "persisting: {}", text(&output));
    assert!(
        text(&output).contains("persisted dataset `trips`: 6 partitions"),
        "{}",
        text(&output)
    );
}

/// Waits for `child` to exit, up to `timeout`.
fn wait_exit(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("poll a worker") {
            return status;
        }
        assert!(
            started.elapsed() < timeout,
            "the worker did not exit within {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_persisted_dataset_is_read_rebalanced_recomputed_and_released() {
    let DatasetCluster {
        data: _data,
        reference,
        dir,
        persist_job,
        read_job,
        cache,
        mut processes,
        scheduler,
    } = DatasetCluster::start("2");
    let url = scheduler.url.clone();
    let worker_args = ["--slots", "2", "--cache-dir", &cache];
    let mut workers: Vec<Child> = (0..2)
        .map(|i| start_worker(&url, &format!("w{i}"), &worker_args))
        .collect();
    wait_for_workers(&url, 2, None);

    persist(&url, &persist_job);
    let list = datasets(&url);
    assert!(list.contains("trips") && list.contains("ready"), "{list}");
    let before = holders(&url);
    assert_eq!(before.iter().map(|(_, n)| n).sum::<u32>(), 6, "{list}");
    let again = Command::new(wrk())
        .arg("submit")
        .arg(&persist_job)
        .args(["--scheduler", &url, "--quiet"])
        .output()
        .unwrap();
    assert!(
        !again.status.success() && text(&again).contains("a dataset named `trips` already exists"),
        "{}",
        text(&again)
    );
    read_back(
        &url,
        &read_job,
        &dir.path().join("r1.parquet"),
        &reference,
        "first read",
    );

    // A new, empty worker: rebalancing moves partitions to it, peer to peer.
    workers.push(start_worker(&url, "w2", &worker_args));
    wait_for_workers(&url, 3, None);
    let output = wrk_at(&url, &["rebalance", "trips"]);
    assert!(output.status.success(), "rebalance: {}", text(&output));
    let after = holders(&url);
    assert_eq!(after.iter().map(|(_, n)| n).sum::<u32>(), 6);
    assert!(
        after.iter().any(|(w, n)| w == "w2" && *n >= 1),
        "w2 holds partitions after rebalancing: {after:?}"
    );
    assert!(
        after.iter().all(|(_, n)| *n <= 3),
        "spread out: {after:?} (was {before:?})"
    );
    read_back(
        &url,
        &read_job,
        &dir.path().join("r2.parquet"),
        &reference,
        "after rebalancing",
    );

    // Kill the worker holding most partitions: they are recomputed from the persisted job.
    let (victim, _) = after.iter().max_by_key(|(_, n)| *n).unwrap().clone();
    let index = ["w0", "w1", "w2"]
        .iter()
        .position(|w| *w == victim)
        .unwrap();
    workers[index].kill().unwrap();
    workers[index].wait().unwrap();
    let started = Instant::now();
    while !scheduler
        .log
        .lock()
        .unwrap()
        .iter()
        .any(|l| l.contains("a worker holding dataset partitions was lost"))
    {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the scheduler did not notice the lost worker"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    read_back(
        &url,
        &read_job,
        &dir.path().join("r3.parquet"),
        &reference,
        "after losing a worker",
    );
    let recovered = holders(&url);
    assert_eq!(recovered.iter().map(|(_, n)| n).sum::<u32>(), 6);
    assert!(recovered.iter().all(|(w, _)| *w != victim), "{recovered:?}");

    let output = wrk_at(&url, &["release-dataset", "trips"]);
    assert!(output.status.success(), "{}", text(&output));
    assert!(datasets(&url).contains("no datasets"));
    let output = spawn_submit(&url, &read_job, &dir.path().join("r4.parquet"), &[])
        .wait_with_output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && stderr.contains("no dataset `trips`"),
        "{stderr}"
    );
    let output = wrk_at(&url, &["release-dataset", "trips"]);
    assert!(
        !output.status.success() && text(&output).contains("no dataset `trips`"),
        "{}",
        text(&output)
    );
    processes.0.extend(workers);
}

#[test]
fn retired_workers_hand_their_data_over_and_exit_cleanly() {
    let DatasetCluster {
        data: _data,
        reference,
        dir,
        persist_job,
        read_job,
        cache,
        processes: _processes,
        scheduler,
    } = DatasetCluster::start("5");
    let url = scheduler.url.clone();
    let worker_args = ["--slots", "2", "--cache-dir", &cache];
    let mut w0 = start_worker(&url, "w0", &worker_args);
    let mut w1 = start_worker(&url, "w1", &worker_args);
    wait_for_workers(&url, 2, None);
    persist(&url, &persist_job);
    assert!(
        holders(&url).iter().any(|(w, _)| w == "w0"),
        "w0 holds partitions"
    );

    // Retired by command: its partitions move to w1, then it exits 0.
    let output = wrk_at(&url, &["retire", "w0"]);
    assert!(output.status.success(), "wrk retire: {}", text(&output));
    assert!(wait_exit(&mut w0, Duration::from_secs(20)).success());
    assert_eq!(holders(&url), vec![("w1".to_string(), 6)]);
    read_back(
        &url,
        &read_job,
        &dir.path().join("r1.parquet"),
        &reference,
        "after retiring w0",
    );

    // The last worker cannot be retired.
    let output = wrk_at(&url, &["retire", "w1"]);
    assert!(
        !output.status.success()
            && text(&output).contains("worker `w1` cannot be retired: no other worker"),
        "{}",
        text(&output)
    );
    let output = wrk_at(&url, &["retire", "nobody"]);
    assert!(
        !output.status.success() && text(&output).contains("no worker `nobody`"),
        "{}",
        text(&output)
    );

    // SIGTERM: the worker asks to be retired and exits 0 once its data is on w2.
    let mut w2 = start_worker(&url, "w2", &worker_args);
    wait_for_workers(&url, 2, None);
    let term = Command::new("kill")
        .args(["-TERM", &w1.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    assert!(wait_exit(&mut w1, Duration::from_secs(20)).success());
    assert_eq!(holders(&url), vec![("w2".to_string(), 6)]);
    read_back(
        &url,
        &read_job,
        &dir.path().join("r2.parquet"),
        &reference,
        "after SIGTERM to w1",
    );
    let log = scheduler.log.lock().unwrap().clone();
    assert_eq!(
        costly_losses(&log),
        0,
        "retiring cost no recomputation:\n{}",
        log.join("\n")
    );
    let _ = w2.kill();
    let _ = w2.wait();
}

/// Starts `wrk worker` `id` logging task starts, and forwards its log lines, tagged with `id`.
fn start_watched_worker(
    url: &str,
    id: &str,
    cache: &str,
    lines: std::sync::mpsc::Sender<(String, String)>,
) -> Child {
    let mut child = worker_command(url, id, &["--slots", "1", "--cache-dir", cache])
        .env("WRK_LOG", "info,wrk_host::worker=debug")
        .stderr(Stdio::piped())
        .spawn()
        .expect("start wrk worker");
    let stderr = child.stderr.take().expect("worker stderr");
    let id = id.to_string();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines.send((id.clone(), line)).is_err() {
                break;
            }
        }
    });
    child
}

#[test]
fn a_task_that_kills_every_worker_running_it_poisons_its_job_and_others_carry_on() {
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("doomed.toml");
    std::fs::write(
        &job,
        format!(
            r#"
name = "doomed"
module = "{slow}"
[params]
delay_ms = "60000"
[[stage]]
name = "doomed"
"#,
            slow = guest("test-guest-slow").display(),
        ),
    )
    .unwrap();
    let cache = dir.path().join("cache").to_string_lossy().into_owned();
    let mut processes = Processes(Vec::new());
    let scheduler = start_scheduler(
        &mut processes,
        &["--heartbeat-ms", "100", "--worker-timeout-secs", "2"],
        &[],
    );
    let url = scheduler.url.clone();
    let (sender, lines) = std::sync::mpsc::channel();
    let mut workers: Vec<(String, Child)> = (0..2)
        .map(|i| {
            let id = format!("w{i}");
            let child = start_watched_worker(&url, &id, &cache, sender.clone());
            (id, child)
        })
        .collect();
    wait_for_workers(&url, 2, None);

    // Whichever worker starts the doomed task dies (SIGKILL) and is replaced.
    let mut submit = spawn_submit(&url, &job, &dir.path().join("none.parquet"), &[]);
    let started = Instant::now();
    let mut killed = Vec::new();
    while submit.try_wait().unwrap().is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the job did not end; killed {killed:?}"
        );
        let Ok((id, line)) = lines.recv_timeout(Duration::from_millis(100)) else {
            continue;
        };
        if !(line.contains("task started") && line.contains("stage=doomed")) {
            continue;
        }
        let Some(position) = workers.iter().position(|(w, _)| *w == id) else {
            continue;
        };
        let (_, mut child) = workers.remove(position);
        child.kill().unwrap();
        child.wait().unwrap();
        killed.push(id);
        let replacement = format!("r{}", killed.len());
        let child = start_watched_worker(&url, &replacement, &cache, sender.clone());
        workers.push((replacement, child));
    }
    let output = submit.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "the doomed job failed");
    assert_eq!(killed.len(), 3, "three workers died: {killed:?}");
    assert!(
        stderr.contains(&format!(
            "stage `doomed` task 0 is poisoned: the 3 workers that ran it died (the last: {})",
            killed[2]
        )),
        "{stderr}"
    );

    // The replacements serve other jobs.
    let data = taxi_dataset(10_000, 2, 5_000);
    let reference = taxi_reference(data.path());
    let taxi = dir.path().join("taxi.toml");
    std::fs::write(
        &taxi,
        format!(
            r#"
name = "taxi"
module = "{taxi}"
[sources.trips]
path = "{data}"
[[stage]]
name = "distance"
source = "trips"
columns = {COLUMNS}
[[stage]]
name = "summary"
inputs = ["distance"]
"#,
            taxi = guest("taxi-haversine").display(),
            data = data.path().display(),
        ),
    )
    .unwrap();
    read_back(
        &url,
        &taxi,
        &dir.path().join("taxi.parquet"),
        &reference,
        "after the poisoned job",
    );
    processes.0.extend(workers.into_iter().map(|(_, c)| c));
}

#[test]
fn a_scheduler_without_tenants_refuses_to_listen_beyond_loopback() {
    let output = Command::new(wrk())
        .args([
            "scheduler",
            "--listen",
            "0.0.0.0:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .output()
        .expect("run wrk scheduler");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "it refuses: {stderr}");
    assert!(
        stderr.contains("refusing to listen on 0.0.0.0:0 without authentication")
            && stderr.contains("--insecure-no-auth"),
        "{stderr}"
    );

    // Told so, it serves; and a loopback scheduler needs nothing.
    let mut processes = Processes(Vec::new());
    let mut open = Command::new(wrk())
        .args([
            "scheduler",
            "--listen",
            "0.0.0.0:0",
            "--http-listen",
            "127.0.0.1:0",
            "--insecure-no-auth",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .expect("run wrk scheduler");
    let stderr = open.stderr.take().expect("scheduler stderr");
    processes.0.push(open);
    let listening = BufReader::new(stderr)
        .lines()
        .map_while(Result::ok)
        .find(|l| l.starts_with("wrk scheduler listening on 0.0.0.0:"));
    assert!(listening.is_some(), "with --insecure-no-auth it serves");
    let loopback = start_scheduler(&mut processes, &[], &[]);
    assert!(loopback.url.starts_with("http://127.0.0.1:"));
}

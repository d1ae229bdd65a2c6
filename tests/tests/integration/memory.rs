//! The memory pool across real processes.
//!
//! - A job whose working set is more than three times a worker's pool (stage `keep` holds every
//!   partition of a generated dataset, `sum` aggregates each one-to-one, `combine` adds them up)
//!   completes by spilling with the answer computed here from the same data, and the worker's
//!   peak resident memory (`VmHWM` from `/proc/<pid>/status`, the OS's figure, not ours) stays
//!   within the pool plus 20% plus the peak of an idle worker that ran the same job on a tiny
//!   dataset (the runtime, the components and the guests' instances).
//! - Two tasks that each hold half the pool and both need more finish in bounded time: one
//!   gives way (a retriable failure naming the sizes) and runs again once the other is done.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use arrow::array::{Array, AsArray, Float64Array, RecordBatch};
use arrow::datatypes::{Float64Type, Int64Type};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;

const MIB: u64 = 1 << 20;
const POOL: u64 = 256 * MIB;
/// Rows per row group: 4 f64 columns, 32 MiB in Arrow, one partition each.
const GROUP_ROWS: usize = 1 << 20;

/// Writes `files` Parquet files of `groups` row groups each (plain encoding, uncompressed, so
/// the files' size estimates match the tables in memory); returns the sum of `value` and the
/// row count, computed as the data is made.
fn generate(dir: &Path, files: usize, groups: usize, group_rows: usize) -> (f64, i64) {
    let properties = WriterProperties::builder()
        .set_dictionary_enabled(false)
        .set_compression(Compression::UNCOMPRESSED)
        .set_max_row_group_row_count(Some(group_rows))
        .build();
    let (mut total, mut rows) = (0.0f64, 0i64);
    for file in 0..files {
        let path = dir.join(format!("part-{file:03}.parquet"));
        let mut writer = None;
        for group in 0..groups {
            let start = ((file * groups + group) * group_rows) as u64;
            let values: Vec<f64> = (start..start + group_rows as u64)
                .map(|i| (i % 1000) as f64 * 0.5)
                .collect();
            total += values.iter().sum::<f64>();
            rows += group_rows as i64;
            let column = |scale: f64| {
                Arc::new(Float64Array::from_iter_values(
                    values.iter().map(|v| v * scale),
                )) as Arc<dyn Array>
            };
            let batch = RecordBatch::try_from_iter([
                ("value", column(1.0)),
                ("a", column(2.0)),
                ("b", column(3.0)),
                ("c", column(4.0)),
            ])
            .unwrap();
            let writer = writer.get_or_insert_with(|| {
                ArrowWriter::try_new(
                    std::fs::File::create(&path).unwrap(),
                    batch.schema(),
                    Some(properties.clone()),
                )
                .unwrap()
            });
            writer.write(&batch).unwrap();
            writer.flush().unwrap();
        }
        writer.unwrap().close().unwrap();
    }
    (total, rows)
}

fn job_file(dir: &Path, data: &Path, name: &str) -> std::path::PathBuf {
    let job = dir.join(format!("{name}.toml"));
    std::fs::write(
        &job,
        format!(
            r#"
name = "{name}"
module = "{module}"
[sources.data]
path = "{data}"
[[stage]]
name = "keep"
source = "data"
columns = ["value", "a", "b", "c"]
partition_mib = 32
[[stage]]
name = "sum"
inputs = [{{ stage = "keep", pattern = "one-to-one" }}]
[[stage]]
name = "combine"
inputs = ["sum"]
"#,
            module = guest("test-guest-memory").display(),
            data = data.display(),
        ),
    )
    .unwrap();
    job
}

/// Runs `job` with `wrk submit` against `url`; returns the result's value sum and count.
fn submit(url: &str, job: &Path, result: &Path) -> (f64, i64) {
    let output = Command::new(wrk())
        .arg("submit")
        .arg(job)
        .args(["--scheduler", url, "--quiet", "--output"])
        .arg(result)
        .output()
        .expect("run wrk submit");
    assert!(
        output.status.success(),
        "the job failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let batch = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(result).unwrap())
        .unwrap()
        .build()
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    (
        batch.column(0).as_primitive::<Float64Type>().value(0),
        batch.column(1).as_primitive::<Int64Type>().value(0),
    )
}

/// The peak resident memory of a process, from the OS.
fn vm_hwm(child: &Child) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

fn worker_status(url: &str, id: &str) -> serde_json::Value {
    let output = Command::new(wrk())
        .args(["status", "--scheduler", url, "--output", "json"])
        .env_remove("WRK_TOKEN")
        .output()
        .unwrap();
    let status: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    status["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == id)
        .cloned()
        .unwrap_or_else(|| panic!("worker {id} in {status}"))
}

fn spill_files(dir: &Path) -> usize {
    walk(dir)
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "arrows"))
        .count()
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

#[test]
fn a_working_set_three_times_the_pool_completes_within_the_pool_plus_20_percent() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let (tiny, big) = (dir.path().join("tiny"), dir.path().join("big"));
    std::fs::create_dir_all(&tiny).unwrap();
    std::fs::create_dir_all(&big).unwrap();
    // 28 partitions of 32 MiB: 896 MiB, 3.5 times the pool.
    let (expected_sum, expected_rows) = generate(&big, 14, 2, GROUP_ROWS);
    let tiny_answer = generate(&tiny, 2, 2, 1000);
    let generated = started.elapsed();

    let mut processes = Processes(Vec::new());
    let scheduler = start_scheduler(&mut processes, &["--heartbeat-ms", "100"], &[]);
    let url = scheduler.url.clone();
    let cache = dir.path().join("cache").to_string_lossy().into_owned();
    let spill = dir.path().join("spill");
    let spill_arg = spill.to_string_lossy().into_owned();
    let pool = format!("{}MiB", POOL / MIB);
    let args = [
        "--slots",
        "2",
        "--cache-dir",
        &cache,
        "--memory-limit",
        "2GiB",
        "--pool-size",
        &pool,
        "--spill-dir",
        &spill_arg,
    ];
    let tiny_job = job_file(dir.path(), &tiny, "tiny");
    let tiny_result = dir.path().join("tiny.parquet");

    // Compile the component once into the cache, then measure an idle worker's peak running
    // the tiny job: the baseline of the runtime itself.
    let mut warm = start_worker(&url, "warm", &args);
    wait_for_workers(&url, 1, None);
    assert_eq!(submit(&url, &tiny_job, &tiny_result), tiny_answer);
    warm.kill().unwrap();
    warm.wait().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let baseline_worker = start_worker(&url, "baseline", &args);
    processes.0.push(baseline_worker);
    wait_for_workers(&url, 1, None);
    assert_eq!(submit(&url, &tiny_job, &tiny_result), tiny_answer);
    let baseline = vm_hwm(&processes.0[1]);
    let mut baseline_worker = processes.0.remove(1);
    baseline_worker.kill().unwrap();
    baseline_worker.wait().unwrap();
    std::thread::sleep(Duration::from_millis(300));

    let worker = start_worker(&url, "measured", &args);
    processes.0.push(worker);
    wait_for_workers(&url, 1, None);
    let job_started = Instant::now();
    let (sum, rows) = submit(
        &url,
        &job_file(dir.path(), &big, "big"),
        &dir.path().join("big.parquet"),
    );
    let job_time = job_started.elapsed();
    assert_eq!(rows, expected_rows, "every row counted once");
    assert_eq!(sum, expected_sum, "the sum of every value");

    let peak = vm_hwm(&processes.0[1]);
    let limit = POOL + POOL / 5 + baseline;
    eprintln!(
        "generated in {generated:.1?}, job in {job_time:.1?}; worker peak RSS {} MiB, idle baseline {} MiB, limit {} MiB; pool as reported: {}",
        peak / MIB,
        baseline / MIB,
        limit / MIB,
        worker_status(&url, "measured")["pool"]
    );
    assert!(
        peak <= limit,
        "peak resident memory {} MiB is over the pool ({} MiB) + 20% + the idle baseline ({} MiB)",
        peak / MIB,
        POOL / MIB,
        baseline / MIB
    );

    // The pool did spill and read back, as the worker reports to the scheduler.
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        let status = worker_status(&url, "measured");
        let files = spill_files(&spill);
        if status["pool"]["unspills"].as_u64().unwrap_or(0) > 0 && files == 0 {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the worker reports {status} with {files} spill files left"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let pool_status = &status["pool"];
    assert_eq!(pool_status["size_bytes"].as_u64(), Some(POOL));
    assert!(pool_status["spills"].as_u64().unwrap() >= 20, "{status}");
    assert!(
        pool_status["peak_bytes"].as_u64().unwrap() <= POOL + POOL / 5,
        "{status}"
    );
    assert!(
        pool_status["peak_bytes"].as_u64().unwrap() >= POOL / 2,
        "{status}"
    );
}

#[test]
fn two_tasks_each_holding_half_the_pool_and_wanting_more_finish_in_bounded_time() {
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("hold.toml");
    std::fs::write(
        &job,
        format!(
            r#"
name = "hold"
module = "{module}"
[params]
wait_ms = "1500"
[[stage]]
name = "hold"
tasks = 2
"#,
            module = guest("test-guest-memory").display(),
        ),
    )
    .unwrap();
    let mut processes = Processes(Vec::new());
    let scheduler = start_scheduler(&mut processes, &["--heartbeat-ms", "100"], &[]);
    let spill = dir.path().join("spill").to_string_lossy().into_owned();
    let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let metrics = format!("127.0.0.1:{metrics_port}");
    processes.0.push(start_worker(
        &scheduler.url,
        "w",
        &[
            "--slots",
            "2",
            "--pool-size",
            "64MiB",
            "--spill-dir",
            &spill,
            "--metrics-listen",
            &metrics,
        ],
    ));
    wait_for_workers(&scheduler.url, 1, None);
    let started = Instant::now();
    let mut submit = Command::new(wrk())
        .arg("submit")
        .arg(&job)
        .args(["--scheduler", &scheduler.url, "--quiet"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(status) = submit.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the job hangs: two tasks holding half the pool each deadlocked"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = submit.wait_with_output().unwrap();
    assert!(
        status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let printed = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        printed.matches(&(48 * MIB).to_string()).count(),
        2,
        "both tasks leased three quarters of the pool in the end:\n{printed}"
    );
    // One of them gave way once (a retriable failure), then ran again.
    let (_, body) = http_get(&metrics, "/metrics");
    let failed = body
        .lines()
        .find(|l| l.starts_with(r#"wrk_worker_tasks_finished_total{outcome="failed"}"#))
        .unwrap_or_else(|| panic!("no failed attempt in\n{body}"));
    assert!(failed.ends_with(" 1"), "{failed}");
}

#[test]
fn inconsistent_memory_settings_stop_the_worker_at_start_naming_the_sizes() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let output = Command::new(wrk())
            .args(["worker", "--scheduler", "http://127.0.0.1:9"])
            .args(args)
            .env_remove("WRK_MEMORY_LIMIT_BYTES")
            .env_remove("WRK_POOL_BYTES")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert!(!output.status.success());
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let err = run(&["--memory-limit", "1GiB", "--pool-size", "2GiB"], &[]);
    assert!(err.contains("pool of 2.0 GiB"), "{err}");
    assert!(err.contains("memory limit of 1.0 GiB"), "{err}");
    // The operator's environment variables are read the same way.
    let err = run(
        &[],
        &[
            ("WRK_MEMORY_LIMIT_BYTES", "1073741824"),
            ("WRK_POOL_BYTES", "2147483648"),
        ],
    );
    assert!(err.contains("does not fit in the memory limit"), "{err}");
    let err = run(&["--memory-limit", "1PiB"], &[]);
    assert!(err.contains("more than this machine offers"), "{err}");
    let err = run(&["--pool-size", "lots"], &[]);
    assert!(err.contains("`lots` is not a size"), "{err}");
}

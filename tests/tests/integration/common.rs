//! Helpers shared by the integration tests: building the guests and the `wrk` binary once per
//! test run, generating taxi data, and the reference answer computed directly in Rust.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use arrow::array::{Array, AsArray};
use arrow::datatypes::{Float64Type, Int32Type, Int64Type};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

/// `target/` of the running test binary (`target/debug/deps/<test>`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.ancestors()
        .nth(3)
        .expect("target directory")
        .to_path_buf()
}

/// The repository's root: `WRK_WORKSPACE_ROOT` where the tests run from a bundle in another
/// checkout (`host/gpu-check.sh` on a machine without cargo), else the one they were built in.
pub fn workspace_root() -> PathBuf {
    if let Some(root) = std::env::var_os("WRK_WORKSPACE_ROOT") {
        return PathBuf::from(root);
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// `WRK_TEST_ARTIFACTS`: a folder holding a prebuilt `wrk` and the guests' `.wasm` files
/// (`host/gpu-bundle.sh` makes one), used instead of building them with cargo, for machines
/// that have no Rust toolchain (the lent GPU machines).
fn prebuilt(file: &str) -> Option<PathBuf> {
    let path = PathBuf::from(std::env::var_os("WRK_TEST_ARTIFACTS")?).join(file);
    assert!(
        path.exists(),
        "WRK_TEST_ARTIFACTS is set but holds no {file}: {}",
        path.display()
    );
    Some(path)
}

fn cargo() -> Command {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    // The guests build for another target: flags meant for the host must not leak into them.
    command
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .current_dir(workspace_root());
    // Nor the variables cargo sets for this test (its package, manifest and output folders):
    // build scripts that watch them (ring's does) would run again, and the outer build would
    // then rebuild what depends on them, every run.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let set_for_this_test = name == "OUT_DIR"
            || [
                "CARGO_PKG_",
                "CARGO_MANIFEST_",
                "CARGO_CRATE_",
                "CARGO_BIN_",
                "CARGO_TARGET_TMPDIR",
            ]
            .iter()
            .any(|prefix| name.starts_with(prefix))
            || name == "CARGO_PRIMARY_PACKAGE";
        if set_for_this_test {
            command.env_remove(name.as_ref());
        }
    }
    command
}

const GUESTS: [&str; 14] = [
    "taxi-haversine",
    "noop",
    "fare-stats",
    "zone-join",
    "top-fares",
    "word-count",
    "zone-filter",
    "shuffle-join",
    "shuffle-groupby",
    "test-guest-trap",
    "test-guest-spin",
    "test-guest-hog",
    "test-guest-slow",
    "test-guest-memory",
];

/// The path of a guest component, building every test guest once (or from `WRK_TEST_ARTIFACTS`).
pub fn guest(crate_name: &str) -> PathBuf {
    let file = format!("{}.wasm", crate_name.replace('-', "_"));
    if let Some(path) = prebuilt(&file) {
        return path;
    }
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let mut command = cargo();
        command.args(["build", "--release", "--target", "wasm32-wasip2"]);
        for g in GUESTS {
            command.args(["-p", g]);
        }
        let status = command.status().expect("run cargo to build the guests");
        assert!(status.success(), "building the guests failed");
    });
    target_dir().join("wasm32-wasip2/release").join(file)
}

/// The `wrk` binary of this build (or of `WRK_TEST_ARTIFACTS`).
pub fn wrk() -> PathBuf {
    if let Some(path) = prebuilt("wrk") {
        return path;
    }
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let mut build = cargo();
        build.args(["build", "-p", "wrk-cli", "--bin", "wrk"]);
        if cfg!(feature = "ucx") {
            build.args(["--features", "ucx"]);
        }
        let status = build.status().expect("run cargo to build wrk");
        assert!(status.success(), "building wrk failed");
    });
    target_dir().join("debug").join("wrk")
}

/// Whether this machine has a usable GPU; with `WRK_REQUIRE_GPU=1` it must have one.
pub fn has_gpu() -> bool {
    let found = wrk_host::gpu::detect::probe(0);
    if std::env::var("WRK_REQUIRE_GPU").is_ok_and(|v| v == "1")
        && let Err(reason) = &found
    {
        panic!("WRK_REQUIRE_GPU=1 but no GPU can be used: {reason}");
    }
    found.is_ok()
}

/// A deterministic taxi dataset in a temporary directory.
pub fn taxi_dataset(rows: u64, files: u32, row_group_rows: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    wrk_cli::taxi::generate(
        dir.path(),
        &wrk_cli::taxi::TaxiConfig {
            rows,
            files,
            row_group_rows,
            seed: 11,
            drivers: (rows / 4).max(1),
        },
    )
    .expect("generate taxi data");
    dir
}

/// Per passenger count: trips, total km, mean km.
pub type Summary = BTreeMap<i32, (i64, f64, f64)>;

fn haversine_km(lon1: f64, lat1: f64, lon2: f64, lat2: f64) -> f64 {
    let rad = std::f64::consts::PI / 180.0;
    let (lat1, lat2) = (lat1 * rad, lat2 * rad);
    let dlat = (lat2 - lat1) / 2.0;
    let dlon = (lon2 * rad - lon1 * rad) / 2.0;
    let a = dlat.sin().powi(2) + lat1.cos() * lat2.cos() * dlon.sin().powi(2);
    2.0 * 6371.0 * a.sqrt().asin()
}

/// The taxi job's answer, computed directly from the Parquet files.
pub fn taxi_reference(dir: &Path) -> Summary {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read data dir")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect();
    files.sort();
    let mut sums: BTreeMap<i32, (i64, f64)> = BTreeMap::new();
    for file in files {
        let reader =
            ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(&file).expect("open"))
                .expect("parquet")
                .build()
                .expect("reader");
        for batch in reader {
            let batch = batch.expect("batch");
            let f = |name: &str| {
                batch
                    .column_by_name(name)
                    .expect(name)
                    .as_primitive::<Float64Type>()
                    .clone()
            };
            let (lon1, lat1, lon2, lat2) = (
                f("pickup_longitude"),
                f("pickup_latitude"),
                f("dropoff_longitude"),
                f("dropoff_latitude"),
            );
            let passengers = batch
                .column_by_name("passenger_count")
                .expect("passenger_count")
                .as_primitive::<Int32Type>()
                .clone();
            for row in 0..batch.num_rows() {
                let d = haversine_km(
                    lon1.value(row),
                    lat1.value(row),
                    lon2.value(row),
                    lat2.value(row),
                );
                let entry = sums.entry(passengers.value(row)).or_default();
                entry.0 += 1;
                entry.1 += d;
            }
        }
    }
    sums.into_iter()
        .map(|(k, (n, total))| (k, (n, total, total / n as f64)))
        .collect()
}

/// Reads the taxi job's result file.
pub fn read_summary(path: &Path) -> Summary {
    let reader =
        ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(path).expect("open result"))
            .expect("result is Parquet")
            .build()
            .expect("reader");
    let mut out = Summary::new();
    for batch in reader {
        let batch = batch.expect("batch");
        let names: Vec<&str> = batch
            .schema_ref()
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        assert_eq!(names, ["passenger_count", "trips", "total_km", "mean_km"]);
        let keys = batch.column(0).as_primitive::<Int32Type>();
        let trips = batch.column(1).as_primitive::<Int64Type>();
        let total = batch.column(2).as_primitive::<Float64Type>();
        let mean = batch.column(3).as_primitive::<Float64Type>();
        assert_eq!(keys.null_count(), 0);
        for row in 0..batch.num_rows() {
            let previous = out.insert(
                keys.value(row),
                (trips.value(row), total.value(row), mean.value(row)),
            );
            assert!(
                previous.is_none(),
                "passenger_count {} appears twice",
                keys.value(row)
            );
        }
    }
    out
}

pub fn assert_close(what: &str, actual: f64, expected: f64) {
    let relative = (actual - expected).abs() / expected.abs().max(f64::MIN_POSITIVE);
    assert!(
        relative <= 1e-9,
        "{what}: {actual} vs reference {expected} (relative error {relative:e})"
    );
}

pub fn assert_summaries_match(actual: &Summary, expected: &Summary) {
    assert_eq!(
        actual.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>(),
        "the same passenger counts"
    );
    for (key, (trips, total, mean)) in expected {
        let (a_trips, a_total, a_mean) = actual[key];
        assert_eq!(a_trips, *trips, "trips for passenger_count {key}");
        assert_close(
            &format!("total_km for passenger_count {key}"),
            a_total,
            *total,
        );
        assert_close(&format!("mean_km for passenger_count {key}"), a_mean, *mean);
    }
}

/// Kills its child processes when dropped, so a failing test leaves nothing running.
pub struct Processes(pub Vec<std::process::Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `wrk worker` `id` attached to `url` on a free loopback port, with `extra` arguments, for the
/// caller to set its environment and output before spawning it.
pub fn worker_command(url: &str, id: &str, extra: &[&str]) -> Command {
    let mut command = Command::new(wrk());
    command
        .args([
            "worker",
            "--scheduler",
            url,
            "--listen",
            "127.0.0.1:0",
            "--id",
            id,
        ])
        .args(extra);
    command
}

/// Starts `wrk worker` `id` attached to `url` on a free loopback port, with `extra` arguments and
/// its log discarded.
pub fn start_worker(url: &str, id: &str, extra: &[&str]) -> std::process::Child {
    worker_command(url, id, extra)
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start wrk worker")
}

/// Starts `wrk submit job` against the scheduler at `url`, writing the result to `result`, with
/// `extra` arguments; its stderr is piped for the failure message.
pub fn spawn_submit(url: &str, job: &Path, result: &Path, extra: &[String]) -> std::process::Child {
    Command::new(wrk())
        .arg("submit")
        .arg(job)
        .args(["--scheduler", url, "--quiet", "--output"])
        .arg(result)
        .args(extra)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run wrk submit")
}

/// Kills `workers[victim]` with SIGKILL and starts `wrk worker` `id` with `args` in its place.
pub fn replace_worker(
    workers: &mut [std::process::Child],
    victim: usize,
    url: &str,
    id: &str,
    args: &[&str],
) {
    workers[victim].kill().expect("SIGKILL a worker");
    workers[victim].wait().expect("reap the killed worker");
    workers[victim] = start_worker(url, id, args);
}

/// Lines of a scheduler's log where losing a worker cost work (tasks to rerun or recompute),
/// rather than an idle worker leaving.
pub fn costly_losses(log: &[String]) -> usize {
    log.iter()
        .filter(|l| {
            l.contains("worker lost") && !l.contains(": 0 running tasks to rerun, 0 finished")
        })
        .count()
}

/// A `wrk scheduler` process: its gRPC URL, its HTTP address and its log lines as they arrive.
pub struct SchedulerProcess {
    pub url: String,
    pub http: String,
    pub log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

/// Starts `wrk scheduler` on free loopback ports, with `extra` arguments and environment.
pub fn start_scheduler(
    processes: &mut Processes,
    extra: &[&str],
    env: &[(&str, &str)],
) -> SchedulerProcess {
    use std::io::{BufRead, BufReader};
    let mut scheduler = Command::new(wrk())
        .args([
            "scheduler",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .args(extra)
        .envs(env.iter().copied())
        .stderr(std::process::Stdio::piped())
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
            .expect("scheduler output");
        if let Some(address) = line.strip_prefix("wrk scheduler http on ") {
            http = Some(address.trim().to_string());
        }
        if let Some(address) = line.strip_prefix("wrk scheduler listening on ") {
            break address.trim().to_string();
        }
    };
    // Keep draining the log so the scheduler never blocks on a full pipe.
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = log.clone();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            if let Ok(mut log) = sink.lock() {
                log.push(line);
            }
        }
    });
    SchedulerProcess {
        url: format!("http://{address}"),
        http: http.expect("the scheduler announces its HTTP address first"),
        log,
    }
}

/// Waits until `count` workers are registered, as `wrk status` (with `token`) reports.
pub fn wait_for_workers(url: &str, count: usize, token: Option<&str>) {
    let started = std::time::Instant::now();
    loop {
        let mut status = Command::new(wrk());
        status
            .args(["status", "--scheduler", url])
            .env_remove("WRK_TOKEN");
        if let Some(token) = token {
            status.env("WRK_TOKEN", token);
        }
        let output = status.output().expect("wrk status");
        let report = String::from_utf8_lossy(&output.stdout);
        if report.contains(&format!("workers: {count}")) {
            return;
        }
        // Generous: an emulated-GPU worker self-tests its kernels before it registers.
        assert!(
            started.elapsed() < std::time::Duration::from_secs(90),
            "{count} workers did not register within 90 s; the scheduler reports:\n{report}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// A plain HTTP/1.1 GET of `path` on `address` (`host:port`, with or without `http://`);
/// returns the response head and body.
pub fn http_get(address: &str, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let address = address.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(address).expect("connect over HTTP");
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("set a timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .expect("send the request");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .expect("read the response");
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "GET {path}: {head}");
    (head.to_string(), body.to_string())
}

/// Submits `spec` as the holder of `token` at `priority`, keeping its timeline, waits for it to
/// end (failing the test if it does not succeed), and returns its timeline; then releases it.
pub async fn run_with_timeline(
    url: &str,
    token: Option<&str>,
    spec: wrk_proto::JobSpec,
    priority: i32,
) -> wrk_proto::JobTimeline {
    let mut client = wrk_cli::client::connect(url, token)
        .await
        .expect("connect to the scheduler");
    let job_id = client
        .submit_job(wrk_proto::SubmitJobRequest {
            job: Some(spec),
            keep_timeline: true,
            priority,
        })
        .await
        .expect("the job is accepted")
        .into_inner()
        .job_id;
    let job = wrk_proto::JobRef { job_id };
    let mut progress = client
        .watch_job(job.clone())
        .await
        .expect("watch the job")
        .into_inner();
    while let Some(p) = progress.message().await.expect("progress") {
        match p.state() {
            wrk_proto::JobState::Succeeded => break,
            wrk_proto::JobState::Failed | wrk_proto::JobState::Cancelled => {
                panic!("job {} ended {:?}: {}", job.job_id, p.state(), p.error)
            }
            _ => {}
        }
    }
    let timeline = client
        .get_job_timeline(job.clone())
        .await
        .expect("the job's timeline")
        .into_inner();
    client.release_job(job).await.expect("release the job");
    timeline
}

/// A job file running the `slow` test guest (`delay_ms` per task) over `stages`, written to
/// `dir`: each stage is `(name, tasks, requires)`.
pub fn slow_job(dir: &Path, name: &str, delay_ms: u64, stages: &[(&str, u32, &[&str])]) -> PathBuf {
    let mut text = format!(
        "name = \"{name}\"\nmodule = \"{}\"\n[params]\ndelay_ms = \"{delay_ms}\"\n",
        guest("test-guest-slow").display()
    );
    for (stage, tasks, requires) in stages {
        text.push_str(&format!(
            "[[stage]]\nname = \"{stage}\"\ntasks = {tasks}\nrequires = {requires:?}\n"
        ));
    }
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).expect("write the job file");
    path
}

/// The value of the series whose line starts with `series` (its name and labels as written) in
/// a Prometheus text exposition, or 0 when it is absent.
pub fn metric_value(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

//! The P2P shuffle across real processes: a scheduler and four workers on 127.0.0.1 run the
//! shuffle join and the shuffle group-by examples (pieces pushed worker to worker over TCP) and
//! must give the answer computed directly in Rust; then workers are killed with SIGKILL at
//! different moments of a shuffle and the answer must still be right.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use crate::common::*;
use arrow::array::{AsArray, RecordBatch};
use arrow::compute;
use arrow::datatypes::{DataType, Float64Type, Int64Type};

/// A result file's rows, string columns as plain strings (the reader keeps dictionary-encoded
/// pages as Arrow dictionaries).
fn read(path: &Path) -> RecordBatch {
    let batch =
        wrk_host::io::read_source(&path.to_string_lossy(), &[], None, None).expect("read Parquet");
    wrk_host::cpu::dictionary::plain_batch(&batch).expect("decode dictionaries")
}

fn f64s(batch: &RecordBatch, name: &str) -> Vec<f64> {
    let column = batch.column_by_name(name).expect(name);
    let c = compute::cast(column, &DataType::Float64).unwrap();
    c.as_primitive::<Float64Type>().values().to_vec()
}

fn i64s(batch: &RecordBatch, name: &str) -> Vec<i64> {
    let column = batch.column_by_name(name).expect(name);
    let c = compute::cast(column, &DataType::Int64).unwrap();
    c.as_primitive::<Int64Type>().values().to_vec()
}

fn strings(batch: &RecordBatch, name: &str) -> Vec<String> {
    let column = batch.column_by_name(name).expect(name);
    let c = compute::cast(column, &DataType::Utf8).unwrap();
    c.as_string::<i32>()
        .iter()
        .map(|s| s.unwrap_or_default().to_string())
        .collect()
}

/// Trips (with driver ids drawn from 5,000 drivers) and the drivers table.
fn dataset() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let config = wrk_cli::taxi::TaxiConfig {
        rows: 120_000,
        files: 4,
        row_group_rows: 15_000,
        seed: 5,
        drivers: 5_000,
    };
    wrk_cli::taxi::generate(&dir.path().join("taxi"), &config).unwrap();
    wrk_cli::taxi::generate_dimensions(dir.path(), config.drivers, config.seed).unwrap();
    dir
}

/// Per driver: (fare sum, trips), from the Parquet files.
fn fares_per_driver(trips: &RecordBatch) -> BTreeMap<i64, (f64, i64)> {
    let mut expected: BTreeMap<i64, (f64, i64)> = BTreeMap::new();
    for (driver, fare) in i64s(trips, "driver_id")
        .into_iter()
        .zip(f64s(trips, "fare_amount"))
    {
        let e = expected.entry(driver).or_default();
        e.0 += fare;
        e.1 += 1;
    }
    expected
}

fn assert_fares_per_driver(result: &RecordBatch, expected: &BTreeMap<i64, (f64, i64)>) {
    let mut got: BTreeMap<i64, (f64, i64)> = BTreeMap::new();
    for ((driver, fare), trips) in i64s(result, "driver_id")
        .into_iter()
        .zip(f64s(result, "fare_sum"))
        .zip(i64s(result, "trips"))
    {
        assert!(
            got.insert(driver, (fare, trips)).is_none(),
            "driver {driver} appears in two reducers' outputs"
        );
    }
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>(),
        "the same drivers"
    );
    for (driver, (fare, trips)) in expected {
        let (got_fare, got_trips) = got[driver];
        assert_eq!(got_trips, *trips, "trips of driver {driver}");
        assert!(
            (got_fare - fare).abs() <= 1e-9 * fare.abs().max(1.0),
            "fares of driver {driver}: {got_fare} vs {fare}"
        );
    }
}

/// A scheduler and `workers` worker processes with one slot each, shuffling over `transport`
/// and serving their metrics.
fn cluster(
    processes: &mut Processes,
    workers: usize,
    transport: &str,
) -> (String, Vec<Child>, SchedulerProcess) {
    let scheduler = start_scheduler(
        processes,
        &["--heartbeat-ms", "100", "--worker-timeout-secs", "2"],
        &[],
    );
    let url = scheduler.url.clone();
    let args = [
        "--slots",
        "1",
        "--transport",
        transport,
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    let children = (0..workers)
        .map(|i| start_worker(&url, &format!("w{i}"), &args))
        .collect();
    wait_for_workers(&url, workers, None);
    (url, children, scheduler)
}

/// Shuffle bytes the workers sent, by transport, from their `/metrics`.
fn shuffle_bytes_sent(url: &str) -> BTreeMap<String, f64> {
    let status = Command::new(wrk())
        .args(["status", "--scheduler", url, "--output", "json"])
        .env_remove("WRK_TOKEN")
        .output()
        .expect("wrk status");
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status JSON");
    let mut sent = BTreeMap::new();
    for worker in status["workers"].as_array().expect("workers") {
        let http = worker["http_address"].as_str().expect("http address");
        let (_, metrics) = http_get(http, "/metrics");
        for line in metrics.lines() {
            if let Some(rest) =
                line.strip_prefix("wrk_worker_shuffle_bytes_total{direction=\"sent\",transport=\"")
                && let Some((transport, value)) = rest.split_once("\"} ")
            {
                *sent.entry(transport.to_string()).or_default() += value.parse::<f64>().unwrap();
            }
        }
    }
    sent
}

/// Submits an example's job file with that example's module.
fn submit(url: &str, job: &Path, module: &str, args: &[String], result: &Path) -> Child {
    let mut extra = vec!["--module".to_string(), guest(module).display().to_string()];
    extra.extend_from_slice(args);
    spawn_submit(url, job, result, &extra)
}

fn succeeded(child: Child, what: &str) {
    let output = child.wait_with_output().expect("wait for wrk submit");
    assert!(
        output.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn shuffle_join_and_group_by_give_the_reference_answer_over_tcp() {
    join_and_group_by("tcp");
}

#[test]
fn shuffle_join_and_group_by_give_the_reference_answer_over_ucx() {
    if cfg!(feature = "ucx") {
        join_and_group_by("ucx");
    } else {
        eprintln!(
            "skipped: the tests were built without the `ucx` feature (tests/run.sh turns it on)"
        );
    }
}

/// The shuffle join and group-by examples on four workers shuffling over `transport`.
fn join_and_group_by(transport: &str) {
    let data = dataset();
    let out = tempfile::tempdir().unwrap();
    let mut processes = Processes(Vec::new());
    let (url, workers, _scheduler) = cluster(&mut processes, 4, transport);
    processes.0.extend(workers);
    let examples = workspace_root().join("guest-examples");
    let trips_source = format!("trips={}", data.path().join("taxi").display());

    let joined = out.path().join("join.parquet");
    let args = [
        "--source".to_string(),
        trips_source.clone(),
        "--source".to_string(),
        format!("drivers={}", data.path().join("drivers").display()),
    ];
    let join = submit(
        &url,
        &examples.join("shuffle-join/job.toml"),
        "shuffle-join",
        &args,
        &joined,
    );
    succeeded(join, "the shuffle join");

    let trips = read(&data.path().join("taxi"));
    let drivers = read(&data.path().join("drivers"));
    let driver: HashMap<i64, (f64, String)> = i64s(&drivers, "driver_id")
        .into_iter()
        .zip(
            f64s(&drivers, "rating")
                .into_iter()
                .zip(strings(&drivers, "shift")),
        )
        .collect();
    let mut expected: BTreeMap<String, (i64, f64, f64)> = BTreeMap::new();
    for (id, fare) in i64s(&trips, "driver_id")
        .into_iter()
        .zip(f64s(&trips, "fare_amount"))
    {
        let (rating, shift) = &driver[&id];
        let e = expected.entry(shift.clone()).or_default();
        e.0 += 1;
        e.1 += fare;
        e.2 += rating;
    }
    let result = read(&joined);
    assert_eq!(
        strings(&result, "shift"),
        expected.keys().cloned().collect::<Vec<_>>()
    );
    let (trips_n, fares, ratings) = (
        i64s(&result, "trips"),
        f64s(&result, "fare_sum"),
        f64s(&result, "rating_sum"),
    );
    for (row, (n, fare, rating)) in expected.values().enumerate() {
        assert_eq!(trips_n[row], *n);
        assert_close("fare sum", fares[row], *fare);
        assert_close("rating sum", ratings[row], *rating);
    }

    let grouped = out.path().join("groupby.parquet");
    let group_by = submit(
        &url,
        &examples.join("shuffle-groupby/job.toml"),
        "shuffle-groupby",
        &["--source".to_string(), trips_source],
        &grouped,
    );
    succeeded(group_by, "the shuffle group-by");
    assert_fares_per_driver(&read(&grouped), &fares_per_driver(&trips));

    // The pieces really went between the workers over that transport, and only over it.
    let sent = shuffle_bytes_sent(&url);
    assert!(
        sent.get(transport).is_some_and(|bytes| *bytes > 100_000.0),
        "{sent:?}"
    );
    assert_eq!(
        sent.keys().filter(|t| *t != "local").collect::<Vec<_>>(),
        [transport],
        "{sent:?}"
    );
}

#[test]
fn killing_a_worker_mid_shuffle_still_gives_the_reference_answer() {
    let data = dataset();
    let trips = read(&data.path().join("taxi"));
    let expected = fares_per_driver(&trips);
    let dir = tempfile::tempdir().unwrap();
    // Slow reads feed the mappers; slow pass-through tasks after the reducers keep their
    // outputs needed for a while, so kills land on mappers pushing, on workers holding pieces
    // for reducers, and on reducers' outputs.
    let job = dir.path().join("shuffle-recovery.toml");
    std::fs::write(
        &job,
        format!(
            r#"
name = "shuffle-recovery"
[params]
delay_ms = "150"
[sources.trips]
path = "{data}"
[[stage]]
name = "read"
module = "{slow}"
source = "trips"
# Every column: one row group (about 1.2 MiB) per partition, eight reads.
partition_mib = 1
[[stage]]
name = "partial"
module = "{groupby}"
inputs = [{{ stage = "read", pattern = "one-to-one" }}]
[[stage]]
name = "final"
module = "{groupby}"
tasks = 6
inputs = [{{ stage = "partial", exchange = "by-driver" }}]
[[stage]]
name = "hold"
module = "{slow}"
inputs = [{{ stage = "final", pattern = "one-to-one" }}]
"#,
            data = data.path().join("taxi").display(),
            slow = guest("test-guest-slow").display(),
            groupby = guest("shuffle-groupby").display(),
        ),
    )
    .unwrap();
    let mut processes = Processes(Vec::new());
    let (url, mut workers, scheduler) = cluster(&mut processes, 4, "auto");
    for round in 0..6u64 {
        let result = dir.path().join(format!("fares-{round}.parquet"));
        let submit = spawn_submit(&url, &job, &result, &[]);
        // The job takes about 0.6 s here (more on a loaded machine): kill inside it, before its
        // results are fetched (results lost after a job succeeded are not recomputed).
        std::thread::sleep(Duration::from_millis(100 + round * 70));
        let victim = (round % 4) as usize;
        let id = format!("w{victim}-{round}");
        replace_worker(&mut workers, victim, &url, &id, &["--slots", "1"]);
        succeeded(submit, &format!("round {round}"));
        assert_fares_per_driver(&read(&result), &expected);
    }
    processes.0.extend(workers);
    let log = scheduler.log.lock().unwrap();
    let costly = costly_losses(&log);
    assert!(
        costly >= 3,
        "only {costly} of 6 kills hit running work:\n{}",
        log.join("\n")
    );
}

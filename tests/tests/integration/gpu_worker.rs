//! Jobs on a GPU worker: `wrk worker --device gpu:0` where a GPU is found, else the CUDA
//! emulator (`--device emulated-gpu`: the kernels of a real GPU compiled for the host; the
//! closest substitute for a GPU in CI; `WRK_REQUIRE_GPU=1` insists on the real one). The
//! guests' operators run on the device where kernels cover them and on the CPU backend where
//! they do not; the answers match the reference and the CPU workers', tables cross between host
//! and device only at the edges, and the tasks' device memory is freed when they end.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;
use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Float64Type};

fn operators(text: &str, operator: &str, ran_on: &str) -> f64 {
    metric_value(
        text,
        &format!(r#"wrk_worker_device_operators_total{{operator="{operator}",ran_on="{ran_on}"}}"#),
    )
}

fn transferred(text: &str, direction: &str) -> f64 {
    metric_value(
        text,
        &format!(r#"wrk_worker_device_transfer_bytes_total{{direction="{direction}"}}"#),
    )
}

fn transfers(text: &str, direction: &str) -> f64 {
    metric_value(
        text,
        &format!(r#"wrk_worker_device_transfers_total{{direction="{direction}"}}"#),
    )
}

/// `wrk submit` of `guest-examples/<example>` with its sources, on the scheduler at `url` or
/// (with `None`) on an embedded two-worker CPU cluster; returns the result file, in `out`.
fn submit(
    example: &str,
    sources: &[(&str, &Path)],
    url: Option<&str>,
    out: &Path,
) -> std::path::PathBuf {
    let where_ = if url.is_some() { "device" } else { "cpu" };
    let result = out.join(format!("{example}-{where_}.parquet"));
    let mut command = Command::new(wrk());
    command
        .arg("submit")
        .arg(workspace_root().join(format!("guest-examples/{example}/job.toml")))
        .args(["--quiet", "--output"])
        .arg(&result)
        .arg("--module")
        .arg(guest(example));
    match url {
        Some(url) => command.args(["--scheduler", url]),
        None => command.args(["--workers", "2"]),
    };
    for (name, path) in sources {
        command
            .arg("--source")
            .arg(format!("{name}={}", path.display()));
    }
    let run = command.output().expect("run wrk submit");
    assert!(
        run.status.success(),
        "{example} failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    result
}

/// A result file's rows, string columns as plain strings.
fn read(path: &Path) -> RecordBatch {
    let batch =
        wrk_host::io::read_source(&path.to_string_lossy(), &[], None, None).expect("read result");
    wrk_host::cpu::dictionary::plain_batch(&batch).expect("decode dictionaries")
}

/// Asserts two results hold the same rows in the same order: floats to 1e-9 relative (sums
/// add in another order on the device), everything else exactly.
fn assert_same_rows(what: &str, device: &RecordBatch, cpu: &RecordBatch) {
    assert_eq!(device.num_rows(), cpu.num_rows(), "{what}: rows");
    let names = |b: &RecordBatch| -> Vec<String> {
        b.schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect()
    };
    assert_eq!(names(device), names(cpu), "{what}: columns");
    for (i, field) in cpu.schema().fields().iter().enumerate() {
        let (d, c) = (device.column(i), cpu.column(i));
        assert_eq!(d.data_type(), c.data_type(), "{what}: `{}`", field.name());
        if d.data_type().is_floating() {
            let cast = |a| arrow::compute::cast(a, &DataType::Float64).unwrap();
            let (d, c) = (cast(d), cast(c));
            let (d, c) = (
                d.as_primitive::<Float64Type>(),
                c.as_primitive::<Float64Type>(),
            );
            for row in 0..c.len() {
                let (x, y) = (d.value(row), c.value(row));
                assert!(
                    (x - y).abs() <= 1e-9 * y.abs().max(1.0),
                    "{what}: `{}` row {row}: {x} on the device, {y} on the CPU",
                    field.name()
                );
            }
        } else {
            assert_eq!(d.as_ref(), c.as_ref(), "{what}: `{}`", field.name());
        }
    }
}

/// A scheduler and one worker on `device` (with `extra` arguments) serving metrics: the
/// processes, the scheduler's URL and the worker as the scheduler reports it, which must be
/// on `device`.
fn start_gpu_worker(device: &str, extra: &[&str]) -> (Processes, String, wrk_proto::WorkerStatus) {
    let mut processes = Processes(Vec::new());
    let scheduler = start_scheduler(&mut processes, &[], &[]);
    let url = scheduler.url.clone();
    let mut args = vec!["--device", device, "--metrics-listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    processes.0.push(start_worker(&url, "gpu-worker", &args));
    wait_for_workers(&url, 1, None);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let status = runtime
        .block_on(wrk_cli::client::cluster_status(&url, None))
        .unwrap();
    let worker = status.workers[0].clone();
    assert_eq!(worker.device, device, "{worker:?}");
    (processes, url, worker)
}

/// The worker's metrics once `settled` holds for them (they follow the heartbeats), or a
/// failure after 20 s saying `what` never happened.
fn metrics_once(
    worker: &wrk_proto::WorkerStatus,
    what: &str,
    settled: impl Fn(&str) -> bool,
) -> String {
    let waited = Instant::now();
    loop {
        let text = http_get(&worker.http_address, "/metrics").1;
        if settled(&text) {
            return text;
        }
        assert!(
            waited.elapsed() < Duration::from_secs(20),
            "{what} never happened: {text}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The rows of `batch` in ascending order of `column`.
fn sorted_by(batch: &RecordBatch, column: &str) -> RecordBatch {
    let order =
        arrow::compute::sort_to_indices(batch.column_by_name(column).unwrap(), None, None).unwrap();
    arrow::compute::take_record_batch(batch, &order).unwrap()
}

/// `gpu:0` where a GPU can be used, else `emulated-gpu` where a C++ compiler can build the
/// emulator's kernels, else `None` (with the reason printed).
fn gpu_device() -> Option<&'static str> {
    if has_gpu() {
        Some("gpu:0")
    } else if wrk_host::gpu::emulator::compiler_present() {
        println!("no CUDA device found: the jobs run on the CUDA emulator (host CPU)");
        Some("emulated-gpu")
    } else {
        println!(
            "SKIPPED jobs on a GPU worker: no CUDA device and no C++ compiler (`c++` or $CXX)"
        );
        None
    }
}

#[test]
fn jobs_on_a_gpu_worker_run_on_the_device_and_match_the_cpu() {
    let Some(device) = gpu_device() else {
        return;
    };
    for example in [
        "taxi-haversine",
        "fare-stats",
        "zone-join",
        "top-fares",
        "shuffle-groupby",
    ] {
        let _ = guest(example);
    }
    let data = taxi_dataset(50_000, 2, 10_000);
    let trips = data.path().to_path_buf();
    let dimensions = tempfile::tempdir().unwrap();
    wrk_cli::taxi::generate_dimensions(dimensions.path(), 12_500, 11).unwrap();
    let zones = dimensions.path().join("zones");

    let (_processes, url, worker) = start_gpu_worker(device, &[]);
    let scrape = || http_get(&worker.http_address, "/metrics").1;
    // The worker's start-up self-test moved tables too: a job's transfers are the change.
    let start = scrape();
    let used_at_start = metric_value(&start, "wrk_worker_device_pool_used_bytes");

    // The taxi job: every operator has a kernel. Two `distance` tasks (one per file) make a
    // fused haversine kernel and a group-by each; one `summary` task a concat, a group-by, the
    // mean, the selection and the sort.
    let out = tempfile::tempdir().unwrap();
    let result = submit(
        "taxi-haversine",
        &[("trips", &trips)],
        Some(&url),
        out.path(),
    );
    let taxi = scrape();
    assert_summaries_match(&read_summary(&result), &taxi_reference(data.path()));
    assert_eq!(operators(&taxi, "with-columns", "device"), 3.0, "{taxi}");
    assert_eq!(operators(&taxi, "group-by", "device"), 3.0, "{taxi}");
    for operator in ["concat", "select", "sort"] {
        assert_eq!(
            operators(&taxi, operator, "device"),
            1.0,
            "{operator}: {taxi}"
        );
    }
    assert!(
        !taxi.contains(r#"ran_on="host""#),
        "every operator of the taxi job has a kernel: {taxi}"
    );
    // The trips went up once per `distance` task. Their results stayed on the device, in the
    // worker's store, for the `summary` task; only the job's result came back, when `wrk
    // submit` fetched it.
    let up = transferred(&taxi, "to_device") - transferred(&start, "to_device");
    let down = transferred(&taxi, "to_host") - transferred(&start, "to_host");
    assert!(up >= 50_000.0 * (4.0 * 8.0 + 4.0), "uploaded {up} bytes");
    assert!(down > 0.0 && down < up / 100.0, "downloaded {down} bytes");
    assert_eq!(
        transfers(&taxi, "to_device") - transfers(&start, "to_device"),
        2.0,
        "{taxi}"
    );
    assert_eq!(
        transfers(&taxi, "to_host") - transfers(&start, "to_host"),
        1.0,
        "{taxi}"
    );

    // Two-key group-bys on the device (fare-stats), group-bys and a sort on strings after
    // joins on the device (zone-join), and a top-k on the device (top-fares).
    for (example, sources) in [
        ("fare-stats", vec![("trips", trips.as_path())]),
        (
            "zone-join",
            vec![("trips", trips.as_path()), ("zones", zones.as_path())],
        ),
        ("top-fares", vec![("trips", trips.as_path())]),
    ] {
        let before = scrape();
        let on_device = read(&submit(example, &sources, Some(&url), out.path()));
        let after = scrape();
        let ran = |operator, on| operators(&after, operator, on) - operators(&before, operator, on);
        let group_bys = (ran("group-by", "device"), ran("group-by", "host"));
        match example {
            "fare-stats" => assert_eq!(group_bys, (3.0, 0.0), "{after}"),
            // Per trips file, the fares per borough of the known zones and of the unknown
            // (after a constant borough column is added); the merge's group-by and sort by
            // borough. Every operator of the job ran on the device.
            "zone-join" => {
                assert_eq!(group_bys, (5.0, 0.0), "{after}");
                assert_eq!(ran("sort", "device"), 1.0, "{after}");
                assert_eq!(ran("with-columns", "device"), 2.0, "{after}");
                for operator in ["join", "concat", "select", "with-columns", "sort"] {
                    assert_eq!(ran(operator, "host"), 0.0, "{operator}: {after}");
                }
                // The zones went to the device once, for both join tasks, each joining twice
                // (inner, then anti): the first join built the index on them, the other three
                // probed it (an upload per task would make an index per task). The counter
                // follows the heartbeats.
                let indexes = |text: &str| {
                    let count = |text: &str, outcome: &str| {
                        metric_value(
                            text,
                            &format!(
                                r#"wrk_worker_device_join_indexes_total{{outcome="{outcome}"}}"#
                            ),
                        )
                    };
                    (
                        count(text, "built") - count(&before, "built"),
                        count(text, "reused") - count(&before, "reused"),
                    )
                };
                let counted = metrics_once(&worker, "zone-join's join indexes", |text| {
                    indexes(text).1 >= 3.0
                });
                assert_eq!(indexes(&counted), (1.0, 3.0), "{counted}");
            }
            _ => {}
        }
        let on_cpu = read(&submit(example, &sources, None, out.path()));
        assert!(on_cpu.num_rows() > 0, "{example}");
        assert_same_rows(example, &on_device, &on_cpu);
    }
    // A shuffle: each `partial` task's group-by result, on the device, is hash-partitioned
    // there and its pieces come down for the exchange. The reducers see the pieces in the
    // order they arrive, so the rows are compared in driver order.
    let sources = [("trips", trips.as_path())];
    let on_device = read(&submit("shuffle-groupby", &sources, Some(&url), out.path()));
    let on_cpu = read(&submit("shuffle-groupby", &sources, None, out.path()));
    assert!(on_cpu.num_rows() > 1_000, "one row per driver");
    assert_same_rows(
        "shuffle-groupby",
        &sorted_by(&on_device, "driver_id"),
        &sorted_by(&on_cpu, "driver_id"),
    );
    let after = scrape();
    let ran = |operator, on| operators(&after, operator, on) - operators(&taxi, operator, on);
    assert!(ran("join", "device") >= 2.0, "{after}");
    assert!(ran("top-k", "device") >= 2.0, "{after}");
    assert_eq!(ran("shuffle.send", "device"), 2.0, "{after}");

    // The tasks' device tables were freed when they ended, and the broadcast table and its
    // join index when their job was released (the gauge follows the heartbeats).
    metrics_once(&worker, "freeing the device pool", |text| {
        metric_value(text, "wrk_worker_device_pool_used_bytes") == used_at_start
    });
}

#[test]
fn a_job_larger_than_the_device_pool_gives_the_same_answer() {
    let Some(device) = gpu_device() else {
        return;
    };
    let _ = guest("taxi-haversine");
    // Each `distance` task uploads 3 MB of trips (60 bytes a row) and adds its distances next
    // to them: a 3 MiB pool holds one task's trips, not its distances, nor two tasks at once.
    let data = taxi_dataset(100_000, 2, 10_000);
    // The worker's self-test fits the small pool: it starts on the device.
    let (_processes, url, worker) = start_gpu_worker(device, &["--device-pool-size", "3MiB"]);
    let used_at_start = metric_value(
        &http_get(&worker.http_address, "/metrics").1,
        "wrk_worker_device_pool_used_bytes",
    );

    let out = tempfile::tempdir().unwrap();
    let result = submit(
        "taxi-haversine",
        &[("trips", data.path())],
        Some(&url),
        out.path(),
    );
    assert_summaries_match(&read_summary(&result), &taxi_reference(data.path()));
    // The pool was full: it asked the spiller for room, which had nothing to give (every
    // device table was an operator's input, or shared its columns with one), and the
    // operators that did not fit ran on the CPU backend. The others ran on the device, within
    // the budget, and everything went back to the pool (the gauges follow the heartbeats).
    let text = metrics_once(&worker, "a full device pool, then an empty one", |text| {
        metric_value(text, "wrk_worker_device_pool_evictions_total") > 0.0
            && metric_value(text, "wrk_worker_device_pool_used_bytes") == used_at_start
    });
    assert!(
        metric_value(&text, "wrk_worker_device_pool_peak_bytes") <= f64::from(3u32 << 20),
        "{text}"
    );
    assert!(operators(&text, "with-columns", "device") >= 1.0, "{text}");
    assert!(operators(&text, "with-columns", "host") >= 1.0, "{text}");
}

#[test]
fn wrk_run_on_a_gpu_runs_the_operators_there_and_says_so() {
    let Some(device) = gpu_device() else {
        return;
    };
    let module = guest("taxi-haversine");
    let data = taxi_dataset(20_000, 1, 5_000);
    let input = std::fs::read_dir(data.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "parquet"))
        .unwrap();
    let out = tempfile::tempdir().unwrap();
    let run = |device: &str| {
        let result = out.path().join(format!("distance-{device}.parquet"));
        let output = Command::new(wrk())
            .arg("run")
            .arg(&module)
            .arg("--input")
            .arg(&input)
            .args(["--stage", "distance", "--device", device, "--output"])
            .arg(&result)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(
            output.status.success(),
            "wrk run --device {device}: {stderr}"
        );
        (read(&result), stderr)
    };
    let (on_device, said) = run(device);
    let (on_cpu, said_on_cpu) = run("cpu");
    assert!(on_cpu.num_rows() > 0);
    assert_same_rows("wrk run distance", &on_device, &on_cpu);
    // The distance stage's with-columns (one fused kernel) and group-by ran on the device: the
    // trips went up once, the result came down once.
    let line = said
        .lines()
        .find(|l| l.starts_with("on GPU 0 ("))
        .unwrap_or_else(|| panic!("no device line in:\n{said}"));
    assert!(
        line.contains("2 operator(s) on the device, 0 on the CPU backend; 1 upload(s)")
            && line.contains("1 download(s)"),
        "{line}"
    );
    assert!(!said_on_cpu.contains("on GPU"), "{said_on_cpu}");
}

//! The guest examples of the engine (group-by aggregate, broadcast join, top-k, word count), each
//! run through `wrk submit` on an embedded two-worker cluster and checked against an answer
//! computed directly in Rust from the same Parquet files.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use crate::common::*;
use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, StringArray};
use arrow::compute;
use arrow::datatypes::{DataType, Float64Type, Int64Type};

/// Runs `guest-examples/<example>/job.toml` with its module, the given sources and parameters,
/// and returns the result table.
fn submit(example: &str, sources: &[(&str, &Path)], params: &[&str]) -> RecordBatch {
    let out = tempfile::tempdir().unwrap();
    let result = out.path().join("result.parquet");
    let mut command = Command::new(wrk());
    command
        .arg("submit")
        .arg(
            workspace_root()
                .join("guest-examples")
                .join(example)
                .join("job.toml"),
        )
        .args(["--workers", "2", "--quiet", "--output"])
        .arg(&result)
        .arg("--module")
        .arg(guest(example));
    for (name, path) in sources {
        command
            .arg("--source")
            .arg(format!("{name}={}", path.display()));
    }
    for param in params {
        command.args(["--param", param]);
    }
    let run = command.output().expect("run wrk submit");
    assert!(
        run.status.success(),
        "{example} failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    read(&result)
}

/// A result file's rows, string columns as plain strings (the reader keeps dictionary-encoded
/// pages as Arrow dictionaries).
fn read(path: &Path) -> RecordBatch {
    let batch =
        wrk_host::io::read_source(&path.to_string_lossy(), &[], None, None).expect("read Parquet");
    wrk_host::cpu::dictionary::plain_batch(&batch).expect("decode dictionaries")
}

fn column<'a>(batch: &'a RecordBatch, name: &str) -> &'a ArrayRef {
    batch
        .column_by_name(name)
        .unwrap_or_else(|| panic!("no column `{name}` in {:?}", batch.schema()))
}

fn f64s(batch: &RecordBatch, name: &str) -> Vec<f64> {
    let c = compute::cast(column(batch, name), &DataType::Float64).unwrap();
    c.as_primitive::<Float64Type>().values().to_vec()
}

fn i64s(batch: &RecordBatch, name: &str) -> Vec<i64> {
    let c = compute::cast(column(batch, name), &DataType::Int64).unwrap();
    c.as_primitive::<Int64Type>().values().to_vec()
}

fn strings(batch: &RecordBatch, name: &str) -> Vec<String> {
    let c = column(batch, name).as_string::<i32>();
    (0..c.len()).map(|i| c.value(i).to_string()).collect()
}

/// A small taxi dataset (three files, several row groups) with its dimension tables.
fn taxi_with_dimensions() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let trips = dir.path().join("taxi");
    wrk_cli::taxi::generate(
        &trips,
        &wrk_cli::taxi::TaxiConfig {
            rows: 60_000,
            files: 3,
            row_group_rows: 7_000,
            seed: 5,
            drivers: 20_000,
        },
    )
    .unwrap();
    wrk_cli::taxi::generate_dimensions(dir.path(), 20_000, 5).unwrap();
    dir
}

#[test]
fn group_by_aggregate_matches_the_reference() {
    let data = taxi_with_dimensions();
    let trips = read(&data.path().join("taxi"));
    let result = submit("fare-stats", &[("trips", &data.path().join("taxi"))], &[]);

    // (passengers, zone) -> (sum, count, min, max)
    let mut expected: BTreeMap<(i64, i64), (f64, i64, f64, f64)> = BTreeMap::new();
    let (p, z, f) = (
        i64s(&trips, "passenger_count"),
        i64s(&trips, "pickup_zone"),
        f64s(&trips, "fare_amount"),
    );
    for i in 0..trips.num_rows() {
        let e = expected
            .entry((p[i], z[i]))
            .or_insert((0.0, 0, f64::INFINITY, f64::NEG_INFINITY));
        e.0 += f[i];
        e.1 += 1;
        e.2 = e.2.min(f[i]);
        e.3 = e.3.max(f[i]);
    }
    assert_eq!(result.num_rows(), expected.len());
    assert_eq!(
        column(&result, "passenger_count").data_type(),
        &DataType::Int32
    );
    let (rp, rz) = (
        i64s(&result, "passenger_count"),
        i64s(&result, "pickup_zone"),
    );
    let (sums, trips_n) = (f64s(&result, "fare_sum"), i64s(&result, "trips"));
    let (mins, maxs, means) = (
        f64s(&result, "fare_min"),
        f64s(&result, "fare_max"),
        f64s(&result, "fare_mean"),
    );
    for (row, (key, (sum, count, lo, hi))) in expected.iter().enumerate() {
        assert_eq!(
            (rp[row], rz[row]),
            *key,
            "rows sorted by passengers, then zone"
        );
        assert_close("fare sum", sums[row], *sum);
        assert_eq!(trips_n[row], *count);
        assert_eq!((mins[row], maxs[row]), (*lo, *hi));
        assert_close("fare mean", means[row], sum / *count as f64);
    }
}

#[test]
fn broadcast_join_matches_the_reference() {
    let data = taxi_with_dimensions();
    // Drop some zones so the anti join has trips to count as `unknown`.
    let zones = read(&data.path().join("zones"));
    let kept = compute::filter_record_batch(
        &zones,
        &compute::kernels::cmp::gt(
            column(&zones, "zone_id"),
            &arrow::array::Scalar::new(arrow::array::Int64Array::from(vec![10])),
        )
        .unwrap(),
    )
    .unwrap();
    let partial_zones = data.path().join("some-zones");
    std::fs::create_dir_all(&partial_zones).unwrap();
    wrk_host::io::write_file(
        &partial_zones.join("zones.parquet"),
        std::slice::from_ref(&kept),
        100,
    )
    .unwrap();

    let result = submit(
        "zone-join",
        &[
            ("trips", &data.path().join("taxi")),
            ("zones", &partial_zones),
        ],
        &[],
    );

    let borough_of: HashMap<i64, String> = i64s(&kept, "zone_id")
        .into_iter()
        .zip(strings(&kept, "borough"))
        .collect();
    let trips = read(&data.path().join("taxi"));
    let mut expected: BTreeMap<String, (f64, i64)> = BTreeMap::new();
    for (zone, fare) in i64s(&trips, "pickup_zone")
        .into_iter()
        .zip(f64s(&trips, "fare_amount"))
    {
        let borough = borough_of
            .get(&zone)
            .cloned()
            .unwrap_or_else(|| "unknown".into());
        let e = expected.entry(borough).or_insert((0.0, 0));
        e.0 += fare;
        e.1 += 1;
    }
    assert!(
        expected.contains_key("unknown"),
        "the data has unknown zones"
    );
    let boroughs = strings(&result, "borough");
    assert_eq!(boroughs, expected.keys().cloned().collect::<Vec<_>>());
    let (sums, counts) = (f64s(&result, "fare_sum"), i64s(&result, "trips"));
    for (row, (sum, count)) in expected.values().enumerate() {
        assert_close("fare sum", sums[row], *sum);
        assert_eq!(counts[row], *count);
    }
}

#[test]
fn top_k_matches_the_reference() {
    let data = taxi_with_dimensions();
    let trips = read(&data.path().join("taxi"));
    let result = submit(
        "top-fares",
        &[("trips", &data.path().join("taxi"))],
        &["k=25"],
    );
    let mut all: Vec<(f64, i64)> = f64s(&trips, "fare_amount")
        .into_iter()
        .zip(i64s(&trips, "driver_id"))
        .collect();
    all.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let got: Vec<(f64, i64)> = f64s(&result, "fare_amount")
        .into_iter()
        .zip(i64s(&result, "driver_id"))
        .collect();
    assert_eq!(got, all[..25]);
}

#[test]
fn word_count_matches_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let vocabulary = [
        "the", "Taxi", "driver", "was", "late,", "but", "the", "ride", "was", "smooth.", "Great",
        "tip!", "don't",
    ];
    let texts: Vec<Option<String>> = (0..5_000usize)
        .map(|i| {
            (i % 17 != 0).then(|| {
                (0..(i % 7))
                    .map(|j| vocabulary[(i * 31 + j * 7) % vocabulary.len()])
                    .collect::<Vec<_>>()
                    .join(if i % 2 == 0 { " " } else { "  " })
            })
        })
        .collect();
    for (file, chunk) in texts.chunks(2_000).enumerate() {
        let column: ArrayRef = Arc::new(StringArray::from(chunk.to_vec()));
        let id: ArrayRef = Arc::new(arrow::array::Int32Array::from_iter_values(
            0..chunk.len() as i32,
        ));
        let batch = RecordBatch::try_from_iter(vec![("id", id), ("review", column)]).unwrap();
        wrk_host::io::write_file(
            &dir.path().join(format!("part-{file}.parquet")),
            &[batch],
            500,
        )
        .unwrap();
    }
    let result = submit("word-count", &[("text", dir.path())], &["column=review"]);

    let mut counts: HashMap<String, i64> = HashMap::new();
    for text in texts.iter().flatten() {
        for word in text
            .split(|c: char| !c.is_alphanumeric() && c != '\'')
            .filter(|w| !w.is_empty())
        {
            *counts.entry(word.to_lowercase()).or_default() += 1;
        }
    }
    let mut expected: Vec<(String, i64)> = counts.into_iter().collect();
    expected.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let got: Vec<(String, i64)> = strings(&result, "word")
        .into_iter()
        .zip(i64s(&result, "n"))
        .collect();
    assert_eq!(got, expected);
}

#[test]
fn predicate_pushdown_from_a_guest_matches_the_reference() {
    let data = taxi_with_dimensions();
    let trips_dir = data.path().join("taxi");
    let result = submit("zone-filter", &[("trips", &trips_dir)], &["below=12"]);
    let trips = read(&trips_dir);
    let mut expected: BTreeMap<i64, (i64, f64)> = BTreeMap::new();
    for (zone, fare) in i64s(&trips, "pickup_zone")
        .into_iter()
        .zip(f64s(&trips, "fare_amount"))
    {
        if zone < 12 {
            let e = expected.entry(zone).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += fare;
        }
    }
    assert_eq!(
        i64s(&result, "pickup_zone"),
        expected.keys().copied().collect::<Vec<_>>()
    );
    let (counts, sums) = (i64s(&result, "trips"), f64s(&result, "fare_sum"));
    for (row, (count, sum)) in expected.values().enumerate() {
        assert_eq!(counts[row], *count);
        assert_close("fare sum", sums[row], *sum);
    }
}

//! The device operator benchmark (an ignored test; `host/gpu-check.sh` runs it in release mode
//! on a GPU machine): the taxi haversine pass as one fused kernel, a group-by, a join, a sort and
//! a hash-partition on the GPU, each next to the CPU backend on the same data; the haversine
//! pass's effective memory bandwidth next to the card's (its peak from NVML, and a
//! device-to-device copy measured in the same run), and that of a pass moving the same bytes
//! with almost no arithmetic (the four coordinates added up). `BENCH_ROWS` sets the row count (20 M).
//! Without a GPU it runs on the CUDA emulator (for checking the benchmark itself; its figures
//! then mean nothing), unless `WRK_REQUIRE_GPU=1`.
//!
//! The data is a function of the row number ([`uniform`]), so `host/gpu-peers.py` makes the
//! same table for the peer on the same card (cuDF) without reading a file.

use std::sync::Arc;
use std::time::Instant;

use arrow::array::{ArrayRef, Float64Array, Int32Array, Int64Array, RecordBatch};

use super::kernels::fused::MIN_BLOCKS;
use super::table::{DeviceTable, download, upload};
use super::{GpuRuntime, nvml, ops};
use crate::cpu;
use crate::cpu::join::JoinType;
use crate::cpu::ops::{Aggregate, AggregateFn};
use crate::cpu::sort::SortKey;
use crate::expr::{Expr, Literal};
use crate::guest_api::wit::{BinaryOp, UnaryOp};

/// Value `column` of row `row`, uniform in [0, 1): the top 53 bits of SplitMix64 of
/// `row * 8 + column` (`host/gpu-peers.py` computes the same with numpy).
fn uniform(row: u64, column: u64) -> f64 {
    let mut z = (row * 8 + column).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// Trips around Manhattan: four coordinates, 1-6 passengers, and one of `rows / 4` drivers.
fn taxi(rows: usize) -> RecordBatch {
    let drivers = (rows as i64 / 4).max(1);
    let coordinate = |column: u64, base: f64| {
        let values = (0..rows as u64).map(|row| base + uniform(row, column) * 0.3);
        Arc::new(Float64Array::from_iter_values(values)) as ArrayRef
    };
    let passengers = (0..rows as u64).map(|row| (uniform(row, 4) * 6.0) as i32 + 1);
    let driver = (0..rows as i64).map(|row| (row * 7919) % drivers);
    RecordBatch::try_from_iter([
        ("pickup_longitude", coordinate(0, -74.0)),
        ("pickup_latitude", coordinate(1, 40.6)),
        ("dropoff_longitude", coordinate(2, -74.0)),
        ("dropoff_latitude", coordinate(3, 40.6)),
        (
            "passenger_count",
            Arc::new(Int32Array::from_iter_values(passengers)) as ArrayRef,
        ),
        (
            "driver",
            Arc::new(Int64Array::from_iter_values(driver)) as ArrayRef,
        ),
    ])
    .unwrap()
}

fn haversine() -> Expr {
    let c = |n: &str| Arc::new(Expr::col(n));
    let f = |v: f64| Arc::new(Expr::Literal(Literal::Float64(v)));
    let b = |op, lhs, rhs| Arc::new(Expr::Binary { op, lhs, rhs });
    let u = |op, arg| Arc::new(Expr::Unary { op, arg });
    let rad = |n: &str| b(BinaryOp::Mul, c(n), f(std::f64::consts::PI / 180.0));
    let half = |a, z| {
        u(
            UnaryOp::Sin,
            b(BinaryOp::Div, b(BinaryOp::Sub, a, z), f(2.0)),
        )
    };
    let dlat = half(rad("dropoff_latitude"), rad("pickup_latitude"));
    let dlon = half(rad("dropoff_longitude"), rad("pickup_longitude"));
    let a = b(
        BinaryOp::Add,
        b(BinaryOp::Mul, dlat.clone(), dlat),
        b(
            BinaryOp::Mul,
            b(
                BinaryOp::Mul,
                u(UnaryOp::Cos, rad("pickup_latitude")),
                u(UnaryOp::Cos, rad("dropoff_latitude")),
            ),
            b(BinaryOp::Mul, dlon.clone(), dlon),
        ),
    );
    Arc::unwrap_or_clone(b(
        BinaryOp::Mul,
        f(2.0 * 6371.0),
        u(UnaryOp::Asin, u(UnaryOp::Sqrt, a)),
    ))
}

/// The best of `runs` timings of `f`, in seconds (the GPU ones synchronise inside `f`).
fn best<T>(runs: usize, mut f: impl FnMut() -> T) -> f64 {
    (0..runs)
        .map(|_| {
            let started = Instant::now();
            std::hint::black_box(f());
            started.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// The best of `runs` timings of the device operator `gpu`, each waited for, in seconds; `None`
/// after printing why where it fails, so the other operators are still measured.
fn time_device<T, E: std::fmt::Display>(
    runtime: &GpuRuntime,
    name: &str,
    runs: usize,
    mut gpu: impl FnMut() -> Result<T, E>,
) -> Option<f64> {
    let mut seconds = f64::INFINITY;
    for _ in 0..runs {
        let started = Instant::now();
        let result = gpu()
            .map_err(|e| e.to_string())
            .and_then(|out| runtime.backend.synchronize().map(|()| out));
        let elapsed = started.elapsed().as_secs_f64();
        match result {
            Ok(out) => drop(out),
            Err(e) => {
                println!("  {name:<16} gpu failed: {e}");
                return None;
            }
        }
        seconds = seconds.min(elapsed);
    }
    Some(seconds)
}

/// [`time_device`] of `gpu` next to the best of three of `cpu`, printed at once as a row of
/// the report.
fn compare<T, E: std::fmt::Display, U>(
    runtime: &GpuRuntime,
    name: &str,
    runs: usize,
    gpu: impl FnMut() -> Result<T, E>,
    cpu: impl FnMut() -> U,
) -> Option<f64> {
    let seconds = time_device(runtime, name, runs, gpu)?;
    let cpu_seconds = best(3, cpu);
    println!(
        "  {name:<16} gpu {:>9.2} ms   cpu {:>9.2} ms   speed-up {:>6.1}x",
        seconds * 1e3,
        cpu_seconds * 1e3,
        cpu_seconds / seconds
    );
    Some(seconds)
}

#[test]
#[ignore = "a benchmark: host/gpu-check.sh runs it on a GPU machine"]
fn device_operator_benchmark() {
    // The pool as a worker sizes it (most of the GPU's free memory): the join and sort of 20 M
    // rows need several GiB.
    let Some(runtime) = super::test_device_with_pool("device_operator_benchmark", None) else {
        return;
    };
    let rows: usize = std::env::var("BENCH_ROWS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(20_000_000);
    let batch = taxi(rows);
    let drivers = RecordBatch::try_from_iter(vec![(
        "driver",
        Arc::new(Int64Array::from_iter_values(0..(rows as i64 / 4).max(1))) as ArrayRef,
    )])
    .unwrap();
    println!(
        "device operator benchmark on {} ({rows} rows, a pool of {} MiB)",
        runtime.device.name,
        runtime.pool.stats().capacity >> 20
    );
    let upload_s = best(3, || upload(&runtime, &batch).unwrap());
    let device: DeviceTable = upload(&runtime, &batch).unwrap();
    let device_drivers = upload(&runtime, &drivers).unwrap();
    let expr = haversine();
    let haversine = compare(
        &runtime,
        "haversine",
        5,
        || ops::evaluate(&runtime, &device, &expr),
        || cpu::eval::evaluate(&expr, &batch).unwrap(),
    );
    // The same bytes with almost no arithmetic: what the fused path moves when memory alone
    // bounds it (the haversine's double-precision sines, cosines and arcsine cost time too).
    let added = four_column_sum();
    let column_add = compare(
        &runtime,
        "column-add",
        5,
        || ops::evaluate(&runtime, &device, &added),
        || cpu::eval::evaluate(&added, &batch).unwrap(),
    );
    // The fused kernels launched otherwise: each pass with BENCH_FUSED_ROWS rows a thread (a
    // grid of fewer, longer-lived threads), the haversine also with its registers capped so
    // that BENCH_FUSED_MIN_BLOCKS blocks fit on a multiprocessor (the generated kernels ask for
    // `fused::MIN_BLOCKS`; 1 lets the compiler use all the registers it likes). The
    // haversine's kernel waits on its loads half of the time: more threads resident, or more
    // rows in flight per thread, can hide that.
    let list = |name: &str, default: &str| -> Vec<usize> {
        std::env::var(name)
            .unwrap_or_else(|_| default.into())
            .split(',')
            .filter_map(|v| v.trim().parse().ok())
            .collect()
    };
    let variant = |name: &str, expr: &Expr, min_blocks: usize, rows: usize| {
        let kernel = runtime
            .kernels
            .plan(expr, &ops::validity_schema(&device))
            .ok()?;
        let generated = format!("__launch_bounds__({}, {MIN_BLOCKS})", super::exec::BLOCK);
        let kernel = match min_blocks as u32 {
            MIN_BLOCKS => kernel.as_ref().clone(),
            blocks => kernel.variant(
                &format!("min-blocks-{blocks}"),
                &generated,
                &format!("__launch_bounds__({}, {blocks})", super::exec::BLOCK),
            ),
        };
        let label = format!("{name}, {rows} rows/thread, min blocks {min_blocks}");
        let seconds = time_device(&runtime, &label, 5, || {
            ops::run_fused(&runtime, &device, expr, &kernel, rows)
        });
        if let Some(seconds) = seconds {
            println!("  {label:<48} gpu {:>9.3} ms", seconds * 1e3);
        }
        Some((label, seconds?))
    };
    let rows_per_thread = list("BENCH_FUSED_ROWS", "1,2,4,16");
    let min_blocks = list("BENCH_FUSED_MIN_BLOCKS", "1,7,8");
    let mut variants: Vec<(String, f64)> = Vec::new();
    for &rows in &rows_per_thread {
        variants.extend(variant("column-add", &added, 0, rows));
        for &blocks in &min_blocks {
            variants.extend(variant("haversine", &expr, blocks, rows));
        }
    }
    // What each pass writes: its values, and a validity byte a row if its result can be null
    // (not here: the coordinates have no nulls).
    let written = ops::evaluate(&runtime, &device, &expr).unwrap();
    let validity_bytes = if written.validity.is_some() { 1.0 } else { 0.0 };
    drop(written);
    let aggregates = [Aggregate {
        column: "pickup_longitude".into(),
        function: AggregateFn::Mean,
        alias: "m".into(),
    }];
    let key = ["passenger_count".to_string()];
    compare(
        &runtime,
        "group-by",
        5,
        || ops::group_by(&runtime, &device, &key, &aggregates),
        || cpu::ops::group_by(&batch, &key, &aggregates).unwrap(),
    );
    let on = ["driver".to_string()];
    compare(
        &runtime,
        "join",
        3,
        || {
            ops::join(
                &runtime,
                &device,
                &device_drivers,
                &on,
                &on,
                JoinType::Inner,
                false,
            )
        },
        || cpu::join::join(&batch, &drivers, &on, &on, JoinType::Inner).unwrap(),
    );
    let keys = [SortKey {
        column: "pickup_longitude".into(),
        descending: false,
        nulls_first: false,
    }];
    compare(
        &runtime,
        "sort",
        3,
        || ops::sort(&runtime, &device, &keys),
        || cpu::sort::sort(&batch, &keys).unwrap(),
    );
    compare(
        &runtime,
        "hash-partition",
        3,
        || ops::hash_partition(&runtime, &device, &on, 16),
        || cpu::partition::hash_partition(&batch, &on, 16).unwrap(),
    );
    let download_s = best(3, || download(&runtime, &device).unwrap());
    let bytes = super::table::DeviceTable::bytes(&device) as f64;
    drop((device, device_drivers));
    println!("  pool peak {} MiB", runtime.pool.stats().peak >> 20);
    println!(
        "  upload {:.2} GB/s, download {:.2} GB/s",
        bytes / upload_s / 1e9,
        bytes / download_s / 1e9
    );
    // Both passes read 4 f64 and write one f64 per row.
    let bandwidth = |seconds: f64| rows as f64 * (5.0 * 8.0 + validity_bytes) / seconds;
    let passes: Vec<(String, f64)> = [("haversine", haversine), ("column-add", column_add)]
        .into_iter()
        .map(|(name, seconds)| (name.to_string(), seconds))
        .filter_map(|(name, seconds)| Some((name, bandwidth(seconds?))))
        .chain(
            variants
                .into_iter()
                .map(|(label, seconds)| (label, bandwidth(seconds))),
        )
        .collect();
    println!("  bytes per row: 40 read and written, {validity_bytes} of validity");
    let peak = peak_bandwidth(&runtime);
    let copy = copy_bandwidth(&runtime);
    println!(
        "  card peak memory bandwidth (NVML) {}, device-to-device copy (bytes read + written) {:.1} GB/s",
        peak.map_or("unknown".into(), |peak| format!("{:.1} GB/s", peak / 1e9)),
        copy / 1e9
    );
    for (name, achieved) in &passes {
        let of_peak = peak.map_or("?".into(), |peak| format!("{:.0}", 100.0 * achieved / peak));
        println!(
            "  {name:<48} effective bandwidth {:>7.1} GB/s = {of_peak}% of the peak, {:.0}% of the copy",
            achieved / 1e9,
            100.0 * achieved / copy
        );
    }
}

/// The four coordinates added up: the haversine's inputs and output, without its arithmetic.
fn four_column_sum() -> Expr {
    let c = |n: &str| Arc::new(Expr::col(n));
    let add = |lhs, rhs| {
        Arc::new(Expr::Binary {
            op: BinaryOp::Add,
            lhs,
            rhs,
        })
    };
    Arc::unwrap_or_clone(add(
        add(c("pickup_longitude"), c("pickup_latitude")),
        add(c("dropoff_longitude"), c("dropoff_latitude")),
    ))
}

/// A device-to-device copy of up to 1 GiB (an eighth of the pool at most), best of 5, in bytes
/// read and written per second: what the card's memory sustains for a plain stream.
fn copy_bandwidth(runtime: &GpuRuntime) -> f64 {
    let len = (runtime.pool.stats().capacity / 8).min(1 << 30);
    let source = runtime.pool.alloc(len).unwrap();
    let mut target = runtime.pool.alloc(len).unwrap();
    let seconds = best(5, || {
        runtime
            .backend
            .copy(source.memory(), len as usize, target.memory_mut(), 0)
            .unwrap();
        runtime.backend.synchronize().unwrap();
    });
    2.0 * len as f64 / seconds
}

/// The card's peak memory bandwidth as NVML gives it (`None` on the emulator or without NVML).
fn peak_bandwidth(runtime: &GpuRuntime) -> Option<f64> {
    if runtime.backend.is_emulated() {
        return None;
    }
    nvml::Telemetry::open_cuda_device(runtime.device.ordinal, &runtime.device.uuid)
        .ok()?
        .peak_memory_bandwidth()
}

/// The table is the one `host/gpu-peers.py` builds for cuDF: these values are what its numpy
/// code gives for the same rows.
#[test]
fn the_benchmark_table_is_the_python_peers() {
    use arrow::array::AsArray;
    use arrow::datatypes::{Float64Type, Int32Type, Int64Type};
    let batch = taxi(12);
    let floats = |name: &str| batch[name].as_primitive::<Float64Type>().values().to_vec();
    assert_eq!(
        floats("pickup_longitude")[..3],
        [-73.73500675753591, -73.8144486124905, -73.88998324521386]
    );
    assert_eq!(floats("pickup_latitude")[11], 40.8448859181348);
    assert_eq!(floats("dropoff_longitude")[11], -73.71923122162235);
    assert_eq!(
        floats("dropoff_latitude")[..3],
        [40.63403510261715, 40.69487331787627, 40.82060757784182]
    );
    let passengers = batch["passenger_count"].as_primitive::<Int32Type>();
    assert_eq!(passengers.values()[..3], [3, 4, 2]);
    let drivers = batch["driver"].as_primitive::<Int64Type>();
    assert_eq!(drivers.values()[..3], [0, 2, 1]);
    assert_eq!(uniform(1_000_000, 3), 0.4716794102507287);
}

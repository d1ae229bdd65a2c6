//! The device operator benchmark (an ignored test; `host/gpu-check.sh` runs it in release mode
//! on a GPU machine): the taxi haversine pass as one fused kernel, a group-by, a join, a sort and
//! a hash-partition on the GPU, each next to the CPU backend on the same data, with the
//! haversine pass's effective memory bandwidth. `BENCH_ROWS` sets the row count (20 M).

use std::sync::Arc;
use std::time::Instant;

use arrow::array::{ArrayRef, Float64Array, Int32Array, Int64Array, RecordBatch};

use super::table::{DeviceTable, download, upload};
use super::{GpuRuntime, ops};
use crate::cpu;
use crate::cpu::join::JoinType;
use crate::cpu::ops::{Aggregate, AggregateFn};
use crate::cpu::sort::SortKey;
use crate::expr::{Expr, Literal};
use crate::guest_api::wit::{BinaryOp, UnaryOp};

fn taxi(rows: usize) -> RecordBatch {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut columns: Vec<Vec<f64>> = (0..4).map(|_| Vec::with_capacity(rows)).collect();
    let mut passengers = Vec::with_capacity(rows);
    let mut drivers = Vec::with_capacity(rows);
    for row in 0..rows {
        columns[0].push(-74.0 + next() * 0.3);
        columns[1].push(40.6 + next() * 0.3);
        columns[2].push(-74.0 + next() * 0.3);
        columns[3].push(40.6 + next() * 0.3);
        passengers.push((next() * 6.0) as i32 + 1);
        drivers.push((row as i64 * 7919) % (rows as i64 / 4).max(1));
    }
    let names = [
        "pickup_longitude",
        "pickup_latitude",
        "dropoff_longitude",
        "dropoff_latitude",
    ];
    let mut fields: Vec<(&str, ArrayRef)> = names
        .iter()
        .zip(columns)
        .map(|(n, c)| (*n, Arc::new(Float64Array::from(c)) as ArrayRef))
        .collect();
    fields.push(("passenger_count", Arc::new(Int32Array::from(passengers))));
    fields.push(("driver", Arc::new(Int64Array::from(drivers))));
    RecordBatch::try_from_iter(fields).unwrap()
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

fn sync(runtime: &GpuRuntime) {
    runtime.backend.synchronize().unwrap();
}

#[test]
#[ignore = "a benchmark: host/gpu-check.sh runs it on a GPU machine"]
fn device_operator_benchmark() {
    let Some(runtime) = super::test_gpu("device_operator_benchmark") else {
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
    let upload_s = best(3, || upload(&runtime, &batch).unwrap());
    let device: DeviceTable = upload(&runtime, &batch).unwrap();
    let device_drivers = upload(&runtime, &drivers).unwrap();
    let expr = haversine();
    let mut report = Vec::new();
    let mut row = |name: &str, gpu: f64, cpu: f64| {
        report.push(format!(
            "{name:<16} gpu {:>9.2} ms   cpu {:>9.2} ms   speed-up {:>6.1}x",
            gpu * 1e3,
            cpu * 1e3,
            cpu / gpu
        ))
    };
    let gpu = best(5, || {
        let c = ops::evaluate(&runtime, &device, &expr).unwrap();
        sync(&runtime);
        c
    });
    let cpu_time = best(3, || cpu::eval::evaluate(&expr, &batch).unwrap());
    row("haversine", gpu, cpu_time);
    // 4 f64 read, one f64 and one validity byte written per row.
    let bandwidth = rows as f64 * (4.0 * 8.0 + 9.0) / gpu;
    let aggregates = [Aggregate {
        column: "pickup_longitude".into(),
        function: AggregateFn::Mean,
        alias: "m".into(),
    }];
    let key = ["passenger_count".to_string()];
    let gpu = best(5, || {
        let t = ops::group_by(&runtime, &device, &key, &aggregates).unwrap();
        sync(&runtime);
        t
    });
    let cpu_time = best(3, || cpu::ops::group_by(&batch, &key, &aggregates).unwrap());
    row("group-by", gpu, cpu_time);
    let on = ["driver".to_string()];
    let gpu = best(3, || {
        let t = ops::join(
            &runtime,
            &device,
            &device_drivers,
            &on,
            &on,
            JoinType::Inner,
            false,
        )
        .unwrap();
        sync(&runtime);
        t
    });
    let cpu_time = best(3, || {
        cpu::join::join(&batch, &drivers, &on, &on, JoinType::Inner).unwrap()
    });
    row("join", gpu, cpu_time);
    let keys = [SortKey {
        column: "pickup_longitude".into(),
        descending: false,
        nulls_first: false,
    }];
    let gpu = best(3, || {
        let t = ops::sort(&runtime, &device, &keys).unwrap();
        sync(&runtime);
        t
    });
    let cpu_time = best(3, || cpu::sort::sort(&batch, &keys).unwrap());
    row("sort", gpu, cpu_time);
    let gpu = best(3, || {
        let t = ops::hash_partition(&runtime, &device, &on, 16).unwrap();
        sync(&runtime);
        t
    });
    let cpu_time = best(3, || {
        cpu::partition::hash_partition(&batch, &on, 16).unwrap()
    });
    row("hash-partition", gpu, cpu_time);
    let download_s = best(3, || download(&runtime, &device).unwrap());
    println!(
        "device operator benchmark on {} ({rows} rows, pool peak {} MiB)",
        runtime.device.name,
        runtime.pool.stats().peak >> 20
    );
    for line in &report {
        println!("  {line}");
    }
    let bytes = super::table::DeviceTable::bytes(&device) as f64;
    println!(
        "  haversine effective bandwidth {:.1} GB/s; upload {:.2} GB/s, download {:.2} GB/s",
        bandwidth / 1e9,
        bytes / upload_s / 1e9,
        bytes / download_s / 1e9
    );
}

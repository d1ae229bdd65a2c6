//! The device self-test: every device operator run on a small table and compared with the CPU
//! backend. A GPU worker runs it at start (a broken driver, NVRTC or kernel then shows up as a
//! clear start-up error, or a logged fallback to the CPU with `--device auto`), and the GPU tests
//! run the same comparisons ([`compare_all`]) on larger tables.

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Float64Array, Int32Array, Int64Array, RecordBatch,
    StringArray,
};
use arrow::datatypes::{DataType, Float64Type};

use super::GpuRuntime;
use super::ops::{self, GpuOpError};
use super::table::{DeviceTable, download, download_array, upload};
use crate::cpu;
use crate::cpu::join::JoinType;
use crate::cpu::ops::{Aggregate, AggregateFn};
use crate::cpu::sort::SortKey;
use crate::expr::{Expr, Literal};
use crate::guest_api::wit::{BinaryOp, UnaryOp};

/// A device result that differs from the CPU backend's.
#[derive(Debug, thiserror::Error)]
pub enum SelfTestError {
    #[error("{operator}: the device failed: {detail}")]
    Failed { operator: String, detail: String },
    #[error("{operator}: the device's result differs from the CPU backend's: {detail}")]
    Mismatch { operator: String, detail: String },
}

/// A deterministic table of `rows` rows: ints with nulls, floats with nulls, NaN and -0.0,
/// strings, booleans.
/// The next value of a xorshift64 generator.
fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// The sample table's strings: prefixes of each other, an empty one, non-ASCII bytes, and
/// lengths across several 8-byte words.
const STRINGS: [&str; 11] = [
    "w0",
    "w1",
    "w10",
    "w3",
    "w",
    "",
    "w1\u{e9}",
    "w1\u{7f}",
    "a string of more than sixteen bytes",
    "a string of more than sixteen bytes!",
    "a string of more than sixteen",
];

pub fn sample_table(rows: usize) -> RecordBatch {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || xorshift(&mut state);
    let mut k = Vec::with_capacity(rows);
    let mut x = Vec::with_capacity(rows);
    let mut s = Vec::with_capacity(rows);
    let mut b = Vec::with_capacity(rows);
    let mut id = Vec::with_capacity(rows);
    for row in 0..rows {
        let r = next();
        k.push((r % 17 != 0).then_some((r % 7) as i32 - 3));
        x.push(match r % 23 {
            0 => None,
            1 => Some(f64::NAN),
            2 => Some(-0.0),
            _ => Some(((r >> 8) % 10_000) as f64 / 7.0 - 500.0),
        });
        s.push((r % 13 != 0).then(|| STRINGS[((r >> 16) % STRINGS.len() as u64) as usize]));
        b.push((r >> 3) % 2 == 0);
        id.push(row as i64);
    }
    let column = |a: ArrayRef| a;
    RecordBatch::try_from_iter(vec![
        ("k", column(Arc::new(Int32Array::from(k)))),
        ("x", column(Arc::new(Float64Array::from(x)))),
        ("s", column(Arc::new(StringArray::from(s)))),
        ("b", column(Arc::new(BooleanArray::from(b)))),
        ("id", column(Arc::new(Int64Array::from(id)))),
    ])
    .unwrap_or_else(|e| panic!("the sample table is well formed: {e}"))
}

/// A small dimension table keyed by `k` (with a duplicate key, so joins fan out).
pub fn dimension_table() -> RecordBatch {
    let keys: ArrayRef = Arc::new(Int64Array::from(vec![-3, -1, 0, 2, 2, 9]));
    let names: ArrayRef = Arc::new(StringArray::from(vec!["a", "b", "c", "d", "e", "f"]));
    RecordBatch::try_from_iter(vec![("k", keys), ("name", names)])
        .unwrap_or_else(|e| panic!("the dimension table is well formed: {e}"))
}

/// A small dimension table keyed by the string `s` (with a duplicate and a null key, and keys
/// the sample table does not have).
pub fn string_dimension_table() -> RecordBatch {
    let keys: ArrayRef = Arc::new(StringArray::from(vec![
        Some("w3"),
        Some("w10"),
        None,
        Some("w3"),
        Some("w"),
        Some("w30"),
        Some(""),
    ]));
    let ranks: ArrayRef = Arc::new(Int64Array::from(vec![1, 2, 3, 4, 5, 6, 7]));
    RecordBatch::try_from_iter(vec![("s", keys), ("rank", ranks)])
        .unwrap_or_else(|e| panic!("the string dimension table is well formed: {e}"))
}

/// A small dimension table keyed by the pair (`k`, `s`), with duplicate and null keys.
pub fn pair_dimension_table() -> RecordBatch {
    let k: ArrayRef = Arc::new(Int64Array::from(vec![
        Some(-3),
        Some(-1),
        Some(0),
        Some(2),
        Some(2),
        None,
        Some(2),
        Some(-3),
    ]));
    let s: ArrayRef = Arc::new(StringArray::from(vec![
        Some("w3"),
        Some("w10"),
        Some("w1"),
        Some("w3"),
        Some("w3"),
        Some("w0"),
        None,
        Some(""),
    ]));
    let ranks: ArrayRef = Arc::new(Int64Array::from((1..=8).collect::<Vec<i64>>()));
    RecordBatch::try_from_iter(vec![("k", k), ("s", s), ("rank", ranks)])
        .unwrap_or_else(|e| panic!("the pair dimension table is well formed: {e}"))
}

/// Compares two batches: names, types, and values; floats within a relative `tolerance`
/// (0 for exact), NaN equal to NaN.
pub fn compare(
    operator: &str,
    device: &RecordBatch,
    host: &RecordBatch,
    tolerance: f64,
) -> Result<(), SelfTestError> {
    let mismatch = |detail: String| SelfTestError::Mismatch {
        operator: operator.to_string(),
        detail,
    };
    if device.num_rows() != host.num_rows() || device.num_columns() != host.num_columns() {
        return Err(mismatch(format!(
            "{}x{} vs {}x{}",
            device.num_rows(),
            device.num_columns(),
            host.num_rows(),
            host.num_columns()
        )));
    }
    for (i, field) in host.schema().fields().iter().enumerate() {
        let (d, h) = (device.column(i), host.column(i));
        let device_field = device.schema().field(i).clone();
        if device_field.name() != field.name() || d.data_type() != h.data_type() {
            return Err(mismatch(format!(
                "column {i}: {}: {} vs {}: {}",
                device_field.name(),
                d.data_type(),
                field.name(),
                h.data_type()
            )));
        }
        if *h.data_type() == DataType::Float64 && tolerance > 0.0 {
            let (d, h) = (
                d.as_primitive::<Float64Type>(),
                h.as_primitive::<Float64Type>(),
            );
            for row in 0..h.len() {
                let same = match (d.is_valid(row), h.is_valid(row)) {
                    (true, true) => {
                        let (a, b) = (d.value(row), h.value(row));
                        // Equal infinities are equal (their difference is NaN).
                        a == b
                            || (a.is_nan() && b.is_nan())
                            || (a - b).abs() <= tolerance * b.abs().max(1.0)
                    }
                    (a, b) => a == b,
                };
                if !same {
                    return Err(mismatch(format!(
                        "column `{}` row {row}: {:?} vs {:?}",
                        field.name(),
                        d.is_valid(row).then(|| d.value(row)),
                        h.is_valid(row).then(|| h.value(row))
                    )));
                }
            }
        } else if d.to_data() != h.to_data() {
            // Compare logically (null slots may hold different bytes).
            let render = |a: &ArrayRef| {
                arrow::util::display::ArrayFormatter::try_new(a.as_ref(), &Default::default())
                    .map(|f| {
                        (0..a.len())
                            .map(|r| f.value(r).to_string())
                            .collect::<Vec<_>>()
                    })
                    .unwrap_or_default()
            };
            let (dr, hr) = (render(d), render(h));
            // Validity row by row: one side may carry an all-valid null buffer, the other none.
            let valid = |a: &ArrayRef| (0..a.len()).map(|r| a.is_valid(r)).collect::<Vec<_>>();
            if dr != hr || valid(d) != valid(h) {
                let first = (0..dr.len().min(hr.len()))
                    .find(|&r| dr[r] != hr[r])
                    .unwrap_or(0);
                return Err(mismatch(format!(
                    "column `{}` from row {first}: {:?} vs {:?}",
                    field.name(),
                    dr.get(first),
                    hr.get(first)
                )));
            }
        }
    }
    Ok(())
}

/// Compares a device operator's result with the CPU backend's, as [`compare`] does; either
/// failing fails `operator`.
fn check_against_cpu<E: std::fmt::Display>(
    runtime: &GpuRuntime,
    operator: &str,
    device: Result<DeviceTable, GpuOpError>,
    host: Result<RecordBatch, E>,
    tolerance: f64,
) -> Result<(), SelfTestError> {
    let device = device
        .and_then(|t| Ok(download(runtime, &t)?))
        .map_err(|e| failed(operator)(e.to_string()))?;
    let host = host.map_err(|e| failed(operator)(e.to_string()))?;
    compare(operator, &device, &host, tolerance)
}

fn failed(operator: &str) -> impl Fn(String) -> SelfTestError + '_ {
    move |detail| SelfTestError::Failed {
        operator: operator.to_string(),
        detail,
    }
}

fn col(name: &str) -> Arc<Expr> {
    Arc::new(Expr::col(name))
}

fn lit(v: f64) -> Arc<Expr> {
    Arc::new(Expr::Literal(Literal::Float64(v)))
}

/// Every device operator on `table` (and joins with [`dimension_table`]) against the CPU backend.
pub fn compare_all(runtime: &GpuRuntime, table: &RecordBatch) -> Result<(), SelfTestError> {
    let device = upload(runtime, table).map_err(|e| failed("upload")(e.to_string()))?;
    let roundtrip = download(runtime, &device).map_err(|e| failed("download")(e.to_string()))?;
    compare("upload/download", &roundtrip, table, 0.0)?;

    // A fused expression with math, a cast and null handling.
    let expr = Expr::Binary {
        op: BinaryOp::Add,
        lhs: Arc::new(Expr::Unary {
            op: UnaryOp::Sqrt,
            arg: Arc::new(Expr::Unary {
                op: UnaryOp::Abs,
                arg: col("x"),
            }),
        }),
        rhs: Arc::new(Expr::FillNull {
            arg: Arc::new(Expr::Cast {
                arg: col("k"),
                to: DataType::Float64,
            }),
            fill: lit(0.5),
        }),
    };
    let on_device =
        ops::evaluate(runtime, &device, &expr).map_err(|e| failed("evaluate")(e.to_string()))?;
    let on_device =
        download_array(runtime, "e", &on_device).map_err(|e| failed("evaluate")(e.to_string()))?;
    let on_device = RecordBatch::try_from_iter(vec![("e", on_device)])
        .map_err(|e| failed("evaluate")(e.to_string()))?;
    let on_host =
        cpu::eval::evaluate(&expr, table).map_err(|e| failed("evaluate")(e.to_string()))?;
    let on_host = RecordBatch::try_from_iter(vec![("e", on_host)])
        .map_err(|e| failed("evaluate")(e.to_string()))?;
    compare("evaluate", &on_device, &on_host, 1e-12)?;

    // Filter.
    let predicate = Expr::Binary {
        op: BinaryOp::And,
        lhs: Arc::new(Expr::Binary {
            op: BinaryOp::Gt,
            lhs: col("x"),
            rhs: lit(-100.0),
        }),
        rhs: col("b"),
    };
    check_against_cpu(
        runtime,
        "filter",
        ops::filter(runtime, &device, &predicate),
        cpu::ops::filter(table, &predicate),
        0.0,
    )?;
    // A filter on strings against literals (one fused kernel): prefixes, the empty string and
    // non-ASCII bytes order as bytes; null strings drop their rows.
    let text = |t: &str| Arc::new(Expr::Literal(Literal::Utf8(t.into())));
    for (op, literal) in [
        (BinaryOp::Eq, "w1"),
        (BinaryOp::Ne, "w1"),
        (BinaryOp::Lt, "w1"),
        (BinaryOp::Ge, "w1\u{e9}"),
        (BinaryOp::Gt, ""),
        (BinaryOp::Le, "a string of more than sixteen bytes"),
    ] {
        let predicate = Expr::Binary {
            op: BinaryOp::Or,
            lhs: Arc::new(Expr::Binary {
                op,
                lhs: col("s"),
                rhs: text(literal),
            }),
            rhs: Arc::new(Expr::Binary {
                op: BinaryOp::Lt,
                lhs: text("w3"),
                rhs: col("s"),
            }),
        };
        let operator = format!("filter {predicate}");
        check_against_cpu(
            runtime,
            &operator,
            ops::filter(runtime, &device, &predicate),
            cpu::ops::filter(table, &predicate),
            0.0,
        )?;
    }

    // Hash-partition on an int and a string key, into a few partitions and into many (some
    // of them empty), counted in shared memory and, past WRK_SHARED_GROUPS, in global memory.
    let keys = ["k".to_string(), "s".to_string()];
    for partitions in [5, 64, 300] {
        let d = ops::hash_partition(runtime, &device, &keys, partitions)
            .map_err(|e| failed("hash-partition")(e.to_string()))?;
        let h = cpu::partition::hash_partition(table, &keys, partitions)
            .map_err(|e| failed("hash-partition")(e.to_string()))?;
        if d.len() != h.len() {
            return Err(failed("hash-partition")(format!(
                "{} partitions, the CPU backend made {}",
                d.len(),
                h.len()
            )));
        }
        for (p, (d, h)) in d.iter().zip(&h).enumerate() {
            let d = download(runtime, d).map_err(|e| failed("hash-partition")(e.to_string()))?;
            compare(
                &format!("hash-partition part {p} of {partitions}"),
                &d,
                h,
                0.0,
            )?;
        }
    }

    // Group-by with every aggregate the kernels have.
    let aggregates: Vec<Aggregate> = [
        (AggregateFn::Sum, "x"),
        (AggregateFn::Count, "x"),
        (AggregateFn::Mean, "x"),
        (AggregateFn::Min, "x"),
        (AggregateFn::Max, "x"),
        (AggregateFn::Sum, "id"),
        (AggregateFn::Min, "k"),
        (AggregateFn::Mean, "id"),
        (AggregateFn::CountDistinct, "k"),
        (AggregateFn::CountDistinct, "x"),
        (AggregateFn::CountDistinct, "s"),
    ]
    .iter()
    .enumerate()
    .map(|(i, (function, column))| Aggregate {
        column: column.to_string(),
        function: *function,
        alias: format!("a{i}"),
    })
    .collect();
    // One key, and several: with nulls, a boolean, a float key with NaN and -0.0, and strings.
    for keys in [
        &["k"][..],
        &["k", "b"],
        &["b", "k"],
        &["k", "x", "b"],
        &["s"],
        &["s", "k"],
        &["b", "s"],
    ] {
        let operator = format!("group-by {keys:?}");
        let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        // Float sums add in another order on the device.
        check_against_cpu(
            runtime,
            &operator,
            ops::group_by(runtime, &device, &keys, &aggregates),
            cpu::ops::group_by(table, &keys, &aggregates),
            1e-9,
        )?;
    }
    // The same over the whole table (an empty table's aggregate is the CPU's).
    if table.num_rows() > 0 {
        check_against_cpu(
            runtime,
            "aggregate",
            ops::aggregate(runtime, &device, &aggregates),
            cpu::ops::aggregate(table, &aggregates),
            1e-9,
        )?;
    }

    // Distinct rows: by strings and ints, by a boolean, and by every column (floats with NaN
    // and -0.0 among them; the unique id keeps every row).
    for columns in [Some(&["s", "k"][..]), Some(&["b"]), None] {
        let operator = format!("distinct {columns:?}");
        let columns: Option<Vec<String>> =
            columns.map(|c| c.iter().map(|name| name.to_string()).collect());
        check_against_cpu(
            runtime,
            &operator,
            ops::distinct(runtime, &device, columns.as_deref()),
            cpu::ops::distinct(table, columns.as_deref()),
            0.0,
        )?;
    }

    // Sort: float descending with nulls first, then the id (unique, so the order is total).
    let sort_keys = [
        SortKey {
            column: "x".into(),
            descending: true,
            nulls_first: true,
        },
        SortKey {
            column: "id".into(),
            descending: false,
            nulls_first: false,
        },
    ];
    check_against_cpu(
        runtime,
        "sort",
        ops::sort(runtime, &device, &sort_keys),
        cpu::sort::sort(table, &sort_keys),
        0.0,
    )?;
    // By strings each way (nulls last, then first), then by the integer key and the id.
    for descending in [false, true] {
        let string_keys = [
            SortKey {
                column: "s".into(),
                descending,
                nulls_first: descending,
            },
            SortKey {
                column: "k".into(),
                descending: !descending,
                nulls_first: false,
            },
            SortKey {
                column: "id".into(),
                descending: false,
                nulls_first: false,
            },
        ];
        let operator = format!("sort by strings (descending: {descending})");
        check_against_cpu(
            runtime,
            &operator,
            ops::sort(runtime, &device, &string_keys),
            cpu::sort::sort(table, &string_keys),
            0.0,
        )?;
    }
    let k = table.num_rows() as u64 / 3 + 1;
    check_against_cpu(
        runtime,
        "top-k",
        ops::top_k(runtime, &device, &sort_keys, k),
        cpu::sort::top_k(table, &sort_keys, k),
        0.0,
    )?;

    // Slices, one running past the end.
    let rows = table.num_rows() as u64;
    for (offset, length) in [(rows / 4, rows / 2), (rows / 2, rows), (rows + 1, 3)] {
        let d = ops::slice(runtime, &device, offset, length)
            .and_then(|t| Ok(download(runtime, &t)?))
            .map_err(|e| failed("slice")(e.to_string()))?;
        compare("slice", &d, &cpu::ops::slice(table, offset, length), 0.0)?;
    }

    // New and replaced columns (one a renamed column, one a constant string), then a
    // selection of them.
    let renamed = Expr::col("x");
    let label = Expr::Literal(Literal::Utf8("unknown \u{2713}".into()));
    let added = [
        ("e".to_string(), &expr),
        ("k".to_string(), &renamed),
        ("label".to_string(), &label),
    ];
    let names = [
        "e".to_string(),
        "id".to_string(),
        "k".to_string(),
        "label".to_string(),
    ];
    check_against_cpu(
        runtime,
        "with-columns",
        ops::with_columns(runtime, &device, &added).and_then(|t| ops::select(&t, &names)),
        cpu::ops::with_columns(table, &added).and_then(|t| cpu::ops::select(&t, &names)),
        1e-12,
    )?;

    // Joins with the (smaller) dimension tables (the CPU builds on them too, so orders agree):
    // on an integer key, on a string key, and on several (an index of the join's own whether
    // cached or not).
    for (dimension, on) in [
        (dimension_table(), &["k"][..]),
        (string_dimension_table(), &["s"]),
        (pair_dimension_table(), &["k", "s"]),
        // Three pairs (one twice): the groups of the first two are combined again.
        (pair_dimension_table(), &["s", "k", "s"]),
    ] {
        let dim = upload(runtime, &dimension).map_err(|e| failed("join")(e.to_string()))?;
        // Each kind with an index of its own, then with the one the worker's cache keeps for
        // a shared table (built by the first join, probed by the others).
        let on: Vec<String> = on.iter().map(|k| k.to_string()).collect();
        for cache_index in [false, true] {
            for how in [
                JoinType::Inner,
                JoinType::Left,
                JoinType::Semi,
                JoinType::Anti,
            ] {
                let operator = format!("{how:?} join on {on:?} (cached index: {cache_index})");
                check_against_cpu(
                    runtime,
                    &operator,
                    ops::join(runtime, &device, &dim, &on, &on, how, cache_index),
                    cpu::join::join(table, &dimension, &on, &on, how),
                    0.0,
                )?;
            }
        }
        // The dimension table goes: so does its cached index.
        drop(dim);
        runtime.join_indexes.purge_dropped();
    }

    // Concat of the table with itself.
    check_against_cpu(
        runtime,
        "concat",
        ops::concat(runtime, &[&device, &device]),
        cpu::ops::concat(&[table, table]),
        0.0,
    )
}

/// The start-up check: [`compare_all`] on a table of a few thousand rows (several scan blocks).
pub fn run(runtime: &GpuRuntime) -> Result<(), SelfTestError> {
    compare_all(runtime, &sample_table(5_000))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_comparison_catches_differences_and_tolerates_float_noise() {
        let a = sample_table(100);
        compare("same", &a, &a, 0.0).unwrap();
        let b = sample_table(99);
        assert!(compare("rows", &a, &b, 0.0).is_err());
        let x: ArrayRef = Arc::new(Float64Array::from(vec![Some(1.0), None, Some(f64::NAN)]));
        let y: ArrayRef = Arc::new(Float64Array::from(vec![
            Some(1.0 + 1e-12),
            None,
            Some(f64::NAN),
        ]));
        let z: ArrayRef = Arc::new(Float64Array::from(vec![Some(1.1), None, Some(f64::NAN)]));
        let batch = |c: &ArrayRef| RecordBatch::try_from_iter(vec![("v", c.clone())]).unwrap();
        compare("noise", &batch(&x), &batch(&y), 1e-9).unwrap();
        let inf: ArrayRef = Arc::new(Float64Array::from(vec![f64::INFINITY, f64::NEG_INFINITY]));
        compare("infinities", &batch(&inf), &batch(&inf), 1e-9).unwrap();
        assert!(compare("exact", &batch(&x), &batch(&y), 0.0).is_err());
        assert!(compare("off", &batch(&x), &batch(&z), 1e-9).is_err());
        // An all-valid null buffer equals no null buffer; a null equals only a null.
        let plain: ArrayRef = Arc::new(Int32Array::from(vec![1, 2]));
        let buffered: ArrayRef = Arc::new(Int32Array::new(
            vec![1, 2].into(),
            Some(arrow::buffer::NullBuffer::new_valid(2)),
        ));
        let null: ArrayRef = Arc::new(Int32Array::from(vec![Some(1), None]));
        compare("buffers", &batch(&plain), &batch(&buffered), 0.0).unwrap();
        assert!(compare("null", &batch(&plain), &batch(&null), 0.0).is_err());
    }

    #[test]
    fn device_operators_match_the_cpu_backend() {
        let Some(runtime) = super::super::test_device("device_operators_match_the_cpu_backend")
        else {
            return;
        };
        // Empty, one row, a partial scan block, several blocks and levels of the scan. The
        // emulator runs a CUDA thread at a time, so it stops at two levels of the scan (the
        // third is checked by exec's scan test).
        let sizes: &[usize] = if runtime.backend.is_emulated() {
            &[0, 1, 1000, 5_000, 70_000]
        } else {
            &[0, 1, 1000, 5_000, 1_100_000]
        };
        for &rows in sizes {
            compare_all(&runtime, &sample_table(rows))
                .unwrap_or_else(|e| panic!("{rows} rows: {e}"));
        }
        // Per size and dimension table: one index built for the cached joins, probed by the
        // other three.
        let joins = runtime.join_indexes.stats();
        assert_eq!((joins.builds, joins.hits), (10, 30), "{joins:?}");
        assert_eq!(joins.entries, 0, "the dimension table's index went with it");
        let stats = runtime.pool.stats();
        assert_eq!(stats.used, 0, "every device buffer went back to the pool");
        assert!(stats.peak > 0);
    }

    /// A division by a power of two runs as a multiplication by its reciprocal: the quotients
    /// must be the CPU's to the bit, subnormal, infinite, NaN and signed-zero ones included.
    /// The column has no nulls, so the result has no validity buffer (nor does the kernel
    /// write one), and every row is valid.
    #[test]
    fn a_division_by_a_power_of_two_is_exact_and_a_column_without_nulls_stays_so() {
        let Some(runtime) = super::super::test_device(
            "a_division_by_a_power_of_two_is_exact_and_a_column_without_nulls_stays_so",
        ) else {
            return;
        };
        let mut values = vec![
            0.0,
            -0.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::MAX,
            f64::MIN_POSITIVE,
            -f64::MIN_POSITIVE,
            5e-324,
            3.0 * 5e-324,
            1.0 + f64::EPSILON,
            -7.25,
            1e300,
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        values.extend((0..500).map(|_| f64::from_bits(xorshift(&mut state))));
        let table = RecordBatch::try_from_iter(vec![(
            "x",
            Arc::new(Float64Array::from(values)) as ArrayRef,
        )])
        .unwrap();
        let device = upload(&runtime, &table).unwrap();
        let divided_by = |divisor: Literal| Expr::Binary {
            op: BinaryOp::Div,
            lhs: Arc::new(Expr::col("x")),
            rhs: Arc::new(Expr::Literal(divisor)),
        };
        for divisor in [
            Literal::Float64(2.0),
            Literal::Float64(0.5),
            Literal::Float64(-0.125),
            Literal::Float64(2f64.powi(-1000)),
            Literal::Float64(2f64.powi(1000)),
            Literal::Int64(-4),
            Literal::UInt64(1 << 40),
            // Not powers of two: a true division. The two zeros are equal to `==` but not
            // to the kernel plan cache, which compares literals by their bits.
            Literal::Float64(3.0),
            Literal::Float64(-0.0),
            Literal::Float64(0.0),
        ] {
            let expr = divided_by(divisor);
            let on_device = ops::evaluate(&runtime, &device, &expr).unwrap();
            assert!(on_device.validity.is_none(), "{expr}: a validity buffer");
            let on_device = download_array(&runtime, "v", &on_device).unwrap();
            let on_host = cpu::eval::evaluate(&expr, &table).unwrap();
            let (d, h) = (
                on_device.as_primitive::<Float64Type>(),
                on_host.as_primitive::<Float64Type>(),
            );
            assert_eq!(d.null_count(), 0, "{expr}");
            for (row, (d, h)) in d.values().iter().zip(h.values()).enumerate() {
                let same = d.to_bits() == h.to_bits() || (d.is_nan() && h.is_nan());
                assert!(same, "{expr}, row {row}: device {d:e}, CPU {h:e}");
            }
        }
        // An expression built again is the plan generated before; over a nullable column it is
        // another.
        let schema = table.schema();
        let plan = |schema: &arrow::datatypes::Schema| {
            runtime
                .kernels
                .plan(&divided_by(Literal::Float64(2.0)), schema)
                .unwrap()
        };
        assert!(Arc::ptr_eq(&plan(&schema), &plan(&schema)));
        let nullable =
            arrow::datatypes::Schema::new(vec![schema.field(0).clone().with_nullable(true)]);
        assert!(!Arc::ptr_eq(&plan(&schema), &plan(&nullable)));
        assert!(plan(&nullable).nullable);
    }

    /// Edge values of every register kind, drawn pseudo-randomly (with nulls) for 600 rows.
    fn edge_table() -> RecordBatch {
        let longs = [0, 1, -1, 7, -7, i64::MIN, i64::MAX, 1 << 40];
        let divisors = [1, -1, 3, -5, i64::MIN, i64::MAX];
        let unsigned = [0, 1, 5, u64::MAX, 1 << 63, 12345];
        let doubles = [
            0.0,
            -0.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            1.5,
            -2.5,
            0.25,
            1e300,
            -3.0,
        ];
        /// 600 values drawn from `values`, null one time in `values.len() + 1`.
        fn draw<T: Copy>(values: &[T], state: &mut u64) -> Vec<Option<T>> {
            (0..600)
                .map(|_| {
                    values
                        .get((xorshift(state) % (values.len() as u64 + 1)) as usize)
                        .copied()
                })
                .collect()
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let (d, e) = (draw(&doubles, &mut state), draw(&doubles, &mut state));
        let (l, m) = (draw(&longs, &mut state), draw(&longs, &mut state));
        let nz = draw(&divisors, &mut state);
        let (u, v) = (draw(&unsigned, &mut state), draw(&unsigned, &mut state));
        let (p, q) = (
            draw(&[true, false], &mut state),
            draw(&[true, false], &mut state),
        );
        let i: Vec<Option<i32>> = l.iter().map(|x| x.map(|x| x as i32)).collect();
        let b8: Vec<Option<u8>> = u.iter().map(|x| x.map(|x| x as u8)).collect();
        let f: Vec<Option<f32>> = e.iter().map(|x| x.map(|x| x as f32)).collect();
        RecordBatch::try_from_iter(vec![
            ("l", Arc::new(Int64Array::from(l)) as ArrayRef),
            ("m", Arc::new(Int64Array::from(m)) as ArrayRef),
            ("nz", Arc::new(Int64Array::from(nz)) as ArrayRef),
            (
                "u",
                Arc::new(arrow::array::UInt64Array::from(u)) as ArrayRef,
            ),
            (
                "v",
                Arc::new(arrow::array::UInt64Array::from(v)) as ArrayRef,
            ),
            ("i", Arc::new(Int32Array::from(i)) as ArrayRef),
            (
                "b8",
                Arc::new(arrow::array::UInt8Array::from(b8)) as ArrayRef,
            ),
            (
                "f",
                Arc::new(arrow::array::Float32Array::from(f)) as ArrayRef,
            ),
            ("d", Arc::new(Float64Array::from(d)) as ArrayRef),
            ("e", Arc::new(Float64Array::from(e)) as ArrayRef),
            ("p", Arc::new(BooleanArray::from(p)) as ArrayRef),
            ("q", Arc::new(BooleanArray::from(q)) as ArrayRef),
        ])
        .unwrap()
    }

    #[test]
    fn fused_kernels_evaluate_edge_values_like_the_cpu_backend() {
        let Some(runtime) =
            super::super::test_device("fused_kernels_evaluate_edge_values_like_the_cpu_backend")
        else {
            return;
        };
        let table = edge_table();
        let device = upload(&runtime, &table).unwrap();
        let c = |n: &str| Arc::new(Expr::col(n));
        let bin = |op, l: &str, r: &str| Expr::Binary {
            op,
            lhs: c(l),
            rhs: c(r),
        };
        let un = |op, a: &str| Expr::Unary { op, arg: c(a) };
        use BinaryOp::*;
        let mut exprs = Vec::new();
        for (l, r) in [
            ("l", "m"),
            ("u", "v"),
            ("d", "e"),
            ("i", "b8"),
            ("i", "f"),
            ("f", "d"),
        ] {
            for op in [Add, Sub, Mul, Eq, Ne, Lt, Le, Gt, Ge] {
                exprs.push(bin(op, l, r));
            }
        }
        for op in [Div, Rem, Pow, Atan2] {
            exprs.push(bin(op, "d", "e"));
        }
        exprs.push(bin(Rem, "l", "nz"));
        exprs.push(bin(Div, "l", "nz"));
        exprs.push(bin(Eq, "p", "q"));
        exprs.push(bin(And, "p", "q"));
        exprs.push(bin(Or, "p", "q"));
        for op in crate::gpu::kernels::tests::UNARY {
            if op == UnaryOp::Not {
                continue;
            }
            exprs.push(un(op, "d"));
        }
        exprs.push(un(UnaryOp::Neg, "l"));
        exprs.push(un(UnaryOp::Abs, "l"));
        exprs.push(un(UnaryOp::IsNotNull, "u"));
        exprs.push(un(UnaryOp::Not, "p"));
        for (column, to) in [
            ("l", DataType::Float64),
            ("u", DataType::Int64),
            ("i", DataType::UInt64),
            ("d", DataType::Int64),
            ("f", DataType::Float64),
        ] {
            exprs.push(Expr::Cast { arg: c(column), to });
        }
        exprs.push(Expr::FillNull {
            arg: c("d"),
            fill: Arc::new(Expr::Literal(Literal::Float64(0.5))),
        });
        exprs.push(Expr::FillNull {
            arg: c("l"),
            fill: c("m"),
        });
        exprs.push(Expr::IfElse {
            condition: c("p"),
            then: c("d"),
            otherwise: c("e"),
        });
        exprs.push(Expr::IfElse {
            condition: c("q"),
            then: c("l"),
            otherwise: Arc::new(Expr::Literal(Literal::Int64(5))),
        });
        exprs.push(Expr::Binary {
            op: Gt,
            lhs: c("d"),
            rhs: Arc::new(Expr::Literal(Literal::Float64(1.0))),
        });
        let mut checked = 0;
        for expr in &exprs {
            let on_host = cpu::eval::evaluate(expr, &table);
            let on_device = ops::evaluate(&runtime, &device, expr);
            match (on_host, on_device) {
                (Ok(h), Ok(d)) => {
                    let d =
                        download_array(&runtime, "v", &d).unwrap_or_else(|e| panic!("{expr}: {e}"));
                    let d = RecordBatch::try_from_iter(vec![("v", d)]).unwrap();
                    let h = RecordBatch::try_from_iter(vec![("v", h)]).unwrap();
                    compare(&expr.to_string(), &d, &h, 1e-12).unwrap_or_else(|e| panic!("{e}"));
                    checked += 1;
                }
                (Err(h), Err(d)) => println!("{expr}: both refuse ({h} / {d})"),
                (Ok(_), Err(d)) => {
                    // The GPU refuses what it does not fuse; anything else is a bug.
                    let text = d.to_string();
                    assert!(
                        text.contains("does not fuse"),
                        "{expr}: the device failed: {text}"
                    );
                    println!("{expr}: not fused on the device: {text}");
                }
                (Err(h), Ok(_)) => panic!("{expr}: the CPU refused ({h}) but the device did not"),
            }
        }
        assert!(
            checked >= exprs.len() - 4,
            "only {checked} of {} checked",
            exprs.len()
        );
    }
}

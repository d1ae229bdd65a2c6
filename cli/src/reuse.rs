//! `wrk bench-reuse`: what reusing operators' output buffers saves on a repeated operator
//! (`docs/benchmarks.md`). The same fused expression is evaluated over the same table again and
//! again, each result dropped before the next (as a stage of many tasks does), with buffer
//! reuse off and on; reports the time and the minor page faults per evaluation.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use arrow::array::{ArrayRef, Float64Array};
use arrow::record_batch::RecordBatch;
use wrk_host::cpu::eval;
use wrk_host::expr::{Expr, Literal};
use wrk_host::guest_api::wit::{BinaryOp, UnaryOp};
use wrk_host::memory::buffers;

/// One mode's figures.
#[derive(Debug, Clone, Copy)]
pub struct Figures {
    pub per_evaluation: Duration,
    pub page_faults_per_evaluation: f64,
    pub reused_blocks: u64,
}

/// Minor page faults of this process so far (`/proc/self/stat`, field 10).
fn minor_faults() -> Result<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").context("reading /proc/self/stat")?;
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("an unexpected /proc/self/stat")?;
    rest.split_whitespace()
        .nth(7)
        .and_then(|v| v.parse().ok())
        .context("no minor fault count in /proc/self/stat")
}

fn binary(op: BinaryOp, lhs: Expr, rhs: Expr) -> Expr {
    Expr::Binary {
        op,
        lhs: Arc::new(lhs),
        rhs: Arc::new(rhs),
    }
}

fn column(name: &str) -> Expr {
    Expr::Column(name.into())
}

/// `sqrt(x * x + y * y) * 2.5 + z`: one fused pass, one f64 output column.
fn expression() -> Expr {
    let squares = binary(
        BinaryOp::Add,
        binary(BinaryOp::Mul, column("x"), column("x")),
        binary(BinaryOp::Mul, column("y"), column("y")),
    );
    let norm = Expr::Unary {
        op: UnaryOp::Sqrt,
        arg: Arc::new(squares),
    };
    binary(
        BinaryOp::Add,
        binary(BinaryOp::Mul, norm, Expr::Literal(Literal::Float64(2.5))),
        column("z"),
    )
}

fn table(rows: usize) -> Result<RecordBatch> {
    let column = |scale: f64| -> ArrayRef {
        Arc::new(Float64Array::from_iter_values(
            (0..rows).map(|i| (i % 1000) as f64 * scale),
        ))
    };
    Ok(RecordBatch::try_from_iter([
        ("x", column(0.5)),
        ("y", column(0.25)),
        ("z", column(2.0)),
    ])?)
}

fn measure(batch: &RecordBatch, iterations: u32, reuse: bool) -> Result<Figures> {
    let pool = buffers::global();
    pool.set_limit(if reuse { 1 << 30 } else { 0 });
    let expr = expression();
    // Warm up: the first evaluation allocates in both modes.
    drop(eval::evaluate(&expr, batch)?);
    let reused_before = pool.stats().reused;
    let faults = minor_faults()?;
    let started = Instant::now();
    for _ in 0..iterations {
        let result = eval::evaluate(&expr, batch)?;
        std::hint::black_box(&result);
    }
    let elapsed = started.elapsed();
    let faults = minor_faults()? - faults;
    Ok(Figures {
        per_evaluation: elapsed / iterations.max(1),
        page_faults_per_evaluation: faults as f64 / f64::from(iterations.max(1)),
        reused_blocks: pool.stats().reused - reused_before,
    })
}

/// Evaluates the expression `iterations` times over `rows` rows without reuse, then with it.
pub fn run(rows: usize, iterations: u32) -> Result<(Figures, Figures)> {
    let batch = table(rows)?;
    let off = measure(&batch, iterations, false)?;
    let on = measure(&batch, iterations, true)?;
    buffers::global().set_limit(0);
    Ok((off, on))
}

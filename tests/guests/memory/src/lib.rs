//! Test fixture for the worker's memory pool, by stage:
//!
//! - `keep`: returns its inputs, so the worker keeps them as partitions;
//! - `sum`: per input, the sum and count of its `value` column (one row);
//! - `combine`: the sums and counts of every `sum` output added up (one row);
//! - `hold`: leases half the pool, waits (up to `wait_ms`, default 2000) until the pool is full
//!   (another task holds the other half), then asks for a quarter more: with two such tasks
//!   at once, one must give way, since neither can get memory while the other holds its half.
//!   Returns the bytes it leased in all.
//! - `fresh`: fails unless its memory is as the component left it at instantiation (a static
//!   counter still at its initial value, a zeroed static buffer still zero), then dirties both
//!   (and a fresh heap page): an instance slot reused for the next task must be reset.

use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use wrk_sdk::prelude::*;

struct Memory;

impl Task for Memory {
    fn run(inputs: Vec<Table>) -> Result<Vec<Table>> {
        match context::stage_name().as_str() {
            "keep" => Ok(inputs),
            "sum" => inputs
                .iter()
                .map(|t| {
                    t.aggregate([
                        sum("value").alias("value_sum"),
                        count("value").alias("value_count"),
                    ])
                })
                .collect(),
            "combine" => Ok(vec![Table::concat(&inputs)?.aggregate([
                sum("value_sum").alias("value_sum"),
                sum("value_count").alias("value_count"),
            ])?]),
            "hold" => hold(),
            "fresh" => fresh(),
            other => Err(Error::msg(format!(
                "test-guest-memory has no stage `{other}`"
            ))),
        }
    }
}

fn hold() -> Result<Vec<Table>> {
    let wait = Duration::from_millis(context::param_as::<u64>("wait_ms")?.unwrap_or(2000));
    let size = memory::stats().size;
    let half = memory::lease(size / 2)?;
    let until = Instant::now() + wait;
    while memory::stats().used < size && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    let more = memory::lease(size / 4)?;
    let leased = half.bytes() + more.bytes();
    let column = Column::from_i64s("leased", &[leased as i64])?;
    Ok(vec![Table::from_columns([&column])?])
}

/// Initialised data: lives in the component's data segment.
static RUNS: AtomicU32 = AtomicU32::new(7);
/// Zero-initialised: lives past the data segment.
static SCRATCH: [AtomicU8; 8192] = [const { AtomicU8::new(0) }; 8192];

fn fresh() -> Result<Vec<Table>> {
    let runs = RUNS.fetch_add(1, Ordering::Relaxed);
    if runs != 7 {
        return Err(Error::msg(format!(
            "the counter starts at {runs}, not 7: memory left over from an earlier task"
        )));
    }
    if let Some(i) = SCRATCH.iter().position(|b| b.load(Ordering::Relaxed) != 0) {
        return Err(Error::msg(format!(
            "scratch byte {i} is not zero: memory left over from an earlier task"
        )));
    }
    for byte in &SCRATCH {
        byte.store(0xA5, Ordering::Relaxed);
    }
    std::hint::black_box(vec![0x5Au8; 1 << 16]);
    Ok(Vec::new())
}

wrk_sdk::export_task!(Memory);

//! A test guest that waits `delay_ms` (a job parameter, default 100) and returns its inputs
//! concatenated into one table: a stage slow enough for tests to kill a worker while it runs.

use std::time::{Duration, Instant};

use wrk_sdk::prelude::*;

struct Slow;

impl Task for Slow {
    fn run(inputs: Vec<Table>) -> Result<Vec<Table>> {
        let delay = context::param_as::<u64>("delay_ms")?.unwrap_or(100);
        let until = Instant::now() + Duration::from_millis(delay);
        while Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        if inputs.is_empty() {
            return Ok(inputs);
        }
        Ok(vec![Table::concat(&inputs)?])
    }
}

wrk_sdk::export_task!(Slow);

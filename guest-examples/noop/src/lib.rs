//! A task that returns its inputs unchanged: the floor of per-task overhead, used by the
//! 10,000-task benchmark.

use wrk_sdk::prelude::*;

struct Noop;

impl Task for Noop {
    fn run(inputs: Vec<Table>) -> Result<Vec<Table>> {
        Ok(inputs)
    }
}

wrk_sdk::export_task!(Noop);

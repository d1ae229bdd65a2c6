//! Test fixture: a task that panics, so the host must report a trap naming the module.

use wrk_sdk::prelude::*;

struct Trap;

impl Task for Trap {
    fn run(_inputs: Vec<Table>) -> Result<Vec<Table>> {
        panic!("deliberate failure in test guest")
    }
}

wrk_sdk::export_task!(Trap);

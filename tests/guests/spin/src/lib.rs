//! Test fixture: a task that never returns, so the host must interrupt it (fuel or epoch
//! deadline).

use core::hint::black_box;

use wrk_sdk::prelude::*;

struct Spin;

impl Task for Spin {
    fn run(_inputs: Vec<Table>) -> Result<Vec<Table>> {
        let mut turns: u64 = 0;
        loop {
            turns = black_box(turns.wrapping_add(1));
        }
    }
}

wrk_sdk::export_task!(Spin);

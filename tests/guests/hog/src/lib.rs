//! Test fixture: a task that allocates memory without bound, so the host must stop it at its
//! memory limit.

use core::hint::black_box;

use wrk_sdk::prelude::*;

/// Each allocation: 1 MiB, written with non-zero bytes so every page is touched.
const CHUNK: usize = 1 << 20;

struct Hog;

impl Task for Hog {
    fn run(_inputs: Vec<Table>) -> Result<Vec<Table>> {
        let mut hoard: Vec<Vec<u8>> = Vec::new();
        loop {
            hoard.push(black_box(vec![0xA5; CHUNK]));
            black_box(&mut hoard);
        }
    }
}

wrk_sdk::export_task!(Hog);

//! Top-k: the `k` most expensive trips (ties broken by the lower driver id).
//!
//! - `top` (one task per trips partition): the partition's top `k` by a partial sort;
//! - `merge`: the top `k` of the partials' union.
//!
//! `k` is the job parameter `k` (default 10).

use wrk_sdk::prelude::*;

struct TopFares;

impl Task for TopFares {
    fn run(inputs: Vec<Table>) -> Result<Vec<Table>> {
        let k: u64 = context::param_as("k")?.unwrap_or(10);
        let order = [desc("fare_amount"), asc("driver_id")];
        let output = match context::stage_name().as_str() {
            "top" => inputs
                .first()
                .ok_or_else(|| Error::msg("stage `top` expects the trips table"))?
                .top_k(order, k)?,
            "merge" => {
                if inputs.is_empty() {
                    return Err(Error::msg("stage `merge` received no partial tables"));
                }
                Table::concat(&inputs)?.top_k(order, k)?
            }
            other => {
                return Err(Error::msg(format!(
                    "top-fares has no stage `{other}` (its stages are `top` and `merge`)"
                )));
            }
        };
        Ok(vec![output])
    }
}

wrk_sdk::export_task!(TopFares);

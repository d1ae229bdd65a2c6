//! Shuffle group-by with a combine step: fares per driver over every trip.
//!
//! - `partial` (one task per trips partition): sums fares and counts trips per driver within
//!   the partition (the combine step: one row per driver leaves the task, not one per trip),
//!   then sends the partial sums to exchange `by-driver`, split by `driver_id`;
//! - `final` (the reducers): reducer i receives every partial of the drivers in partition i
//!   and adds them up. The job's result is every reducer's table: one row per driver.

use wrk_sdk::prelude::*;

struct ShuffleGroupBy;

impl Task for ShuffleGroupBy {
    fn run(inputs: Vec<Table>) -> Result<Vec<Table>> {
        match context::stage_name().as_str() {
            "partial" => {
                let trips = inputs
                    .into_iter()
                    .next()
                    .ok_or_else(|| Error::msg("stage `partial` expects a trips partition"))?;
                let partial = trips.group_by(["driver_id"]).agg([
                    sum("fare_amount").alias("fare_sum"),
                    count("fare_amount").alias("trips"),
                ])?;
                shuffle::send("by-driver", &partial, ["driver_id"])?;
                Ok(Vec::new())
            }
            "final" => {
                let partials = shuffle::receive("by-driver")?;
                Ok(vec![partials.group_by(["driver_id"]).agg([
                    sum("fare_sum").alias("fare_sum"),
                    sum("trips").alias("trips"),
                ])?])
            }
            other => Err(Error::msg(format!(
                "shuffle-groupby has no stage `{other}` (its stages are `partial` and `final`)"
            ))),
        }
    }
}

wrk_sdk::export_task!(ShuffleGroupBy);

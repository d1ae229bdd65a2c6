//! Shuffle group-by with a combine step: fares per driver over every trip.
//!
//! - `partial` (one task per trips partition): sums fares and counts trips per driver within
//!   the partition (the combine step: one row per driver leaves the task, not one per trip),
//!   then sends the partial sums to exchange `by-driver`, split by `driver_id`;
//! - `final` (the reducers): reducer i receives the partials of the drivers in partition i
//!   piece by piece and adds them up as they come, so only one piece and the running totals
//!   are ever in memory (a partition larger than the worker's pool still folds). The job's
//!   result is every reducer's table: one row per driver.

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
                let mut totals: Option<Table> = None;
                for piece in shuffle::receive_pieces("by-driver")? {
                    let piece = piece?;
                    let both = match totals.take() {
                        Some(totals) => Table::concat([&totals, &piece])?,
                        None => piece,
                    };
                    totals = Some(both.group_by(["driver_id"]).agg([
                        sum("fare_sum").alias("fare_sum"),
                        sum("trips").alias("trips"),
                    ])?);
                }
                Ok(vec![totals.ok_or_else(|| {
                    Error::msg("exchange `by-driver` brought no pieces to this reducer")
                })?])
            }
            other => Err(Error::msg(format!(
                "shuffle-groupby has no stage `{other}` (its stages are `partial` and `final`)"
            ))),
        }
    }
}

wrk_sdk::export_task!(ShuffleGroupBy);

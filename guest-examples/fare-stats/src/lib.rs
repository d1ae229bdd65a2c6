//! Group-by aggregate: fare statistics per passenger count and pickup zone.
//!
//! - `partial` (one task per trips partition): per `(passenger_count, pickup_zone)`, the sum,
//!   count, minimum and maximum of `fare_amount`;
//! - `merge` (one task over every partial): combines the partials and adds the mean fare, sorted
//!   by passenger count then zone.
//!
//! Every operator runs in the host; no row enters the guest.

use wrk_sdk::prelude::*;

const KEYS: [&str; 2] = ["passenger_count", "pickup_zone"];

struct FareStats;

impl Task for FareStats {
    fn run(inputs: Vec<Table>) -> Result<Vec<Table>> {
        let output = match context::stage_name().as_str() {
            "partial" => partial(&inputs)?,
            "merge" => merge(&inputs)?,
            other => {
                return Err(Error::msg(format!(
                    "fare-stats has no stage `{other}` (its stages are `partial` and `merge`)"
                )));
            }
        };
        Ok(vec![output])
    }
}

wrk_sdk::export_task!(FareStats);

fn partial(inputs: &[Table]) -> Result<Table> {
    let trips = inputs
        .first()
        .ok_or_else(|| Error::msg("stage `partial` expects the trips table as its input"))?;
    trips.group_by(KEYS).agg([
        sum("fare_amount").alias("fare_sum"),
        count("fare_amount").alias("trips"),
        min("fare_amount").alias("fare_min"),
        max("fare_amount").alias("fare_max"),
    ])
}

fn merge(partials: &[Table]) -> Result<Table> {
    if partials.is_empty() {
        return Err(Error::msg("stage `merge` received no partial tables"));
    }
    Table::concat(partials)?
        .group_by(KEYS)
        .agg([
            sum("fare_sum").alias("fare_sum"),
            sum("trips").alias("trips"),
            min("fare_min").alias("fare_min"),
            max("fare_max").alias("fare_max"),
        ])?
        .with_column(
            "fare_mean",
            col("fare_sum") / col("trips").cast(DataType::Float64),
        )?
        .sort([asc("passenger_count"), asc("pickup_zone")])
}

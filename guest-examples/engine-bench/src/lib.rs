//! The engine benchmark's queries over the taxi data, one per job file, chosen by the stage
//! names and the job parameter `query`:
//!
//! - `haversine`: the total haversine distance and trip count;
//! - `groupby`: per `passenger_count`, the fare sum and the mean haversine distance;
//! - `join`: trips joined with the drivers table on `driver_id`, fare sum and trips per `shift`;
//! - `scan`: the sum of `fare_amount` over the trips with a fare above 30.
//!
//! Stage `partial` runs once per trips partition, `merge` combines the partials, and the join
//! has a `drivers` stage that loads the drivers table every `partial` task receives (as a
//! broadcast input: one table per worker, which the host builds its join index on once).

use std::f64::consts::PI;

use wrk_sdk::prelude::*;

struct EngineBench;

impl Task for EngineBench {
    fn run(inputs: Vec<Table>) -> Result<Vec<Table>> {
        let query = context::param("query").unwrap_or_default();
        let stage = context::stage_name();
        let output = match (query.as_str(), stage.as_str()) {
            (_, "drivers") => first(&inputs)?.select(["driver_id", "shift"])?,
            ("haversine", "partial") => first(&inputs)?
                .with_column("distance_km", haversine_km())?
                .aggregate([
                    sum("distance_km").alias("distance_km"),
                    count("distance_km").alias("trips"),
                ])?,
            ("haversine", "merge") => Table::concat(&inputs)?.aggregate([
                sum("distance_km").alias("distance_km"),
                sum("trips").alias("trips"),
            ])?,
            ("groupby", "partial") => first(&inputs)?
                .with_column("distance_km", haversine_km())?
                .group_by(["passenger_count"])
                .agg([
                    sum("fare_amount").alias("fare_sum"),
                    sum("distance_km").alias("distance_sum"),
                    count("distance_km").alias("trips"),
                ])?,
            ("groupby", "merge") => Table::concat(&inputs)?
                .group_by(["passenger_count"])
                .agg([
                    sum("fare_sum").alias("fare_sum"),
                    sum("distance_sum").alias("distance_sum"),
                    sum("trips").alias("trips"),
                ])?
                .with_column(
                    "mean_distance_km",
                    col("distance_sum") / col("trips").cast(DataType::Float64),
                )?
                .select(["passenger_count", "fare_sum", "mean_distance_km"])?
                .sort([asc("passenger_count")])?,
            ("join", "partial") => {
                let [trips, drivers @ ..] = inputs.as_slice() else {
                    return Err(Error::msg("stage `partial` expects trips, then drivers"));
                };
                // One table with a broadcast input (shared by the worker's tasks, so the
                // host builds its hash index once); the drivers stage's outputs otherwise.
                let concatenated;
                let drivers = match drivers {
                    [drivers] => drivers,
                    outputs => {
                        concatenated = Table::concat(outputs)?;
                        &concatenated
                    }
                };
                trips
                    .join(drivers, ["driver_id"], JoinType::Inner)?
                    .group_by(["shift"])
                    .agg([
                        sum("fare_amount").alias("fare_sum"),
                        count("fare_amount").alias("trips"),
                    ])?
            }
            ("join", "merge") => Table::concat(&inputs)?
                .group_by(["shift"])
                .agg([
                    sum("fare_sum").alias("fare_sum"),
                    sum("trips").alias("trips"),
                ])?
                .sort([asc("shift")])?,
            ("scan", "load") => first(&inputs)?.select(["fare_amount"])?,
            ("scan", "partial") => first(&inputs)?
                .filter(col("fare_amount").gt(30.0))?
                .aggregate([sum("fare_amount").alias("fare_sum")])?,
            ("scan", "merge") => {
                Table::concat(&inputs)?.aggregate([sum("fare_sum").alias("fare_sum")])?
            }
            (query, stage) => {
                return Err(Error::msg(format!(
                    "engine-bench has no stage `{stage}` for query `{query}` (queries: haversine, \
                     groupby, join, scan)"
                )));
            }
        };
        Ok(vec![output])
    }
}

wrk_sdk::export_task!(EngineBench);

fn first(inputs: &[Table]) -> Result<&Table> {
    inputs
        .first()
        .ok_or_else(|| Error::msg("the stage received no input table"))
}

/// The column `name`, in degrees, converted to radians.
fn radians(name: &str) -> Expr {
    col(name) * (PI / 180.0)
}

/// The great-circle distance between pickup and dropoff, in kilometres.
fn haversine_km() -> Expr {
    let lat1 = radians("pickup_latitude");
    let lat2 = radians("dropoff_latitude");
    let sin_half_dlat = ((&lat2 - &lat1) / 2.0).sin();
    let sin_half_dlon = ((radians("dropoff_longitude") - radians("pickup_longitude")) / 2.0).sin();
    let a =
        &sin_half_dlat * &sin_half_dlat + lat1.cos() * lat2.cos() * &sin_half_dlon * &sin_half_dlon;
    2.0 * 6371.0 * a.sqrt().asin()
}

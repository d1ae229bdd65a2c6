//! The NYC-taxi haversine workload: great-circle trip distances per passenger count.
//!
//! One component serving two stages, chosen by the stage name:
//!
//! - `distance` (one task per input partition): computes each trip's haversine distance from
//!   its pickup and dropoff coordinates and returns, per `passenger_count`, the partial
//!   `total_km` and `trips`;
//! - `summary` (one task over all partials): merges the partials and adds `mean_km`, returning
//!   `passenger_count, trips, total_km, mean_km`.
//!
//! All the arithmetic runs in the host through the expression API; no row enters the guest.

use std::f64::consts::PI;

use wrk_sdk::prelude::*;

/// The mean Earth radius, in kilometres.
const EARTH_RADIUS_KM: f64 = 6371.0;

struct TaxiHaversine;

impl Task for TaxiHaversine {
    fn run(inputs: Vec<Table>) -> Result<Vec<Table>> {
        let stage = context::stage_name();
        let output = match stage.as_str() {
            "distance" => distance(&inputs)?,
            "summary" => summary(&inputs)?,
            other => {
                return Err(Error::msg(format!(
                    "taxi-haversine has no stage `{other}` (its stages are `distance` and \
                     `summary`)"
                )));
            }
        };
        Ok(vec![output])
    }
}

wrk_sdk::export_task!(TaxiHaversine);

/// Stage `distance`: per passenger count, the total haversine distance and number of trips of
/// one partition.
fn distance(inputs: &[Table]) -> Result<Table> {
    let trips = inputs
        .first()
        .ok_or_else(|| Error::msg("stage `distance` expects the trips table as its input"))?;
    trips
        .with_column("distance_km", haversine_km())?
        .group_by(["passenger_count"])
        .agg([
            sum("distance_km").alias("total_km"),
            count("distance_km").alias("trips"),
        ])
}

/// Stage `summary`: merges the partials of every `distance` task and adds the mean distance.
fn summary(partials: &[Table]) -> Result<Table> {
    if partials.is_empty() {
        return Err(Error::msg("stage `summary` received no partial tables"));
    }
    Table::concat(partials)?
        .group_by(["passenger_count"])
        .agg([
            sum("total_km").alias("total_km"),
            sum("trips").alias("trips"),
        ])?
        .with_column(
            "mean_km",
            col("total_km") / col("trips").cast(DataType::Float64),
        )?
        .select(["passenger_count", "trips", "total_km", "mean_km"])?
        .sort([asc("passenger_count")])
}

/// The column `name`, in degrees, converted to radians.
fn radians(name: &str) -> Expr {
    col(name) * (PI / 180.0)
}

/// The great-circle distance between pickup and dropoff, in kilometres:
/// `a = sin²(Δlat/2) + cos(lat1)·cos(lat2)·sin²(Δlon/2)`, `d = 2·R·asin(√a)`.
fn haversine_km() -> Expr {
    let lat1 = radians("pickup_latitude");
    let lat2 = radians("dropoff_latitude");
    let sin_half_dlat = ((&lat2 - &lat1) / 2.0).sin();
    let sin_half_dlon = ((radians("dropoff_longitude") - radians("pickup_longitude")) / 2.0).sin();
    let a =
        &sin_half_dlat * &sin_half_dlat + lat1.cos() * lat2.cos() * &sin_half_dlon * &sin_half_dlon;
    2.0 * EARTH_RADIUS_KM * a.sqrt().asin()
}

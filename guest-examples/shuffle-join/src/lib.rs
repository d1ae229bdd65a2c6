//! Shuffle join: two large tables joined on a key by hash-partitioning both sides to the same
//! reducers, peer to peer, instead of broadcasting one of them.
//!
//! - `trips` (one task per trips partition) and `drivers` (one task per drivers partition):
//!   mappers; each sends its table to an exchange (`trips`, `drivers`) split by `driver_id`;
//! - `join` (the reducers): reducer i receives partition i of both exchanges, joins them on
//!   `driver_id`, and sums per driver shift the trips, fares and driver ratings;
//! - `merge`: combines the reducers' partials, sorted by shift.

use wrk_sdk::prelude::*;

struct ShuffleJoin;

impl Task for ShuffleJoin {
    fn run(inputs: Vec<Table>) -> Result<Vec<Table>> {
        match context::stage_name().as_str() {
            side @ ("trips" | "drivers") => {
                let table = inputs.into_iter().next().ok_or_else(|| {
                    Error::msg(format!("stage `{side}` expects its source partition"))
                })?;
                shuffle::send(side, &table, ["driver_id"])?;
                Ok(Vec::new())
            }
            "join" => Ok(vec![join()?]),
            "merge" => Ok(vec![merge(&inputs)?]),
            other => Err(Error::msg(format!(
                "shuffle-join has no stage `{other}` (its stages are `trips`, `drivers`, `join` and `merge`)"
            ))),
        }
    }
}

wrk_sdk::export_task!(ShuffleJoin);

fn join() -> Result<Table> {
    let trips = shuffle::receive("trips")?;
    let drivers = shuffle::receive("drivers")?;
    trips
        .join_on(&drivers, ["driver_id"], ["driver_id"], JoinType::Inner)?
        .group_by(["shift"])
        .agg([
            count("fare_amount").alias("trips"),
            sum("fare_amount").alias("fare_sum"),
            sum("rating").alias("rating_sum"),
        ])
}

fn merge(partials: &[Table]) -> Result<Table> {
    if partials.is_empty() {
        return Err(Error::msg("stage `merge` received no partial tables"));
    }
    Table::concat(partials)?
        .group_by(["shift"])
        .agg([
            sum("trips").alias("trips"),
            sum("fare_sum").alias("fare_sum"),
            sum("rating_sum").alias("rating_sum"),
        ])?
        .sort([asc("shift")])
}

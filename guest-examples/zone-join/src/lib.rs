//! Broadcast join: trips joined with the small zones table in every partition, then fares
//! summed per borough.
//!
//! - `zones` (one task): reads the zones table (`zone_id`, `borough`);
//! - `join` (one task per trips partition, with the `zones` outputs as one broadcast input,
//!   fetched once per worker): inner join of the partition's trips with the zones on
//!   `pickup_zone = zone_id`, then per borough the fare sum and trip count; trips whose zone is
//!   unknown are counted apart through an anti join, under the borough `unknown`;
//! - `merge`: combines the partials, sorted by borough.

use wrk_sdk::prelude::*;

struct ZoneJoin;

impl Task for ZoneJoin {
    fn run(inputs: Vec<Table>) -> Result<Vec<Table>> {
        let output = match context::stage_name().as_str() {
            "zones" => inputs
                .into_iter()
                .next()
                .ok_or_else(|| Error::msg("stage `zones` expects the zones table"))?
                .select(["zone_id", "borough"])?,
            "join" => join(&inputs)?,
            "merge" => merge(&inputs)?,
            other => {
                return Err(Error::msg(format!(
                    "zone-join has no stage `{other}` (its stages are `zones`, `join` and `merge`)"
                )));
            }
        };
        Ok(vec![output])
    }
}

wrk_sdk::export_task!(ZoneJoin);

fn join(inputs: &[Table]) -> Result<Table> {
    let [trips, zones @ ..] = inputs else {
        return Err(Error::msg(
            "stage `join` expects trips, then the zones tables",
        ));
    };
    if zones.is_empty() {
        return Err(Error::msg("stage `join` received no zones table"));
    }
    let zones = Table::concat(zones)?;
    let known = trips
        .join_on(&zones, ["pickup_zone"], ["zone_id"], JoinType::Inner)?
        .group_by(["borough"])
        .agg([
            sum("fare_amount").alias("fare_sum"),
            count("fare_amount").alias("trips"),
        ])?;
    let unknown = trips
        .join_on(&zones, ["pickup_zone"], ["zone_id"], JoinType::Anti)?
        .with_column("borough", lit("unknown"))?
        .group_by(["borough"])
        .agg([
            sum("fare_amount").alias("fare_sum"),
            count("fare_amount").alias("trips"),
        ])?;
    Table::concat([&known, &unknown])
}

fn merge(partials: &[Table]) -> Result<Table> {
    if partials.is_empty() {
        return Err(Error::msg("stage `merge` received no partial tables"));
    }
    Table::concat(partials)?
        .group_by(["borough"])
        .agg([
            sum("fare_sum").alias("fare_sum"),
            sum("trips").alias("trips"),
        ])?
        .sort([asc("borough")])
}

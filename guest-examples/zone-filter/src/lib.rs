//! Predicate pushdown from a guest: one task reads the granted `trips` source itself, asking for
//! only the trips picked up in zones below the job parameter `below` (default 20). Row groups
//! whose statistics rule the zones out are never read; the rest are filtered in the host. The
//! task returns, per zone, the trip count and fare sum, sorted by zone.

use wrk_sdk::prelude::*;

struct ZoneFilter;

impl Task for ZoneFilter {
    fn run(_inputs: Vec<Table>) -> Result<Vec<Table>> {
        let below: i64 = context::param_as("below")?.unwrap_or(20);
        let trips = read_parquet("trips")
            .columns(["fare_amount"])
            .filter(col("pickup_zone").lt(below))
            .read()?;
        if trips.schema().iter().any(|f| f.name == "pickup_zone") {
            return Err(Error::msg("the filter column leaked into the projection"));
        }
        let zoned = read_parquet("trips")
            .columns(["pickup_zone", "fare_amount"])
            .filter(col("pickup_zone").lt(below))
            .read()?;
        if zoned.num_rows() != trips.num_rows() {
            return Err(Error::msg("the two reads disagree on the rows kept"));
        }
        Ok(vec![
            zoned
                .group_by(["pickup_zone"])
                .agg([
                    count("fare_amount").alias("trips"),
                    sum("fare_amount").alias("fare_sum"),
                ])?
                .sort([asc("pickup_zone")])?,
        ])
    }
}

wrk_sdk::export_task!(ZoneFilter);

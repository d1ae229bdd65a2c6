//! A deterministic generator of NYC-taxi-like trip data (the seed-001 workload), written as
//! Parquet files with several row groups each. The same seed and sizes give the same bytes.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use arrow::array::ArrayRef;
use arrow::array::{Float64Array, Int32Array, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone)]
pub struct TaxiConfig {
    pub rows: u64,
    pub files: u32,
    pub row_group_rows: usize,
    pub seed: u64,
    /// Trips draw `driver_id` uniformly from `0..drivers` (the key of the drivers table).
    pub drivers: u64,
}

/// The number of taxi zones (`pickup_zone` runs from 1 to this).
pub const ZONES: i64 = 263;

/// The boroughs zones belong to, zone `z` in `BOROUGHS[z % 6]`.
pub const BOROUGHS: [&str; 6] = [
    "Manhattan",
    "Brooklyn",
    "Queens",
    "Bronx",
    "Staten Island",
    "EWR",
];

pub fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("pickup_longitude", DataType::Float64, false),
        Field::new("pickup_latitude", DataType::Float64, false),
        Field::new("dropoff_longitude", DataType::Float64, false),
        Field::new("dropoff_latitude", DataType::Float64, false),
        Field::new("passenger_count", DataType::Int32, false),
        Field::new("fare_amount", DataType::Float64, false),
        Field::new("pickup_zone", DataType::Int64, false),
        Field::new("driver_id", DataType::Int64, false),
    ]))
}

/// Passenger counts weighted roughly as in the real data (mostly single riders).
const PASSENGER_WEIGHTS: [(i32, u32); 6] = [(1, 70), (2, 14), (3, 4), (4, 2), (5, 6), (6, 4)];

fn passengers(rng: &mut ChaCha8Rng) -> i32 {
    let total: u32 = PASSENGER_WEIGHTS.iter().map(|(_, w)| w).sum();
    let mut pick = rng.random_range(0..total);
    for (count, weight) in PASSENGER_WEIGHTS {
        if pick < weight {
            return count;
        }
        pick -= weight;
    }
    1
}

fn batch(rng: &mut ChaCha8Rng, rows: usize, drivers: u64) -> Result<RecordBatch> {
    let mut columns: [Vec<f64>; 5] = Default::default();
    let mut counts = Vec::with_capacity(rows);
    let mut zones = Vec::with_capacity(rows);
    let mut driver_ids = Vec::with_capacity(rows);
    for _ in 0..rows {
        // Manhattan-ish pickups, drop-offs a few kilometres away.
        let pickup_lon = -73.98 + rng.random_range(-0.06..0.06);
        let pickup_lat = 40.75 + rng.random_range(-0.08..0.08);
        let dropoff_lon = pickup_lon + rng.random_range(-0.05..0.05);
        let dropoff_lat = pickup_lat + rng.random_range(-0.05..0.05);
        let fare = 2.5 + rng.random_range(0.0..40.0f64);
        columns[0].push(pickup_lon);
        columns[1].push(pickup_lat);
        columns[2].push(dropoff_lon);
        columns[3].push(dropoff_lat);
        columns[4].push((fare * 100.0).round() / 100.0);
        counts.push(passengers(rng));
        zones.push(rng.random_range(1..=ZONES));
        driver_ids.push(rng.random_range(0..drivers.max(1)) as i64);
    }
    let [a, b, c, d, fare] = columns;
    Ok(RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(Float64Array::from(a)),
            Arc::new(Float64Array::from(b)),
            Arc::new(Float64Array::from(c)),
            Arc::new(Float64Array::from(d)),
            Arc::new(Int32Array::from(counts)),
            Arc::new(Float64Array::from(fare)),
            Arc::new(Int64Array::from(zones)),
            Arc::new(Int64Array::from(driver_ids)),
        ],
    )?)
}

/// Writes `config.rows` trips into `config.files` files `part-00000.parquet`... under `dir`.
pub fn generate(dir: &Path, config: &TaxiConfig) -> Result<()> {
    if config.files == 0 || config.row_group_rows == 0 {
        bail!("--files and --row-group-rows must be at least 1");
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create `{}`", dir.display()))?;
    let per_file = config.rows.div_ceil(u64::from(config.files));
    let mut remaining = config.rows;
    for file_index in 0..config.files {
        let rows = per_file.min(remaining);
        remaining -= rows;
        // Every file has its own stream, so files can be regenerated independently.
        let mut rng = ChaCha8Rng::seed_from_u64(config.seed ^ (u64::from(file_index) << 32));
        let path = dir.join(format!("part-{file_index:05}.parquet"));
        let partial = path.with_extension("parquet.partial");
        let file = File::create(&partial)
            .with_context(|| format!("cannot create `{}`", partial.display()))?;
        let props = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_max_row_group_row_count(Some(config.row_group_rows))
            .build();
        let mut writer = ArrowWriter::try_new(file, schema(), Some(props))?;
        let mut left = rows as usize;
        while left > 0 {
            let n = left.min(config.row_group_rows);
            writer.write(&batch(&mut rng, n, config.drivers)?)?;
            left -= n;
        }
        writer.close()?;
        std::fs::rename(&partial, &path)?;
    }
    Ok(())
}

/// Writes the dimension tables trips join with: `zones/part-00000.parquet` (`zone_id`,
/// `borough`; 263 rows) and `drivers/part-00000.parquet` (`driver_id`, `rating`, `shift`;
/// `drivers` rows) under `dir`.
pub fn generate_dimensions(dir: &Path, drivers: u64, seed: u64) -> Result<()> {
    let write = |name: &str, batch: RecordBatch, row_group_rows: usize| -> Result<()> {
        let path = dir.join(name).join("part-00000.parquet");
        std::fs::create_dir_all(dir.join(name))
            .with_context(|| format!("cannot create `{}`", dir.join(name).display()))?;
        wrk_host::io::write_file(&path, &[batch], row_group_rows)
            .with_context(|| format!("cannot write `{}`", path.display()))
    };
    let zone_ids: Vec<i64> = (1..=ZONES).collect();
    let boroughs: StringArray = zone_ids
        .iter()
        .map(|z| Some(BOROUGHS[(*z % 6) as usize]))
        .collect();
    let zones = RecordBatch::try_from_iter(vec![
        ("zone_id", Arc::new(Int64Array::from(zone_ids)) as ArrayRef),
        ("borough", Arc::new(boroughs) as ArrayRef),
    ])?;
    write("zones", zones, 1024)?;

    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xd1d1);
    let ids: Vec<i64> = (0..drivers as i64).collect();
    let ratings: Vec<f64> = ids
        .iter()
        .map(|_| (rng.random_range(30.0..50.0f64)).round() / 10.0)
        .collect();
    let shifts: StringArray = ids
        .iter()
        .map(|id| Some(if id % 3 == 0 { "night" } else { "day" }))
        .collect();
    let drivers = RecordBatch::try_from_iter(vec![
        ("driver_id", Arc::new(Int64Array::from(ids)) as ArrayRef),
        ("rating", Arc::new(Float64Array::from(ratings)) as ArrayRef),
        ("shift", Arc::new(shifts) as ArrayRef),
    ])?;
    write("drivers", drivers, 1 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_is_deterministic_and_split_into_row_groups() {
        let dir = tempfile::tempdir().unwrap();
        let config = TaxiConfig {
            rows: 2500,
            files: 2,
            row_group_rows: 500,
            seed: 7,
            drivers: 100,
        };
        generate(&dir.path().join("a"), &config).unwrap();
        generate(&dir.path().join("b"), &config).unwrap();
        for name in ["part-00000.parquet", "part-00001.parquet"] {
            let a = std::fs::read(dir.path().join("a").join(name)).unwrap();
            let b = std::fs::read(dir.path().join("b").join(name)).unwrap();
            assert_eq!(a, b, "{name} differs between runs");
        }
        let partitions =
            wrk_host::io::plan_partitions(&dir.path().join("a").to_string_lossy(), &[], 1).unwrap();
        assert_eq!(
            partitions.len(),
            6,
            "3 row groups of 500 and 3 of <=500 rows"
        );
        let rows: u64 = partitions.iter().map(|p| p.rows).sum();
        assert_eq!(rows, 2500);
    }
}

//! Hash partitioning: splitting a table into `n` tables by the stable hash of its key columns,
//! the building block of the shuffle.

use arrow::array::{ArrayRef, RecordBatch, UInt32Array};
use arrow::compute;

use super::keys::partition_hashes;
use super::ops::{OpError, column_index};

const OP: &str = "hash-partition";

/// The rows of `batch` split into `partitions` tables; row `r` goes to table
/// `hash(keys of r) % partitions`, each table keeping the input's row order.
pub fn hash_partition(
    batch: &RecordBatch,
    keys: &[String],
    partitions: u32,
) -> Result<Vec<RecordBatch>, OpError> {
    if keys.is_empty() || partitions == 0 {
        return Err(OpError::Invalid {
            operator: OP,
            detail: format!(
                "needs at least one key and one partition, got {} keys and {partitions} partitions",
                keys.len()
            ),
        });
    }
    let key_columns = keys
        .iter()
        .map(|k| column_index(batch, OP, k).map(|i| batch.column(i).clone()))
        .collect::<Result<Vec<ArrayRef>, _>>()?;
    let arrow = |source| OpError::Arrow {
        operator: OP,
        source,
    };
    let hashes = partition_hashes(&key_columns).map_err(arrow)?;
    let mut rows: Vec<Vec<u32>> = vec![Vec::new(); partitions as usize];
    for (row, hash) in hashes.iter().enumerate() {
        rows[(hash % u64::from(partitions)) as usize].push(row as u32);
    }
    rows.into_iter()
        .map(|indices| {
            compute::take_record_batch(batch, &UInt32Array::from(indices)).map_err(arrow)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, AsArray, Int64Array, StringArray};
    use arrow::datatypes::Int64Type;
    use std::collections::HashMap;
    use std::sync::Arc;

    #[test]
    fn equal_keys_land_together_and_no_row_is_lost() {
        let keys: Vec<i64> = (0..1000).map(|i| i % 37).collect();
        let batch = RecordBatch::try_from_iter(vec![
            ("k", Arc::new(Int64Array::from(keys)) as ArrayRef),
            (
                "s",
                Arc::new(StringArray::from_iter_values(
                    (0..1000).map(|i| format!("w{}", i % 5)),
                )) as ArrayRef,
            ),
        ])
        .unwrap();
        let parts = hash_partition(&batch, &["k".into(), "s".into()], 4).unwrap();
        assert_eq!(parts.len(), 4);
        assert_eq!(parts.iter().map(|p| p.num_rows()).sum::<usize>(), 1000);
        let mut home: HashMap<(i64, String), usize> = HashMap::new();
        for (p, part) in parts.iter().enumerate() {
            assert!(
                part.num_rows() > 100,
                "the hash spreads keys: {}",
                part.num_rows()
            );
            let k = part.column(0).as_primitive::<Int64Type>();
            let s = part.column(1).as_string::<i32>();
            for row in 0..part.num_rows() {
                let key = (k.value(row), s.value(row).to_string());
                assert_eq!(*home.entry(key).or_insert(p), p);
            }
        }
        let nulls = RecordBatch::try_from_iter(vec![(
            "k",
            Arc::new(Int64Array::from(vec![None, Some(1), None])) as ArrayRef,
        )])
        .unwrap();
        let parts = hash_partition(&nulls, &["k".into()], 3).unwrap();
        assert!(parts.iter().any(|p| p.column(0).null_count() == 2));
    }

    #[test]
    fn zero_partitions_is_refused() {
        let batch = RecordBatch::try_from_iter(vec![(
            "k",
            Arc::new(Int64Array::from(vec![1])) as ArrayRef,
        )])
        .unwrap();
        let err = hash_partition(&batch, &["k".into()], 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("hash-partition"), "{err}");
    }
}

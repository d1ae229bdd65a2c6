//! The shuffle pieces a worker holds for the reducers placed on it, by job, exchange, partition
//! and mapper, until the reducer that needs them has finished.
//!
//! Each mapper attempt fills one slot per partition: pieces arrive, then a completion marker. A
//! newer attempt of the same mapper replaces what an older one sent (a rerun after a lost worker
//! or a retry), and pieces from an older attempt than the slot's are refused, so a partition
//! never mixes two attempts of one mapper.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::table::Table;

/// One partition of one exchange of one job.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PartitionRef {
    pub job_id: String,
    pub exchange: String,
    pub partition: u32,
}

impl std::fmt::Display for PartitionRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "partition {} of exchange `{}` of {}",
            self.partition, self.exchange, self.job_id
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PieceError {
    #[error(
        "mapper {mapper} attempt {attempt} sent to {partition}, which already holds that mapper's attempt {held}"
    )]
    Stale {
        partition: PartitionRef,
        mapper: u32,
        attempt: u32,
        held: u32,
    },
    #[error("{partition} is incomplete: no complete piece from mapper(s) {missing} of {mappers}")]
    Incomplete {
        partition: PartitionRef,
        missing: String,
        mappers: u32,
    },
}

/// What one mapper attempt sent to one partition.
#[derive(Debug, Default)]
struct Slot {
    attempt: u32,
    tables: Vec<Table>,
    bytes: u64,
    complete: bool,
}

/// Pieces held, and their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PieceStats {
    pub partitions: u64,
    pub pieces: u64,
    pub bytes: u64,
}

#[derive(Debug, Default)]
pub struct PieceStore {
    partitions: Mutex<HashMap<PartitionRef, HashMap<u32, Slot>>>,
}

impl PieceStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// The slot of `mapper`'s `attempt` in `partition`: a newer attempt starts a fresh slot.
    fn with_slot<R>(
        &self,
        partition: &PartitionRef,
        mapper: u32,
        attempt: u32,
        f: impl FnOnce(&mut Slot) -> R,
    ) -> Result<R, PieceError> {
        let mut partitions = self
            .partitions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let slots = partitions.entry(partition.clone()).or_default();
        let slot = slots.entry(mapper).or_insert_with(|| Slot {
            attempt,
            ..Slot::default()
        });
        if attempt < slot.attempt {
            return Err(PieceError::Stale {
                partition: partition.clone(),
                mapper,
                attempt,
                held: slot.attempt,
            });
        }
        if attempt > slot.attempt {
            *slot = Slot {
                attempt,
                ..Slot::default()
            };
        }
        Ok(f(slot))
    }

    /// Adds a piece sent by `mapper`'s `attempt`.
    pub fn add(
        &self,
        partition: &PartitionRef,
        mapper: u32,
        attempt: u32,
        table: Table,
    ) -> Result<(), PieceError> {
        self.with_slot(partition, mapper, attempt, |slot| {
            slot.bytes += table.memory_bytes() as u64;
            slot.tables.push(table);
        })
    }

    /// Marks `mapper`'s `attempt` done sending to `partition`.
    pub fn complete(
        &self,
        partition: &PartitionRef,
        mapper: u32,
        attempt: u32,
    ) -> Result<(), PieceError> {
        self.with_slot(partition, mapper, attempt, |slot| slot.complete = true)
    }

    /// Whether every one of `mappers` has completed its slot of `partition`; the missing ones
    /// are named in the error.
    pub fn check(&self, partition: &PartitionRef, mappers: u32) -> Result<(), PieceError> {
        let partitions = self
            .partitions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let slots = partitions.get(partition);
        let missing: Vec<u32> = (0..mappers)
            .filter(|m| !slots.and_then(|s| s.get(m)).is_some_and(|s| s.complete))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let mut listed: Vec<String> = missing.iter().take(8).map(u32::to_string).collect();
        if missing.len() > 8 {
            listed.push(format!("and {} more", missing.len() - 8));
        }
        Err(PieceError::Incomplete {
            partition: partition.clone(),
            missing: listed.join(", "),
            mappers,
        })
    }

    /// Every piece of a complete partition, in mapper order (then in the order each mapper sent
    /// them).
    pub fn pieces(&self, partition: &PartitionRef, mappers: u32) -> Result<Vec<Table>, PieceError> {
        self.check(partition, mappers)?;
        let partitions = self
            .partitions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(slots) = partitions.get(partition) else {
            return Ok(Vec::new());
        };
        Ok((0..mappers)
            .filter_map(|m| slots.get(&m))
            .flat_map(|slot| slot.tables.iter().cloned())
            .collect())
    }

    /// Drops a partition (its reducer finished); returns the pieces dropped.
    pub fn release_partition(&self, partition: &PartitionRef) -> usize {
        let mut partitions = self
            .partitions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        partitions
            .remove(partition)
            .map_or(0, |slots| slots.values().map(|s| s.tables.len()).sum())
    }

    /// Drops every piece of a job; returns how many partitions it had here.
    pub fn release_job(&self, job_id: &str) -> usize {
        let mut partitions = self
            .partitions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let before = partitions.len();
        partitions.retain(|p, _| p.job_id != job_id);
        before - partitions.len()
    }

    pub fn stats(&self) -> PieceStats {
        let partitions = self
            .partitions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut stats = PieceStats {
            partitions: partitions.len() as u64,
            ..PieceStats::default()
        };
        for slot in partitions.values().flat_map(HashMap::values) {
            stats.pieces += slot.tables.len() as u64;
            stats.bytes += slot.bytes;
        }
        stats
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::record_batch::RecordBatch;
    use std::sync::Arc;

    fn table(values: &[i64]) -> Table {
        Table::new(
            RecordBatch::try_from_iter([("x", Arc::new(Int64Array::from(values.to_vec())) as _)])
                .unwrap(),
        )
    }

    /// The first (int64) column of `tables`, one after the other.
    pub(in crate::shuffle) fn values(tables: &[Table]) -> Vec<i64> {
        tables
            .iter()
            .flat_map(|t| {
                t.batch()
                    .column(0)
                    .as_any()
                    .downcast_ref::<Int64Array>()
                    .unwrap()
                    .values()
                    .to_vec()
            })
            .collect()
    }

    fn part(partition: u32) -> PartitionRef {
        PartitionRef {
            job_id: "job-000001".into(),
            exchange: "by-key".into(),
            partition,
        }
    }

    #[test]
    fn a_partition_is_complete_when_every_mapper_completed_it() {
        let store = PieceStore::new();
        store.add(&part(0), 1, 1, table(&[3, 4])).unwrap();
        store.add(&part(0), 0, 1, table(&[1])).unwrap();
        store.add(&part(0), 0, 1, table(&[2])).unwrap();
        store.complete(&part(0), 0, 1).unwrap();
        let err = store.pieces(&part(0), 3).unwrap_err().to_string();
        assert_eq!(
            err,
            "partition 0 of exchange `by-key` of job-000001 is incomplete: no complete piece from mapper(s) 1, 2 of 3"
        );
        store.complete(&part(0), 1, 1).unwrap();
        // A mapper that had nothing for this partition still completes it.
        store.complete(&part(0), 2, 1).unwrap();
        assert_eq!(values(&store.pieces(&part(0), 3).unwrap()), [1, 2, 3, 4]);
        assert_eq!(
            store.stats(),
            PieceStats {
                partitions: 1,
                pieces: 3,
                bytes: store.stats().bytes
            }
        );
        assert_eq!(store.release_partition(&part(0)), 3);
        assert!(store.pieces(&part(0), 3).is_err());
    }

    #[test]
    fn a_newer_attempt_replaces_an_older_one_and_stale_pieces_are_refused() {
        let store = PieceStore::new();
        store.add(&part(1), 0, 1, table(&[9, 9])).unwrap();
        store.add(&part(1), 0, 2, table(&[1])).unwrap();
        store.complete(&part(1), 0, 2).unwrap();
        let stale = store.add(&part(1), 0, 1, table(&[7])).unwrap_err();
        assert!(
            matches!(stale, PieceError::Stale { held: 2, .. }),
            "{stale}"
        );
        assert!(store.complete(&part(1), 0, 1).is_err());
        assert_eq!(values(&store.pieces(&part(1), 1).unwrap()), [1]);
    }

    #[test]
    fn releasing_a_job_keeps_other_jobs() {
        let store = PieceStore::new();
        store.add(&part(0), 0, 1, table(&[1])).unwrap();
        let other = PartitionRef {
            job_id: "job-000002".into(),
            ..part(0)
        };
        store.add(&other, 0, 1, table(&[2])).unwrap();
        assert_eq!(store.release_job("job-000001"), 1);
        assert_eq!(store.stats().partitions, 1);
    }
}

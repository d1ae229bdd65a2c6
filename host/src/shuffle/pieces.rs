//! The shuffle pieces a worker holds for the reducers placed on it, by job, exchange, partition
//! and mapper, until the reducer that needs them has finished.
//!
//! Each mapper attempt fills one slot per partition: pieces arrive, then a completion marker. A
//! newer attempt of the same mapper replaces what an older one sent (a rerun after a lost worker
//! or a retry), and pieces from an older attempt than the slot's are refused, so a partition
//! never mixes two attempts of one mapper.
//!
//! The pieces' data lives in the worker's [`PartitionStore`], like task outputs: counted in the
//! memory pool, spilled to disk under pressure and read back when the reducer asks for them.
//! This module keeps only which pieces make up which slot.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::store::{PartitionStore, PoolError, TaskMemory};
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

/// One piece: the `seq`-th table `mapper`'s `attempt` sent to `partition`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PieceId {
    pub partition: PartitionRef,
    pub mapper: u32,
    pub attempt: u32,
    pub seq: u32,
}

impl std::fmt::Display for PieceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "piece {} of mapper {} (attempt {}) for {}",
            self.seq, self.mapper, self.attempt, self.partition
        )
    }
}

#[derive(Debug, thiserror::Error)]
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
    #[error("{0} was released while its reducer read it")]
    Released(PieceId),
    #[error(transparent)]
    Pool(#[from] PoolError),
}

impl PieceError {
    /// Whether another attempt of the reducer may succeed (pieces a rerun resends, memory that
    /// other tasks give back), as opposed to a mapper's stale attempt.
    pub fn is_retriable(&self) -> bool {
        match self {
            PieceError::Stale { .. } => false,
            PieceError::Incomplete { .. } | PieceError::Released(_) => true,
            PieceError::Pool(e) => e.retriable(),
        }
    }
}

/// What one mapper attempt sent to one partition: the number of pieces (their ids follow) and
/// their bytes when they arrived.
#[derive(Debug, Default)]
struct Slot {
    attempt: u32,
    pieces: u32,
    bytes: u64,
    complete: bool,
}

impl Slot {
    fn ids(&self, partition: &PartitionRef, mapper: u32) -> impl Iterator<Item = PieceId> {
        let (partition, attempt) = (partition.clone(), self.attempt);
        (0..self.pieces).map(move |seq| PieceId {
            partition: partition.clone(),
            mapper,
            attempt,
            seq,
        })
    }
}

/// Pieces held, and their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PieceStats {
    pub partitions: u64,
    pub pieces: u64,
    pub bytes: u64,
}

type Slots = HashMap<PartitionRef, HashMap<u32, Slot>>;

#[derive(Debug)]
pub struct PieceStore {
    /// Where the pieces' tables are kept.
    store: Arc<PartitionStore>,
    partitions: Mutex<Slots>,
}

impl PieceStore {
    pub fn new(store: Arc<PartitionStore>) -> Self {
        PieceStore {
            store,
            partitions: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Slots> {
        // Every update is one step: a panic while holding the lock leaves consistent data.
        self.partitions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The slot of `mapper`'s `attempt` in `partition`: a newer attempt starts a fresh slot and
    /// drops the older attempt's pieces.
    fn with_slot<R>(
        &self,
        partition: &PartitionRef,
        mapper: u32,
        attempt: u32,
        f: impl FnOnce(&mut Slot) -> R,
    ) -> Result<R, PieceError> {
        let mut partitions = self.lock();
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
            let replaced: Vec<PieceId> = slot.ids(partition, mapper).collect();
            self.store.release_pieces(&replaced);
            *slot = Slot {
                attempt,
                ..Slot::default()
            };
        }
        Ok(f(slot))
    }

    /// Adds a piece sent by `mapper`'s `attempt`; it goes into the pool (which may spill to
    /// make room).
    pub fn add(
        &self,
        partition: &PartitionRef,
        mapper: u32,
        attempt: u32,
        table: Table,
    ) -> Result<(), PieceError> {
        // Stored under the lock, so a release of the partition cannot miss it.
        self.with_slot(partition, mapper, attempt, |slot| {
            let id = PieceId {
                partition: partition.clone(),
                mapper,
                attempt,
                seq: slot.pieces,
            };
            slot.pieces += 1;
            slot.bytes += table.memory_bytes() as u64;
            self.store.insert_piece(id, table);
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
        self.complete_ids(&self.lock(), partition, mappers)
            .map(|_| ())
    }

    /// The ids of a complete partition's pieces, in mapper order (then in the order each mapper
    /// sent them).
    fn complete_ids(
        &self,
        partitions: &Slots,
        partition: &PartitionRef,
        mappers: u32,
    ) -> Result<Vec<PieceId>, PieceError> {
        let slots = partitions.get(partition);
        let missing: Vec<u32> = (0..mappers)
            .filter(|m| !slots.and_then(|s| s.get(m)).is_some_and(|s| s.complete))
            .collect();
        if !missing.is_empty() {
            let mut listed: Vec<String> = missing.iter().take(8).map(u32::to_string).collect();
            if missing.len() > 8 {
                listed.push(format!("and {} more", missing.len() - 8));
            }
            return Err(PieceError::Incomplete {
                partition: partition.clone(),
                missing: listed.join(", "),
                mappers,
            });
        }
        Ok(slots
            .into_iter()
            .flat_map(|slots| (0..mappers).filter_map(|m| slots.get(&m).map(|s| (m, s))))
            .flat_map(|(m, slot)| slot.ids(partition, m))
            .collect())
    }

    /// The ids of a complete partition's pieces, in mapper order (then in the order each mapper
    /// sent them), to take one by one with [`PieceStore::take`].
    pub fn piece_ids(
        &self,
        partition: &PartitionRef,
        mappers: u32,
    ) -> Result<Vec<PieceId>, PieceError> {
        self.complete_ids(&self.lock(), partition, mappers)
    }

    /// One piece, read back from disk if it spilled; `task`'s working set takes it on.
    pub fn take(&self, id: &PieceId, task: Option<&TaskMemory>) -> Result<Table, PieceError> {
        self.store
            .get_piece(id, task)?
            .ok_or_else(|| PieceError::Released(id.clone()))
    }

    /// Every piece of a complete partition, in mapper order (then in the order each mapper sent
    /// them), read back from disk where they spilled; `task`'s working set takes them on.
    pub fn pieces(
        &self,
        partition: &PartitionRef,
        mappers: u32,
        task: Option<&TaskMemory>,
    ) -> Result<Vec<Table>, PieceError> {
        let ids = self.piece_ids(partition, mappers)?;
        ids.iter().map(|id| self.take(id, task)).collect()
    }

    /// Drops a partition (its reducer finished); returns the pieces dropped.
    pub fn release_partition(&self, partition: &PartitionRef) -> usize {
        let Some(slots) = self.lock().remove(partition) else {
            return 0;
        };
        let ids: Vec<PieceId> = slots
            .iter()
            .flat_map(|(&mapper, slot)| slot.ids(partition, mapper))
            .collect();
        self.store.release_pieces(&ids)
    }

    /// Drops every piece of a job; returns how many partitions it had here.
    pub fn release_job(&self, job_id: &str) -> usize {
        let mut ids = Vec::new();
        let mut count = 0;
        self.lock().retain(|partition, slots| {
            if partition.job_id != job_id {
                return true;
            }
            count += 1;
            ids.extend(
                slots
                    .iter()
                    .flat_map(|(&mapper, slot)| slot.ids(partition, mapper)),
            );
            false
        });
        self.store.release_pieces(&ids);
        count
    }

    pub fn stats(&self) -> PieceStats {
        let partitions = self.lock();
        let mut stats = PieceStats {
            partitions: partitions.len() as u64,
            ..PieceStats::default()
        };
        for slot in partitions.values().flat_map(HashMap::values) {
            stats.pieces += u64::from(slot.pieces);
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

    use crate::memory::spill::SpillDir;

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

    /// A piece store over a partition store of `pool` bytes spilling into a fresh directory.
    pub(in crate::shuffle) fn piece_store(pool: u64) -> (PieceStore, tempfile::TempDir) {
        let root = tempfile::tempdir().unwrap();
        let spill = SpillDir::open(root.path(), "test").unwrap();
        let store = Arc::new(PartitionStore::new(pool, spill));
        (PieceStore::new(store), root)
    }

    /// Partition `partition` of exchange `by-key` of job-000001.
    pub(in crate::shuffle) fn part(partition: u32) -> PartitionRef {
        PartitionRef {
            job_id: "job-000001".into(),
            exchange: "by-key".into(),
            partition,
        }
    }

    #[test]
    fn a_partition_is_complete_when_every_mapper_completed_it() {
        let (store, _dir) = piece_store(1 << 30);
        store.add(&part(0), 1, 1, table(&[3, 4])).unwrap();
        store.add(&part(0), 0, 1, table(&[1])).unwrap();
        store.add(&part(0), 0, 1, table(&[2])).unwrap();
        store.complete(&part(0), 0, 1).unwrap();
        let err = store.pieces(&part(0), 3, None).unwrap_err().to_string();
        assert_eq!(
            err,
            "partition 0 of exchange `by-key` of job-000001 is incomplete: no complete piece from mapper(s) 1, 2 of 3"
        );
        store.complete(&part(0), 1, 1).unwrap();
        // A mapper that had nothing for this partition still completes it.
        store.complete(&part(0), 2, 1).unwrap();
        assert_eq!(
            values(&store.pieces(&part(0), 3, None).unwrap()),
            [1, 2, 3, 4]
        );
        assert_eq!(
            store.stats(),
            PieceStats {
                partitions: 1,
                pieces: 3,
                bytes: store.stats().bytes
            }
        );
        assert_eq!(
            store.store.stats().pieces,
            3,
            "the data is in the partition store"
        );
        assert_eq!(store.release_partition(&part(0)), 3);
        assert!(store.pieces(&part(0), 3, None).is_err());
        assert_eq!(store.store.stats().pieces, 0);
    }

    #[test]
    fn a_newer_attempt_replaces_an_older_one_and_stale_pieces_are_refused() {
        let (store, _dir) = piece_store(1 << 30);
        store.add(&part(1), 0, 1, table(&[9, 9])).unwrap();
        store.add(&part(1), 0, 2, table(&[1])).unwrap();
        store.complete(&part(1), 0, 2).unwrap();
        let stale = store.add(&part(1), 0, 1, table(&[7])).unwrap_err();
        assert!(
            matches!(stale, PieceError::Stale { held: 2, .. }),
            "{stale}"
        );
        assert!(store.complete(&part(1), 0, 1).is_err());
        assert_eq!(values(&store.pieces(&part(1), 1, None).unwrap()), [1]);
        assert_eq!(
            store.store.stats().pieces,
            1,
            "attempt 1's piece left the store"
        );
    }

    #[test]
    fn a_piece_released_while_its_reducer_streams_the_partition_is_named() {
        let (store, _dir) = piece_store(1 << 30);
        store.add(&part(3), 0, 1, table(&[1])).unwrap();
        store.add(&part(3), 0, 1, table(&[2])).unwrap();
        store.complete(&part(3), 0, 1).unwrap();
        let ids = store.piece_ids(&part(3), 1).unwrap();
        assert_eq!(values(&[store.take(&ids[0], None).unwrap()]), [1]);
        store.release_partition(&part(3));
        let err = store.take(&ids[1], None).unwrap_err();
        assert!(err.is_retriable(), "{err}");
        assert_eq!(
            err.to_string(),
            "piece 1 of mapper 0 (attempt 1) for partition 3 of exchange `by-key` of job-000001 was released while its reducer read it"
        );
    }

    #[test]
    fn releasing_a_job_keeps_other_jobs() {
        let (store, _dir) = piece_store(1 << 30);
        store.add(&part(0), 0, 1, table(&[1])).unwrap();
        let other = PartitionRef {
            job_id: "job-000002".into(),
            ..part(0)
        };
        store.add(&other, 0, 1, table(&[2])).unwrap();
        assert_eq!(store.release_job("job-000001"), 1);
        assert_eq!(store.stats().partitions, 1);
        assert_eq!(store.store.stats().pieces, 1);
    }

    #[test]
    fn pieces_beyond_the_pool_spill_and_come_back_intact_for_their_reducers() {
        // Five partitions of two 80 KB pieces each (800 KB) arrive in a pool of 300 KB: most
        // pieces must go to disk as they arrive.
        let (store, _dir) = piece_store(300_000);
        let piece = |partition: u32, mapper: u32| -> Vec<i64> {
            let start = i64::from(partition * 2 + mapper) * 10_000;
            (start..start + 10_000).collect()
        };
        for partition in 0..5 {
            for mapper in 0..2 {
                store
                    .add(
                        &part(partition),
                        mapper,
                        1,
                        table(&piece(partition, mapper)),
                    )
                    .unwrap();
                store.complete(&part(partition), mapper, 1).unwrap();
            }
        }
        let stats = store.store.stats();
        assert_eq!(stats.pieces, 10);
        assert!(stats.spilled_partitions >= 7, "{stats:?}");
        assert!(stats.pool.used <= 300_000, "{stats:?}");
        // Each reducer in turn gets its partition back intact, read from disk as needed.
        for partition in 0..5 {
            let task = store.store.begin_task(format!("reducer {partition}"));
            let tables = store.pieces(&part(partition), 2, Some(&task)).unwrap();
            let expected: Vec<i64> = [piece(partition, 0), piece(partition, 1)].concat();
            assert_eq!(values(&tables), expected, "partition {partition}");
            drop((tables, task));
            assert_eq!(store.release_partition(&part(partition)), 2);
        }
        let stats = store.store.stats();
        assert!(stats.pool.unspills >= 7, "{stats:?}");
        assert_eq!((stats.pieces, stats.spilled_partitions), (0, 0));
        // A partition larger than the whole pool can never be received at once: the reducer
        // is told so, and it is not worth retrying.
        for mapper in 0..5 {
            store
                .add(&part(9), mapper, 1, table(&piece(9, mapper)))
                .unwrap();
            store.complete(&part(9), mapper, 1).unwrap();
        }
        let task = store.store.begin_task("reducer 9");
        let err = store.pieces(&part(9), 5, Some(&task)).unwrap_err();
        assert!(matches!(err, PieceError::Pool(_)), "{err}");
        assert!(!err.is_retriable(), "{err}");
        assert!(err.to_string().contains("can never fit"), "{err}");
    }
}

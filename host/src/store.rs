//! The worker's partitions: task outputs kept in memory, keyed by job, stage, task and output,
//! until the scheduler releases their job.

use std::collections::HashMap;
use std::sync::RwLock;

use crate::table::Table;

/// Identity of one stored output table.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartitionId {
    pub job_id: String,
    pub stage: u32,
    pub task: u32,
    pub output: u32,
}

impl From<&wrk_proto::PartitionKey> for PartitionId {
    fn from(key: &wrk_proto::PartitionKey) -> Self {
        PartitionId {
            job_id: key.job_id.clone(),
            stage: key.stage,
            task: key.task,
            output: key.output,
        }
    }
}

/// Counts for heartbeats and status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub partitions: u64,
    pub bytes: u64,
}

#[derive(Debug, Default)]
pub struct PartitionStore {
    partitions: RwLock<HashMap<PartitionId, Table>>,
}

impl PartitionStore {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&self, id: PartitionId, table: Table) {
        if let Ok(mut map) = self.partitions.write() {
            map.insert(id, table);
        }
    }

    pub fn get(&self, id: &PartitionId) -> Option<Table> {
        self.partitions.read().ok()?.get(id).cloned()
    }

    /// Drops every partition of a job; returns how many there were.
    pub fn release_job(&self, job_id: &str) -> usize {
        let Ok(mut map) = self.partitions.write() else {
            return 0;
        };
        let before = map.len();
        map.retain(|id, _| id.job_id != job_id);
        before - map.len()
    }

    /// Drops every output of one task; returns how many there were.
    pub fn release_task(&self, job_id: &str, stage: u32, task: u32) -> usize {
        let Ok(mut map) = self.partitions.write() else {
            return 0;
        };
        let before = map.len();
        map.retain(|id, _| !(id.job_id == job_id && id.stage == stage && id.task == task));
        before - map.len()
    }

    pub fn stats(&self) -> StoreStats {
        let Ok(map) = self.partitions.read() else {
            return StoreStats::default();
        };
        StoreStats {
            partitions: map.len() as u64,
            bytes: map.values().map(|t| t.memory_bytes() as u64).sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::record_batch::RecordBatch;
    use std::sync::Arc;

    fn id(job: &str, task: u32) -> PartitionId {
        PartitionId {
            job_id: job.into(),
            stage: 0,
            task,
            output: 0,
        }
    }

    #[test]
    fn release_drops_only_that_job() {
        let store = PartitionStore::new();
        let batch =
            RecordBatch::try_from_iter([("x", Arc::new(Int64Array::from(vec![1, 2, 3])) as _)])
                .unwrap();
        store.insert(id("a", 0), Table::new(batch.clone()));
        store.insert(id("a", 1), Table::new(batch.clone()));
        store.insert(id("b", 0), Table::new(batch));
        assert_eq!(store.stats().partitions, 3);
        assert!(store.stats().bytes >= 3 * 24);
        assert_eq!(store.release_task("a", 0, 1), 1);
        assert!(
            store.get(&id("a", 0)).is_some(),
            "only task 1's outputs went"
        );
        assert_eq!(store.release_job("a"), 1);
        assert!(store.get(&id("a", 0)).is_none());
        assert!(store.get(&id("b", 0)).is_some());
    }
}

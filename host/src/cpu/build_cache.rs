//! A worker's cache of join hash indexes built on shared tables (broadcast inputs), so that the
//! index of a table every task of the worker joins with is built once and probed by all.
//!
//! An entry is keyed by the identity of the build table's key columns (their `Arc`s, held by
//! `Weak` so that an address cannot be reused while the entry exists) and the types the keys
//! were encoded as. Entries whose columns have been dropped never hit and are removed at the
//! next lookup. The cache is bounded in bytes (least recently used entries go first), its
//! indexes are claimed by its own account of the worker's pool, and the store releases every
//! entry under pool pressure, before it spills partitions (`docs/memory.md`).
//!
//! Two tasks missing the same entry at once both build it; the second to finish uses the
//! first one's index.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use arrow::array::{Array, ArrayRef};
use arrow::datatypes::DataType;

use super::hash_index::HashIndex;
use crate::memory::Account;

/// What the cache holds and has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BuildCacheStats {
    /// Lookups answered by a cached index.
    pub hits: u64,
    /// Indexes built because none was cached.
    pub builds: u64,
    /// Indexes held now, and their bytes.
    pub entries: u64,
    pub bytes: u64,
}

/// The cache; see the module docs.
pub struct BuildCache {
    account: Arc<Account>,
    budget: u64,
    state: Mutex<State>,
    hits: AtomicU64,
    builds: AtomicU64,
}

impl std::fmt::Debug for BuildCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BuildCache")
            .field("budget", &self.budget)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct State {
    entries: Vec<Entry>,
    /// Logical clock for least-recently-used order.
    clock: u64,
}

struct Entry {
    columns: Vec<Weak<dyn Array>>,
    types: Vec<DataType>,
    index: Arc<HashIndex>,
    bytes: u64,
    last_used: u64,
}

impl Entry {
    fn alive(&self) -> bool {
        self.columns.iter().all(|c| c.strong_count() > 0)
    }

    fn is_for(&self, columns: &[ArrayRef], types: &[DataType]) -> bool {
        self.types == types
            && self.columns.len() == columns.len()
            && self
                .columns
                .iter()
                .zip(columns)
                .all(|(cached, column)| std::ptr::addr_eq(cached.as_ptr(), Arc::as_ptr(column)))
    }
}

impl BuildCache {
    /// A cache of at most `budget` bytes whose indexes `account` claims.
    pub fn new(account: Arc<Account>, budget: u64) -> Self {
        BuildCache {
            account,
            budget,
            state: Mutex::default(),
            hits: AtomicU64::new(0),
            builds: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update is one step: a panic elsewhere leaves consistent data.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The index of the build table whose key columns are `columns`, encoded as `types`: the
    /// cached one, or the one `build` makes, cached when it fits the budget.
    pub(crate) fn get_or_build<E>(
        &self,
        columns: &[ArrayRef],
        types: &[DataType],
        build: impl FnOnce() -> Result<HashIndex, E>,
    ) -> Result<Arc<HashIndex>, E> {
        if let Some(index) = self.lookup(columns, types) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(index);
        }
        let index = Arc::new(build()?);
        self.builds.fetch_add(1, Ordering::Relaxed);
        let bytes = index.memory_bytes() as u64;
        if bytes > self.budget {
            tracing::debug!(bytes, budget = self.budget, "join index too large to cache");
            return Ok(index);
        }
        let mut state = self.lock();
        // Another task may have cached the same index meanwhile.
        if let Some(entry) = state.entries.iter().find(|e| e.is_for(columns, types)) {
            return Ok(entry.index.clone());
        }
        let mut held: u64 = state.entries.iter().map(|e| e.bytes).sum();
        while held + bytes > self.budget {
            let Some(oldest) = (0..state.entries.len()).min_by_key(|&i| state.entries[i].last_used)
            else {
                break;
            };
            held -= state.entries.swap_remove(oldest).bytes;
        }
        index.claim(&self.account);
        state.clock += 1;
        let last_used = state.clock;
        state.entries.push(Entry {
            columns: columns.iter().map(Arc::downgrade).collect(),
            types: types.to_vec(),
            index: index.clone(),
            bytes,
            last_used,
        });
        tracing::debug!(bytes, entries = state.entries.len(), "cached a join index");
        Ok(index)
    }

    fn lookup(&self, columns: &[ArrayRef], types: &[DataType]) -> Option<Arc<HashIndex>> {
        let mut state = self.lock();
        state.entries.retain(Entry::alive);
        state.clock += 1;
        let clock = state.clock;
        let entry = state
            .entries
            .iter_mut()
            .find(|e| e.is_for(columns, types))?;
        entry.last_used = clock;
        Some(entry.index.clone())
    }

    /// Drops the entries whose build table is gone; returns the bytes they held.
    pub fn purge_dropped(&self) -> u64 {
        let mut state = self.lock();
        let before: u64 = state.entries.iter().map(|e| e.bytes).sum();
        state.entries.retain(Entry::alive);
        before - state.entries.iter().map(|e| e.bytes).sum::<u64>()
    }

    /// Drops every entry (joins running with one keep it until they end); returns the bytes
    /// the entries held.
    pub fn release(&self) -> u64 {
        let entries = std::mem::take(&mut self.lock().entries);
        entries.iter().map(|e| e.bytes).sum()
    }

    pub fn stats(&self) -> BuildCacheStats {
        let state = self.lock();
        BuildCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            builds: self.builds.load(Ordering::Relaxed),
            entries: state.entries.len() as u64,
            bytes: state.entries.iter().map(|e| e.bytes).sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::join::{Build, JoinType, Side, join, join_with};
    use crate::memory::SpillDir;
    use crate::store::{PartitionId, PartitionStore};
    use crate::table::Table;
    use arrow::array::{Float64Array, Int64Array, RecordBatch, StringArray};

    fn store(pool: u64) -> (Arc<PartitionStore>, tempfile::TempDir) {
        let root = tempfile::tempdir().unwrap();
        let spill = SpillDir::open(root.path(), "test").unwrap();
        (Arc::new(PartitionStore::new(pool, spill)), root)
    }

    /// A dimension table of `rows` drivers: `id` (unique, spread wide so the index hashes),
    /// `zone` (repeated) and `shift`.
    fn drivers(rows: i64) -> RecordBatch {
        RecordBatch::try_from_iter(vec![
            (
                "id",
                Arc::new(Int64Array::from_iter_values(
                    (0..rows).map(|i| i * 1_000_003),
                )) as ArrayRef,
            ),
            (
                "zone",
                Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i % 7))) as ArrayRef,
            ),
            (
                "shift",
                Arc::new(StringArray::from_iter_values(
                    (0..rows).map(|i| if i % 3 == 0 { "night" } else { "day" }),
                )) as ArrayRef,
            ),
        ])
        .unwrap()
    }

    /// `rows` trips of drivers `0..drivers` (and some of no driver).
    fn trips(rows: i64, drivers: i64) -> RecordBatch {
        RecordBatch::try_from_iter(vec![
            (
                "driver",
                Arc::new(Int64Array::from_iter_values(
                    (0..rows).map(|i| (i * 7 % (drivers + 3)) * 1_000_003),
                )) as ArrayRef,
            ),
            (
                "fare",
                Arc::new(Float64Array::from_iter_values((0..rows).map(|i| i as f64))) as ArrayRef,
            ),
        ])
        .unwrap()
    }

    /// The rows of `batch` in the order of its columns' values.
    fn sorted(batch: &RecordBatch) -> RecordBatch {
        let columns: Vec<arrow::compute::SortColumn> = batch
            .columns()
            .iter()
            .map(|c| arrow::compute::SortColumn {
                values: c.clone(),
                options: None,
            })
            .collect();
        let order = arrow::compute::lexsort_to_indices(&columns, None).unwrap();
        arrow::compute::take_record_batch(batch, &order).unwrap()
    }

    fn on(name: &str) -> Vec<String> {
        vec![name.to_string()]
    }

    fn shared<'a>(cache: &'a BuildCache) -> Build<'a> {
        Build::Shared {
            side: Side::Right,
            cache,
        }
    }

    #[test]
    fn a_second_join_with_the_same_table_reuses_its_index() {
        let (store, _dir) = store(1 << 30);
        let cache = store.build_cache();
        // The dimension is the larger side: a shared table is built on all the same.
        let (dimension, facts) = (drivers(1000), trips(300, 1000));
        for how in [
            JoinType::Inner,
            JoinType::Left,
            JoinType::Semi,
            JoinType::Anti,
        ] {
            let run = || {
                join_with(
                    &facts,
                    &dimension,
                    &on("driver"),
                    &on("id"),
                    how,
                    shared(cache),
                )
                .unwrap()
            };
            let (first, second) = (run(), run());
            assert_eq!(first, second, "{how:?}: a cached index gives the same rows");
            // Built on the smaller (left) side, the same rows come in another order.
            let smaller = join(&facts, &dimension, &on("driver"), &on("id"), how).unwrap();
            assert_eq!(sorted(&first), sorted(&smaller), "{how:?}");
        }
        let stats = cache.stats();
        assert_eq!((stats.builds, stats.hits, stats.entries), (1, 7, 1));
        assert!(stats.bytes > 0);
        // Another table sharing the same key column (a projection) hits too.
        let projected = dimension.project(&[2, 0]).unwrap();
        join_with(
            &facts,
            &projected,
            &on("driver"),
            &on("id"),
            JoinType::Inner,
            shared(cache),
        )
        .unwrap();
        assert_eq!(cache.stats().hits, 8);
    }

    #[test]
    fn another_key_or_a_dropped_table_does_not_hit() {
        let (store, _dir) = store(1 << 30);
        let cache = store.build_cache();
        let facts = trips(500, 100);
        let dimension = drivers(100);
        let by_zone = |dimension: &RecordBatch| {
            let zones = facts.project(&[0, 1]).unwrap();
            join_with(
                &zones,
                dimension,
                &on("fare"),
                &on("zone"),
                JoinType::Semi,
                shared(cache),
            )
        };
        join_with(
            &facts,
            &dimension,
            &on("driver"),
            &on("id"),
            JoinType::Inner,
            shared(cache),
        )
        .unwrap();
        // Another key column of the same table, and the same column as another key type.
        by_zone(&dimension).unwrap();
        assert_eq!((cache.stats().builds, cache.stats().hits), (2, 0));
        let as_floats = RecordBatch::try_from_iter(vec![(
            "driver",
            arrow::compute::cast(facts.column(0), &DataType::Float64).unwrap(),
        )])
        .unwrap();
        join_with(
            &as_floats,
            &dimension,
            &on("driver"),
            &on("id"),
            JoinType::Semi,
            shared(cache),
        )
        .unwrap();
        assert_eq!((cache.stats().builds, cache.stats().entries), (3, 3));
        // A new table with equal contents is another table; the dropped one's entries go.
        drop(dimension);
        let again = drivers(100);
        let out = join_with(
            &facts,
            &again,
            &on("driver"),
            &on("id"),
            JoinType::Inner,
            shared(cache),
        )
        .unwrap();
        let stats = cache.stats();
        assert_eq!((stats.builds, stats.hits, stats.entries), (4, 0, 1));
        assert_eq!(
            out,
            join(&facts, &again, &on("driver"), &on("id"), JoinType::Inner).unwrap()
        );
        drop(again);
        assert!(cache.purge_dropped() > 0);
        assert_eq!(cache.stats().entries, 0);
    }

    #[test]
    fn cached_indexes_count_in_the_pool_and_go_under_pressure() {
        let pool = 4 << 20;
        let (store, _dir) = store(pool);
        let cache = store.build_cache();
        let dimension = drivers(20_000);
        let claimed_before = store.stats().pool.used;
        join_with(
            &trips(100, 20_000),
            &dimension,
            &on("driver"),
            &on("id"),
            JoinType::Inner,
            shared(cache),
        )
        .unwrap();
        let cached = cache.stats().bytes;
        assert!(cached > 0);
        assert!(
            store.stats().pool.used >= claimed_before + cached,
            "the pool counts the cached index"
        );
        // A partition that takes the pool over its size: the index goes before any spill.
        let rows = (pool - store.stats().pool.used + 1024) as usize / 8;
        let big = RecordBatch::try_from_iter(vec![(
            "x",
            Arc::new(Float64Array::from(vec![1.0; rows])) as ArrayRef,
        )])
        .unwrap();
        store.insert(
            PartitionId {
                job_id: "job".into(),
                stage: 0,
                task: 0,
                output: 0,
            },
            Table::new(big),
        );
        assert_eq!(cache.stats().entries, 0);
        assert_eq!(
            store.stats().spilled_partitions,
            0,
            "dropping the index was enough"
        );
    }
}

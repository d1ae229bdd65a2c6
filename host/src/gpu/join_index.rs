//! The build side of a device join ([`super::ops::join`]): an index on one key column of the
//! right table, and a worker's cache of the indexes built on shared tables (broadcast inputs),
//! so that every task joining with a broadcast table probes one index built once: the device
//! counterpart of `cpu::build_cache`.
//!
//! An index holds the table's rows with a valid key sorted by key word (stable), the start of
//! each run of equal keys, and an open-addressing hash table from key word to run.
//!
//! A cache entry is keyed by the identity of the key column, held by `Weak` so that its address
//! is not reused while the entry exists; an entry whose column is gone is removed at the next
//! lookup or purge. Indexes live in the device pool: the pool's spiller drops every cached
//! index before it spills a table (an index is rebuilt more cheaply than a table is moved).
//! Builds are one at a time: a task missing an entry another task is building waits for it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use arrow::datatypes::DataType;

use super::GpuRuntime;
use super::exec::{
    Arg, alloc, filled_u32, gather_values, iota, radix_sort, read_u32, run, selected_rows,
};
use super::ops::{GpuOpError, hash_collision, string_offsets};
use super::pool::DeviceBuffer;
use super::table::DeviceColumn;

/// A join index on one key column; see the module docs.
pub struct JoinIndex {
    /// The rows with a valid key, in key order.
    pub build_order: DeviceBuffer,
    /// Where each run of equal keys starts in `build_order`.
    pub run_starts: DeviceBuffer,
    pub runs: usize,
    /// How many rows have a valid key.
    pub valid_rows: usize,
    /// The hash table: each slot's key word, its run, and its state (see `wrk_join_build`).
    pub slot_words: DeviceBuffer,
    pub slot_run: DeviceBuffer,
    pub slot_state: DeviceBuffer,
    /// Slots in the hash table (a power of two).
    pub capacity: usize,
}

impl JoinIndex {
    /// Builds the index on `key` (the column `name`), whose equality words are `words`. The
    /// words of strings are hashes: a run of equal words holding different strings (a
    /// collision) refuses the build, so every run holds one key.
    pub fn build(
        runtime: &GpuRuntime,
        key: &DeviceColumn,
        words: &DeviceBuffer,
        name: &str,
    ) -> Result<JoinIndex, GpuOpError> {
        let all = key.len;
        let valid_flags = alloc(runtime, all, 4)?;
        run(
            runtime,
            "wrk_valid_flags",
            all,
            &[
                Arg::Opt(key.validity.as_ref()),
                Arg::Buf(&valid_flags),
                Arg::I64(all as i64),
            ],
        )?;
        let (valid, b) = selected_rows(runtime, &valid_flags, all)?;
        let build_words = gather_values(runtime, words, 8, &valid, b)?;
        let order = radix_sort(runtime, &build_words, iota(runtime, 0, b)?, b)?;
        let build_order = gather_values(runtime, &valid, 4, &order, b)?;
        if key.data_type == DataType::Utf8 {
            let mismatches = filled_u32(runtime, 1, 0)?;
            run(
                runtime,
                "wrk_str_run_check",
                b,
                &[
                    Arg::Buf(string_offsets(key, "join", name)?),
                    Arg::Buf(&key.values),
                    Arg::Buf(&build_words),
                    Arg::Buf(&order),
                    Arg::Buf(&build_order),
                    Arg::Buf(&mismatches),
                    Arg::I64(b as i64),
                ],
            )?;
            match read_u32(runtime, &mismatches, 0)? {
                0 => {}
                rows => return Err(hash_collision("join", name, rows)),
            }
        }
        let run_flags = alloc(runtime, b, 4)?;
        run(
            runtime,
            "wrk_run_starts",
            b,
            &[
                Arg::Buf(&build_words),
                Arg::Buf(&order),
                Arg::Buf(&run_flags),
                Arg::I64(b as i64),
            ],
        )?;
        let (run_starts, runs) = selected_rows(runtime, &run_flags, b)?;
        let capacity = super::ops::table_capacity(runs);
        let slot_words = alloc(runtime, capacity, 8)?;
        let slot_run = alloc(runtime, capacity, 4)?;
        let slot_state = filled_u32(runtime, capacity, 0)?;
        run(
            runtime,
            "wrk_join_build",
            runs,
            &[
                Arg::Buf(&build_words),
                Arg::Buf(&order),
                Arg::Buf(&run_starts),
                Arg::Buf(&slot_words),
                Arg::Buf(&slot_run),
                Arg::Buf(&slot_state),
                Arg::U64(capacity as u64 - 1),
                Arg::I64(runs as i64),
            ],
        )?;
        Ok(JoinIndex {
            build_order,
            run_starts,
            runs,
            valid_rows: b,
            slot_words,
            slot_run,
            slot_state,
            capacity,
        })
    }

    /// Probes the index with every row of `key` (the probe table's key column and its name),
    /// whose equality words are `words`; `build_key` is the column the index was built on.
    /// Returns each probe row's matches: where they start in `build_order`, and how many
    /// there are (0 for none).
    pub fn probe(
        &self,
        runtime: &GpuRuntime,
        (key, name): (&DeviceColumn, &str),
        words: &DeviceBuffer,
        (build_key, build_name): (&DeviceColumn, &str),
    ) -> Result<(DeviceBuffer, DeviceBuffer), GpuOpError> {
        let n = key.len;
        let match_start = alloc(runtime, n, 4)?;
        let match_count = alloc(runtime, n, 4)?;
        run(
            runtime,
            "wrk_join_probe",
            n,
            &[
                Arg::Buf(words),
                Arg::Opt(key.validity.as_ref()),
                Arg::Buf(&self.slot_words),
                Arg::Buf(&self.slot_run),
                Arg::Buf(&self.slot_state),
                Arg::U64(self.capacity as u64 - 1),
                Arg::Buf(&self.run_starts),
                Arg::U64(self.runs as u64),
                Arg::U32(self.valid_rows as u32),
                Arg::Buf(&match_start),
                Arg::Buf(&match_count),
                Arg::I64(n as i64),
            ],
        )?;
        if key.data_type == DataType::Utf8 {
            // Equal hashes, different strings: no match (a run's strings are all equal).
            run(
                runtime,
                "wrk_str_probe_check",
                n,
                &[
                    Arg::Buf(string_offsets(key, "join", name)?),
                    Arg::Buf(&key.values),
                    Arg::Buf(string_offsets(build_key, "join", build_name)?),
                    Arg::Buf(&build_key.values),
                    Arg::Buf(&self.build_order),
                    Arg::Buf(&match_start),
                    Arg::Buf(&match_count),
                    Arg::I64(n as i64),
                ],
            )?;
        }
        Ok((match_start, match_count))
    }

    /// Device memory the index holds.
    pub fn bytes(&self) -> u64 {
        [
            &self.build_order,
            &self.run_starts,
            &self.slot_words,
            &self.slot_run,
            &self.slot_state,
        ]
        .iter()
        .map(|b| b.bytes())
        .sum()
    }
}

/// What the cache holds and has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JoinIndexStats {
    /// Lookups answered by a cached index.
    pub hits: u64,
    /// Indexes built because none was cached.
    pub builds: u64,
    /// Indexes held now, and their device bytes.
    pub entries: u64,
    pub bytes: u64,
}

/// A worker's cache of join indexes on shared tables; see the module docs.
#[derive(Default)]
pub struct JoinIndexCache {
    entries: Mutex<Vec<Entry>>,
    /// Held while an index is built, so that tasks missing the same entry at once build it
    /// once (builds on shared tables are few: one per broadcast table and key).
    building: Mutex<()>,
    hits: AtomicU64,
    builds: AtomicU64,
}

struct Entry {
    key: Weak<DeviceColumn>,
    index: Arc<JoinIndex>,
}

impl JoinIndexCache {
    fn lock(&self) -> MutexGuard<'_, Vec<Entry>> {
        // Every update is one push or retain: a panic leaves the list consistent.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn cached(&self, key: &Arc<DeviceColumn>) -> Option<Arc<JoinIndex>> {
        let mut entries = self.lock();
        entries.retain(|e| e.key.strong_count() > 0);
        entries
            .iter()
            .find(|e| std::ptr::eq(e.key.as_ptr(), Arc::as_ptr(key)))
            .map(|e| e.index.clone())
    }

    /// The cached index on `key`, or the one `build` makes (then cached). `build` runs without
    /// the entries' lock: its allocations may make the spiller clear the cache.
    pub fn get_or_build(
        &self,
        key: &Arc<DeviceColumn>,
        build: impl FnOnce() -> Result<JoinIndex, GpuOpError>,
    ) -> Result<Arc<JoinIndex>, GpuOpError> {
        let hit = |index| {
            self.hits.fetch_add(1, Ordering::Relaxed);
            Ok(index)
        };
        if let Some(index) = self.cached(key) {
            return hit(index);
        }
        let _building = self.building.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(index) = self.cached(key) {
            // Another task built it while this one waited.
            return hit(index);
        }
        let index = Arc::new(build()?);
        self.builds.fetch_add(1, Ordering::Relaxed);
        self.lock().push(Entry {
            key: Arc::downgrade(key),
            index: index.clone(),
        });
        Ok(index)
    }

    /// Drops every entry (an index a join is probing lives until the join ends); returns how
    /// many there were.
    pub fn clear(&self) -> u64 {
        std::mem::take(&mut *self.lock()).len() as u64
    }

    /// Drops the entries whose key column is gone (their table was dropped or spilled); returns
    /// how many.
    pub fn purge_dropped(&self) -> u64 {
        let mut entries = self.lock();
        let before = entries.len();
        entries.retain(|e| e.key.strong_count() > 0);
        (before - entries.len()) as u64
    }

    pub fn stats(&self) -> JoinIndexStats {
        let entries = self.lock();
        JoinIndexStats {
            hits: self.hits.load(Ordering::Relaxed),
            builds: self.builds.load(Ordering::Relaxed),
            entries: entries.len() as u64,
            bytes: entries.iter().map(|e| e.index.bytes()).sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Int64Array, RecordBatch};

    use crate::cpu::join::JoinType;
    use crate::gpu::exec::alloc;
    use crate::gpu::table::upload;
    use crate::gpu::{DeviceCounters, GpuRuntime, emulator, ops};

    fn keys(values: impl Iterator<Item = i64>) -> RecordBatch {
        RecordBatch::try_from_iter([(
            "k",
            Arc::new(Int64Array::from_iter_values(values)) as ArrayRef,
        )])
        .unwrap()
    }

    #[test]
    fn a_shared_tables_index_is_built_once_and_goes_with_the_table_or_under_pressure() {
        if emulator::skipped_without_compiler("a_shared_tables_index_is_built_once") {
            return;
        }
        let runtime = GpuRuntime::emulated(Some(4 << 20), DeviceCounters::default()).unwrap();
        let probe = upload(&runtime, &keys(0..1_000)).unwrap();
        let build = upload(&runtime, &keys((0..500).map(|i| i * 3))).unwrap();
        let on = ["k".to_string()];
        let join = |cache_index| {
            ops::join(
                &runtime,
                &probe,
                &build,
                &on,
                &on,
                JoinType::Inner,
                cache_index,
            )
            .unwrap()
            .rows
        };
        // 0, 3, ..., 999: 334 keys below 1000 are multiples of 3.
        assert_eq!(join(false), 334);
        assert_eq!(
            runtime.join_indexes.stats().entries,
            0,
            "not a shared table"
        );
        assert_eq!(join(true), 334);
        assert_eq!(join(true), 334);
        let stats = runtime.join_indexes.stats();
        assert_eq!((stats.builds, stats.hits, stats.entries), (1, 1, 1));
        assert!(stats.bytes > 500 * 4, "{stats:?}");

        // A full pool drops the cached index before it spills anything.
        let used = runtime.pool.stats().used;
        let free = runtime.pool.stats().capacity - used;
        let filler = alloc(&runtime, (free + stats.bytes / 2) as usize, 1).unwrap();
        assert_eq!(runtime.join_indexes.stats().entries, 0);
        assert!(runtime.pool.stats().evictions >= 1);
        drop(filler);

        // Rebuilt on the next join; dropping the table makes its entry dead, purged.
        assert_eq!(join(true), 334);
        assert_eq!(runtime.join_indexes.stats().builds, 2);
        drop(build);
        assert_eq!(runtime.join_indexes.purge_dropped(), 1);
        drop(probe);
        assert_eq!(runtime.pool.stats().used, 0, "every buffer went back");
    }
}

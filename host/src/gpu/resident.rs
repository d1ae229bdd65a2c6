//! The device tables of running tasks, and their spilling to host memory.
//!
//! On a GPU worker a guest's table lives in device memory as a [`ResidentTable`]: an operator's
//! result, or a host table (a Parquet read, a partition from the store, a shuffle piece, a
//! guest's own copy) uploaded the first time a device operator reads it. A resident table may
//! also hold a host copy: the one it was uploaded from, or a download made for an operator the
//! device does not run (each such copy is a counted transfer, made once).
//!
//! When an allocation does not fit the device pool, the pool's eviction hook, the [`Spiller`],
//! spills resident tables that no operator is reading: those with a host copy first (dropping
//! their device buffers costs no copy), then the least recently used. A spilled table is
//! copied to host memory, its copy claimed by the owning task's account of the worker's memory
//! pool (which makes room there by spilling the store's partitions to disk), and its device
//! buffers are dropped. The next device operator that reads it uploads it again.
//!
//! A task's output left on the device goes to the worker's partition store as it is: its owner
//! becomes the store (see [`ResidentTable::hand_to`]), and the next stage's tasks on this
//! worker read it there without a copy. It is spilled like any other resident table.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use arrow::array::ArrayRef;
use arrow::datatypes::SchemaRef;

use super::GpuRuntime;
use super::pool::EvictionHook;
use super::table::{DeviceTable, TableError, download, download_array, upload};
use crate::memory::pool::Account;
use crate::table::Table;

/// The copies a resident table has now. The device copy is shared with the operators reading
/// it: the table is spilled only when nobody else holds it.
enum Copies {
    /// Made on the device, not downloaded yet.
    Device(Arc<DeviceTable>),
    /// On the device, with a host copy (the table it was uploaded from, or a download).
    Both(Arc<DeviceTable>, Table),
    /// Spilled.
    Host(Table),
}

impl Copies {
    fn device(&self) -> Option<&Arc<DeviceTable>> {
        match self {
            Copies::Device(device) | Copies::Both(device, _) => Some(device),
            Copies::Host(_) => None,
        }
    }

    fn host(&self) -> Option<&Table> {
        match self {
            Copies::Host(host) | Copies::Both(_, host) => Some(host),
            Copies::Device(_) => None,
        }
    }
}

/// A table of a running task in device memory, which the pool may spill to host memory.
pub struct ResidentTable {
    runtime: Arc<GpuRuntime>,
    schema: SchemaRef,
    rows: usize,
    copies: Mutex<Copies>,
    /// Held while the table is uploaded again, so that two operators reading it at once make
    /// one upload (the copies are not locked during an upload: it may spill other tables).
    uploading: Mutex<()>,
    last_used: AtomicU64,
    /// The account host copies are claimed by: the task's, or the store's once the table is
    /// a stored partition.
    owner: Mutex<Option<Arc<Account>>>,
}

impl ResidentTable {
    /// Keeps `table` (and its host copy, if it has one), registered for spilling.
    pub fn new(
        runtime: &Arc<GpuRuntime>,
        table: DeviceTable,
        host: Option<Table>,
        owner: Option<Arc<Account>>,
    ) -> Arc<Self> {
        let (schema, rows) = (table.schema.clone(), table.rows);
        let copies = match host {
            Some(host) => Copies::Both(Arc::new(table), host),
            None => Copies::Device(Arc::new(table)),
        };
        Self::keep(runtime, schema, rows, copies, owner)
    }

    /// A host table kept for the device without uploading it yet: the first device operator
    /// that reads it uploads it (counted), and whoever holds this table then reads that one
    /// copy; operators on the CPU backend read the host table as it is, and never upload it.
    /// A broadcast input is kept so: one upload per worker, and none where only the CPU backend
    /// reads it.
    pub fn on_host(
        runtime: &Arc<GpuRuntime>,
        host: Table,
        owner: Option<Arc<Account>>,
    ) -> Arc<Self> {
        let schema = Arc::new(super::table::device_schema(&host.schema()));
        let rows = host.num_rows();
        Self::keep(runtime, schema, rows, Copies::Host(host), owner)
    }

    fn keep(
        runtime: &Arc<GpuRuntime>,
        schema: SchemaRef,
        rows: usize,
        copies: Copies,
        owner: Option<Arc<Account>>,
    ) -> Arc<Self> {
        let resident = Arc::new(ResidentTable {
            runtime: runtime.clone(),
            schema,
            rows,
            copies: Mutex::new(copies),
            uploading: Mutex::new(()),
            last_used: AtomicU64::new(runtime.resident.tick()),
            owner: Mutex::new(owner),
        });
        runtime.resident.register(&resident);
        resident
    }

    /// Uploads a host table (one counted transfer); it keeps `host` as its host copy.
    pub fn upload(
        runtime: &Arc<GpuRuntime>,
        host: Table,
        owner: Option<Arc<Account>>,
    ) -> Result<Arc<Self>, TableError> {
        let table = upload(runtime, host.batch())?;
        Ok(Self::new(runtime, table, Some(host), owner))
    }

    fn lock(&self) -> MutexGuard<'_, Copies> {
        // Every update of the copies is one assignment: a panic leaves them consistent.
        self.copies.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The column names and types (strings as `Utf8`: device tables hold no dictionaries).
    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Whether the worker's tasks share it (see [`Table::is_shared`]): it was uploaded from a
    /// shared table (a broadcast input), which stays its host copy, so that a join caches its
    /// index on it. A table made on the device, and the download of one, are not shared.
    pub fn is_shared(&self) -> bool {
        self.lock().host().is_some_and(Table::is_shared)
    }

    /// Whether the table is in device memory now (not spilled).
    pub fn on_device(&self) -> bool {
        self.lock().device().is_some()
    }

    /// Its host copy, if it has one now (nothing is downloaded).
    pub fn host_copy(&self) -> Option<Table> {
        self.lock().host().cloned()
    }

    /// Its size: of the device copy, or of the host copy once spilled.
    pub fn bytes(&self) -> u64 {
        match &*self.lock() {
            Copies::Device(device) | Copies::Both(device, _) => device.bytes(),
            Copies::Host(host) => host.memory_bytes() as u64,
        }
    }

    /// Makes `owner` claim the table's host copies from now on, and the one it has now.
    pub fn hand_to(&self, owner: Arc<Account>) {
        *self.owner.lock().unwrap_or_else(|e| e.into_inner()) = Some(owner.clone());
        if let Some(host) = self.host_copy() {
            owner.claim(host.batch());
        }
    }

    fn owner(&self) -> Option<Arc<Account>> {
        self.owner.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The table in device memory for an operator to read, uploaded again (counted) when it
    /// was spilled. It is not spilled while the result is held.
    pub fn device(&self) -> Result<Arc<DeviceTable>, TableError> {
        self.last_used
            .store(self.runtime.resident.tick(), Ordering::Relaxed);
        let on_device = || match &*self.lock() {
            Copies::Device(device) | Copies::Both(device, _) => Ok(device.clone()),
            Copies::Host(host) => Err(host.clone()),
        };
        if let Ok(device) = on_device() {
            return Ok(device);
        }
        let _uploading = self.uploading.lock().unwrap_or_else(|e| e.into_inner());
        // Another operator may have uploaded it while this one waited.
        let host = match on_device() {
            Ok(device) => return Ok(device),
            Err(host) => host,
        };
        // Uploaded without the copies' lock: the allocation may spill other tables.
        let uploaded = Arc::new(upload(&self.runtime, host.batch())?);
        *self.lock() = Copies::Both(uploaded.clone(), host);
        Ok(uploaded)
    }

    /// The table in host memory, downloaded once (counted) when it has no host copy yet.
    pub fn host(&self) -> Result<Table, TableError> {
        let device = match &*self.lock() {
            Copies::Host(host) | Copies::Both(_, host) => return Ok(host.clone()),
            Copies::Device(device) => device.clone(),
        };
        let host = self.claimed(download(&self.runtime, &device)?);
        let mut copies = self.lock();
        if let Some(host) = copies.host() {
            // Another thread downloaded it meanwhile.
            return Ok(host.clone());
        }
        *copies = Copies::Both(device, host.clone());
        Ok(host)
    }

    /// One column in host memory: from the host copy, or downloaded alone (counted) when the
    /// table has none. `None` when the table has no such column.
    pub fn column_on_host(&self, name: &str) -> Result<Option<ArrayRef>, TableError> {
        let device = match &*self.lock() {
            Copies::Host(host) | Copies::Both(_, host) => {
                return Ok(host.batch().column_by_name(name).cloned());
            }
            Copies::Device(device) => device.clone(),
        };
        let Some(column) = device.column(name) else {
            return Ok(None);
        };
        let array = download_array(&self.runtime, name, column)?;
        if let Some(owner) = self.owner() {
            owner.claim_array(array.as_ref());
        }
        Ok(Some(array))
    }

    fn claimed(&self, batch: arrow::record_batch::RecordBatch) -> Table {
        if let Some(owner) = self.owner() {
            owner.claim(&batch);
        }
        Table::new(batch)
    }

    /// Spills the table to host memory unless an operator is reading it (or another thread
    /// holds its copies); returns whether its device copy was dropped.
    fn try_spill(&self) -> Result<bool, TableError> {
        let Ok(mut copies) = self.copies.try_lock() else {
            return Ok(false);
        };
        let host = match &*copies {
            Copies::Host(_) => return Ok(false),
            Copies::Device(device) | Copies::Both(device, _) if Arc::strong_count(device) > 1 => {
                return Ok(false);
            }
            Copies::Both(_, host) => host.clone(),
            Copies::Device(device) => self.claimed(download(&self.runtime, device)?),
        };
        *copies = Copies::Host(host);
        Ok(true)
    }

    fn spill_rank(&self) -> (bool, u64) {
        let has_host = self.lock().host().is_some();
        (!has_host, self.last_used.load(Ordering::Relaxed))
    }
}

/// The resident tables of a runtime, for the spiller.
#[derive(Default)]
pub struct Residents {
    tables: Mutex<Vec<Weak<ResidentTable>>>,
    clock: AtomicU64,
}

impl Residents {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Weak<ResidentTable>>> {
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn register(&self, table: &Arc<ResidentTable>) {
        let mut tables = self.lock();
        tables.retain(|t| t.strong_count() > 0);
        tables.push(Arc::downgrade(table));
    }

    /// The live resident tables, in the order to spill them.
    fn spill_order(&self) -> Vec<Arc<ResidentTable>> {
        let mut live: Vec<Arc<ResidentTable>> =
            self.lock().iter().filter_map(Weak::upgrade).collect();
        live.sort_by_cached_key(|t| t.spill_rank());
        live
    }

    /// How many resident tables are alive, and how many of them are in device memory.
    pub fn counts(&self) -> (usize, usize) {
        let live: Vec<Arc<ResidentTable>> = self.lock().iter().filter_map(Weak::upgrade).collect();
        let on_device = live.iter().filter(|t| t.on_device()).count();
        (live.len(), on_device)
    }
}

/// The device pool's eviction hook: spills resident tables to host memory.
pub struct Spiller {
    runtime: Weak<GpuRuntime>,
}

impl Spiller {
    pub fn new(runtime: &Arc<GpuRuntime>) -> Self {
        Spiller {
            runtime: Arc::downgrade(runtime),
        }
    }
}

impl EvictionHook for Spiller {
    fn evict(&self, needed_bytes: u64) -> u64 {
        let Some(runtime) = self.runtime.upgrade() else {
            return 0;
        };
        let used = || runtime.pool.stats().used;
        let before = used();
        // Cached join indexes go first: rebuilding one costs less than moving a table.
        let indexes = runtime.join_indexes.clear();
        if indexes > 0 {
            tracing::debug!(indexes, "dropped the cached join indexes");
            if before.saturating_sub(used()) >= needed_bytes {
                return before.saturating_sub(used());
            }
        }
        for table in runtime.resident.spill_order() {
            match table.try_spill() {
                Ok(true) => {
                    tracing::debug!(rows = table.rows, "spilled a device table to host memory");
                    if before.saturating_sub(used()) >= needed_bytes {
                        break;
                    }
                }
                Ok(false) => {}
                Err(e) => tracing::warn!("cannot spill a device table to host memory: {e}"),
            }
        }
        before.saturating_sub(used())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray};

    use super::*;
    use crate::gpu::{DeviceCounters, Direction, GpuRuntime, emulator};

    fn batch(rows: i64, seed: i64) -> RecordBatch {
        RecordBatch::try_from_iter([
            (
                "k",
                Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i * seed))) as ArrayRef,
            ),
            (
                "x",
                Arc::new(Float64Array::from_iter_values(
                    (0..rows).map(|i| i as f64 / 3.0),
                )),
            ),
            (
                "s",
                Arc::new(StringArray::from_iter_values(
                    (0..rows).map(|i| format!("row {i}")),
                )),
            ),
        ])
        .unwrap()
    }

    /// A pool with room for about three of the test's tables spills the least recently used
    /// ones to host memory and uploads them again when read; every table keeps its rows.
    #[test]
    fn a_full_pool_spills_idle_tables_and_reads_them_back() {
        if emulator::skipped_without_compiler("a_full_pool_spills_idle_tables") {
            return;
        }
        let rows = 20_000;
        let one = upload_size(rows);
        let runtime =
            GpuRuntime::emulated(Some(one * 3 + one / 2), DeviceCounters::default()).unwrap();
        let batches: Vec<RecordBatch> = (1..=6).map(|seed| batch(rows, seed)).collect();
        let tables: Vec<Arc<ResidentTable>> = batches
            .iter()
            .map(|b| ResidentTable::upload(&runtime, Table::new(b.clone()), None).unwrap())
            .collect();
        // The first three were spilled to make room for the last three.
        let resident: Vec<bool> = tables.iter().map(|t| t.on_device()).collect();
        assert_eq!(resident, [false, false, false, true, true, true]);
        assert_eq!(runtime.resident.counts(), (6, 3));
        let stats = runtime.pool.stats();
        assert!(stats.evictions >= 3, "{stats:?}");
        assert!(stats.used <= stats.capacity);
        // Their host copies were kept: spilling them copied nothing back.
        assert_eq!(runtime.transfers.totals(Direction::ToHost), (0, 0));

        // Reading the first uploads it again, spilling the least recently used of the rest.
        let uploads = runtime.transfers.totals(Direction::ToDevice).1;
        let first = tables[0].device().unwrap();
        assert_eq!(first.rows, rows as usize);
        assert_eq!(runtime.transfers.totals(Direction::ToDevice).1, uploads + 1);
        assert!(!tables[3].on_device(), "the least recently used went");
        // A table an operator holds is not spilled: with the first one held, uploading the
        // others again spills around it.
        for table in &tables[1..] {
            table.device().unwrap();
        }
        assert!(tables[0].on_device(), "held by `first`, so kept");
        drop(first);
        for (table, original) in tables.iter().zip(&batches) {
            assert_eq!(table.host().unwrap().batch(), original);
        }
    }

    /// A table made on the device (no host copy) is downloaded when spilled (counted), and
    /// its host copy is claimed by the owning task's account.
    #[test]
    fn spilling_a_device_made_table_downloads_it_into_its_owners_account() {
        if emulator::skipped_without_compiler("spilling_a_device_made_table") {
            return;
        }
        let rows = 20_000;
        let one = upload_size(rows);
        let runtime = GpuRuntime::emulated(Some(one + one / 2), DeviceCounters::default()).unwrap();
        let pool = crate::memory::pool::Pool::new(1 << 30);
        let account = pool.account("task");
        let original = batch(rows, 7);
        let made = upload(&runtime, &original).unwrap();
        let table = ResidentTable::new(&runtime, made, None, Some(account.clone()));
        let other = ResidentTable::upload(&runtime, Table::new(batch(rows, 3)), None).unwrap();
        assert!(!table.on_device(), "spilled for the other");
        assert!(other.on_device());
        assert_eq!(runtime.transfers.totals(Direction::ToHost).1, 1);
        assert!(account.claimed() >= original.get_array_memory_size() as u64 / 2);
        assert_eq!(table.host().unwrap().batch(), &original);
        assert_eq!(
            runtime.transfers.totals(Direction::ToHost).1,
            1,
            "the spilled copy serves host reads"
        );
    }

    /// A table kept on the host for the device is uploaded by its first device reader alone,
    /// once however many read it at once, and never by host readers.
    #[test]
    fn a_host_kept_table_is_uploaded_once_by_its_first_device_reader() {
        if emulator::skipped_without_compiler("a_host_kept_table_is_uploaded_once") {
            return;
        }
        let runtime = GpuRuntime::emulated(None, DeviceCounters::default()).unwrap();
        let original = batch(5_000, 3);
        let table = ResidentTable::on_host(&runtime, Table::new(original.clone()), None);
        assert!(!table.on_device());
        assert_eq!(table.rows(), 5_000);
        assert_eq!(table.host().unwrap().batch(), &original);
        assert_eq!(
            table.bytes(),
            Table::new(original.clone()).memory_bytes() as u64
        );
        assert_eq!(runtime.transfers.totals(Direction::ToDevice), (0, 0));
        let copies: Vec<Arc<DeviceTable>> = std::thread::scope(|scope| {
            let readers: Vec<_> = (0..4).map(|_| scope.spawn(|| table.device())).collect();
            readers
                .into_iter()
                .map(|r| r.join().unwrap().unwrap())
                .collect()
        });
        assert!(copies.iter().all(|c| Arc::ptr_eq(c, &copies[0])));
        assert_eq!(runtime.transfers.totals(Direction::ToDevice).1, 1);
        assert_eq!(table.schema(), copies[0].schema);
        assert!(table.on_device());
        // Its host copy stays: reading it on the host copies nothing back.
        assert_eq!(table.host().unwrap().batch(), &original);
        assert_eq!(runtime.transfers.totals(Direction::ToHost), (0, 0));
    }

    /// The device bytes of one test table.
    fn upload_size(rows: i64) -> u64 {
        // k and x: 8 bytes a row; s: about 9 bytes and a 4-byte offset a row.
        (rows as u64) * (8 + 8 + 4 + 10) + 4
    }
}

//! The worker's partitions: task outputs keyed by job, stage, task and output, and the shuffle
//! pieces received for reducers placed here, kept in the worker's memory pool until they are
//! released, spilled to disk under pressure and read back when a task or a peer needs them.
//!
//! On a GPU worker a task's output made on the device stays there: the store keeps the
//! [`ResidentTable`](crate::gpu::resident::ResidentTable) (which the device pool spills to
//! host memory under its own pressure) and the next stage's tasks here read it without a
//! copy. It comes to host memory (once, counted)
//! only when something needs it there: a peer, a CPU operator, or spilling; once it has a host
//! copy and no task reads it, it spills to disk like any other partition.
//!
//! The store also admits work into the pool: running tasks register an account
//! ([`PartitionStore::begin_task`]) and take leases for their working set; an admission that
//! does not fit spills least-recently-used partitions no running task holds (a table whose
//! `Arc` only the store holds), then waits for running tasks to give memory back (a later
//! admission does not take the memory an earlier one waits for), and fails
//! with the sizes named when the request can never fit or when every other running task is
//! waiting too (waiting would deadlock).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use arrow::buffer::Buffer;

use crate::cpu::build_cache::BuildCache;
use crate::gpu::table::TableError;
use crate::guest_api::TaskTable;
use crate::memory::pool::{Account, Pool, PoolStats};
use crate::memory::size::Bytes;
use crate::memory::spill::{SpillDir, SpillError, SpillFile};
use crate::shuffle::pieces::PieceId;
use crate::table::{Table, ipc_segments};

/// How long an admission waits for running tasks to give memory back before failing.
pub const ADMISSION_TIMEOUT: Duration = Duration::from_secs(120);
/// How long every other running task must have been waiting too before a waiter gives way:
/// long enough for a task that is about to finish (or a peer transfer) to let go.
const DEADLOCK_GRACE: Duration = Duration::from_millis(300);
/// The share of the pool the join index cache may hold.
const BUILD_CACHE_SHARE: u64 = 4;
/// How often a waiting admission looks again (buffers freed by dropped tables do not signal).
const RECHECK: Duration = Duration::from_millis(20);

/// Identity of one stored output table.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartitionId {
    pub job_id: String,
    pub stage: u32,
    pub task: u32,
    pub output: u32,
}

impl std::fmt::Display for PartitionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}/{}",
            self.job_id, self.stage, self.task, self.output
        )
    }
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

/// What the store keeps: a task's output, or a shuffle piece.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum StoredKey {
    Output(PartitionId),
    Piece(PieceId),
}

impl StoredKey {
    fn job_id(&self) -> &str {
        match self {
            StoredKey::Output(id) => &id.job_id,
            StoredKey::Piece(id) => &id.partition.job_id,
        }
    }
}

impl std::fmt::Display for StoredKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoredKey::Output(id) => write!(f, "partition {id}"),
            StoredKey::Piece(id) => id.fmt(f),
        }
    }
}

/// Counts for heartbeats, metrics and status.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StoreStats {
    /// Task outputs held, in memory or spilled.
    pub partitions: u64,
    /// Shuffle pieces held, in memory or spilled.
    pub pieces: u64,
    /// Outputs and pieces on disk, not in memory.
    pub spilled_partitions: u64,
    /// Bytes of the outputs and pieces in memory.
    pub bytes: u64,
    pub pool: PoolStats,
}

/// Why memory could not be had.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error(
        "{what} needs a working set of {needed}, more than the whole memory pool of {size}: it can never fit"
    )]
    NeverFits {
        what: String,
        needed: Bytes,
        size: Bytes,
    },
    #[error(
        "{what} needs {needed} more of the memory pool of {size}, which has {used} in use ({partitions} by partitions running tasks hold, {tasks} by {running} other running task(s)) and nothing left to spill; {reason}"
    )]
    NoRoom {
        what: String,
        needed: Bytes,
        size: Bytes,
        used: Bytes,
        partitions: Bytes,
        tasks: Bytes,
        running: usize,
        reason: String,
    },
    #[error(transparent)]
    Spill(#[from] SpillError),
    #[error("copying a stored table from the device failed: {0}")]
    Device(#[from] TableError),
}

impl PoolError {
    /// Whether another attempt may succeed (later, with other tasks done).
    pub fn retriable(&self) -> bool {
        matches!(self, PoolError::NoRoom { .. })
    }
}

struct Entry {
    /// The table, while it is in memory: host memory, or the device for a GPU task's output.
    table: Option<TaskTable>,
    /// Its spill file, once written; kept after unspilling (partitions never change), so a
    /// second spill costs no I/O.
    file: Option<Arc<SpillFile>>,
    /// Bytes of the table in host memory (a device table's: once it has a host copy).
    bytes: u64,
    last_used: u64,
}

impl Entry {
    /// Whether spilling the table frees host memory: only the store holds it, and it is in
    /// host memory (a device table once it has a host copy; the device pool spills its
    /// device copy).
    fn spillable(&self) -> bool {
        match &self.table {
            Some(TaskTable::Host(table)) => table.holders() == 1,
            Some(TaskTable::Device(resident)) => {
                // The copy in hand and the resident table's own.
                Arc::strong_count(resident) == 1
                    && resident.host_copy().is_some_and(|host| host.holders() == 2)
            }
            None => false,
        }
    }

    /// The table's copy in host memory now, if it has one.
    fn host_copy(&self) -> Option<Table> {
        match &self.table {
            Some(TaskTable::Host(table)) => Some(table.clone()),
            Some(TaskTable::Device(resident)) => resident.host_copy(),
            None => None,
        }
    }

    /// Bytes of the table in host memory now.
    fn memory_bytes(&self) -> u64 {
        match &self.table {
            Some(TaskTable::Host(_)) => self.bytes,
            Some(TaskTable::Device(resident)) => resident
                .host_copy()
                .map_or(0, |host| host.memory_bytes() as u64),
            None => 0,
        }
    }
}

#[derive(Default)]
struct Inner {
    entries: HashMap<StoredKey, Entry>,
    /// Accounts of the running tasks, by registration number.
    tasks: HashMap<u64, Arc<Account>>,
    next_task: u64,
    /// Admissions waiting for memory now, by arrival, with the bytes each needs. A later
    /// admission leaves room for them: it does not take the memory an earlier one waits for.
    waiters: std::collections::BTreeMap<u64, u64>,
    next_ticket: u64,
    /// Logical clock for least-recently-used order.
    clock: u64,
}

pub struct PartitionStore {
    pool: Pool,
    /// The store's own claims: the buffers of partitions in memory.
    account: Arc<Account>,
    /// Join indexes built on tables the worker's tasks share, claimed by their own account and
    /// released first under pressure.
    build_cache: BuildCache,
    spill: SpillDir,
    inner: Mutex<Inner>,
    changed: Condvar,
}

impl std::fmt::Debug for PartitionStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionStore")
            .field("pool", &self.pool)
            .field("spill", &self.spill)
            .finish_non_exhaustive()
    }
}

impl PartitionStore {
    /// A store whose pool holds `pool_bytes`, spilling into `spill`.
    pub fn new(pool_bytes: u64, spill: SpillDir) -> Self {
        let pool = Pool::new(pool_bytes);
        PartitionStore {
            account: pool.account("partition store"),
            build_cache: BuildCache::new(
                pool.account("join index cache"),
                pool.size() / BUILD_CACHE_SHARE,
            ),
            pool,
            spill,
            inner: Mutex::default(),
            changed: Condvar::new(),
        }
    }

    /// The same store, counting the free blocks `buffers` keeps for reuse in its pool.
    pub fn with_buffers(self, buffers: Arc<crate::memory::buffers::BufferPool>) -> Self {
        let pool = self.pool.with_buffers(buffers);
        Self { pool, ..self }
    }

    pub fn pool_size(&self) -> u64 {
        self.pool.size()
    }

    /// The worker's cache of join indexes on shared tables (counted in this pool).
    pub fn build_cache(&self) -> &BuildCache {
        &self.build_cache
    }

    pub fn spill_dir(&self) -> &SpillDir {
        &self.spill
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent data: every update is one step.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn used(&self, inner: &Inner) -> u64 {
        self.pool.used(inner.tasks.values())
    }

    /// Keeps `table` as partition `id`, spilling older partitions (or this one) when the pool
    /// overflows. A device table stays on the device, its host copies claimed by the store.
    pub fn insert(&self, id: PartitionId, table: impl Into<TaskTable>) {
        self.insert_stored(StoredKey::Output(id), table.into());
    }

    /// Keeps a shuffle piece until [`PartitionStore::release_pieces`], like a partition: in the
    /// pool, spilled under pressure.
    pub fn insert_piece(&self, id: PieceId, table: Table) {
        self.insert_stored(StoredKey::Piece(id), TaskTable::Host(table));
    }

    fn insert_stored(&self, id: StoredKey, table: TaskTable) {
        let bytes = match &table {
            TaskTable::Host(table) => {
                self.account.claim(table.batch());
                table.memory_bytes() as u64
            }
            TaskTable::Device(resident) => {
                resident.hand_to(self.account.clone());
                0
            }
        };
        let mut inner = self.lock();
        inner.clock += 1;
        let entry = Entry {
            table: Some(table),
            file: None,
            bytes,
            last_used: inner.clock,
        };
        inner.entries.insert(id, entry);
        if let Err(e) = self.evict(&mut inner, 0) {
            tracing::warn!("cannot spill partitions: {e}");
        }
    }

    /// Spills least-recently-used partitions nobody else holds until `needed` more bytes fit,
    /// or none is left. Returns whether they fit.
    fn evict(&self, inner: &mut Inner, needed: u64) -> Result<bool, SpillError> {
        if self.used(inner) + needed > self.pool.size() {
            // Free blocks kept for reuse and cached join indexes go first: they cost nothing
            // to give up (an index is built again when needed).
            self.pool.release_buffers();
            let released = self.build_cache.release();
            if released > 0 {
                tracing::debug!(bytes = released, "released cached join indexes");
            }
        }
        loop {
            if self.used(inner) + needed <= self.pool.size() {
                return Ok(true);
            }
            let victim = inner
                .entries
                .iter()
                .filter(|(_, e)| e.spillable())
                .min_by_key(|(_, e)| e.last_used)
                .map(|(id, _)| id.clone());
            let Some(id) = victim else {
                return Ok(false);
            };
            let Some(entry) = inner.entries.get_mut(&id) else {
                return Ok(false);
            };
            let started = Instant::now();
            if let Some(host) = entry.host_copy() {
                entry.bytes = host.memory_bytes() as u64;
                if entry.file.is_none() {
                    entry.file = Some(Arc::new(self.spill.write(host.batch())?));
                }
            }
            // A device table's device copy goes too: nobody reads it.
            entry.table = None;
            self.pool.record_spill(entry.bytes, started.elapsed());
            tracing::debug!(what = %id, bytes = entry.bytes, "spilled to disk");
        }
    }

    /// Partition `id` for a task (which then keeps it from spilling while it holds it), read
    /// back from disk if it was spilled. A device table is given as it is (its host copies
    /// stay claimed by the store). `Ok(None)` when the store does not have it.
    pub fn get(
        &self,
        id: &PartitionId,
        task: Option<&TaskMemory>,
    ) -> Result<Option<TaskTable>, PoolError> {
        self.get_stored(&StoredKey::Output(id.clone()), task)
    }

    /// A shuffle piece, as [`PartitionStore::get`] gives a partition (pieces are kept in host
    /// memory).
    pub fn get_piece(
        &self,
        id: &PieceId,
        task: Option<&TaskMemory>,
    ) -> Result<Option<Table>, PoolError> {
        match self.get_stored(&StoredKey::Piece(id.clone()), task)? {
            Some(table) => Ok(Some(table.host()?)),
            None => Ok(None),
        }
    }

    fn get_stored(
        &self,
        id: &StoredKey,
        task: Option<&TaskMemory>,
    ) -> Result<Option<TaskTable>, PoolError> {
        let mut inner = self.lock();
        inner.clock += 1;
        let clock = inner.clock;
        let Some(entry) = inner.entries.get_mut(id) else {
            return Ok(None);
        };
        entry.last_used = clock;
        let bytes = entry.bytes;
        if let Some(table) = &entry.table {
            let table = table.clone();
            // The task's working set includes its inputs: their claims move to its account.
            if let (Some(task), TaskTable::Host(host)) = (task, &table) {
                task.account.claim(host.batch());
            }
            return Ok(Some(table));
        }
        let Some(file) = entry.file.clone() else {
            return Ok(None);
        };
        // Make room for it first, as a task of the caller's would.
        let what = format!("reading back {id}");
        let mut inner = self.admit(inner, bytes, task, &what)?;
        let started = Instant::now();
        let table = Table::new(file.read()?);
        match task {
            Some(task) => task.account.claim(table.batch()),
            None => self.account.claim(table.batch()),
        }
        self.pool.record_unspill(bytes, started.elapsed());
        match inner.entries.get_mut(id) {
            Some(entry) => {
                entry.table = Some(TaskTable::Host(table.clone()));
                entry.bytes = table.memory_bytes() as u64;
            }
            // Released while it was read: the task still gets it.
            None => tracing::debug!(what = %id, "released while read back"),
        }
        tracing::debug!(what = %id, bytes, "read back from disk");
        Ok(Some(TaskTable::Host(table)))
    }

    /// Partition `id` as an Arrow IPC stream for a peer, in segments: the table's own buffers
    /// between the messages' headers (see [`ipc_segments`]), or a spilled partition's file read
    /// as it is, without coming back into the pool. A device table is copied to host memory
    /// first (once: the store keeps the copy).
    pub fn ipc_stream(&self, id: &PartitionId) -> Option<Result<Vec<Buffer>, String>> {
        let (table, file) = {
            let mut inner = self.lock();
            inner.clock += 1;
            let clock = inner.clock;
            let entry = inner.entries.get_mut(&StoredKey::Output(id.clone()))?;
            entry.last_used = clock;
            (entry.table.clone(), entry.file.clone())
        };
        Some(match (table, file) {
            (Some(table), _) => table
                .host()
                .map_err(|e| format!("copying partition {id} from the device failed: {e}"))
                .and_then(|host| ipc_segments(host.batch()).map_err(|e| e.to_string())),
            (None, Some(file)) => file
                .read_bytes()
                .map(|bytes| vec![Buffer::from(bytes)])
                .map_err(|e| e.to_string()),
            (None, None) => Err(format!("partition {id} has no data")),
        })
    }

    /// Drops every partition and shuffle piece of a job (and their spill files); returns how
    /// many there were.
    pub fn release_job(&self, job_id: &str) -> usize {
        self.release_where(|id| id.job_id() == job_id)
    }

    /// Drops every output of one task; returns how many there were.
    pub fn release_task(&self, job_id: &str, stage: u32, task: u32) -> usize {
        self.release_where(|id| {
            matches!(id, StoredKey::Output(id)
                if id.job_id == job_id && id.stage == stage && id.task == task)
        })
    }

    /// Drops the given shuffle pieces; returns how many the store had.
    pub fn release_pieces<'a>(&self, ids: impl IntoIterator<Item = &'a PieceId>) -> usize {
        let removed: Vec<Entry> = {
            let mut inner = self.lock();
            ids.into_iter()
                .filter_map(|id| inner.entries.remove(&StoredKey::Piece(id.clone())))
                .collect()
        };
        let count = removed.len();
        drop(removed);
        self.changed.notify_all();
        count
    }

    fn release_where(&self, matches: impl Fn(&StoredKey) -> bool) -> usize {
        let removed: Vec<Entry> = {
            let mut inner = self.lock();
            let ids: Vec<StoredKey> = inner
                .entries
                .keys()
                .filter(|id| matches(id))
                .cloned()
                .collect();
            ids.iter()
                .filter_map(|id| inner.entries.remove(id))
                .collect()
        };
        // Tables and spill files go outside the lock.
        let count = removed.len();
        drop(removed);
        self.changed.notify_all();
        count
    }

    pub fn stats(&self) -> StoreStats {
        let inner = self.lock();
        let (mut resident, mut spilled, mut spilled_bytes) = (0u64, 0u64, 0u64);
        let mut pieces = 0;
        for (key, entry) in &inner.entries {
            if matches!(key, StoredKey::Piece(_)) {
                pieces += 1;
            }
            if entry.table.is_some() {
                resident += entry.memory_bytes();
            } else {
                spilled += 1;
                spilled_bytes += entry.bytes;
            }
        }
        let leased = inner.tasks.values().map(|a| a.leased()).sum();
        let used = self.used(&inner);
        StoreStats {
            partitions: inner.entries.len() as u64 - pieces,
            pieces,
            spilled_partitions: spilled,
            bytes: resident,
            pool: self.pool.stats(used, resident, leased, [0, spilled_bytes]),
        }
    }

    /// Registers a running task with the pool; dropping the result unregisters it.
    pub fn begin_task(self: &Arc<Self>, name: impl Into<String>) -> Arc<TaskMemory> {
        let account = self.pool.account(name);
        let mut inner = self.lock();
        inner.next_task += 1;
        let key = inner.next_task;
        inner.tasks.insert(key, account.clone());
        Arc::new(TaskMemory {
            store: self.clone(),
            key,
            account,
        })
    }

    /// Waits until `needed` more bytes fit in the pool, spilling first; see the module docs.
    fn admit<'a>(
        &'a self,
        inner: MutexGuard<'a, Inner>,
        needed: u64,
        task: Option<&TaskMemory>,
        what: &str,
    ) -> Result<MutexGuard<'a, Inner>, PoolError> {
        let size = self.pool.size();
        let working_set = task.map(|t| t.account.working_set()).unwrap_or(0) + needed;
        if needed > size || working_set > size {
            return Err(PoolError::NeverFits {
                what: what.to_string(),
                needed: Bytes(working_set.max(needed)),
                size: Bytes(size),
            });
        }
        let mut ticket = None;
        let (mut inner, result) = self.admit_waiting(inner, needed, task, what, &mut ticket);
        if let Some(ticket) = ticket {
            inner.waiters.remove(&ticket);
        }
        result.map(|()| inner)
    }

    fn admit_waiting<'a>(
        &'a self,
        mut inner: MutexGuard<'a, Inner>,
        needed: u64,
        task: Option<&TaskMemory>,
        what: &str,
        ticket: &mut Option<u64>,
    ) -> (MutexGuard<'a, Inner>, Result<(), PoolError>) {
        let size = self.pool.size();
        let started = Instant::now();
        let mut stuck_since: Option<Instant> = None;
        let me = task.map(|t| t.key);
        loop {
            let ahead: u64 = match *ticket {
                Some(mine) => inner.waiters.range(..mine).map(|(_, bytes)| bytes).sum(),
                None => inner.waiters.values().sum(),
            };
            match self.evict(&mut inner, needed + ahead) {
                Ok(true) => return (inner, Ok(())),
                Ok(false) => {}
                Err(e) => return (inner, Err(e.into())),
            }
            let mine = match *ticket {
                Some(t) => t,
                None => {
                    inner.next_ticket += 1;
                    let t = inner.next_ticket;
                    inner.waiters.insert(t, needed);
                    *ticket = Some(t);
                    t
                }
            };
            let others = inner.tasks.keys().filter(|k| Some(**k) != me).count();
            let no_room = |inner: &Inner, reason: String| {
                let tasks: u64 = inner
                    .tasks
                    .iter()
                    .filter(|(k, _)| Some(**k) != me)
                    .map(|(_, a)| a.working_set())
                    .sum();
                let partitions = inner.entries.values().map(Entry::memory_bytes).sum();
                PoolError::NoRoom {
                    what: what.to_string(),
                    needed: Bytes(needed),
                    size: Bytes(size),
                    used: Bytes(self.used(inner)),
                    partitions: Bytes(partitions),
                    tasks: Bytes(tasks),
                    running: others,
                    reason,
                }
            };
            // Only running tasks give memory back. With every other one waiting too (or none
            // running), waiting cannot help: the newest waiter gives way, the others go on.
            let other_waiters = inner.waiters.len() - 1;
            let newest = inner.waiters.keys().next_back() == Some(&mine);
            if other_waiters >= others && newest {
                let since = *stuck_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= DEADLOCK_GRACE {
                    let reason = if others == 0 {
                        "no other task is running to give memory back".to_string()
                    } else {
                        format!(
                            "every other running task is waiting for memory too, so this one gives way instead of deadlocking (waited {:.1?})",
                            started.elapsed()
                        )
                    };
                    let error = no_room(&inner, reason);
                    return (inner, Err(error));
                }
            } else {
                stuck_since = None;
            }
            if started.elapsed() >= ADMISSION_TIMEOUT {
                let reason = format!(
                    "gave up after waiting {:.1?} for running tasks to give memory back",
                    started.elapsed()
                );
                let error = no_room(&inner, reason);
                return (inner, Err(error));
            }
            inner = self
                .changed
                .wait_timeout(inner, RECHECK)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Spills partitions until the pool is within its size again, if it can; never waits.
    fn relieve(&self) -> Result<(), SpillError> {
        let mut inner = self.lock();
        self.evict(&mut inner, 0).map(|_| ())
    }
}

/// A running task's share of the pool: its account, leases and the partitions it holds.
/// Dropping it (when the task ends) returns its leases and wakes tasks waiting for memory.
pub struct TaskMemory {
    store: Arc<PartitionStore>,
    key: u64,
    account: Arc<Account>,
}

impl std::fmt::Debug for TaskMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskMemory")
            .field("account", &self.account)
            .finish_non_exhaustive()
    }
}

impl TaskMemory {
    pub fn account(&self) -> &Arc<Account> {
        &self.account
    }

    pub fn store(&self) -> &Arc<PartitionStore> {
        &self.store
    }

    /// Reserves `bytes` of the pool for this task until the lease is dropped: spills
    /// partitions nobody holds to make room, waits for other tasks to give memory back, and
    /// fails with the sizes named when the task's working set can never fit or waiting would
    /// deadlock. Blocking.
    pub fn lease(self: &Arc<Self>, bytes: u64) -> Result<Lease, PoolError> {
        let what = format!("task {} (a lease of {})", self.account.name(), Bytes(bytes));
        let inner = self.store.lock();
        // What the lease adds to the pool's use: the growth of the task's unfilled leases.
        let needed = (self.account.leased() + bytes)
            .saturating_sub(self.account.claimed())
            .saturating_sub(self.account.unfilled_lease());
        let working_set = self
            .account
            .working_set()
            .max(self.account.leased() + bytes);
        if working_set > self.store.pool.size() {
            return Err(PoolError::NeverFits {
                what,
                needed: Bytes(working_set),
                size: Bytes(self.store.pool.size()),
            });
        }
        let inner = self.store.admit(inner, needed, Some(self), &what)?;
        self.account.add_lease(bytes);
        drop(inner);
        Ok(Lease {
            task: self.clone(),
            bytes,
        })
    }

    /// Counts the buffers of a table this task made (an operator's result, a read) and, when
    /// the pool overflows, spills partitions nobody holds. Fails when the task's working set
    /// alone exceeds the pool: it could never finish.
    pub fn track(&self, batch: &arrow::record_batch::RecordBatch) -> Result<(), PoolError> {
        self.account.claim(batch);
        self.check()
    }

    /// Counts the buffers of a column this task made; see [`TaskMemory::track`].
    pub fn track_array(&self, array: &dyn arrow::array::Array) -> Result<(), PoolError> {
        self.account.claim_array(array);
        self.check()
    }

    fn check(&self) -> Result<(), PoolError> {
        let size = self.store.pool.size();
        let working_set = self.account.claimed();
        if working_set > size {
            return Err(PoolError::NeverFits {
                what: format!("task {}", self.account.name()),
                needed: Bytes(working_set),
                size: Bytes(size),
            });
        }
        if self.store.pool.claimed() > size {
            self.store.relieve()?;
        }
        Ok(())
    }

    /// Pool statistics, as a task sees them.
    pub fn stats(&self) -> PoolStats {
        self.store.stats().pool
    }
}

impl Drop for TaskMemory {
    fn drop(&mut self) {
        let mut inner = self.store.lock();
        inner.tasks.remove(&self.key);
        // Waking is a system call even with nobody waiting: most tasks end with no admission
        // waiting for memory (one that starts waiting after this sees the task gone).
        let waiting = !inner.waiters.is_empty();
        drop(inner);
        if waiting {
            self.store.changed.notify_all();
        }
    }
}

/// Pool bytes reserved for a task until dropped.
#[derive(Debug)]
pub struct Lease {
    task: Arc<TaskMemory>,
    bytes: u64,
}

impl Lease {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.task.account.remove_lease(self.bytes);
        self.task.store.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float64Array, Int64Array};
    use arrow::record_batch::RecordBatch;

    fn id(job: &str, task: u32) -> PartitionId {
        PartitionId {
            job_id: job.into(),
            stage: 0,
            task,
            output: 0,
        }
    }

    /// A table of `rows` f64 values (8 bytes each) tagged with `tag`.
    fn table(rows: usize, tag: f64) -> Table {
        let batch =
            RecordBatch::try_from_iter([("x", Arc::new(Float64Array::from(vec![tag; rows])) as _)])
                .unwrap();
        Table::new(batch)
    }

    fn store(pool: u64) -> (Arc<PartitionStore>, tempfile::TempDir) {
        let root = tempfile::tempdir().unwrap();
        let spill = SpillDir::open(root.path(), "test").unwrap();
        (Arc::new(PartitionStore::new(pool, spill)), root)
    }

    fn spill_files(store: &PartitionStore) -> usize {
        std::fs::read_dir(store.spill_dir().path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".arrows")
            })
            .count()
    }

    #[test]
    fn release_drops_only_that_job() {
        let (store, _dir) = store(1 << 30);
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
            store.get(&id("a", 0), None).unwrap().is_some(),
            "only task 1's outputs went"
        );
        assert_eq!(store.release_job("a"), 1);
        assert!(store.get(&id("a", 0), None).unwrap().is_none());
        assert!(store.get(&id("b", 0), None).unwrap().is_some());
    }

    #[test]
    fn the_least_recently_used_unheld_partition_spills_first() {
        // Room for two 80 KB partitions, not three.
        let (store, _dir) = store(200_000);
        store.insert(id("j", 0), table(10_000, 0.0));
        store.insert(id("j", 1), table(10_000, 1.0));
        // Partition 0 is used again, and a task holds partition 1: neither may go first...
        assert!(store.get(&id("j", 0), None).unwrap().is_some());
        let held = store.get(&id("j", 1), None).unwrap().unwrap();
        store.insert(id("j", 2), table(10_000, 2.0));
        // ...so the least recently used one nobody holds is 0, after 1 was used.
        let stats = store.stats();
        assert_eq!(stats.spilled_partitions, 1);
        assert_eq!(stats.pool.spills, 1);
        assert!(stats.pool.used <= 200_000, "{stats:?}");
        assert!(stats.pool.spilled_disk >= 80_000);
        assert_eq!(spill_files(&store), 1);
        drop(held);
        // Partition 0 comes back transparently, intact, and something else makes room.
        let back = store
            .get(&id("j", 0), None)
            .unwrap()
            .unwrap()
            .host()
            .unwrap();
        let values = back
            .batch()
            .column(0)
            .as_any()
            .downcast_ref::<Float64Array>()
            .unwrap();
        assert!(values.iter().all(|v| v == Some(0.0)));
        let stats = store.stats();
        assert_eq!(stats.pool.unspills, 1);
        assert_eq!(stats.spilled_partitions, 1, "another one went out for it");
        assert!(stats.pool.peak >= stats.pool.used);
        assert!(stats.pool.spill_seconds > 0.0);
    }

    #[test]
    fn spill_files_go_with_their_partitions() {
        let (store, _dir) = store(100_000);
        for task in 0..4 {
            store.insert(id("j", task), table(10_000, task as f64));
        }
        store.insert(id("k", 0), table(10_000, 9.0));
        assert!(spill_files(&store) >= 3);
        store.release_task("j", 0, 0);
        store.release_job("j");
        assert_eq!(spill_files(&store), 0, "released partitions leave no file");
        assert_eq!(store.stats().partitions, 1);
    }

    #[test]
    fn a_spilled_partition_is_served_from_its_file() {
        let (store, _dir) = store(100_000);
        store.insert(id("j", 0), table(10_000, 4.0));
        store.insert(id("j", 1), table(10_000, 5.0));
        assert_eq!(store.stats().spilled_partitions, 1);
        let stream = store.ipc_stream(&id("j", 0)).unwrap().unwrap();
        assert_eq!(stream.len(), 1, "the file's bytes as one segment");
        let batch = crate::table::decode_ipc_buffer(stream[0].clone()).unwrap();
        assert_eq!(batch, table(10_000, 4.0).batch().clone());
        // One in memory goes out as its own buffers.
        let held = store.ipc_stream(&id("j", 1)).unwrap().unwrap();
        let values = table(10_000, 5.0);
        let joined: Vec<u8> = held.iter().flat_map(|s| s.to_vec()).collect();
        assert_eq!(
            crate::table::decode_ipc(&joined).unwrap(),
            values.batch().clone()
        );
        assert_eq!(
            store.stats().pool.unspills,
            0,
            "served without reading it back"
        );
    }

    /// A GPU task's output is stored on the device: a task here gets it without a copy, a
    /// peer's fetch copies it to host memory once (claimed by the store), and once it has a
    /// host copy and nobody reads it, it spills to disk like any partition, its device memory
    /// freed.
    #[test]
    fn a_device_table_stays_on_the_device_until_host_memory_needs_it() {
        use crate::gpu::resident::ResidentTable;
        use crate::gpu::{DeviceCounters, Direction, GpuRuntime, emulator};
        if emulator::skipped_without_compiler("a_device_table_stays_on_the_device") {
            return;
        }
        let runtime = GpuRuntime::emulated(None, DeviceCounters::default()).unwrap();
        let downloads = || runtime.transfers.totals(Direction::ToHost).1;
        // Room for two 80 KB partitions, not three.
        let (store, _dir) = store(200_000);
        let original = table(10_000, 3.0);
        let made = crate::gpu::table::upload(&runtime, original.batch()).unwrap();
        let task = store.begin_task("j/0/0");
        let output = ResidentTable::new(&runtime, made, None, Some(task.account().clone()));
        store.insert(id("j", 0), TaskTable::Device(output));
        drop(task);

        match store.get(&id("j", 0), None).unwrap() {
            Some(TaskTable::Device(stored)) => assert!(stored.on_device()),
            other => panic!("expected the device table, got {other:?}"),
        }
        assert_eq!(downloads(), 0);
        assert_eq!(store.stats().bytes, 0, "nothing of it in host memory");

        for _ in 0..2 {
            let stream = store.ipc_stream(&id("j", 0)).unwrap().unwrap();
            let joined: Vec<u8> = stream.iter().flat_map(|s| s.to_vec()).collect();
            assert_eq!(
                crate::table::decode_ipc(&joined).unwrap(),
                original.batch().clone()
            );
        }
        assert_eq!(downloads(), 1, "copied once, then served from the copy");
        let stats = store.stats();
        assert!(stats.bytes >= 80_000, "{stats:?}");
        assert!(
            stats.pool.used >= 80_000,
            "the store claims the copy: {stats:?}"
        );

        store.insert(id("j", 1), table(10_000, 1.0));
        store.insert(id("j", 2), table(10_000, 2.0));
        let stats = store.stats();
        assert_eq!(stats.spilled_partitions, 1, "{stats:?}");
        assert_eq!(spill_files(&store), 1);
        assert_eq!(
            runtime.resident.counts(),
            (0, 0),
            "its device copy went too"
        );
        match store.get(&id("j", 0), None).unwrap() {
            Some(TaskTable::Host(back)) => assert_eq!(back.batch(), original.batch()),
            other => panic!("expected it read back from disk, got {other:?}"),
        }
        assert_eq!(downloads(), 1);
    }

    #[test]
    fn leases_spill_others_and_a_lease_that_can_never_fit_fails_naming_sizes() {
        let (store, _dir) = store(200_000);
        store.insert(id("j", 0), table(10_000, 0.0));
        store.insert(id("j", 1), table(10_000, 1.0));
        let task = store.begin_task("j/1/0");
        let lease = task.lease(150_000).unwrap();
        assert_eq!(store.stats().spilled_partitions, 2, "both made room");
        assert_eq!(store.stats().pool.leased, 150_000);
        let err = task.lease(100_000).unwrap_err().to_string();
        assert!(err.contains("can never fit"), "{err}");
        assert!(err.contains("250000 bytes"), "{err}");
        assert!(err.contains("200000 bytes"), "{err}");
        drop(lease);
        assert_eq!(store.stats().pool.leased, 0);
        drop(task);
        assert!(store.stats().pool.used < 1000);
    }

    /// A later admission does not take the memory an earlier one waits for: with a task
    /// waiting for 100 KB and 50 KB free, a new task asking for 50 KB waits too, and both get
    /// theirs once memory is given back.
    #[test]
    fn a_later_admission_does_not_take_memory_an_earlier_one_waits_for() {
        let (store, _dir) = store(300_000);
        let (a, b, c) = (
            store.begin_task("a"),
            store.begin_task("b"),
            store.begin_task("c"),
        );
        let _held_by_a = a.lease(100_000).unwrap();
        let held_by_b = b.lease(150_000).unwrap();
        let more_for_a = std::thread::spawn(move || a.lease(100_000).map(|l| l.bytes()));
        while store.lock().waiters.is_empty() {
            std::thread::sleep(Duration::from_millis(5));
        }
        let first_for_c = std::thread::spawn(move || c.lease(50_000).map(|l| l.bytes()));
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            !first_for_c.is_finished(),
            "the later lease took the memory the earlier one waits for"
        );
        assert!(!more_for_a.is_finished());
        drop(held_by_b);
        assert_eq!(more_for_a.join().unwrap().unwrap(), 100_000);
        assert_eq!(first_for_c.join().unwrap().unwrap(), 50_000);
    }

    #[test]
    fn two_tasks_each_holding_half_and_wanting_more_do_not_deadlock() {
        let (store, _dir) = store(200_000);
        let a = store.begin_task("a");
        let b = store.begin_task("b");
        let lease_a = a.lease(100_000).unwrap();
        let lease_b = b.lease(100_000).unwrap();
        let started = Instant::now();
        let waiter = {
            let a = a.clone();
            std::thread::spawn(move || {
                let more = a.lease(50_000);
                (more.map(|l| l.bytes()), lease_a)
            })
        };
        // b asks too while a waits: one of them gives way with a clear error.
        std::thread::sleep(Duration::from_millis(50));
        let b_more = b.lease(50_000);
        let err = b_more.unwrap_err();
        assert!(err.retriable());
        let text = err.to_string();
        assert!(text.contains("instead of deadlocking"), "{text}");
        assert!(text.contains("100000 bytes"), "{text}");
        // b ends (its leases go), and a gets its memory.
        drop(lease_b);
        drop(b);
        let (a_more, _lease_a) = waiter.join().unwrap();
        assert_eq!(a_more.unwrap(), 50_000);
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_task_alone_that_cannot_get_room_fails_soon_without_waiting_out_the_timeout() {
        let (store, _dir) = store(200_000);
        let a = store.begin_task("a");
        assert!(store.get(&id("none", 0), Some(&a)).unwrap().is_none());
        // Something outside any task (a transfer, say) holds an 80 KB partition.
        store.insert(id("j", 0), table(10_000, 0.0));
        let held = store.get(&id("j", 0), None).unwrap().unwrap();
        let started = Instant::now();
        let err = a.lease(150_000).unwrap_err();
        assert!(err.retriable());
        let text = err.to_string();
        assert!(text.contains("no other task is running"), "{text}");
        assert!(text.contains("150000 bytes"), "{text}");
        assert!(started.elapsed() < Duration::from_secs(2));
        // Once it is let go, the same lease spills it and fits.
        drop(held);
        let lease = a.lease(150_000).unwrap();
        assert_eq!(lease.bytes(), 150_000);
        assert_eq!(store.stats().spilled_partitions, 1);
    }

    #[test]
    fn tracking_a_working_set_larger_than_the_pool_fails() {
        let (store, _dir) = store(100_000);
        let task = store.begin_task("t");
        let small = table(1_000, 1.0);
        task.track(small.batch()).unwrap();
        let big = table(20_000, 1.0);
        let err = task.track(big.batch()).unwrap_err().to_string();
        assert!(err.contains("more than the whole memory pool"), "{err}");
    }
}

//! The pool's accounting: how many bytes the worker's tables hold, who holds them, and the
//! counters behind the pool statistics.
//!
//! Every Arrow buffer the worker keeps is *claimed* by an [`Account`] through Arrow's memory-pool
//! hook (`Array::claim`): the buffer carries a reservation that is returned when its last
//! reference drops, and claiming a buffer again moves its reservation instead of counting it
//! twice. Bytes are therefore counted once however many tables share a buffer, and released
//! exactly when the memory is. The partition store has one account; every running task has
//! its own, which also records the task's leases (bytes reserved ahead of use).
//!
//! The accounting is device-agnostic: a device pool counts device buffers with the same
//! accounts, with its own [`Tier`]s to spill to.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arrow::array::Array;
use arrow_buffer::{MemoryPool as ArrowPool, MemoryReservation};

use super::buffers::BufferPool;
use arrow::record_batch::RecordBatch;

/// Where spilled data goes. The CPU backend spills host memory to disk; a device pool spills
/// device memory to host memory, then to disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    Host,
    Disk,
}

impl Tier {
    pub const ALL: [Tier; 2] = [Tier::Host, Tier::Disk];

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

/// A snapshot of the pool's statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PoolStats {
    /// The configured size of the pool.
    pub size: u64,
    /// Bytes held now: claimed buffers plus the unused part of leases.
    pub used: u64,
    /// The most `used` has been.
    pub peak: u64,
    /// Bytes of resident partitions in the store.
    pub partition_bytes: u64,
    /// Bytes reserved by leases of running tasks.
    pub leased: u64,
    /// Bytes of partitions spilled now, to host memory and to disk.
    pub spilled_host: u64,
    pub spilled_disk: u64,
    /// Partitions moved out of the pool, and back in, since the worker started.
    pub spills: u64,
    pub unspills: u64,
    /// Bytes moved out to host memory and to disk, and back in, since the worker started.
    pub spilled_host_total: u64,
    pub spilled_disk_total: u64,
    pub unspilled_bytes_total: u64,
    /// Time spent moving partitions out and back in.
    pub spill_seconds: f64,
    pub unspill_seconds: f64,
}

/// A counter of claimed bytes that Arrow buffers report to.
#[derive(Debug, Default)]
struct Counter(AtomicU64);

impl Counter {
    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// One holder of pool memory: the partition store, or one running task.
#[derive(Debug)]
pub struct Account {
    name: String,
    claimed: Arc<Counter>,
    leased: AtomicU64,
    pool: Arc<PoolCounters>,
}

impl Account {
    /// Bytes of the buffers this account claimed that are still alive.
    pub fn claimed(&self) -> u64 {
        self.claimed.get()
    }

    pub fn leased(&self) -> u64 {
        self.leased.load(Ordering::Relaxed)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// What this holder needs beyond what it already holds: the part of its leases not yet
    /// filled by claimed buffers.
    pub fn unfilled_lease(&self) -> u64 {
        self.leased().saturating_sub(self.claimed())
    }

    /// The holder's working set: its leases, or what it holds if that is more.
    pub fn working_set(&self) -> u64 {
        self.leased().max(self.claimed())
    }

    pub(crate) fn add_lease(&self, bytes: u64) {
        self.leased.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn remove_lease(&self, bytes: u64) {
        let _ = self
            .leased
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(bytes))
            });
    }

    /// Claims every buffer of `batch` for this account (moving claims other accounts hold).
    pub fn claim(self: &Arc<Self>, batch: &RecordBatch) {
        let claims = Claims(self.clone());
        for column in batch.columns() {
            column.claim(&claims);
        }
        self.pool.observe_claims();
    }

    /// Claims the buffers of one array.
    pub fn claim_array(self: &Arc<Self>, array: &dyn Array) {
        array.claim(&Claims(self.clone()));
        self.pool.observe_claims();
    }
}

/// Counters shared by every account of one pool.
#[derive(Debug, Default)]
pub(crate) struct PoolCounters {
    claimed: Counter,
    peak: AtomicU64,
}

impl PoolCounters {
    fn observe_claims(&self) {
        self.peak.fetch_max(self.claimed.get(), Ordering::Relaxed);
    }
}

/// Arrow's view of an account: reservations add to the account and the pool.
#[derive(Debug)]
struct Claims(Arc<Account>);

#[derive(Debug)]
struct Reservation {
    size: u64,
    account: Arc<Counter>,
    pool: Arc<PoolCounters>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.account.0.fetch_sub(self.size, Ordering::Relaxed);
        self.pool.claimed.0.fetch_sub(self.size, Ordering::Relaxed);
    }
}

impl MemoryReservation for Reservation {
    fn size(&self) -> usize {
        self.size as usize
    }

    fn resize(&mut self, new_size: usize) {
        let new_size = new_size as u64;
        if new_size >= self.size {
            let grow = new_size - self.size;
            self.account.0.fetch_add(grow, Ordering::Relaxed);
            self.pool.claimed.0.fetch_add(grow, Ordering::Relaxed);
        } else {
            let shrink = self.size - new_size;
            self.account.0.fetch_sub(shrink, Ordering::Relaxed);
            self.pool.claimed.0.fetch_sub(shrink, Ordering::Relaxed);
        }
        self.size = new_size;
    }
}

impl ArrowPool for Claims {
    fn reserve(&self, size: usize) -> Box<dyn MemoryReservation> {
        let size = size as u64;
        self.0.claimed.0.fetch_add(size, Ordering::Relaxed);
        self.0.pool.claimed.0.fetch_add(size, Ordering::Relaxed);
        Box::new(Reservation {
            size,
            account: self.0.claimed.clone(),
            pool: self.0.pool.clone(),
        })
    }

    fn available(&self) -> isize {
        isize::MAX
    }

    fn used(&self) -> usize {
        self.0.claimed() as usize
    }

    fn capacity(&self) -> usize {
        usize::MAX
    }
}

/// Spill and unspill counters.
#[derive(Debug, Default)]
struct Movement {
    count: AtomicU64,
    bytes: AtomicU64,
    nanos: AtomicU64,
}

impl Movement {
    fn record(&self, bytes: u64, took: Duration) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.nanos
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    fn seconds(&self) -> f64 {
        self.nanos.load(Ordering::Relaxed) as f64 / 1e9
    }
}

/// The accounting of one worker's pool.
#[derive(Debug)]
pub struct Pool {
    size: u64,
    counters: Arc<PoolCounters>,
    /// Free blocks kept for reuse count as used, and are the first to go under pressure.
    buffers: Option<Arc<BufferPool>>,
    spills: Movement,
    unspills: Movement,
}

impl Pool {
    pub fn new(size: u64) -> Self {
        Pool {
            size: size.max(1),
            counters: Arc::default(),
            buffers: None,
            spills: Movement::default(),
            unspills: Movement::default(),
        }
    }

    /// The same pool, counting the free blocks `buffers` keeps for reuse.
    pub fn with_buffers(self, buffers: Arc<BufferPool>) -> Self {
        Pool {
            buffers: Some(buffers),
            ..self
        }
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Releases the free blocks kept for reuse; returns the bytes released.
    pub fn release_buffers(&self) -> u64 {
        self.buffers.as_ref().map(|b| b.trim(0)).unwrap_or(0)
    }

    /// A new holder of pool memory.
    pub fn account(&self, name: impl Into<String>) -> Arc<Account> {
        Arc::new(Account {
            name: name.into(),
            claimed: Arc::default(),
            leased: AtomicU64::new(0),
            pool: self.counters.clone(),
        })
    }

    /// Bytes of live claimed buffers, whoever claimed them.
    pub fn claimed(&self) -> u64 {
        self.counters.claimed.get()
    }

    /// Bytes in use given the unfilled leases of `accounts` (the running tasks): what admission
    /// decisions compare with the size. Records the peak.
    pub fn used<'a>(&self, accounts: impl IntoIterator<Item = &'a Arc<Account>>) -> u64 {
        let cached = self.buffers.as_ref().map(|b| b.stats().cached_bytes);
        let used = self.claimed()
            + cached.unwrap_or(0)
            + accounts
                .into_iter()
                .map(|a| a.unfilled_lease())
                .sum::<u64>();
        self.counters.peak.fetch_max(used, Ordering::Relaxed);
        used
    }

    pub fn peak(&self) -> u64 {
        self.counters.peak.load(Ordering::Relaxed)
    }

    pub fn record_spill(&self, bytes: u64, took: Duration) {
        self.spills.record(bytes, took);
    }

    pub fn record_unspill(&self, bytes: u64, took: Duration) {
        self.unspills.record(bytes, took);
    }

    /// The statistics, given the current usage figures the store knows.
    pub fn stats(
        &self,
        used: u64,
        partition_bytes: u64,
        leased: u64,
        spilled: [u64; 2],
    ) -> PoolStats {
        PoolStats {
            size: self.size,
            used,
            peak: self.peak().max(used),
            partition_bytes,
            leased,
            spilled_host: spilled[0],
            spilled_disk: spilled[1],
            spills: self.spills.count.load(Ordering::Relaxed),
            unspills: self.unspills.count.load(Ordering::Relaxed),
            // The CPU backend spills host memory to disk only.
            spilled_host_total: 0,
            spilled_disk_total: self.spills.bytes.load(Ordering::Relaxed),
            unspilled_bytes_total: self.unspills.bytes.load(Ordering::Relaxed),
            spill_seconds: self.spills.seconds(),
            unspill_seconds: self.unspills.seconds(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float64Array, Int64Array};

    fn batch(rows: usize) -> RecordBatch {
        RecordBatch::try_from_iter([
            (
                "x",
                Arc::new(Int64Array::from_iter_values(0..rows as i64)) as _,
            ),
            (
                "y",
                Arc::new(Float64Array::from_iter_values((0..rows).map(|v| v as f64))) as _,
            ),
        ])
        .unwrap()
    }

    #[test]
    fn claims_count_each_buffer_once_and_end_with_it() {
        let pool = Pool::new(1 << 20);
        let store = pool.account("store");
        let task = pool.account("task");
        let table = batch(1000);
        // Two columns of 1000 eight-byte values, no validity buffers.
        let bytes = 16_000;
        store.claim(&table);
        assert_eq!(pool.claimed(), bytes);
        assert_eq!(store.claimed(), bytes);
        // A second table sharing the same buffers moves the claim rather than adding one.
        let shared = table.project(&[1, 0]).unwrap();
        task.claim(&shared);
        assert_eq!(pool.claimed(), bytes);
        assert_eq!(task.claimed(), bytes);
        assert_eq!(store.claimed(), 0);
        drop(table);
        assert_eq!(
            pool.claimed(),
            bytes,
            "the projection still holds the buffers"
        );
        drop(shared);
        assert_eq!(pool.claimed(), 0);
        assert_eq!(task.claimed(), 0);
        assert_eq!(pool.peak(), bytes);
    }

    #[test]
    fn unfilled_leases_count_as_used() {
        let pool = Pool::new(1 << 20);
        let task = pool.account("task");
        task.add_lease(10_000);
        assert_eq!(pool.used([&task]), 10_000);
        let table = batch(100);
        let bytes = 1_600;
        task.claim(&table);
        assert_eq!(pool.used([&task]), 10_000, "claims fill the lease");
        assert_eq!(task.working_set(), 10_000);
        task.remove_lease(10_000);
        assert_eq!(pool.used([&task]), bytes);
        assert_eq!(task.working_set(), bytes);
    }
}

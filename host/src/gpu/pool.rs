//! The worker's device memory pool: one per worker, a fixed budget of device memory carved from
//! CUDA's stream-ordered allocator (`cuMemAllocAsync` on the device's default `cuMemPool`, kept
//! warm by raising its release threshold to the budget), with statistics and an eviction hook.
//!
//! The API is deliberately small so the worker's memory manager (the pool and spiller of issue 5)
//! can own policy: [`DevicePool::alloc`] reserves bytes against the budget and, when they do not
//! fit, asks the [`EvictionHook`] to free at least the shortfall (by spilling device tables to
//! host memory or disk) before failing with [`PoolError::Exhausted`]; every [`DeviceBuffer`]
//! returns its bytes when dropped; [`DevicePool::stats`] reports size, use, peak and evictions.
//! The budget accounting ([`Accounting`]) is plain Rust and is tested without a GPU. On the
//! emulated device the buffers are host memory under the same budget.

use std::sync::{Arc, Mutex, RwLock};

use cudarc::driver::sys;

use super::backend::{Backend, Memory};

/// Frees device memory on request: the spiller implements it. `evict` is called with the bytes
/// missing for an allocation and returns how many bytes it released (it may release more or
/// less; the pool retries once after it returns).
pub trait EvictionHook: Send + Sync {
    fn evict(&self, needed_bytes: u64) -> u64;
}

/// Counters of one pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// The budget.
    pub capacity: u64,
    /// Bytes held by live buffers.
    pub used: u64,
    /// The most ever held at once.
    pub peak: u64,
    pub allocations: u64,
    pub frees: u64,
    /// Allocations refused (budget exhausted even after eviction, or a driver failure).
    pub failed: u64,
    /// Calls to the eviction hook, and the bytes it reported freed.
    pub evictions: u64,
    pub evicted_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error(
        "the device pool is exhausted: {requested} bytes requested, {used} of {capacity} in use (eviction freed {evicted})"
    )]
    Exhausted {
        requested: u64,
        used: u64,
        capacity: u64,
        evicted: u64,
    },
    #[error("the CUDA driver could not allocate {bytes} bytes: {detail}")]
    Driver { bytes: u64, detail: String },
    #[error("configuring the device memory pool failed: {0}")]
    Configure(String),
}

/// The budget of a pool: reservations against a capacity, with statistics.
#[derive(Debug)]
pub struct Accounting {
    state: Mutex<PoolStats>,
}

impl Accounting {
    pub fn new(capacity: u64) -> Self {
        Accounting {
            state: Mutex::new(PoolStats {
                capacity,
                ..PoolStats::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolStats> {
        // A panic while holding the lock leaves consistent counters: recover them.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn try_reserve(&self, bytes: u64) -> Result<(), u64> {
        let mut s = self.lock();
        let wanted = s.used.saturating_add(bytes);
        if wanted <= s.capacity {
            s.used = wanted;
            s.peak = s.peak.max(wanted);
            s.allocations += 1;
            Ok(())
        } else {
            Err(wanted - s.capacity)
        }
    }

    /// Reserves `bytes`, asking `hook` to evict the shortfall once if they do not fit.
    pub fn reserve(&self, bytes: u64, hook: Option<&dyn EvictionHook>) -> Result<(), PoolError> {
        let mut evicted = 0;
        match self.try_reserve(bytes) {
            Ok(()) => return Ok(()),
            Err(shortfall) => {
                if let Some(hook) = hook {
                    evicted = hook.evict(shortfall);
                    let mut s = self.lock();
                    s.evictions += 1;
                    s.evicted_bytes += evicted;
                    drop(s);
                    if self.try_reserve(bytes).is_ok() {
                        return Ok(());
                    }
                }
            }
        }
        let mut s = self.lock();
        s.failed += 1;
        Err(PoolError::Exhausted {
            requested: bytes,
            used: s.used,
            capacity: s.capacity,
            evicted,
        })
    }

    /// Returns `bytes` reserved earlier.
    pub fn release(&self, bytes: u64) {
        let mut s = self.lock();
        s.used = s.used.saturating_sub(bytes);
        s.frees += 1;
    }

    /// Counts an allocation the driver refused after its reservation succeeded.
    fn driver_failed(&self, bytes: u64) {
        let mut s = self.lock();
        s.used = s.used.saturating_sub(bytes);
        s.allocations = s.allocations.saturating_sub(1);
        s.failed += 1;
    }

    pub fn stats(&self) -> PoolStats {
        *self.lock()
    }
}

/// The budget of a worker's pool: `requested` (`--pool-size`) if given, capped so 10% of the
/// device stays free for the CUDA context, loaded kernels and driver scratch; otherwise 80% of
/// the memory free at start. Returns the size and, when the request was capped, why.
pub fn pool_budget(requested: Option<u64>, total: u64, free: u64) -> (u64, Option<String>) {
    let limit = total - total / 10;
    match requested {
        Some(bytes) if bytes > limit => (
            limit,
            Some(format!(
                "--pool-size {bytes} bytes leaves no headroom on a device of {total} bytes: using {limit} (90%)"
            )),
        ),
        Some(bytes) => (bytes, None),
        None => (free.min(total) / 10 * 8, None),
    }
}

/// Device memory leased from a [`DevicePool`]; its bytes return to the pool when it is dropped.
pub struct DeviceBuffer {
    memory: Memory,
    bytes: u64,
    accounting: Arc<Accounting>,
}

impl DeviceBuffer {
    pub fn memory(&self) -> &Memory {
        &self.memory
    }

    pub fn memory_mut(&mut self) -> &mut Memory {
        &mut self.memory
    }

    /// The bytes this buffer holds against the budget.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        self.accounting.release(self.bytes);
    }
}

/// One worker's device memory.
pub struct DevicePool {
    backend: Arc<Backend>,
    accounting: Arc<Accounting>,
    hook: RwLock<Option<Arc<dyn EvictionHook>>>,
}

impl DevicePool {
    /// A pool of `capacity` bytes on `backend`. On a CUDA device, raises the release threshold
    /// of the device's default memory pool to `capacity`, so freed blocks stay mapped for reuse
    /// instead of going back to the driver at every synchronisation.
    pub fn new(backend: Arc<Backend>, capacity: u64) -> Result<Self, PoolError> {
        if let Backend::Cuda { context, .. } = &*backend
            && context.has_async_alloc()
        {
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            let mut threshold: u64 = capacity;
            // SAFETY: `pool` receives the device's default pool handle, which lives as long as
            // the context; the attribute value is a `u64` as the driver API documents.
            unsafe {
                context
                    .bind_to_thread()
                    .map_err(|e| PoolError::Configure(e.to_string()))?;
                sys::cuDeviceGetDefaultMemPool(&mut pool, context.cu_device())
                    .result()
                    .map_err(|e| PoolError::Configure(e.to_string()))?;
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    (&mut threshold as *mut u64).cast(),
                )
                .result()
                .map_err(|e| PoolError::Configure(e.to_string()))?;
            }
        }
        Ok(DevicePool {
            backend,
            accounting: Arc::new(Accounting::new(capacity)),
            hook: RwLock::new(None),
        })
    }

    /// Installs the memory manager's eviction hook.
    pub fn set_eviction_hook(&self, hook: Arc<dyn EvictionHook>) {
        *self.hook.write().unwrap_or_else(|e| e.into_inner()) = Some(hook);
    }

    /// `bytes` of uninitialised device memory (at least one byte is allocated, so every buffer
    /// has a valid address).
    pub fn alloc(&self, bytes: u64) -> Result<DeviceBuffer, PoolError> {
        let hook = self.hook.read().unwrap_or_else(|e| e.into_inner()).clone();
        self.accounting.reserve(bytes, hook.as_deref())?;
        match self.backend.alloc(bytes as usize) {
            Ok(memory) => Ok(DeviceBuffer {
                memory,
                bytes,
                accounting: self.accounting.clone(),
            }),
            Err(detail) => {
                self.accounting.driver_failed(bytes);
                Err(PoolError::Driver { bytes, detail })
            }
        }
    }

    pub fn stats(&self) -> PoolStats {
        self.accounting.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Frees what it is asked for by releasing bytes it holds in the pool.
    struct Spiller {
        accounting: Arc<Accounting>,
        held: AtomicU64,
    }

    impl EvictionHook for Spiller {
        fn evict(&self, needed: u64) -> u64 {
            let freed = needed.min(self.held.load(Ordering::SeqCst));
            self.held.fetch_sub(freed, Ordering::SeqCst);
            self.accounting.release(freed);
            freed
        }
    }

    #[test]
    fn reservations_respect_the_budget_and_track_the_peak() {
        let pool = Accounting::new(100);
        pool.reserve(60, None).unwrap();
        pool.reserve(40, None).unwrap();
        let err = pool.reserve(1, None).unwrap_err().to_string();
        assert!(
            err.contains("1 bytes requested, 100 of 100 in use"),
            "{err}"
        );
        pool.release(60);
        pool.reserve(30, None).unwrap();
        let stats = pool.stats();
        assert_eq!(
            (stats.used, stats.peak, stats.allocations, stats.frees),
            (70, 100, 3, 1)
        );
        assert_eq!(stats.failed, 1);
    }

    #[test]
    fn a_full_pool_asks_the_hook_for_the_shortfall_once() {
        let accounting = Arc::new(Accounting::new(100));
        accounting.reserve(90, None).unwrap();
        let spiller = Spiller {
            accounting: accounting.clone(),
            held: AtomicU64::new(50),
        };
        accounting.reserve(30, Some(&spiller)).unwrap();
        let stats = accounting.stats();
        assert_eq!((stats.evictions, stats.evicted_bytes), (1, 20));
        assert_eq!(stats.used, 100);
        // Nothing more to spill than 30: a 200-byte request fails after one eviction attempt.
        let err = accounting.reserve(200, Some(&spiller)).unwrap_err();
        assert!(
            matches!(err, PoolError::Exhausted { evicted: 30, .. }),
            "{err}"
        );
        assert_eq!(accounting.stats().evictions, 2);
    }

    #[test]
    fn the_budget_keeps_headroom() {
        let gib = 1u64 << 30;
        assert_eq!(pool_budget(None, 80 * gib, 79 * gib).0, 79 * gib / 10 * 8);
        assert_eq!(
            pool_budget(Some(40 * gib), 80 * gib, 79 * gib),
            (40 * gib, None)
        );
        let (size, warning) = pool_budget(Some(80 * gib), 80 * gib, 79 * gib);
        assert_eq!(size, 72 * gib);
        assert!(warning.unwrap().contains("no headroom"));
    }
}

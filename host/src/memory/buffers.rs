//! Buffer reuse: operators' output buffers come from size classes of blocks kept by the process
//! instead of a fresh allocation each time.
//!
//! A fresh multi-megabyte allocation is mapped anew by the allocator and every page faults (and
//! is zeroed by the kernel) on first touch; a block that a previous operator's output gave back
//! is already resident. Blocks are handed to Arrow as custom allocations
//! (`Buffer::from_custom_allocation`): when the last array using one drops, the block returns to
//! its class instead of the allocator. Classes are 2^k x {1, 1.25, 1.5, 1.75} bytes from 64 KiB
//! up (at most 25% slack); smaller buffers are cheap to allocate and are not pooled. The blocks
//! kept free are bounded ([`BufferPool::set_limit`]) and counted in the worker's pool; the pool
//! releases them first under pressure ([`BufferPool::trim`]).
//!
//! What goes through it: the output columns of the fused expression evaluator
//! (`cpu/fused.rs`), the hot producer of `with_column`, `evaluate` and filter predicates, and
//! the frames the shuffle receives over TCP (`shuffle/tcp.rs`, read straight into a block
//! through [`bytes::BufMut`]; the pieces decoded from a frame keep using it).

use std::alloc::Layout;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use arrow::buffer::{Buffer, ScalarBuffer};
use arrow::datatypes::ArrowNativeType;

/// The smallest pooled block.
const MIN_BLOCK: usize = 64 << 10;
/// Alignment of every block (Arrow's own).
const ALIGN: usize = 64;
/// Free blocks kept by default, until a worker sets its own limit.
const DEFAULT_LIMIT: u64 = 256 << 20;

/// The size class of a request: (index, block size).
fn class_of(bytes: usize) -> Option<(usize, usize)> {
    if bytes < MIN_BLOCK {
        return None;
    }
    let base = MIN_BLOCK.trailing_zeros() as usize;
    let power = (usize::BITS - 1 - bytes.leading_zeros()) as usize;
    for (step, quarters) in (4..8).enumerate() {
        let size = (1usize << power) / 4 * quarters;
        if size >= bytes {
            return Some(((power - base) * 4 + step, size));
        }
    }
    let size = 1usize.checked_shl(power as u32 + 1)?;
    Some(((power + 1 - base) * 4, size))
}

/// One block of memory from the allocator.
struct Block {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a block is plain memory owned by exactly one holder at a time.
unsafe impl Send for Block {}
// SAFETY: shared references to a block never touch its memory.
unsafe impl Sync for Block {}

impl Block {
    fn allocate(size: usize) -> Option<Block> {
        let layout = Layout::from_size_align(size, ALIGN).ok()?;
        // SAFETY: `layout` has a non-zero size (at least MIN_BLOCK).
        let ptr = NonNull::new(unsafe { std::alloc::alloc(layout) })?;
        Some(Block { ptr, layout })
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: allocated in `allocate` with this layout, and freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Counts of the pool's work, for benchmarks and statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BufferStats {
    /// Blocks handed out again from a class.
    pub reused: u64,
    /// Blocks freshly allocated.
    pub allocated: u64,
    /// Bytes of free blocks kept now.
    pub cached_bytes: u64,
}

/// Free blocks by size class.
#[derive(Default)]
pub struct BufferPool {
    free: Mutex<Vec<Vec<Block>>>,
    cached: AtomicU64,
    limit: AtomicU64,
    reused: AtomicU64,
    allocated: AtomicU64,
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// The process's buffer pool.
pub fn global() -> &'static Arc<BufferPool> {
    static POOL: OnceLock<Arc<BufferPool>> = OnceLock::new();
    POOL.get_or_init(|| Arc::new(BufferPool::with_limit(DEFAULT_LIMIT)))
}

impl BufferPool {
    pub fn with_limit(limit: u64) -> Self {
        BufferPool {
            limit: AtomicU64::new(limit),
            ..Default::default()
        }
    }

    /// Keeps at most `bytes` of free blocks (0 turns reuse off), releasing any excess.
    pub fn set_limit(&self, bytes: u64) {
        self.limit.store(bytes, Ordering::Relaxed);
        self.trim(bytes);
    }

    /// Releases free blocks until at most `keep` bytes are kept; returns the bytes released.
    pub fn trim(&self, keep: u64) -> u64 {
        let mut released = Vec::new();
        if let Ok(mut free) = self.free.lock() {
            // Largest classes first: fewest blocks for the most memory.
            for class in free.iter_mut().rev() {
                while self.cached.load(Ordering::Relaxed) > keep {
                    let Some(block) = class.pop() else { break };
                    self.cached
                        .fetch_sub(block.layout.size() as u64, Ordering::Relaxed);
                    released.push(block);
                }
            }
        }
        released.iter().map(|b| b.layout.size() as u64).sum()
    }

    pub fn stats(&self) -> BufferStats {
        BufferStats {
            reused: self.reused.load(Ordering::Relaxed),
            allocated: self.allocated.load(Ordering::Relaxed),
            cached_bytes: self.cached.load(Ordering::Relaxed),
        }
    }

    fn take(&self, class: usize, size: usize) -> Option<Block> {
        let reused = self
            .free
            .lock()
            .ok()
            .and_then(|mut free| free.get_mut(class).and_then(Vec::pop));
        if let Some(block) = reused {
            self.cached.fetch_sub(size as u64, Ordering::Relaxed);
            self.reused.fetch_add(1, Ordering::Relaxed);
            return Some(block);
        }
        self.allocated.fetch_add(1, Ordering::Relaxed);
        Block::allocate(size)
    }

    fn give_back(&self, block: Block) {
        let size = block.layout.size();
        let Some((class, _)) = class_of(size) else {
            return;
        };
        if self.cached.load(Ordering::Relaxed) + size as u64 > self.limit.load(Ordering::Relaxed) {
            return; // dropped: back to the allocator
        }
        if let Ok(mut free) = self.free.lock() {
            if free.len() <= class {
                free.resize_with(class + 1, Vec::new);
            }
            self.cached.fetch_add(size as u64, Ordering::Relaxed);
            free[class].push(block);
        }
    }
}

/// A block lent to Arrow; it goes back to its pool when the last buffer using it drops.
struct Lent {
    block: Option<Block>,
    pool: Arc<BufferPool>,
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            self.pool.give_back(block);
        }
    }
}

/// A growable vector of `T` whose memory comes from a [`BufferPool`] block when it is large
/// enough to be worth it, and from a plain `Vec` otherwise.
pub struct PooledVec<T: ArrowNativeType> {
    storage: Storage<T>,
}

enum Storage<T> {
    Plain(Vec<T>),
    Pooled {
        block: Block,
        len: usize,
        capacity: usize,
        pool: Arc<BufferPool>,
        _items: PhantomData<T>,
    },
}

impl<T: ArrowNativeType> PooledVec<T> {
    /// Room for `capacity` items, from `pool` when that is at least one block.
    pub fn with_capacity(pool: &Arc<BufferPool>, capacity: usize) -> Self {
        let bytes = capacity.saturating_mul(size_of::<T>());
        let pooled = (pool.limit.load(Ordering::Relaxed) > 0)
            .then(|| class_of(bytes))
            .flatten()
            .and_then(|(class, size)| {
                pool.take(class, size).map(|block| Storage::Pooled {
                    block,
                    len: 0,
                    capacity: size / size_of::<T>().max(1),
                    pool: pool.clone(),
                    _items: PhantomData,
                })
            });
        PooledVec {
            storage: pooled.unwrap_or_else(|| Storage::Plain(Vec::with_capacity(capacity))),
        }
    }

    pub fn len(&self) -> usize {
        match &self.storage {
            Storage::Plain(v) => v.len(),
            Storage::Pooled { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many items fit before the vector must move.
    pub fn capacity(&self) -> usize {
        match &self.storage {
            Storage::Plain(v) => v.capacity(),
            Storage::Pooled { capacity, .. } => *capacity,
        }
    }

    /// Makes room for at least `additional` more items. A pooled vector that outgrows its block
    /// moves its items to a block of the new size and gives the old block back to the pool.
    pub fn reserve(&mut self, additional: usize) {
        let needed = self.len().saturating_add(additional);
        if needed <= self.capacity() {
            return;
        }
        let pool = match &mut self.storage {
            Storage::Plain(v) => return v.reserve(additional),
            Storage::Pooled { pool, .. } => pool.clone(),
        };
        let mut larger = PooledVec::with_capacity(&pool, needed);
        larger.extend_from_slice(self.as_slice());
        if let Storage::Pooled { block, .. } = std::mem::replace(&mut self.storage, larger.storage)
        {
            pool.give_back(block);
        }
    }

    /// Appends `items`; outgrowing a pooled block moves the items to a plain `Vec`.
    pub fn extend_from_slice(&mut self, items: &[T]) {
        if let Storage::Pooled {
            block,
            len,
            capacity,
            ..
        } = &mut self.storage
        {
            if *len + items.len() <= *capacity {
                // SAFETY: the block holds `capacity` items of `T` (aligned to 64, sized in
                // whole items), `len + items.len()` of them fit, and `items` cannot overlap a
                // block only this vector owns.
                unsafe {
                    let dst = block.ptr.as_ptr().cast::<T>().add(*len);
                    std::ptr::copy_nonoverlapping(items.as_ptr(), dst, items.len());
                }
                *len += items.len();
                return;
            }
            let mut plain = Vec::with_capacity(*len + items.len());
            plain.extend_from_slice(self.as_slice());
            self.storage = Storage::Plain(plain);
        }
        if let Storage::Plain(v) = &mut self.storage {
            v.extend_from_slice(items);
        }
    }

    /// Appends every item of `items`; outgrowing a pooled block moves the items to a plain
    /// `Vec`.
    pub fn extend(&mut self, items: impl IntoIterator<Item = T>) {
        let mut items = items.into_iter();
        if let Storage::Pooled {
            block,
            len,
            capacity,
            ..
        } = &mut self.storage
        {
            let base = block.ptr.as_ptr().cast::<T>();
            let mut written = *len;
            while written < *capacity {
                let Some(item) = items.next() else {
                    *len = written;
                    return;
                };
                // SAFETY: the block holds `capacity` items of `T` and `written` is below it.
                unsafe { base.add(written).write(item) };
                written += 1;
            }
            *len = written;
            let mut plain = Vec::with_capacity(written + items.size_hint().0);
            plain.extend_from_slice(self.as_slice());
            self.storage = Storage::Plain(plain);
        }
        if let Storage::Plain(v) = &mut self.storage {
            v.extend(items);
        }
    }

    /// The room past the items, to write more into before [`PooledVec::set_len`] counts them.
    pub fn spare_capacity_mut(&mut self) -> &mut [std::mem::MaybeUninit<T>] {
        match &mut self.storage {
            Storage::Plain(v) => v.spare_capacity_mut(),
            // SAFETY: the block holds `capacity` items of `T`, of which the first `len` are
            // written; the rest is this vector's alone, handed out as uninitialised.
            Storage::Pooled {
                block,
                len,
                capacity,
                ..
            } => unsafe {
                std::slice::from_raw_parts_mut(
                    block
                        .ptr
                        .as_ptr()
                        .cast::<std::mem::MaybeUninit<T>>()
                        .add(*len),
                    *capacity - *len,
                )
            },
        }
    }

    /// Sets the number of items.
    ///
    /// # Safety
    /// `new_len` must be at most the capacity, and the items up to it written (through
    /// [`PooledVec::spare_capacity_mut`]).
    pub unsafe fn set_len(&mut self, new_len: usize) {
        match &mut self.storage {
            // SAFETY: passed on from the caller.
            Storage::Plain(v) => unsafe { v.set_len(new_len) },
            Storage::Pooled { len, capacity, .. } => {
                assert!(new_len <= *capacity, "a length past the block");
                *len = new_len;
            }
        }
    }

    fn as_slice(&self) -> &[T] {
        match &self.storage {
            Storage::Plain(v) => v,
            // SAFETY: the first `len` items of the block were written by `extend_from_slice`.
            Storage::Pooled { block, len, .. } => unsafe {
                std::slice::from_raw_parts(block.ptr.as_ptr().cast::<T>(), *len)
            },
        }
    }

    /// The items as an Arrow buffer; a pooled block returns to its pool when the buffer (and
    /// every slice of it) drops.
    pub fn into_scalar_buffer(self) -> ScalarBuffer<T> {
        match self.storage {
            Storage::Plain(v) => ScalarBuffer::from(v),
            Storage::Pooled {
                block, len, pool, ..
            } => {
                let ptr = block.ptr;
                let owner = Arc::new(Lent {
                    block: Some(block),
                    pool,
                });
                // SAFETY: `ptr` points to `len` initialised items of `T` in a block that
                // `owner` keeps alive, unmoved and unwritten until Arrow drops the last buffer.
                let buffer =
                    unsafe { Buffer::from_custom_allocation(ptr, len * size_of::<T>(), owner) };
                ScalarBuffer::new(buffer, 0, len)
            }
        }
    }
}

// SAFETY: `chunk_mut` is the block's unwritten tail, exactly `remaining_mut` bytes long, and
// `advance_mut` only counts bytes the caller wrote there. A plain vector defers to `Vec`'s own
// implementation (which grows).
unsafe impl bytes::BufMut for PooledVec<u8> {
    fn remaining_mut(&self) -> usize {
        match &self.storage {
            Storage::Plain(v) => v.remaining_mut(),
            Storage::Pooled { len, capacity, .. } => capacity - len,
        }
    }

    unsafe fn advance_mut(&mut self, count: usize) {
        match &mut self.storage {
            // SAFETY: passed on from the caller.
            Storage::Plain(v) => unsafe { v.advance_mut(count) },
            Storage::Pooled { len, capacity, .. } => {
                assert!(*len + count <= *capacity, "advanced past the block");
                *len += count;
            }
        }
    }

    fn chunk_mut(&mut self) -> &mut bytes::buf::UninitSlice {
        match &mut self.storage {
            Storage::Plain(v) => v.chunk_mut(),
            Storage::Pooled {
                block,
                len,
                capacity,
                ..
            } => {
                // SAFETY: the block is `capacity` bytes this vector alone owns; the range from
                // `len` is inside it.
                unsafe {
                    bytes::buf::UninitSlice::from_raw_parts_mut(
                        block.ptr.as_ptr().add(*len),
                        *capacity - *len,
                    )
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Float64Array;

    #[test]
    fn size_classes_cover_requests_with_at_most_a_quarter_of_slack() {
        assert_eq!(class_of(1000), None);
        assert_eq!(class_of(64 << 10), Some((0, 64 << 10)));
        assert_eq!(class_of((64 << 10) + 1), Some((1, 80 << 10)));
        assert_eq!(class_of(90 << 10), Some((2, 96 << 10)));
        assert_eq!(class_of(100 << 10), Some((3, 112 << 10)));
        assert_eq!(class_of(120 << 10), Some((4, 128 << 10)));
        for bytes in [70_000usize, 1 << 20, 3_000_001, 123_456_789] {
            let (_, size) = class_of(bytes).unwrap();
            assert!(
                size >= bytes && size as f64 <= bytes as f64 * 1.25 + 1.0,
                "{bytes}: {size}"
            );
        }
        // Classes grow with the size.
        let sizes: Vec<usize> = (16..30).map(|p| class_of(1 << p).unwrap().0).collect();
        assert!(sizes.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn a_dropped_column_gives_its_block_to_the_next_one() {
        let pool = Arc::new(BufferPool::with_limit(64 << 20));
        let make = |value: f64| {
            let mut values = PooledVec::<f64>::with_capacity(&pool, 100_000);
            for _ in 0..100 {
                values.extend_from_slice(&[value; 1000]);
            }
            Float64Array::new(values.into_scalar_buffer(), None)
        };
        let first = make(1.0);
        assert!(first.values().iter().all(|v| *v == 1.0));
        assert_eq!(pool.stats().allocated, 1);
        let slice = first.slice(10, 10);
        drop(first);
        assert_eq!(pool.stats().cached_bytes, 0, "a slice still uses the block");
        drop(slice);
        assert!(pool.stats().cached_bytes >= 800_000);
        let second = make(2.0);
        assert_eq!(pool.stats().reused, 1);
        assert_eq!(pool.stats().allocated, 1);
        assert!(second.values().iter().all(|v| *v == 2.0));
        assert_eq!(second.len(), 100_000);
        drop(second);
        let cached = pool.stats().cached_bytes;
        assert_eq!(pool.trim(0), cached);
        assert_eq!(pool.stats().cached_bytes, 0);
    }

    #[test]
    fn outgrowing_a_block_or_reuse_off_falls_back_to_plain_vectors() {
        let pool = Arc::new(BufferPool::with_limit(64 << 20));
        let mut values = PooledVec::<i64>::with_capacity(&pool, 10_000);
        values.extend_from_slice(&vec![7; 10_000]);
        values.extend_from_slice(&vec![8; 10_000]);
        assert_eq!(values.len(), 20_000);
        let buffer = values.into_scalar_buffer();
        assert_eq!(buffer[9_999], 7);
        assert_eq!(buffer[19_999], 8);
        let off = Arc::new(BufferPool::with_limit(0));
        let mut plain = PooledVec::<i64>::with_capacity(&off, 100_000);
        plain.extend_from_slice(&[1; 3]);
        drop(plain.into_scalar_buffer());
        assert_eq!(off.stats(), BufferStats::default());
    }

    #[test]
    fn items_extend_a_block_then_overflow_into_a_plain_vector() {
        let pool = Arc::new(BufferPool::with_limit(64 << 20));
        let mut values = PooledVec::<i32>::with_capacity(&pool, 20_000);
        values.extend(0..20_000);
        assert_eq!(pool.stats().allocated, 1);
        // The block has some slack past 20,000 items; 10,000 more outgrow it.
        values.extend(20_000..30_000);
        let buffer = values.into_scalar_buffer();
        assert_eq!(buffer.len(), 30_000);
        assert!(buffer.iter().enumerate().all(|(i, v)| *v == i as i32));
    }

    #[test]
    fn reserving_past_a_block_moves_the_items_to_a_larger_block() {
        let pool = Arc::new(BufferPool::with_limit(64 << 20));
        let mut values = PooledVec::<u64>::with_capacity(&pool, 10_000);
        values.extend(0..10_000);
        let before = values.capacity();
        values.reserve(before - values.len());
        assert_eq!(values.capacity(), before, "room enough already");
        values.reserve(100_000);
        assert!(values.capacity() >= 110_000);
        assert_eq!(pool.stats().allocated, 2, "a second, larger block");
        assert!(
            pool.stats().cached_bytes >= 80_000,
            "the first block is back in the pool"
        );
        values.extend(10_000..110_000);
        let buffer = values.into_scalar_buffer();
        assert!(buffer.iter().enumerate().all(|(i, v)| *v == i as u64));
        drop(buffer);
        assert!(pool.stats().cached_bytes >= 80_000 + 110_000 * 8);
    }

    #[test]
    fn bytes_read_into_a_block_come_back_as_a_buffer_and_the_block_is_reused() {
        use bytes::BufMut;
        let pool = Arc::new(BufferPool::with_limit(64 << 20));
        let frame: Vec<u8> = (0..195_000u32).map(|i| (i % 251) as u8).collect();
        let read = |frame: &[u8]| {
            let mut into = PooledVec::<u8>::with_capacity(&pool, frame.len());
            assert!(into.remaining_mut() >= frame.len());
            // As a socket read would: in chunks.
            for chunk in frame.chunks(65_536) {
                into.put_slice(chunk);
            }
            assert_eq!(into.len(), frame.len());
            into.into_scalar_buffer().into_inner()
        };
        let buffer = read(&frame);
        assert_eq!(buffer.as_slice(), frame.as_slice());
        drop(buffer);
        // A smaller frame of the same size class takes the same block.
        let again = read(&frame[..170_000]);
        assert_eq!(again.as_slice(), &frame[..170_000]);
        let stats = pool.stats();
        assert_eq!((stats.allocated, stats.reused), (1, 1), "{stats:?}");
        // Small frames are plain vectors, and grow as a `Vec` would.
        let mut small = PooledVec::<u8>::with_capacity(&pool, 10);
        small.put_slice(&frame[..1000]);
        assert_eq!(small.into_scalar_buffer().as_ref(), &frame[..1000]);
    }
}

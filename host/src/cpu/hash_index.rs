//! The build side of a hash join: an index from a key to the build table's rows with that key.
//!
//! The index lives in Arrow buffers, so that a cached index is claimed and counted in the
//! worker's pool like any table (`build_cache`). Three layouts:
//!
//! - integer keys in a narrow range (at most twice as wide as the table is long): a table
//!   indexed by `key - lowest`, no hashing and one memory access per probe;
//! - other integer keys: open addressing with linear probing, each slot holding a key and its
//!   first row side by side (one cache line per probe);
//! - any other key set (Arrow's row format): slots holding a hash and a first row, the keys'
//!   bytes compared on a hash match.
//!
//! Rows with equal keys are chained through `next` in table order; a table whose keys are unique
//! has no chains. Rows with a null key are left out: they never match.

use std::hash::BuildHasher;
use std::sync::Arc;

use arrow::array::{Array, BinaryArray, Int64Array, UInt32Array, UInt64Array};
use arrow::buffer::ScalarBuffer;
use arrow::error::ArrowError;
use hashbrown::DefaultHashBuilder;

use super::keys::EncodedKeys;
use crate::memory::Account;

/// No row: the end of a chain, an empty slot, a probe row without a match.
pub(crate) const END: u32 = u32::MAX;

/// How many probe rows are looked up before their matches are walked: independent lookups in
/// a tight loop let the processor overlap their cache misses.
const PROBE_BATCH: usize = 2048;

/// A build table's rows by key.
pub(crate) struct HashIndex {
    slots: Slots,
    /// The next row with the same key, per row (`END` ends a chain); `None` when keys are unique.
    next: Option<ScalarBuffer<u32>>,
}

enum Slots {
    /// The first row of key `lowest + i` at `heads[i]`.
    Direct {
        lowest: i64,
        heads: ScalarBuffer<u32>,
    },
    /// Pairs of words: a key, then its first row (`END` when the slot is empty).
    Int { bits: u32, slots: ScalarBuffer<u64> },
    /// Pairs of words: a key's hash, then its first row; `keys` holds every row's encoded key.
    Rows {
        bits: u32,
        hasher: DefaultHashBuilder,
        slots: ScalarBuffer<u64>,
        keys: BinaryArray,
    },
}

/// Fibonacci hashing: the top `bits` bits of the key times 2^64 / phi.
#[inline]
fn int_slot(key: i64, bits: u32) -> usize {
    ((key as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - bits)) as usize
}

/// Slots for `rows` keys: a power of two, at most two thirds full.
fn slot_bits(rows: usize) -> u32 {
    (rows + rows / 2)
        .next_power_of_two()
        .max(16)
        .trailing_zeros()
}

/// Links `row` in front of the chain that started at `previous`.
fn chain(next: &mut Option<Vec<u32>>, rows: usize, row: usize, previous: u32) {
    next.get_or_insert_with(|| vec![END; rows])[row] = previous;
}

impl HashIndex {
    /// Indexes every row of `keys` whose key is not null.
    pub(crate) fn build(keys: EncodedKeys) -> Result<Self, ArrowError> {
        let rows = keys.len();
        if rows >= END as usize {
            return Err(ArrowError::InvalidArgumentError(format!(
                "a join's build table has {rows} rows; at most {} are supported",
                END - 1
            )));
        }
        let mut next = None;
        // Inserting from the last row makes every chain run in table order.
        let slots = match keys {
            EncodedKeys::Int(values) => {
                let valid = |row: &usize| !values.is_null(*row);
                match narrow_range(&values) {
                    Some((lowest, width)) => {
                        let mut heads = vec![END; width];
                        for row in (0..rows).rev().filter(valid) {
                            let head = &mut heads[(values.value(row) - lowest) as usize];
                            if *head != END {
                                chain(&mut next, rows, row, *head);
                            }
                            *head = row as u32;
                        }
                        Slots::Direct {
                            lowest,
                            heads: heads.into(),
                        }
                    }
                    None => {
                        let bits = slot_bits(rows - values.null_count());
                        let mask = (1usize << bits) - 1;
                        let mut slots = vec![0u64; 2 << bits];
                        for pair in slots.chunks_exact_mut(2) {
                            pair[1] = END as u64;
                        }
                        for row in (0..rows).rev().filter(valid) {
                            let key = values.value(row);
                            let mut slot = int_slot(key, bits);
                            loop {
                                let pair = &mut slots[2 * slot..2 * slot + 2];
                                if pair[1] == END as u64 {
                                    pair[0] = key as u64;
                                    pair[1] = row as u64;
                                    break;
                                }
                                if pair[0] == key as u64 {
                                    chain(&mut next, rows, row, pair[1] as u32);
                                    pair[1] = row as u64;
                                    break;
                                }
                                slot = (slot + 1) & mask;
                            }
                        }
                        Slots::Int {
                            bits,
                            slots: slots.into(),
                        }
                    }
                }
            }
            EncodedKeys::Rows {
                rows: encoded,
                has_null,
            } => {
                let keys = encoded.try_into_binary()?;
                let hasher = DefaultHashBuilder::default();
                let bits = slot_bits(rows);
                let mask = (1usize << bits) - 1;
                let mut slots = vec![0u64; 2 << bits];
                for pair in slots.chunks_exact_mut(2) {
                    pair[1] = END as u64;
                }
                for row in (0..rows).rev().filter(|&r| !has_null[r]) {
                    let key = keys.value(row);
                    let hash = hasher.hash_one(key);
                    let mut slot = (hash >> (64 - bits)) as usize;
                    loop {
                        let pair = &mut slots[2 * slot..2 * slot + 2];
                        if pair[1] == END as u64 {
                            pair[0] = hash;
                            pair[1] = row as u64;
                            break;
                        }
                        if pair[0] == hash && keys.value(pair[1] as usize) == key {
                            chain(&mut next, rows, row, pair[1] as u32);
                            pair[1] = row as u64;
                            break;
                        }
                        slot = (slot + 1) & mask;
                    }
                }
                Slots::Rows {
                    bits,
                    hasher,
                    slots: slots.into(),
                    keys,
                }
            }
        };
        Ok(HashIndex {
            slots,
            next: next.map(ScalarBuffer::from),
        })
    }

    /// Bytes of the index's buffers.
    pub(crate) fn memory_bytes(&self) -> usize {
        let slots = match &self.slots {
            Slots::Direct { heads, .. } => heads.inner().capacity(),
            Slots::Int { slots, .. } => slots.inner().capacity(),
            Slots::Rows { slots, keys, .. } => {
                slots.inner().capacity() + keys.get_buffer_memory_size()
            }
        };
        slots + self.next.as_ref().map_or(0, |n| n.inner().capacity())
    }

    /// Claims the index's buffers for `account` (so the pool counts them while they live).
    pub(crate) fn claim(&self, account: &Arc<Account>) {
        match &self.slots {
            Slots::Direct { heads, .. } => {
                account.claim_array(&UInt32Array::new(heads.clone(), None));
            }
            Slots::Int { slots, .. } => {
                account.claim_array(&UInt64Array::new(slots.clone(), None));
            }
            Slots::Rows { slots, keys, .. } => {
                account.claim_array(&UInt64Array::new(slots.clone(), None));
                account.claim_array(keys);
            }
        }
        if let Some(next) = &self.next {
            account.claim_array(&UInt32Array::new(next.clone(), None));
        }
    }

    /// The row after `row` with the same key, or `END`.
    #[inline]
    pub(crate) fn next(&self, row: u32) -> u32 {
        match &self.next {
            Some(next) => next[row as usize],
            None => END,
        }
    }

    /// Whether some key has several rows.
    pub(crate) fn has_chains(&self) -> bool {
        self.next.is_some()
    }

    /// Calls `visit(probe row, first matching build row)` for every probe row in order (`END`
    /// when none matches). The probe's keys must be encoded as the build table's were.
    pub(crate) fn probe(&self, probe: &EncodedKeys, mut visit: impl FnMut(usize, u32)) {
        let mut firsts = [END; PROBE_BATCH];
        let rows = probe.len();
        let mut start = 0;
        while start < rows {
            let end = (start + PROBE_BATCH).min(rows);
            let batch = &mut firsts[..end - start];
            self.first_matches(probe, start, batch);
            if let EncodedKeys::Rows { has_null, .. } = probe {
                for (first, null) in batch.iter_mut().zip(&has_null[start..end]) {
                    if *null {
                        *first = END;
                    }
                }
            }
            for (offset, &first) in batch.iter().enumerate() {
                visit(start + offset, first);
            }
            start = end;
        }
    }

    /// The first matching build row of probe rows `start..start + out.len()`, ignoring nulls
    /// of row-encoded keys (the caller masks those).
    fn first_matches(&self, probe: &EncodedKeys, start: usize, out: &mut [u32]) {
        match (&self.slots, probe) {
            (Slots::Direct { lowest, heads }, EncodedKeys::Int(values)) => {
                let width = heads.len() as u64;
                let keys = &values.values()[start..start + out.len()];
                for (first, &key) in out.iter_mut().zip(keys) {
                    let at = key.wrapping_sub(*lowest) as u64;
                    *first = if at < width { heads[at as usize] } else { END };
                }
                mask_nulls(values, start, out);
            }
            (Slots::Int { bits, slots }, EncodedKeys::Int(values)) => {
                let mask = (1usize << bits) - 1;
                let keys = &values.values()[start..start + out.len()];
                for (first, &key) in out.iter_mut().zip(keys) {
                    let mut slot = int_slot(key, *bits);
                    *first = loop {
                        let (slot_key, row) = (slots[2 * slot], slots[2 * slot + 1]);
                        if row == END as u64 {
                            break END;
                        }
                        if slot_key == key as u64 {
                            break row as u32;
                        }
                        slot = (slot + 1) & mask;
                    };
                }
                mask_nulls(values, start, out);
            }
            (
                Slots::Rows {
                    bits,
                    hasher,
                    slots,
                    keys,
                },
                EncodedKeys::Rows { rows, .. },
            ) => {
                let mask = (1usize << bits) - 1;
                for (offset, first) in out.iter_mut().enumerate() {
                    let key = rows.row(start + offset);
                    let key = key.data();
                    let hash = hasher.hash_one(key);
                    let mut slot = (hash >> (64 - bits)) as usize;
                    *first = loop {
                        let (slot_hash, row) = (slots[2 * slot], slots[2 * slot + 1]);
                        if row == END as u64 {
                            break END;
                        }
                        if slot_hash == hash && keys.value(row as usize) == key {
                            break row as u32;
                        }
                        slot = (slot + 1) & mask;
                    };
                }
            }
            // `key_types` gives both sides the same encoding, so the layouts always agree.
            _ => out.fill(END),
        }
    }
}

/// Clears the matches of probe rows whose integer key is null.
fn mask_nulls(values: &Int64Array, start: usize, out: &mut [u32]) {
    if values.null_count() == 0 {
        return;
    }
    for (offset, first) in out.iter_mut().enumerate() {
        if values.is_null(start + offset) {
            *first = END;
        }
    }
}

/// The lowest key and the range's width, when keys span at most twice as many values as there
/// are rows (so a table indexed by value is no larger than a hash table would be).
fn narrow_range(values: &Int64Array) -> Option<(i64, usize)> {
    let lowest = arrow::compute::min(values)?;
    let highest = arrow::compute::max(values)?;
    let width = highest.checked_sub(lowest)?.checked_add(1)?;
    let limit = (2 * values.len()).max(1024) as i64;
    (width <= limit).then_some((lowest, width as usize))
}

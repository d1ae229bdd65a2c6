//! Key columns, as the hashing operators (group-by, distinct, join, hash-partition) see them.
//!
//! One integer-like key column takes a fast path (its values hashed as `i64`); any other key set
//! is encoded with Arrow's row format, whose bytes compare equal exactly when the keys do. The
//! stable partition hash is defined here too: it decides which reducer a key goes to, so it must
//! give the same answer on every worker, backend and version.

use arrow::array::{
    Array, ArrayRef, AsArray, DictionaryArray, GenericStringArray, OffsetSizeTrait,
};
use arrow::compute;
use arrow::datatypes::{DataType, Int32Type, Int64Type};
use arrow::error::ArrowError;
use arrow::row::{RowConverter, Rows, SortField};
use hashbrown::HashMap;
use hashbrown::hash_map::Entry;

use super::dictionary::logical_type;

/// Key columns encoded for hashing and equality.
pub(crate) enum EncodedKeys {
    /// One integer column, widened to `i64`.
    Int(arrow::array::Int64Array),
    /// Any other key set, in Arrow's row format (plus which rows have a null key).
    Rows { rows: Rows, has_null: Vec<bool> },
}

impl EncodedKeys {
    /// Encodes one table's key columns.
    pub(crate) fn encode(keys: &[ArrayRef]) -> Result<Self, ArrowError> {
        let types: Vec<DataType> = keys
            .iter()
            .map(|k| logical_type(k.data_type()).clone())
            .collect();
        Self::encode_as(keys, &types)
    }

    /// Encodes key columns converted to `types` (so that two tables' keys compare; see
    /// [`key_types`]).
    pub(crate) fn encode_as(keys: &[ArrayRef], types: &[DataType]) -> Result<Self, ArrowError> {
        if let ([key], [data_type]) = (keys, types)
            && int_like(data_type)
        {
            let widened = match super::pooled::widen_to_i64(key.as_ref()) {
                Some(widened) => widened,
                None => compute::cast(key, &DataType::Int64)?
                    .as_primitive::<Int64Type>()
                    .clone(),
            };
            return Ok(EncodedKeys::Int(widened));
        }
        let cast = keys
            .iter()
            .zip(types)
            .map(|(k, t)| compute::cast(k, t))
            .collect::<Result<Vec<_>, _>>()?;
        let converter = RowConverter::new(types.iter().cloned().map(SortField::new).collect())?;
        let rows = converter.convert_columns(&cast)?;
        Ok(EncodedKeys::Rows {
            rows,
            has_null: any_null(&cast),
        })
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            EncodedKeys::Int(values) => values.len(),
            EncodedKeys::Rows { rows, .. } => rows.num_rows(),
        }
    }
}

/// Types whose values fit an `i64` exactly (so the fast path loses nothing).
fn int_like(data_type: &DataType) -> bool {
    use DataType::*;
    matches!(
        data_type,
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32
    )
}

/// The type two key columns are compared as (a dictionary-encoded column as its values).
fn key_type(left: &DataType, right: &DataType) -> Option<DataType> {
    let (left, right) = (logical_type(left), logical_type(right));
    if left == right {
        return Some(left.clone());
    }
    if int_like(left) && int_like(right) {
        return Some(DataType::Int64);
    }
    crate::expr::common_type(left, right)
}

/// The types two tables' key columns are encoded as so that equal keys compare equal across
/// them: each pair of columns brought to a common type. Both sides must then be encoded with
/// [`EncodedKeys::encode_as`] and these types: the row encoding of one single integer key and
/// its `i64` form are not comparable.
pub(crate) fn key_types(left: &[ArrayRef], right: &[ArrayRef]) -> Result<Vec<DataType>, String> {
    left.iter()
        .zip(right)
        .map(|(l, r)| {
            key_type(l.data_type(), r.data_type()).ok_or_else(|| {
                format!(
                    "key types {} and {} cannot be compared",
                    l.data_type(),
                    r.data_type()
                )
            })
        })
        .collect()
}

/// Per row, whether any of `columns` is null there.
fn any_null(columns: &[ArrayRef]) -> Vec<bool> {
    let rows = columns.first().map_or(0, |c| c.len());
    let mut has_null = vec![false; rows];
    for column in columns.iter().filter(|c| c.null_count() > 0) {
        for (row, slot) in has_null.iter_mut().enumerate() {
            *slot |= column.is_null(row);
        }
    }
    has_null
}

/// Maps each row to a dense group id (nulls form their own group); returns the ids and the first
/// row of every group, groups numbered in order of first occurrence.
pub(crate) fn group_ids(keys: &[ArrayRef]) -> Result<(Vec<u32>, Vec<u32>), ArrowError> {
    // One string key is hashed as it is: its row encoding (at least 33 bytes a value) costs
    // more than the grouping.
    if let [key] = keys {
        if let Some(strings) = key.as_string_opt::<i32>() {
            return Ok(string_group_ids(strings));
        }
        if let Some(strings) = key.as_string_opt::<i64>() {
            return Ok(string_group_ids(strings));
        }
        if let Some(dictionary) = key.as_dictionary_opt::<Int32Type>()
            && let Some(strings) = dictionary.values().as_string_opt::<i32>()
        {
            return Ok(dictionary_group_ids(dictionary, strings));
        }
    }
    let encoded = EncodedKeys::encode(keys)?;
    let rows = encoded.len();
    let mut group_of_row = Vec::with_capacity(rows);
    let mut first_rows: Vec<u32> = Vec::new();
    let new_group = |row: usize, first_rows: &mut Vec<u32>| {
        first_rows.push(row as u32);
        (first_rows.len() - 1) as u32
    };
    // Few distinct values in a narrow range (a passenger count, a day of the week): a table
    // indexed by the value replaces hashing.
    let narrow = match &encoded {
        EncodedKeys::Int(values) if values.null_count() == 0 => small_range(values),
        _ => None,
    };
    match &encoded {
        EncodedKeys::Int(values) if let Some((lowest, width)) = narrow => {
            let mut ids = vec![u32::MAX; width];
            for (row, &value) in values.values().iter().enumerate() {
                let slot = &mut ids[(value - lowest) as usize];
                if *slot == u32::MAX {
                    *slot = new_group(row, &mut first_rows);
                }
                group_of_row.push(*slot);
            }
        }
        EncodedKeys::Int(values) => {
            let mut ids: HashMap<i64, u32> = HashMap::new();
            let mut null_group = None;
            for row in 0..rows {
                let id = if values.is_null(row) {
                    *null_group.get_or_insert_with(|| new_group(row, &mut first_rows))
                } else {
                    match ids.entry(values.value(row)) {
                        Entry::Occupied(e) => *e.get(),
                        Entry::Vacant(e) => *e.insert(new_group(row, &mut first_rows)),
                    }
                };
                group_of_row.push(id);
            }
        }
        EncodedKeys::Rows { rows: encoded, .. } => {
            let mut ids: HashMap<&[u8], u32> = HashMap::new();
            for (row, key) in encoded.iter().enumerate() {
                let id = match ids.entry(key.data()) {
                    Entry::Occupied(e) => *e.get(),
                    Entry::Vacant(e) => *e.insert(new_group(row, &mut first_rows)),
                };
                group_of_row.push(id);
            }
        }
    }
    Ok((group_of_row, first_rows))
}

/// [`group_ids`] of one string column.
fn string_group_ids<O: OffsetSizeTrait>(strings: &GenericStringArray<O>) -> (Vec<u32>, Vec<u32>) {
    let mut group_of_row = Vec::with_capacity(strings.len());
    let mut first_rows: Vec<u32> = Vec::new();
    let mut ids: HashMap<&[u8], u32> = HashMap::new();
    let mut null_group = None;
    for (row, value) in strings.iter().enumerate() {
        let mut new_group = || {
            first_rows.push(row as u32);
            (first_rows.len() - 1) as u32
        };
        let id = match value {
            None => *null_group.get_or_insert_with(new_group),
            Some(value) => match ids.entry(value.as_bytes()) {
                Entry::Occupied(e) => *e.get(),
                Entry::Vacant(e) => *e.insert(new_group()),
            },
        };
        group_of_row.push(id);
    }
    (group_of_row, first_rows)
}

/// [`group_ids`] of one dictionary-encoded string column: each distinct dictionary value is
/// hashed once, then every row maps through its key (no row's bytes are read).
fn dictionary_group_ids(
    dictionary: &DictionaryArray<Int32Type>,
    values: &GenericStringArray<i32>,
) -> (Vec<u32>, Vec<u32>) {
    // Equal values may sit under several keys: each key maps to the first of its value's keys.
    let (value_ids, _) = string_group_ids(values);
    let mut group_of_value = vec![u32::MAX; values.len()];
    let mut null_group = u32::MAX;
    let mut group_of_row = Vec::with_capacity(dictionary.len());
    let mut first_rows: Vec<u32> = Vec::new();
    let keys = dictionary.keys();
    for (row, &key) in keys.values().iter().enumerate() {
        // A null key, or a key to a null value, is the null group (Arrow checked the keys
        // against the dictionary when it built the array; a key outside it counts as null).
        let slot = match usize::try_from(key) {
            Ok(key) if key < values.len() && keys.is_valid(row) && values.is_valid(key) => {
                &mut group_of_value[value_ids[key] as usize]
            }
            _ => &mut null_group,
        };
        if *slot == u32::MAX {
            first_rows.push(row as u32);
            *slot = (first_rows.len() - 1) as u32;
        }
        group_of_row.push(*slot);
    }
    (group_of_row, first_rows)
}

/// The lowest value and the width of `values`' range, when it is narrow enough for a table
/// indexed by value (at most 65,536 wide, and no wider than the column is long).
fn small_range(values: &arrow::array::Int64Array) -> Option<(i64, usize)> {
    let lowest = arrow::compute::min(values)?;
    let highest = arrow::compute::max(values)?;
    let width = highest.checked_sub(lowest)?.checked_add(1)?;
    (width <= 65_536 && width as usize <= values.len().max(1024))
        .then_some((lowest, width as usize))
}

/// The partition hash of a null key value.
pub(crate) const NULL_HASH: u64 = 0x9e37_79b9_7f4a_7c15;
/// The multipliers of [`mix`] (the GPU kernels use the same constants).
pub(crate) const MIX_MULTIPLIERS: [u64; 2] = [0xff51_afd7_ed55_8ccd, 0xc4ce_b9fe_1a85_ec53];

/// MurmurHash3's 64-bit finaliser: a fixed, well-mixed permutation of `u64`.
fn mix(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(MIX_MULTIPLIERS[0]);
    h ^= h >> 33;
    h = h.wrapping_mul(MIX_MULTIPLIERS[1]);
    h ^ (h >> 33)
}

/// The stable hash of every row's keys, the contract of `hash-partition`:
///
/// - integers (any width, signed or not), booleans (0/1), dates (days) and timestamps (their
///   integer value) hash as `mix(value as u64)`, so equal keys of different integer types agree;
/// - floats hash their `f64` bits (`-0.0` as `0.0`, every NaN as one NaN);
/// - strings and binaries hash their bytes with XXH64 (seed 0), then `mix`;
/// - a null hashes as a fixed constant;
/// - several keys combine left to right: `h = mix(h.rotate_left(5) ^ key_hash)`, from `h = 0`.
pub(crate) fn partition_hashes(keys: &[ArrayRef]) -> Result<Vec<u64>, ArrowError> {
    let rows = keys.first().map_or(0, |k| k.len());
    let mut hashes = vec![0u64; rows];
    for key in keys {
        let combine = |h: &mut u64, value: u64| *h = mix(h.rotate_left(5) ^ value);
        // A dictionary-encoded key hashes as its values.
        let key = &super::dictionary::plain(key)?;
        let data_type = key.data_type();
        if data_type.is_integer() || matches!(data_type, DataType::Boolean) {
            let (as_int, unsigned) = if data_type.is_unsigned_integer() {
                (compute::cast(key, &DataType::UInt64)?, true)
            } else {
                (compute::cast(key, &DataType::Int64)?, false)
            };
            for (row, h) in hashes.iter_mut().enumerate() {
                let value = if as_int.is_null(row) {
                    NULL_HASH
                } else if unsigned {
                    mix(as_int
                        .as_primitive::<arrow::datatypes::UInt64Type>()
                        .value(row))
                } else {
                    mix(as_int.as_primitive::<Int64Type>().value(row) as u64)
                };
                combine(h, value);
            }
        } else if matches!(data_type, DataType::Date32 | DataType::Timestamp(_, _)) {
            let days_or_ticks = compute::cast(key, &DataType::Int64).or_else(|_| {
                compute::cast(&compute::cast(key, &DataType::Int32)?, &DataType::Int64)
            })?;
            let values = days_or_ticks.as_primitive::<Int64Type>();
            for (row, h) in hashes.iter_mut().enumerate() {
                let value = if values.is_null(row) {
                    NULL_HASH
                } else {
                    mix(values.value(row) as u64)
                };
                combine(h, value);
            }
        } else if data_type.is_floating() {
            let floats = compute::cast(key, &DataType::Float64)?;
            let values = floats.as_primitive::<arrow::datatypes::Float64Type>();
            for (row, h) in hashes.iter_mut().enumerate() {
                let value = if values.is_null(row) {
                    NULL_HASH
                } else {
                    let v = values.value(row);
                    let canonical = if v == 0.0 {
                        0.0f64
                    } else if v.is_nan() {
                        f64::NAN
                    } else {
                        v
                    };
                    mix(canonical.to_bits())
                };
                combine(h, value);
            }
        } else if matches!(data_type, DataType::Utf8 | DataType::LargeUtf8) {
            let strings = compute::cast(key, &DataType::Utf8)?;
            let strings = strings.as_string::<i32>();
            for (row, h) in hashes.iter_mut().enumerate() {
                let value = if strings.is_null(row) {
                    NULL_HASH
                } else {
                    mix(twox_hash::XxHash64::oneshot(
                        0,
                        strings.value(row).as_bytes(),
                    ))
                };
                combine(h, value);
            }
        } else {
            return Err(ArrowError::InvalidArgumentError(format!(
                "cannot hash-partition a key of type {data_type}"
            )));
        }
    }
    Ok(hashes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int32Array, Int64Array, StringArray, UInt8Array};
    use std::sync::Arc;

    #[test]
    fn equal_integers_of_different_types_hash_alike() {
        let a: ArrayRef = Arc::new(Int32Array::from(vec![Some(7), None, Some(-1)]));
        let b: ArrayRef = Arc::new(Int64Array::from(vec![Some(7), None, Some(-1)]));
        assert_eq!(
            partition_hashes(&[a]).unwrap(),
            partition_hashes(&[b]).unwrap()
        );
        let small: ArrayRef = Arc::new(UInt8Array::from(vec![7]));
        let wide: ArrayRef = Arc::new(Int64Array::from(vec![7]));
        assert_eq!(
            partition_hashes(&[small]).unwrap(),
            partition_hashes(&[wide]).unwrap()
        );
    }

    #[test]
    fn the_partition_hash_is_pinned() {
        // These values are the cross-backend contract: changing them breaks mixed clusters.
        let ints: ArrayRef = Arc::new(Int64Array::from(vec![0, 1, 42]));
        let words: ArrayRef = Arc::new(StringArray::from(vec!["", "wrk"]));
        let int_hashes = partition_hashes(&[ints]).unwrap();
        assert_eq!(int_hashes[0], mix(0u64.rotate_left(5) ^ mix(0)));
        assert_eq!(int_hashes[2], mix(mix(42)));
        let word_hashes = partition_hashes(&[words]).unwrap();
        assert_eq!(
            word_hashes[1],
            mix(mix(twox_hash::XxHash64::oneshot(0, b"wrk")))
        );
        assert_ne!(int_hashes[1], int_hashes[2]);
    }

    #[test]
    fn narrow_and_wide_integer_keys_group_alike() {
        let narrow: ArrayRef = Arc::new(Int32Array::from(vec![5, 3, 5, 4, 3]));
        assert_eq!(
            group_ids(&[narrow]).unwrap(),
            (vec![0, 1, 0, 2, 1], vec![0, 1, 3])
        );
        let wide: ArrayRef = Arc::new(Int64Array::from(vec![i64::MIN, i64::MAX, i64::MIN]));
        assert_eq!(group_ids(&[wide]).unwrap(), (vec![0, 1, 0], vec![0, 1]));
    }

    #[test]
    fn string_keys_group_as_their_row_encoding_does() {
        let words: ArrayRef = Arc::new(StringArray::from(vec![
            Some("day"),
            None,
            Some("night"),
            Some("day"),
            None,
            Some(""),
        ]));
        let expected = (vec![0, 1, 2, 0, 1, 3], vec![0, 1, 2, 5]);
        assert_eq!(group_ids(std::slice::from_ref(&words)).unwrap(), expected);
        let large = compute::cast(&words, &DataType::LargeUtf8).unwrap();
        assert_eq!(group_ids(&[large]).unwrap(), expected);
        // Two keys take the row format; with a constant second key, the same groups.
        let constant: ArrayRef = Arc::new(Int32Array::from(vec![1; 6]));
        assert_eq!(group_ids(&[words, constant]).unwrap(), expected);
    }

    #[test]
    fn group_ids_put_nulls_in_their_own_group() {
        let keys: ArrayRef = Arc::new(Int32Array::from(vec![
            Some(3),
            None,
            Some(3),
            None,
            Some(1),
        ]));
        let (ids, first) = group_ids(&[keys]).unwrap();
        assert_eq!(ids, vec![0, 1, 0, 1, 2]);
        assert_eq!(first, vec![0, 1, 4]);
    }
}

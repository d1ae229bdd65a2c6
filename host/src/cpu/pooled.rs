//! Concatenation and filtering of fixed-width columns into the process's reusable blocks
//! (`memory::buffers`) instead of fresh allocations.
//!
//! Reading a partition concatenates its decoded batches, and a filter copies the rows it keeps:
//! both write one large buffer per column, and a fresh one faults in (and the kernel zeroes)
//! every page on first touch, which `perf` put at a fifth of the scan query. A block a previous
//! column gave back is already resident. Other types (strings, lists...) use Arrow's kernels.

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, ArrowPrimitiveType, AsArray, BooleanArray, BooleanBufferBuilder, Int64Array,
    PrimitiveArray, RecordBatch, RecordBatchOptions, downcast_primitive,
};
use arrow::buffer::{BooleanBuffer, NullBuffer};
use arrow::compute::{self, FilterBuilder};
use arrow::datatypes::{
    DataType, Int8Type, Int16Type, Int32Type, SchemaRef, UInt8Type, UInt16Type, UInt32Type,
};
use arrow::error::ArrowError;

use crate::memory::buffers::{self, PooledVec};

/// Above this share of rows kept, a filter copies runs of kept rows rather than one row at a
/// time (Arrow's own filter switches at the same point).
const RUNS_ABOVE_SELECTIVITY: f64 = 0.8;

/// Concatenates arrays of one type.
pub fn concat(arrays: &[&dyn Array]) -> Result<ArrayRef, ArrowError> {
    let Some(first) = arrays.first() else {
        return compute::concat(arrays);
    };
    if arrays.iter().any(|a| a.data_type() != first.data_type()) {
        // Arrow's kernel names the mismatch.
        return compute::concat(arrays);
    }
    macro_rules! primitive {
        ($t:ty, $arrays:expr) => {
            Ok(concat_primitive::<$t>($arrays))
        };
    }
    downcast_primitive! {
        first.data_type() => (primitive, arrays),
        _ => compute::concat(arrays),
    }
}

/// Concatenates batches of `schema` column by column (one batch is returned as it is).
pub fn concat_batches(
    schema: &SchemaRef,
    batches: &[&RecordBatch],
) -> Result<RecordBatch, ArrowError> {
    match batches {
        [] => return Ok(RecordBatch::new_empty(schema.clone())),
        [batch] => return Ok((*batch).clone()),
        _ => {}
    }
    let rows = batches.iter().map(|b| b.num_rows()).sum();
    let columns = (0..schema.fields().len())
        .map(|i| {
            let arrays: Vec<&dyn Array> = batches.iter().map(|b| b.column(i).as_ref()).collect();
            concat(&arrays)
        })
        .collect::<Result<Vec<_>, _>>()?;
    RecordBatch::try_new_with_options(
        schema.clone(),
        columns,
        &RecordBatchOptions::new().with_row_count(Some(rows)),
    )
}

fn concat_primitive<T: ArrowPrimitiveType>(arrays: &[&dyn Array]) -> ArrayRef {
    let total: usize = arrays.iter().map(|a| a.len()).sum();
    let mut values = PooledVec::<T::Native>::with_capacity(buffers::global(), total);
    for array in arrays {
        values.extend_from_slice(array.as_primitive::<T>().values());
    }
    let nulls = arrays.iter().any(|a| a.null_count() > 0).then(|| {
        let mut validity = BooleanBufferBuilder::new(total);
        for array in arrays {
            match array.nulls() {
                Some(nulls) => validity.append_buffer(nulls.inner()),
                None => validity.append_n(array.len(), true),
            }
        }
        NullBuffer::new(validity.finish())
    });
    let data_type = arrays[0].data_type().clone();
    Arc::new(PrimitiveArray::<T>::new(values.into_scalar_buffer(), nulls).with_data_type(data_type))
}

/// A narrower integer column as `Int64`, in a reused block (group-by and join keys are widened
/// so; a cast would fault in a fresh buffer of eight bytes a row). `None` for other types.
pub fn widen_to_i64(array: &dyn Array) -> Option<Int64Array> {
    fn widen<T: ArrowPrimitiveType>(array: &dyn Array) -> Int64Array
    where
        T::Native: Into<i64>,
    {
        let mut values = PooledVec::<i64>::with_capacity(buffers::global(), array.len());
        values.extend(array.as_primitive::<T>().values().iter().map(|&v| v.into()));
        Int64Array::new(values.into_scalar_buffer(), array.nulls().cloned())
    }
    Some(match array.data_type() {
        DataType::Int8 => widen::<Int8Type>(array),
        DataType::Int16 => widen::<Int16Type>(array),
        DataType::Int32 => widen::<Int32Type>(array),
        DataType::UInt8 => widen::<UInt8Type>(array),
        DataType::UInt16 => widen::<UInt16Type>(array),
        DataType::UInt32 => widen::<UInt32Type>(array),
        _ => return None,
    })
}

/// The rows of `batch` where `mask` is true (null counts as false).
pub fn filter_batch(batch: &RecordBatch, mask: &BooleanArray) -> Result<RecordBatch, ArrowError> {
    let selected = match mask.nulls() {
        Some(nulls) if nulls.null_count() > 0 => mask.values() & nulls.inner(),
        _ => mask.values().clone(),
    };
    let kept = selected.count_set_bits();
    // Arrow's filter, for the columns that need it: built once, only if one does.
    let predicate = std::cell::OnceCell::new();
    let arrow_filter = |array: &dyn Array| {
        predicate
            .get_or_init(|| {
                FilterBuilder::new(&BooleanArray::new(selected.clone(), None))
                    .optimize()
                    .build()
            })
            .filter(array)
    };
    let columns = batch
        .columns()
        .iter()
        .map(|column| filter_column(column, &selected, kept, &arrow_filter))
        .collect::<Result<Vec<_>, _>>()?;
    RecordBatch::try_new_with_options(
        batch.schema(),
        columns,
        &RecordBatchOptions::new().with_row_count(Some(kept)),
    )
}

fn filter_column(
    column: &ArrayRef,
    selected: &BooleanBuffer,
    kept: usize,
    arrow_filter: &dyn Fn(&dyn Array) -> Result<ArrayRef, ArrowError>,
) -> Result<ArrayRef, ArrowError> {
    macro_rules! primitive {
        ($t:ty, $column:expr) => {
            filter_primitive::<$t>($column, selected, kept, arrow_filter)
        };
    }
    downcast_primitive! {
        column.data_type() => (primitive, column),
        _ => arrow_filter(column.as_ref()),
    }
}

fn filter_primitive<T: ArrowPrimitiveType>(
    column: &ArrayRef,
    selected: &BooleanBuffer,
    kept: usize,
    arrow_filter: &dyn Fn(&dyn Array) -> Result<ArrayRef, ArrowError>,
) -> Result<ArrayRef, ArrowError> {
    let values = column.as_primitive::<T>().values();
    let mut out = PooledVec::<T::Native>::with_capacity(buffers::global(), kept);
    if kept as f64 > selected.len() as f64 * RUNS_ABOVE_SELECTIVITY {
        for (start, end) in selected.set_slices() {
            out.extend_from_slice(&values[start..end]);
        }
    } else {
        out.extend(selected.set_indices().map(|i| values[i]));
    }
    let nulls = match column.nulls() {
        Some(nulls) if nulls.null_count() > 0 => {
            let validity = arrow_filter(&BooleanArray::new(nulls.inner().clone(), None))?;
            Some(NullBuffer::new(validity.as_boolean().values().clone()))
        }
        _ => None,
    };
    Ok(Arc::new(
        PrimitiveArray::<T>::new(out.into_scalar_buffer(), nulls)
            .with_data_type(column.data_type().clone()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float64Array, Int32Array, StringArray, TimestampMillisecondArray};
    use arrow::datatypes::{DataType, Field, Schema};

    #[test]
    fn concatenation_matches_arrows_kernel_with_and_without_nulls() {
        let big = Int32Array::from_iter_values(0..100_000);
        let with_nulls = Int32Array::from(vec![Some(1), None, Some(3)]);
        let arrays: [&dyn Array; 3] = [&big, &with_nulls, &big.slice(5, 10)];
        let ours = concat(&arrays).unwrap();
        assert_eq!(ours.as_ref(), compute::concat(&arrays).unwrap().as_ref());
        assert_eq!(ours.null_count(), 1);
        let no_nulls: [&dyn Array; 2] = [&big, &big];
        assert_eq!(concat(&no_nulls).unwrap().null_count(), 0);

        let zoned = TimestampMillisecondArray::from(vec![1, 2]).with_timezone("UTC");
        let zoned: [&dyn Array; 2] = [&zoned, &zoned];
        assert_eq!(
            concat(&zoned).unwrap().data_type(),
            &DataType::Timestamp(arrow::datatypes::TimeUnit::Millisecond, Some("UTC".into()))
        );
        let strings = StringArray::from(vec!["a", "b"]);
        let strings: [&dyn Array; 2] = [&strings, &strings];
        assert_eq!(concat(&strings).unwrap().len(), 4);
        let mixed: [&dyn Array; 2] = [&big, &StringArray::from(vec!["a"])];
        assert!(concat(&mixed).is_err());
    }

    #[test]
    fn narrow_integers_widen_as_a_cast_would() {
        let narrow: Vec<ArrayRef> = vec![
            Arc::new(Int32Array::from(vec![Some(-3), None, Some(i32::MAX)])),
            Arc::new(arrow::array::UInt8Array::from(vec![0, 255])),
            Arc::new(arrow::array::Int16Array::from_iter_values(0..20_000)),
        ];
        for array in &narrow {
            let widened = widen_to_i64(array.as_ref()).unwrap();
            let cast = compute::cast(array, &DataType::Int64).unwrap();
            assert_eq!(&widened, cast.as_primitive::<arrow::datatypes::Int64Type>());
        }
        assert!(widen_to_i64(&StringArray::from(vec!["a"])).is_none());
    }

    #[test]
    fn filtering_matches_arrows_kernel_for_sparse_dense_and_null_masks() {
        let rows = 200_000;
        let schema = Arc::new(Schema::new(vec![
            Field::new("x", DataType::Float64, true),
            Field::new("s", DataType::Utf8, false),
        ]));
        let x = Float64Array::from_iter((0..rows).map(|i| (i % 7 != 0).then_some(i as f64)));
        let s = StringArray::from_iter_values((0..rows).map(|i| format!("v{i}")));
        let batch = RecordBatch::try_new(schema, vec![Arc::new(x), Arc::new(s)]).unwrap();
        let masks = [
            BooleanArray::from_iter((0..rows).map(|i| Some(i % 3 == 0))),
            BooleanArray::from_iter((0..rows).map(|i| Some(i % 10 != 0))),
            BooleanArray::from_iter((0..rows).map(|i| (i % 5 != 0).then_some(i % 2 == 0))),
            BooleanArray::from(vec![false; rows]),
        ];
        for mask in &masks {
            let ours = filter_batch(&batch, mask).unwrap();
            let arrows = compute::filter_record_batch(&batch, mask).unwrap();
            assert_eq!(ours, arrows);
        }
    }
}

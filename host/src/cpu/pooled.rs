//! Concatenation and widening of fixed-width columns into the process's reusable blocks
//! (`memory::buffers`) instead of fresh allocations (the filter's are in [`super::filter`]).
//!
//! Reading a partition concatenates its decoded batches into one large buffer per column, and a
//! fresh one faults in (and the kernel zeroes) every page on first touch, which `perf` put at a
//! fifth of the scan query. A block a previous column gave back is already resident. Other
//! types (strings, lists...) use Arrow's kernels.

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, ArrowPrimitiveType, AsArray, BooleanBufferBuilder, Int64Array, PrimitiveArray,
    RecordBatch, RecordBatchOptions, downcast_primitive,
};
use arrow::buffer::NullBuffer;
use arrow::compute;
use arrow::datatypes::{
    DataType, Int8Type, Int16Type, Int32Type, SchemaRef, UInt8Type, UInt16Type, UInt32Type,
};
use arrow::error::ArrowError;

use crate::memory::buffers::{self, PooledVec};

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
    let mut appender = PrimitiveAppender::<T>::new(arrays[0].data_type(), total);
    for array in arrays {
        appender.append(*array);
    }
    Box::new(appender).finish()
}

/// Batches of one schema appended one at a time into columns in reused blocks, for a reader
/// that decodes a partition batch by batch: each batch can be dropped as soon as it is
/// appended, so the decoder's next batch reuses its memory while it is still resident, where
/// collecting every batch before concatenating them faults in fresh pages for all of them.
pub struct BatchAppender {
    schema: SchemaRef,
    rows: usize,
    columns: Vec<ColumnAppender>,
}

enum ColumnAppender {
    /// Fixed-width values, copied into a block sized for the expected rows.
    Primitive(Box<dyn AppendPrimitive>),
    /// Any other type: the arrays, concatenated by Arrow's kernel at the end.
    Other(Vec<ArrayRef>),
}

impl BatchAppender {
    /// An appender for batches of `schema`, with room for `expected_rows` (more still fit).
    pub fn new(schema: SchemaRef, expected_rows: usize) -> Self {
        macro_rules! primitive {
            ($t:ty, $data_type:expr) => {
                ColumnAppender::Primitive(Box::new(PrimitiveAppender::<$t>::new(
                    $data_type,
                    expected_rows,
                )))
            };
        }
        let columns = schema
            .fields()
            .iter()
            .map(|field| {
                let data_type = field.data_type();
                downcast_primitive! {
                    data_type => (primitive, data_type),
                    _ => ColumnAppender::Other(Vec::new()),
                }
            })
            .collect();
        BatchAppender {
            schema,
            rows: 0,
            columns,
        }
    }

    /// Appends `batch`, whose columns must have the appender's types.
    pub fn push(&mut self, batch: &RecordBatch) -> Result<(), ArrowError> {
        if batch.num_columns() != self.columns.len() {
            return Err(ArrowError::SchemaError(format!(
                "a batch of {} columns appended to {} columns",
                batch.num_columns(),
                self.columns.len()
            )));
        }
        for ((column, field), array) in self
            .columns
            .iter_mut()
            .zip(self.schema.fields())
            .zip(batch.columns())
        {
            if array.data_type() != field.data_type() {
                return Err(ArrowError::SchemaError(format!(
                    "column `{}` is {} in a batch appended to {}",
                    field.name(),
                    array.data_type(),
                    field.data_type()
                )));
            }
            match column {
                ColumnAppender::Primitive(appender) => appender.append(array.as_ref()),
                ColumnAppender::Other(arrays) => arrays.push(array.clone()),
            }
        }
        self.rows += batch.num_rows();
        Ok(())
    }

    /// The appended rows as one batch.
    pub fn finish(self) -> Result<RecordBatch, ArrowError> {
        let columns = self
            .columns
            .into_iter()
            .zip(self.schema.fields())
            .map(|(column, field)| match column {
                ColumnAppender::Primitive(appender) => Ok(appender.finish()),
                ColumnAppender::Other(arrays) => match arrays.as_slice() {
                    [] => Ok(arrow::array::new_empty_array(field.data_type())),
                    [one] => Ok(one.clone()),
                    _ => {
                        let refs: Vec<&dyn Array> = arrays.iter().map(|a| a.as_ref()).collect();
                        compute::concat(&refs)
                    }
                },
            })
            .collect::<Result<Vec<_>, _>>()?;
        RecordBatch::try_new_with_options(
            self.schema,
            columns,
            &RecordBatchOptions::new().with_row_count(Some(self.rows)),
        )
    }
}

/// A primitive column being appended to, whatever its type.
trait AppendPrimitive {
    fn append(&mut self, array: &dyn Array);
    fn finish(self: Box<Self>) -> ArrayRef;
}

struct PrimitiveAppender<T: ArrowPrimitiveType> {
    values: PooledVec<T::Native>,
    /// Created at the first array with nulls (every earlier row valid).
    validity: Option<BooleanBufferBuilder>,
    data_type: DataType,
}

impl<T: ArrowPrimitiveType> PrimitiveAppender<T> {
    fn new(data_type: &DataType, capacity: usize) -> Self {
        PrimitiveAppender {
            values: PooledVec::with_capacity(buffers::global(), capacity),
            validity: None,
            data_type: data_type.clone(),
        }
    }
}

impl<T: ArrowPrimitiveType> AppendPrimitive for PrimitiveAppender<T> {
    fn append(&mut self, array: &dyn Array) {
        let before = self.values.len();
        self.values
            .extend_from_slice(array.as_primitive::<T>().values());
        match (
            array.nulls().filter(|n| n.null_count() > 0),
            &mut self.validity,
        ) {
            (Some(nulls), Some(validity)) => validity.append_buffer(nulls.inner()),
            (Some(nulls), None) => {
                let mut validity = BooleanBufferBuilder::new(self.values.len());
                validity.append_n(before, true);
                validity.append_buffer(nulls.inner());
                self.validity = Some(validity);
            }
            (None, Some(validity)) => validity.append_n(array.len(), true),
            (None, None) => {}
        }
    }

    fn finish(self: Box<Self>) -> ArrayRef {
        let nulls = self.validity.map(|mut v| NullBuffer::new(v.finish()));
        Arc::new(
            PrimitiveArray::<T>::new(self.values.into_scalar_buffer(), nulls)
                .with_data_type(self.data_type),
        )
    }
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
    fn appending_batch_by_batch_matches_concatenation() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("x", DataType::Float64, true),
            Field::new("s", DataType::Utf8, false),
        ]));
        let batch = |start: usize, rows: usize, nulls: bool| {
            let x = Float64Array::from_iter(
                (start..start + rows).map(|i| (!nulls || i % 3 != 0).then_some(i as f64)),
            );
            let s = StringArray::from_iter_values((start..start + rows).map(|i| format!("v{i}")));
            RecordBatch::try_new(schema.clone(), vec![Arc::new(x), Arc::new(s)]).unwrap()
        };
        // Nulls first appearing in the second batch; more rows than expected.
        let batches = [
            batch(0, 70_000, false),
            batch(70_000, 5, true),
            batch(70_005, 9_000, false),
        ];
        let mut appender = BatchAppender::new(schema.clone(), 50_000);
        for b in &batches {
            appender.push(b).unwrap();
        }
        let appended = appender.finish().unwrap();
        let refs: Vec<&RecordBatch> = batches.iter().collect();
        assert_eq!(appended, compute::concat_batches(&schema, refs).unwrap());
        assert_eq!(appended.column(0).null_count(), 1);
        assert_eq!(
            BatchAppender::new(schema.clone(), 0).finish().unwrap(),
            RecordBatch::new_empty(schema.clone())
        );
        let other =
            RecordBatch::try_from_iter([("x", Arc::new(Int32Array::from(vec![1])) as ArrayRef)])
                .unwrap();
        assert!(BatchAppender::new(schema, 1).push(&other).is_err());
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
}

//! Device tables: Arrow-like columns in device memory, leased from the worker's pool, and the
//! counted copies between them and host `RecordBatch`es.
//!
//! Layout: fixed-width values as in Arrow (booleans one byte per row rather than bits, so
//! kernels read them like any other column), strings as `i32` offsets plus bytes, validity one
//! byte per row (absent when no row is null). Data crosses between host and device only through
//! [`upload`] and [`download`], which count every copy (bytes and transfers) in the runtime's
//! [`super::Transfers`]; the callers are the edges of a task (Parquet reads, explicit guest
//! copies, spilling, shuffle sends and receives).

use std::sync::Arc;

use arrow::array::{Array, ArrayData, ArrayRef, BooleanArray, RecordBatch, make_array};
use arrow::buffer::{Buffer, MutableBuffer, NullBuffer};
use arrow::datatypes::{DataType, Schema, SchemaRef};

use super::pool::{DeviceBuffer, PoolError};
use super::{Direction, GpuRuntime};

/// Why a table cannot be moved to or from the device.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error("column `{column}` of type {data_type} has no device layout yet")]
    Unsupported { column: String, data_type: DataType },
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error("a copy between host and device failed: {0}")]
    Copy(String),
    #[error("rebuilding column `{column}` on the host failed: {detail}")]
    Rebuild { column: String, detail: String },
}

/// The bytes per value of a fixed-width device column; `None` for strings and for types with
/// no device layout.
pub fn value_width(data_type: &DataType) -> Option<usize> {
    use DataType::*;
    Some(match data_type {
        Boolean | Int8 | UInt8 | Null => 1,
        Int16 | UInt16 => 2,
        Int32 | UInt32 | Float32 | Date32 => 4,
        Int64 | UInt64 | Float64 | Timestamp(_, _) => 8,
        _ => return None,
    })
}

/// Whether a column of `data_type` can live on the device.
pub fn device_type(data_type: &DataType) -> bool {
    value_width(data_type).is_some() || *data_type == DataType::Utf8
}

/// The schema a table of `schema` has once uploaded: dictionary-encoded columns are written
/// out as their values.
pub fn device_schema(schema: &Schema) -> Schema {
    Schema::new(
        schema
            .fields()
            .iter()
            .map(|f| match f.data_type() {
                DataType::Dictionary(_, values) => {
                    f.as_ref().clone().with_data_type(values.as_ref().clone())
                }
                _ => f.as_ref().clone(),
            })
            .collect::<Vec<_>>(),
    )
}

/// Whether every column of `schema` can be uploaded.
pub fn uploadable(schema: &Schema) -> bool {
    device_schema(schema)
        .fields()
        .iter()
        .all(|f| device_type(f.data_type()))
}

/// One column in device memory.
pub struct DeviceColumn {
    pub data_type: DataType,
    pub len: usize,
    /// Fixed-width values (`len * width` bytes), or a string column's bytes.
    pub values: DeviceBuffer,
    /// A string column's `len + 1` offsets (`i32`).
    pub offsets: Option<DeviceBuffer>,
    /// One byte per row, 1 where valid; `None` when every row is valid.
    pub validity: Option<DeviceBuffer>,
}

/// A table in device memory. Columns are shared between tables (a selection, a renamed or an
/// added column takes no copy) and freed with the last table holding them.
pub struct DeviceTable {
    pub schema: SchemaRef,
    pub columns: Vec<Arc<DeviceColumn>>,
    pub rows: usize,
}

impl DeviceTable {
    pub fn column(&self, name: &str) -> Option<&DeviceColumn> {
        self.schema
            .index_of(name)
            .ok()
            .and_then(|i| self.columns.get(i))
            .map(Arc::as_ref)
    }

    /// Device bytes of the table's columns, including columns it shares with other tables.
    pub fn bytes(&self) -> u64 {
        self.columns
            .iter()
            .map(|c| {
                c.values.bytes()
                    + c.offsets.as_ref().map_or(0, DeviceBuffer::bytes)
                    + c.validity.as_ref().map_or(0, DeviceBuffer::bytes)
            })
            .sum()
    }
}

/// The raw device address of `buffer` plus `offset` bytes, for kernel arguments.
pub(crate) fn address(runtime: &GpuRuntime, buffer: &DeviceBuffer, offset: u64) -> u64 {
    runtime.backend.address(buffer.memory(), offset)
}

/// Copies `bytes` into a new pool buffer (not counted: the callers count whole tables).
pub(crate) fn to_device(runtime: &GpuRuntime, bytes: &[u8]) -> Result<DeviceBuffer, TableError> {
    let mut buffer = runtime.pool.alloc(bytes.len() as u64)?;
    if !bytes.is_empty() {
        runtime
            .backend
            .write(buffer.memory_mut(), bytes)
            .map_err(TableError::Copy)?;
    }
    Ok(buffer)
}

/// The first `len` bytes of `buffer` on the host (not counted).
pub(crate) fn to_host(
    runtime: &GpuRuntime,
    buffer: &DeviceBuffer,
    len: usize,
) -> Result<Vec<u8>, TableError> {
    to_host_at(runtime, buffer, 0, len)
}

/// `len` bytes of `buffer` from byte `at` (a value read back without the ones before it), not
/// counted.
pub(crate) fn to_host_at(
    runtime: &GpuRuntime,
    buffer: &DeviceBuffer,
    at: usize,
    len: usize,
) -> Result<Vec<u8>, TableError> {
    let mut out = vec![0u8; len];
    if len > 0 {
        runtime
            .backend
            .read(buffer.memory(), at, &mut out)
            .map_err(TableError::Copy)?;
    }
    Ok(out)
}

/// The first `len` bytes of `buffer` as an Arrow buffer (aligned for any value type, also when
/// empty), not counted.
fn to_host_buffer(
    runtime: &GpuRuntime,
    buffer: &DeviceBuffer,
    len: usize,
) -> Result<Buffer, TableError> {
    let mut out = MutableBuffer::from_len_zeroed(len);
    if len > 0 {
        runtime
            .backend
            .read(buffer.memory(), 0, out.as_slice_mut())
            .map_err(TableError::Copy)?;
    }
    Ok(out.into())
}

/// The bytes of an Arrow buffer's `len` elements of `width` bytes from element `offset`.
fn element_bytes(buffer: &Buffer, offset: usize, len: usize, width: usize) -> &[u8] {
    &buffer.as_slice()[offset * width..(offset + len) * width]
}

/// One byte per row: 1 where `array` is valid (`None` when no row is null).
fn validity_bytes(array: &dyn Array) -> Option<Vec<u8>> {
    let nulls = array.logical_nulls()?;
    if nulls.null_count() == 0 && *array.data_type() != DataType::Null {
        return None;
    }
    Some(
        (0..array.len())
            .map(|i| u8::from(nulls.is_valid(i)))
            .collect(),
    )
}

fn upload_column(
    runtime: &GpuRuntime,
    name: &str,
    array: &ArrayRef,
) -> Result<(DeviceColumn, u64), TableError> {
    let data_type = array.data_type().clone();
    let unsupported = || TableError::Unsupported {
        column: name.to_string(),
        data_type: data_type.clone(),
    };
    let data = array.to_data();
    let len = array.len();
    let validity = validity_bytes(array.as_ref());
    let mut copied = validity.as_ref().map_or(0, |v| v.len() as u64);
    let (values, offsets) = match &data_type {
        DataType::Null => (to_device(runtime, &[])?, None),
        DataType::Boolean => {
            let booleans = array
                .as_any()
                .downcast_ref::<BooleanArray>()
                .ok_or_else(unsupported)?;
            let bytes: Vec<u8> = booleans.values().iter().map(u8::from).collect();
            copied += bytes.len() as u64;
            (to_device(runtime, &bytes)?, None)
        }
        DataType::Utf8 => {
            let offsets = data.buffer::<i32>(0);
            let window = &offsets[data.offset()..data.offset() + len + 1];
            let first = window[0];
            let rebased: Vec<u8> = window
                .iter()
                .flat_map(|o| (o - first).to_le_bytes())
                .collect();
            let bytes = &data.buffers()[1].as_slice()[first as usize..window[len] as usize];
            copied += (rebased.len() + bytes.len()) as u64;
            (
                to_device(runtime, bytes)?,
                Some(to_device(runtime, &rebased)?),
            )
        }
        other => {
            let width = value_width(other).ok_or_else(unsupported)?;
            let bytes = element_bytes(&data.buffers()[0], data.offset(), len, width);
            copied += bytes.len() as u64;
            (to_device(runtime, bytes)?, None)
        }
    };
    let validity = match validity {
        Some(bytes) => Some(to_device(runtime, &bytes)?),
        None => None,
    };
    Ok((
        DeviceColumn {
            data_type,
            len,
            values,
            offsets,
            validity,
        },
        copied,
    ))
}

/// Copies a host table to the device: one counted transfer.
pub fn upload(runtime: &GpuRuntime, batch: &RecordBatch) -> Result<DeviceTable, TableError> {
    // Device string columns hold their bytes: a dictionary-encoded column is written out first.
    let batch = &crate::cpu::dictionary::plain_batch(batch).map_err(|e| TableError::Rebuild {
        column: "a dictionary-encoded column".into(),
        detail: e.to_string(),
    })?;
    let schema = batch.schema();
    let mut columns = Vec::with_capacity(batch.num_columns());
    let mut copied = 0;
    for (field, array) in schema.fields().iter().zip(batch.columns()) {
        if !device_type(field.data_type()) {
            return Err(TableError::Unsupported {
                column: field.name().clone(),
                data_type: field.data_type().clone(),
            });
        }
        let (column, bytes) = upload_column(runtime, field.name(), array)?;
        copied += bytes;
        columns.push(Arc::new(column));
    }
    runtime.backend.synchronize().map_err(TableError::Copy)?;
    runtime.transfers.record(Direction::ToDevice, copied);
    Ok(DeviceTable {
        schema,
        columns,
        rows: batch.num_rows(),
    })
}

fn download_column(
    runtime: &GpuRuntime,
    name: &str,
    column: &DeviceColumn,
) -> Result<(ArrayRef, u64), TableError> {
    let len = column.len;
    let rebuild = |e: arrow::error::ArrowError| TableError::Rebuild {
        column: name.to_string(),
        detail: e.to_string(),
    };
    let mut copied = 0u64;
    let nulls = match &column.validity {
        Some(validity) => {
            let bytes = to_host(runtime, validity, len)?;
            copied += len as u64;
            Some(NullBuffer::from(
                bytes.iter().map(|b| *b != 0).collect::<Vec<bool>>(),
            ))
        }
        None => None,
    };
    let array: ArrayRef = match &column.data_type {
        DataType::Null => Arc::new(arrow::array::NullArray::new(len)),
        DataType::Boolean => {
            let bytes = to_host(runtime, &column.values, len)?;
            copied += len as u64;
            let values: Vec<bool> = bytes.iter().map(|b| *b != 0).collect();
            Arc::new(BooleanArray::new(values.into(), nulls))
        }
        DataType::Utf8 => {
            let offsets_buffer = column.offsets.as_ref().ok_or_else(|| TableError::Rebuild {
                column: name.to_string(),
                detail: "a string column without offsets".into(),
            })?;
            let offsets = to_host_buffer(runtime, offsets_buffer, (len + 1) * 4)?;
            let end = offsets
                .chunks_exact(4)
                .last()
                .map_or(0, |b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            let bytes = to_host_buffer(runtime, &column.values, end.max(0) as usize)?;
            copied += (offsets.len() + bytes.len()) as u64;
            let data = ArrayData::builder(DataType::Utf8)
                .len(len)
                .add_buffer(offsets)
                .add_buffer(bytes)
                .nulls(nulls)
                .build()
                .map_err(rebuild)?;
            make_array(data)
        }
        other => {
            let width = value_width(other).ok_or_else(|| TableError::Unsupported {
                column: name.to_string(),
                data_type: other.clone(),
            })?;
            let bytes = to_host_buffer(runtime, &column.values, len * width)?;
            copied += bytes.len() as u64;
            let data = ArrayData::builder(other.clone())
                .len(len)
                .add_buffer(bytes)
                .nulls(nulls)
                .build()
                .map_err(rebuild)?;
            make_array(data)
        }
    };
    Ok((array, copied))
}

/// Copies one device column back to the host as an Arrow array: one counted transfer.
pub fn download_array(
    runtime: &GpuRuntime,
    name: &str,
    column: &DeviceColumn,
) -> Result<ArrayRef, TableError> {
    let (array, copied) = download_column(runtime, name, column)?;
    runtime.transfers.record(Direction::ToHost, copied);
    Ok(array)
}

/// Copies a device table back to the host: one counted transfer.
pub fn download(runtime: &GpuRuntime, table: &DeviceTable) -> Result<RecordBatch, TableError> {
    let mut arrays = Vec::with_capacity(table.columns.len());
    let mut copied = 0;
    for (field, column) in table.schema.fields().iter().zip(&table.columns) {
        let (array, bytes) = download_column(runtime, field.name(), column)?;
        copied += bytes;
        arrays.push(array);
    }
    runtime.transfers.record(Direction::ToHost, copied);
    let options = arrow::array::RecordBatchOptions::new().with_row_count(Some(table.rows));
    // Fields keep their names and types; nullability follows the data the kernels produced.
    let fields: Vec<arrow::datatypes::Field> = table
        .schema
        .fields()
        .iter()
        .zip(&arrays)
        .map(|(f, a)| {
            f.as_ref()
                .clone()
                .with_nullable(f.is_nullable() || a.null_count() > 0)
        })
        .collect();
    RecordBatch::try_new_with_options(
        Arc::new(arrow::datatypes::Schema::new(fields)),
        arrays,
        &options,
    )
    .map_err(|e| TableError::Rebuild {
        column: "*".into(),
        detail: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float64Array, Int32Array, Int64Array, StringArray};

    #[test]
    fn every_contract_type_but_wide_strings_has_a_device_layout() {
        for t in [
            DataType::Boolean,
            DataType::Int8,
            DataType::UInt32,
            DataType::Float32,
            DataType::Float64,
            DataType::Date32,
            DataType::Timestamp(arrow::datatypes::TimeUnit::Microsecond, None),
            DataType::Utf8,
            DataType::Null,
        ] {
            assert!(device_type(&t), "{t}");
        }
        assert!(!device_type(&DataType::LargeUtf8));
        assert_eq!(value_width(&DataType::Int16), Some(2));
        assert_eq!(value_width(&DataType::Utf8), None);
    }

    #[test]
    fn validity_is_one_byte_per_row_and_absent_without_nulls() {
        let with_nulls = Int32Array::from(vec![Some(1), None, Some(3)]);
        assert_eq!(validity_bytes(&with_nulls), Some(vec![1, 0, 1]));
        let without = Float64Array::from(vec![1.0, 2.0]);
        assert_eq!(validity_bytes(&without), None);
        let sliced = StringArray::from(vec![Some("a"), None, Some("c")]).slice(1, 2);
        assert_eq!(validity_bytes(&sliced), Some(vec![0, 1]));
    }

    /// A table dropped on a thread that never used the device (a transfer thread releasing a
    /// partition) is freed there, and a copy on another such thread still works: on a GPU,
    /// freeing without the context made current failed and poisoned the next call.
    #[test]
    fn a_table_freed_on_another_thread_leaves_the_device_usable() {
        let Some(runtime) = super::super::test_device("a_table_freed_on_another_thread") else {
            return;
        };
        let batch = RecordBatch::try_from_iter(vec![(
            "i",
            Arc::new(Int64Array::from_iter_values(0..100_000)) as ArrayRef,
        )])
        .unwrap();
        let dropped = upload(&runtime, &batch).unwrap();
        let kept = upload(&runtime, &batch).unwrap();
        std::thread::spawn(move || drop(dropped)).join().unwrap();
        let worker = runtime.clone();
        let back = std::thread::spawn(move || download(&worker, &kept).map_err(|e| e.to_string()))
            .join()
            .unwrap();
        assert_eq!(back.unwrap().columns(), batch.columns());
        assert_eq!(runtime.pool.stats().used, 0);
    }

    #[test]
    fn tables_round_trip_through_the_device() {
        let Some(runtime) = super::super::test_device("tables_round_trip_through_the_device")
        else {
            return;
        };
        let batch = RecordBatch::try_from_iter(vec![
            (
                "i",
                Arc::new(Int32Array::from(vec![Some(1), None, Some(3)])) as ArrayRef,
            ),
            (
                "s",
                Arc::new(StringArray::from(vec![Some("wrk"), None, Some("")])) as ArrayRef,
            ),
            (
                "b",
                Arc::new(BooleanArray::from(vec![true, false, true])) as ArrayRef,
            ),
        ])
        .unwrap()
        .slice(1, 2);
        let device = upload(&runtime, &batch).unwrap();
        assert_eq!(device.rows, 2);
        let back = download(&runtime, &device).unwrap();
        assert_eq!(back.columns(), batch.columns());
        assert_eq!(runtime.transfers.totals(Direction::ToDevice).1, 1);
        assert_eq!(runtime.transfers.totals(Direction::ToHost).1, 1);
    }
}

//! Host-side tables and columns: what a guest's `table` and `column` handles point at.
//!
//! A table is an immutable Arrow `RecordBatch` behind an `Arc`, so handing a table to another
//! task, the partition store or a peer never copies its buffers.

use std::sync::Arc;

use std::io::Cursor;

use arrow::array::ArrayRef;
use arrow::datatypes::SchemaRef;
use arrow::error::ArrowError;
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::StreamWriter;
use arrow::record_batch::RecordBatch;

/// An immutable columnar table held by the worker.
#[derive(Debug, Clone)]
pub struct Table {
    batch: Arc<RecordBatch>,
    /// Whether every task of the worker that reads this input gets this same table (a
    /// broadcast input): work derived from it alone, such as a join's hash index, is worth
    /// keeping for the other tasks.
    shared: bool,
}

impl Table {
    pub fn new(batch: RecordBatch) -> Self {
        Table {
            batch: Arc::new(batch),
            shared: false,
        }
    }

    /// The same table, marked as shared by the worker's tasks.
    pub fn into_shared(self) -> Self {
        Table {
            shared: true,
            ..self
        }
    }

    pub fn is_shared(&self) -> bool {
        self.shared
    }

    pub fn batch(&self) -> &RecordBatch {
        &self.batch
    }

    pub fn schema(&self) -> SchemaRef {
        self.batch.schema()
    }

    pub fn num_rows(&self) -> usize {
        self.batch.num_rows()
    }

    /// How many handles share this table (the store, tasks, transfers): 1 means only its
    /// current holder has it.
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.batch)
    }

    /// Bytes of the Arrow buffers this table references.
    pub fn memory_bytes(&self) -> usize {
        self.batch.get_array_memory_size()
    }
}

impl From<RecordBatch> for Table {
    fn from(batch: RecordBatch) -> Self {
        Table::new(batch)
    }
}

/// A named column: one Arrow array.
#[derive(Debug, Clone)]
pub struct Column {
    pub name: String,
    pub array: ArrayRef,
}

impl Column {
    pub fn new(name: impl Into<String>, array: ArrayRef) -> Self {
        Column {
            name: name.into(),
            array,
        }
    }
}

/// Encodes a batch as an Arrow IPC stream: the format of explicit guest copies and of transfers
/// between workers.
pub fn encode_ipc(batch: &RecordBatch) -> Result<Vec<u8>, ArrowError> {
    let mut writer = StreamWriter::try_new(Vec::new(), &batch.schema())?;
    writer.write(batch)?;
    writer.into_inner()
}

/// Decodes an Arrow IPC stream into one batch.
pub fn decode_ipc(bytes: &[u8]) -> Result<RecordBatch, ArrowError> {
    let reader = StreamReader::try_new(Cursor::new(bytes), None)?;
    let schema = reader.schema();
    let batches = reader.collect::<Result<Vec<_>, _>>()?;
    arrow::compute::concat_batches(&schema, &batches)
}

//! Host-side tables and columns: what a guest's `table` and `column` handles point at.
//!
//! A table is an immutable Arrow `RecordBatch` behind an `Arc`, so handing a table to another
//! task, the partition store or a peer never copies its buffers.

use std::sync::Arc;

use arrow::array::ArrayRef;
use arrow::datatypes::{Schema, SchemaRef};
use arrow::record_batch::RecordBatch;

/// An immutable columnar table held by the worker.
#[derive(Debug, Clone)]
pub struct Table {
    batch: Arc<RecordBatch>,
}

impl Table {
    pub fn new(batch: RecordBatch) -> Self {
        Table {
            batch: Arc::new(batch),
        }
    }

    pub fn empty(schema: SchemaRef) -> Self {
        Table::new(RecordBatch::new_empty(schema))
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

/// An empty schema, for tables made of no columns.
pub fn empty_schema() -> SchemaRef {
    Arc::new(Schema::empty())
}

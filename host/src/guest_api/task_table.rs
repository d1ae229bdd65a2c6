//! What a guest's `table` handle points at: a table in host memory, or on a GPU worker one in
//! device memory ([`ResidentTable`]).
//!
//! Tables reach a task in host memory (Parquet reads, partitions from the store, shuffle
//! pieces, the guest's own copies) and move to the device the first time a device operator
//! reads them; operators the device runs leave their results there. A table leaves the device
//! only when something needs it in host memory: an operator no kernel covers, a copy into the
//! guest, a shuffle send, a Parquet write, or the task's output going to the store. Every move
//! is a counted transfer, made once per table.

use std::sync::Arc;

use arrow::datatypes::SchemaRef;

use crate::gpu::resident::ResidentTable;
use crate::gpu::table::TableError;
use crate::table::Table;

#[derive(Clone)]
pub enum TaskTable {
    Host(Table),
    Device(Arc<ResidentTable>),
}

impl TaskTable {
    pub fn schema(&self) -> SchemaRef {
        match self {
            TaskTable::Host(table) => table.schema(),
            TaskTable::Device(table) => table.schema(),
        }
    }

    pub fn num_rows(&self) -> usize {
        match self {
            TaskTable::Host(table) => table.num_rows(),
            TaskTable::Device(table) => table.rows(),
        }
    }

    /// The table in host memory: downloaded from the device (once, counted) if it has no host
    /// copy yet.
    pub fn host(&self) -> Result<Table, TableError> {
        match self {
            TaskTable::Host(table) => Ok(table.clone()),
            TaskTable::Device(table) => table.host(),
        }
    }
}

impl From<Table> for TaskTable {
    fn from(table: Table) -> Self {
        TaskTable::Host(table)
    }
}

//! What a guest's `table` handle points at: a table in host memory, or on a GPU worker one in
//! device memory ([`ResidentTable`]).
//!
//! Tables reach a task in host memory (Parquet reads, partitions from the store, shuffle
//! pieces, the guest's own copies) and move to the device the first time a device operator
//! reads them; operators the device runs leave their results there. A table leaves the device
//! only when something needs it in host memory: an operator no kernel covers, a copy into the
//! guest, a shuffle send, a Parquet write. A task's outputs go to the partition store as they
//! are, and the next stage's tasks on the worker read them from there; a stored device table
//! comes to host memory when a peer fetches it. Every move is a counted transfer, made once
//! per table.

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

impl std::fmt::Debug for TaskTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (place, rows) = match self {
            TaskTable::Host(table) => ("host", table.num_rows()),
            TaskTable::Device(table) => ("device", table.rows()),
        };
        f.debug_struct("TaskTable")
            .field("memory", &place)
            .field("rows", &rows)
            .finish()
    }
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

    /// Whether the worker's tasks share it (a broadcast input): a join caches its index on it.
    pub fn is_shared(&self) -> bool {
        match self {
            TaskTable::Host(table) => table.is_shared(),
            TaskTable::Device(table) => table.is_shared(),
        }
    }

    /// Bytes it takes where it is (a device table: in device memory until spilled).
    pub fn memory_bytes(&self) -> u64 {
        match self {
            TaskTable::Host(table) => table.memory_bytes() as u64,
            TaskTable::Device(table) => table.bytes(),
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

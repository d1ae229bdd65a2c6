//! The host side of the `wrk:task` WIT contract: generated bindings, the per-task store state and
//! the implementations of the `dataframe`, `io`, `memory`, `shuffle` and `context` interfaces.
//!
//! Guests hold handles (WIT resources) whose host values live in the task's `ResourceTable`; the
//! values share their data behind `Arc`s, so a guest may drop a table before a column taken from
//! it.

mod context;
mod dataframe;
mod dispatch;
mod io;
mod memory;
mod shuffle;
mod task_table;

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::ArrayRef;
use arrow::record_batch::RecordBatch;
use wasmtime::component::{Resource, ResourceTable};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::expr::Expr;
use crate::limits::MemoryLimiter;
use crate::store::{PoolError, TaskMemory};
use crate::table::{Column, Table};
pub use task_table::TaskTable;

/// Bindings generated from `wit/` by wasmtime.
pub mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "task",
        imports: { default: trappable },
        with: {
            "wrk:task/dataframe.table": crate::guest_api::TaskTable,
            "wrk:task/dataframe.column": crate::table::Column,
            "wrk:task/dataframe.expr": crate::guest_api::ExprHandle,
            "wrk:task/memory.lease": crate::store::Lease,
            "wrk:task/shuffle.pieces": crate::shuffle::PieceStream,
        },
    });
}

/// The WIT types the rest of the host works with.
pub mod wit {
    pub use super::bindings::wrk::task::dataframe::{
        Aggregate, AggregateOp, BinaryOp, ColumnValues, JoinType, SortKey, UnaryOp, Values,
    };
    pub use super::bindings::wrk::task::types::{DataType, Error, ErrorCode, Field, Scalar};
}

/// The semantic version of the `wrk:task` package this host implements.
pub const WIT_PACKAGE: &str = "wrk:task";
pub const WIT_VERSION: &str = "0.1.0";

/// What an `expr` handle points at.
#[derive(Debug, Clone)]
pub struct ExprHandle(pub Arc<Expr>);

/// Who the running task is and what it was granted.
#[derive(Debug, Clone, Default)]
pub struct TaskInfo {
    pub job_id: String,
    pub job_name: String,
    pub stage_name: String,
    pub task_index: u32,
    pub task_count: u32,
    pub params: BTreeMap<String, String>,
    /// Granted sources and sinks: name to URI.
    pub sources: BTreeMap<String, String>,
    pub sinks: BTreeMap<String, String>,
    /// The component's human name (its file name), for logs and errors.
    pub module_name: String,
    /// The exchanges the task sends to and receives from, when it runs in a cluster.
    pub shuffle: Option<Arc<crate::shuffle::TaskShuffle>>,
    /// The worker's GPU, on which the task's table operators run where kernels cover them.
    pub gpu: Option<Arc<crate::gpu::GpuRuntime>>,
}

/// Bytes a task explicitly copied between host tables and its own memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyStats {
    pub into_guest_bytes: u64,
    pub out_of_guest_bytes: u64,
}

/// The data of one task's wasmtime `Store`.
pub struct TaskState {
    pub(crate) table: ResourceTable,
    wasi: WasiCtx,
    pub(crate) info: Arc<TaskInfo>,
    pub(crate) copies: CopyStats,
    pub(crate) limiter: MemoryLimiter,
    /// The task's share of the worker's memory pool.
    pub(crate) memory: Arc<TaskMemory>,
    /// The last time the pool turned the task away because other tasks held the memory (it
    /// may succeed when run again).
    pub(crate) gave_way: Option<String>,
}

impl TaskState {
    pub(crate) fn new(
        info: Arc<TaskInfo>,
        wasi: WasiCtx,
        limiter: MemoryLimiter,
        memory: Arc<TaskMemory>,
    ) -> Self {
        TaskState {
            table: ResourceTable::new(),
            wasi,
            info,
            copies: CopyStats::default(),
            limiter,
            memory,
            gave_way: None,
        }
    }

    /// A pool refusal as the guest's `resource-exhausted` error, remembered when another attempt
    /// may succeed.
    pub(crate) fn pool_error(&mut self, e: PoolError) -> wit::Error {
        let message = e.to_string();
        if e.retriable() {
            self.gave_way = Some(message.clone());
        }
        error(wit::ErrorCode::ResourceExhausted, message)
    }

    /// Stores a table the task made as a new handle, counted in the task's working set; a
    /// working set the pool can never hold is the guest's `resource-exhausted` error.
    pub(crate) fn push_table(
        &mut self,
        batch: RecordBatch,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, wit::Error>> {
        if let Err(e) = self.memory.track(&batch) {
            return Ok(Err(self.pool_error(e)));
        }
        Ok(Ok(self.table.push(TaskTable::Host(Table::new(batch)))?))
    }

    /// The table behind `handle` in host memory (downloaded from the device, counted, if it
    /// is only there), or the guest's error naming `operation` when that copy fails.
    pub(crate) fn host_input(
        &self,
        handle: &Resource<TaskTable>,
        operation: &str,
    ) -> wasmtime::Result<Result<Table, wit::Error>> {
        let table = self.table.get(handle)?;
        Ok(table.host().map_err(|e| {
            error(
                wit::ErrorCode::Internal,
                format!("{operation}: copying the table from the device failed: {e}"),
            )
        }))
    }

    /// Stores a column the task made as a new handle; see [`TaskState::push_table`].
    pub(crate) fn push_column(
        &mut self,
        name: String,
        array: ArrayRef,
    ) -> wasmtime::Result<Result<Resource<Column>, wit::Error>> {
        if let Err(e) = self.memory.track_array(array.as_ref()) {
            return Ok(Err(self.pool_error(e)));
        }
        Ok(Ok(self.table.push(Column::new(name, array))?))
    }
}

impl WasiView for TaskState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl bindings::wrk::task::types::Host for TaskState {}

/// A WIT error value.
pub(crate) fn error(code: wit::ErrorCode, message: impl Into<String>) -> wit::Error {
    wit::Error {
        code,
        message: message.into(),
    }
}

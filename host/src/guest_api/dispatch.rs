//! Where a guest's table operator runs. On a worker without a GPU: the CPU backend. On a GPU
//! worker: on the device when its inputs can live there and a kernel covers the operator (the
//! result stays on the device), else on the CPU backend with the inputs in host memory. Every
//! operator is counted by where it ran (`wrk_worker_device_operators_total`).

use std::sync::Arc;

use arrow::datatypes::Schema;
use arrow::record_batch::RecordBatch;
use wasmtime::component::Resource;

use super::wit::{Error, ErrorCode};
use super::{TaskState, TaskTable, error};
use crate::gpu::exec::ExecError;
use crate::gpu::ops::GpuOpError;
use crate::gpu::resident::ResidentTable;
use crate::gpu::table::{DeviceTable, TableError, device_schema, uploadable};
use crate::gpu::{GpuRuntime, RanOn};
use crate::table::Table;

/// An operator on device tables (its inputs in order), making a `D`.
pub(crate) type DeviceOp<'a, D = DeviceTable> =
    &'a dyn Fn(&GpuRuntime, &[&DeviceTable]) -> Result<D, GpuOpError>;

/// Whether a device operator's failure sends the operator to the CPU backend (which then
/// gives the result, or the error a CPU worker would give) rather than to the guest.
fn runs_on_host_instead(e: &GpuOpError) -> bool {
    match e {
        GpuOpError::Unsupported { .. } | GpuOpError::Invalid { .. } | GpuOpError::Expr(_) => true,
        GpuOpError::Exec(e) => matches!(
            e,
            ExecError::Pool(_)
                | ExecError::Table(TableError::Pool(_) | TableError::Unsupported { .. })
                | ExecError::TooManyRows { .. }
        ),
    }
}

impl TaskState {
    /// The worker's GPU, when it has one.
    pub(crate) fn gpu(&self) -> Option<Arc<GpuRuntime>> {
        self.info.gpu.clone()
    }

    /// Whether the worker has a GPU whose kernels cover an operator on `inputs`, by `covers`
    /// over their schemas as device tables (see `gpu::ops::expression_covers`).
    pub(crate) fn device_covers(
        &self,
        inputs: &[&Resource<TaskTable>],
        covers: impl FnOnce(&[Schema]) -> bool,
    ) -> wasmtime::Result<bool> {
        if self.info.gpu.is_none() {
            return Ok(false);
        }
        let schemas = inputs
            .iter()
            .map(|h| Ok(device_schema(&self.table.get(h)?.schema())))
            .collect::<wasmtime::Result<Vec<Schema>>>()?;
        Ok(covers(&schemas))
    }

    /// Stores a device operator's result as a new table handle.
    pub(crate) fn push_device(
        &mut self,
        gpu: &Arc<GpuRuntime>,
        table: DeviceTable,
    ) -> wasmtime::Result<Resource<TaskTable>> {
        let owner = Some(self.memory.account().clone());
        let resident = ResidentTable::new(gpu, table, None, owner);
        Ok(self.table.push(TaskTable::Device(resident))?)
    }

    /// The inputs in device memory, uploading host tables (once: the handle then points at
    /// the device copy); `None` when one cannot live on the device (a type without a device
    /// layout, or no room in the device pool).
    fn device_inputs(
        &mut self,
        gpu: &Arc<GpuRuntime>,
        operator: &str,
        inputs: &[&Resource<TaskTable>],
    ) -> wasmtime::Result<Option<Vec<Arc<DeviceTable>>>> {
        let mut tables = Vec::with_capacity(inputs.len());
        for handle in inputs {
            let resident = match self.table.get(handle)? {
                TaskTable::Device(resident) => resident.clone(),
                TaskTable::Host(table) => {
                    if !uploadable(&table.schema()) {
                        tracing::debug!(operator, "an input has columns the device cannot hold");
                        return Ok(None);
                    }
                    let owner = Some(self.memory.account().clone());
                    match ResidentTable::upload(gpu, table.clone(), owner) {
                        Ok(resident) => {
                            *self.table.get_mut(handle)? = TaskTable::Device(resident.clone());
                            resident
                        }
                        Err(e) => {
                            tracing::debug!(operator, "an input stays in host memory: {e}");
                            return Ok(None);
                        }
                    }
                }
            };
            match resident.device() {
                Ok(table) => tables.push(table),
                Err(e) => {
                    tracing::debug!(operator, "an input stays in host memory: {e}");
                    return Ok(None);
                }
            }
        }
        Ok(Some(tables))
    }

    /// Runs `operator` on the device (through `device`) when it can, else on the CPU backend
    /// (through `host`, given the inputs in host memory); see the module's documentation.
    /// `device` is `None` for operators no kernel covers.
    pub(crate) fn run_on_device_or_host<D, H>(
        &mut self,
        operator: &'static str,
        inputs: &[&Resource<TaskTable>],
        device: Option<DeviceOp<D>>,
        host: impl FnOnce(&[Table]) -> Result<H, Error>,
    ) -> wasmtime::Result<Result<Placed<D, H>, Error>> {
        if let Some(gpu) = self.gpu() {
            if let Some(device) = device
                && let Some(tables) = self.device_inputs(&gpu, operator, inputs)?
            {
                let tables: Vec<&DeviceTable> = tables.iter().map(Arc::as_ref).collect();
                match device(&gpu, &tables) {
                    Ok(result) => {
                        gpu.operators.record(operator, RanOn::Device);
                        return Ok(Ok(Placed::Device(gpu, result)));
                    }
                    Err(e) if runs_on_host_instead(&e) => {
                        tracing::debug!(operator, "runs on the CPU backend: {e}");
                    }
                    Err(e) => {
                        return Ok(Err(error(
                            ErrorCode::Internal,
                            format!("{operator} on the GPU failed: {e}"),
                        )));
                    }
                }
            }
            gpu.operators.record(operator, RanOn::Host);
        }
        let mut tables = Vec::with_capacity(inputs.len());
        for handle in inputs {
            match self.host_input(handle, operator)? {
                Ok(table) => tables.push(table),
                Err(e) => return Ok(Err(e)),
            }
        }
        Ok(host(&tables).map(Placed::Host))
    }

    /// [`TaskState::run_on_device_or_host`] for operators that make one table, stored as a
    /// new handle.
    pub(crate) fn table_op(
        &mut self,
        operator: &'static str,
        inputs: &[&Resource<TaskTable>],
        device: Option<DeviceOp>,
        host: impl FnOnce(&[Table]) -> Result<RecordBatch, Error>,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        match self.run_on_device_or_host(operator, inputs, device, host)? {
            Ok(Placed::Device(gpu, table)) => Ok(Ok(self.push_device(&gpu, table)?)),
            Ok(Placed::Host(batch)) => self.push_table(batch),
            Err(e) => Ok(Err(e)),
        }
    }
}

/// An operator's result: made on the device, or on the host.
pub(crate) enum Placed<D, H> {
    Device(Arc<GpuRuntime>, D),
    Host(H),
}

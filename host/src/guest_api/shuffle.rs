//! The `shuffle` interface: a mapper sends hash-partitions of its tables to an exchange, a
//! reducer receives its own partition, through the task's [`TaskShuffle`].

use wasmtime::component::Resource;

use super::bindings::wrk::task::shuffle::{Host, HostPieces};
use super::dispatch::{DeviceOp, Placed};
use super::wit::{Error, ErrorCode};
use super::{TaskState, TaskTable, error};
use crate::cpu::partition;
use crate::gpu::ops as gpu_ops;
use crate::gpu::table::download;
use crate::shuffle::pieces::PieceError;
use crate::shuffle::{PieceStream, ShuffleError, TaskShuffle};
use crate::table::Table;

fn shuffle_error(e: ShuffleError) -> Error {
    let code = match &e {
        ShuffleError::NotSending { .. }
        | ShuffleError::NotReceiving { .. }
        | ShuffleError::PartitionCount { .. } => ErrorCode::InvalidArgument,
        ShuffleError::Pieces { .. } => ErrorCode::TypeMismatch,
        ShuffleError::Piece(PieceError::Pool(_)) => ErrorCode::ResourceExhausted,
        ShuffleError::Transport(_) | ShuffleError::Piece(_) => ErrorCode::Io,
    };
    error(code, e.to_string())
}

impl TaskState {
    fn shuffle(&self) -> Result<&TaskShuffle, Error> {
        self.info.shuffle.as_deref().ok_or_else(|| {
            error(
                ErrorCode::InvalidArgument,
                "this task takes part in no exchange (it runs outside a cluster, or its job declares none)",
            )
        })
    }
}

impl Host for TaskState {
    fn outgoing(&mut self) -> wasmtime::Result<Vec<String>> {
        Ok(self
            .shuffle()
            .map(TaskShuffle::outgoing)
            .unwrap_or_default())
    }

    fn partitions(&mut self, exchange: String) -> wasmtime::Result<Result<u32, Error>> {
        Ok(self
            .shuffle()
            .and_then(|s| s.partitions(&exchange).map_err(shuffle_error)))
    }

    fn send(
        &mut self,
        exchange: String,
        data: Resource<TaskTable>,
        keys: Vec<String>,
    ) -> wasmtime::Result<Result<(), Error>> {
        let partitions = match self
            .shuffle()
            .and_then(|s| s.partitions(&exchange).map_err(shuffle_error))
        {
            Ok(n) => n,
            Err(e) => return Ok(Err(e)),
        };
        // A table only on the device is partitioned there, and the pieces come to host memory
        // (counted) for the exchange; one with a copy in host memory is partitioned there,
        // with no transfer.
        let on_device = matches!(
            self.table.get(&data)?,
            TaskTable::Device(t) if t.on_device() && t.host_copy().is_none()
        );
        let device: DeviceOp<_> = &|gpu, t| gpu_ops::hash_partition(gpu, t[0], &keys, partitions);
        let device = on_device.then_some(device);
        let placed = self.run_on_device_or_host("shuffle.send", &[&data], device, |t| {
            partition::hash_partition(t[0].batch(), &keys, partitions).map_err(|e| {
                error(
                    ErrorCode::InvalidArgument,
                    format!("shuffle.send to exchange `{exchange}`: {e}"),
                )
            })
        })?;
        let parts: Vec<Table> = match placed {
            Ok(Placed::Device(gpu, parts)) => {
                let mut tables = Vec::with_capacity(parts.len());
                for part in &parts {
                    match download(&gpu, part) {
                        Ok(batch) => tables.push(Table::new(batch)),
                        Err(e) => {
                            return Ok(Err(error(
                                ErrorCode::Internal,
                                format!(
                                    "shuffle.send to exchange `{exchange}`: copying a partition from the device failed: {e}"
                                ),
                            )));
                        }
                    }
                }
                tables
            }
            Ok(Placed::Host(parts)) => parts.into_iter().map(Table::new).collect(),
            Err(e) => return Ok(Err(e)),
        };
        Ok(self
            .shuffle()
            .and_then(|s| s.send(&exchange, parts).map_err(shuffle_error)))
    }

    fn send_partitions(
        &mut self,
        exchange: String,
        parts: Vec<Resource<TaskTable>>,
    ) -> wasmtime::Result<Result<(), Error>> {
        let mut tables = Vec::with_capacity(parts.len());
        for part in parts {
            let part = self.table.delete(part)?;
            match part.host() {
                Ok(table) => tables.push(table),
                Err(e) => {
                    return Ok(Err(error(
                        ErrorCode::Internal,
                        format!(
                            "shuffle.send-partitions: copying a partition from the device failed: {e}"
                        ),
                    )));
                }
            }
        }
        if let Some(first) = tables.first()
            && let Some(other) = tables.iter().find(|t| t.schema() != first.schema())
        {
            return Ok(Err(error(
                ErrorCode::TypeMismatch,
                format!(
                    "shuffle.send-partitions to exchange `{exchange}`: the partitions have different schemas: {:?} and {:?}",
                    first.schema().fields(),
                    other.schema().fields()
                ),
            )));
        }
        Ok(self
            .shuffle()
            .and_then(|s| s.send(&exchange, tables).map_err(shuffle_error)))
    }

    fn receive_pieces(
        &mut self,
        exchange: String,
    ) -> wasmtime::Result<Result<Resource<PieceStream>, Error>> {
        let stream = self
            .shuffle()
            .and_then(|s| s.receive_pieces(&exchange).map_err(shuffle_error));
        match stream {
            Ok(stream) => Ok(Ok(self.table.push(stream)?)),
            Err(e) => Ok(Err(e)),
        }
    }

    fn receive(
        &mut self,
        exchange: String,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        let received = self
            .shuffle()
            .and_then(|s| s.receive(&exchange, &self.memory).map_err(shuffle_error));
        match received {
            Ok(table) => Ok(Ok(self.table.push(TaskTable::Host(table))?)),
            Err(e) => Ok(Err(e)),
        }
    }
}

impl HostPieces for TaskState {
    fn next(
        &mut self,
        pieces: Resource<PieceStream>,
    ) -> wasmtime::Result<Result<Option<Resource<TaskTable>>, Error>> {
        let memory = self.memory.clone();
        let next = self.table.get_mut(&pieces)?.next(&memory);
        match next {
            Ok(Some(table)) => Ok(Ok(Some(self.table.push(TaskTable::Host(table))?))),
            Ok(None) => Ok(Ok(None)),
            Err(e) => Ok(Err(shuffle_error(e))),
        }
    }

    fn drop(&mut self, pieces: Resource<PieceStream>) -> wasmtime::Result<()> {
        self.table.delete(pieces)?;
        Ok(())
    }
}

//! The `memory` interface: pool statistics and leases over the task's [`TaskMemory`].

use wasmtime::component::Resource;

use super::TaskState;
use super::bindings::wrk::task::memory::{Host, HostLease, PoolStats};
use super::wit::Error;
use crate::store::Lease;

impl Host for TaskState {
    fn stats(&mut self) -> wasmtime::Result<PoolStats> {
        let stats = self.memory.stats();
        Ok(PoolStats {
            size: stats.size,
            used: stats.used,
            peak: stats.peak,
            spilled_host: stats.spilled_host,
            spilled_disk: stats.spilled_disk,
            spills: stats.spills,
            unspills: stats.unspills,
            task_bytes: self.memory.account().working_set(),
        })
    }

    fn take_lease(&mut self, bytes: u64) -> wasmtime::Result<Result<Resource<Lease>, Error>> {
        match self.memory.lease(bytes) {
            Ok(lease) => Ok(Ok(self.table.push(lease)?)),
            Err(e) => Ok(Err(self.pool_error(e))),
        }
    }
}

impl HostLease for TaskState {
    fn bytes(&mut self, self_: Resource<Lease>) -> wasmtime::Result<u64> {
        Ok(self.table.get(&self_)?.bytes())
    }

    fn drop(&mut self, rep: Resource<Lease>) -> wasmtime::Result<()> {
        self.table.delete(rep)?;
        Ok(())
    }
}

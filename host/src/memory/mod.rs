//! The worker's memory pool (BRIEF §2; seed 000's RMM pool and spilling).
//!
//! One pool per worker, of a configured size ([`size`]), accounts every Arrow buffer the worker
//! holds ([`pool`]): partitions in the store and the tables of running tasks, plus the leases
//! tasks take for their working set. Under pressure, the store ([`crate::store`]) spills
//! least-recently-used partitions that no running task holds to Arrow IPC files ([`spill`]) and
//! reads them back when a task or a peer needs them. Operators' output buffers are reused from
//! size classes ([`buffers`]). See `docs/memory.md`.

pub mod buffers;
pub mod pool;
pub mod size;
pub mod spill;

pub use pool::{Account, Pool, PoolStats, Tier};
pub use size::{Bytes, MachineMemory, MemorySettings, SizeSpec};
pub use spill::SpillDir;

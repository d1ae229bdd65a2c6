//! `wrk-host`: the worker runtime.
//!
//! A worker runs `wrk:task` WebAssembly components (see `wit/`) in wasmtime, gives them handles
//! to tables held in its memory, executes their operators natively on its device backend, keeps
//! task outputs keyed by job/stage/task/output, serves them to peers, and talks to the scheduler.
//!
//! - [`engine`]: compiling, caching and running components with limits.
//! - [`guest_api`]: the host side of the WIT interfaces.
//! - [`expr`], [`table`], [`cpu`]: expressions, tables and the CPU (Arrow) backend.
//! - [`gpu`], [`device`]: the CUDA backend, and the worker's choice of device.
//! - [`io`]: Parquet sources and sinks.
//! - [`memory`]: the worker's memory pool: sizing, accounting, spill files.
//! - [`store`]: the worker's partitions, spilled and read back under memory pressure.
//! - [`metrics`]: the worker's Prometheus metrics.
//! - [`transfer`]: the peer-to-peer partition service and client.
//! - [`shuffle`]: the P2P shuffle: piece store, transports, a task's exchanges.
//! - [`worker`]: the worker process: scheduler channel, task execution.

pub mod cpu;
pub mod device;
pub mod engine;
pub mod expr;
pub mod gpu;
pub mod guest_api;
pub mod io;
pub mod limits;
pub mod memory;
pub mod metrics;
pub mod object_cache;
mod prune;
pub mod remote;
pub mod shuffle;
pub mod store;
pub mod table;
pub mod transfer;
pub mod worker;

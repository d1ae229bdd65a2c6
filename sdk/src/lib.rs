//! Write wrk tasks in Rust.
//!
//! A wrk task is a WebAssembly component (`wasm32-wasip2`) exporting the `wrk:task` world: it
//! receives its input tables and returns its output tables. The tables stay in the host, on the
//! worker's device; the task drives the host's dataframe operators through handles, and no data
//! crosses into the guest unless the task asks for an explicit, counted copy
//! ([`Column::to_values`], [`Table::to_ipc`], ...).
//!
//! This crate wraps the generated bindings in an idiomatic API:
//!
//! - [`Task`] and [`export_task!`] declare the task;
//! - [`Table`], [`Column`] and [`Expr`] ([`col`], [`lit`], operators) drive the host's
//!   operators, with [`Table::group_by`] taking aggregates such as [`sum`] and [`count`];
//! - [`io`] reads and writes Parquet through the sources and sinks the job granted;
//! - [`memory`] reads the worker's pool statistics and takes leases for a working set;
//! - [`shuffle`] sends hash-partitions to the reducers of an exchange and receives one's own;
//! - [`context`] tells the task who and where it is, hands it its parameters and logs
//!   ([`info!`], [`warn!`], ...);
//! - every fallible call returns [`Result`], whose [`Error`] goes back to the host from `run`.
//!
//! # Example
//!
//! A guest crate is a `cdylib` depending on this crate; built with
//! `cargo build --release --target wasm32-wasip2` it is a component ready for the host.
//!
//! ```
//! use wrk_sdk::prelude::*;
//!
//! /// Keeps the trips longer than a threshold and sums their fares per passenger count.
//! struct LongFares;
//!
//! impl Task for LongFares {
//!     fn run(inputs: Vec<Table>) -> Result<Vec<Table>> {
//!         let min_km: f64 = context::param_as("min_km")?.unwrap_or(1.0);
//!         let trips = match inputs.first() {
//!             Some(trips) => trips.with_column("km", col("miles") * 1.609_344)?,
//!             None => read_parquet("trips").columns(["miles", "passengers", "fare"]).read()?,
//!         };
//!         let long = trips.filter(col("km").gt(min_km).and(col("fare").is_not_null()))?;
//!         info!("task {} of {}: {} long trips", context::task_index(), context::task_count(),
//!             long.num_rows());
//!         let fares = long
//!             .group_by(["passengers"])
//!             .agg([sum("fare").alias("total_fare"), count("fare"), mean("km")])?;
//!         // `count("fare")` and `mean("km")` are named `fare_count` and `km_mean`.
//!         Ok(vec![fares])
//!     }
//! }
//!
//! wrk_sdk::export_task!(LongFares);
//! ```

pub mod bindings;
pub mod context;
pub mod io;
pub mod memory;
pub mod prelude;
pub mod shuffle;

mod aggregate;
mod column;
mod error;
mod expr;
mod order;
mod table;
mod task;
mod types;

pub use aggregate::{Agg, AggregateOp, count, count_distinct, max, mean, min, sum};
pub use bindings::wrk::task::dataframe::JoinType;
pub use column::{Column, ColumnValues, Values};
pub use error::{Error, ErrorCode, Result};
pub use expr::{Expr, Then, When, col, if_else, lit, when};
pub use order::{SortKey, asc, desc};
pub use table::{GroupBy, Table};
pub use task::Task;
#[doc(hidden)]
pub use task::TaskExport;
pub use types::{DataType, Field, Scalar};

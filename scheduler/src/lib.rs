//! `wrk-scheduler`: runs job graphs across workers.
//!
//! Workers attach over a bidirectional gRPC stream (register, heartbeat, task reports; the
//! scheduler assigns tasks and releases data). Clients submit job graphs, watch their progress
//! and fetch where the results are; the data itself moves between workers and clients directly.
//!
//! - [`graph`]: validation of submitted job graphs.
//! - [`state`]: the task state machine, placement, retries, recovery from lost workers.
//! - [`tenants`]: tenants, their tokens, weights and quotas.
//! - [`tags`]: worker tags and the stage requirements they meet.
//! - [`metrics`]: Prometheus metrics.
//! - [`timeline`]: bounded records of task executions and transfers, for dashboards and reports.
//! - [`dashboard`]: the live web dashboard and its JSON endpoints.
//! - [`service`]: the tonic service, the HTTP endpoints and [`serve`].

pub mod dashboard;
pub mod graph;
pub mod metrics;
pub mod service;
pub mod state;
pub mod tags;
pub mod tenants;
pub mod timeline;

pub use service::{SchedulerConfig, SchedulerService, ServeError, serve};

//! Read-only views of the state: what the dashboard's JSON endpoints serve and what a job's
//! performance report is made from. They are built under the state's lock from counters and the
//! bounded records of [`crate::timeline`] (never by walking a job's task table), and serialised
//! after it is released.

use std::collections::HashMap;

use serde::Serialize;
use wrk_proto::{
    JobState, JobTimeline, MemorySample, TaskExecution, TimelineWorker, TransferRecord,
};

use super::{State, StateError, is_terminal};

/// Finished jobs the dashboard lists besides the unfinished ones.
const FINISHED_JOBS_SHOWN: usize = 20;
/// Most records one page of `/api/tasks` or `/api/transfers` carries.
pub const MAX_PAGE: usize = 5_000;

/// `pending`, `running`, ... for a job state.
pub fn state_name(state: JobState) -> &'static str {
    match state {
        JobState::Pending => "pending",
        JobState::Running => "running",
        JobState::Succeeded => "succeeded",
        JobState::Failed => "failed",
        JobState::Cancelled => "cancelled",
        JobState::Unspecified => "unspecified",
    }
}

#[derive(Debug, Serialize)]
pub struct WorkerView {
    pub id: String,
    pub address: String,
    pub http_address: String,
    pub device: String,
    pub slots: u32,
    /// Its tags (given and automatic), which stages can require.
    pub tags: Vec<String>,
    /// Tasks assigned: running, or queued on the worker.
    pub assigned: u32,
    pub pool_bytes: u64,
    pub pool_used_bytes: u64,
    pub partitions: u64,
    /// Milliseconds since its last message.
    pub seen_ms_ago: u64,
    /// A GPU worker's device and latest telemetry (absent on CPU workers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuView>,
}

/// A GPU worker's device, with its latest NVML sample (fields NVML does not support are null).
#[derive(Debug, Serialize)]
pub struct GpuView {
    pub name: String,
    pub uuid: String,
    pub mig_profile: String,
    pub memory_total_bytes: u64,
    pub memory_used_bytes: Option<u64>,
    pub sm_utilization: Option<f64>,
    pub temperature_celsius: Option<f64>,
    pub power_watts: Option<f64>,
    pub pcie_tx_bytes_per_second: Option<f64>,
    pub pcie_rx_bytes_per_second: Option<f64>,
}

impl GpuView {
    fn new(info: &wrk_proto::GpuInfo, telemetry: Option<&wrk_proto::GpuTelemetry>) -> Self {
        GpuView {
            name: info.name.clone(),
            uuid: info.uuid.clone(),
            mig_profile: info.mig_profile.clone(),
            memory_total_bytes: info.memory_total_bytes,
            memory_used_bytes: telemetry.map(|t| t.memory_used_bytes),
            sm_utilization: telemetry.and_then(|t| t.sm_utilization),
            temperature_celsius: telemetry.and_then(|t| t.temperature_celsius),
            power_watts: telemetry.and_then(|t| t.power_watts),
            pcie_tx_bytes_per_second: telemetry.and_then(|t| t.pcie_tx_bytes_per_second),
            pcie_rx_bytes_per_second: telemetry.and_then(|t| t.pcie_rx_bytes_per_second),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct WorkersView {
    pub now_us: u64,
    pub epoch_unix_ms: u64,
    /// Tasks ready to run, waiting for a free slot.
    pub ready_tasks: usize,
    pub workers: Vec<WorkerView>,
}

#[derive(Debug, Serialize)]
pub struct StageView {
    pub name: String,
    pub total: u32,
    pub done: u32,
    pub running: u32,
}

#[derive(Debug, Serialize)]
pub struct JobView {
    pub id: String,
    pub name: String,
    pub tenant: String,
    /// Its priority among its tenant's jobs (higher runs first).
    pub priority: i32,
    pub state: &'static str,
    pub error: String,
    /// Why ready tasks of the job are not running (no worker with a required tag); empty
    /// otherwise.
    pub waiting: String,
    pub submitted_us: u64,
    pub finished_us: Option<u64>,
    pub stages: Vec<StageView>,
}

#[derive(Debug, Serialize)]
pub struct JobsView {
    pub now_us: u64,
    pub jobs: Vec<JobView>,
}

#[derive(Debug, Serialize)]
pub struct ExecutionView {
    pub seq: u64,
    pub job: String,
    pub stage: String,
    pub task: u32,
    pub attempt: u32,
    pub worker: String,
    pub start_us: u64,
    pub end_us: u64,
    pub ok: bool,
    pub error: Option<String>,
    pub output_bytes: u64,
    pub output_rows: u64,
    pub fetched_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct TransferView {
    pub seq: u64,
    pub job: String,
    pub stage: String,
    pub task: u32,
    pub from: String,
    pub to: String,
    pub bytes: u64,
    pub at_us: u64,
}

/// A page of records read by cursor: ask again with `next`; `missed` records were overwritten
/// before this read.
#[derive(Debug, Serialize)]
pub struct Page<T> {
    pub now_us: u64,
    pub next: u64,
    pub missed: u64,
    pub items: Vec<T>,
}

impl State {
    /// The job id and the name of stage `stage` of job `number` (empty if unknown).
    fn names(&self, number: u64, stage: u32) -> (String, String) {
        match self.jobs.get(&number) {
            Some(job) => (
                job.id.clone(),
                job.spec
                    .stages
                    .get(stage as usize)
                    .map(|s| s.name.clone())
                    .unwrap_or_default(),
            ),
            None => (String::new(), String::new()),
        }
    }

    pub fn workers_view(&self) -> WorkersView {
        let mut workers: Vec<WorkerView> = self
            .workers
            .iter()
            .map(|(id, w)| WorkerView {
                id: id.clone(),
                address: w.address.clone(),
                http_address: w.http_address.clone(),
                device: w.device.clone(),
                slots: w.slots,
                tags: w.tags.clone(),
                assigned: w.running.len() as u32,
                pool_bytes: w.pool_bytes,
                pool_used_bytes: w.pool_used_bytes,
                partitions: w.partitions,
                seen_ms_ago: w.last_seen.elapsed().as_millis() as u64,
                gpu: w
                    .gpu
                    .as_ref()
                    .map(|info| GpuView::new(info, w.gpu_telemetry.as_ref())),
            })
            .collect();
        workers.sort_by(|a, b| a.id.cmp(&b.id));
        WorkersView {
            now_us: self.clock.now_us(),
            epoch_unix_ms: self.clock.epoch_unix_ms(),
            ready_tasks: self.ready.len(),
            workers,
        }
    }

    /// Unfinished jobs, and the most recent finished ones; newest first.
    pub fn jobs_view(&self) -> JobsView {
        let mut numbers: Vec<u64> = self.jobs.keys().copied().collect();
        numbers.sort_unstable_by(|a, b| b.cmp(a));
        let mut finished = 0;
        let mut jobs = Vec::new();
        for number in numbers {
            let job = &self.jobs[&number];
            if is_terminal(job.state) {
                finished += 1;
                if finished > FINISHED_JOBS_SHOWN {
                    continue;
                }
            }
            jobs.push(JobView {
                id: job.id.clone(),
                name: job.spec.name.clone(),
                tenant: job.tenant.clone(),
                priority: job.priority,
                state: state_name(job.state),
                error: job.error.clone(),
                waiting: job.waiting.clone(),
                submitted_us: job.submitted_us,
                finished_us: job.finished_us,
                stages: job
                    .stage_progress()
                    .into_iter()
                    .map(|s| StageView {
                        name: s.name,
                        total: s.total,
                        done: s.done,
                        running: s.running,
                    })
                    .collect(),
            });
        }
        JobsView {
            now_us: self.clock.now_us(),
            jobs,
        }
    }

    /// The cursor after the newest task execution.
    pub fn executions_end(&self) -> u64 {
        self.recent.executions.end()
    }

    /// The cursor after the newest transfer.
    pub fn transfers_end(&self) -> u64 {
        self.recent.transfers.end()
    }

    /// Task executions from sequence number `cursor` on (at most `limit`, capped at
    /// [`MAX_PAGE`]).
    pub fn executions_view(&self, cursor: u64, limit: usize) -> Page<ExecutionView> {
        let page = self.recent.executions.since(cursor, limit.min(MAX_PAGE));
        let items = page
            .items
            .into_iter()
            .map(|(seq, recent)| {
                let e = &recent.execution;
                let (job, stage) = self.names(recent.job, e.stage);
                ExecutionView {
                    seq,
                    job,
                    stage,
                    task: e.task,
                    attempt: e.attempt,
                    worker: self.worker_names.name(e.worker).to_string(),
                    start_us: e.start_us,
                    end_us: e.end_us,
                    ok: recent.error.is_none(),
                    error: recent.error.as_deref().map(str::to_string),
                    output_bytes: e.output_bytes,
                    output_rows: e.output_rows,
                    fetched_bytes: e.fetched_bytes,
                }
            })
            .collect();
        Page {
            now_us: self.clock.now_us(),
            next: page.next,
            missed: page.missed,
            items,
        }
    }

    /// Transfers between workers from sequence number `cursor` on (at most `limit`, capped at
    /// [`MAX_PAGE`]).
    pub fn transfers_view(&self, cursor: u64, limit: usize) -> Page<TransferView> {
        let page = self.recent.transfers.since(cursor, limit.min(MAX_PAGE));
        let items = page
            .items
            .into_iter()
            .map(|(seq, (number, t))| {
                let (job, stage) = self.names(*number, t.stage);
                TransferView {
                    seq,
                    job,
                    stage,
                    task: t.task,
                    from: self.worker_names.name(t.from).to_string(),
                    to: self.worker_names.name(t.to).to_string(),
                    bytes: t.bytes,
                    at_us: t.at_us,
                }
            })
            .collect();
        Page {
            now_us: self.clock.now_us(),
            next: page.next,
            missed: page.missed,
            items,
        }
    }

    /// The records of `tenant`'s job `job_id` for its report: times relative to its submission,
    /// workers by index in the answer. The job must keep a timeline ([`State::keep_timeline`]).
    pub fn job_timeline(&self, tenant: &str, job_id: &str) -> Result<JobTimeline, StateError> {
        let number = self.tenant_job(tenant, job_id)?;
        let job = &self.jobs[&number];
        let Some(records) = job.records.as_deref() else {
            return Err(StateError::NoTimeline(job_id.to_string()));
        };
        let now_us = self.clock.now_us();
        let start = job.submitted_us;
        let end = job.finished_us.unwrap_or(now_us);
        // Workers by their number in the records, and by index in the answer.
        let mut index: HashMap<u32, u32> = HashMap::new();
        let mut order: Vec<u32> = Vec::new();
        let mut local = |number: u32| -> u32 {
            *index.entry(number).or_insert_with(|| {
                order.push(number);
                order.len() as u32 - 1
            })
        };
        let mut errors = records.errors.iter().peekable();
        let tasks: Vec<TaskExecution> = records
            .executions
            .iter()
            .enumerate()
            .map(|(i, e)| TaskExecution {
                stage: e.stage,
                task: e.task,
                attempt: e.attempt,
                worker: local(e.worker),
                start_us: e.start_us.saturating_sub(start),
                end_us: e.end_us.saturating_sub(start),
                error: errors
                    .next_if(|(at, _)| *at == i)
                    .map(|(_, error)| error.to_string())
                    .unwrap_or_default(),
                output_bytes: e.output_bytes,
                output_rows: e.output_rows,
                fetched_bytes: e.fetched_bytes,
            })
            .collect();
        let transfers: Vec<TransferRecord> = records
            .transfers
            .iter()
            .map(|t| TransferRecord {
                stage: t.stage,
                task: t.task,
                from_worker: local(t.from),
                to_worker: local(t.to),
                bytes: t.bytes,
                at_us: t.at_us.saturating_sub(start),
            })
            .collect();
        let mut workers = Vec::with_capacity(order.len());
        let mut memory = Vec::new();
        for (i, &number) in order.iter().enumerate() {
            let name = self.worker_names.name(number);
            let attached = self.workers.get(name);
            workers.push(TimelineWorker {
                worker_id: name.to_string(),
                device: attached.map(|w| w.device.clone()).unwrap_or_default(),
                pool_bytes: attached.map_or(0, |w| w.pool_bytes),
                slots: attached.map_or(0, |w| w.slots),
            });
            if let Some(worker) = attached {
                memory.extend(
                    worker
                        .memory
                        .between(start, end)
                        .map(|(at, used)| MemorySample {
                            worker: i as u32,
                            at_us: at - start,
                            used_bytes: used,
                        }),
                );
            }
        }
        Ok(JobTimeline {
            job_id: job.id.clone(),
            name: job.spec.name.clone(),
            state: job.state as i32,
            error: job.error.clone(),
            submitted_unix_ms: self.clock.epoch_unix_ms() + start / 1000,
            duration_us: end.saturating_sub(start),
            stages: job.stage_progress(),
            workers,
            tasks,
            transfers,
            memory,
            dropped_tasks: records.dropped_executions,
            dropped_transfers: records.dropped_transfers,
        })
    }
}

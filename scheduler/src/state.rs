//! The scheduler's state machine: workers, jobs, the state of every task, and the decisions
//! (which task runs where, what to retry, what a lost worker costs).
//!
//! It is synchronous and does no I/O: every event returns the messages to send, so the gRPC layer
//! stays thin and the logic is tested directly.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

use crate::metrics::SchedulerMetrics;
use crate::timeline::{
    Clock, Execution, JobRecords, MemoryHistory, RETAINED_JOB_TIMELINES, Recent, RecentExecution,
    Transfer, WorkerNames, short_error,
};
use wrk_proto::scheduler_message::Kind as ToWorker;
use wrk_proto::stage_input::Pattern;
use wrk_proto::{
    AssignTask, CancelTask, ClusterStatus, JobProgress, JobResult, JobSpec, JobState, JobSummary,
    OutputMeta, PartitionKey, PartitionLocation, ReleaseJob, ReleaseTasks, ScalingAdvice,
    SchedulerMessage, StageProgress, TaskDone, TaskFailed, TaskId, TaskInput, TaskReports,
    WorkerStatus, task_input,
};

use crate::tags::{self, TagError};
use crate::tenants::TenantPolicy;

mod assignments;
mod datasets;
mod locality;
mod moves;
mod queue;
mod requirements;
mod retire;
mod shuffle;
mod steal;
mod views;

use assignments::Assignments;
pub use datasets::Read;
use locality::{DurationHistory, Locality, TransferRate};
use queue::ReadyQueue;

pub use views::{
    ExecutionView, JobView, JobsView, Page, StageView, TransferView, WorkerView, WorkersView,
    state_name,
};

/// Where a worker's control messages go.
pub type WorkerOutbox = mpsc::UnboundedSender<Result<SchedulerMessage, tonic::Status>>;

/// The reason given when a worker closes its channel itself.
pub const WORKER_LEFT: &str = "it closed its channel";

/// Tasks a worker may hold queued per slot beyond those it runs, so that a slot that frees up
/// starts its next task at once instead of waiting a round trip to the scheduler.
pub const QUEUED_PER_SLOT: u32 = 1;

/// Tasks queued per slot on a worker whose recent tasks were short ([`SHORT_TASK_SECONDS`]):
/// a slot then finishes several tasks in a round trip, and waiting behind three of them costs
/// a queued task little. Idle workers still steal what is queued.
pub const QUEUED_PER_SLOT_SHORT: u32 = 3;

/// Tasks queued per slot on a worker whose recent tasks were very short
/// ([`VERY_SHORT_TASK_SECONDS`]): at most a few milliseconds of work wait per slot, and a slot
/// rarely runs dry (and sleeps, to be woken by the next assignment) while its reports and the
/// next assignments cross. With three, no-op tasks left a slot idle every fourth task.
pub const QUEUED_PER_SLOT_VERY_SHORT: u32 = 8;

/// A worker's recent tasks are short when their moving average is below this...
const SHORT_TASK_SECONDS: f64 = 0.005;
/// ...and very short below this.
const VERY_SHORT_TASK_SECONDS: f64 = 0.0005;

/// The weight of the latest task in a worker's moving average of task durations: one long
/// task makes the average long at once, about thirty short ones make it short again.
const TASK_SECONDS_WEIGHT: f64 = 0.1;

/// A task running on this many workers that died fails its job as poisoned.
pub const POISON_AFTER_LOST_WORKERS: u32 = 3;

/// Task duration assumed for a stage before any of its tasks finished (as Dask's `adapt` does).
const DEFAULT_TASK_SECONDS: f64 = 0.5;

/// Attempts of a task that failed with a retriable error before the job fails.
pub const MAX_ATTEMPTS: u32 = 4;

/// Ready tasks one dispatch sets aside because the workers they must run on (their reducer
/// partition's, or those with their stage's tags) are busy, before it stops looking further
/// down the queue: bounds the work of one event when many such tasks queue up.
const MAX_SET_ASIDE: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    #[error("a worker with id `{0}` is already registered")]
    DuplicateWorker(String),
    #[error("no job `{0}`")]
    UnknownJob(String),
    #[error("no module with hash {0}")]
    UnknownModule(String),
    #[error("worker `{worker}` offers an invalid tag: {source}")]
    InvalidTag { worker: String, source: TagError },
    #[error(
        "job `{0}` keeps no timeline: it was submitted without asking for one (wrk submit --report), or it was released, or too many jobs finished since"
    )]
    NoTimeline(String),
    #[error("no dataset `{0}`")]
    UnknownDataset(String),
    #[error("a dataset named `{0}` already exists: release it first (wrk release-dataset {0})")]
    DatasetExists(String),
    #[error("dataset `{name}` cannot be read: {reason}")]
    DatasetUnavailable { name: String, reason: String },
    #[error("no worker `{0}`")]
    UnknownWorker(String),
    #[error("worker `{0}` cannot be retired: no other worker would take its data and tasks")]
    NoOtherWorker(String),
}

/// A task, by position in its job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct TaskRef {
    job: u64,
    stage: u32,
    index: u32,
}

#[derive(Debug, Clone, PartialEq)]
enum TaskStatus {
    /// Waiting for this many input tasks to finish.
    Waiting(u32),
    Ready,
    Running {
        worker: String,
    },
    Done {
        worker: String,
        outputs: Vec<OutputMeta>,
    },
}

#[derive(Debug, Clone)]
struct TaskEntry {
    status: TaskStatus,
    /// Attempts started so far.
    attempts: u32,
    /// Workers that died while running this task.
    workers_lost: u32,
    /// A finished task whose outputs were dropped because nothing needed them any more.
    outputs_released: bool,
    /// Attempts given back unstarted by a busy worker for an idle one (work stealing), which
    /// do not count as tries.
    stolen: u32,
}

struct Job {
    id: String,
    /// The tenant that submitted the job; only it may see or touch it.
    tenant: String,
    spec: JobSpec,
    tasks: Vec<Vec<TaskEntry>>,
    /// For each stage, the stages consuming it and how.
    consumers: Vec<Vec<(u32, Pattern)>>,
    state: JobState,
    error: String,
    progress: watch::Sender<JobProgress>,
    /// Per stage: tasks done and running, kept with every status change (never recounted).
    done: Vec<u32>,
    running: Vec<u32>,
    /// Tasks of the job not done.
    remaining: usize,
    /// Per stage: total seconds and count of finished tasks, to estimate the backlog.
    durations: Vec<(f64, u32)>,
    /// Per stage: its series of the task duration histogram and of the succeeded tasks'
    /// counter, resolved once (not at every task).
    stage_metrics: Vec<(prometheus::Histogram, prometheus::IntCounter)>,
    /// The client fetched the results (or there are none to fetch): workers dropped the job's
    /// data and the scheduler its tasks.
    released: bool,
    /// Its task executions and transfers, for its report, when its client asked for them
    /// ([`State::keep_timeline`]); kept until the client releases it (or until more recent jobs
    /// push them out, [`RETAINED_JOB_TIMELINES`]).
    records: Option<Box<JobRecords>>,
    /// When it was submitted and ended, on the scheduler's [`Clock`].
    submitted_us: u64,
    finished_us: Option<u64>,
    /// Where each reducer stage's partitions are received, and what mappers owe.
    shuffles: Vec<shuffle::Placement>,
    /// Its tenant's number in the ready queue, and its priority among the tenant's jobs.
    queue_tenant: usize,
    priority: i32,
    /// Tasks running (or queued on workers), and bytes of finished outputs not released,
    /// kept with every status change; and their values as last added to the tenant's use.
    running_total: u32,
    held: u64,
    accounted: (u32, u64),
    /// Why ready tasks are held back other than by busy workers (see `JobProgress.waiting`).
    waiting: String,
}

fn output_bytes(outputs: &[OutputMeta]) -> u64 {
    outputs.iter().map(|o| o.bytes).sum()
}

struct Worker {
    /// The worker's number in the records of the tasks it ran.
    number: u32,
    address: String,
    http_address: String,
    slots: u32,
    /// Tasks assigned to the worker (running, or queued there), with the bytes each is
    /// expected to hold in the worker's pool and the order they were assigned in (the worker
    /// starts them in that order).
    running: HashMap<(u64, u32, u32), (u64, u64)>,
    /// Whether the worker is in the scheduler's idle queue, its open queue (a free slot to
    /// run in, not only to queue in) and its overloaded queue (tasks queued, stealable).
    idle_queued: bool,
    open_queued: bool,
    overload_queued: bool,
    /// Its tags, the automatic ones included, sorted.
    tags: Vec<String>,
    /// Tasks queued here that the scheduler asked back to give to an idle worker (the thief),
    /// and how many such tasks are on their way to this worker as a thief.
    retracting: HashMap<(u64, u32, u32), String>,
    expecting: u32,
    /// The latest assignment (by order) the worker said it had started when asked back: it
    /// and every earlier one are not worth asking for.
    started_through: u64,
    outbox: WorkerOutbox,
    last_seen: Instant,
    /// Where it receives shuffle pieces over TCP, and its UCX address (empty without UCX).
    shuffle_address: String,
    ucx_address: Vec<u8>,
    device: String,
    /// A GPU worker's device, as it registered, and its latest telemetry.
    gpu: Option<wrk_proto::GpuInfo>,
    gpu_telemetry: Option<wrk_proto::GpuTelemetry>,
    pool_bytes: u64,
    pool_used_bytes: u64,
    partitions: u64,
    /// Being retired: it gets no new task ([`State::retire_worker`]).
    retiring: bool,
    /// The moving average of its tasks' durations, once one finished ([`Worker::capacity`]).
    task_seconds: Option<f64>,
    /// The pool figures of the latest heartbeat.
    beat: wrk_proto::Heartbeat,
    memory: MemoryHistory,
}

impl Worker {
    /// Tasks the worker may hold at once, running or queued: deeper queues while its tasks
    /// are short.
    fn capacity(&self) -> u32 {
        let queued = match self.task_seconds {
            Some(seconds) if seconds < VERY_SHORT_TASK_SECONDS => QUEUED_PER_SLOT_VERY_SHORT,
            Some(seconds) if seconds < SHORT_TASK_SECONDS => QUEUED_PER_SLOT_SHORT,
            _ => QUEUED_PER_SLOT,
        };
        self.slots * (1 + queued)
    }

    /// Counts a task that ran here for `duration_us` in its moving average.
    fn observe_task(&mut self, duration_us: u64) {
        let seconds = duration_us as f64 / 1e6;
        self.task_seconds = Some(match self.task_seconds {
            Some(mean) => mean + (seconds - mean) * TASK_SECONDS_WEIGHT,
            None => seconds,
        });
    }

    fn free(&self) -> u32 {
        if self.retiring {
            return 0;
        }
        self.capacity().saturating_sub(self.running.len() as u32)
    }

    /// Pool bytes the tasks assigned here are expected to hold.
    fn committed(&self) -> u64 {
        self.running.values().map(|(bytes, _)| bytes).sum()
    }

    /// Whether a slot is free to run a task now (not only to queue one).
    fn has_open_slot(&self) -> bool {
        !self.retiring && (self.running.len() as u32) < self.slots
    }

    /// Whether the worker has every tag in `requires` (sorted or not).
    fn has_tags(&self, requires: &[String]) -> bool {
        requires
            .iter()
            .all(|tag| self.tags.binary_search(tag).is_ok())
    }

    /// Tasks assigned beyond its slots, not being asked back: queued, and stealable.
    fn stealable(&self) -> usize {
        self.running
            .len()
            .saturating_sub(self.slots as usize + self.retracting.len())
    }

    /// Whether a task expected to hold `bytes` fits beside the tasks assigned here (a worker
    /// that reported no pool size takes anything). Stored partitions do not count: the worker
    /// spills them to make room.
    fn fits(&self, bytes: u64) -> bool {
        self.pool_bytes == 0 || self.committed() + bytes <= self.pool_bytes
    }

    /// Whether a task expected to hold `bytes` fits in this worker's pool at all.
    fn could_ever_fit(&self, bytes: u64) -> bool {
        self.pool_bytes == 0 || bytes <= self.pool_bytes
    }

    /// Pool bytes neither in use (as last reported) nor promised to assigned tasks.
    fn free_pool(&self) -> u64 {
        self.pool_bytes
            .saturating_sub(self.pool_used_bytes.max(self.committed()))
    }
}

#[derive(Debug, Clone)]
pub struct StoredModule {
    pub name: String,
    pub wasm: Vec<u8>,
}

/// All the scheduler knows.
#[derive(Default)]
pub struct State {
    workers: HashMap<String, Worker>,
    /// Mean task durations per module and stage name across jobs, for placement.
    durations: DurationHistory,
    /// The rate partitions move between workers at, for placement.
    transfer_rate: TransferRate,
    jobs: HashMap<u64, Job>,
    job_ids: HashMap<String, u64>,
    modules: HashMap<String, StoredModule>,
    ready: ReadyQueue,
    /// Workers that may have room for a task, in round-robin order (entries are checked when
    /// taken, so a full or departed worker may linger until then).
    idle: VecDeque<String>,
    /// Workers that may have a slot free to run a task at once, likewise.
    open: VecDeque<String>,
    /// Workers that may hold queued tasks another worker could steal, likewise.
    overloaded: VecDeque<String>,
    /// Numbers assignments in order, per worker the order it starts them in.
    assignments: u64,
    /// Whether some connected worker has every tag of a requirement, cached until workers
    /// come or go.
    satisfiable: HashMap<Vec<String>, bool>,
    /// Ready tasks whose stage requires tags no connected worker has, by requirement.
    parked: HashMap<Vec<String>, Vec<TaskRef>>,
    next_job: u64,
    metrics: SchedulerMetrics,
    /// Signs partition locations when the cluster has a worker token.
    ticket_secret: Option<Vec<u8>>,
    clock: Clock,
    /// Every worker that ever registered, numbered for the records.
    worker_names: WorkerNames,
    /// The assignments of the dispatch under way, kept between dispatches (empty) so that
    /// each does not allocate them again.
    assigned: Assignments,
    /// Recent task executions and transfers, for the dashboard.
    recent: Recent,
    /// Finished jobs still holding their records, oldest first.
    retained: VecDeque<u64>,
    /// Persisted datasets and the stages reading them.
    datasets: datasets::Datasets,
    /// Partitions being copied from one worker to another (rebalancing, retiring).
    moves: moves::Moves,
}

/// The pool bytes a task is expected to hold: its Parquet partition's size estimate and the
/// sizes of its input partitions.
fn expected_bytes(job: &Job, task: TaskRef) -> u64 {
    let stage = &job.spec.stages[task.stage as usize];
    let parquet = stage
        .partitions
        .get(task.index as usize)
        .map(|p| p.estimated_bytes)
        .unwrap_or(0);
    let inputs: u64 = job
        .inputs_of(task.stage, task.index)
        .into_iter()
        .filter_map(|(s, i)| match &job.tasks[s as usize][i as usize].status {
            TaskStatus::Done { outputs, .. } => Some(output_bytes(outputs)),
            _ => None,
        })
        .sum();
    parquet + inputs
}

fn is_terminal(state: JobState) -> bool {
    matches!(
        state,
        JobState::Succeeded | JobState::Failed | JobState::Cancelled
    )
}

impl Job {
    /// Every task of the job with its stage and index.
    fn indexed_tasks(&self) -> impl Iterator<Item = (u32, u32, &TaskEntry)> {
        self.tasks.iter().enumerate().flat_map(|(s, tasks)| {
            tasks
                .iter()
                .enumerate()
                .map(move |(i, t)| (s as u32, i as u32, t))
        })
    }

    fn stage_progress(&self) -> Vec<StageProgress> {
        self.spec
            .stages
            .iter()
            .enumerate()
            .map(|(s, stage)| StageProgress {
                name: stage.name.clone(),
                total: stage.num_tasks,
                done: self.done[s],
                running: self.running[s],
            })
            .collect()
    }

    /// Changes a task's status, keeping the done/running counters and held bytes true.
    fn set_status(&mut self, stage: u32, index: u32, status: TaskStatus) {
        let (s, i) = (stage as usize, index as usize);
        let entry = &self.tasks[s][i];
        match &entry.status {
            TaskStatus::Done { outputs, .. } => {
                self.done[s] -= 1;
                self.remaining += 1;
                if !entry.outputs_released {
                    self.held -= output_bytes(outputs);
                }
            }
            TaskStatus::Running { .. } => {
                self.running[s] -= 1;
                self.running_total -= 1;
            }
            _ => {}
        }
        match &status {
            TaskStatus::Done { outputs, .. } => {
                self.done[s] += 1;
                self.remaining -= 1;
                self.held += output_bytes(outputs);
            }
            TaskStatus::Running { .. } => {
                self.running[s] += 1;
                self.running_total += 1;
            }
            _ => {}
        }
        self.tasks[s][i].status = status;
    }

    /// Whether the tasks of `stage` read earlier stages' outputs (or shuffle pieces).
    fn reads_outputs(&self, stage: u32) -> bool {
        !self.spec.stages[stage as usize].inputs.is_empty()
    }

    fn publish(&self) {
        let progress = JobProgress {
            job_id: self.id.clone(),
            state: self.state as i32,
            stages: self.stage_progress(),
            error: self.error.clone(),
            waiting: self.waiting.clone(),
        };
        self.progress.send_replace(progress);
    }

    /// The tasks whose outputs task `(stage, index)` reads, in input order (shuffle inputs
    /// are not outputs: their pieces wait on the reducer's worker).
    fn inputs_of(&self, stage: u32, index: u32) -> Vec<(u32, u32)> {
        let mut inputs = Vec::new();
        for input in &self.spec.stages[stage as usize].inputs {
            match input.pattern() {
                Pattern::OneToOne => inputs.push((input.stage, index)),
                Pattern::All | Pattern::Broadcast => {
                    let count = self.spec.stages[input.stage as usize].num_tasks;
                    inputs.extend((0..count).map(|i| (input.stage, i)));
                }
                Pattern::Shuffle => {}
            }
        }
        inputs
    }

    fn is_done(&self, stage: u32, index: u32) -> bool {
        matches!(
            self.tasks[stage as usize][index as usize].status,
            TaskStatus::Done { .. }
        )
    }

    /// Whether a finished task's outputs are still needed: they are a final result, or an
    /// unfinished task reads them.
    fn is_needed(&self, stage: u32, index: u32) -> bool {
        let consumers = &self.consumers[stage as usize];
        consumers.is_empty()
            || consumers.iter().any(|&(consumer, pattern)| match pattern {
                Pattern::OneToOne => !self.is_done(consumer, index),
                Pattern::All | Pattern::Broadcast => {
                    self.done[consumer as usize] < self.spec.stages[consumer as usize].num_tasks
                }
                Pattern::Shuffle => false,
            })
    }

    /// Outputs that task `(stage, index)` finishing made unneeded, by the worker holding them;
    /// they are marked released.
    fn release_unneeded_inputs(
        &mut self,
        stage: u32,
        index: u32,
    ) -> HashMap<String, Vec<(u32, u32)>> {
        let mut candidates = Vec::new();
        for input in &self.spec.stages[stage as usize].inputs {
            match input.pattern() {
                Pattern::OneToOne => candidates.push((input.stage, index)),
                // Only the consumer stage's last task frees everything it gathered.
                Pattern::All | Pattern::Broadcast
                    if self.done[stage as usize] == self.spec.stages[stage as usize].num_tasks =>
                {
                    let count = self.spec.stages[input.stage as usize].num_tasks;
                    candidates.extend((0..count).map(|i| (input.stage, i)));
                }
                Pattern::All | Pattern::Broadcast | Pattern::Shuffle => {}
            }
        }
        let mut by_worker: HashMap<String, Vec<(u32, u32)>> = HashMap::new();
        for (s, i) in candidates {
            if self.is_needed(s, i) {
                continue;
            }
            let entry = &mut self.tasks[s as usize][i as usize];
            if let TaskStatus::Done { worker, outputs } = &entry.status
                && !entry.outputs_released
            {
                entry.outputs_released = true;
                self.held -= output_bytes(outputs);
                by_worker.entry(worker.clone()).or_default().push((s, i));
            }
        }
        by_worker
    }

    /// Sets to run again the finished tasks whose outputs are lost (released, or on a worker
    /// that is gone) while an unfinished task needs them, and resends lost shuffle pieces;
    /// recomputing one can make the lost inputs it reads needed again, so it repeats until
    /// nothing changes. Returns how many tasks and partitions it set to run again.
    fn recover(&mut self, workers: &HashMap<String, Worker>, offset: usize) -> usize {
        let mut recompute = 0;
        loop {
            let moved = self.repair_shuffles(workers, offset);
            recompute += moved;
            let lost_and_needed: Vec<(u32, u32)> = self
                .indexed_tasks()
                .filter(|(s, i, t)| {
                    matches!(&t.status, TaskStatus::Done { worker, .. }
                        if t.outputs_released || !workers.contains_key(worker))
                        && self.is_needed(*s, *i)
                })
                .map(|(s, i, _)| (s, i))
                .collect();
            if lost_and_needed.is_empty() && moved == 0 {
                return recompute;
            }
            for (s, i) in lost_and_needed {
                self.set_status(s, i, TaskStatus::Ready);
                self.tasks[s as usize][i as usize].outputs_released = false;
                recompute += 1;
            }
        }
    }

    /// Final stages: those no other stage consumes.
    fn final_stages(&self) -> Vec<u32> {
        (0..self.spec.stages.len() as u32)
            .filter(|&s| self.consumers[s as usize].is_empty())
            .collect()
    }

    /// [`Job::recount`], as the scheduler's queue entries of job `number`.
    fn recount_ready(&mut self, number: u64) -> Vec<TaskRef> {
        self.recount()
            .into_iter()
            .map(|(stage, index)| TaskRef {
                job: number,
                stage,
                index,
            })
            .collect()
    }

    /// Sets every task that is neither running nor done to waiting or ready from its inputs'
    /// state, returning the ready ones.
    fn recount(&mut self) -> Vec<(u32, u32)> {
        let mut ready = Vec::new();
        for stage in 0..self.tasks.len() as u32 {
            for index in 0..self.tasks[stage as usize].len() as u32 {
                let status = &self.tasks[stage as usize][index as usize].status;
                if matches!(status, TaskStatus::Running { .. } | TaskStatus::Done { .. }) {
                    continue;
                }
                let missing = self
                    .inputs_of(stage, index)
                    .into_iter()
                    .filter(|&(s, i)| !self.is_done(s, i))
                    .count() as u32
                    + u32::from(!self.shuffle_inputs_ready(stage));
                let entry = &mut self.tasks[stage as usize][index as usize];
                if missing == 0 {
                    entry.status = TaskStatus::Ready;
                    ready.push((stage, index));
                } else {
                    entry.status = TaskStatus::Waiting(missing);
                }
            }
        }
        ready
    }
}

/// A task attempt that ended, as the records name it.
struct Attempt<'a> {
    task: TaskRef,
    attempt: u32,
    /// The worker's number in the records, and its id.
    worker: u32,
    worker_id: &'a str,
    start_us: u64,
    end_us: u64,
}

/// The partitions `attempt`'s task read from workers other than its own, summed by worker.
fn remote_transfers(
    job: &Job,
    attempt: &Attempt<'_>,
    workers: &HashMap<String, Worker>,
    names: &WorkerNames,
) -> Vec<Transfer> {
    let TaskRef { stage, index, .. } = attempt.task;
    let inputs = &job.spec.stages[stage as usize].inputs;
    if inputs.is_empty() {
        return Vec::new();
    }
    // A task reads from few workers, or (gathering a whole stage) from many: index only then.
    let count: usize = inputs
        .iter()
        .map(|i| match i.pattern() {
            Pattern::OneToOne => 1,
            Pattern::All | Pattern::Broadcast => {
                job.spec.stages[i.stage as usize].num_tasks as usize
            }
            Pattern::Shuffle => 0,
        })
        .sum();
    let many = count > 8;
    let mut positions: HashMap<&str, usize> = HashMap::new();
    let mut sources: Vec<(&str, u64)> = Vec::new();
    let mut visit = |s: u32, i: u32| {
        let TaskStatus::Done {
            worker: from,
            outputs,
        } = &job.tasks[s as usize][i as usize].status
        else {
            return;
        };
        if from == attempt.worker_id {
            return;
        }
        let bytes: u64 = outputs.iter().map(|o| o.bytes).sum();
        let found = if many {
            positions.get(from.as_str()).copied()
        } else {
            sources.iter().position(|(w, _)| *w == from)
        };
        match found {
            Some(p) => sources[p].1 += bytes,
            None => {
                if many {
                    positions.insert(from, sources.len());
                }
                sources.push((from, bytes));
            }
        }
    };
    for input in inputs {
        match input.pattern() {
            Pattern::OneToOne => visit(input.stage, index),
            Pattern::All | Pattern::Broadcast => {
                for i in 0..job.spec.stages[input.stage as usize].num_tasks {
                    visit(input.stage, i);
                }
            }
            Pattern::Shuffle => {}
        }
    }
    sources
        .into_iter()
        .map(|(from, bytes)| Transfer {
            stage,
            task: index,
            // Every worker was numbered when it registered.
            from: workers
                .get(from)
                .map(|w| w.number)
                .or_else(|| names.number(from))
                .unwrap_or(u32::MAX),
            to: attempt.worker,
            bytes,
            at_us: attempt.start_us,
        })
        .collect()
}

/// Records an attempt (its outputs when it succeeded, its error when not) and the transfers
/// it read its inputs by, for the dashboard and, when the job keeps them, its report.
fn record(
    recent: &mut Recent,
    job: &mut Job,
    attempt: &Attempt<'_>,
    outputs: &[OutputMeta],
    transfers: &[Transfer],
    error: Option<&str>,
) {
    let execution = Execution {
        stage: attempt.task.stage,
        task: attempt.task.index,
        attempt: attempt.attempt,
        worker: attempt.worker,
        start_us: attempt.start_us,
        end_us: attempt.end_us,
        output_bytes: outputs.iter().map(|o| o.bytes).sum(),
        output_rows: outputs.iter().map(|o| o.rows).sum(),
        fetched_bytes: transfers.iter().map(|t| t.bytes).sum(),
    };
    for &transfer in transfers {
        recent.transfers.push((attempt.task.job, transfer));
    }
    recent.executions.push(RecentExecution {
        job: attempt.task.job,
        execution,
        error: error.map(short_error),
    });
    if let Some(records) = job.records.as_mut() {
        for &transfer in transfers {
            records.push_transfer(transfer);
        }
        records.push_execution(execution, error);
    }
}

/// Messages to send after a state change.
pub type Outgoing = Vec<(WorkerOutbox, SchedulerMessage)>;

/// Room on a worker: a slot free to run a task at once, or a place in its queue.
#[derive(Debug, Clone, Copy)]
enum Slot {
    Run,
    Queue,
}

fn message(kind: ToWorker) -> SchedulerMessage {
    SchedulerMessage { kind: Some(kind) }
}

/// Adds what changed in a job's running tasks and held bytes to its tenant's use.
fn sync_usage(ready: &mut ReadyQueue, job: &mut Job) {
    let now = (job.running_total, job.held);
    if now != job.accounted {
        ready.account(job.queue_tenant, job.accounted, now);
        job.accounted = now;
    }
}

impl State {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn module(&self, hash: &str) -> Result<StoredModule, StateError> {
        self.modules
            .get(hash)
            .cloned()
            .ok_or_else(|| StateError::UnknownModule(hash.to_string()))
    }

    pub fn known_modules(&self) -> HashSet<String> {
        self.modules.keys().cloned().collect()
    }

    pub fn register_worker(
        &mut self,
        register: &wrk_proto::Register,
        outbox: WorkerOutbox,
    ) -> Result<(), StateError> {
        if self.workers.contains_key(&register.worker_id) {
            return Err(StateError::DuplicateWorker(register.worker_id.clone()));
        }
        let mut worker_tags = register.tags.clone();
        for tag in &worker_tags {
            tags::check(tag).map_err(|source| StateError::InvalidTag {
                worker: register.worker_id.clone(),
                source,
            })?;
        }
        worker_tags.extend(tags::automatic(register.gpu.as_ref()));
        worker_tags.sort();
        worker_tags.dedup();
        let number = self.worker_names.intern(&register.worker_id);
        self.workers.insert(
            register.worker_id.clone(),
            Worker {
                number,
                address: register.data_address.clone(),
                http_address: register.http_address.clone(),
                slots: register.slots.max(1),
                running: HashMap::new(),
                idle_queued: false,
                open_queued: false,
                overload_queued: false,
                tags: worker_tags,
                retracting: HashMap::new(),
                expecting: 0,
                started_through: 0,
                outbox,
                last_seen: Instant::now(),
                shuffle_address: register.shuffle_address.clone(),
                ucx_address: register.ucx_address.clone(),
                device: register.device.clone(),
                gpu: register.gpu.clone(),
                gpu_telemetry: None,
                pool_bytes: register.pool_bytes,
                pool_used_bytes: 0,
                partitions: 0,
                retiring: false,
                task_seconds: None,
                beat: wrk_proto::Heartbeat::default(),
                memory: MemoryHistory::default(),
            },
        );
        self.satisfiable.clear();
        self.unpark(&register.worker_id);
        self.requeue_if_free(&register.worker_id);
        Ok(())
    }

    /// Applies a tenant's weight and quotas (from the tenants file).
    pub fn set_tenant_policy(&mut self, tenant: &str, policy: TenantPolicy) {
        self.ready.set_policy(tenant, policy);
    }

    pub fn heartbeat(&mut self, worker_id: &str, beat: &wrk_proto::Heartbeat) {
        let now_us = self.clock.now_us();
        let workers = self.workers.len();
        if let Some(worker) = self.workers.get_mut(worker_id) {
            worker.last_seen = Instant::now();
            worker.pool_used_bytes = beat.pool_used_bytes;
            worker.partitions = beat.partitions;
            if beat.pool_bytes > 0 {
                worker.pool_bytes = beat.pool_bytes;
            }
            worker.beat = *beat;
            if beat.gpu.is_some() {
                worker.gpu_telemetry = beat.gpu;
            }
            worker.memory.sample(now_us, beat.pool_used_bytes);
            if let Some(rate) = beat.transfer_bytes_per_second {
                self.transfer_rate.observe(rate, workers);
            }
            self.metrics
                .transfer_bytes_per_second
                .set(self.transfer_rate.bytes_per_second() as i64);
        }
    }

    /// Workers silent for longer than `timeout`.
    pub fn silent_workers(&self, timeout: Duration) -> Vec<String> {
        self.workers
            .iter()
            .filter(|(_, w)| w.last_seen.elapsed() > timeout)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Accepts a validated job at priority 0; returns its id and a receiver of its progress.
    pub fn submit(
        &mut self,
        tenant: &str,
        spec: JobSpec,
    ) -> (String, watch::Receiver<JobProgress>) {
        self.submit_at(tenant, spec, 0)
    }

    /// Accepts a validated job whose ready tasks go before those of `tenant`'s jobs of lower
    /// `priority`; returns its id and a receiver of its progress.
    pub fn submit_at(
        &mut self,
        tenant: &str,
        mut spec: JobSpec,
        priority: i32,
    ) -> (String, watch::Receiver<JobProgress>) {
        for module in std::mem::take(&mut spec.modules) {
            self.modules.entry(module.hash).or_insert(StoredModule {
                name: module.name,
                wasm: module.wasm,
            });
        }
        self.next_job += 1;
        self.metrics.jobs_submitted.inc();
        let number = self.next_job;
        let id = format!("job-{number:06}");
        let mut consumers = vec![Vec::new(); spec.stages.len()];
        for (s, stage) in spec.stages.iter().enumerate() {
            for input in &stage.inputs {
                consumers[input.stage as usize].push((s as u32, input.pattern()));
            }
        }
        let tasks = spec
            .stages
            .iter()
            .map(|stage| {
                vec![
                    TaskEntry {
                        status: TaskStatus::Waiting(0),
                        attempts: 0,
                        workers_lost: 0,
                        outputs_released: false,
                        stolen: 0,
                    };
                    stage.num_tasks as usize
                ]
            })
            .collect();
        let (progress, receiver) = watch::channel(JobProgress::default());
        let stages = spec.stages.len();
        let stage_metrics = spec
            .stages
            .iter()
            .map(|stage| {
                (
                    self.metrics.task_duration.with_label_values(&[&stage.name]),
                    self.metrics
                        .tasks_finished
                        .with_label_values(&[stage.name.as_str(), "succeeded"]),
                )
            })
            .collect();
        let remaining = spec.stages.iter().map(|s| s.num_tasks as usize).sum();
        let mut job = Job {
            id: id.clone(),
            tenant: tenant.to_string(),
            spec,
            tasks,
            consumers,
            state: JobState::Pending,
            error: String::new(),
            progress,
            done: vec![0; stages],
            running: vec![0; stages],
            remaining,
            durations: vec![(0.0, 0); stages],
            stage_metrics,
            released: false,
            records: None,
            submitted_us: self.clock.now_us(),
            finished_us: None,
            shuffles: Vec::new(),
            queue_tenant: self.ready.tenant(tenant),
            priority,
            running_total: 0,
            held: 0,
            accounted: (0, 0),
            waiting: String::new(),
        };
        job.shuffles = shuffle::placements(&job.spec);
        let ready = job.recount_ready(number);
        self.ready.extend(&job, ready);
        job.publish();
        self.jobs.insert(number, job);
        self.job_ids.insert(id.clone(), number);
        (id, receiver)
    }

    fn job_number(&self, job_id: &str) -> Result<u64, StateError> {
        self.job_ids
            .get(job_id)
            .copied()
            .ok_or_else(|| StateError::UnknownJob(job_id.to_string()))
    }

    /// The job `job_id` of `tenant`. Another tenant's job is reported as unknown, so ids reveal
    /// nothing across tenants.
    fn tenant_job(&self, tenant: &str, job_id: &str) -> Result<u64, StateError> {
        let number = self.job_number(job_id)?;
        if self.jobs.get(&number).is_some_and(|j| j.tenant == tenant) {
            Ok(number)
        } else {
            Err(StateError::UnknownJob(job_id.to_string()))
        }
    }

    pub fn watch(
        &self,
        tenant: &str,
        job_id: &str,
    ) -> Result<watch::Receiver<JobProgress>, StateError> {
        let number = self.tenant_job(tenant, job_id)?;
        Ok(self.jobs[&number].progress.subscribe())
    }

    /// Assigns ready tasks to workers with room, in the ready queue's order (tenants' weighted
    /// shares, then priorities, then FIFO: see `state/queue.rs`), and only where the task's
    /// expected working set fits beside the tasks already there and the worker has every tag
    /// its stage requires. Where, in order of preference:
    ///
    /// 1. the worker holding most of the task's input bytes, if a slot is free there to run it;
    /// 2. any worker with a slot free to run it (round robin): an idle worker beats queueing
    ///    behind a busy one, as Dask's queueing and Ray's spillback do;
    /// 3. the worker holding most input bytes, in its queue (one task per slot);
    /// 4. any worker with room in its queue.
    ///
    /// A task that fits no pool at all goes to the worker with the most free pool (its spilling
    /// copes); one that would fit once running work ends waits for it, and so do the tasks
    /// behind it (no starving a big task with small ones). A task whose stage requires tags no
    /// connected worker has is parked until one registers; one whose tagged or pinned workers
    /// are busy is set aside for the tasks behind it. Then idle slots steal queued tasks
    /// (`state/steal.rs`).
    pub fn dispatch(&mut self) -> Outgoing {
        let mut out = Vec::new();
        let mut assigned = std::mem::take(&mut self.assigned);
        // Tasks whose workers are busy wait for them, behind the tasks that can run now.
        let mut set_aside = Vec::new();
        // Of those, how many wait for each worker because their inputs are there.
        let mut waiting: HashMap<String, usize> = HashMap::new();
        while set_aside.len() < MAX_SET_ASIDE && self.has_free_worker() {
            let Some(queued) = self.ready.pop() else {
                break;
            };
            let task = queued.task;
            match self.dataset_gate(task) {
                datasets::Gate::Open => {}
                datasets::Gate::Wait => continue,
                datasets::Gate::Closed(reason) => {
                    assigned.flush_into(&mut out);
                    out.extend(self.finish_job(task.job, JobState::Failed, reason));
                    out.extend(self.release_job(task.job));
                    continue;
                }
            }
            let Some(job) = self.jobs.get(&task.job) else {
                continue;
            };
            if is_terminal(job.state)
                || job.tasks[task.stage as usize][task.index as usize].status != TaskStatus::Ready
            {
                continue;
            }
            if !self.workers.is_empty() && job.has_dead_targets(task.stage, &self.workers) {
                // Every worker was lost at some point: place the exchange's partitions again.
                self.recover_job(task.job);
                if let Some(job) = self.jobs.get(&task.job) {
                    self.ready.push(job, task);
                }
                continue;
            }
            let requires = job.spec.stages[task.stage as usize].requires.clone();
            if !requires.is_empty() && !self.satisfiable(&requires) {
                self.park(task);
                continue;
            }
            let Some(job) = self.jobs.get(&task.job) else {
                continue;
            };
            let expected = expected_bytes(job, task) + self.dataset_input_bytes(task);
            if let Some(pinned) = job.pinned_worker(task.stage, task.index) {
                if self.workers.get(pinned).is_some_and(|w| w.free() > 0) {
                    let pinned = pinned.to_string();
                    self.start(task, &pinned, expected, &mut assigned);
                    self.requeue_if_free(&pinned);
                } else {
                    set_aside.push(queued);
                }
                continue;
            }
            let placed = match self.locality(job, task, expected, &requires, &waiting) {
                Locality::Place(id) => Some(id),
                Locality::Wait(id) => {
                    *waiting.entry(id).or_default() += 1;
                    set_aside.push(queued);
                    continue;
                }
                Locality::Anywhere(holder) => self
                    .next_fitting(Slot::Run, expected, &requires)
                    .or(holder)
                    .or_else(|| self.next_fitting(Slot::Queue, expected, &requires)),
            };
            let worker_id = match placed {
                Some(id) => id,
                None if !requires.is_empty()
                    && !self
                        .workers
                        .values()
                        .any(|w| w.has_tags(&requires) && w.free() > 0) =>
                {
                    set_aside.push(queued);
                    continue;
                }
                None if self
                    .workers
                    .values()
                    .any(|w| w.has_tags(&requires) && w.could_ever_fit(expected)) =>
                {
                    self.requeue_front(queued);
                    break;
                }
                None => match self.most_free_pool(&requires) {
                    Some(id) => {
                        tracing::warn!(
                            worker = %id,
                            stage = task.stage,
                            task = task.index,
                            expected,
                            "no worker's pool can hold this task's working set; placing it where most of the pool is free"
                        );
                        id
                    }
                    None => {
                        self.requeue_front(queued);
                        break;
                    }
                },
            };
            self.start(task, &worker_id, expected, &mut assigned);
            self.requeue_if_free(&worker_id);
        }
        assigned.flush_into(&mut out);
        self.assigned = assigned;
        for queued in set_aside.into_iter().rev() {
            self.requeue_front(queued);
        }
        out.extend(self.steal());
        out
    }

    /// Runs [`Job::recover`] on a job and queues what became ready.
    fn recover_job(&mut self, number: u64) {
        let Some(job) = self.jobs.get_mut(&number) else {
            return;
        };
        if job.recover(&self.workers, number as usize) > 0 {
            let ready = job.recount_ready(number);
            self.ready.extend(job, ready);
            sync_usage(&mut self.ready, job);
            job.publish();
        }
    }

    /// Puts a task taken from the ready queue back where it was.
    fn requeue_front(&mut self, queued: queue::Queued) {
        if let Some(job) = self.jobs.get(&queued.task.job) {
            self.ready.push_front(job, queued);
        }
    }

    /// The first worker of the open queue (a slot free to run in) or of the idle queue (room
    /// to queue in) whose pool fits `expected` more bytes and which has the tags `requires`,
    /// taken out of the queue (the others keep their places; stale entries are dropped).
    fn next_fitting(&mut self, slot: Slot, expected: u64, requires: &[String]) -> Option<String> {
        let workers = &mut self.workers;
        let deque = match slot {
            Slot::Run => &mut self.open,
            Slot::Queue => &mut self.idle,
        };
        let mut i = 0;
        while i < deque.len() {
            let Some(w) = workers.get_mut(&deque[i]) else {
                deque.remove(i);
                continue;
            };
            let room = match slot {
                Slot::Run => w.has_open_slot(),
                Slot::Queue => w.free() > 0,
            };
            let take = room && w.fits(expected) && w.has_tags(requires);
            if !room || take {
                match slot {
                    Slot::Run => w.open_queued = false,
                    Slot::Queue => w.idle_queued = false,
                }
                let id = deque.remove(i);
                if take {
                    return id;
                }
                continue;
            }
            i += 1;
        }
        None
    }

    /// The worker with a free slot, the tags `requires`, and the most free pool.
    fn most_free_pool(&mut self, requires: &[String]) -> Option<String> {
        let id = self
            .workers
            .iter()
            .filter(|(_, w)| w.free() > 0 && w.has_tags(requires))
            .max_by_key(|(id, w)| (w.free_pool(), std::cmp::Reverse(id.as_str())))
            .map(|(id, _)| id.clone())?;
        if let Some(w) = self.workers.get_mut(&id)
            && w.idle_queued
        {
            w.idle_queued = false;
            self.idle.retain(|queued| *queued != id);
        }
        Some(id)
    }

    /// Whether some worker has room, dropping stale entries (full or gone) from the idle queue.
    fn has_free_worker(&mut self) -> bool {
        while let Some(id) = self.idle.front() {
            match self.workers.get_mut(id) {
                Some(w) if w.free() > 0 => return true,
                Some(w) => w.idle_queued = false,
                None => {}
            }
            self.idle.pop_front();
        }
        false
    }

    /// Puts a worker with room back in the idle queue, and one with a slot free to run in
    /// back in the open queue (once each).
    fn requeue_if_free(&mut self, worker_id: &str) {
        let Some(w) = self.workers.get_mut(worker_id) else {
            return;
        };
        if w.free() > 0 && !w.idle_queued {
            w.idle_queued = true;
            self.idle.push_back(worker_id.to_string());
        }
        if w.has_open_slot() && !w.open_queued {
            w.open_queued = true;
            self.open.push_back(worker_id.to_string());
        }
    }

    /// A task attempt left a worker (done, failed, cancelled): free its place. Returns the
    /// worker's number in the records, if it is attached.
    fn release_slot(&mut self, worker_id: &str, task: (u64, u32, u32)) -> Option<u32> {
        let number = self.workers.get_mut(worker_id).map(|w| {
            w.running.remove(&task);
            w.number
        });
        self.requeue_if_free(worker_id);
        number
    }

    /// Starts `task`'s next attempt on `worker_id`, adding its assignment to `assigned`.
    fn start(&mut self, task: TaskRef, worker_id: &str, expected: u64, assigned: &mut Assignments) {
        let job = self
            .jobs
            .get_mut(&task.job)
            .unwrap_or_else(|| unreachable!("placed task of a missing job"));
        let entry = &mut job.tasks[task.stage as usize][task.index as usize];
        entry.attempts += 1;
        let attempt = entry.attempts;
        job.set_status(
            task.stage,
            task.index,
            TaskStatus::Running {
                worker: worker_id.to_string(),
            },
        );
        if job.state == JobState::Pending {
            job.state = JobState::Running;
        }
        job.publish();
        let sends = job.exchange_targets(task.stage, task.index, &self.workers, task.job as usize);
        let job = &self.jobs[&task.job];
        let stage = &job.spec.stages[task.stage as usize];
        let mut inputs = Vec::new();
        if let Some(partition) = stage.partitions.get(task.index as usize) {
            inputs.push(TaskInput {
                kind: Some(task_input::Kind::Parquet(partition.clone())),
            });
        }
        inputs.extend(self.dataset_inputs(task).into_iter().map(|l| TaskInput {
            kind: Some(task_input::Kind::Partition(l)),
        }));
        let outputs_of = |s: u32, i: u32| -> Vec<PartitionLocation> {
            match &job.tasks[s as usize][i as usize].status {
                TaskStatus::Done { worker, outputs } => outputs
                    .iter()
                    .enumerate()
                    .map(|(output, meta)| {
                        self.location(&job.id, (s, i, output as u32), worker, meta)
                    })
                    .collect(),
                _ => Vec::new(),
            }
        };
        for input in &stage.inputs {
            let count = job.spec.stages[input.stage as usize].num_tasks;
            match input.pattern() {
                Pattern::OneToOne => {
                    inputs.extend(outputs_of(input.stage, task.index).into_iter().map(|l| {
                        TaskInput {
                            kind: Some(task_input::Kind::Partition(l)),
                        }
                    }))
                }
                Pattern::All => inputs.extend((0..count).flat_map(|i| {
                    outputs_of(input.stage, i).into_iter().map(|l| TaskInput {
                        kind: Some(task_input::Kind::Partition(l)),
                    })
                })),
                Pattern::Broadcast => inputs.push(TaskInput {
                    kind: Some(task_input::Kind::Broadcast(wrk_proto::BroadcastInput {
                        stage: input.stage,
                        partitions: (0..count)
                            .flat_map(|i| outputs_of(input.stage, i))
                            .collect(),
                    })),
                }),
                Pattern::Shuffle => {}
            }
        }
        let mut params = job.spec.params.clone();
        params.extend(stage.params.clone());
        let assign = AssignTask {
            task: Some(TaskId {
                job_id: job.id.clone(),
                stage: task.stage,
                index: task.index,
                attempt,
            }),
            job_name: job.spec.name.clone(),
            stage_name: stage.name.clone(),
            task_count: stage.num_tasks,
            module_hash: stage.module_hash.clone(),
            module_name: self
                .modules
                .get(&stage.module_hash)
                .map(|m| m.name.clone())
                .unwrap_or_default(),
            params,
            inputs,
            sources: job.spec.sources.clone(),
            sinks: job.spec.sinks.clone(),
            limits: job.spec.limits,
            sends,
            receives: job.exchange_sources(task.stage, task.index),
        };
        self.assignments += 1;
        let worker = self
            .workers
            .get_mut(worker_id)
            .unwrap_or_else(|| unreachable!("placed on a missing worker"));
        worker.running.insert(
            (task.job, task.stage, task.index),
            (expected, self.assignments),
        );
        if worker.stealable() > 0 && !worker.overload_queued {
            worker.overload_queued = true;
            self.overloaded.push_back(worker_id.to_string());
        }
        assigned.add(worker.number, &worker.outbox, assign);
        if let Some(job) = self.jobs.get_mut(&task.job) {
            sync_usage(&mut self.ready, job);
        }
    }

    /// The running task this report is about, if it is still current (not stale or foreign).
    fn current(&self, worker_id: &str, id: &TaskId) -> Option<TaskRef> {
        let number = *self.job_ids.get(&id.job_id)?;
        let job = self.jobs.get(&number)?;
        let entry = job.tasks.get(id.stage as usize)?.get(id.index as usize)?;
        let running_here =
            matches!(&entry.status, TaskStatus::Running { worker } if worker == worker_id);
        (running_here && entry.attempts == id.attempt).then_some(TaskRef {
            job: number,
            stage: id.stage,
            index: id.index,
        })
    }

    /// A worker reports the end of a task attempt: frees its place, and returns the task if the
    /// report is about its current attempt (not stale, not foreign), with the worker's number in
    /// the records.
    fn attempt_ended(&mut self, worker_id: &str, id: &TaskId) -> Option<(TaskRef, u32)> {
        let number = self.job_ids.get(&id.job_id).copied().unwrap_or(0);
        let worker = self.release_slot(worker_id, (number, id.stage, id.index));
        let task = self.current(worker_id, id)?;
        Some((
            task,
            worker.unwrap_or_else(|| self.worker_names.intern(worker_id)),
        ))
    }

    /// A worker reports task attempts that ended: each is recorded, then the work they made
    /// room for is placed, in one dispatch for them all (so the worker gets the tasks it has
    /// room for in one message).
    pub fn tasks_ended(&mut self, worker_id: &str, reports: TaskReports) -> Outgoing {
        let mut out = Vec::new();
        for done in reports.done {
            out.extend(self.done(worker_id, done));
        }
        for failed in reports.failed {
            out.extend(self.failed(worker_id, failed));
        }
        out.extend(self.dispatch());
        out
    }

    /// [`State::tasks_ended`] for one task that succeeded.
    pub fn task_done(&mut self, worker_id: &str, done: TaskDone) -> Outgoing {
        let mut out = self.done(worker_id, done);
        out.extend(self.dispatch());
        out
    }

    /// [`State::tasks_ended`] for one task that failed.
    pub fn task_failed(&mut self, worker_id: &str, failed: TaskFailed) -> Outgoing {
        let mut out = self.failed(worker_id, failed);
        out.extend(self.dispatch());
        out
    }

    /// Records a task attempt that succeeded (dispatching is the caller's).
    fn done(&mut self, worker_id: &str, done: TaskDone) -> Outgoing {
        let Some(id) = done.task else {
            return Vec::new();
        };
        // Before its slot is freed: the worker's room depends on how long its tasks take.
        if let (Some(stats), Some(worker)) = (&done.stats, self.workers.get_mut(worker_id)) {
            worker.observe_task(stats.duration_us);
        }
        let Some((task, worker)) = self.attempt_ended(worker_id, &id) else {
            return Vec::new();
        };
        let duration_us = done.stats.as_ref().map_or(0, |s| s.duration_us);
        let end_us = self.clock.now_us();
        let job = self
            .jobs
            .get_mut(&task.job)
            .unwrap_or_else(|| unreachable!());
        let attempt = Attempt {
            task,
            attempt: id.attempt,
            worker,
            worker_id,
            start_us: end_us.saturating_sub(duration_us),
            end_us,
        };
        let transfers = remote_transfers(job, &attempt, &self.workers, &self.worker_names);
        record(
            &mut self.recent,
            job,
            &attempt,
            &done.outputs,
            &transfers,
            None,
        );
        if job.mapper_finished(task.stage, task.index) {
            // Pieces it sent were lost with a worker while it ran: it sends them again.
            job.set_status(task.stage, task.index, TaskStatus::Ready);
            self.ready.push(job, task);
            sync_usage(&mut self.ready, job);
            job.publish();
            return Vec::new();
        }
        job.set_status(
            task.stage,
            task.index,
            TaskStatus::Done {
                worker: worker_id.to_string(),
                outputs: done.outputs,
            },
        );
        job.tasks[task.stage as usize][task.index as usize].workers_lost = 0;
        let (duration, succeeded) = &job.stage_metrics[task.stage as usize];
        if let Some(stats) = done.stats {
            let seconds = stats.duration_us as f64 / 1e6;
            let entry = &mut job.durations[task.stage as usize];
            entry.0 += seconds;
            entry.1 += 1;
            duration.observe(seconds);
            let stage = &job.spec.stages[task.stage as usize];
            self.durations
                .observe(&stage.module_hash, &stage.name, seconds);
        }
        succeeded.inc();
        job.reducer_finished(task.stage, task.index);
        let stage_done =
            job.done[task.stage as usize] == job.spec.stages[task.stage as usize].num_tasks;
        let mut exchanges_complete = false;
        for &(consumer, pattern) in &job.consumers[task.stage as usize] {
            let indices: Vec<u32> = match pattern {
                Pattern::OneToOne => vec![task.index],
                Pattern::All | Pattern::Broadcast => {
                    (0..job.spec.stages[consumer as usize].num_tasks).collect()
                }
                // Reducers wait for every mapper: the last one makes them ready (below).
                Pattern::Shuffle => {
                    exchanges_complete |= stage_done;
                    Vec::new()
                }
            };
            for index in indices {
                let entry = &mut job.tasks[consumer as usize][index as usize];
                if let TaskStatus::Waiting(n) = entry.status {
                    entry.status = if n <= 1 {
                        self.ready.push_to(
                            job.queue_tenant,
                            job.priority,
                            // A consumer stage reads earlier stages' outputs by definition.
                            true,
                            TaskRef {
                                job: task.job,
                                stage: consumer,
                                index,
                            },
                        );
                        TaskStatus::Ready
                    } else {
                        TaskStatus::Waiting(n - 1)
                    };
                }
            }
        }
        if exchanges_complete {
            job.mappers_all_done(task.stage);
            let ready = job.recount_ready(task.job);
            self.ready.extend(job, ready);
        }
        let released = job.release_unneeded_inputs(task.stage, task.index);
        sync_usage(&mut self.ready, job);
        let mut out: Outgoing = Vec::new();
        for (worker, tasks) in released {
            if let Some(w) = self.workers.get(&worker) {
                out.push((
                    w.outbox.clone(),
                    message(ToWorker::ReleaseTasks(ReleaseTasks {
                        job_id: job.id.clone(),
                        tasks: tasks
                            .into_iter()
                            .map(|(stage, index)| wrk_proto::TaskRef { stage, index })
                            .collect(),
                    })),
                ));
            }
        }
        let succeeded = job.remaining == 0 && job.state == JobState::Running;
        if succeeded {
            job.state = JobState::Succeeded;
            tracing::info!(job = %job.id, name = %job.spec.name, "job succeeded");
        }
        job.publish();
        if succeeded {
            self.job_ended(task.job);
        }
        self.wake_dataset_readers(task.job);
        out
    }

    /// Keeps the task records of `tenant`'s job `job_id` for [`State::job_timeline`] (a
    /// performance report); call it right after [`State::submit`].
    pub fn keep_timeline(&mut self, tenant: &str, job_id: &str) -> Result<(), StateError> {
        let number = self.tenant_job(tenant, job_id)?;
        if let Some(job) = self.jobs.get_mut(&number) {
            job.records.get_or_insert_default();
        }
        Ok(())
    }

    /// A job reached a final state: note when, and keep its records only while few finished
    /// jobs do.
    fn job_ended(&mut self, number: u64) {
        let now_us = self.clock.now_us();
        if let Some(job) = self.jobs.get_mut(&number) {
            job.finished_us.get_or_insert(now_us);
        }
        self.retained.push_back(number);
        while self.retained.len() > RETAINED_JOB_TIMELINES {
            if let Some(oldest) = self.retained.pop_front()
                && let Some(job) = self.jobs.get_mut(&oldest)
            {
                job.records = None;
            }
        }
    }

    /// Records a task attempt that failed: retries it or fails its job (dispatching is the
    /// caller's).
    fn failed(&mut self, worker_id: &str, failed: TaskFailed) -> Outgoing {
        let Some(id) = failed.task else {
            return Vec::new();
        };
        let Some((task, worker)) = self.attempt_ended(worker_id, &id) else {
            return Vec::new();
        };
        let end_us = self.clock.now_us();
        let job = self
            .jobs
            .get_mut(&task.job)
            .unwrap_or_else(|| unreachable!());
        let attempt = Attempt {
            task,
            attempt: id.attempt,
            worker,
            worker_id,
            start_us: end_us.saturating_sub(failed.duration_us),
            end_us,
        };
        record(
            &mut self.recent,
            job,
            &attempt,
            &[],
            &[],
            Some(&failed.error),
        );
        let entry = &job.tasks[task.stage as usize][task.index as usize];
        let attempts = entry.attempts - entry.stolen;
        let stage_name = job.spec.stages[task.stage as usize].name.clone();
        job.set_status(task.stage, task.index, TaskStatus::Ready);
        sync_usage(&mut self.ready, job);
        let retry = failed.retriable && attempts < MAX_ATTEMPTS;
        let outcome = if retry { "retried" } else { "failed" };
        self.metrics
            .tasks_finished
            .with_label_values(&[stage_name.as_str(), outcome])
            .inc();
        if retry {
            tracing::warn!(job = %job.id, stage = %stage_name, task = task.index, "retrying after: {}", failed.error);
            // Its inputs may be gone with a lost peer: recount puts it (and anything else
            // affected) back to waiting until they are recomputed.
            let ready = job.recount_ready(task.job);
            self.ready.extend(job, ready);
            job.publish();
            return Vec::new();
        }
        let reason = format!(
            "stage `{stage_name}` task {} failed{}: {}",
            task.index,
            if failed.retriable {
                format!(" after {attempts} attempts")
            } else {
                String::new()
            },
            failed.error
        );
        let mut out = self.finish_job(task.job, JobState::Failed, reason);
        // A failed job has no results to fetch: drop its data now.
        out.extend(self.release_job(task.job));
        out
    }

    /// Ends a job that is not finished yet: cancels its running tasks.
    fn finish_job(&mut self, number: u64, state: JobState, error: String) -> Outgoing {
        let mut out = Vec::new();
        let Some(job) = self.jobs.get_mut(&number) else {
            return out;
        };
        if is_terminal(job.state) {
            return out;
        }
        tracing::warn!(job = %job.id, name = %job.spec.name, ?state, "{error}");
        job.state = state;
        job.error = error;
        let running: Vec<(u32, u32, String, u32)> = job
            .indexed_tasks()
            .filter_map(|(s, i, t)| match &t.status {
                TaskStatus::Running { worker } => Some((s, i, worker.clone(), t.attempts)),
                _ => None,
            })
            .collect();
        let mut freed = Vec::with_capacity(running.len());
        for (stage, index, worker, attempt) in running {
            if let Some(w) = self.workers.get_mut(&worker) {
                w.running.remove(&(number, stage, index));
                out.push((
                    w.outbox.clone(),
                    message(ToWorker::Cancel(CancelTask {
                        task: Some(TaskId {
                            job_id: job.id.clone(),
                            stage,
                            index,
                            attempt,
                        }),
                    })),
                ));
            }
            job.set_status(stage, index, TaskStatus::Ready);
            freed.push(worker);
        }
        sync_usage(&mut self.ready, job);
        job.publish();
        for worker in freed {
            self.requeue_if_free(&worker);
        }
        self.job_ended(number);
        out
    }

    pub fn cancel(&mut self, tenant: &str, job_id: &str) -> Result<Outgoing, StateError> {
        let number = self.tenant_job(tenant, job_id)?;
        let mut out = self.finish_job(
            number,
            JobState::Cancelled,
            "cancelled by the client".into(),
        );
        out.extend(self.release_job(number));
        out.extend(self.dispatch());
        Ok(out)
    }

    /// The client is done with a job: workers drop its data, the scheduler its tasks. A job
    /// still running is cancelled first.
    pub fn release(&mut self, tenant: &str, job_id: &str) -> Result<Outgoing, StateError> {
        let number = self.tenant_job(tenant, job_id)?;
        let mut out = self.finish_job(
            number,
            JobState::Cancelled,
            "released by the client before it finished".into(),
        );
        out.extend(self.release_job(number));
        self.forget_dataset_of(number);
        if let Some(job) = self.jobs.get_mut(&number) {
            job.records = None;
        }
        out.extend(self.dispatch());
        Ok(out)
    }

    /// Tells every worker to drop a finished job's partitions and forgets its tasks.
    fn release_job(&mut self, number: u64) -> Outgoing {
        let Some(job) = self.jobs.get_mut(&number) else {
            return Vec::new();
        };
        if job.released {
            return Vec::new();
        }
        job.released = true;
        job.tasks = Vec::new();
        job.held = 0;
        sync_usage(&mut self.ready, job);
        let job_id = job.id.clone();
        // Readers waiting for a partition of this job's dataset learn that it is gone.
        self.wake_dataset_readers(number);
        self.datasets.forget_reader(number);
        self.workers
            .values()
            .map(|w| {
                (
                    w.outbox.clone(),
                    message(ToWorker::Release(ReleaseJob {
                        job_id: job_id.clone(),
                    })),
                )
            })
            .collect()
    }

    /// How many workers the backlog needs to be done within `target`, and which workers can
    /// stop without losing data any job still needs.
    pub fn scaling_advice(&self, target: Duration) -> ScalingAdvice {
        let mut holding: HashSet<&str> = HashSet::new();
        let mut backlog_tasks = 0u64;
        let mut backlog_seconds = 0.0f64;
        for job in self.jobs.values().filter(|j| !j.released) {
            holding.extend(job.shuffle_holders());
            for (stage, tasks) in job.tasks.iter().enumerate() {
                for task in tasks {
                    if let TaskStatus::Done { worker, .. } = &task.status
                        && !task.outputs_released
                    {
                        holding.insert(worker);
                    }
                }
                if is_terminal(job.state) {
                    continue;
                }
                let left = tasks.len() as u32 - job.done[stage];
                let (seconds, count) = job.durations[stage];
                let mean = if count > 0 {
                    seconds / f64::from(count)
                } else {
                    DEFAULT_TASK_SECONDS
                };
                backlog_tasks += u64::from(left);
                backlog_seconds += f64::from(left) * mean;
            }
        }
        let mut retirable: Vec<String> = self
            .workers
            .iter()
            .filter(|(id, w)| w.running.is_empty() && !holding.contains(id.as_str()))
            .map(|(id, _)| id.clone())
            .collect();
        retirable.sort();
        let current = self.workers.len() as u32;
        let slots_per_worker = if self.workers.is_empty() {
            1.0
        } else {
            self.workers
                .values()
                .map(|w| f64::from(w.slots))
                .sum::<f64>()
                / f64::from(current)
        };
        let for_backlog =
            (backlog_seconds / (target.as_secs_f64().max(0.001) * slots_per_worker)).ceil() as u32;
        let for_data = current - retirable.len() as u32;
        ScalingAdvice {
            current_workers: current,
            desired_workers: for_backlog.max(for_data).max(u32::from(backlog_tasks > 0)),
            retirable_workers: retirable,
            backlog_tasks,
            backlog_seconds,
        }
    }

    /// Forgets a worker: its running tasks run again elsewhere, and outputs it held that an
    /// unfinished job still needs are recomputed from the graph.
    pub fn worker_lost(&mut self, worker_id: &str, reason: &str) -> Outgoing {
        let Some(worker) = self.workers.remove(worker_id) else {
            return Vec::new();
        };
        self.satisfiable.clear();
        for thief in worker.retracting.values() {
            if let Some(t) = self.workers.get_mut(thief) {
                t.expecting = t.expecting.saturating_sub(1);
            }
        }
        if reason != WORKER_LEFT {
            self.metrics.workers_lost.inc();
        }
        let mut rerun = 0usize;
        let mut recompute = 0usize;
        let mut poisoned: Vec<(u64, String)> = Vec::new();
        let workers = &self.workers;
        for (&number, job) in self.jobs.iter_mut() {
            if is_terminal(job.state) {
                continue;
            }
            let mut touched = false;
            for stage in 0..job.tasks.len() as u32 {
                for index in 0..job.tasks[stage as usize].len() as u32 {
                    let status = &job.tasks[stage as usize][index as usize].status;
                    if matches!(status, TaskStatus::Running { worker } if worker == worker_id) {
                        job.set_status(stage, index, TaskStatus::Ready);
                        rerun += 1;
                        touched = true;
                        let entry = &mut job.tasks[stage as usize][index as usize];
                        entry.workers_lost += 1;
                        if entry.workers_lost >= POISON_AFTER_LOST_WORKERS {
                            poisoned.push((
                                number,
                                format!(
                                    "stage `{}` task {index} is poisoned: the {} workers that ran it died (the last: {worker_id})",
                                    job.spec.stages[stage as usize].name, entry.workers_lost
                                ),
                            ));
                        }
                    }
                }
            }
            let recomputed = job.recover(workers, number as usize);
            if recomputed > 0 {
                recompute += recomputed;
                touched = true;
            }
            if touched {
                let ready = job.recount_ready(number);
                self.ready.extend(job, ready);
                sync_usage(&mut self.ready, job);
                job.publish();
            }
        }
        recompute += self.recover_datasets();
        if rerun == 0 && recompute == 0 && reason == WORKER_LEFT {
            tracing::info!(worker = %worker_id, address = %worker.address, "worker left");
        } else {
            tracing::warn!(
                worker = %worker_id,
                address = %worker.address,
                "worker lost ({reason}): {rerun} running tasks to rerun, {recompute} finished tasks to recompute"
            );
        }
        let mut out = self.moves_after_loss(worker_id);
        for (number, reason) in poisoned {
            out.extend(self.finish_job(number, JobState::Failed, reason));
            out.extend(self.release_job(number));
        }
        out.extend(self.dispatch());
        out
    }

    /// The Prometheus text exposition of the scheduler's metrics, gauges read now.
    pub fn render_metrics(&self) -> String {
        let m = &self.metrics;
        m.workers.set(self.workers.len() as i64);
        m.ready_queue.set(self.ready.len() as i64);
        m.worker_memory_used.reset();
        m.worker_assigned.reset();
        for (id, w) in &self.workers {
            m.worker_memory_used
                .with_label_values(&[id.as_str()])
                .set(w.pool_used_bytes as i64);
            m.worker_assigned
                .with_label_values(&[id.as_str()])
                .set(w.running.len() as i64);
        }
        let (mut pending, mut running, mut done) = (0i64, 0i64, 0i64);
        let mut jobs: HashMap<&'static str, i64> = HashMap::new();
        let mut queued: HashMap<(&str, &str), i64> = HashMap::new();
        for job in self.jobs.values() {
            *jobs.entry(state_name(job.state)).or_default() += 1;
            if is_terminal(job.state) {
                continue;
            }
            for (s, stage) in job.spec.stages.iter().enumerate() {
                let waiting = stage.num_tasks.saturating_sub(job.done[s] + job.running[s]);
                *queued
                    .entry((job.tenant.as_str(), stage.name.as_str()))
                    .or_default() += i64::from(waiting);
            }
            let job_running: u32 = job.running.iter().sum();
            let job_done: u32 = job.done.iter().sum();
            running += i64::from(job_running);
            done += i64::from(job_done);
            pending += job.remaining as i64 - i64::from(job_running);
        }
        for (state, value) in [("pending", pending), ("running", running), ("done", done)] {
            m.tasks.with_label_values(&[state]).set(value);
        }
        m.jobs.reset();
        for (state, count) in jobs {
            m.jobs.with_label_values(&[state]).set(count);
        }
        m.queued.reset();
        for ((tenant, stage), count) in queued {
            m.queued.with_label_values(&[tenant, stage]).set(count);
        }
        m.render()
    }

    /// Signs partition locations from now on with `secret` (the cluster's worker token), so
    /// workers serve partitions only to holders of a location the scheduler handed out.
    pub fn set_ticket_secret(&mut self, secret: Option<Vec<u8>>) {
        self.ticket_secret = secret;
    }

    /// Where output `(stage, task, output)` of a job is, with its ticket.
    fn location(
        &self,
        job_id: &str,
        (stage, task, output): (u32, u32, u32),
        worker: &str,
        meta: &OutputMeta,
    ) -> PartitionLocation {
        let key = PartitionKey {
            job_id: job_id.to_string(),
            stage,
            task,
            output,
        };
        let ticket = self
            .ticket_secret
            .as_deref()
            .map(|secret| wrk_proto::auth::partition_ticket(secret, &key))
            .unwrap_or_default();
        PartitionLocation {
            key: Some(key),
            worker_id: worker.to_string(),
            address: self
                .workers
                .get(worker)
                .map(|w| w.address.clone())
                .unwrap_or_default(),
            rows: meta.rows,
            bytes: meta.bytes,
            ticket,
        }
    }

    /// The worker a task attempt is running on, if it is running.
    pub fn worker_of(&self, id: &TaskId) -> Option<String> {
        let job = self.jobs.get(self.job_ids.get(&id.job_id)?)?;
        match &job
            .tasks
            .get(id.stage as usize)?
            .get(id.index as usize)?
            .status
        {
            TaskStatus::Running { worker } => Some(worker.clone()),
            _ => None,
        }
    }

    pub fn result(&self, tenant: &str, job_id: &str) -> Result<JobResult, StateError> {
        let number = self.tenant_job(tenant, job_id)?;
        let job = &self.jobs[&number];
        let mut partitions = Vec::new();
        if job.state == JobState::Succeeded && !job.released {
            for stage in job.final_stages() {
                for (index, entry) in job.tasks[stage as usize].iter().enumerate() {
                    if let TaskStatus::Done { worker, outputs } = &entry.status {
                        for (output, meta) in outputs.iter().enumerate() {
                            let key = (stage, index as u32, output as u32);
                            partitions.push(self.location(&job.id, key, worker, meta));
                        }
                    }
                }
            }
        }
        Ok(JobResult {
            state: job.state as i32,
            error: job.error.clone(),
            partitions,
        })
    }

    /// The workers, and the jobs of `tenant`.
    pub fn status(&self, tenant: &str) -> ClusterStatus {
        let mut workers: Vec<WorkerStatus> = self
            .workers
            .iter()
            .map(|(id, w)| WorkerStatus {
                worker_id: id.clone(),
                data_address: w.address.clone(),
                slots: w.slots,
                running_tasks: w.running.len() as u32,
                device: w.device.clone(),
                pool_bytes: w.pool_bytes,
                pool_used_bytes: w.pool_used_bytes,
                partitions: w.partitions,
                http_address: w.http_address.clone(),
                pool_peak_bytes: w.beat.pool_peak_bytes,
                spilled_bytes: w.beat.spilled_bytes,
                spilled_partitions: w.beat.spilled_partitions,
                spill_count: w.beat.spill_count,
                unspill_count: w.beat.unspill_count,
                gpu: w.gpu.clone(),
                gpu_telemetry: w.gpu_telemetry,
                tags: w.tags.clone(),
            })
            .collect();
        workers.sort_by(|a, b| a.worker_id.cmp(&b.worker_id));
        let mut jobs: Vec<(u64, JobSummary)> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.tenant == tenant)
            .map(|(n, j)| {
                (
                    *n,
                    JobSummary {
                        job_id: j.id.clone(),
                        name: j.spec.name.clone(),
                        state: j.state as i32,
                        waiting: j.waiting.clone(),
                        priority: j.priority,
                    },
                )
            })
            .collect();
        jobs.sort_by_key(|(n, _)| *n);
        ClusterStatus {
            workers,
            jobs: jobs.into_iter().map(|(_, j)| j).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wrk_proto::{Register, Stage, StageInput, TaskStats};

    pub(super) type Inbox = mpsc::UnboundedReceiver<Result<SchedulerMessage, tonic::Status>>;

    /// The tenant of the tests' jobs.
    pub(super) const T: &str = "tenant";

    pub(super) fn add_worker(state: &mut State, id: &str, slots: u32) -> Inbox {
        let (tx, rx) = mpsc::unbounded_channel();
        state
            .register_worker(
                &Register {
                    worker_id: id.into(),
                    data_address: format!("http://{id}"),
                    slots,
                    ..Default::default()
                },
                tx,
            )
            .unwrap();
        rx
    }

    /// map (n tasks) -> reduce (1 task, all inputs).
    fn map_reduce(n: u32) -> JobSpec {
        JobSpec {
            name: "mr".into(),
            stages: vec![
                Stage {
                    name: "map".into(),
                    module_hash: "h".into(),
                    num_tasks: n,
                    ..Default::default()
                },
                Stage {
                    name: "reduce".into(),
                    module_hash: "h".into(),
                    num_tasks: 1,
                    inputs: vec![StageInput {
                        stage: 0,
                        pattern: Pattern::All as i32,
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            ],
            ..Default::default()
        }
    }

    pub(super) fn assigned(out: &Outgoing) -> Vec<AssignTask> {
        out.iter()
            .filter_map(|(_, m)| match &m.kind {
                Some(ToWorker::Assign(a)) => Some(a.tasks.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    fn done(task: &AssignTask, bytes: u64) -> TaskDone {
        TaskDone {
            task: task.task.clone(),
            outputs: vec![OutputMeta { rows: 1, bytes }],
            stats: None,
        }
    }

    /// Reports `task` done by the worker running it, with one output of `bytes`.
    pub(super) fn finish(state: &mut State, task: &AssignTask, bytes: u64) -> Outgoing {
        let worker = worker_of(state, task);
        state.task_done(&worker, done(task, bytes))
    }

    /// A job of one stage of `n` tasks.
    pub(super) fn one_stage(n: u32) -> JobSpec {
        JobSpec {
            name: "j".into(),
            stages: vec![Stage {
                name: "s".into(),
                module_hash: "h".into(),
                num_tasks: n,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    pub(super) fn worker_of(state: &State, task: &AssignTask) -> String {
        let id = task.task.as_ref().unwrap();
        let number = state.job_ids[&id.job_id];
        match &state.jobs[&number].tasks[id.stage as usize][id.index as usize].status {
            TaskStatus::Running { worker } => worker.clone(),
            other => panic!("not running: {other:?}"),
        }
    }

    /// The job's state, after checking its incremental counters against its tasks.
    pub(super) fn job_state(state: &State, id: &str) -> JobState {
        let job = &state.jobs[&state.job_ids[id]];
        if job.released {
            assert!(job.tasks.is_empty(), "a released job keeps no tasks");
            return state.result(T, id).unwrap().state();
        }
        let mut remaining = 0;
        for (s, tasks) in job.tasks.iter().enumerate() {
            let done = tasks
                .iter()
                .filter(|t| matches!(t.status, TaskStatus::Done { .. }))
                .count();
            let running = tasks
                .iter()
                .filter(|t| matches!(t.status, TaskStatus::Running { .. }))
                .count();
            assert_eq!(
                (job.done[s] as usize, job.running[s] as usize),
                (done, running),
                "stage {s} counters"
            );
            remaining += tasks.len() - done;
        }
        assert_eq!(job.remaining, remaining, "remaining tasks");
        state.result(T, id).unwrap().state()
    }

    /// Reports `task` done by its worker: one output of `bytes`, after `duration_us`.
    pub(super) fn finish_after(
        state: &mut State,
        task: &AssignTask,
        bytes: u64,
        duration_us: u64,
    ) -> Outgoing {
        let worker = worker_of(state, task);
        let done = TaskDone {
            stats: Some(TaskStats {
                duration_us,
                ..Default::default()
            }),
            ..done(task, bytes)
        };
        state.task_done(&worker, done)
    }

    #[test]
    fn a_worker_whose_tasks_are_short_holds_more_queued_and_one_long_task_ends_that() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 2);
        state.submit(T, one_stage(100));
        let first = assigned(&state.dispatch());
        assert_eq!(first.len(), 4, "two slots and one queued task each");
        // A task of 1 ms: three queued per slot, so room for five more beside the other three.
        let more = assigned(&finish_after(&mut state, &first[0], 1, 1000));
        assert_eq!(more.len(), 5, "eight held in all");
        // A task of one second: back to one queued per slot; seven still held, none added.
        assert!(assigned(&finish_after(&mut state, &first[1], 1, 1_000_000)).is_empty());
        // Until the held tasks drop below four, finishing short ones adds nothing.
        for task in [&first[2], &first[3], &more[0]] {
            assert!(assigned(&finish_after(&mut state, task, 1, 1000)).is_empty());
        }
        assert_eq!(
            assigned(&finish_after(&mut state, &more[1], 1, 1000)).len(),
            1
        );
    }

    #[test]
    fn a_worker_whose_tasks_are_very_short_holds_eight_queued_per_slot() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 2);
        state.submit(T, one_stage(100));
        let first = assigned(&state.dispatch());
        assert_eq!(first.len(), 4);
        // A task of 100 us: eight queued per slot, room for fifteen more beside the other three.
        let more = assigned(&finish_after(&mut state, &first[0], 1, 100));
        assert_eq!(more.len(), 15, "eighteen held in all");
        // One long task: back to one queued per slot at once.
        assert!(assigned(&finish_after(&mut state, &first[1], 1, 1_000_000)).is_empty());
        assert_eq!(state.workers["a"].capacity(), 4);
    }

    /// The assignments of `out`, per message: (worker, task indices).
    fn assign_messages(state: &State, out: &Outgoing) -> Vec<(String, Vec<u32>)> {
        out.iter()
            .filter_map(|(outbox, m)| match &m.kind {
                Some(ToWorker::Assign(a)) => Some((
                    state
                        .workers
                        .iter()
                        .find(|(_, w)| w.outbox.same_channel(outbox))
                        .map(|(id, _)| id.clone())
                        .unwrap_or_default(),
                    a.tasks
                        .iter()
                        .map(|t| t.task.as_ref().unwrap().index)
                        .collect(),
                )),
                _ => None,
            })
            .collect()
    }

    fn failure(task: &AssignTask, retriable: bool) -> TaskFailed {
        TaskFailed {
            task: task.task.clone(),
            error: "boom".into(),
            retriable,
            duration_us: 0,
        }
    }

    #[test]
    fn the_tasks_placed_on_a_worker_at_once_go_in_one_message_each_in_order() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 2);
        let _b = add_worker(&mut state, "b", 2);
        state.submit(T, one_stage(20));
        let out = state.dispatch();
        let mut messages = assign_messages(&state, &out);
        messages.sort();
        assert_eq!(messages.len(), 2, "one message per worker: {messages:?}");
        let mut all: Vec<u32> = Vec::new();
        for (worker, tasks) in &messages {
            assert_eq!(
                tasks.len(),
                4,
                "{worker}: two running and one queued per slot"
            );
            assert!(tasks.is_sorted(), "{worker}: in placement order: {tasks:?}");
            all.extend(tasks.iter().copied());
        }
        all.sort();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn reports_sent_together_each_count_and_refill_the_worker_in_one_message() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 2);
        let (id, _) = state.submit(T, one_stage(8));
        let first = assigned(&state.dispatch());
        assert_eq!(first.len(), 4);
        // Two done and one retriable failure in one report: one dispatch for the three.
        let out = state.tasks_ended(
            "a",
            TaskReports {
                done: vec![done(&first[0], 1), done(&first[1], 1)],
                failed: vec![failure(&first[2], true)],
            },
        );
        let messages = assign_messages(&state, &out);
        assert_eq!(
            messages.len(),
            1,
            "one message refills the worker: {messages:?}"
        );
        let mut running = assigned(&out);
        assert_eq!(running.len(), 3, "room for three more");
        let progress = state.jobs[&state.job_ids[&id]].progress.borrow().clone();
        assert_eq!(progress.stages[0].done, 2);
        assert_eq!(progress.stages[0].running, 4);
        // The rest, reported all at once each round, until the job ends; the failed task ran
        // again, as its second attempt.
        running.push(first[3].clone());
        let mut succeeded = 2;
        while !running.is_empty() {
            let out = state.tasks_ended(
                "a",
                TaskReports {
                    done: running.iter().map(|t| done(t, 1)).collect(),
                    failed: Vec::new(),
                },
            );
            succeeded += running.len();
            if let Some(retry) = running.iter().find(|t| t.task.as_ref().unwrap().index == 2) {
                assert_eq!(retry.task.as_ref().unwrap().attempt, 2);
            }
            assert!(assign_messages(&state, &out).len() <= 1);
            running = assigned(&out);
        }
        assert_eq!(succeeded, 8);
        assert_eq!(job_state(&state, &id), JobState::Succeeded);
    }

    #[test]
    fn a_fatal_failure_among_reports_fails_the_job_and_cancels_its_other_tasks() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 2);
        let (id, _) = state.submit(T, one_stage(8));
        let first = assigned(&state.dispatch());
        let out = state.tasks_ended(
            "a",
            TaskReports {
                done: vec![done(&first[0], 1)],
                failed: vec![failure(&first[1], false)],
            },
        );
        assert_eq!(job_state(&state, &id), JobState::Failed);
        assert!(
            assigned(&out).is_empty(),
            "nothing more of a failed job starts"
        );
        let cancelled: Vec<u32> = out
            .iter()
            .filter_map(|(_, m)| match &m.kind {
                Some(ToWorker::Cancel(c)) => c.task.as_ref().map(|t| t.index),
                _ => None,
            })
            .collect();
        assert_eq!(cancelled, vec![2, 3]);
        // A report of a task of the failed job that was still running is ignored.
        assert!(state.task_done("a", done(&first[2], 1)).is_empty());
    }

    #[test]
    fn map_reduce_runs_to_completion_respecting_slots() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 2);
        let _b = add_worker(&mut state, "b", 1);
        let (id, _) = state.submit(T, map_reduce(5));
        let first = assigned(&state.dispatch());
        assert_eq!(
            first.len(),
            5,
            "three slots, each with room for a queued task: all five maps are assigned"
        );
        let mut pending: Vec<AssignTask> = first;
        let mut reduce = None;
        while let Some(task) = pending.pop() {
            let worker = worker_of(&state, &task);
            let next = assigned(&state.task_done(&worker, done(&task, 10)));
            for t in next {
                if t.stage_name == "reduce" {
                    reduce = Some(t);
                } else {
                    pending.push(t);
                }
            }
        }
        let reduce = reduce.expect("reduce is assigned once every map is done");
        assert_eq!(reduce.inputs.len(), 5, "the reduce reads every map output");
        assert_eq!(job_state(&state, &id), JobState::Running);
        let worker = worker_of(&state, &reduce);
        state.task_done(&worker, done(&reduce, 1));
        let result = state.result(T, &id).unwrap();
        assert_eq!(result.state(), JobState::Succeeded);
        assert_eq!(result.partitions.len(), 1);
        assert_eq!(result.partitions[0].key.as_ref().unwrap().stage, 1);
    }

    fn add_worker_with_pool(state: &mut State, id: &str, slots: u32, pool_bytes: u64) -> Inbox {
        let (tx, rx) = mpsc::unbounded_channel();
        state
            .register_worker(
                &Register {
                    worker_id: id.into(),
                    data_address: format!("http://{id}"),
                    slots,
                    pool_bytes,
                    ..Default::default()
                },
                tx,
            )
            .unwrap();
        rx
    }

    /// A one-stage job of tasks reading Parquet partitions of these estimated sizes.
    fn reads(sizes: &[u64]) -> JobSpec {
        let mut spec = map_reduce(sizes.len() as u32);
        spec.stages.truncate(1);
        spec.stages[0].partitions = sizes
            .iter()
            .map(|&estimated_bytes| wrk_proto::ParquetPartition {
                estimated_bytes,
                ..Default::default()
            })
            .collect();
        spec
    }

    #[test]
    fn placement_keeps_the_working_sets_of_a_workers_tasks_within_its_pool() {
        let mut state = State::new();
        let _a = add_worker_with_pool(&mut state, "a", 4, 100);
        let _b = add_worker_with_pool(&mut state, "b", 4, 100);
        state.submit(T, reads(&[60, 60, 60, 30]));
        let first = assigned(&state.dispatch());
        // Slots are free, but a third 60-byte task fits neither pool beside a running one; the
        // 30-byte task behind it waits its turn rather than overtake it.
        assert_eq!(first.len(), 2, "{first:?}");
        let workers: HashSet<String> = first.iter().map(|t| worker_of(&state, t)).collect();
        assert_eq!(workers.len(), 2);
        let worker = worker_of(&state, &first[0]);
        let next = assigned(&state.task_done(&worker, done(&first[0], 1)));
        assert_eq!(
            next.len(),
            2,
            "the 60 and the 30 fit once a pool has room: {next:?}"
        );
        // The 60 could only go where the pool was freed; the 30 fits beside either 60.
        let sixty = next
            .iter()
            .find(|t| t.task.as_ref().unwrap().index == 2)
            .unwrap();
        assert_eq!(worker_of(&state, sixty), worker);
    }

    #[test]
    fn a_task_no_pool_can_hold_goes_where_most_pool_is_free() {
        let mut state = State::new();
        let _a = add_worker_with_pool(&mut state, "a", 2, 100);
        let _b = add_worker_with_pool(&mut state, "b", 2, 100);
        state.heartbeat(
            "a",
            &wrk_proto::Heartbeat {
                pool_used_bytes: 90,
                ..Default::default()
            },
        );
        state.submit(T, reads(&[500]));
        let placed = assigned(&state.dispatch());
        assert_eq!(placed.len(), 1, "never starved");
        assert_eq!(worker_of(&state, &placed[0]), "b");
    }

    #[test]
    fn placement_prefers_the_worker_holding_the_inputs() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 4);
        let _b = add_worker(&mut state, "b", 4);
        let mut spec = map_reduce(2);
        spec.stages[1].inputs[0].pattern = Pattern::OneToOne as i32;
        spec.stages[1].num_tasks = 2;
        state.submit(T, spec);
        let maps = assigned(&state.dispatch());
        assert_eq!(maps.len(), 2);
        let mut followers = Vec::new();
        for m in &maps {
            let worker = worker_of(&state, m);
            for f in assigned(&state.task_done(&worker, done(m, 1000))) {
                followers.push((worker.clone(), f));
            }
        }
        assert_eq!(followers.len(), 2);
        for (map_worker, follower) in followers {
            assert_eq!(worker_of(&state, &follower), map_worker);
        }
    }

    #[test]
    fn fatal_failure_fails_the_job_with_the_stage_named() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 1);
        let (id, _) = state.submit(T, map_reduce(1));
        let task = assigned(&state.dispatch()).remove(0);
        state.task_failed(
            "a",
            TaskFailed {
                task: task.task.clone(),
                error: "module `m.wasm` trapped".into(),
                retriable: false,
                duration_us: 0,
            },
        );
        let result = state.result(T, &id).unwrap();
        assert_eq!(result.state(), JobState::Failed);
        assert!(
            result
                .error
                .contains("stage `map` task 0 failed: module `m.wasm` trapped"),
            "{}",
            result.error
        );
    }

    #[test]
    fn retriable_failure_is_retried_then_gives_up() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 1);
        let (id, _) = state.submit(T, map_reduce(1));
        let mut task = assigned(&state.dispatch()).remove(0);
        for attempt in 1..=MAX_ATTEMPTS {
            assert_eq!(task.task.as_ref().unwrap().attempt, attempt);
            let out = state.task_failed(
                "a",
                TaskFailed {
                    task: task.task.clone(),
                    error: "peer unreachable".into(),
                    retriable: true,
                    duration_us: 0,
                },
            );
            match assigned(&out).pop() {
                Some(next) => task = next,
                None => break,
            }
        }
        let result = state.result(T, &id).unwrap();
        assert_eq!(result.state(), JobState::Failed);
        assert!(
            result
                .error
                .contains(&format!("after {MAX_ATTEMPTS} attempts")),
            "{}",
            result.error
        );
    }

    #[test]
    fn lost_worker_reruns_its_tasks_and_recomputes_lost_outputs() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 1);
        let _b = add_worker(&mut state, "b", 1);
        let (id, _) = state.submit(T, map_reduce(2));
        let maps = assigned(&state.dispatch());
        assert_eq!(maps.len(), 2);
        let (on_a, on_b): (Vec<_>, Vec<_>) =
            maps.into_iter().partition(|m| worker_of(&state, m) == "a");
        // a finishes its map; then a dies while b still runs the other map.
        state.task_done("a", done(&on_a[0], 5));
        let out = state.worker_lost("a", "test");
        let rerun = assigned(&out);
        assert_eq!(
            rerun.len(),
            1,
            "the map whose output died with `a` runs again, queued on b"
        );
        assert_eq!(rerun[0].stage_name, "map");
        assert_eq!(rerun[0].task.as_ref().unwrap().attempt, 2);
        assert_eq!(worker_of(&state, &rerun[0]), "b");
        let out = state.task_done("b", done(&on_b[0], 5));
        assert!(
            assigned(&out).is_empty(),
            "the reduce waits for the rerun map"
        );
        let reduce = assigned(&state.task_done("b", done(&rerun[0], 5))).remove(0);
        assert!(reduce.inputs.iter().all(
            |i| matches!(&i.kind, Some(task_input::Kind::Partition(p)) if p.worker_id == "b")
        ));
        state.task_done("b", done(&reduce, 1));
        assert_eq!(job_state(&state, &id), JobState::Succeeded);
    }

    /// read (1) -> map (1, one-to-one) -> reduce (1, all).
    fn chain() -> JobSpec {
        let mut spec = map_reduce(1);
        spec.stages[0].name = "read".into();
        spec.stages[1].name = "map".into();
        spec.stages[1].inputs[0].pattern = Pattern::OneToOne as i32;
        let mut reduce = spec.stages[1].clone();
        reduce.name = "reduce".into();
        reduce.inputs = vec![StageInput {
            stage: 1,
            pattern: Pattern::All as i32,
            ..Default::default()
        }];
        spec.stages.push(reduce);
        spec
    }

    #[test]
    fn only_lost_outputs_still_needed_are_recomputed_even_across_losses() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 1);
        let (id, _) = state.submit(T, chain());
        let read = assigned(&state.dispatch()).remove(0);
        let map = assigned(&state.task_done("a", done(&read, 5))).remove(0);
        assert_eq!(map.stage_name, "map");
        // `b` joins, `a` finishes the map and dies: `read` is lost but no longer needed, the
        // map's output is needed by the reduce.
        let _b = add_worker(&mut state, "b", 1);
        let reduce = assigned(&state.task_done("a", done(&map, 5))).remove(0);
        assert_eq!(reduce.stage_name, "reduce");
        let reduce_worker = worker_of(&state, &reduce);
        assert_eq!(reduce_worker, "a", "the reduce runs where its input is");
        let out = state.worker_lost("a", "test");
        // The reduce (running on a) must rerun; its input (map, on a) must be recomputed, and so
        // must the map's own lost input (read), which became needed again.
        let next = assigned(&out);
        assert_eq!(next.len(), 1);
        assert_eq!(
            next[0].stage_name, "read",
            "recomputation starts from the first lost output"
        );
        let map = assigned(&state.task_done("b", done(&next[0], 5))).remove(0);
        let reduce = assigned(&state.task_done("b", done(&map, 5))).remove(0);
        state.task_done("b", done(&reduce, 1));
        assert_eq!(job_state(&state, &id), JobState::Succeeded);
    }

    #[test]
    fn lost_outputs_nobody_needs_are_not_recomputed() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 1);
        let _b = add_worker(&mut state, "b", 1);
        let (id, _) = state.submit(T, chain());
        // `read` ran on a, `map` on b (which consumed read's output); the reduce is pending.
        let number = state.job_ids[&id];
        let job = state.jobs.get_mut(&number).unwrap();
        let output = vec![OutputMeta { rows: 1, bytes: 5 }];
        job.set_status(
            0,
            0,
            TaskStatus::Done {
                worker: "a".into(),
                outputs: output.clone(),
            },
        );
        job.set_status(
            1,
            0,
            TaskStatus::Done {
                worker: "b".into(),
                outputs: output,
            },
        );
        let ready = job.recount_ready(number);
        state.ready.extend(job, ready);
        let out = state.worker_lost("a", "test");
        let job = &state.jobs[&number];
        assert!(
            job.is_done(0, 0),
            "read's lost output is not needed by anyone: not recomputed"
        );
        let started = assigned(&out);
        assert_eq!(started.len(), 1);
        assert_eq!(
            started[0].stage_name, "reduce",
            "the reduce goes on with map's output on b"
        );
    }

    #[test]
    fn a_large_graph_completes_and_spreads_over_every_worker() {
        let mut state = State::new();
        let inboxes: Vec<Inbox> = (0..50)
            .map(|w| add_worker(&mut state, &format!("w{w:02}"), 2))
            .collect();
        let mut spec = map_reduce(10_000);
        spec.stages[1].num_tasks = 10_000;
        spec.stages[1].inputs[0].pattern = Pattern::OneToOne as i32;
        let (id, _) = state.submit(T, spec);
        let mut pending: VecDeque<AssignTask> = assigned(&state.dispatch()).into();
        let mut per_worker: HashMap<String, usize> = HashMap::new();
        while let Some(task) = pending.pop_front() {
            let worker = worker_of(&state, &task);
            *per_worker.entry(worker.clone()).or_default() += 1;
            pending.extend(assigned(&state.task_done(&worker, done(&task, 100))));
        }
        assert_eq!(job_state(&state, &id), JobState::Succeeded);
        assert_eq!(per_worker.values().sum::<usize>(), 20_000);
        assert_eq!(per_worker.len(), 50, "every worker got work");
        let (least, most) = (
            per_worker.values().min().unwrap(),
            per_worker.values().max().unwrap(),
        );
        assert!(
            most - least <= 200,
            "work is spread evenly: {least}..{most} tasks per worker"
        );
        drop(inboxes);
    }

    #[test]
    fn a_task_whose_workers_keep_dying_poisons_its_job() {
        let mut state = State::new();
        let (id, _) = state.submit(T, map_reduce(1));
        for round in 0..POISON_AFTER_LOST_WORKERS {
            let worker = format!("victim-{round}");
            let _inbox = add_worker(&mut state, &worker, 1);
            let started = assigned(&state.dispatch());
            assert_eq!(
                started.len(),
                1,
                "round {round}: the map starts on the new worker"
            );
            state.worker_lost(&worker, "killed");
        }
        assert_eq!(job_state(&state, &id), JobState::Failed);
        let error = state.result(T, &id).unwrap().error;
        assert!(
            error.contains("stage `map` task 0 is poisoned: the 3 workers that ran it died (the last: victim-2)"),
            "{error}"
        );
        let _healthy = add_worker(&mut state, "healthy", 1);
        assert!(
            assigned(&state.dispatch()).is_empty(),
            "a poisoned job runs nothing more"
        );
    }

    #[test]
    fn scaling_advice_follows_the_backlog_and_never_retires_data() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 1);
        let _b = add_worker(&mut state, "b", 1);
        let idle = state.scaling_advice(Duration::from_secs(1));
        assert_eq!((idle.desired_workers, idle.retirable_workers.len()), (0, 2));

        // 40 maps of unknown duration (0.5 s assumed) to finish in 5 s on 1-slot workers: 4.
        let (id, _) = state.submit(T, map_reduce(40));
        let advice = state.scaling_advice(Duration::from_secs(5));
        assert_eq!(advice.backlog_tasks, 41);
        assert_eq!(
            advice.desired_workers, 5,
            "41 tasks x 0.5 s / 5 s = 4.1 -> 5 workers"
        );

        // Measured durations replace the default: maps take 0.1 s.
        let mut pending: VecDeque<AssignTask> = assigned(&state.dispatch()).into();
        let mut finished = 0;
        while let Some(task) = pending.pop_front() {
            if task.stage_name == "reduce" {
                pending.push_back(task);
                break;
            }
            let worker = worker_of(&state, &task);
            let mut report = done(&task, 10);
            report.stats = Some(wrk_proto::TaskStats {
                duration_us: 100_000,
                ..Default::default()
            });
            pending.extend(assigned(&state.task_done(&worker, report)));
            finished += 1;
            if finished == 20 {
                let advice = state.scaling_advice(Duration::from_secs(1));
                // 20 maps x 0.1 s + the reduce (0.5 s assumed) = 2.5 s in 1 s: 3 workers.
                assert_eq!(advice.desired_workers, 3);
                assert!(advice.retirable_workers.is_empty(), "both hold map outputs");
            }
        }
        let reduce = pending.pop_front().expect("the reduce is assigned");
        let worker = worker_of(&state, &reduce);
        state.task_done(&worker, done(&reduce, 1));
        assert_eq!(job_state(&state, &id), JobState::Succeeded);
        let holder = worker.clone();
        let advice = state.scaling_advice(Duration::from_secs(1));
        assert!(
            !advice.retirable_workers.contains(&holder),
            "the result is not fetched yet"
        );
        state.release(T, &id).unwrap();
        let advice = state.scaling_advice(Duration::from_secs(1));
        assert_eq!(
            advice.retirable_workers,
            vec!["a".to_string(), "b".to_string()]
        );
        assert!(
            state.result(T, &id).unwrap().partitions.is_empty(),
            "released results are gone"
        );
    }

    fn released(out: &Outgoing) -> Vec<(u32, u32)> {
        out.iter()
            .filter_map(|(_, m)| match &m.kind {
                Some(ToWorker::ReleaseTasks(r)) => Some(
                    r.tasks
                        .iter()
                        .map(|t| (t.stage, t.index))
                        .collect::<Vec<_>>(),
                ),
                _ => None,
            })
            .flatten()
            .collect()
    }

    #[test]
    fn outputs_are_released_once_nothing_needs_them_and_recomputed_if_needed_again() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 1);
        let (id, _) = state.submit(T, chain());
        let read = assigned(&state.dispatch()).remove(0);
        let out = state.task_done("a", done(&read, 5));
        assert!(
            released(&out).is_empty(),
            "the map still needs read's output"
        );
        let map = assigned(&out).remove(0);
        let out = state.task_done("a", done(&map, 5));
        assert_eq!(
            released(&out),
            vec![(0, 0)],
            "the map consumed read's output"
        );
        let reduce = assigned(&out).remove(0);
        // The worker dies before the reduce finishes: map's output is lost, and the read output
        // it needs was released, so both are recomputed, read first.
        let _b = add_worker(&mut state, "b", 1);
        let out = state.worker_lost("a", "test");
        let next = assigned(&out);
        assert_eq!(next.len(), 1);
        assert_eq!(next[0].stage_name, "read");
        let map = assigned(&state.task_done("b", done(&next[0], 5))).remove(0);
        let out = state.task_done("b", done(&map, 5));
        assert_eq!(released(&out), vec![(0, 0)]);
        let reduce_again = assigned(&out).remove(0);
        assert_eq!(reduce_again.stage_name, reduce.stage_name);
        let out = state.task_done("b", done(&reduce_again, 1));
        assert_eq!(
            released(&out),
            vec![(1, 0)],
            "the reduce consumed the map's output"
        );
        assert_eq!(job_state(&state, &id), JobState::Succeeded);
        assert_eq!(
            state.result(T, &id).unwrap().partitions.len(),
            1,
            "the final output is kept"
        );
    }

    #[test]
    fn a_tenant_sees_and_touches_only_its_own_jobs() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 1);
        let (alice_job, _) = state.submit("alice", map_reduce(1));
        let (bob_job, _) = state.submit("bob", map_reduce(1));
        let unknown = |e: StateError| assert_eq!(e, StateError::UnknownJob(alice_job.clone()));
        unknown(state.watch("bob", &alice_job).map(|_| ()).unwrap_err());
        unknown(state.result("bob", &alice_job).map(|_| ()).unwrap_err());
        unknown(state.cancel("bob", &alice_job).map(|_| ()).unwrap_err());
        unknown(state.release("bob", &alice_job).map(|_| ()).unwrap_err());
        let listed: Vec<String> = state
            .status("bob")
            .jobs
            .into_iter()
            .map(|j| j.job_id)
            .collect();
        assert_eq!(listed, vec![bob_job.clone()]);
        assert_eq!(state.status("bob").workers.len(), 1, "workers are shared");
        assert!(state.result("alice", &alice_job).is_ok());
        assert!(
            state.cancel("alice", &alice_job).is_ok(),
            "alice can cancel her own job"
        );
    }

    #[test]
    fn stale_reports_are_ignored() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 1);
        let (id, _) = state.submit(T, map_reduce(1));
        let task = assigned(&state.dispatch()).remove(0);
        state.task_done("someone-else", done(&task, 1));
        assert_eq!(job_state(&state, &id), JobState::Running);
        let mut old = task.clone();
        old.task.as_mut().unwrap().attempt = 7;
        state.task_done("a", done(&old, 1));
        assert_eq!(state.result(T, &id).unwrap().state(), JobState::Running);
    }

    #[test]
    fn cancel_stops_running_tasks_and_releases_data() {
        let mut state = State::new();
        let mut a = add_worker(&mut state, "a", 2);
        let (id, _) = state.submit(T, map_reduce(3));
        state.dispatch();
        let out = state.cancel(T, &id).unwrap();
        let cancels = out
            .iter()
            .filter(|(_, m)| matches!(m.kind, Some(ToWorker::Cancel(_))))
            .count();
        let releases = out
            .iter()
            .filter(|(_, m)| matches!(m.kind, Some(ToWorker::Release(_))))
            .count();
        assert_eq!(
            (cancels, releases),
            (3, 1),
            "two slots plus queue room: all three maps were assigned"
        );
        assert!(
            assigned(&out).is_empty(),
            "nothing of a cancelled job starts"
        );
        assert_eq!(job_state(&state, &id), JobState::Cancelled);
        drop(a.try_recv());
    }

    /// A state whose clock started a second ago, so that attempts that took milliseconds
    /// began after it.
    fn state_with_history() -> State {
        let mut state = State::new();
        let epoch = Instant::now()
            .checked_sub(Duration::from_secs(1))
            .expect("the machine has been up for a second");
        state.clock = Clock::with_epoch(epoch);
        state
    }

    /// Runs every assigned task (and those they unlock) to completion, each taking
    /// `duration_us` on its worker.
    fn run_all(state: &mut State, mut pending: Vec<AssignTask>, duration_us: u64) {
        while let Some(task) = pending.pop() {
            let worker = worker_of(state, &task);
            let report = TaskDone {
                stats: Some(wrk_proto::TaskStats {
                    duration_us,
                    ..Default::default()
                }),
                ..done(&task, 1000)
            };
            pending.extend(assigned(&state.task_done(&worker, report)));
        }
    }

    #[test]
    fn executions_and_transfers_are_recorded_and_served_by_cursor() {
        let mut state = state_with_history();
        let _a = add_worker(&mut state, "a", 1);
        let _b = add_worker(&mut state, "b", 1);
        let (id, _) = state.submit(T, map_reduce(2));
        state.keep_timeline(T, &id).unwrap();
        let first = assigned(&state.dispatch());
        let map_workers: HashSet<String> = first.iter().map(|t| worker_of(&state, t)).collect();
        assert_eq!(map_workers.len(), 2, "round robin spreads the maps");
        run_all(&mut state, first, 5_000);

        let page = state.executions_view(0, 10);
        assert_eq!((page.items.len(), page.next, page.missed), (3, 3, 0));
        assert!(page.items.iter().all(|e| e.ok && e.job == id));
        let reduce = &page.items[2];
        assert_eq!((reduce.stage.as_str(), reduce.task), ("reduce", 0));
        assert_eq!(reduce.end_us - reduce.start_us, 5_000);
        assert_eq!(
            reduce.fetched_bytes, 1000,
            "the reduce read one map output where it ran and fetched the other"
        );
        let transfers = state.transfers_view(0, 10);
        assert_eq!(transfers.items.len(), 1);
        let t = &transfers.items[0];
        assert_eq!((t.bytes, t.to.as_str()), (1000, reduce.worker.as_str()));
        assert_ne!(t.from, t.to);
        // Increments: nothing new after the cursor, and a page limit is honoured.
        assert!(state.executions_view(page.next, 10).items.is_empty());
        let limited = state.executions_view(1, 1);
        assert_eq!((limited.items[0].seq, limited.next), (1, 2));

        let timeline = state.job_timeline(T, &id).unwrap();
        assert_eq!(timeline.tasks.len(), 3);
        assert_eq!(timeline.transfers.len(), 1);
        assert_eq!(timeline.state(), JobState::Succeeded);
        let names: HashSet<&str> = timeline
            .workers
            .iter()
            .map(|w| w.worker_id.as_str())
            .collect();
        assert_eq!(names, HashSet::from(["a", "b"]));
        assert!(
            timeline
                .tasks
                .iter()
                .all(|t| t.end_us <= timeline.duration_us && t.error.is_empty())
        );
        assert_eq!(
            state.job_timeline("someone-else", &id).unwrap_err(),
            StateError::UnknownJob(id.clone()),
            "another tenant's job is unknown"
        );
        state.release(T, &id).unwrap();
        assert_eq!(
            state.job_timeline(T, &id).unwrap_err(),
            StateError::NoTimeline(id.clone()),
            "releasing a job drops its records"
        );
        assert_eq!(
            state.executions_view(0, 10).items.len(),
            3,
            "the dashboard's ring keeps them"
        );
    }

    #[test]
    fn a_failed_attempt_is_recorded_with_its_error_and_kept_after_the_job_fails() {
        let mut state = state_with_history();
        let _a = add_worker(&mut state, "a", 1);
        let (id, _) = state.submit(T, map_reduce(1));
        state.keep_timeline(T, &id).unwrap();
        let task = assigned(&state.dispatch()).remove(0);
        state.task_failed(
            "a",
            TaskFailed {
                task: task.task.clone(),
                error: "module `m.wasm` trapped: unreachable".into(),
                retriable: false,
                duration_us: 2_000,
            },
        );
        assert_eq!(job_state(&state, &id), JobState::Failed);
        let timeline = state.job_timeline(T, &id).unwrap();
        assert_eq!(timeline.tasks.len(), 1, "a failed job keeps its records");
        let attempt = &timeline.tasks[0];
        assert!(attempt.error.contains("trapped"), "{attempt:?}");
        assert!(timeline.error.contains("trapped"));
        let page = state.executions_view(0, 10);
        let attempt = &page.items[0];
        assert!(!attempt.ok);
        assert_eq!(attempt.end_us - attempt.start_us, 2_000);
    }

    #[test]
    fn only_the_newest_finished_jobs_keep_their_records() {
        let mut state = state_with_history();
        let _a = add_worker(&mut state, "a", 4);
        let mut ids = Vec::new();
        for _ in 0..=RETAINED_JOB_TIMELINES {
            let (id, _) = state.submit(T, map_reduce(1));
            state.keep_timeline(T, &id).unwrap();
            let first = assigned(&state.dispatch());
            run_all(&mut state, first, 10);
            ids.push(id);
        }
        assert_eq!(
            state.job_timeline(T, &ids[0]).unwrap_err(),
            StateError::NoTimeline(ids[0].clone())
        );
        assert_eq!(state.job_timeline(T, &ids[1]).unwrap().tasks.len(), 2);
        let jobs = state.jobs_view();
        assert_eq!(jobs.jobs[0].id, ids[RETAINED_JOB_TIMELINES], "newest first");
        assert!(
            jobs.jobs.len() <= 20,
            "only recent finished jobs are listed"
        );
    }

    #[test]
    fn heartbeats_sample_worker_memory_for_the_timeline() {
        let mut state = state_with_history();
        let _a = add_worker(&mut state, "a", 1);
        let (id, _) = state.submit(T, map_reduce(1));
        state.keep_timeline(T, &id).unwrap();
        state.heartbeat(
            "a",
            &wrk_proto::Heartbeat {
                pool_used_bytes: 4096,
                ..Default::default()
            },
        );
        let first = assigned(&state.dispatch());
        run_all(&mut state, first, 10);
        let timeline = state.job_timeline(T, &id).unwrap();
        assert_eq!(timeline.memory.len(), 1);
        assert_eq!(timeline.memory[0].used_bytes, 4096);
        let workers = state.workers_view();
        assert_eq!(workers.workers[0].pool_used_bytes, 4096);
    }

    #[test]
    fn a_gpu_worker_shows_its_device_and_latest_telemetry() {
        let mut state = State::new();
        let (tx, _rx) = mpsc::unbounded_channel();
        state
            .register_worker(
                &Register {
                    worker_id: "g".into(),
                    data_address: "http://g".into(),
                    slots: 1,
                    device: "gpu:0".into(),
                    gpu: Some(wrk_proto::GpuInfo {
                        name: "NVIDIA A100-SXM4-40GB MIG 1g.5gb".into(),
                        mig_profile: "1g.5gb".into(),
                        memory_total_bytes: 5 << 30,
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                tx,
            )
            .unwrap();
        let _cpu = add_worker(&mut state, "c", 1);
        let beat = |sm| wrk_proto::Heartbeat {
            gpu: Some(wrk_proto::GpuTelemetry {
                memory_used_bytes: 1 << 30,
                memory_total_bytes: 5 << 30,
                sm_utilization: sm,
                ..Default::default()
            }),
            ..Default::default()
        };
        state.heartbeat("g", &beat(Some(0.25)));
        // A heartbeat without telemetry keeps the last sample.
        state.heartbeat("g", &wrk_proto::Heartbeat::default());
        let status = state.status(T);
        let gpu = &status.workers[1];
        assert_eq!(gpu.device, "gpu:0");
        assert_eq!(gpu.gpu.as_ref().unwrap().mig_profile, "1g.5gb");
        assert_eq!(gpu.gpu_telemetry.unwrap().sm_utilization, Some(0.25));
        assert!(status.workers[0].gpu.is_none());
        let view = state.workers_view();
        let json = serde_json::to_value(&view.workers).unwrap();
        assert_eq!(json[1]["gpu"]["mig_profile"], "1g.5gb");
        assert_eq!(json[1]["gpu"]["sm_utilization"], 0.25);
        assert!(json[0].get("gpu").is_none(), "{json}");
    }

    #[test]
    fn only_jobs_that_asked_keep_a_timeline_but_the_dashboard_sees_all() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 1);
        let (id, _) = state.submit(T, map_reduce(1));
        let first = assigned(&state.dispatch());
        run_all(&mut state, first, 10);
        assert_eq!(
            state.job_timeline(T, &id).unwrap_err(),
            StateError::NoTimeline(id.clone())
        );
        assert!(state.jobs[&state.job_ids[&id]].records.is_none());
        assert_eq!(state.executions_view(0, 10).items.len(), 2);
    }

    #[test]
    fn queue_depth_is_exported_per_tenant_and_stage() {
        let mut state = state_with_history();
        let _a = add_worker(&mut state, "a", 1);
        state.submit(T, map_reduce(5));
        state.submit("other", map_reduce(2));
        state.dispatch();
        let text = state.render_metrics();
        // One slot plus one queued, shared fairly: a map of each tenant is assigned.
        for line in [
            r#"wrk_scheduler_queued_tasks{stage="map",tenant="tenant"} 4"#,
            r#"wrk_scheduler_queued_tasks{stage="reduce",tenant="tenant"} 1"#,
            r#"wrk_scheduler_queued_tasks{stage="map",tenant="other"} 1"#,
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }
}

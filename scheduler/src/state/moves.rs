//! Moving a finished task's outputs from one worker to another, peer to peer: the receiving
//! worker fetches them from the holder (as it would a task's input) and keeps them under the
//! same keys; once it says so, the scheduler points the task at it and tells the old holder to
//! drop them. Rebalancing a dataset and retiring a worker both move data this way.

use std::collections::{HashMap, HashSet};

use wrk_proto::scheduler_message::Kind as ToWorker;
use wrk_proto::{FetchPartitions, PartitionsFetched, ReleaseTasks};

use super::{Outgoing, State, TaskRef, TaskStatus, WorkerOutbox, message};

/// A move under way.
#[derive(Debug, Clone)]
struct Move {
    from: String,
    to: String,
}

#[derive(Default)]
pub(super) struct Moves {
    pending: HashMap<TaskRef, Move>,
    /// Workers being retired ([`State::retire_worker`]).
    pub(super) retiring: HashSet<String>,
    /// Retired workers told to exit.
    pub(super) told_to_exit: HashSet<String>,
}

impl Moves {
    pub(super) fn is_moving(&self, task: TaskRef) -> bool {
        self.pending.contains_key(&task)
    }

    /// Moves under way of job `number`'s outputs.
    pub(super) fn moving_of(&self, number: u64) -> u32 {
        self.pending.keys().filter(|t| t.job == number).count() as u32
    }

    /// Moves under way away from `worker`.
    pub(super) fn moving_from(&self, worker: &str) -> usize {
        self.pending.values().filter(|m| m.from == worker).count()
    }
}

/// Tells `outbox` to drop the outputs of `task` of job `job_id`.
fn drop_outputs(outbox: WorkerOutbox, job_id: &str, task: TaskRef) -> Outgoing {
    vec![(
        outbox,
        message(ToWorker::ReleaseTasks(ReleaseTasks {
            job_id: job_id.to_string(),
            tasks: vec![wrk_proto::TaskRef {
                stage: task.stage,
                index: task.index,
            }],
        })),
    )]
}

impl State {
    /// Starts moving the outputs of finished task `task` to worker `to`; `None` when there is
    /// nothing to move (the task is not finished, already there or already moving, or `to` is
    /// gone).
    pub(super) fn start_move(
        &mut self,
        task: TaskRef,
        to: &str,
    ) -> Option<(WorkerOutbox, wrk_proto::SchedulerMessage)> {
        if self.moves.is_moving(task) {
            return None;
        }
        let job = self.jobs.get(&task.job).filter(|j| !j.released)?;
        let entry = job
            .tasks
            .get(task.stage as usize)?
            .get(task.index as usize)?;
        let TaskStatus::Done { worker, outputs } = &entry.status else {
            return None;
        };
        if worker == to || entry.outputs_released {
            return None;
        }
        let target = self.workers.get(to)?;
        let partitions = outputs
            .iter()
            .enumerate()
            .map(|(o, meta)| {
                self.location(&job.id, (task.stage, task.index, o as u32), worker, meta)
            })
            .collect();
        let fetch = FetchPartitions {
            job_id: job.id.clone(),
            stage: task.stage,
            task: task.index,
            partitions,
        };
        tracing::debug!(job = %job.id, stage = task.stage, task = task.index, from = %worker, %to, "moving partitions");
        self.moves.pending.insert(
            task,
            Move {
                from: worker.clone(),
                to: to.to_string(),
            },
        );
        Some((target.outbox.clone(), message(ToWorker::Fetch(fetch))))
    }

    /// Worker `worker_id` fetched (or failed to fetch) the partitions of a move: the task now
    /// points at it and the old holder drops them. A copy nobody needs any more (the job was
    /// released meanwhile, the outputs were dropped or recomputed) is dropped instead.
    pub fn partitions_fetched(&mut self, worker_id: &str, fetched: PartitionsFetched) -> Outgoing {
        let Some(&number) = self.job_ids.get(&fetched.job_id) else {
            return Vec::new();
        };
        let task = TaskRef {
            job: number,
            stage: fetched.stage,
            index: fetched.task,
        };
        let Some(outbox) = self.workers.get(worker_id).map(|w| w.outbox.clone()) else {
            return Vec::new();
        };
        let current = self
            .moves
            .pending
            .get(&task)
            .is_some_and(|m| m.to == worker_id);
        let planned = if current {
            self.moves.pending.remove(&task)
        } else {
            None
        };
        if !fetched.error.is_empty() {
            tracing::warn!(job = %fetched.job_id, stage = task.stage, task = task.index, worker = %worker_id, "moving partitions failed: {}", fetched.error);
            return Vec::new();
        }
        let Some(planned) = planned else {
            // Not the move under way: the copy is not one the scheduler points at.
            return drop_outputs(outbox, &fetched.job_id, task);
        };
        let Some(job) = self.jobs.get_mut(&number).filter(|j| !j.released) else {
            return drop_outputs(outbox, &fetched.job_id, task);
        };
        let entry = job
            .tasks
            .get_mut(task.stage as usize)
            .and_then(|t| t.get_mut(task.index as usize));
        match entry {
            Some(entry) if !entry.outputs_released => match &mut entry.status {
                TaskStatus::Done { worker, .. } if *worker == planned.from => {
                    *worker = worker_id.to_string();
                    tracing::debug!(job = %fetched.job_id, stage = task.stage, task = task.index, from = %planned.from, to = %worker_id, "moved partitions");
                    match self.workers.get(&planned.from) {
                        Some(old) => drop_outputs(old.outbox.clone(), &fetched.job_id, task),
                        None => Vec::new(),
                    }
                }
                _ => drop_outputs(outbox, &fetched.job_id, task),
            },
            _ => drop_outputs(outbox, &fetched.job_id, task),
        }
    }

    /// A worker was lost: moves to or from it are dropped (what it held is recomputed, what it
    /// fetched is gone), and retirements waiting on them go on.
    pub(super) fn moves_after_loss(&mut self, worker_id: &str) -> Outgoing {
        self.moves
            .pending
            .retain(|_, m| m.from != worker_id && m.to != worker_id);
        self.moves.retiring.remove(worker_id);
        self.moves.told_to_exit.remove(worker_id);
        self.retirements()
    }
}

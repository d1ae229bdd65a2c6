//! Graceful retirement of a worker: it gets no new task, every output it holds that is still
//! needed (intermediates of running jobs, results not fetched yet, dataset partitions) moves to
//! the other workers peer to peer ([`super::moves`]), its running and queued tasks finish, and
//! then it is told to exit. Shuffle pieces it received for reducers are not moved: when it has
//! left, the exchange's recovery sends them again to another worker, as after a loss.

use wrk_proto::scheduler_message::Kind as ToWorker;
use wrk_proto::{RetireResponse, Shutdown};

use super::{Outgoing, State, StateError, TaskRef, TaskStatus, message};

impl State {
    /// Starts retiring `worker_id`. Refused when no other worker would take its data and tasks.
    pub fn retire_worker(
        &mut self,
        worker_id: &str,
    ) -> Result<(Outgoing, RetireResponse), StateError> {
        if !self.workers.contains_key(worker_id) {
            return Err(StateError::UnknownWorker(worker_id.to_string()));
        }
        if !self
            .workers
            .iter()
            .any(|(id, w)| id != worker_id && !w.retiring)
        {
            return Err(StateError::NoOtherWorker(worker_id.to_string()));
        }
        if let Some(worker) = self.workers.get_mut(worker_id) {
            worker.retiring = true;
        }
        if self.moves.retiring.insert(worker_id.to_string()) {
            tracing::info!(worker = %worker_id, "retiring worker: moving its data away");
        }
        let mut out = self.retirement(worker_id);
        let response = RetireResponse {
            moves: self.moves.moving_from(worker_id) as u32,
            running_tasks: self
                .workers
                .get(worker_id)
                .map_or(0, |w| w.running.len() as u32),
        };
        // The tasks it would have run go elsewhere.
        out.extend(self.dispatch());
        Ok((out, response))
    }

    /// Tells `worker_id` to exit without retiring it (its request to retire was refused for
    /// `reason`); what it holds is recomputed when it has gone, as after a loss.
    pub fn exit_now(&mut self, worker_id: &str, reason: &str) -> Outgoing {
        self.workers
            .get(worker_id)
            .map(|w| {
                (
                    w.outbox.clone(),
                    message(ToWorker::Shutdown(Shutdown {
                        retired: false,
                        reason: reason.to_string(),
                    })),
                )
            })
            .into_iter()
            .collect()
    }

    /// Moves on every retirement under way (call after any event that may have changed what a
    /// retiring worker holds or runs).
    pub fn retirements(&mut self) -> Outgoing {
        if self.moves.retiring.is_empty() {
            return Vec::new();
        }
        let retiring: Vec<String> = self.moves.retiring.iter().cloned().collect();
        retiring.iter().flat_map(|id| self.retirement(id)).collect()
    }

    /// Moves what `worker_id` holds that is still needed and not moving yet; tells it to exit
    /// once it holds and runs nothing.
    fn retirement(&mut self, worker_id: &str) -> Outgoing {
        let mut out = Vec::new();
        let Some(worker) = self.workers.get(worker_id) else {
            return out;
        };
        if !worker.retiring || self.moves.told_to_exit.contains(worker_id) {
            return out;
        }
        let running = worker.running.len();
        let mut held: Vec<(TaskRef, u64)> = Vec::new();
        let mut empty: Vec<TaskRef> = Vec::new();
        for (&number, job) in &self.jobs {
            if job.released {
                continue;
            }
            for (stage, index, entry) in job.indexed_tasks() {
                let TaskStatus::Done { worker, outputs } = &entry.status else {
                    continue;
                };
                let task = TaskRef {
                    job: number,
                    stage,
                    index,
                };
                if worker != worker_id || entry.outputs_released || self.moves.is_moving(task) {
                    continue;
                }
                if outputs.is_empty() {
                    empty.push(task);
                } else {
                    held.push((task, outputs.iter().map(|o| o.bytes).sum()));
                }
            }
        }
        // Largest first, each to the worker with the least in its pool and on its way there.
        held.sort_by_key(|h| std::cmp::Reverse(h.1));
        let mut targets: Vec<(String, u64)> = self
            .workers
            .iter()
            .filter(|(_, w)| !w.retiring)
            .map(|(id, w)| (id.clone(), w.pool_used_bytes))
            .collect();
        targets.sort();
        if targets.is_empty() {
            if !held.is_empty() || !empty.is_empty() {
                tracing::warn!(worker = %worker_id, "retiring worker waits: no other worker to take its data");
            }
            return out;
        }
        for task in empty {
            // Nothing to copy: the task just points elsewhere.
            let to = targets[0].0.clone();
            if let Some(TaskStatus::Done { worker, .. }) = self
                .jobs
                .get_mut(&task.job)
                .and_then(|j| j.tasks.get_mut(task.stage as usize))
                .and_then(|t| t.get_mut(task.index as usize))
                .map(|e| &mut e.status)
            {
                *worker = to;
            }
        }
        for (task, bytes) in held {
            let Some(target) = targets
                .iter_mut()
                .min_by_key(|(id, load)| (*load, id.clone()))
            else {
                break;
            };
            target.1 += bytes;
            let to = target.0.clone();
            out.extend(self.start_move(task, &to));
        }
        if running == 0 && self.moves.moving_from(worker_id) == 0 && out.is_empty() {
            if let Some(worker) = self.workers.get(worker_id) {
                tracing::info!(worker = %worker_id, "worker retired: its data moved and its tasks finished; telling it to exit");
                out.push((
                    worker.outbox.clone(),
                    message(ToWorker::Shutdown(Shutdown {
                        retired: true,
                        reason: "retired".into(),
                    })),
                ));
            }
            self.moves.told_to_exit.insert(worker_id.to_string());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{T, add_worker, assigned, one_stage, worker_of};
    use super::*;
    use wrk_proto::{OutputMeta, PartitionsFetched, TaskDone};

    fn shutdowns(out: &Outgoing) -> usize {
        out.iter()
            .filter(|(_, m)| matches!(m.kind, Some(ToWorker::Shutdown(_))))
            .count()
    }

    #[test]
    fn retiring_moves_unfetched_results_waits_for_tasks_then_lets_the_worker_go() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 1);
        assert_eq!(
            state.retire_worker("a").map(|_| ()),
            Err(StateError::NoOtherWorker("a".into())),
            "the only worker cannot go"
        );
        assert_eq!(
            state.retire_worker("nobody").map(|_| ()),
            Err(StateError::UnknownWorker("nobody".into()))
        );
        let (id, _) = state.submit(T, one_stage(2));
        let started = assigned(&state.dispatch());
        assert_eq!(started.len(), 2, "a holds a running and a queued task");
        let done = |task: &wrk_proto::AssignTask| TaskDone {
            task: task.task.clone(),
            outputs: vec![OutputMeta { rows: 1, bytes: 7 }],
            stats: None,
        };
        state.task_done("a", done(&started[0]));

        let _b = add_worker(&mut state, "b", 1);
        let (out, response) = state.retire_worker("a").unwrap();
        assert_eq!((response.moves, response.running_tasks), (1, 1));
        assert_eq!(shutdowns(&out), 0);
        assert!(
            !state
                .scaling_advice(std::time::Duration::from_secs(1))
                .retirable_workers
                .contains(&"a".to_string()),
            "a still holds data and runs a task"
        );
        let fetched = |task: &wrk_proto::AssignTask| PartitionsFetched {
            job_id: id.clone(),
            stage: 0,
            task: task.task.as_ref().unwrap().index,
            error: String::new(),
        };
        let out = state.partitions_fetched("b", fetched(&started[0]));
        assert_eq!(shutdowns(&out), 0, "its second task still runs");
        assert_eq!(worker_of(&state, &started[1]), "a");

        // Its last task's output moves too; then it may go.
        state.task_done("a", done(&started[1]));
        let out = state.retirements();
        assert_eq!(out.len(), 1, "a fetch by b");
        assert_eq!(shutdowns(&out), 0);
        let out = state.partitions_fetched("b", fetched(&started[1]));
        let out: Outgoing = out.into_iter().chain(state.retirements()).collect();
        assert_eq!(shutdowns(&out), 1, "a is told to exit");
        let result = state.result(T, &id).unwrap();
        assert!(result.partitions.iter().all(|p| p.worker_id == "b"));
        assert_eq!(
            state
                .scaling_advice(std::time::Duration::from_secs(1))
                .retirable_workers,
            vec!["a".to_string()]
        );
        state.worker_lost("a", crate::state::WORKER_LEFT);
        assert!(state.retirements().is_empty());
    }
}

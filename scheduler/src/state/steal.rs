//! Work stealing: tasks queued on a busy worker move to a worker with an idle slot.
//!
//! A worker holds a few queued tasks per slot beyond those it runs (more while its tasks are
//! short, see `Worker::capacity`), so a freed slot starts its next task without a round trip.
//! Placement already prefers a slot free to run in over a queue (see [`State::dispatch`]); but
//! work finishes unevenly, and a worker can sit idle while another still has tasks queued that
//! it has not started. Then the scheduler steals, the way Dask's work stealing does, with a
//! confirmation rather than a blind cancel:
//!
//! 1. When a worker has a slot free to run in and no ready task it can take, the scheduler asks
//!    an overloaded worker (one with more tasks assigned than slots) to give back its most
//!    recently assigned task (the one it would start last) with `Retract`, if the idle worker
//!    has the task's tags and room for its working set, the task is not pinned to its worker
//!    (a shuffle reducer's partition is received there), and moving the inputs the busy worker
//!    holds for it should take less time than the tasks queued ahead of it there.
//! 2. The busy worker answers `Retracted`: `dropped` when the task had not started, and never
//!    will there; otherwise it keeps running it and reports it as usual. A task therefore runs
//!    at most once per attempt, never twice, and the race between starting and giving back is
//!    decided on the worker alone.
//! 3. A dropped task starts at once on the idle worker if it still has the slot (else it goes
//!    first in the ready queue). The dropped attempt does not count as a try.
//!
//! Each idle slot has at most one steal on its way (`expecting`) and each queued task at most
//! one request (`retracting`), so steals never outnumber idle slots. Looking for a steal costs
//! nothing while no worker is overloaded or none has an idle slot.

use wrk_proto::scheduler_message::Kind as ToWorker;
use wrk_proto::{Retract, Retracted, TaskId};

use super::{
    Assignments, Outgoing, State, TaskRef, TaskStatus, expected_bytes, message, sync_usage,
};

impl State {
    /// Asks overloaded workers to give back queued tasks for the workers with an idle slot.
    pub(super) fn steal(&mut self) -> Outgoing {
        let mut out = Vec::new();
        if self.overloaded.is_empty() || !self.has_open_worker() {
            return out;
        }
        let thieves: Vec<String> = self.open.iter().cloned().collect();
        for thief in thieves {
            while self.workers.get(&thief).is_some_and(|w| {
                !w.retiring && w.slots as usize > w.running.len() + w.expecting as usize
            }) {
                let Some((victim, key, attempt)) = self.steal_for(&thief) else {
                    break;
                };
                let (job, stage, index) = key;
                let job_id = self.jobs[&job].id.clone();
                if let Some(t) = self.workers.get_mut(&thief) {
                    t.expecting += 1;
                }
                let Some(v) = self.workers.get_mut(&victim) else {
                    continue;
                };
                v.retracting.insert(key, thief.clone());
                tracing::debug!(from = %victim, to = %thief, job = %job_id, stage, index, "stealing a queued task");
                out.push((
                    v.outbox.clone(),
                    message(ToWorker::Retract(Retract {
                        task: Some(TaskId {
                            job_id,
                            stage,
                            index,
                            attempt,
                        }),
                    })),
                ));
            }
        }
        out
    }

    /// Whether some worker has a slot free to run in, dropping stale entries (full or gone)
    /// from the open queue's front.
    fn has_open_worker(&mut self) -> bool {
        while let Some(id) = self.open.front() {
            match self.workers.get_mut(id) {
                Some(w) if w.has_open_slot() => return true,
                Some(w) => w.open_queued = false,
                None => {}
            }
            self.open.pop_front();
        }
        false
    }

    /// A queued task `thief` could take from an overloaded worker: the worker, the task and
    /// its attempt. Workers no longer overloaded leave the overloaded queue.
    #[allow(clippy::type_complexity)]
    fn steal_for(&mut self, thief: &str) -> Option<(String, (u64, u32, u32), u32)> {
        let workers = &mut self.workers;
        self.overloaded.retain(|id| match workers.get_mut(id) {
            Some(w) if w.stealable() > 0 => true,
            Some(w) => {
                w.overload_queued = false;
                false
            }
            None => false,
        });
        let thief = self.workers.get(thief)?;
        for id in &self.overloaded {
            let victim = self.workers.get(id)?;
            // The newest assignments are the ones the worker has not started (it starts them
            // in order), except those it said it had.
            let mut assigned: Vec<(&(u64, u32, u32), &(u64, u64))> = victim
                .running
                .iter()
                .filter(|(key, _)| !victim.retracting.contains_key(key))
                .collect();
            assigned.sort_unstable_by_key(|(_, (_, order))| std::cmp::Reverse(*order));
            let found = assigned
                .into_iter()
                .take(victim.stealable())
                .filter(|(_, (_, order))| *order > victim.started_through)
                .find_map(|(&key, &(bytes, order))| {
                    let (number, stage, index) = key;
                    let job = self.jobs.get(&number)?;
                    let requires = &job.spec.stages[stage as usize].requires;
                    let entry = job.tasks.get(stage as usize)?.get(index as usize)?;
                    let movable = thief.has_tags(requires)
                        && thief.fits(bytes)
                        && job.pinned_worker(stage, index).is_none();
                    // Not when moving its inputs takes longer than waiting for the tasks
                    // ahead of it where they are.
                    let task = TaskRef {
                        job: number,
                        stage,
                        index,
                    };
                    let held = self
                        .input_bytes_by_worker(job, task)
                        .get(id.as_str())
                        .copied()
                        .unwrap_or(0);
                    let transfer = self.transfer_rate.seconds(held);
                    let worth_moving = held == 0
                        || self
                            .wait_seconds(victim, Some(order), 0.0, transfer)
                            .is_none_or(|wait| wait > transfer);
                    (movable && worth_moving).then_some((key, entry.attempts))
                });
            if let Some((key, attempt)) = found {
                return Some((id.clone(), key, attempt));
            }
        }
        None
    }

    /// A worker answers a [`Retract`]: a dropped task goes to the idle worker that asked for it
    /// (or first in the ready queue); a started one stays where it runs.
    pub fn retracted(&mut self, worker_id: &str, retracted: Retracted) -> Outgoing {
        let Some(id) = retracted.task else {
            return Vec::new();
        };
        let Some(&number) = self.job_ids.get(&id.job_id) else {
            return Vec::new();
        };
        let key = (number, id.stage, id.index);
        let Some(thief) = self
            .workers
            .get_mut(worker_id)
            .and_then(|w| w.retracting.remove(&key))
        else {
            return Vec::new();
        };
        if let Some(t) = self.workers.get_mut(&thief) {
            t.expecting = t.expecting.saturating_sub(1);
        }
        if !retracted.dropped {
            // It had started, and so had every task assigned there before it: they stay, and
            // the idle worker may steal something else.
            if let Some(w) = self.workers.get_mut(worker_id) {
                if let Some(&(_, order)) = w.running.get(&key) {
                    w.started_through = w.started_through.max(order);
                }
                if w.stealable() > 0 && !w.overload_queued {
                    w.overload_queued = true;
                    self.overloaded.push_back(worker_id.to_string());
                }
            }
            return self.dispatch();
        }
        let current = self.current(worker_id, &id);
        self.release_slot(worker_id, key);
        let Some(task) = current else {
            return self.dispatch();
        };
        let Some(job) = self.jobs.get_mut(&number) else {
            return self.dispatch();
        };
        job.set_status(task.stage, task.index, TaskStatus::Ready);
        job.tasks[task.stage as usize][task.index as usize].stolen += 1;
        sync_usage(&mut self.ready, job);
        let expected = expected_bytes(job, task);
        let requires = &job.spec.stages[task.stage as usize].requires;
        let mut out = Vec::new();
        if self
            .workers
            .get(&thief)
            .is_some_and(|w| w.has_open_slot() && w.fits(expected) && w.has_tags(requires))
        {
            let mut assigned = Assignments::default();
            self.start(task, &thief, expected, &mut assigned);
            assigned.flush_into(&mut out);
            self.requeue_if_free(&thief);
        } else {
            self.ready.push_first(job, task);
        }
        out.extend(self.dispatch());
        out
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, VecDeque};

    use super::super::tests::{T, add_worker, assigned, job_state, worker_of};
    use super::super::*;
    use wrk_proto::{Retracted, Stage, StageInput};

    /// A worker as the real one behaves: it starts assigned tasks in order, one per slot, and
    /// gives back a task asked for only if it has not started it.
    struct SimWorker {
        slots: usize,
        queued: VecDeque<TaskId>,
        running: VecDeque<TaskId>,
        ran: u32,
    }

    /// Runs every message to its worker until nothing is left to do: each round, every worker
    /// starts what its slots allow and finishes its oldest running task. Returns the tasks
    /// each worker ran, and the retracts answered (dropped, kept).
    fn simulate(
        state: &mut State,
        workers: &mut [(&str, SimWorker)],
        mut out: Outgoing,
    ) -> (HashMap<String, u32>, (u32, u32)) {
        let mut answered = (0, 0);
        loop {
            let mut replies = Vec::new();
            for (outbox, message) in out.drain(..) {
                let (id, sim) = workers
                    .iter_mut()
                    .find(|(id, _)| state.workers[*id].outbox.same_channel(&outbox))
                    .expect("a message to a known worker");
                match message.kind {
                    Some(ToWorker::Assign(assign)) => sim
                        .queued
                        .extend(assign.tasks.into_iter().map(|t| t.task.unwrap())),
                    Some(ToWorker::Retract(retract)) => {
                        let task = retract.task.unwrap();
                        let before = sim.queued.len();
                        sim.queued.retain(|t| *t != task);
                        let dropped = sim.queued.len() < before;
                        if dropped {
                            answered.0 += 1;
                        } else {
                            answered.1 += 1;
                        }
                        replies.push((
                            id.to_string(),
                            Retracted {
                                task: Some(task),
                                dropped,
                            },
                        ));
                    }
                    _ => {}
                }
            }
            for (id, reply) in replies {
                out.extend(state.retracted(&id, reply));
            }
            if !out.is_empty() {
                continue;
            }
            let mut finished = Vec::new();
            for (id, sim) in workers.iter_mut() {
                while sim.running.len() < sim.slots
                    && let Some(task) = sim.queued.pop_front()
                {
                    sim.running.push_back(task);
                }
                if let Some(task) = sim.running.pop_front() {
                    sim.ran += 1;
                    finished.push((id.to_string(), task));
                }
            }
            if finished.is_empty() {
                break;
            }
            for (id, task) in finished {
                out.extend(state.task_done(
                    &id,
                    TaskDone {
                        task: Some(task),
                        outputs: vec![OutputMeta { rows: 1, bytes: 1 }],
                        stats: None,
                    },
                ));
            }
        }
        let ran = workers
            .iter()
            .map(|(id, sim)| (id.to_string(), sim.ran))
            .collect();
        (ran, answered)
    }

    fn sim(slots: usize) -> SimWorker {
        SimWorker {
            slots,
            queued: VecDeque::new(),
            running: VecDeque::new(),
            ran: 0,
        }
    }

    /// `first` (n tasks) -> `second` (one-to-one over `first`).
    fn two_stages(n: u32) -> JobSpec {
        let stage = |name: &str, inputs| Stage {
            name: name.into(),
            module_hash: "h".into(),
            num_tasks: n,
            inputs,
            ..Default::default()
        };
        JobSpec {
            name: "skewed".into(),
            stages: vec![
                stage("first", vec![]),
                stage(
                    "second",
                    vec![StageInput {
                        stage: 0,
                        pattern: Pattern::OneToOne as i32,
                        ..Default::default()
                    }],
                ),
            ],
            ..Default::default()
        }
    }

    #[test]
    fn a_skewed_job_that_locality_would_pile_on_one_worker_uses_every_worker() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 4);
        // Only `a` is there when the job starts: it takes all eight first tasks (four running,
        // four queued), and every second task would follow its input there.
        let (id, _) = state.submit(T, two_stages(8));
        let out = state.dispatch();
        assert_eq!(out.len(), 1, "one message for the worker");
        assert_eq!(assigned(&out).len(), 8);
        let _b = add_worker(&mut state, "b", 2);
        let _c = add_worker(&mut state, "c", 2);
        let mut out = out;
        out.extend(state.dispatch());
        let mut workers = [("a", sim(4)), ("b", sim(2)), ("c", sim(2))];
        let (ran, (dropped, _kept)) = simulate(&mut state, &mut workers, out);
        assert_eq!(job_state(&state, &id), JobState::Succeeded);
        assert_eq!(ran.values().sum::<u32>(), 16, "{ran:?}");
        assert!(
            dropped >= 4,
            "the queued first tasks were stolen: {dropped}"
        );
        for worker in ["b", "c"] {
            assert!(ran[worker] >= 2, "{worker} idled: {ran:?}");
        }
        assert!(ran["a"] < 16 - 4, "{ran:?}");
    }

    #[test]
    fn a_task_that_started_before_the_retract_arrived_stays_where_it_runs() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 1);
        let (id, _) = state.submit(T, two_stages(2));
        let first = assigned(&state.dispatch());
        assert_eq!(first.len(), 2, "one running on a, one queued there");
        let _b = add_worker(&mut state, "b", 1);
        let out = state.dispatch();
        let retract = out
            .iter()
            .find_map(|(_, m)| match &m.kind {
                Some(ToWorker::Retract(r)) => r.task.clone(),
                _ => None,
            })
            .expect("b steals the queued task");
        assert_eq!(retract, *first[1].task.as_ref().unwrap(), "the newest one");
        // A second dispatch asks for nothing more: b already expects one.
        assert!(state.dispatch().is_empty());
        // `a` had started it (it finished the first meanwhile): it keeps it.
        let kept = state.retracted(
            "a",
            Retracted {
                task: Some(retract.clone()),
                dropped: false,
            },
        );
        assert!(
            kept.is_empty(),
            "nothing else there is known not to have started"
        );
        assert_eq!(worker_of(&state, &first[1]), "a");
        // Its report counts as usual.
        for task in &first {
            state.task_done(
                "a",
                TaskDone {
                    task: task.task.clone(),
                    outputs: vec![OutputMeta { rows: 1, bytes: 1 }],
                    stats: None,
                },
            );
        }
        assert_eq!(state.jobs[&state.job_ids[&id]].done[0], 2);
        // A stale answer (nothing asked) changes nothing.
        assert!(
            state
                .retracted(
                    "a",
                    Retracted {
                        task: Some(retract),
                        dropped: true,
                    },
                )
                .is_empty()
        );
    }

    #[test]
    fn a_dropped_task_runs_on_the_thief_and_does_not_use_up_a_try() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 1);
        state.submit(T, two_stages(2));
        let first = assigned(&state.dispatch());
        let _b = add_worker(&mut state, "b", 1);
        let out = state.dispatch();
        assert_eq!(out.len(), 1);
        let stolen = first[1].task.clone().unwrap();
        let moved = assigned(&state.retracted(
            "a",
            Retracted {
                task: Some(stolen.clone()),
                dropped: true,
            },
        ));
        assert_eq!(moved.len(), 1);
        assert_eq!(worker_of(&state, &moved[0]), "b");
        let attempt = moved[0].task.as_ref().unwrap().attempt;
        assert_eq!(attempt, stolen.attempt + 1, "a new attempt number");
        let entry = &state.jobs[&1].tasks[0][1];
        assert_eq!(entry.attempts - entry.stolen, 1);
        assert!(!state.workers["a"].running.contains_key(&(1, 0, 1)));
    }
}

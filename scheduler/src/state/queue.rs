//! The ready queue: which ready task is handed out next.
//!
//! - **Tenants share by weight.** Under contention the next task goes to the tenant with the
//!   lowest `(running + 1) / weight` among those with a task that may start (weighted fair
//!   queueing over tenants, with running tasks as the measure of service), so each tenant's
//!   running share tracks its weight, whatever the number or order of its jobs.
//! - **Priorities order a tenant's own jobs.** Within a tenant, tasks of higher-priority jobs
//!   go first; within a priority, tasks keep the order they became ready in (FIFO). A priority
//!   never takes another tenant's share: any tenant could otherwise claim the whole cluster.
//! - **Quotas hold a tenant back.** At `max_tasks` running (or queued on workers) none of its
//!   tasks start. At or past `max_pool_bytes` of held partitions only its tasks consuming earlier
//!   stages' outputs start: source tasks would only add data, while consumers are what lets the
//!   scheduler release the partitions they read (holding them back too could never end).
//!
//! Choosing costs O(tenants with queued tasks + priorities in use), not O(tasks): each
//! priority level keeps producers (tasks reading no stage's outputs) and consumers in two FIFO
//! queues merged by arrival number.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, VecDeque};

use super::{Job, TaskRef};
use crate::tenants::TenantPolicy;

/// A queued task and its arrival number.
#[derive(Debug, Clone, Copy)]
pub(super) struct Queued {
    pub(super) task: TaskRef,
    seq: u64,
}

#[derive(Default)]
struct Level {
    /// Tasks that read no earlier stage's outputs.
    producers: VecDeque<Queued>,
    /// Tasks that read earlier stages' outputs.
    consumers: VecDeque<Queued>,
}

impl Level {
    fn is_empty(&self) -> bool {
        self.producers.is_empty() && self.consumers.is_empty()
    }

    /// The queue the oldest task allowed to start is in (consumers only, when `consumers_only`).
    fn next(&mut self, consumers_only: bool) -> Option<&mut VecDeque<Queued>> {
        let producer = self.producers.front().map(|q| q.seq);
        let consumer = self.consumers.front().map(|q| q.seq);
        match (producer, consumer) {
            (Some(p), Some(c)) if p < c && !consumers_only => Some(&mut self.producers),
            (_, Some(_)) => Some(&mut self.consumers),
            (Some(_), None) if !consumers_only => Some(&mut self.producers),
            _ => None,
        }
    }
}

/// One tenant's queued tasks and use of the cluster.
struct TenantQueue {
    policy: TenantPolicy,
    levels: BTreeMap<Reverse<i32>, Level>,
    queued: usize,
    /// Tasks of the tenant running or queued on workers.
    running: u32,
    /// Bytes of the tenant's finished outputs the workers hold for it.
    held_bytes: u64,
}

impl TenantQueue {
    fn at_max_tasks(&self) -> bool {
        self.policy.max_tasks.is_some_and(|max| self.running >= max)
    }

    fn over_pool(&self) -> bool {
        self.policy
            .max_pool_bytes
            .is_some_and(|max| self.held_bytes >= max)
    }

    /// Its next task allowed to start: level, and whether it is a consumer.
    fn next(&mut self) -> Option<(Reverse<i32>, bool)> {
        if self.queued == 0 || self.at_max_tasks() {
            return None;
        }
        let consumers_only = self.over_pool();
        self.levels.iter_mut().find_map(|(&priority, level)| {
            let queue = level.next(consumers_only)?;
            let consumer = std::ptr::eq(queue, &level.consumers);
            Some((priority, consumer))
        })
    }
}

/// Ready tasks by tenant and priority; see the module documentation.
#[derive(Default)]
pub(super) struct ReadyQueue {
    tenants: Vec<TenantQueue>,
    by_name: HashMap<String, usize>,
    /// Policies of tenants from the tenants file, applied when they first submit.
    policies: HashMap<String, TenantPolicy>,
    /// Tenants that may have queued tasks (checked when choosing).
    active: Vec<usize>,
    next_seq: u64,
    len: usize,
}

impl ReadyQueue {
    /// Applies `policy` to tenant `name`, now and when it first submits.
    pub(super) fn set_policy(&mut self, name: &str, policy: TenantPolicy) {
        if let Some(&slot) = self.by_name.get(name) {
            self.tenants[slot].policy = policy;
        }
        self.policies.insert(name.to_string(), policy);
    }

    /// The queue's number for tenant `name`.
    pub(super) fn tenant(&mut self, name: &str) -> usize {
        if let Some(&slot) = self.by_name.get(name) {
            return slot;
        }
        let slot = self.tenants.len();
        self.tenants.push(TenantQueue {
            policy: self.policies.get(name).copied().unwrap_or_default(),
            levels: BTreeMap::new(),
            queued: 0,
            running: 0,
            held_bytes: 0,
        });
        self.by_name.insert(name.to_string(), slot);
        slot
    }

    /// Tasks queued (a task may be queued twice; the duplicate is skipped when taken).
    pub(super) fn len(&self) -> usize {
        self.len
    }

    fn level(&mut self, tenant: usize, priority: i32) -> &mut Level {
        let queue = &mut self.tenants[tenant];
        if queue.queued == 0 {
            self.active.push(tenant);
        }
        queue.queued += 1;
        self.len += 1;
        queue.levels.entry(Reverse(priority)).or_default()
    }

    /// Queues a ready task of `job` behind the others of its tenant and priority.
    pub(super) fn push(&mut self, job: &Job, task: TaskRef) {
        let consumer = job.reads_outputs(task.stage);
        self.push_to(job.queue_tenant, job.priority, consumer, task);
    }

    /// [`ReadyQueue::push`] by the job's tenant number and priority, and whether the task
    /// reads earlier stages' outputs.
    pub(super) fn push_to(&mut self, tenant: usize, priority: i32, consumer: bool, task: TaskRef) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let level = self.level(tenant, priority);
        let queue = if consumer {
            &mut level.consumers
        } else {
            &mut level.producers
        };
        queue.push_back(Queued { task, seq });
    }

    pub(super) fn extend(&mut self, job: &Job, tasks: Vec<TaskRef>) {
        for task in tasks {
            self.push(job, task);
        }
    }

    /// Puts back a task taken with [`ReadyQueue::pop`] that could not start, in its old place.
    pub(super) fn push_front(&mut self, job: &Job, queued: Queued) {
        let consumer = job.reads_outputs(queued.task.stage);
        let level = self.level(job.queue_tenant, job.priority);
        let queue = if consumer {
            &mut level.consumers
        } else {
            &mut level.producers
        };
        queue.push_front(queued);
    }

    /// Queues a ready task of `job` before every other of its tenant and priority.
    pub(super) fn push_first(&mut self, job: &Job, task: TaskRef) {
        self.push_front(job, Queued { task, seq: 0 });
    }

    /// The next task to hand out: of the tenant furthest below its weighted share that has a
    /// task allowed to start, its oldest task of the highest priority.
    pub(super) fn pop(&mut self) -> Option<Queued> {
        let mut best: Option<(f64, usize, Reverse<i32>, bool)> = None;
        let mut i = 0;
        while i < self.active.len() {
            let slot = self.active[i];
            let tenant = &mut self.tenants[slot];
            if tenant.queued == 0 {
                self.active.swap_remove(i);
                continue;
            }
            i += 1;
            let Some((priority, consumer)) = tenant.next() else {
                continue;
            };
            let share = f64::from(tenant.running + 1) / tenant.policy.weight;
            if best.is_none_or(|(b, b_slot, ..)| share < b || (share == b && slot < b_slot)) {
                best = Some((share, slot, priority, consumer));
            }
        }
        let (_, slot, priority, consumer) = best?;
        let tenant = &mut self.tenants[slot];
        let level = tenant.levels.get_mut(&priority)?;
        let queued = if consumer {
            level.consumers.pop_front()
        } else {
            level.producers.pop_front()
        }?;
        if level.is_empty() {
            tenant.levels.remove(&priority);
        }
        tenant.queued -= 1;
        self.len -= 1;
        Some(queued)
    }

    /// A job's tasks running and bytes held changed from `before` to `after`.
    pub(super) fn account(&mut self, tenant: usize, before: (u32, u64), after: (u32, u64)) {
        let tenant = &mut self.tenants[tenant];
        tenant.running = (tenant.running + after.0).saturating_sub(before.0);
        tenant.held_bytes = (tenant.held_bytes + after.1).saturating_sub(before.1);
    }

    /// Tenant `name`'s tasks running and bytes held, as accounted.
    #[cfg(test)]
    pub(super) fn usage(&self, name: &str) -> (u32, u64) {
        let tenant = &self.tenants[self.by_name[name]];
        (tenant.running, tenant.held_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{T, add_worker, assigned, finish, job_state, one_stage};
    use super::super::*;
    use crate::tenants::TenantPolicy;
    use wrk_proto::{Stage, StageInput};

    fn job_of(task: &AssignTask) -> String {
        task.task.as_ref().unwrap().job_id.clone()
    }

    #[test]
    fn higher_priority_jobs_start_first_and_equal_ones_in_order() {
        let mut state = State::new();
        let _w = add_worker(&mut state, "w", 1);
        let (low, _) = state.submit(T, one_stage(3));
        let mut pending = assigned(&state.dispatch());
        assert_eq!(pending.len(), 2, "one running, one queued on the worker");
        let (high, _) = state.submit_at(T, one_stage(3), 5);
        let (later_low, _) = state.submit(T, one_stage(1));
        pending.extend(assigned(&state.dispatch()));
        let mut order = Vec::new();
        while !pending.is_empty() {
            let task = pending.remove(0);
            order.push(job_of(&task));
            pending.extend(assigned(&finish(&mut state, &task, 1)));
        }
        assert_eq!(
            order,
            [&low, &low, &high, &high, &high, &low, &later_low].map(String::clone),
            "the queued low task had been handed out already; then the high job, then FIFO"
        );
    }

    #[test]
    fn tenants_running_shares_track_their_weights() {
        let mut state = State::new();
        state.set_tenant_policy(
            "heavy",
            TenantPolicy {
                weight: 3.0,
                ..Default::default()
            },
        );
        let _w = add_worker(&mut state, "w", 8);
        // The light tenant submits first and more: FIFO would give it every place.
        state.submit("light", one_stage(100));
        state.submit("light", one_stage(100));
        state.submit("heavy", one_stage(100));
        let first = assigned(&state.dispatch());
        assert_eq!(first.len(), 16);
        assert_eq!(state.ready.usage("light").0, 4);
        assert_eq!(state.ready.usage("heavy").0, 12);
        // As tasks end, each place goes to whoever is below its share.
        let mut running = first;
        for _ in 0..40 {
            let task = running.remove(0);
            running.extend(assigned(&finish(&mut state, &task, 0)));
            let (light, heavy) = (state.ready.usage("light").0, state.ready.usage("heavy").0);
            assert_eq!(light + heavy, 16);
            assert!((3..=5).contains(&light), "light {light}, heavy {heavy}");
        }
    }

    #[test]
    fn a_tenant_at_max_tasks_starts_nothing_more() {
        let mut state = State::new();
        state.set_tenant_policy(
            "capped",
            TenantPolicy {
                max_tasks: Some(2),
                ..Default::default()
            },
        );
        let _w = add_worker(&mut state, "w", 8);
        state.submit("capped", one_stage(10));
        let mut running = assigned(&state.dispatch());
        assert_eq!(running.len(), 2);
        state.submit("other", one_stage(3));
        running.extend(assigned(&state.dispatch()));
        assert_eq!(running.len(), 5, "other tenants are not held back");
        let mut done = 0;
        while !running.is_empty() {
            let task = running.remove(0);
            running.extend(assigned(&finish(&mut state, &task, 0)));
            done += 1;
            assert!(state.ready.usage("capped").0 <= 2);
        }
        assert_eq!(done, 13);
    }

    /// `source` (n tasks, no inputs) -> `sink` (one-to-one).
    fn source_and_sink(n: u32) -> JobSpec {
        let mut spec = one_stage(n);
        spec.stages.push(Stage {
            name: "sink".into(),
            module_hash: "h".into(),
            num_tasks: n,
            inputs: vec![StageInput {
                stage: 0,
                pattern: Pattern::OneToOne as i32,
                ..Default::default()
            }],
            ..Default::default()
        });
        spec
    }

    #[test]
    fn past_max_pool_bytes_only_consumers_start_until_data_is_released() {
        let mut state = State::new();
        state.set_tenant_policy(
            T,
            TenantPolicy {
                max_pool_bytes: Some(100),
                ..Default::default()
            },
        );
        let _w = add_worker(&mut state, "w", 1);
        let (id, _) = state.submit(T, source_and_sink(4));
        let mut pending = assigned(&state.dispatch());
        let mut held_peak = 0;
        let mut order = Vec::new();
        while !pending.is_empty() {
            let task = pending.remove(0);
            // Sources hold 60 bytes each, sinks 1.
            let bytes = if task.stage_name == "s" { 60 } else { 1 };
            order.push(format!(
                "{}{}",
                task.stage_name,
                task.task.as_ref().unwrap().index
            ));
            let next = assigned(&finish(&mut state, &task, bytes));
            if state.ready.usage(T).1 >= 100 {
                // Handed out while the tenant was over its pool quota: consumers only.
                for t in &next {
                    assert_eq!(t.stage_name, "sink", "{order:?}");
                }
            }
            held_peak = held_peak.max(state.ready.usage(T).1);
            pending.extend(next);
        }
        assert_eq!(job_state(&state, &id), JobState::Succeeded);
        // Two sources fit under the quota, a third may start before the second ends (it was
        // queued), never a fourth before a sink released one.
        assert!(held_peak <= 3 * 60 + 4, "peak {held_peak} ({order:?})");
        let s3 = order.iter().position(|t| t == "s3").unwrap();
        let first_sink = order.iter().position(|t| t.starts_with("sink")).unwrap();
        assert!(first_sink < s3, "{order:?}");
        assert_eq!(state.ready.usage(T).0, 0, "nothing running at the end");
    }
}

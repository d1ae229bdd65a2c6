//! Persisted datasets: the outputs of a tenant's job kept on the workers under a name, read by
//! that tenant's later jobs.
//!
//! A dataset is its producing job, kept instead of released: the final stages' task outputs stay
//! where they were made (partition p is the p-th task over the final stages, in stage order), and
//! the job keeps its graph, so a partition lost with a worker is recomputed by running the job's
//! tasks that lead to it again (the job goes back to running until they are done). A stage that
//! reads a dataset has one task per partition, placed like any task near its input bytes; a
//! reading task whose partition is being recomputed waits for it (parked by producing job), and
//! a reading job fails, naming the dataset, when the dataset is released or fails.

use std::collections::{HashMap, HashSet};

use wrk_proto::stage_input::Pattern;
use wrk_proto::{
    DatasetList, DatasetWorker, JobSpec, JobState, PartitionLocation, PersistedDataset,
};

use super::{Job, Outgoing, State, StateError, TaskRef, TaskStatus};

/// A stage of a job reading a dataset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub stage: u32,
    /// The job computing the dataset.
    pub producer: u64,
    pub name: String,
}

#[derive(Default)]
pub(super) struct Datasets {
    /// The producing job of each dataset, by tenant and name.
    by_name: HashMap<(String, String), u64>,
    /// The tenant and name of each producing job.
    names: HashMap<u64, (String, String)>,
    /// The dataset a stage reads, by reading job and stage.
    reads: HashMap<(u64, u32), Read>,
    /// Reading tasks waiting for partitions being recomputed, by producing job.
    parked: HashMap<u64, Vec<TaskRef>>,
}

impl Datasets {
    /// A reading job was released: forget what its stages read.
    pub(super) fn forget_reader(&mut self, job: u64) {
        if !self.reads.is_empty() {
            self.reads.retain(|(reader, _), _| *reader != job);
        }
    }
}

/// Whether a task reading a dataset can start.
pub(super) enum Gate {
    /// It reads no dataset, or its partition is held by a live worker.
    Open,
    /// Its partition is being computed: the task was parked until the producing job progresses.
    Wait,
    /// The dataset is gone: the reading job fails with this reason.
    Closed(String),
}

/// The task of `job` computing dataset partition `partition`: the final stages' tasks, in
/// stage order.
fn partition_task(job: &Job, partition: u32) -> Option<(u32, u32)> {
    let mut left = partition;
    for stage in job.final_stages() {
        let count = job.spec.stages[stage as usize].num_tasks;
        if left < count {
            return Some((stage, left));
        }
        left -= count;
    }
    None
}

fn partition_count(job: &Job) -> u32 {
    job.final_stages()
        .into_iter()
        .map(|s| job.spec.stages[s as usize].num_tasks)
        .sum()
}

/// Why a dataset's job cannot serve it any more, if it cannot.
fn unavailable(job: &Job) -> Option<String> {
    if job.released {
        return Some("it was released".into());
    }
    match job.state {
        JobState::Failed | JobState::Cancelled => Some(format!(
            "its job {} did not complete: {}",
            job.id, job.error
        )),
        _ => None,
    }
}

/// Stages left at 0 tasks (the client did not know a dataset's partition count) that map one
/// to one over a stage, or reduce an exchange from it, take its task count.
fn follow_task_counts(spec: &mut JobSpec) {
    for s in 0..spec.stages.len() {
        if spec.stages[s].num_tasks != 0 {
            continue;
        }
        let upstream = spec.stages[s]
            .inputs
            .iter()
            .find(|i| {
                matches!(i.pattern(), Pattern::OneToOne | Pattern::Shuffle)
                    && (i.stage as usize) < s
            })
            .map(|i| spec.stages[i.stage as usize].num_tasks);
        if let Some(count) = upstream {
            spec.stages[s].num_tasks = count;
        }
    }
}

impl State {
    /// Checks the datasets `spec` names for `tenant` (the one it persists must be free, the
    /// ones it reads must exist and be readable) and sets each reading stage's task count to
    /// its dataset's partition count. Returns what the stages read.
    pub fn resolve_datasets(
        &self,
        tenant: &str,
        spec: &mut JobSpec,
    ) -> Result<Vec<Read>, StateError> {
        if !spec.persist.is_empty()
            && self
                .datasets
                .by_name
                .contains_key(&(tenant.to_string(), spec.persist.clone()))
        {
            return Err(StateError::DatasetExists(spec.persist.clone()));
        }
        let mut reads = Vec::new();
        for (s, stage) in spec.stages.iter_mut().enumerate() {
            if stage.dataset.is_empty() {
                continue;
            }
            let name = stage.dataset.clone();
            let producer = *self
                .datasets
                .by_name
                .get(&(tenant.to_string(), name.clone()))
                .ok_or_else(|| StateError::UnknownDataset(name.clone()))?;
            let job = self
                .jobs
                .get(&producer)
                .ok_or_else(|| StateError::UnknownDataset(name.clone()))?;
            if let Some(reason) = unavailable(job) {
                return Err(StateError::DatasetUnavailable { name, reason });
            }
            stage.num_tasks = partition_count(job);
            reads.push(Read {
                stage: s as u32,
                producer,
                name,
            });
        }
        if !reads.is_empty() {
            follow_task_counts(spec);
        }
        Ok(reads)
    }

    /// Registers what a just submitted job reads, and the dataset it persists (`persist`, if
    /// not empty), from [`State::resolve_datasets`].
    pub fn register_datasets(
        &mut self,
        tenant: &str,
        job_id: &str,
        reads: Vec<Read>,
        persist: &str,
    ) -> Result<(), StateError> {
        let number = self.tenant_job(tenant, job_id)?;
        for read in reads {
            self.datasets.reads.insert((number, read.stage), read);
        }
        if !persist.is_empty() {
            let key = (tenant.to_string(), persist.to_string());
            self.datasets.by_name.insert(key.clone(), number);
            self.datasets.names.insert(number, key);
            tracing::info!(job = %job_id, dataset = %persist, %tenant, "job persists a dataset");
        }
        Ok(())
    }

    /// The dataset `name` of `tenant`, by producing job.
    pub(super) fn tenant_dataset(&self, tenant: &str, name: &str) -> Result<u64, StateError> {
        self.datasets
            .by_name
            .get(&(tenant.to_string(), name.to_string()))
            .copied()
            .filter(|n| self.jobs.contains_key(n))
            .ok_or_else(|| StateError::UnknownDataset(name.to_string()))
    }

    /// Job `number` no longer computes a dataset (it was released).
    pub(super) fn forget_dataset_of(&mut self, number: u64) {
        if let Some(key) = self.datasets.names.remove(&number) {
            self.datasets.by_name.remove(&key);
        }
    }

    /// The dataset partition task `task` reads, when it reads one: the producing job, and the
    /// partition's task in it.
    fn dataset_partition(&self, task: TaskRef) -> Option<(&Read, &Job, u32, u32)> {
        if self.datasets.reads.is_empty() {
            return None;
        }
        let read = self.datasets.reads.get(&(task.job, task.stage))?;
        let job = self.jobs.get(&read.producer)?;
        let (stage, index) = partition_task(job, task.index)?;
        Some((read, job, stage, index))
    }

    /// Whether `task` may start now as far as the dataset it reads goes; parks it when its
    /// partition is being computed.
    pub(super) fn dataset_gate(&mut self, task: TaskRef) -> Gate {
        if self.datasets.reads.is_empty() {
            return Gate::Open;
        }
        let Some(read) = self.datasets.reads.get(&(task.job, task.stage)) else {
            return Gate::Open;
        };
        let closed = |reason: String| {
            Gate::Closed(format!(
                "stage {} task {} reads dataset `{}`, which cannot be read: {reason}",
                task.stage, task.index, read.name
            ))
        };
        let Some(job) = self.jobs.get(&read.producer) else {
            return closed("it was released".into());
        };
        if let Some(reason) = unavailable(job) {
            return closed(reason);
        }
        let Some((stage, index)) = partition_task(job, task.index) else {
            return closed(format!("it has no partition {}", task.index));
        };
        let entry = &job.tasks[stage as usize][index as usize];
        match &entry.status {
            TaskStatus::Done { worker, .. }
                if !entry.outputs_released && self.workers.contains_key(worker) =>
            {
                Gate::Open
            }
            _ => {
                let producer = read.producer;
                self.datasets.parked.entry(producer).or_default().push(task);
                Gate::Wait
            }
        }
    }

    /// Queues again the reading tasks parked on job `producer` (it progressed, or is gone).
    pub(super) fn wake_dataset_readers(&mut self, producer: u64) {
        if self.datasets.parked.is_empty() {
            return;
        }
        if let Some(parked) = self.datasets.parked.remove(&producer) {
            for task in parked {
                if let Some(job) = self.jobs.get(&task.job) {
                    self.ready.push(job, task);
                }
            }
        }
    }

    /// The bytes of the dataset partition `task` reads (none if it reads none).
    pub(super) fn dataset_input_bytes(&self, task: TaskRef) -> u64 {
        self.dataset_holders(task).map_or(0, |(_, bytes)| bytes)
    }

    /// The worker holding the dataset partition `task` reads, and its bytes.
    pub(super) fn dataset_holders(&self, task: TaskRef) -> Option<(&str, u64)> {
        let (_, job, stage, index) = self.dataset_partition(task)?;
        match &job.tasks[stage as usize][index as usize].status {
            TaskStatus::Done { worker, outputs } => {
                Some((worker.as_str(), outputs.iter().map(|o| o.bytes).sum()))
            }
            _ => None,
        }
    }

    /// The locations of the outputs of the dataset partition `task` reads.
    pub(super) fn dataset_inputs(&self, task: TaskRef) -> Vec<PartitionLocation> {
        let Some((_, job, stage, index)) = self.dataset_partition(task) else {
            return Vec::new();
        };
        match &job.tasks[stage as usize][index as usize].status {
            TaskStatus::Done { worker, outputs } => outputs
                .iter()
                .enumerate()
                .map(|(o, meta)| self.location(&job.id, (stage, index, o as u32), worker, meta))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// After a worker was lost: datasets that lost partitions run the tasks leading to them
    /// again. Returns how many tasks were set to run again.
    pub(super) fn recover_datasets(&mut self) -> usize {
        let mut total = 0;
        let producers: Vec<u64> = self.datasets.names.keys().copied().collect();
        for number in producers {
            let workers = &self.workers;
            let Some(job) = self.jobs.get_mut(&number) else {
                continue;
            };
            if job.released || job.state != JobState::Succeeded {
                continue;
            }
            let lost = job.final_stages().into_iter().any(|s| {
                job.tasks[s as usize].iter().any(|t| {
                    matches!(&t.status, TaskStatus::Done { worker, .. } if !workers.contains_key(worker))
                })
            });
            if !lost {
                continue;
            }
            job.state = JobState::Running;
            let recomputed = job.recover(workers, number as usize);
            total += recomputed;
            tracing::warn!(
                job = %job.id,
                dataset = %self.datasets.names[&number].1,
                "a worker holding dataset partitions was lost: {recomputed} tasks to recompute them"
            );
            let ready = job.recount_ready(number);
            self.ready.extend(job, ready);
            job.publish();
        }
        total
    }

    /// The datasets of `tenant`, by name.
    pub fn datasets(&self, tenant: &str) -> DatasetList {
        let mut datasets: Vec<PersistedDataset> = self
            .datasets
            .by_name
            .iter()
            .filter(|((t, _), _)| t == tenant)
            .filter_map(|((_, name), number)| {
                let job = self.jobs.get(number)?;
                Some(self.dataset_view(name, *number, job))
            })
            .collect();
        datasets.sort_by(|a, b| a.name.cmp(&b.name));
        DatasetList { datasets }
    }

    fn dataset_view(&self, name: &str, number: u64, job: &Job) -> PersistedDataset {
        let mut view = PersistedDataset {
            name: name.to_string(),
            job_id: job.id.clone(),
            state: job.state as i32,
            error: unavailable(job).unwrap_or_default(),
            partitions: partition_count(job),
            moving: self.moves.moving_of(number),
            ..Default::default()
        };
        let mut by_worker: HashMap<&str, DatasetWorker> = HashMap::new();
        for stage in job.final_stages() {
            for task in job.tasks.get(stage as usize).into_iter().flatten() {
                if let TaskStatus::Done { worker, outputs } = &task.status {
                    let bytes: u64 = outputs.iter().map(|o| o.bytes).sum();
                    view.bytes += bytes;
                    view.rows += outputs.iter().map(|o| o.rows).sum::<u64>();
                    let entry = by_worker
                        .entry(worker.as_str())
                        .or_insert_with(|| DatasetWorker {
                            worker_id: worker.clone(),
                            ..Default::default()
                        });
                    entry.partitions += 1;
                    entry.bytes += bytes;
                }
            }
        }
        view.workers = by_worker.into_values().collect();
        view.workers.sort_by(|a, b| a.worker_id.cmp(&b.worker_id));
        view
    }

    /// Drops `tenant`'s dataset `name`: its partitions on the workers and its job (cancelled
    /// first if it is still computing). Jobs reading it fail, naming it.
    pub fn release_dataset(&mut self, tenant: &str, name: &str) -> Result<Outgoing, StateError> {
        let number = self.tenant_dataset(tenant, name)?;
        let mut out = self.finish_job(
            number,
            JobState::Cancelled,
            format!("dataset `{name}` was released"),
        );
        out.extend(self.release_job(number));
        self.forget_dataset_of(number);
        if let Some(job) = self.jobs.get_mut(&number) {
            job.records = None;
        }
        tracing::info!(dataset = %name, %tenant, "dataset released");
        out.extend(self.dispatch());
        Ok(out)
    }

    /// Releases the datasets of tenants not in `tenants` (they were removed from the tenants
    /// file).
    pub fn release_datasets_except(&mut self, tenants: &HashSet<String>) -> Outgoing {
        let removed: Vec<(String, String)> = self
            .datasets
            .by_name
            .keys()
            .filter(|(tenant, _)| !tenants.contains(tenant))
            .cloned()
            .collect();
        let mut out = Vec::new();
        for (tenant, name) in removed {
            tracing::info!(%tenant, dataset = %name, "tenant removed: releasing its dataset");
            out.extend(self.release_dataset(&tenant, &name).unwrap_or_default());
        }
        out
    }

    /// Plans moves of `tenant`'s dataset `name`'s partitions so that its bytes are spread
    /// evenly over the workers taking tasks: repeatedly, the largest partition of the fullest
    /// worker that lowers the spread goes to the emptiest. Returns the messages starting the
    /// moves and how many there are.
    pub fn rebalance_dataset(
        &mut self,
        tenant: &str,
        name: &str,
    ) -> Result<(Outgoing, u32), StateError> {
        let number = self.tenant_dataset(tenant, name)?;
        let job = &self.jobs[&number];
        if let Some(reason) = unavailable(job) {
            return Err(StateError::DatasetUnavailable {
                name: name.to_string(),
                reason,
            });
        }
        if job.state != JobState::Succeeded {
            return Err(StateError::DatasetUnavailable {
                name: name.to_string(),
                reason: "it is still being computed".into(),
            });
        }
        let mut load: HashMap<String, u64> = self
            .workers
            .iter()
            .filter(|(_, w)| !w.retiring)
            .map(|(id, _)| (id.clone(), 0))
            .collect();
        // Movable partitions: (task, holder, bytes).
        let mut partitions: Vec<(TaskRef, String, u64)> = Vec::new();
        for stage in job.final_stages() {
            for (index, entry) in job.tasks[stage as usize].iter().enumerate() {
                let TaskStatus::Done { worker, outputs } = &entry.status else {
                    continue;
                };
                let bytes: u64 = outputs.iter().map(|o| o.bytes).sum();
                let task = TaskRef {
                    job: number,
                    stage,
                    index: index as u32,
                };
                if let Some(l) = load.get_mut(worker) {
                    *l += bytes;
                }
                if bytes > 0 && !self.moves.is_moving(task) {
                    partitions.push((task, worker.clone(), bytes));
                }
            }
        }
        // Largest first, so the first fitting partition of a worker is its largest.
        partitions.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.index.cmp(&b.0.index)));
        let mut planned: Vec<(TaskRef, String)> = Vec::new();
        while let Some((emptiest, low)) = load
            .iter()
            .min_by_key(|(id, l)| (**l, (*id).clone()))
            .map(|(id, l)| (id.clone(), *l))
        {
            let mut holders: Vec<(String, u64)> = load
                .iter()
                .filter(|(id, l)| **l > low && **id != emptiest)
                .map(|(id, l)| (id.clone(), *l))
                .collect();
            holders.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            // From the fullest worker that has a partition whose move narrows the spread.
            let choice = holders.iter().find_map(|(holder, high)| {
                partitions
                    .iter()
                    .position(|(_, w, bytes)| w == holder && *bytes < high - low)
                    .map(|p| (p, holder.clone()))
            });
            let Some((position, holder)) = choice else {
                break;
            };
            let (task, _, bytes) = partitions.remove(position);
            *load.entry(holder).or_default() -= bytes;
            *load.entry(emptiest.clone()).or_default() += bytes;
            planned.push((task, emptiest));
        }
        let mut out = Vec::new();
        let moves = planned.len() as u32;
        for (task, to) in planned {
            out.extend(self.start_move(task, &to));
        }
        tracing::info!(dataset = %name, %tenant, moves, "rebalancing dataset");
        Ok((out, moves))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{
        Inbox, T, add_worker, assigned, finish, finish_after, job_state, worker_of,
    };
    use super::*;
    use wrk_proto::scheduler_message::Kind as ToWorker;
    use wrk_proto::{AssignTask, PartitionsFetched, Stage, task_input};

    /// One stage of `n` tasks, persisted as `name`.
    fn producer(n: u32, name: &str) -> JobSpec {
        JobSpec {
            name: "make".into(),
            persist: name.into(),
            stages: vec![Stage {
                name: "make".into(),
                module_hash: "h".into(),
                num_tasks: n,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn reader(name: &str) -> JobSpec {
        JobSpec {
            name: "read".into(),
            stages: vec![Stage {
                name: "read".into(),
                module_hash: "h".into(),
                dataset: name.into(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn submit(state: &mut State, tenant: &str, mut spec: JobSpec) -> Result<String, StateError> {
        let reads = state.resolve_datasets(tenant, &mut spec)?;
        let persist = spec.persist.clone();
        let (id, _) = state.submit(tenant, spec);
        state.register_datasets(tenant, &id, reads, &persist)?;
        Ok(id)
    }

    /// Runs every task dispatch hands out until none is left, each output `bytes` big.
    fn run_all(state: &mut State, out: Outgoing, bytes: u64) {
        run_all_with(state, out, |state, task| finish(state, task, bytes));
    }

    /// Runs every task dispatch hands out until none is left, each reported by `finish`.
    fn run_all_with(
        state: &mut State,
        mut out: Outgoing,
        mut finish: impl FnMut(&mut State, &AssignTask) -> Outgoing,
    ) {
        loop {
            let started = assigned(&out);
            if started.is_empty() {
                return;
            }
            out = Vec::new();
            for task in &started {
                out.extend(finish(state, task));
            }
        }
    }

    fn input_workers(task: &AssignTask) -> Vec<String> {
        task.inputs
            .iter()
            .filter_map(|i| match &i.kind {
                Some(task_input::Kind::Partition(l)) => Some(l.worker_id.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_persisted_job_keeps_its_partitions_and_readers_run_where_they_are() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 1);
        let _b = add_worker(&mut state, "b", 1);
        let id = submit(&mut state, T, producer(4, "trips")).unwrap();
        let out = state.dispatch();
        run_all(&mut state, out, 100);
        assert_eq!(job_state(&state, &id), JobState::Succeeded);

        let list = state.datasets(T).datasets;
        assert_eq!(list.len(), 1);
        let trips = &list[0];
        assert_eq!(
            (
                trips.name.as_str(),
                trips.partitions,
                trips.bytes,
                trips.state()
            ),
            ("trips", 4, 400, JobState::Succeeded)
        );
        assert_eq!(trips.workers.iter().map(|w| w.partitions).sum::<u32>(), 4);
        assert!(
            state.datasets("other").datasets.is_empty(),
            "tenants see only their own"
        );

        // The same name again is refused; another tenant cannot read it.
        assert_eq!(
            submit(&mut state, T, producer(1, "trips")),
            Err(StateError::DatasetExists("trips".into()))
        );
        assert_eq!(
            submit(&mut state, "other", reader("trips")),
            Err(StateError::UnknownDataset("trips".into()))
        );

        let read = submit(&mut state, T, reader("trips")).unwrap();
        let started = assigned(&state.dispatch());
        assert_eq!(started.len(), 4, "a running and a queued task per worker");
        for task in &started {
            assert_eq!(
                input_workers(task),
                vec![worker_of(&state, task)],
                "a reader runs where its partition is"
            );
        }
        let mut out = Vec::new();
        for task in &started {
            out.extend(finish(&mut state, task, 10));
        }
        run_all(&mut state, out, 10);
        assert_eq!(job_state(&state, &read), JobState::Succeeded);
        assert_eq!(state.datasets(T).datasets[0].partitions, 4);
    }

    /// Runs a persisting job of `partitions` tasks on `a` alone, each output `bytes` big and
    /// each task `duration_us` long; then `b` joins. The state and the workers' inboxes.
    fn dataset_on_a(partitions: u32, bytes: u64, duration_us: u64) -> (State, [Inbox; 2]) {
        let mut state = State::new();
        let a = add_worker(&mut state, "a", 1);
        submit(&mut state, T, producer(partitions, "d")).unwrap();
        let out = state.dispatch();
        run_all_with(&mut state, out, |state, task| {
            finish_after(state, task, bytes, duration_us)
        });
        let b = add_worker(&mut state, "b", 1);
        (state, [a, b])
    }

    fn placed_on(state: &State, started: &[AssignTask]) -> Vec<String> {
        started.iter().map(|t| worker_of(state, t)).collect()
    }

    fn retracts(out: &Outgoing) -> usize {
        out.iter()
            .filter(|(_, m)| matches!(m.kind, Some(ToWorker::Retract(_))))
            .count()
    }

    #[test]
    fn readers_queue_behind_short_tasks_where_their_large_partitions_are() {
        // 100 MB partitions take about 0.1 s to move; the tasks on `a` take 2 ms.
        let (mut state, _inboxes) = dataset_on_a(4, 100_000_000, 2_000);
        submit(&mut state, T, reader("d")).unwrap();
        let out = state.dispatch();
        let started = assigned(&out);
        assert_eq!(placed_on(&state, &started), ["a", "a", "a", "a"]);
        assert_eq!(retracts(&out), 0, "idle `b` steals none of them either");
        assert!(state.dispatch().is_empty());

        // With partitions that move in no time, the idle worker takes a share.
        let (mut state, _inboxes) = dataset_on_a(4, 1_000, 2_000);
        submit(&mut state, T, reader("d")).unwrap();
        let started = assigned(&state.dispatch());
        assert!(
            placed_on(&state, &started).contains(&"b".to_string()),
            "{:?}",
            placed_on(&state, &started)
        );
    }

    #[test]
    fn a_reader_moves_to_an_idle_worker_once_the_wait_would_exceed_the_transfer() {
        // 50 MB partitions (about 50 ms to move), 20 ms tasks: a second and a third task are
        // worth waiting for on `a` (20 and 40 ms), a fourth is not (60 ms).
        let (mut state, _inboxes) = dataset_on_a(4, 50_000_000, 20_000);
        submit(&mut state, T, reader("d")).unwrap();
        let first = assigned(&state.dispatch());
        assert_eq!(placed_on(&state, &first), ["a", "a", "b"]);
        // The one that waited starts on `a` when `a` has room again.
        let next = assigned(&finish_after(&mut state, &first[0], 10, 20_000));
        assert_eq!(placed_on(&state, &next), ["a"]);
        let inputs: Vec<u32> = first
            .iter()
            .chain(&next)
            .map(|t| t.task.as_ref().unwrap().index)
            .collect();
        let mut sorted = inputs.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, [0, 1, 2, 3], "every reader placed once: {inputs:?}");
    }

    #[test]
    fn the_rate_workers_measure_decides_between_moving_and_waiting() {
        // The same 50 MB partitions and 20 ms tasks as above, which the assumed 1 GB/s splits
        // two on `a`, one on `b`.
        let placements = |bytes_per_second: f64| {
            let (mut state, _inboxes) = dataset_on_a(4, 50_000_000, 20_000);
            let beat = wrk_proto::Heartbeat {
                transfer_bytes_per_second: Some(bytes_per_second),
                ..Default::default()
            };
            for _ in 0..50 {
                state.heartbeat("a", &beat);
                state.heartbeat("b", &beat);
            }
            submit(&mut state, T, reader("d")).unwrap();
            let out = state.dispatch();
            assert_eq!(retracts(&out), 0);
            placed_on(&state, &assigned(&out))
        };
        let on_b = |placed: &[String]| placed.iter().filter(|w| *w == "b").count();
        // 100 MB/s: half a second to move a partition, so every reader waits for `a`.
        let slow = placements(1e8);
        assert_eq!(on_b(&slow), 0, "{slow:?}");
        // 10 GB/s: 5 ms, less than one task ahead on `a`, so the readers split evenly.
        let fast = placements(1e10);
        assert_eq!((fast.len(), on_b(&fast)), (4, 2), "{fast:?}");
    }

    #[test]
    fn a_new_job_is_placed_by_the_durations_of_the_same_stage_in_earlier_jobs() {
        // The partitions took 200 ms each to make, so `a`'s recent mean is long; the readers
        // take 2 ms, which a first reading job teaches the scheduler.
        let (mut state, _inboxes) = dataset_on_a(4, 100_000_000, 200_000);
        submit(&mut state, T, reader("d")).unwrap();
        let out = state.dispatch();
        run_all_with(&mut state, out, |state, task| {
            finish_after(state, task, 10, 2_000)
        });
        submit(&mut state, T, reader("d")).unwrap();
        let out = state.dispatch();
        let started = assigned(&out);
        // `a` takes as many as its queue holds (its recent mean is still long, so its queue
        // is short); the other two wait for it rather than move 100 MB to idle `b`.
        assert_eq!(placed_on(&state, &started), ["a", "a"]);
        assert_eq!(retracts(&out), 0);
        let next = assigned(&finish_after(&mut state, &started[0], 10, 2_000));
        assert_eq!(placed_on(&state, &next), ["a"]);
    }

    #[test]
    fn a_lost_dataset_partition_is_recomputed_and_its_reader_waits_for_it() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 2);
        let _b = add_worker(&mut state, "b", 2);
        let id = submit(&mut state, T, producer(4, "d")).unwrap();
        let out = state.dispatch();
        run_all(&mut state, out, 100);
        let on_a = state.datasets(T).datasets[0]
            .workers
            .iter()
            .find(|w| w.worker_id == "a")
            .map_or(0, |w| w.partitions);
        assert!(on_a > 0, "both workers hold partitions");

        // Only the lost partitions run again; the reader's tasks wait for them.
        let out = state.worker_lost("a", "killed");
        let started = assigned(&out);
        let producing: Vec<&AssignTask> = started.iter().filter(|t| t.job_name == "make").collect();
        assert_eq!(
            producing.len() as u32,
            on_a,
            "just the lost partitions rerun"
        );
        assert_eq!(job_state(&state, &id), JobState::Running);
        assert_eq!(state.datasets(T).datasets[0].state(), JobState::Running);

        let read = submit(&mut state, T, reader("d")).unwrap();
        let readers = assigned(&state.dispatch());
        assert!(
            readers
                .iter()
                .all(|t| input_workers(t) == vec!["b".to_string()]),
            "only readers of held partitions start"
        );
        let mut out = Vec::new();
        for task in producing {
            out.extend(finish(&mut state, task, 100));
        }
        assert_eq!(job_state(&state, &id), JobState::Succeeded);
        for task in &readers {
            out.extend(finish(&mut state, task, 1));
        }
        run_all(&mut state, out, 1);
        assert_eq!(job_state(&state, &read), JobState::Succeeded);
    }

    #[test]
    fn a_released_dataset_fails_its_readers_naming_it() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 1);
        let make = submit(&mut state, T, producer(2, "d")).unwrap();
        let started = assigned(&state.dispatch());
        // The reader is accepted while the dataset is computed, and waits.
        let read = submit(&mut state, T, reader("d")).unwrap();
        finish(&mut state, &started[0], 5);
        let released = state.release_dataset(T, "d").unwrap();
        assert!(
            released
                .iter()
                .any(|(_, m)| matches!(&m.kind, Some(ToWorker::Release(r)) if r.job_id == make)),
            "workers drop its partitions"
        );
        assert_eq!(job_state(&state, &read), JobState::Failed);
        let error = state.result(T, &read).unwrap().error;
        assert!(error.contains("dataset `d`"), "{error}");
        assert_eq!(
            state.release_dataset(T, "d").map(|_| ()),
            Err(StateError::UnknownDataset("d".into()))
        );
        assert_eq!(
            submit(&mut state, T, reader("d")),
            Err(StateError::UnknownDataset("d".into()))
        );
    }

    #[test]
    fn rebalancing_moves_partitions_to_the_emptiest_workers() {
        let mut state = State::new();
        let _a = add_worker(&mut state, "a", 4);
        let id = submit(&mut state, T, producer(4, "d")).unwrap();
        let out = state.dispatch();
        run_all(&mut state, out, 100);
        let _b = add_worker(&mut state, "b", 1);
        let (out, moves) = state.rebalance_dataset(T, "d").unwrap();
        assert_eq!(moves, 2, "two of a's four partitions go to b");
        let fetches: Vec<_> = out
            .iter()
            .filter_map(|(_, m)| match &m.kind {
                Some(ToWorker::Fetch(f)) => Some(f.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(fetches.len(), 2);
        assert!(fetches.iter().all(|f| f.partitions[0].worker_id == "a"));
        assert_eq!(state.datasets(T).datasets[0].moving, 2);
        for fetch in &fetches {
            let out = state.partitions_fetched(
                "b",
                PartitionsFetched {
                    job_id: id.clone(),
                    stage: fetch.stage,
                    task: fetch.task,
                    error: String::new(),
                },
            );
            assert!(
                out.iter().any(|(_, m)| matches!(&m.kind,
                    Some(ToWorker::ReleaseTasks(r)) if r.tasks[0].index == fetch.task)),
                "the old holder drops the moved partition"
            );
        }
        let view = &state.datasets(T).datasets[0];
        assert_eq!(view.moving, 0);
        let bytes: Vec<u64> = view.workers.iter().map(|w| w.bytes).collect();
        assert_eq!(bytes, vec![200, 200]);
        assert_eq!(
            state.rebalance_dataset(T, "d").map(|(_, n)| n),
            Ok(0),
            "nothing to move once even"
        );
        assert_eq!(
            state.rebalance_dataset("other", "d").map(|(_, n)| n),
            Err(StateError::UnknownDataset("d".into()))
        );
    }
}

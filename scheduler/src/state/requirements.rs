//! Stage requirements: a stage's `requires` tags and the workers that have them. A task goes
//! only to a worker having every tag its stage requires (placement checks `Worker::has_tags`);
//! a task whose requirement no connected worker meets is parked, its job's progress says what
//! it waits for, and it is queued again when a worker that meets it registers (as Dask's worker
//! resources keep such tasks in `no-worker`).

use super::{State, TaskRef};

impl State {
    /// Whether some connected worker has every tag in `requires`.
    pub(super) fn satisfiable(&mut self, requires: &[String]) -> bool {
        if let Some(&known) = self.satisfiable.get(requires) {
            return known;
        }
        let known = self.workers.values().any(|w| w.has_tags(requires));
        self.satisfiable.insert(requires.to_vec(), known);
        known
    }

    /// Sets aside a ready task whose stage requires tags no connected worker has, and says so
    /// in its job's progress.
    pub(super) fn park(&mut self, task: TaskRef) {
        let Some(job) = self.jobs.get_mut(&task.job) else {
            return;
        };
        let requires = job.spec.stages[task.stage as usize].requires.clone();
        if job.waiting.is_empty() {
            job.waiting = format!(
                "waiting for a worker with tags [{}] (stage `{}`)",
                requires.join(", "),
                job.spec.stages[task.stage as usize].name
            );
            tracing::info!(job = %job.id, "{}", job.waiting);
            job.publish();
        }
        self.parked.entry(requires).or_default().push(task);
    }

    /// Queues again the parked tasks that worker `worker_id` (just registered) can run.
    pub(super) fn unpark(&mut self, worker_id: &str) {
        let Some(worker) = self.workers.get(worker_id) else {
            return;
        };
        let runnable: Vec<Vec<String>> = self
            .parked
            .keys()
            .filter(|requires| worker.has_tags(requires))
            .cloned()
            .collect();
        for requires in runnable {
            for task in self.parked.remove(&requires).unwrap_or_default() {
                if let Some(job) = self.jobs.get_mut(&task.job) {
                    if !job.waiting.is_empty() {
                        job.waiting.clear();
                        job.publish();
                    }
                    self.ready.push(job, task);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{T, assigned, finish, worker_of};
    use super::super::*;
    use wrk_proto::{GpuInfo, Register, Stage};

    fn add_tagged(
        state: &mut State,
        id: &str,
        tags: &[&str],
        gpu: Option<GpuInfo>,
    ) -> Result<(), StateError> {
        let (tx, _rx) = mpsc::unbounded_channel();
        state.register_worker(
            &Register {
                worker_id: id.into(),
                data_address: format!("http://{id}"),
                slots: 2,
                tags: tags.iter().map(|t| t.to_string()).collect(),
                gpu,
                ..Default::default()
            },
            tx,
        )
    }

    /// A `cpu` stage of `n` tasks and a stage of `n` tasks requiring `requires`.
    fn mixed(n: u32, requires: &[&str]) -> JobSpec {
        let stage = |name: &str, requires: Vec<String>| Stage {
            name: name.into(),
            module_hash: "h".into(),
            num_tasks: n,
            requires,
            ..Default::default()
        };
        JobSpec {
            name: "mixed".into(),
            stages: vec![
                stage("anywhere", Vec::new()),
                stage("tagged", requires.iter().map(|t| t.to_string()).collect()),
            ],
            ..Default::default()
        }
    }

    #[test]
    fn tasks_go_only_to_workers_with_every_required_tag() {
        let mut state = State::new();
        add_tagged(&mut state, "plain", &[], None).unwrap();
        let h100 = GpuInfo {
            name: "NVIDIA H100".into(),
            ..Default::default()
        };
        add_tagged(&mut state, "gpu", &["fast"], Some(h100)).unwrap();
        assert_eq!(state.workers["gpu"].tags, ["fast", "gpu", "nvidia-h100"]);
        assert_eq!(state.workers["plain"].tags, ["cpu"]);
        state.submit(T, mixed(4, &["gpu", "nvidia-h100"]));
        let mut pending = assigned(&state.dispatch());
        let mut seen = Vec::new();
        while let Some(task) = pending.pop() {
            let worker = worker_of(&state, &task);
            if task.stage_name == "tagged" {
                assert_eq!(worker, "gpu");
            }
            seen.push((task.stage_name.clone(), worker.clone()));
            pending.extend(assigned(&finish(&mut state, &task, 1)));
        }
        assert_eq!(seen.len(), 8, "{seen:?}");
        assert!(
            seen.iter()
                .any(|(stage, w)| stage == "anywhere" && w == "plain"),
            "untagged tasks still use every worker: {seen:?}"
        );
    }

    #[test]
    fn a_requirement_no_worker_meets_waits_and_says_why_until_one_registers() {
        let mut state = State::new();
        add_tagged(&mut state, "plain", &[], None).unwrap();
        let (id, progress) = state.submit(T, mixed(2, &["gpu"]));
        let mut pending = assigned(&state.dispatch());
        assert_eq!(pending.len(), 2, "the untagged stage runs");
        while let Some(task) = pending.pop() {
            pending.extend(assigned(&finish(&mut state, &task, 1)));
        }
        let waiting = progress.borrow().waiting.clone();
        assert_eq!(
            waiting,
            "waiting for a worker with tags [gpu] (stage `tagged`)"
        );
        assert_eq!(state.status(T).jobs[0].waiting, waiting);
        assert_eq!(
            state.jobs_view().jobs[0].waiting,
            waiting,
            "on the dashboard too"
        );
        assert_eq!(job_state_of(&state, &id), JobState::Running);
        add_tagged(&mut state, "late", &["gpu"], None).unwrap();
        let started = assigned(&state.dispatch());
        assert_eq!(started.len(), 2);
        assert!(started.iter().all(|t| worker_of(&state, t) == "late"));
        assert!(progress.borrow().waiting.is_empty());
    }

    #[test]
    fn reducer_partitions_of_a_tagged_stage_are_received_on_tagged_workers() {
        let mut state = State::new();
        add_tagged(&mut state, "a", &[], None).unwrap();
        add_tagged(&mut state, "b", &["big"], None).unwrap();
        let spec = JobSpec {
            name: "shuffle".into(),
            stages: vec![
                Stage {
                    name: "map".into(),
                    module_hash: "h".into(),
                    num_tasks: 4,
                    ..Default::default()
                },
                Stage {
                    name: "reduce".into(),
                    module_hash: "h".into(),
                    num_tasks: 4,
                    inputs: vec![wrk_proto::StageInput {
                        stage: 0,
                        pattern: Pattern::Shuffle as i32,
                        exchange: "x".into(),
                    }],
                    requires: vec!["big".into()],
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let (id, _) = state.submit(T, spec);
        let mut pending = assigned(&state.dispatch());
        let mut reducers = 0;
        while let Some(task) = pending.pop() {
            if task.stage_name == "map" {
                for send in &task.sends {
                    assert!(send.peers.iter().all(|p| p.worker_id == "b"), "{send:?}");
                }
            }
            let worker = worker_of(&state, &task);
            if task.stage_name == "reduce" {
                assert_eq!(worker, "b");
                reducers += 1;
            }
            pending.extend(assigned(&finish(&mut state, &task, 1)));
        }
        assert_eq!(reducers, 4);
        assert_eq!(job_state_of(&state, &id), JobState::Succeeded);
    }

    fn job_state_of(state: &State, id: &str) -> JobState {
        state.result(T, id).unwrap().state()
    }

    #[test]
    fn invalid_worker_tags_are_refused_naming_the_worker() {
        let mut state = State::new();
        let err = add_tagged(&mut state, "w", &["GPU"], None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "worker `w` offers an invalid tag: tag `GPU` has characters other than a-z, 0-9, `.`, `_`, `:` and `-`"
        );
        assert!(state.workers.is_empty());
    }
}

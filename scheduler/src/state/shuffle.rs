//! Exchanges: what the scheduler tracks of a P2P shuffle. Per reducer stage, the worker that
//! receives each partition; per exchange, which mappers must send again after pieces were lost.
//! Never a task, a record or a message per mapper x reducer pair: pieces go worker to worker.
//!
//! Partition r of every exchange into one reducer stage goes to the same worker (a join reads
//! partition r of both sides), and reducer r runs there. When that worker is lost before the
//! reducer finished, or the reducer must run again after its worker dropped the pieces, the
//! partition moves to a live worker and every mapper of its exchanges runs again, sending just
//! the partitions that were lost.

use std::collections::{BTreeSet, HashMap, HashSet};

use wrk_proto::stage_input::Pattern;
use wrk_proto::{ExchangeSource, ExchangeTargets, JobSpec, ShufflePeer};

use super::{Job, TaskStatus, Worker};

/// One exchange: the mappers of `mapper_stage` send to the reducers of its placement's stage.
#[derive(Debug)]
pub(super) struct Exchange {
    pub name: String,
    pub mapper_stage: u32,
    /// Partitions that mappers which already sent everything once must send again.
    resend: BTreeSet<u32>,
    /// Mappers whose finished attempt sent every partition.
    sent_all: Vec<bool>,
    /// Running mappers that must run once more when they finish (pieces they sent were lost
    /// while they ran).
    rerun_after: HashSet<u32>,
}

/// Where the partitions of one reducer stage (a stage with shuffle inputs) are received.
#[derive(Debug)]
pub(super) struct Placement {
    pub reducer_stage: u32,
    /// The reducer stage's required tags: partitions go to workers having them.
    requires: Vec<String>,
    /// The worker receiving each partition; empty until the first mapper starts.
    targets: Vec<String>,
    /// Partitions whose worker dropped the pieces after their reducer succeeded.
    consumed: Vec<bool>,
    pub exchanges: Vec<Exchange>,
}

/// The placements of a job's reducer stages.
pub(super) fn placements(spec: &JobSpec) -> Vec<Placement> {
    let mut placements = Vec::new();
    for (s, stage) in spec.stages.iter().enumerate() {
        let exchanges: Vec<Exchange> = stage
            .inputs
            .iter()
            .filter(|i| i.pattern() == Pattern::Shuffle)
            .map(|i| Exchange {
                name: i.exchange.clone(),
                mapper_stage: i.stage,
                resend: BTreeSet::new(),
                sent_all: vec![false; spec.stages[i.stage as usize].num_tasks as usize],
                rerun_after: HashSet::new(),
            })
            .collect();
        if !exchanges.is_empty() {
            placements.push(Placement {
                reducer_stage: s as u32,
                requires: stage.requires.clone(),
                targets: Vec::new(),
                consumed: vec![false; stage.num_tasks as usize],
                exchanges,
            });
        }
    }
    placements
}

/// Workers that can receive partitions of reducers requiring `requires`, in a stable order: those
/// having the tags, or, while none is connected, any (the pieces must land somewhere).
fn live_workers<'a>(workers: &'a HashMap<String, Worker>, requires: &[String]) -> Vec<&'a String> {
    let mut live: Vec<&String> = workers
        .iter()
        .filter(|(_, w)| w.has_tags(requires))
        .map(|(id, _)| id)
        .collect();
    if live.is_empty() {
        live = workers.keys().collect();
    }
    live.sort_unstable();
    live
}

impl Placement {
    /// Gives every partition without a live worker one, spreading partitions evenly; returns
    /// whether some partition moved.
    fn place(&mut self, workers: &HashMap<String, Worker>, offset: usize) -> bool {
        let live = live_workers(workers, &self.requires);
        if live.is_empty() {
            return false;
        }
        let partitions = self.consumed.len();
        if self.targets.is_empty() {
            self.targets = (0..partitions)
                .map(|r| live[(r + offset) % live.len()].clone())
                .collect();
            return true;
        }
        let mut moved = false;
        for (r, target) in self.targets.iter_mut().enumerate() {
            if !workers.contains_key(target) {
                *target = live[(r + offset) % live.len()].clone();
                moved = true;
            }
        }
        moved
    }
}

impl Job {
    /// The placement and exchange index of the exchanges `stage` sends to, as a mapper.
    fn exchanges_from(&self, stage: u32) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.shuffles
            .iter()
            .enumerate()
            .flat_map(move |(p, placement)| {
                placement
                    .exchanges
                    .iter()
                    .enumerate()
                    .filter(move |(_, e)| e.mapper_stage == stage)
                    .map(move |(e, _)| (p, e))
            })
    }

    /// Whether every mapper of the exchanges into reducer stage `stage` is done.
    pub(super) fn shuffle_inputs_ready(&self, stage: u32) -> bool {
        self.spec.stages[stage as usize]
            .inputs
            .iter()
            .filter(|i| i.pattern() == Pattern::Shuffle)
            .all(|i| self.done[i.stage as usize] == self.spec.stages[i.stage as usize].num_tasks)
    }

    /// The worker reducer `(stage, index)` must run on, if it is a reducer with a placement.
    pub(super) fn pinned_worker(&self, stage: u32, index: u32) -> Option<&str> {
        self.shuffles
            .iter()
            .find(|p| p.reducer_stage == stage)
            .and_then(|p| p.targets.get(index as usize))
            .map(String::as_str)
    }

    /// What mapper `(stage, index)` sends, placing the partitions first if needed.
    pub(super) fn exchange_targets(
        &mut self,
        stage: u32,
        index: u32,
        workers: &HashMap<String, Worker>,
        offset: usize,
    ) -> Vec<ExchangeTargets> {
        let routes: Vec<(usize, usize)> = self.exchanges_from(stage).collect();
        let mut sends = Vec::with_capacity(routes.len());
        for (p, e) in routes {
            let placement = &mut self.shuffles[p];
            placement.place(workers, offset);
            let exchange = &placement.exchanges[e];
            let mut peers: Vec<ShufflePeer> = Vec::new();
            let mut peer_index: HashMap<&str, u32> = HashMap::new();
            let mut partition_peer = Vec::with_capacity(placement.targets.len());
            let only_resend = exchange.sent_all[index as usize];
            for (r, target) in placement.targets.iter().enumerate() {
                if only_resend && !exchange.resend.contains(&(r as u32)) {
                    partition_peer.push(u32::MAX);
                    continue;
                }
                let next = peer_index.len() as u32;
                let i = *peer_index.entry(target.as_str()).or_insert_with(|| {
                    let worker = workers.get(target);
                    peers.push(ShufflePeer {
                        worker_id: target.clone(),
                        tcp_address: worker
                            .map(|w| w.shuffle_address.clone())
                            .unwrap_or_default(),
                        ucx_address: worker.map(|w| w.ucx_address.clone()).unwrap_or_default(),
                    });
                    next
                });
                partition_peer.push(i);
            }
            // "Not sent by this attempt" is `peers.len()`, known only now.
            let skip = peers.len() as u32;
            for peer in &mut partition_peer {
                if *peer == u32::MAX {
                    *peer = skip;
                }
            }
            sends.push(ExchangeTargets {
                exchange: exchange.name.clone(),
                partitions: placement.targets.len() as u32,
                peers,
                partition_peer,
            });
        }
        sends
    }

    /// What reducer `(stage, index)` receives.
    pub(super) fn exchange_sources(&self, stage: u32, index: u32) -> Vec<ExchangeSource> {
        self.spec.stages[stage as usize]
            .inputs
            .iter()
            .filter(|i| i.pattern() == Pattern::Shuffle)
            .map(|i| ExchangeSource {
                exchange: i.exchange.clone(),
                partition: index,
                mappers: self.spec.stages[i.stage as usize].num_tasks,
            })
            .collect()
    }

    /// Mapper `(stage, index)` finished: whether it must run again (pieces it sent were lost
    /// while it ran). Otherwise it has sent everything it owed.
    pub(super) fn mapper_finished(&mut self, stage: u32, index: u32) -> bool {
        let routes: Vec<(usize, usize)> = self.exchanges_from(stage).collect();
        let mut again = false;
        for &(p, e) in &routes {
            again |= self.shuffles[p].exchanges[e].rerun_after.remove(&index);
        }
        if !again {
            for (p, e) in routes {
                self.shuffles[p].exchanges[e].sent_all[index as usize] = true;
            }
        }
        again
    }

    /// Every mapper of the exchanges `stage` sends to is done: nothing is owed any more.
    pub(super) fn mappers_all_done(&mut self, stage: u32) {
        let routes: Vec<(usize, usize)> = self.exchanges_from(stage).collect();
        for (p, e) in routes {
            let exchange = &self.shuffles[p].exchanges[e];
            if self.done[exchange.mapper_stage as usize] == exchange.sent_all.len() as u32 {
                self.shuffles[p].exchanges[e].resend.clear();
            }
        }
    }

    /// Reducer `(stage, index)` succeeded: its worker dropped the pieces it read.
    pub(super) fn reducer_finished(&mut self, stage: u32, index: u32) {
        if let Some(placement) = self.shuffles.iter_mut().find(|p| p.reducer_stage == stage)
            && let Some(consumed) = placement.consumed.get_mut(index as usize)
        {
            *consumed = true;
        }
    }

    /// Whether `stage` sends to or receives from an exchange with a partition on a worker that
    /// is gone.
    pub(super) fn has_dead_targets(&self, stage: u32, workers: &HashMap<String, Worker>) -> bool {
        self.shuffles.iter().any(|p| {
            (p.reducer_stage == stage || p.exchanges.iter().any(|e| e.mapper_stage == stage))
                && p.targets.iter().any(|t| !workers.contains_key(t))
        })
    }

    /// Workers holding pieces an unfinished reducer still needs.
    pub(super) fn shuffle_holders(&self) -> impl Iterator<Item = &str> + '_ {
        self.shuffles.iter().flat_map(move |placement| {
            placement
                .targets
                .iter()
                .enumerate()
                .filter(move |&(r, _)| {
                    !placement.consumed[r]
                        && !matches!(
                            self.tasks[placement.reducer_stage as usize][r].status,
                            TaskStatus::Done { .. }
                        )
                })
                .map(|(_, target)| target.as_str())
        })
    }

    /// Moves the partitions whose pieces are gone (their worker lost, or dropped after their
    /// reducer finished) while an unfinished reducer needs them, and makes every mapper of their
    /// exchanges send them again. Returns how many partitions moved.
    pub(super) fn repair_shuffles(
        &mut self,
        workers: &HashMap<String, Worker>,
        offset: usize,
    ) -> usize {
        let mut repaired = 0;
        if workers.is_empty() {
            // Nowhere to move partitions to: dispatch repairs them when workers are back.
            return 0;
        }
        for p in 0..self.shuffles.len() {
            let placement = &self.shuffles[p];
            if placement.targets.is_empty() {
                continue;
            }
            let stage = placement.reducer_stage as usize;
            let lost: Vec<u32> = (0..placement.targets.len())
                .filter(|&r| {
                    !matches!(self.tasks[stage][r].status, TaskStatus::Done { .. })
                        && (placement.consumed[r] || !workers.contains_key(&placement.targets[r]))
                })
                .map(|r| r as u32)
                .collect();
            if lost.is_empty() {
                continue;
            }
            repaired += lost.len();
            let placement = &mut self.shuffles[p];
            placement.place(workers, offset);
            for &r in &lost {
                placement.consumed[r as usize] = false;
            }
            let mut mappers = Vec::new();
            for exchange in &mut placement.exchanges {
                exchange.resend.extend(lost.iter().copied());
                mappers.push(exchange.mapper_stage);
            }
            for mapper_stage in mappers {
                for m in 0..self.tasks[mapper_stage as usize].len() as u32 {
                    match self.tasks[mapper_stage as usize][m as usize].status {
                        TaskStatus::Done { .. } => {
                            self.set_status(mapper_stage, m, TaskStatus::Ready);
                        }
                        TaskStatus::Running { .. } => {
                            for exchange in &mut self.shuffles[p].exchanges {
                                if exchange.mapper_stage == mapper_stage {
                                    exchange.rerun_after.insert(m);
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
        repaired
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{T, add_worker, assigned, job_state, worker_of};
    use super::super::{Outgoing, State};
    use wrk_proto::stage_input::Pattern;
    use wrk_proto::{AssignTask, JobSpec, JobState, Stage, StageInput, TaskDone};

    /// map (3 tasks) -> exchange `x` -> reduce (3 partitions).
    fn shuffle_job() -> JobSpec {
        JobSpec {
            name: "shuffle".into(),
            stages: vec![
                Stage {
                    name: "map".into(),
                    module_hash: "h".into(),
                    num_tasks: 3,
                    ..Default::default()
                },
                Stage {
                    name: "reduce".into(),
                    module_hash: "h".into(),
                    num_tasks: 3,
                    inputs: vec![StageInput {
                        stage: 0,
                        pattern: Pattern::Shuffle as i32,
                        exchange: "x".into(),
                    }],
                    ..Default::default()
                },
            ],
            ..Default::default()
        }
    }

    fn finish(state: &mut State, task: &AssignTask) -> Outgoing {
        let worker = worker_of(state, task);
        state.task_done(
            &worker,
            TaskDone {
                task: task.task.clone(),
                outputs: if task.task.as_ref().unwrap().stage == 0 {
                    Vec::new()
                } else {
                    vec![wrk_proto::OutputMeta { rows: 1, bytes: 8 }]
                },
                stats: None,
            },
        )
    }

    /// The partitions a mapper assignment sends, and to which worker.
    fn sent(task: &AssignTask) -> Vec<(u32, String)> {
        let targets = &task.sends[0];
        targets
            .partition_peer
            .iter()
            .enumerate()
            .filter_map(|(r, &peer)| {
                targets
                    .peers
                    .get(peer as usize)
                    .map(|p| (r as u32, p.worker_id.clone()))
            })
            .collect()
    }

    #[test]
    fn reducers_run_where_their_partition_is_and_a_lost_partition_is_sent_again_alone() {
        let mut state = State::new();
        let _inboxes: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|w| add_worker(&mut state, w, 4))
            .collect();
        let (job, _) = state.submit(T, shuffle_job());
        let maps = assigned(&state.dispatch());
        assert_eq!(maps.len(), 3, "reducers wait for every mapper");
        let targets = sent(&maps[0]);
        assert_eq!(targets.len(), 3, "a first attempt sends every partition");
        for map in &maps {
            assert_eq!(sent(map), targets, "every mapper sends partition r alike");
            assert!(map.receives.is_empty());
        }
        let mut workers: Vec<&str> = targets.iter().map(|(_, w)| w.as_str()).collect();
        workers.sort_unstable();
        assert_eq!(workers, ["a", "b", "c"], "partitions are spread");

        let mut reducers = Vec::new();
        for map in &maps {
            reducers.extend(assigned(&finish(&mut state, map)));
        }
        assert_eq!(
            reducers.len(),
            3,
            "the last mapper makes every reducer ready"
        );
        for reducer in &reducers {
            let r = reducer.task.as_ref().unwrap().index;
            assert_eq!(worker_of(&state, reducer), targets[r as usize].1);
            assert_eq!(reducer.receives.len(), 1);
            assert_eq!(
                (reducer.receives[0].partition, reducer.receives[0].mappers),
                (r, 3)
            );
            assert!(reducer.sends.is_empty());
        }

        // The worker of partition 1 dies while its reducer runs: partition 1 moves, and every
        // mapper runs again sending partition 1 only.
        let lost = targets[1].1.clone();
        let rerun = assigned(&state.worker_lost(&lost, "killed"));
        let mut remaps: Vec<&AssignTask> = rerun
            .iter()
            .filter(|a| a.task.as_ref().unwrap().stage == 0)
            .collect();
        remaps.sort_by_key(|a| a.task.as_ref().unwrap().index);
        assert_eq!(remaps.len(), 3, "{rerun:?}");
        let moved = sent(remaps[0]);
        assert_eq!(moved.len(), 1, "only the lost partition is sent again");
        assert_eq!(moved[0].0, 1);
        assert_ne!(moved[0].1, lost);
        for remap in &remaps {
            assert_eq!(sent(remap), moved);
            assert_eq!(remap.task.as_ref().unwrap().attempt, 2);
        }

        // The other reducers were not disturbed: they finish.
        for reducer in reducers
            .iter()
            .filter(|r| r.task.as_ref().unwrap().index != 1)
        {
            finish(&mut state, reducer);
        }
        let mut last = Vec::new();
        for remap in remaps {
            last.extend(assigned(&finish(&mut state, remap)));
        }
        assert_eq!(last.len(), 1, "{last:?}");
        assert_eq!(last[0].task.as_ref().unwrap().index, 1);
        assert_eq!(worker_of(&state, &last[0]), moved[0].1);
        finish(&mut state, &last[0]);
        assert_eq!(job_state(&state, &job), JobState::Succeeded);
    }

    #[test]
    fn a_reducer_rerun_after_its_pieces_were_consumed_gets_them_sent_again() {
        let mut state = State::new();
        let _inboxes: Vec<_> = ["a", "b"]
            .iter()
            .map(|w| add_worker(&mut state, w, 4))
            .collect();
        let mut spec = shuffle_job();
        // A third stage reads the reducers' outputs one to one: losing them after the reducers
        // finished means running reducers again.
        spec.stages.push(Stage {
            name: "after".into(),
            module_hash: "h".into(),
            num_tasks: 3,
            inputs: vec![StageInput {
                stage: 1,
                pattern: Pattern::OneToOne as i32,
                ..Default::default()
            }],
            ..Default::default()
        });
        let (job, _) = state.submit(T, spec);
        let maps = assigned(&state.dispatch());
        let mut reducers = Vec::new();
        for map in &maps {
            reducers.extend(assigned(&finish(&mut state, map)));
        }
        let mut followers = Vec::new();
        for reducer in &reducers {
            followers.extend(
                assigned(&finish(&mut state, reducer))
                    .into_iter()
                    .filter(|a| a.task.as_ref().unwrap().stage == 2),
            );
        }
        // Kill a worker holding reducer outputs that the third stage still needs: they are
        // recomputed, and their pieces (dropped once read) are sent again by every mapper.
        let victim = worker_of(&state, &followers[0]);
        let followers: Vec<AssignTask> = followers
            .into_iter()
            .filter(|f| worker_of(&state, f) != victim)
            .collect();
        let out = state.worker_lost(&victim, "killed");
        let remaps: Vec<AssignTask> = assigned(&out)
            .into_iter()
            .filter(|a| a.task.as_ref().unwrap().stage == 0)
            .collect();
        assert_eq!(remaps.len(), 3, "every mapper sends again");
        let resent: Vec<u32> = sent(&remaps[0]).into_iter().map(|(r, _)| r).collect();
        assert!(!resent.is_empty() && resent.len() < 3, "{resent:?}");
        let mut pending = remaps;
        // Followers on the surviving worker are still running.
        pending.extend(followers);
        let mut rounds = 0;
        while job_state(&state, &job) == JobState::Running {
            let task = pending.pop().expect("work remains while the job runs");
            pending.extend(assigned(&finish(&mut state, &task)));
            rounds += 1;
            assert!(rounds < 50, "the job does not converge");
        }
        assert_eq!(job_state(&state, &job), JobState::Succeeded);
    }
}

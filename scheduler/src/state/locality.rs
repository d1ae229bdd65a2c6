//! Data locality in placement: which worker holds a task's inputs, and whether the task should
//! wait for that worker rather than move its inputs to another.
//!
//! Like Dask's `decide_worker`, a placement compares the time the tasks queued ahead of a task
//! on the worker holding its inputs should take with the time its inputs would take to move
//! ([`TransferRate`]: what the workers measure of their fetches). Tasks are expected to last as long as the finished tasks
//! of their stage in the same job; before one has finished, as long as the tasks of the same
//! module and stage name in earlier jobs (Dask's task-prefix durations); failing both, the
//! worker's recent mean.

use std::collections::HashMap;

use super::{Job, State, TaskRef, TaskStatus, Worker, output_bytes};

/// The rate a placement assumes partitions move between workers at until a worker has
/// measured one. A peer fetch moves about 2 GB/s over loopback here; 1 GB/s stands for a 10 GbE
/// link.
const ASSUMED_BYTES_PER_SECOND: f64 = 1e9;

/// Reported rates are held within these bounds (a worker's clock or a bug cannot make moving
/// data look free or impossible).
const REPORTED_BYTES_PER_SECOND: std::ops::RangeInclusive<f64> = 1e6..=1e12;

/// The weight of the latest job's tasks in a stage's duration across jobs.
const HISTORY_WEIGHT: f64 = 0.5;

/// Module-and-stage pairs remembered; past this the history starts again.
const HISTORY_ENTRIES: usize = 4096;

/// The rate partitions move between workers at, as the workers measure their fetches and
/// report in heartbeats (Dask's `bandwidth`): a running mean over the reports, each weighing
/// one part in (workers + 1), so that it follows the workers' mean rate.
#[derive(Debug)]
pub(super) struct TransferRate {
    bytes_per_second: f64,
}

impl Default for TransferRate {
    fn default() -> Self {
        TransferRate {
            bytes_per_second: ASSUMED_BYTES_PER_SECOND,
        }
    }
}

impl TransferRate {
    /// Counts a rate one of `workers` workers reported.
    pub(super) fn observe(&mut self, reported: f64, workers: usize) {
        if !reported.is_finite() {
            return;
        }
        let reported = reported.clamp(
            *REPORTED_BYTES_PER_SECOND.start(),
            *REPORTED_BYTES_PER_SECOND.end(),
        );
        self.bytes_per_second += (reported - self.bytes_per_second) / (workers as f64 + 1.0);
    }

    pub(super) fn bytes_per_second(&self) -> f64 {
        self.bytes_per_second
    }

    /// Seconds to move `bytes` between workers.
    pub(super) fn seconds(&self, bytes: u64) -> f64 {
        bytes as f64 / self.bytes_per_second
    }
}

/// Where a task's inputs say it should go ([`State::locality`]).
pub(super) enum Locality {
    /// To this worker, which holds most of its inputs: it has a slot free, or room to queue
    /// the task behind tasks that should finish before the inputs could move.
    Place(String),
    /// This worker holds most of its inputs and has no room now, but its tasks should finish
    /// before the inputs could move: the task waits for it in the ready queue.
    Wait(String),
    /// Wherever a slot is free first: no worker's inputs are worth waiting for. The holder of
    /// most of them, when it has room to queue the task, comes before other queues.
    Anywhere(Option<String>),
}

/// Mean task durations per module and stage name, across jobs.
#[derive(Default)]
pub(super) struct DurationHistory {
    seconds: HashMap<(String, String), f64>,
}

impl DurationHistory {
    /// Counts a task of stage `stage` of module `module_hash` that ran for `seconds`.
    pub(super) fn observe(&mut self, module_hash: &str, stage: &str, seconds: f64) {
        let key = (module_hash.to_string(), stage.to_string());
        if let Some(mean) = self.seconds.get_mut(&key) {
            *mean += (seconds - *mean) * HISTORY_WEIGHT;
            return;
        }
        if self.seconds.len() >= HISTORY_ENTRIES {
            self.seconds.clear();
        }
        self.seconds.insert(key, seconds);
    }

    fn get(&self, module_hash: &str, stage: &str) -> Option<f64> {
        self.seconds
            .get(&(module_hash.to_string(), stage.to_string()))
            .copied()
    }
}

impl State {
    /// Bytes of `task`'s inputs each worker holds: the upstream outputs it reads and the
    /// dataset partition it reads, if any.
    pub(super) fn input_bytes_by_worker<'a>(
        &'a self,
        job: &'a Job,
        task: TaskRef,
    ) -> HashMap<&'a str, u64> {
        let mut bytes_by_worker: HashMap<&str, u64> = HashMap::new();
        for (stage, index) in job.inputs_of(task.stage, task.index) {
            if let TaskStatus::Done { worker, outputs } =
                &job.tasks[stage as usize][index as usize].status
            {
                *bytes_by_worker.entry(worker.as_str()).or_default() += output_bytes(outputs);
            }
        }
        if let Some((worker, bytes)) = self.dataset_holders(task) {
            *bytes_by_worker.entry(worker).or_default() += bytes;
        }
        bytes_by_worker
    }

    /// Where `task`'s inputs say it should go. The worker holding most of their bytes (with
    /// the tags `requires` and pool for `expected` bytes) is worth waiting for when the tasks
    /// ahead of this one there, and `waiting` more set aside for it already, should finish
    /// before those bytes could move to another worker.
    pub(super) fn locality(
        &self,
        job: &Job,
        task: TaskRef,
        expected: u64,
        requires: &[String],
        waiting: &HashMap<String, usize>,
    ) -> Locality {
        let holder = self
            .input_bytes_by_worker(job, task)
            .into_iter()
            .filter_map(|(id, bytes)| {
                let w = self.workers.get(id)?;
                (!w.retiring && w.fits(expected) && w.has_tags(requires)).then_some((id, bytes, w))
            })
            .max_by_key(|(id, bytes, _)| (*bytes, std::cmp::Reverse(*id)));
        let Some((id, bytes, w)) = holder else {
            return Locality::Anywhere(None);
        };
        if w.has_open_slot() {
            return Locality::Place(id.to_string());
        }
        let transfer = self.transfer_rate.seconds(bytes);
        let set_aside = waiting.get(id).copied().unwrap_or(0) as f64
            * self
                .expected_seconds(task.job, task.stage)
                .or(w.task_seconds)
                .unwrap_or(f64::INFINITY);
        let worth_waiting = self
            .wait_seconds(w, None, set_aside, transfer)
            .is_some_and(|wait| wait < transfer);
        match (w.free() > 0, worth_waiting) {
            (true, true) => Locality::Place(id.to_string()),
            (false, true) => Locality::Wait(id.to_string()),
            (true, false) => Locality::Anywhere(Some(id.to_string())),
            (false, false) => Locality::Anywhere(None),
        }
    }

    /// Seconds the tasks of stage `stage` of job `number` are expected to take: the mean of
    /// its finished tasks, else that of the same module and stage name in earlier jobs.
    fn expected_seconds(&self, number: u64, stage: u32) -> Option<f64> {
        let job = self.jobs.get(&number)?;
        match job.durations.get(stage as usize) {
            Some(&(seconds, count)) if count > 0 => Some(seconds / f64::from(count)),
            _ => {
                let stage = job.spec.stages.get(stage as usize)?;
                self.durations.get(&stage.module_hash, &stage.name)
            }
        }
    }

    /// Seconds before a task would start on `w`: the expected work of the tasks assigned
    /// there (those assigned before `before` only, when given) plus `extra` seconds, spread
    /// over its slots. None when a task's duration cannot be estimated; the sum stops once
    /// past `enough`.
    pub(super) fn wait_seconds(
        &self,
        w: &Worker,
        before: Option<u64>,
        extra: f64,
        enough: f64,
    ) -> Option<f64> {
        let slots = f64::from(w.slots.max(1));
        let mut total = extra;
        for (&(job, stage, _), &(_, order)) in &w.running {
            if total / slots >= enough {
                break;
            }
            if before.is_some_and(|before| order >= before) {
                continue;
            }
            total += self.expected_seconds(job, stage).or(w.task_seconds)?;
        }
        Some(total / slots)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_follows_recent_jobs_per_module_and_stage() {
        let mut history = DurationHistory::default();
        assert_eq!(history.get("m", "read"), None);
        history.observe("m", "read", 0.2);
        history.observe("m", "read", 0.1);
        let mean = history.get("m", "read").unwrap();
        assert!((mean - 0.15).abs() < 1e-12, "{mean}");
        assert_eq!(history.get("m", "other"), None);
        assert_eq!(history.get("n", "read"), None);
        for i in 0..HISTORY_ENTRIES {
            history.observe("m", &format!("s{i}"), 1.0);
        }
        assert!(history.seconds.len() <= HISTORY_ENTRIES, "bounded");
    }

    #[test]
    fn transfers_are_timed_at_the_mean_of_the_reported_rates() {
        let mut rate = TransferRate::default();
        assert_eq!(rate.seconds(0), 0.0);
        assert!((rate.seconds(500_000_000) - 0.5).abs() < 1e-12, "assumed");
        // Two workers, reporting 100 MB/s and 300 MB/s heartbeat after heartbeat.
        for _ in 0..200 {
            rate.observe(1e8, 2);
            rate.observe(3e8, 2);
        }
        let mean = rate.bytes_per_second();
        assert!((1.5e8..2.5e8).contains(&mean), "{mean}");
        // Nonsense is bounded or ignored.
        rate.observe(f64::NAN, 2);
        assert_eq!(rate.bytes_per_second(), mean);
        for _ in 0..200 {
            rate.observe(0.0, 1);
        }
        assert!(rate.bytes_per_second() >= 1e6);
        for _ in 0..200 {
            rate.observe(f64::INFINITY, 1);
            rate.observe(1e300, 1);
        }
        assert!(rate.bytes_per_second() <= 1e12);
    }
}

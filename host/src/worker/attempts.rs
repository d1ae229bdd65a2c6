//! The task attempts assigned to a worker: each one's cancel flag, and whether it still waits
//! for a slot (so the scheduler may retract it and give it to an idle worker).
//!
//! Keyed by attempt, not by task: a retracted attempt may still sit in the slot queue when the
//! scheduler gives the same task back to this worker as a new attempt, and the old entry must
//! neither hide nor remove the new one's flag.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use wrk_proto::TaskId;

/// Job, stage, index and attempt.
type AttemptKey = (String, u32, u32, u32);

fn key(id: &TaskId) -> AttemptKey {
    (id.job_id.clone(), id.stage, id.index, id.attempt)
}

struct Attempt {
    cancel: Arc<AtomicBool>,
    /// Not started yet: the scheduler may still retract it.
    queued: bool,
}

#[derive(Default)]
pub(super) struct Attempts {
    attempts: Mutex<HashMap<AttemptKey, Attempt>>,
}

impl Attempts {
    /// Records a newly assigned attempt, queued; returns the flag that cancels it.
    pub(super) fn register(&self, id: &TaskId) -> Arc<AtomicBool> {
        let cancel = Arc::new(AtomicBool::new(false));
        if let Ok(mut attempts) = self.attempts.lock() {
            attempts.insert(
                key(id),
                Attempt {
                    cancel: cancel.clone(),
                    queued: true,
                },
            );
        }
        cancel
    }

    /// Gives back an attempt the scheduler retracts: true when it had not started (it never
    /// will here, and is forgotten), false when it started already (it runs and reports as
    /// usual).
    pub(super) fn retract(&self, id: &TaskId) -> bool {
        let Ok(mut attempts) = self.attempts.lock() else {
            return false;
        };
        let key = key(id);
        if attempts.get(&key).is_some_and(|a| a.queued) {
            attempts.remove(&key);
            return true;
        }
        false
    }

    /// Whether a queued attempt may start now (it was not retracted); it is no longer queued.
    pub(super) fn begin(&self, id: &TaskId) -> bool {
        self.attempts.lock().is_ok_and(|mut attempts| {
            attempts
                .get_mut(&key(id))
                .is_some_and(|a| std::mem::replace(&mut a.queued, false))
        })
    }

    /// Forgets an attempt that has ended.
    pub(super) fn finish(&self, id: &TaskId) {
        if let Ok(mut attempts) = self.attempts.lock() {
            attempts.remove(&key(id));
        }
    }

    /// Stops the attempts whose job, stage and index match, running or queued.
    pub(super) fn cancel_where(&self, matches: impl Fn(&str, u32, u32) -> bool) {
        if let Ok(attempts) = self.attempts.lock() {
            for ((job, stage, index, _), attempt) in attempts.iter() {
                if matches(job, *stage, *index) {
                    attempt.cancel.store(true, Ordering::Relaxed);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(index: u32, attempt: u32) -> TaskId {
        TaskId {
            job_id: "job-1".into(),
            stage: 0,
            index,
            attempt,
        }
    }

    #[test]
    fn a_retracted_attempt_never_starts_and_a_started_one_cannot_be_retracted() {
        let attempts = Attempts::default();
        attempts.register(&id(0, 1));
        attempts.register(&id(1, 1));
        assert!(attempts.retract(&id(0, 1)));
        assert!(
            !attempts.begin(&id(0, 1)),
            "retracted: it must not run here"
        );
        assert!(attempts.begin(&id(1, 1)));
        assert!(!attempts.retract(&id(1, 1)), "started: it runs and reports");
        assert!(!attempts.begin(&id(1, 1)), "an attempt starts once");
    }

    #[test]
    fn a_task_retracted_and_given_back_keeps_its_new_attempts_cancel_flag() {
        let attempts = Attempts::default();
        attempts.register(&id(0, 1));
        assert!(attempts.retract(&id(0, 1)));
        // The scheduler gives the task back to this worker before the slot reaches the old
        // attempt, which it then skips.
        let second = attempts.register(&id(0, 2));
        assert!(!attempts.begin(&id(0, 1)));
        attempts.finish(&id(0, 1));
        assert!(attempts.begin(&id(0, 2)));
        attempts.cancel_where(|job, stage, index| job == "job-1" && stage == 0 && index == 0);
        assert!(
            second.load(Ordering::Relaxed),
            "the cancel reaches the new attempt"
        );
    }

    #[test]
    fn cancelling_a_job_stops_its_queued_and_running_attempts_only() {
        let attempts = Attempts::default();
        let queued = attempts.register(&id(0, 1));
        let running = attempts.register(&id(1, 1));
        let other = attempts.register(&TaskId {
            job_id: "job-2".into(),
            ..id(0, 1)
        });
        assert!(attempts.begin(&id(1, 1)));
        attempts.cancel_where(|job, _, _| job == "job-1");
        assert!(queued.load(Ordering::Relaxed) && running.load(Ordering::Relaxed));
        assert!(!other.load(Ordering::Relaxed));
        attempts.finish(&id(1, 1));
        attempts.cancel_where(|_, _, _| true);
        assert!(other.load(Ordering::Relaxed));
    }
}

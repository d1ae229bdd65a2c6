//! The tasks one event places, gathered into one `AssignTasks` message per worker.

use std::collections::HashMap;

use wrk_proto::scheduler_message::Kind as ToWorker;
use wrk_proto::{AssignTask, AssignTasks};

use super::{Outgoing, WorkerOutbox, message};

/// Assignments made by one event, per worker (by its number), each worker's in the order they
/// were placed.
#[derive(Default)]
pub(super) struct Assignments {
    batches: Vec<(WorkerOutbox, Vec<AssignTask>)>,
    by_worker: HashMap<u32, usize>,
}

impl Assignments {
    /// Adds `task` to the message for the worker numbered `worker`.
    pub(super) fn add(&mut self, worker: u32, outbox: &WorkerOutbox, task: AssignTask) {
        let batch = *self.by_worker.entry(worker).or_insert_with(|| {
            self.batches.push((outbox.clone(), Vec::new()));
            self.batches.len() - 1
        });
        self.batches[batch].1.push(task);
    }

    /// Appends one message per worker to `out`, and starts over. Called before any other message
    /// to these workers joins `out`, so that a worker sees a task assigned before whatever follows
    /// about it (a cancel, a retract, its job's release).
    pub(super) fn flush_into(&mut self, out: &mut Outgoing) {
        self.by_worker.clear();
        out.extend(
            self.batches
                .drain(..)
                .map(|(outbox, tasks)| (outbox, message(ToWorker::Assign(AssignTasks { tasks })))),
        );
    }
}

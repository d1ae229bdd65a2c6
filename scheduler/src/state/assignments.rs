//! The tasks one event places, gathered into one `AssignTasks` message per worker (more than
//! one only when their inputs make a message large).

use prost::Message;
use wrk_proto::scheduler_message::Kind as ToWorker;
use wrk_proto::{AssignTask, AssignTasks, MAX_MESSAGE_BYTES};

use super::{Outgoing, WorkerOutbox, message};

/// A message takes no more tasks once their encoded size passes this: a task reading every
/// output of a large stage carries a location per output, and many such tasks in one message
/// would pass the gRPC limit (a task alone stays within it, as before batching).
const MAX_BATCH_BYTES: usize = MAX_MESSAGE_BYTES / 16;

/// Assignments made by one event, per worker (by its number), each worker's in the order they
/// were placed.
#[derive(Default)]
pub(super) struct Assignments {
    /// The messages so far: the worker's number and outbox, the tasks, their encoded size.
    batches: Vec<Batch>,
}

struct Batch {
    worker: u32,
    outbox: WorkerOutbox,
    tasks: Vec<AssignTask>,
    bytes: usize,
}

impl Assignments {
    /// Adds `task` to the message for the worker numbered `worker`.
    ///
    /// A worker's message is found by a scan from the latest: an event usually places tasks on
    /// one or two workers, and at most on every worker (a job's first dispatch), so the scan is
    /// cheaper than hashing but for those first dispatches (about a millisecond for 1,000
    /// workers).
    pub(super) fn add(&mut self, worker: u32, outbox: &WorkerOutbox, task: AssignTask) {
        let bytes = task.encoded_len();
        let open = self
            .batches
            .iter()
            .rposition(|b| b.worker == worker)
            .filter(|&i| self.batches[i].bytes + bytes <= MAX_BATCH_BYTES);
        let batch = match open {
            Some(i) => &mut self.batches[i],
            None => {
                self.batches.push(Batch {
                    worker,
                    outbox: outbox.clone(),
                    tasks: Vec::new(),
                    bytes: 0,
                });
                let last = self.batches.len() - 1;
                &mut self.batches[last]
            }
        };
        batch.tasks.push(task);
        batch.bytes += bytes;
    }

    /// Appends one message per worker to `out`, and starts over. Called before any other message
    /// to these workers joins `out`, so that a worker sees a task assigned before whatever follows
    /// about it (a cancel, a retract, its job's release).
    pub(super) fn flush_into(&mut self, out: &mut Outgoing) {
        out.extend(self.batches.drain(..).map(|b| {
            (
                b.outbox,
                message(ToWorker::Assign(AssignTasks { tasks: b.tasks })),
            )
        }));
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;
    use wrk_proto::{PartitionLocation, TaskId, TaskInput, task_input};

    use super::*;

    /// A task of index `index` carrying `inputs` partition locations of about 100 bytes each.
    fn task(index: u32, inputs: usize) -> AssignTask {
        AssignTask {
            task: Some(TaskId {
                index,
                ..Default::default()
            }),
            inputs: (0..inputs)
                .map(|_| TaskInput {
                    kind: Some(task_input::Kind::Partition(PartitionLocation {
                        address: "x".repeat(100),
                        ..Default::default()
                    })),
                })
                .collect(),
            ..Default::default()
        }
    }

    /// The task indices of each message of `out`.
    fn messages(out: &Outgoing) -> Vec<Vec<u32>> {
        out.iter()
            .map(|(_, m)| match &m.kind {
                Some(ToWorker::Assign(a)) => a
                    .tasks
                    .iter()
                    .map(|t| t.task.as_ref().map_or(u32::MAX, |t| t.index))
                    .collect(),
                other => panic!("not an assignment: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn each_worker_gets_its_tasks_in_one_message_in_order() {
        let (a, _a) = mpsc::unbounded_channel();
        let (b, _b) = mpsc::unbounded_channel();
        let mut assigned = Assignments::default();
        for (index, worker) in [(0, 1), (1, 2), (2, 1), (3, 1), (4, 2)] {
            assigned.add(worker, if worker == 1 { &a } else { &b }, task(index, 0));
        }
        let mut out = Vec::new();
        assigned.flush_into(&mut out);
        assert_eq!(messages(&out), vec![vec![0, 2, 3], vec![1, 4]]);
        assert!(out[0].0.same_channel(&a) && out[1].0.same_channel(&b));
        // Flushed: the next event starts over.
        assigned.add(1, &a, task(5, 0));
        let mut out = Vec::new();
        assigned.flush_into(&mut out);
        assert_eq!(messages(&out), vec![vec![5]]);
    }

    #[test]
    fn tasks_with_many_inputs_are_split_over_messages_within_the_limit() {
        let (a, _a) = mpsc::unbounded_channel();
        let mut assigned = Assignments::default();
        // Each task is a bit over a third of the limit: two fit in a message, not three.
        let inputs = MAX_BATCH_BYTES / 3 / 100;
        for index in 0..5 {
            assigned.add(1, &a, task(index, inputs));
        }
        let mut out = Vec::new();
        assigned.flush_into(&mut out);
        assert_eq!(messages(&out), vec![vec![0, 1], vec![2, 3], vec![4]]);
        for (_, m) in &out {
            assert!(m.encoded_len() <= MAX_BATCH_BYTES + 64);
        }
    }
}

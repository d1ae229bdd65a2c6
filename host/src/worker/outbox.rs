//! The worker's messages to the scheduler, as its gRPC stream sends them: the task reports that
//! are waiting in the outbox when the stream is polled go out together, as one `TaskReports`.
//! Nothing waits to be batched: a lone report goes out as soon as the stream is polled, and
//! reports only merge when they ended while the previous message was on its way.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use tokio::sync::mpsc;
use wrk_proto::worker_message::Kind;
use wrk_proto::{TaskReports, WorkerMessage};

/// Most task reports one message carries.
const MAX_REPORTS: usize = 512;

/// A stream of the outbox's messages in order, consecutive task reports merged.
pub struct Coalesced {
    outbox: mpsc::Receiver<WorkerMessage>,
    /// A message taken from the outbox that could not join the previous one: it goes next.
    held: Option<WorkerMessage>,
}

impl Coalesced {
    pub fn new(outbox: mpsc::Receiver<WorkerMessage>) -> Self {
        Coalesced { outbox, held: None }
    }
}

fn reports(reports: TaskReports) -> WorkerMessage {
    WorkerMessage {
        kind: Some(Kind::Reports(reports)),
    }
}

impl Stream for Coalesced {
    type Item = WorkerMessage;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<WorkerMessage>> {
        let this = self.get_mut();
        let first = match this.held.take() {
            Some(message) => message,
            None => match this.outbox.poll_recv(cx) {
                Poll::Ready(Some(message)) => message,
                other => return other,
            },
        };
        let Some(Kind::Reports(mut batch)) = first.kind else {
            return Poll::Ready(Some(first));
        };
        while batch.done.len() + batch.failed.len() < MAX_REPORTS {
            let Ok(next) = this.outbox.try_recv() else {
                break;
            };
            match next.kind {
                Some(Kind::Reports(more)) => {
                    batch.done.extend(more.done);
                    batch.failed.extend(more.failed);
                }
                kind => {
                    this.held = Some(WorkerMessage { kind });
                    break;
                }
            }
        }
        Poll::Ready(Some(reports(batch)))
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;
    use wrk_proto::{Heartbeat, TaskDone, TaskFailed, TaskId};

    use super::*;

    fn id(index: u32) -> Option<TaskId> {
        Some(TaskId {
            job_id: "job".into(),
            index,
            ..Default::default()
        })
    }

    fn done(index: u32) -> WorkerMessage {
        reports(TaskReports {
            done: vec![TaskDone {
                task: id(index),
                ..Default::default()
            }],
            failed: Vec::new(),
        })
    }

    fn failed(index: u32) -> WorkerMessage {
        reports(TaskReports {
            done: Vec::new(),
            failed: vec![TaskFailed {
                task: id(index),
                error: "trap".into(),
                ..Default::default()
            }],
        })
    }

    fn heartbeat() -> WorkerMessage {
        WorkerMessage {
            kind: Some(Kind::Heartbeat(Heartbeat::default())),
        }
    }

    /// The indices of the tasks a message reports done and failed, or `None` for another kind.
    fn reported(message: &WorkerMessage) -> Option<(Vec<u32>, Vec<u32>)> {
        let index = |task: &Option<TaskId>| task.as_ref().map_or(u32::MAX, |t| t.index);
        match &message.kind {
            Some(Kind::Reports(r)) => Some((
                r.done.iter().map(|d| index(&d.task)).collect(),
                r.failed.iter().map(|f| index(&f.task)).collect(),
            )),
            _ => None,
        }
    }

    #[tokio::test]
    async fn waiting_reports_go_out_as_one_message_and_other_messages_keep_their_place() {
        let (outbox, receiver) = mpsc::channel(64);
        for message in [done(0), failed(1), done(2), heartbeat(), done(3), done(4)] {
            outbox.send(message).await.unwrap();
        }
        drop(outbox);
        let sent: Vec<_> = Coalesced::new(receiver).collect().await;
        assert_eq!(sent.len(), 3, "{sent:?}");
        assert_eq!(reported(&sent[0]), Some((vec![0, 2], vec![1])));
        assert!(matches!(sent[1].kind, Some(Kind::Heartbeat(_))));
        assert_eq!(reported(&sent[2]), Some((vec![3, 4], vec![])));
    }

    #[tokio::test]
    async fn a_lone_report_goes_out_at_once() {
        let (outbox, receiver) = mpsc::channel(64);
        let mut stream = Coalesced::new(receiver);
        outbox.send(done(7)).await.unwrap();
        let first = stream.next().await.unwrap();
        assert_eq!(reported(&first), Some((vec![7], vec![])));
        outbox.send(failed(8)).await.unwrap();
        let second = stream.next().await.unwrap();
        assert_eq!(reported(&second), Some((vec![], vec![8])));
    }

    #[tokio::test]
    async fn a_message_carries_at_most_max_reports() {
        let (outbox, receiver) = mpsc::channel(2 * MAX_REPORTS);
        for index in 0..(MAX_REPORTS + 3) as u32 {
            outbox.send(done(index)).await.unwrap();
        }
        drop(outbox);
        let sent: Vec<_> = Coalesced::new(receiver).collect().await;
        let counts: Vec<usize> = sent
            .iter()
            .map(|m| reported(m).map_or(0, |(done, _)| done.len()))
            .collect();
        assert_eq!(counts, vec![MAX_REPORTS, 3]);
    }
}

//! A job's progress as `WatchJob` streams it: the state when the watch begins, then the latest
//! state at most once per [`PROGRESS_INTERVAL`] while the job runs, and its end at once. A job
//! changes at every task start and end; sending each change would cost a message per change
//! (thousands a second) for a progress bar, and the end of a job never waits.

use std::time::{Duration, Instant};

use futures::Stream;
use tokio::sync::watch;
use wrk_proto::{JobProgress, JobState};

/// A running job's progress goes to a watcher at most this often.
pub const PROGRESS_INTERVAL: Duration = Duration::from_millis(50);

/// Whether a job's progress is its last: it succeeded, failed or was cancelled.
fn is_final(progress: &JobProgress) -> bool {
    matches!(
        progress.state(),
        JobState::Succeeded | JobState::Failed | JobState::Cancelled
    )
}

/// The progress updates of the job `receiver` watches, ending after its final state (or when
/// the job is gone).
pub fn updates(receiver: watch::Receiver<JobProgress>) -> impl Stream<Item = JobProgress> {
    futures::stream::unfold(
        (receiver, None, false),
        |(mut receiver, sent, finished): (_, Option<Instant>, bool)| async move {
            if finished {
                return None;
            }
            if let Some(sent) = sent {
                if receiver.changed().await.is_err() {
                    return None;
                }
                // Changes until the interval is over join this update, unless the job ends.
                if !is_final(&receiver.borrow()) {
                    let _ = tokio::time::timeout_at(
                        (sent + PROGRESS_INTERVAL).into(),
                        receiver.wait_for(is_final),
                    )
                    .await;
                }
            }
            let progress = receiver.borrow_and_update().clone();
            let finished = is_final(&progress);
            Some((progress, (receiver, Some(Instant::now()), finished)))
        },
    )
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;
    use wrk_proto::StageProgress;

    use super::*;

    fn progress(state: JobState, done: u32) -> JobProgress {
        JobProgress {
            state: state as i32,
            stages: vec![StageProgress {
                done,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn done(p: &JobProgress) -> u32 {
        p.stages[0].done
    }

    #[tokio::test]
    async fn many_changes_in_an_interval_make_one_update_with_the_latest_state() {
        let (sender, receiver) = watch::channel(progress(JobState::Running, 0));
        let mut updates = Box::pin(updates(receiver));
        assert_eq!(done(&updates.next().await.unwrap()), 0, "the state at once");
        for n in 1..=1000 {
            sender.send_replace(progress(JobState::Running, n));
        }
        let update = updates.next().await.unwrap();
        assert_eq!(done(&update), 1000, "the latest state, not each change");
        sender.send_replace(progress(JobState::Running, 1001));
        let started = Instant::now();
        assert_eq!(done(&updates.next().await.unwrap()), 1001);
        assert!(
            started.elapsed() >= PROGRESS_INTERVAL / 2,
            "the next update waits out the interval"
        );
    }

    #[tokio::test]
    async fn the_end_of_a_job_goes_out_at_once_and_ends_the_stream() {
        let (sender, receiver) = watch::channel(progress(JobState::Running, 0));
        let mut updates = Box::pin(updates(receiver));
        updates.next().await.unwrap();
        sender.send_replace(progress(JobState::Running, 1));
        let started = Instant::now();
        // The job ends while its last update is held back for the interval.
        let ended = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            sender.send_replace(progress(JobState::Succeeded, 2));
            sender
        });
        let last = updates.next().await.unwrap();
        assert_eq!(last.state(), JobState::Succeeded);
        assert_eq!(done(&last), 2);
        assert!(
            started.elapsed() < PROGRESS_INTERVAL,
            "the end waited {:?}",
            started.elapsed()
        );
        let _sender = ended.await.unwrap();
        assert!(updates.next().await.is_none(), "nothing after the end");
    }

    #[tokio::test]
    async fn a_job_gone_ends_the_stream() {
        let (sender, receiver) = watch::channel(progress(JobState::Running, 0));
        let mut updates = Box::pin(updates(receiver));
        updates.next().await.unwrap();
        drop(sender);
        assert!(updates.next().await.is_none());
    }
}

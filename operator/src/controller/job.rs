//! Reconciliation of a `WrkJob`, through its whole life:
//!
//! 1. pick its cluster (a named one, or an ephemeral one created from the spec and owned by the
//!    `WrkJob`) and wait for the cluster's scheduler to be available;
//! 2. create the submitting batch Job (`wrk submit`), with what is left of the deadline as its
//!    `activeDeadlineSeconds`;
//! 3. follow it: `Pending` until its pod runs, `Running`, then `Succeeded` or `Failed` with the
//!    Job's reason (`DeadlineExceeded`, `BackoffLimitExceeded`); past the deadline the operator
//!    fails the `WrkJob` itself (reason `DeadlineExceeded`), whether or not the Job started, and
//!    deletes the Job (its pod's `wrk submit` cancels the job in the scheduler on SIGTERM);
//! 4. once finished, delete the ephemeral cluster at once (its GPUs are no longer needed: the
//!    results were fetched by `wrk submit`), and the `WrkJob` itself, with all it owns, after
//!    `ttlSecondsAfterFinished`. A finished `WrkJob` never starts anything again.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use tracing::info;

use super::Context;
use super::cluster::apply;
use crate::Error;
use crate::crd::{JobPhase, WrkCluster, WrkJob, WrkJobStatus};
use crate::render::job::{COMPONENT, LABEL_JOB, ephemeral_cluster, submit_job, submit_job_name};
use crate::render::{LABEL_COMPONENT, selector_string};
use crate::status::set_condition;

/// The reason of a `WrkJob` failed by its deadline.
pub const DEADLINE_EXCEEDED: &str = "DeadlineExceeded";

/// What the submitting Job says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub phase: JobPhase,
    /// When it finished (succeeded or failed).
    pub finished_at: Option<Timestamp>,
    /// The Job condition's reason and message, once finished.
    pub reason: String,
    pub message: String,
}

/// The outcome of a submitting Job; `pod_running` says whether its pod runs (a Job counts a pod
/// as active from its creation, long before it runs).
pub fn outcome(job: &Job, pod_running: bool, now: Timestamp) -> Outcome {
    let status = job.status.as_ref();
    let finished = status
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .find(|c| (c.type_ == "Complete" || c.type_ == "Failed") && c.status == "True");
    if let Some(c) = finished {
        let succeeded = c.type_ == "Complete";
        return Outcome {
            phase: if succeeded {
                JobPhase::Succeeded
            } else {
                JobPhase::Failed
            },
            finished_at: Some(c.last_transition_time.as_ref().map_or(now, |t| t.0)),
            reason: c
                .reason
                .clone()
                .unwrap_or_else(|| if succeeded { "Succeeded" } else { "Failed" }.to_string()),
            message: c.message.clone().unwrap_or_else(|| {
                if succeeded {
                    "the job ran to completion".to_string()
                } else {
                    "the submitting pod failed".to_string()
                }
            }),
        };
    }
    let active = status.and_then(|s| s.active).unwrap_or(0) > 0;
    Outcome {
        phase: if active && pod_running {
            JobPhase::Running
        } else {
            JobPhase::Pending
        },
        finished_at: None,
        reason: String::new(),
        message: String::new(),
    }
}

/// When `job`'s deadline passes, if it has one.
fn deadline_of(job: &WrkJob) -> Result<Option<Timestamp>, Error> {
    let (Some(seconds), Some(created)) = (
        job.spec.deadline_seconds,
        job.metadata.creation_timestamp.as_ref(),
    ) else {
        return Ok(None);
    };
    Ok(Some(
        created
            .0
            .saturating_add(SignedDuration::from_secs(seconds))?,
    ))
}

fn condition_true(cluster: &WrkCluster, type_: &str) -> bool {
    cluster.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == type_ && c.status == "True")
    })
}

fn ignore_missing<T>(result: Result<T, kube::Error>) -> Result<(), Error> {
    match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// What every step of one reconcile needs.
struct Step<'a> {
    job: &'a WrkJob,
    name: String,
    jobs: Api<WrkJob>,
    clusters: Api<WrkCluster>,
    batch: Api<Job>,
    status: WrkJobStatus,
    generation: Option<i64>,
    now: Timestamp,
}

impl Step<'_> {
    fn condition(&mut self, type_: &str, ok: bool, reason: &str, message: impl Into<String>) {
        set_condition(
            &mut self.status.conditions,
            type_,
            ok,
            reason,
            message,
            self.generation,
            self.now,
        );
    }

    async fn write_status(&self) -> Result<(), Error> {
        let patch = serde_json::json!({ "status": &self.status });
        self.jobs
            .patch_status(&self.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    /// Records the end, deletes an ephemeral cluster, and waits for the TTL.
    async fn finish(
        &mut self,
        phase: JobPhase,
        at: Timestamp,
        reason: &str,
        message: &str,
    ) -> Result<Action, Error> {
        info!(job = %self.name, ?phase, reason, message, "job finished");
        self.status.phase = phase;
        self.status.finished_at = Some(at.to_string());
        let succeeded = phase == JobPhase::Succeeded;
        self.condition(
            if succeeded { "Complete" } else { "Failed" },
            true,
            reason,
            message,
        );
        self.condition("Running", false, "Finished", "the job has finished");
        self.write_status().await?;
        self.after_finish().await
    }

    /// For a finished job: the ephemeral cluster goes, and the `WrkJob` after its TTL.
    async fn after_finish(&self) -> Result<Action, Error> {
        if self.job.spec.ephemeral_cluster.is_some()
            && let Some(cluster) = &self.status.cluster
            && self.clusters.get_opt(cluster).await?.is_some()
        {
            info!(job = %self.name, %cluster, "deleting the job's ephemeral cluster");
            ignore_missing(
                self.clusters
                    .delete(cluster, &DeleteParams::background())
                    .await,
            )?;
        }
        let Some(ttl) = self.job.spec.ttl_seconds_after_finished else {
            return Ok(Action::await_change());
        };
        let finished = self
            .status
            .finished_at
            .as_deref()
            .and_then(|t| t.parse::<Timestamp>().ok())
            .unwrap_or(self.now);
        let expires = finished.saturating_add(SignedDuration::from_secs(ttl))?;
        if self.now >= expires {
            info!(job = %self.name, "TTL after finishing passed: deleting the WrkJob");
            ignore_missing(
                self.jobs
                    .delete(&self.name, &DeleteParams::background())
                    .await,
            )?;
            return Ok(Action::await_change());
        }
        let wait = self.now.duration_until(expires).unsigned_abs();
        Ok(Action::requeue(wait.max(Duration::from_millis(200))))
    }
}

/// Whether a pod of the submitting Job of `job` runs.
async fn pod_running(pods: &Api<Pod>, job: &str) -> Result<bool, Error> {
    let selector = selector_string(&std::collections::BTreeMap::from([
        (LABEL_JOB.to_string(), job.to_string()),
        (LABEL_COMPONENT.to_string(), COMPONENT.to_string()),
    ]));
    Ok(pods
        .list(&ListParams::default().labels(&selector))
        .await?
        .items
        .iter()
        .any(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")))
}

/// Reconciles one `WrkJob`.
pub async fn reconcile(job: Arc<WrkJob>, ctx: Arc<Context>) -> Result<Action, Error> {
    let name = job.name_any();
    let namespace = job
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let mut step = Step {
        job: &job,
        name: name.clone(),
        jobs: Api::namespaced(ctx.client.clone(), &namespace),
        clusters: Api::namespaced(ctx.client.clone(), &namespace),
        batch: Api::namespaced(ctx.client.clone(), &namespace),
        status: job.status.clone().unwrap_or_default(),
        generation: job.metadata.generation,
        now: Timestamp::now(),
    };
    step.status.observed_generation = step.generation;
    let now = step.now;

    if step.status.phase.is_finished() {
        step.write_status().await?;
        return step.after_finish().await;
    }

    let cluster_name = match (&job.spec.cluster, &job.spec.ephemeral_cluster) {
        (Some(named), None) => named.clone(),
        (None, Some(_)) => name.clone(),
        _ => {
            step.condition(
                "Ready",
                false,
                "InvalidSpec",
                "set exactly one of `cluster` and `ephemeralCluster`",
            );
            step.write_status().await?;
            return Ok(Action::await_change());
        }
    };
    step.status.cluster = Some(cluster_name.clone());
    let deadline = deadline_of(&job)?;
    let past_deadline = deadline.is_some_and(|d| now >= d);
    let deadline_message = || {
        format!(
            "not finished within its deadline of {} s",
            job.spec.deadline_seconds.unwrap_or_default()
        )
    };

    // Follow a submitting Job that exists.
    if let Some(submitted) = step.batch.get_opt(&submit_job_name(&name)).await? {
        let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
        let running = pod_running(&pods, &name).await?;
        let seen = outcome(&submitted, running, now);
        if let Some(start) = submitted
            .status
            .as_ref()
            .and_then(|s| s.start_time.as_ref())
        {
            step.status.started_at = Some(start.0.to_string());
        }
        if let Some(at) = seen.finished_at {
            return step
                .finish(seen.phase, at, &seen.reason, &seen.message)
                .await;
        }
        if past_deadline {
            info!(job = %name, "deadline passed: stopping the submitting Job");
            ignore_missing(
                step.batch
                    .delete(&submit_job_name(&name), &DeleteParams::background())
                    .await,
            )?;
            return step
                .finish(
                    JobPhase::Failed,
                    now,
                    DEADLINE_EXCEEDED,
                    &deadline_message(),
                )
                .await;
        }
        step.status.phase = seen.phase;
        // Also when the reconcile that created the Job failed before recording it.
        step.condition("Ready", true, "Submitted", "the submitting Job is created");
        if seen.phase == JobPhase::Running {
            step.condition("Running", true, "Running", "`wrk submit` runs the job");
        } else {
            step.condition(
                "Running",
                false,
                "Starting",
                "the submitting pod is not running yet",
            );
        }
        step.write_status().await?;
        return Ok(Action::requeue(requeue_within(
            Duration::from_secs(5),
            deadline,
            now,
        )));
    }

    if past_deadline {
        return step
            .finish(
                JobPhase::Failed,
                now,
                DEADLINE_EXCEEDED,
                &deadline_message(),
            )
            .await;
    }

    // No submitting Job yet: make sure the cluster exists and its scheduler is up.
    let cluster = match &job.spec.ephemeral_cluster {
        Some(spec) => Some(apply(&step.clusters, &ephemeral_cluster(&job, spec)?).await?),
        None => step.clusters.get_opt(&cluster_name).await?,
    };
    step.status.phase = JobPhase::Pending;
    let Some(cluster) = cluster else {
        step.condition(
            "Ready",
            false,
            "ClusterNotFound",
            format!("no WrkCluster `{cluster_name}` in namespace `{namespace}`"),
        );
        step.write_status().await?;
        return Ok(Action::requeue(requeue_within(
            Duration::from_secs(10),
            deadline,
            now,
        )));
    };
    if !condition_true(&cluster, "SchedulerAvailable") {
        step.condition(
            "Ready",
            false,
            "WaitingForScheduler",
            format!("waiting for the scheduler of WrkCluster `{cluster_name}`"),
        );
        step.write_status().await?;
        return Ok(Action::requeue(requeue_within(
            Duration::from_secs(5),
            deadline,
            now,
        )));
    }
    // What is left of the deadline, in whole seconds (at least one).
    let active_deadline = deadline.map(|d| {
        let left = now.duration_until(d).as_secs_f64().ceil() as i64;
        left.max(1)
    });
    info!(job = %name, cluster = %cluster_name, ?active_deadline, "creating the submitting Job");
    apply(&step.batch, &submit_job(&job, &cluster, active_deadline)?).await?;
    step.condition("Ready", true, "Submitted", "the submitting Job is created");
    step.condition(
        "Running",
        false,
        "Starting",
        "the submitting pod is not running yet",
    );
    step.write_status().await?;
    Ok(Action::requeue(requeue_within(
        Duration::from_secs(2),
        deadline,
        now,
    )))
}

/// `interval`, or sooner when the deadline comes first.
fn requeue_within(interval: Duration, deadline: Option<Timestamp>, now: Timestamp) -> Duration {
    match deadline {
        Some(d) if d > now => interval.min(
            now.duration_until(d)
                .unsigned_abs()
                .max(Duration::from_millis(200)),
        ),
        _ => interval,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::batch::v1::{JobCondition, JobStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).unwrap()
    }

    fn job_with(active: i32, condition: Option<(&str, &str)>) -> Job {
        Job {
            status: Some(JobStatus {
                active: Some(active),
                conditions: condition.map(|(type_, reason)| {
                    vec![JobCondition {
                        type_: type_.to_string(),
                        status: "True".to_string(),
                        reason: Some(reason.to_string()),
                        message: Some(format!("{reason} message")),
                        last_transition_time: Some(Time(at(5))),
                        ..Default::default()
                    }]
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn active_means_running_only_once_the_pod_runs() {
        assert_eq!(
            outcome(&job_with(1, None), false, at(9)).phase,
            JobPhase::Pending
        );
        assert_eq!(
            outcome(&job_with(1, None), true, at(9)).phase,
            JobPhase::Running
        );
        assert_eq!(
            outcome(&job_with(0, None), false, at(9)).phase,
            JobPhase::Pending
        );
    }

    #[test]
    fn finished_jobs_carry_their_reason_and_time() {
        let failed = outcome(
            &job_with(0, Some(("Failed", "DeadlineExceeded"))),
            false,
            at(9),
        );
        assert_eq!(failed.phase, JobPhase::Failed);
        assert_eq!(failed.reason, "DeadlineExceeded");
        assert_eq!(failed.message, "DeadlineExceeded message");
        assert_eq!(failed.finished_at, Some(at(5)));
        let done = outcome(&job_with(0, Some(("Complete", "Done"))), false, at(9));
        assert_eq!(done.phase, JobPhase::Succeeded);
    }

    #[test]
    fn requeues_come_no_later_than_the_deadline() {
        let five = Duration::from_secs(5);
        assert_eq!(requeue_within(five, None, at(0)), five);
        assert_eq!(
            requeue_within(five, Some(at(2)), at(0)),
            Duration::from_secs(2)
        );
        assert_eq!(requeue_within(five, Some(at(60)), at(0)), five);
        assert_eq!(requeue_within(five, Some(at(0)), at(1)), five);
    }
}

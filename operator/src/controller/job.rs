//! Reconciliation of a `WrkJob`: pick (or create) its cluster, start the submitting batch Job once
//! the cluster's scheduler is available, follow it to a phase, delete an ephemeral cluster as soon
//! as the job finished, and delete the `WrkJob` itself (and so all it owns) after its TTL.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use tracing::info;

use super::Context;
use super::cluster::apply;
use crate::Error;
use crate::crd::{JobPhase, WrkCluster, WrkJob, WrkJobStatus};
use crate::render::job::{ephemeral_cluster, submit_job, submit_job_name};
use crate::status::set_condition;

/// The phase of a submitting Job and, once finished, when.
fn job_phase(job: &Job) -> (JobPhase, Option<Timestamp>) {
    let status = job.status.as_ref();
    let finished = status
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .find(|c| (c.type_ == "Complete" || c.type_ == "Failed") && c.status == "True");
    if let Some(c) = finished {
        let phase = if c.type_ == "Complete" {
            JobPhase::Succeeded
        } else {
            JobPhase::Failed
        };
        return (phase, c.last_transition_time.as_ref().map(|t| t.0));
    }
    if status.and_then(|s| s.active).unwrap_or(0) > 0 {
        (JobPhase::Running, None)
    } else {
        (JobPhase::Pending, None)
    }
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

/// Reconciles one `WrkJob`.
pub async fn reconcile(job: Arc<WrkJob>, ctx: Arc<Context>) -> Result<Action, Error> {
    let name = job.name_any();
    let namespace = job
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let generation = job.metadata.generation;
    let jobs: Api<WrkJob> = Api::namespaced(ctx.client.clone(), &namespace);
    let clusters: Api<WrkCluster> = Api::namespaced(ctx.client.clone(), &namespace);
    let batch: Api<Job> = Api::namespaced(ctx.client.clone(), &namespace);
    let mut status = job.status.clone().unwrap_or_default();
    status.observed_generation = generation;
    let now = Timestamp::now();

    let cluster_name = match (&job.spec.cluster, &job.spec.ephemeral_cluster) {
        (Some(named), None) => named.clone(),
        (None, Some(_)) => name.clone(),
        _ => {
            set_condition(
                &mut status.conditions,
                "Ready",
                false,
                "InvalidSpec",
                "set exactly one of `cluster` and `ephemeralCluster`",
                generation,
                now,
            );
            write_status(&jobs, &name, &status).await?;
            return Ok(Action::await_change());
        }
    };
    status.cluster = Some(cluster_name.clone());

    // Follow a submitting Job that exists.
    if let Some(submitted) = batch.get_opt(&submit_job_name(&name)).await? {
        let (phase, finished) = job_phase(&submitted);
        status.phase = phase;
        if let Some(at) = finished {
            status.finished_at = Some(at.to_string());
            let ok = phase == JobPhase::Succeeded;
            let kind = if ok { "Complete" } else { "Failed" };
            set_condition(
                &mut status.conditions,
                kind,
                true,
                kind,
                "the submitting Job finished",
                generation,
                now,
            );
            if job.spec.ephemeral_cluster.is_some() {
                info!(job = %name, "job finished: deleting its ephemeral cluster");
                ignore_missing(
                    clusters
                        .delete(&cluster_name, &DeleteParams::background())
                        .await,
                )?;
            }
            write_status(&jobs, &name, &status).await?;
            if let Some(ttl) = job.spec.ttl_seconds_after_finished {
                let expires = at.saturating_add(SignedDuration::from_secs(ttl))?;
                if now >= expires {
                    info!(job = %name, "TTL after finishing passed: deleting the WrkJob");
                    ignore_missing(jobs.delete(&name, &DeleteParams::background()).await)?;
                    return Ok(Action::await_change());
                }
                let wait = now.duration_until(expires).unsigned_abs();
                return Ok(Action::requeue(wait.max(Duration::from_secs(1))));
            }
            return Ok(Action::await_change());
        }
        write_status(&jobs, &name, &status).await?;
        return Ok(Action::requeue(Duration::from_secs(10)));
    }

    // No submitting Job yet: make sure the cluster exists and its scheduler is up.
    let cluster = match &job.spec.ephemeral_cluster {
        Some(spec) => Some(apply(&clusters, &ephemeral_cluster(&job, spec)?).await?),
        None => clusters.get_opt(&cluster_name).await?,
    };
    let Some(cluster) = cluster else {
        set_condition(
            &mut status.conditions,
            "Ready",
            false,
            "ClusterNotFound",
            format!("no WrkCluster `{cluster_name}` in namespace `{namespace}`"),
            generation,
            now,
        );
        status.phase = JobPhase::Pending;
        write_status(&jobs, &name, &status).await?;
        return Ok(Action::requeue(Duration::from_secs(10)));
    };
    if !condition_true(&cluster, "SchedulerAvailable") {
        set_condition(
            &mut status.conditions,
            "Ready",
            false,
            "WaitingForScheduler",
            format!("waiting for the scheduler of WrkCluster `{cluster_name}`"),
            generation,
            now,
        );
        status.phase = JobPhase::Pending;
        write_status(&jobs, &name, &status).await?;
        return Ok(Action::requeue(Duration::from_secs(5)));
    }
    set_condition(
        &mut status.conditions,
        "Ready",
        true,
        "Submitted",
        "the submitting Job is created",
        generation,
        now,
    );
    info!(job = %name, cluster = %cluster_name, "creating the submitting Job");
    apply(
        &batch,
        &submit_job(&job, &cluster_name, &cluster.spec.image)?,
    )
    .await?;
    write_status(&jobs, &name, &status).await?;
    Ok(Action::requeue(Duration::from_secs(5)))
}

async fn write_status(jobs: &Api<WrkJob>, name: &str, status: &WrkJobStatus) -> Result<(), Error> {
    let patch = serde_json::json!({ "status": status });
    jobs.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

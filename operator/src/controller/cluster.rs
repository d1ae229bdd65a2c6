//! Reconciliation of a `WrkCluster`: validate, server-side apply the scheduler Deployment and
//! Service, ask the scheduler (once it is available, with the client token from the cluster's
//! Secret) for its scaling advice, split it over the worker groups ([`scaling::targets`]: bounds,
//! spec order, idle timeout), keep each group at its target number of pods (retiring only pods the
//! scheduler reports safe, or that never became ready), then write the status: conditions
//! (`Ready`, `SchedulerAvailable`, `WorkersReady`, `PodsPending`, `Autoscaling`, `Idle`),
//! `observedGeneration`, counts, and pods pending past the timeout with the reason from their
//! events. Deletion needs no code: every child carries an owner reference to the cluster and the
//! garbage collector removes it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Event, Pod, Secret, Service};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{info, warn};

use super::Context;
use crate::Error;
use crate::crd::{SecretKeyRef, WorkerGroupSpec, WorkerGroupStatus, WrkCluster, WrkClusterStatus};
use crate::render::{
    self, ANNOTATION_SPEC_HASH, FIELD_MANAGER, LABEL_GROUP, component_selector, scheduler_address,
    selector_string, worker,
};
use crate::scaling::{self, Advice, GroupView, Idle, Worker};
use crate::status::{pending_pods, set_condition};
use crate::validate;

/// Server-side applies `object` (forcing ownership of the fields the operator sets).
pub(crate) async fn apply<K>(api: &Api<K>, object: &K) -> Result<K, Error>
where
    K: Resource + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    let name = object
        .meta()
        .name
        .clone()
        .ok_or(Error::MissingField("metadata.name"))?;
    let params = PatchParams::apply(FIELD_MANAGER).force();
    Ok(api.patch(&name, &params, &Patch::Apply(object)).await?)
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn is_finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Failed" | "Succeeded")
    )
}

fn is_bound(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_ref())
        .is_some()
}

fn spec_hash(pod: &Pod) -> Option<&str> {
    pod.metadata
        .annotations
        .as_ref()?
        .get(ANNOTATION_SPEC_HASH)
        .map(String::as_str)
}

/// Reconciles one `WrkCluster`.
pub async fn reconcile(cluster: Arc<WrkCluster>, ctx: Arc<Context>) -> Result<Action, Error> {
    let name = cluster.name_any();
    let namespace = cluster
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let generation = cluster.metadata.generation;
    let clusters: Api<WrkCluster> = Api::namespaced(ctx.client.clone(), &namespace);
    let mut status = cluster.status.clone().unwrap_or_default();
    status.observed_generation = generation;
    let now = Timestamp::now();

    if let Err(problems) = validate::cluster(&name, &cluster.spec) {
        let message = problems.join("; ");
        warn!(cluster = %name, %namespace, %message, "invalid WrkCluster");
        set_condition(
            &mut status.conditions,
            "Ready",
            false,
            "InvalidSpec",
            message,
            generation,
            now,
        );
        write_status(&clusters, &name, &status).await?;
        return Ok(Action::await_change());
    }

    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &namespace);
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), &namespace);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    apply(&services, &render::scheduler::service(&cluster)?).await?;
    let deployment = apply(&deployments, &render::scheduler::deployment(&cluster)?).await?;

    let address = scheduler_address(&name, &namespace);
    let scheduler_available = deployment
        .status
        .as_ref()
        .and_then(|s| s.available_replicas)
        .unwrap_or(0)
        > 0;

    // What the scheduler advises, when it is up.
    let autoscaled = cluster
        .spec
        .worker_groups
        .iter()
        .any(|g| g.autoscaling.is_some());
    let uses_advice = autoscaled || cluster.spec.idle_timeout_seconds.is_some();
    let (advice, advice_problem) = if !scheduler_available {
        (None, Some("the scheduler is not available yet".to_string()))
    } else {
        match ask_scheduler(&ctx, &cluster, &namespace, &address).await {
            Ok(advice) => (Some(advice), None),
            Err(problem) => {
                if uses_advice {
                    warn!(cluster = %name, %namespace, %problem, "no scaling advice");
                } else {
                    tracing::debug!(cluster = %name, %namespace, %problem, "no scaling advice");
                }
                (None, Some(problem))
            }
        }
    };
    let idle_timeout = cluster.spec.idle_timeout_seconds.map(Duration::from_secs);
    let idle_since = status
        .idle_since
        .as_deref()
        .and_then(|s| s.parse::<Timestamp>().ok());
    let (idle, idle_since) = scaling::idle_state(idle_timeout, advice.as_ref(), idle_since, now);
    status.idle_since = idle_since.map(|t| t.to_string());
    let safe = advice
        .as_ref()
        .map(|a| a.safe_to_retire.clone())
        .unwrap_or_default();

    // Worker groups: drop finished and outdated pods, split the advice, bring each to its target.
    let worker_selector = selector_string(&component_selector(&name, worker::COMPONENT));
    let existing = pods
        .list(&ListParams::default().labels(&worker_selector))
        .await?;
    let mut by_group: BTreeMap<String, Vec<Pod>> = BTreeMap::new();
    for pod in existing.items {
        if pod.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let group = pod.labels().get(LABEL_GROUP).cloned().unwrap_or_default();
        by_group.entry(group).or_default().push(pod);
    }
    let mut live_by_group = Vec::new();
    let mut views = Vec::new();
    for group in &cluster.spec.worker_groups {
        let group_pods = by_group.remove(&group.name).unwrap_or_default();
        let live = prune_group(&cluster, group, group_pods, &safe, &pods).await?;
        views.push(GroupView {
            bounds: group.autoscaling,
            replicas: group.replicas,
            current: live.len() as u32,
            removable: live
                .iter()
                .filter(|p| !is_ready(p) || safe.contains(&p.name_any()))
                .count() as u32,
            stuck: live
                .iter()
                .any(|p| is_stuck(p, now, ctx.config.pending_timeout)),
        });
        live_by_group.push(live);
    }
    let group_targets = scaling::targets(&views, advice.as_ref(), idle);
    let mut held = BTreeMap::new();
    let mut targets = BTreeMap::new();
    for ((group, live), target) in cluster
        .spec
        .worker_groups
        .iter()
        .zip(live_by_group)
        .zip(group_targets)
    {
        let plan = scale_group(&cluster, group, live, target, &safe, &pods).await?;
        held.insert(group.name.clone(), plan.held);
        targets.insert(group.name.clone(), plan.target);
    }
    // Pods of groups no longer in the spec go too, under the same rule.
    let mut held_total: u32 = held.values().sum();
    for pod in by_group.into_values().flatten() {
        let pod_name = pod.name_any();
        if is_ready(&pod) && !safe.contains(&pod_name) {
            held_total += 1;
            continue;
        }
        info!(cluster = %name, pod = %pod_name, "deleting a worker of a removed group");
        delete_pod(&pods, &pod_name).await?;
    }

    // Status from a fresh look at the pods.
    let workers = pods
        .list(&ListParams::default().labels(&worker_selector))
        .await?
        .items;
    let scheduler_pods = pods
        .list(
            &ListParams::default().labels(&selector_string(&component_selector(
                &name,
                render::scheduler::COMPONENT,
            ))),
        )
        .await?
        .items;
    status.worker_groups = cluster
        .spec
        .worker_groups
        .iter()
        .map(|g| {
            let desired = targets.get(&g.name).copied().unwrap_or(0);
            group_status(
                g,
                desired,
                held.get(&g.name).copied().unwrap_or(0),
                &workers,
            )
        })
        .collect();
    status.desired_workers = status.worker_groups.iter().map(|g| g.desired).sum();
    status.ready_workers = status.worker_groups.iter().map(|g| g.ready).sum();
    status.scheduler_address = Some(address);

    let worker_names: BTreeSet<String> = workers.iter().map(|p| p.name_any()).collect();
    let all_pods: Vec<Pod> = scheduler_pods.into_iter().chain(workers).collect();
    let any_pending = all_pods.iter().any(|p| {
        matches!(
            p.status.as_ref().and_then(|s| s.phase.as_deref()),
            None | Some("Pending")
        )
    });
    let warnings = if any_pending {
        let events: Api<Event> = Api::namespaced(ctx.client.clone(), &namespace);
        events
            .list(&ListParams::default().fields("involvedObject.kind=Pod,type=Warning"))
            .await?
            .items
    } else {
        Vec::new()
    };
    status.pending_pods = pending_pods(&all_pods, &warnings, now, ctx.config.pending_timeout);
    status.pending_workers = status
        .pending_pods
        .iter()
        .filter(|p| worker_names.contains(&p.name))
        .count() as u32;

    let available = scheduler_available;
    set_condition(
        &mut status.conditions,
        "SchedulerAvailable",
        available,
        if available {
            "Available"
        } else {
            "Unavailable"
        },
        if available {
            "the scheduler pod is ready".to_string()
        } else {
            "no ready scheduler pod yet".to_string()
        },
        generation,
        now,
    );
    let workers_ready = status.ready_workers >= status.desired_workers;
    set_condition(
        &mut status.conditions,
        "WorkersReady",
        workers_ready,
        if workers_ready { "AllReady" } else { "Waiting" },
        format!(
            "{}/{} workers ready",
            status.ready_workers, status.desired_workers
        ),
        generation,
        now,
    );
    match status.pending_pods.first() {
        Some(first) => {
            let message = format!(
                "{} pod(s) pending over {} s; {}: {}: {}",
                status.pending_pods.len(),
                ctx.config.pending_timeout.as_secs(),
                first.name,
                first.reason,
                first.message
            );
            let reason = first.reason.clone();
            set_condition(
                &mut status.conditions,
                "PodsPending",
                true,
                &reason,
                message,
                generation,
                now,
            );
        }
        None => set_condition(
            &mut status.conditions,
            "PodsPending",
            false,
            "NonePending",
            "no pod pending past the timeout",
            generation,
            now,
        ),
    }
    if autoscaled {
        let (ok, reason, message) = if let Some(problem) = &advice_problem {
            (
                false,
                "AdviceUnavailable",
                format!(
                    "no scaling advice from the scheduler ({problem}): groups stay at their \
                     replicas within bounds"
                ),
            )
        } else if held_total > 0 {
            (
                true,
                "RetirementHeld",
                format!(
                    "{held_total} worker(s) above target kept until the scheduler reports them safe to retire"
                ),
            )
        } else {
            let desired = advice.as_ref().map_or(0, |a| a.desired);
            (
                true,
                "Following",
                format!("following the scheduler's advice: {desired} worker(s) wanted"),
            )
        };
        set_condition(
            &mut status.conditions,
            "Autoscaling",
            ok,
            reason,
            message,
            generation,
            now,
        );
    }
    // Conditions of features the spec no longer uses would only mislead.
    status.conditions.retain(|c| {
        (c.type_ != "Autoscaling" || autoscaled) && (c.type_ != "Idle" || idle_timeout.is_some())
    });
    if let Some(timeout) = idle_timeout {
        let since = status.idle_since.clone().unwrap_or_default();
        let (idle_now, reason, message) = match (idle, &advice, &advice_problem) {
            (Idle::TimedOut, _, _) => (
                true,
                "IdleTimeout",
                format!("no work since {since}: worker groups are at their floor"),
            ),
            (Idle::Waiting, _, _) => (
                false,
                "Idle",
                format!(
                    "no work since {since}; worker groups go to their floor after {} s",
                    timeout.as_secs()
                ),
            ),
            (Idle::Busy, Some(advice), _) => (
                false,
                "Working",
                format!(
                    "the scheduler reports {} unfinished task(s)",
                    advice.backlog_tasks
                ),
            ),
            (Idle::Busy, None, problem) => (
                false,
                "AdviceUnavailable",
                format!(
                    "cannot tell whether the cluster is idle: {}",
                    problem.as_deref().unwrap_or("no advice")
                ),
            ),
        };
        set_condition(
            &mut status.conditions,
            "Idle",
            idle_now,
            reason,
            message,
            generation,
            now,
        );
    }
    let ready = available && workers_ready;
    let (reason, message) = if ready {
        (
            "Ready",
            "the scheduler and all workers are ready".to_string(),
        )
    } else if let Some(first) = status.pending_pods.first() {
        (
            first.reason.as_str(),
            format!("{}: {}", first.name, first.message),
        )
    } else {
        (
            "Starting",
            "waiting for the scheduler and workers to become ready".to_string(),
        )
    };
    let (reason, message) = (reason.to_string(), message);
    set_condition(
        &mut status.conditions,
        "Ready",
        ready,
        &reason,
        message,
        generation,
        now,
    );
    write_status(&clusters, &name, &status).await?;

    let mut after = if ready {
        Duration::from_secs(60)
    } else {
        ctx.config
            .pending_timeout
            .clamp(Duration::from_secs(1), Duration::from_secs(10))
    };
    if uses_advice {
        after = after.min(ctx.config.advice_interval.max(Duration::from_millis(100)));
    }
    if let (Idle::Waiting, Some(timeout), Some(since)) = (idle, idle_timeout, idle_since) {
        let left = timeout.saturating_sub(now.duration_since(since).unsigned_abs());
        after = after.min(left.max(Duration::from_millis(100)));
    }
    Ok(Action::requeue(after))
}

/// The tenant token in `secret` (trailing whitespace trimmed), or why there is none.
async fn read_token(secrets: &Api<Secret>, secret: &SecretKeyRef) -> Result<String, String> {
    let found = secrets
        .get_opt(&secret.name)
        .await
        .map_err(|e| format!("cannot read Secret `{}`: {e}", secret.name))?
        .ok_or_else(|| format!("no Secret `{}`", secret.name))?;
    let bytes = found
        .data
        .as_ref()
        .and_then(|d| d.get(&secret.key))
        .ok_or_else(|| format!("Secret `{}` has no key `{}`", secret.name, secret.key))?;
    let text = std::str::from_utf8(&bytes.0).map_err(|_| {
        format!(
            "key `{}` of Secret `{}` is not UTF-8",
            secret.key, secret.name
        )
    })?;
    Ok(text.trim_end().to_string())
}

/// The scheduler's advice for `cluster`, asked with its client token where it has `auth`.
async fn ask_scheduler(
    ctx: &Context,
    cluster: &WrkCluster,
    namespace: &str,
    service_address: &str,
) -> Result<Advice, String> {
    let Some(advisor) = &ctx.advisor else {
        return Err("the operator runs without an advisor".to_string());
    };
    let token = match &cluster.spec.auth {
        Some(auth) => {
            let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), namespace);
            Some(read_token(&secrets, &auth.client_token()).await?)
        }
        None => None,
    };
    let key = format!("{namespace}/{}", cluster.name_any());
    let address = ctx
        .config
        .scheduler_addresses
        .get(&key)
        .map_or(service_address, String::as_str);
    advisor
        .advise(address, token.as_deref())
        .await
        .map_err(|e| e.to_string())
}

/// A pod that no node would take: unbound and pending for `timeout` or longer.
fn is_stuck(pod: &Pod, now: Timestamp, timeout: Duration) -> bool {
    let pending = matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        None | Some("Pending")
    );
    let old_enough = pod
        .metadata
        .creation_timestamp
        .as_ref()
        .is_some_and(|t| now.duration_since(t.0).unsigned_abs() >= timeout);
    pending && !is_bound(pod) && old_enough
}

/// Deletes a group's finished pods, and pods of an older spec that could be retired anyway (not
/// ready, or reported safe); returns the pods left.
async fn prune_group(
    cluster: &WrkCluster,
    group: &WorkerGroupSpec,
    group_pods: Vec<Pod>,
    safe: &BTreeSet<String>,
    pods: &Api<Pod>,
) -> Result<Vec<Pod>, Error> {
    let name = cluster.name_any();
    let mut live = Vec::new();
    for pod in group_pods {
        let pod_name = pod.name_any();
        let outdated = match scaling::index_of(&pod_name) {
            Some(i) => {
                let wanted = worker::pod(cluster, group, i)?;
                spec_hash(&wanted) != spec_hash(&pod)
            }
            None => true,
        };
        let retirable = !is_ready(&pod) || safe.contains(&pod_name);
        if is_finished(&pod) || (outdated && retirable) {
            info!(cluster = %name, pod = %pod_name, finished = is_finished(&pod), outdated, "replacing a worker pod");
            delete_pod(pods, &pod_name).await?;
        } else {
            live.push(pod);
        }
    }
    Ok(live)
}

/// Brings one group to `target`: retires what [`scaling::plan`] allows and creates the missing
/// pods at the lowest free indices; returns the plan.
async fn scale_group(
    cluster: &WrkCluster,
    group: &WorkerGroupSpec,
    live: Vec<Pod>,
    target: u32,
    safe: &BTreeSet<String>,
    pods: &Api<Pod>,
) -> Result<scaling::Plan, Error> {
    let name = cluster.name_any();
    let workers: Vec<Worker> = live
        .iter()
        .map(|p| Worker {
            name: p.name_any(),
            ready: is_ready(p),
        })
        .collect();
    let plan = scaling::plan(&workers, target, safe);
    for pod_name in &plan.retire {
        info!(cluster = %name, group = %group.name, pod = %pod_name, target, "retiring a worker");
        delete_pod(pods, pod_name).await?;
    }
    let retired: BTreeSet<&String> = plan.retire.iter().collect();
    let taken: BTreeSet<u32> = workers
        .iter()
        .filter(|w| !retired.contains(&w.name))
        .filter_map(|w| scaling::index_of(&w.name))
        .collect();
    let remaining = workers.len() - plan.retire.len();
    let missing = (target as usize).saturating_sub(remaining);
    let free = (0u32..).filter(|i| !taken.contains(i)).take(missing);
    for index in free {
        let pod = worker::pod(cluster, group, index)?;
        info!(cluster = %name, group = %group.name, index, "creating a worker pod");
        apply(pods, &pod).await?;
    }
    Ok(plan)
}

async fn delete_pod(pods: &Api<Pod>, name: &str) -> Result<(), Error> {
    match pods.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        // Already gone: what we wanted.
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

fn group_status(
    group: &WorkerGroupSpec,
    desired: u32,
    held: u32,
    workers: &[Pod],
) -> WorkerGroupStatus {
    let mine: Vec<&Pod> = workers
        .iter()
        .filter(|p| p.labels().get(LABEL_GROUP) == Some(&group.name))
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    WorkerGroupStatus {
        name: group.name.clone(),
        desired,
        current: mine.len() as u32,
        scheduled: mine.iter().filter(|p| is_bound(p)).count() as u32,
        ready: mine.iter().filter(|p| is_ready(p)).count() as u32,
        held,
    }
}

async fn write_status(
    clusters: &Api<WrkCluster>,
    name: &str,
    status: &WrkClusterStatus,
) -> Result<(), Error> {
    let mut value = serde_json::to_value(status)?;
    // A merge patch keeps what it does not mention: an idle period that ended must be removed.
    if status.idle_since.is_none()
        && let Some(object) = value.as_object_mut()
    {
        object.insert("idleSince".to_string(), serde_json::Value::Null);
    }
    let patch = serde_json::json!({ "status": value });
    clusters
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

//! The controllers: one for `WrkCluster`, one for `WrkJob`, run together by [`run`]. Each
//! reconciles by server-side apply and reports in its resource's status; errors are logged and the
//! object retried after a pause.

pub mod cluster;
pub mod job;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Api, Client};
use tracing::{info, warn};

use crate::Error;
use crate::crd::{WrkCluster, WrkJob};
use crate::render::{FIELD_MANAGER, LABEL_MANAGED_BY};
use crate::scaling::ScalingAdvisor;

/// Settings of the controllers.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// A pod pending this long is listed in its cluster's status with the reason.
    pub pending_timeout: Duration,
    /// Watch only this namespace (all namespaces when `None`).
    pub namespace: Option<String>,
    /// How often a cluster that autoscales or has an idle timeout asks its scheduler again.
    pub advice_interval: Duration,
    /// Where the operator itself reaches the scheduler of cluster `NAMESPACE/NAME`, instead of
    /// the Service's cluster DNS name (for an operator running outside the cluster, through a
    /// port-forward or a load balancer). Pods always use the Service.
    pub scheduler_addresses: BTreeMap<String, String>,
}

impl ControllerConfig {
    /// Defaults, with `pending_timeout`.
    pub fn new(pending_timeout: Duration) -> Self {
        ControllerConfig {
            pending_timeout,
            namespace: None,
            advice_interval: Duration::from_secs(15),
            scheduler_addresses: BTreeMap::new(),
        }
    }
}

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub config: ControllerConfig,
    /// The schedulers' scaling advice; without it groups with autoscaling stay at their
    /// replicas within bounds, and say so in their status.
    pub advisor: Option<Arc<dyn ScalingAdvisor>>,
}

fn api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

fn error_policy<K>(_object: Arc<K>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(%error, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

/// Runs both controllers until `shutdown` completes.
pub async fn run(
    ctx: Context,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) -> Result<(), Error> {
    let ctx = Arc::new(ctx);
    let ns = ctx.config.namespace.as_deref();
    let client = &ctx.client;
    let managed = watcher::Config::default().labels(&format!("{LABEL_MANAGED_BY}={FIELD_MANAGER}"));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        // Either a `true` or the sender's drop ends the wait.
        let _ = rx.wait_for(|s| *s).await;
    };

    let clusters = Controller::new(api::<WrkCluster>(client, ns), watcher::Config::default())
        .owns(api::<Deployment>(client, ns), managed.clone())
        .owns(api::<Service>(client, ns), managed.clone())
        .owns(api::<Pod>(client, ns), managed.clone())
        .graceful_shutdown_on(stopped(stop_rx.clone()))
        .run(cluster::reconcile, error_policy, ctx.clone())
        .for_each(|result| async move {
            match result {
                Ok((object, _)) => tracing::debug!(cluster = %object.name, "reconciled"),
                Err(error) => warn!(%error, "WrkCluster controller"),
            }
        });
    let jobs = Controller::new(api::<WrkJob>(client, ns), watcher::Config::default())
        .owns(api::<Job>(client, ns), managed.clone())
        .owns(api::<WrkCluster>(client, ns), managed)
        .graceful_shutdown_on(stopped(stop_rx))
        .run(job::reconcile, error_policy, ctx.clone())
        .for_each(|result| async move {
            match result {
                Ok((object, _)) => tracing::debug!(job = %object.name, "reconciled"),
                Err(error) => warn!(%error, "WrkJob controller"),
            }
        });
    info!(namespace = ns.unwrap_or("(all)"), "wrk operator running");
    let signal = async move {
        shutdown.await;
        info!("shutting down");
        let _ = stop_tx.send(true);
    };
    tokio::join!(clusters, jobs, signal);
    Ok(())
}

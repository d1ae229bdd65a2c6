//! The `wrk operator` subcommands: print the CRDs, print the operator's installation manifests,
//! or run the controllers.

use std::time::Duration;

use clap::Subcommand;
use kube::Client;

use crate::Error;
use crate::controller::{self, Context, ControllerConfig};
use crate::install::{self, InstallOptions};

#[derive(Subcommand, Debug, Clone)]
pub enum OperatorCommand {
    /// Print the WrkCluster and WrkJob CustomResourceDefinitions (YAML).
    Crds,
    /// Print the operator's namespace, service account, RBAC and Deployment (YAML).
    Manifests {
        #[arg(long, default_value = "wrk-system")]
        namespace: String,
        /// The image holding `wrk` (see operator/Dockerfile).
        #[arg(long, default_value = concat!("wrk:", env!("CARGO_PKG_VERSION")))]
        image: String,
        #[arg(long, default_value_t = 120)]
        pending_timeout_secs: u64,
    },
    /// Run the controllers, in a pod (in-cluster config) or against $KUBECONFIG.
    Run {
        /// Watch only this namespace (default: all).
        #[arg(long)]
        namespace: Option<String>,
        /// List pods pending this long in their cluster's status, with the reason.
        #[arg(long, default_value_t = 120)]
        pending_timeout_secs: u64,
        /// Ask the scheduler of a cluster that autoscales (or has an idle timeout) this often.
        #[arg(long, default_value_t = 15.0)]
        advice_interval_secs: f64,
        /// Ask for the workers that finish the backlog within this many seconds.
        #[arg(long, default_value_t = 60.0)]
        scaling_target_secs: f64,
        /// Reach the scheduler of cluster NAMESPACE/NAME at URL instead of its Service's cluster
        /// DNS name (an operator outside the cluster, through a port-forward); repeatable.
        #[arg(long = "scheduler-address", value_name = "NAMESPACE/NAME=URL", value_parser = scheduler_address)]
        scheduler_addresses: Vec<(String, String)>,
    },
}

/// Parses `NAMESPACE/NAME=URL`.
fn scheduler_address(text: &str) -> Result<(String, String), String> {
    let (cluster, url) = text
        .split_once('=')
        .ok_or_else(|| format!("`{text}` is not NAMESPACE/NAME=URL"))?;
    let well_formed = cluster
        .split_once('/')
        .is_some_and(|(ns, name)| !ns.is_empty() && !name.is_empty() && !name.contains('/'));
    if !well_formed || !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(format!(
            "`{text}` is not NAMESPACE/NAME=URL with an http:// or https:// URL"
        ));
    }
    Ok((cluster.to_string(), url.to_string()))
}

/// Seconds as a duration, refusing what is not a positive finite number.
fn seconds(name: &str, value: f64) -> Result<Duration, Error> {
    if value.is_finite() && value > 0.0 {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(Error::Config(format!(
            "--{name} must be a positive number of seconds, not {value}"
        )))
    }
}

/// Runs one `wrk operator` subcommand.
pub async fn run(command: OperatorCommand) -> Result<(), Error> {
    match command {
        OperatorCommand::Crds => print!("{}", install::to_yaml(&install::crds())?),
        OperatorCommand::Manifests {
            namespace,
            image,
            pending_timeout_secs,
        } => {
            let objects = install::operator_manifests(&InstallOptions {
                namespace,
                image,
                pending_timeout_secs,
            })?;
            print!("{}", install::to_yaml(&objects)?);
        }
        OperatorCommand::Run {
            namespace,
            pending_timeout_secs,
            advice_interval_secs,
            scaling_target_secs,
            scheduler_addresses,
        } => {
            let advice_interval = seconds("advice-interval-secs", advice_interval_secs)?;
            let scaling_target = seconds("scaling-target-secs", scaling_target_secs)?;
            let client = Client::try_default().await?;
            let mut config = ControllerConfig::new(Duration::from_secs(pending_timeout_secs));
            config.namespace = namespace;
            config.advice_interval = advice_interval;
            config.scheduler_addresses = scheduler_addresses.into_iter().collect();
            let ctx = Context {
                client,
                config,
                advisor: Some(std::sync::Arc::new(crate::advisor::GrpcAdvisor::new(
                    scaling_target,
                ))),
            };
            controller::run(ctx, termination()).await?;
        }
    }
    Ok(())
}

/// Completes on SIGINT or SIGTERM (what the kubelet sends).
async fn termination() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async {
            match term.as_mut() {
                Some(t) => { t.recv().await; }
                None => std::future::pending::<()>().await,
            }
        } => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduler_addresses_name_a_cluster_and_a_url() {
        assert_eq!(
            scheduler_address("data/taxi=http://127.0.0.1:7070"),
            Ok(("data/taxi".to_string(), "http://127.0.0.1:7070".to_string()))
        );
        for bad in [
            "taxi=http://127.0.0.1:7070",
            "data/taxi",
            "data/taxi=127.0.0.1:7070",
            "/taxi=http://x",
            "a/b/c=http://x",
        ] {
            assert!(scheduler_address(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations_must_be_positive() {
        assert_eq!(seconds("x", 1.5).ok(), Some(Duration::from_millis(1500)));
        assert!(seconds("x", 0.0).is_err());
        assert!(seconds("x", f64::NAN).is_err());
    }
}

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
    },
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
        } => {
            let client = Client::try_default().await?;
            let ctx = Context {
                client,
                config: ControllerConfig {
                    pending_timeout: Duration::from_secs(pending_timeout_secs),
                    namespace,
                },
                advisor: Some(std::sync::Arc::new(crate::advisor::GrpcAdvisor::default())),
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

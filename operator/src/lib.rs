//! The `wrk` Kubernetes operator.
//!
//! Custom resources `WrkCluster` and `WrkJob` ([`crd`]); pure rendering of a cluster into its
//! scheduler Deployment/Service and one worker pod per GPU ([`render`]), with flags derived from the
//! pod's limits; the controllers that apply them server-side and report status ([`controller`]);
//! scaling within bounds from the scheduler's advice ([`scaling`], asked over gRPC by
//! [`advisor`] with the cluster's token); and what installs the operator ([`install`], the Helm
//! chart under `chart/`). `wrk operator ...` is [`cli`].

pub mod advisor;
pub mod cli;
pub mod controller;
pub mod crd;
pub mod install;
pub mod quantity;
pub mod render;
pub mod scaling;
pub mod status;
pub mod validate;

use thiserror::Error;

/// What can go wrong in the operator.
#[derive(Debug, Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("object has no {0}")]
    MissingField(&'static str),
    #[error(transparent)]
    Quantity(#[from] quantity::BadQuantity),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("YAML: {0}")]
    Yaml(String),
    #[error("time: {0}")]
    Time(#[from] k8s_openapi::jiff::Error),
    #[error("configuration: {0}")]
    Config(String),
}

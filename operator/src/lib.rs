//! The `wrk` Kubernetes operator.
//!
//! It will hold the kube-rs controller for the `WrkCluster` and `WrkJob` custom resources (schemas
//! from `schemars`, status conditions, server-side apply), the rendering of the scheduler
//! Deployment/Service and one worker pod per GPU with flags derived from the pod's limits, the
//! autoscaling loop driven by the scheduler's recommendation, and the Helm chart under `chart/`.
//! It depends only on the `wrk scheduler` and `wrk worker` command lines. Nothing is built yet.

//! Worker-group scaling: how many workers a group should run and which ones may go.
//!
//! The scheduler is the one that knows the backlog and which workers hold data. It answers through
//! a [`ScalingAdvisor`]; the operator only follows the recommendation within the group's bounds and
//! retires nothing the scheduler has not reported safe to retire, except pods that never became
//! ready (they never registered, so they hold nothing).

use std::collections::BTreeSet;

use futures::future::BoxFuture;
use thiserror::Error;

use crate::crd::WorkerGroupSpec;

/// What the scheduler says about one worker group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Advice {
    /// How many workers the backlog needs.
    pub recommended: u32,
    /// Workers (by id, which is their pod's name) holding no data the cluster still needs.
    pub safe_to_retire: BTreeSet<String>,
}

/// Why no advice could be had.
#[derive(Debug, Error)]
#[error("scaling advice for `{cluster}` unavailable: {reason}")]
pub struct AdvisorError {
    pub cluster: String,
    pub reason: String,
}

/// The scheduler's scaling answers, per worker group of a cluster.
pub trait ScalingAdvisor: Send + Sync {
    /// Advice for `group` of the cluster whose scheduler is at `scheduler_address`.
    fn advise<'a>(
        &'a self,
        scheduler_address: &'a str,
        group: &'a str,
    ) -> BoxFuture<'a, Result<Advice, AdvisorError>>;
}

/// A worker pod as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    pub name: String,
    /// The pod is ready: the worker runs and may hold partitions.
    pub ready: bool,
}

/// The planner's decision for one group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Workers the group should have.
    pub target: u32,
    /// Pods to delete now.
    pub retire: Vec<String>,
    /// Workers above the target kept because the scheduler has not reported them safe.
    pub held: u32,
}

/// The number of workers `group` should have: its replicas, or with autoscaling the advice (or the
/// replicas when there is none) clamped to the bounds.
pub fn target(group: &WorkerGroupSpec, advice: Option<&Advice>) -> u32 {
    match group.autoscaling {
        None => group.replicas,
        Some(bounds) => advice.map_or(group.replicas, |a| a.recommended).clamp(
            bounds.min_replicas,
            bounds.min_replicas.max(bounds.max_replicas),
        ),
    }
}

/// Which of `workers` to retire to reach `target`. Pods that are not ready go first (newest name
/// first); ready workers only when the scheduler listed them as safe to retire.
pub fn plan(workers: &[Worker], target: u32, safe_to_retire: &BTreeSet<String>) -> Plan {
    let excess = (workers.len() as u64).saturating_sub(u64::from(target));
    let mut candidates: Vec<&Worker> = workers
        .iter()
        .filter(|w| !w.ready || safe_to_retire.contains(&w.name))
        .collect();
    // Not-ready before ready; then higher indices first, so the group shrinks from its end.
    candidates.sort_by(|a, b| {
        a.ready
            .cmp(&b.ready)
            .then_with(|| index_of(&b.name).cmp(&index_of(&a.name)))
            .then_with(|| b.name.cmp(&a.name))
    });
    let retire: Vec<String> = candidates
        .into_iter()
        .take(excess as usize)
        .map(|w| w.name.clone())
        .collect();
    Plan {
        target,
        held: (excess - retire.len() as u64) as u32,
        retire,
    }
}

/// The trailing `-N` index of a worker pod name.
pub fn index_of(name: &str) -> Option<u32> {
    name.rsplit_once('-').and_then(|(_, n)| n.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::AutoscalingSpec;
    use crate::render::testing;

    fn workers(spec: &[(&str, bool)]) -> Vec<Worker> {
        spec.iter()
            .map(|(n, r)| Worker {
                name: n.to_string(),
                ready: *r,
            })
            .collect()
    }

    fn safe(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn fixed_groups_ignore_advice() {
        let g = testing::group("g", 3, "nvidia.com/gpu");
        let advice = Advice {
            recommended: 10,
            ..Default::default()
        };
        assert_eq!(target(&g, Some(&advice)), 3);
    }

    #[test]
    fn advice_is_clamped_to_bounds() {
        let mut g = testing::group("g", 3, "nvidia.com/gpu");
        g.autoscaling = Some(AutoscalingSpec {
            min_replicas: 2,
            max_replicas: 5,
        });
        let advise = |n| Advice {
            recommended: n,
            ..Default::default()
        };
        assert_eq!(target(&g, Some(&advise(10))), 5);
        assert_eq!(target(&g, Some(&advise(0))), 2);
        assert_eq!(target(&g, Some(&advise(4))), 4);
        // No advice: the replicas, still within bounds.
        assert_eq!(target(&g, None), 3);
        g.replicas = 9;
        assert_eq!(target(&g, None), 5);
    }

    #[test]
    fn never_retires_ready_workers_not_reported_safe() {
        let w = workers(&[("c-g-0", true), ("c-g-1", true), ("c-g-2", true)]);
        let p = plan(&w, 1, &safe(&[]));
        assert!(p.retire.is_empty());
        assert_eq!(p.held, 2);
        let p = plan(&w, 1, &safe(&["c-g-0"]));
        assert_eq!(p.retire, vec!["c-g-0"]);
        assert_eq!(p.held, 1);
    }

    #[test]
    fn pending_pods_go_first_then_highest_index() {
        let w = workers(&[
            ("c-g-0", true),
            ("c-g-1", false),
            ("c-g-2", true),
            ("c-g-10", true),
        ]);
        let p = plan(&w, 2, &safe(&["c-g-2", "c-g-10", "c-g-0"]));
        assert_eq!(p.retire, vec!["c-g-1", "c-g-10"]);
        assert_eq!(p.held, 0);
    }

    #[test]
    fn nothing_to_retire_at_or_below_target() {
        let w = workers(&[("c-g-0", false)]);
        assert_eq!(
            plan(&w, 3, &safe(&[])),
            Plan {
                target: 3,
                retire: vec![],
                held: 0
            }
        );
    }

    #[test]
    fn index_parsing() {
        assert_eq!(index_of("demo-a100-12"), Some(12));
        assert_eq!(index_of("demo"), None);
    }
}

//! Worker-group scaling: how many workers each group should run and which ones may go.
//!
//! The scheduler is the one that knows the backlog and which workers hold data. It answers for
//! the whole cluster through a [`ScalingAdvisor`]; [`targets`] splits that answer over the worker
//! groups and [`plan`] picks the pods to delete, never one the scheduler has not reported safe to
//! retire, except pods that never became ready (they never registered, so they hold nothing).
//!
//! The split ([`targets`]), in order:
//!
//! 1. A group without `autoscaling` runs its `replicas`; its workers count towards the advice.
//! 2. Without advice (the scheduler is not up yet or does not answer), an autoscaled group runs
//!    its `replicas` clamped to its bounds.
//! 3. With advice, the workers still wanted after the fixed groups are split over the autoscaled
//!    groups. Each keeps the workers it has (clamped to its bounds), so scaling never moves
//!    workers from one group to another.
//!    - More needed: the increase goes to the groups in the order the spec lists them (list the
//!      preferred, cheaper, group first), each up to its `maxReplicas`, skipping groups with pods
//!      pending past the timeout: their nodes are full, and more pods would only wait there.
//!      Every stage can run on every group today (stages name no device requirements yet), so
//!      every autoscaled group is eligible.
//!    - Fewer needed: the decrease comes from the groups in reverse order, down to each
//!      `minReplicas`, first where workers can go now (pods not ready, workers the scheduler
//!      reports safe), then wherever workers above the floor remain: those are held until the
//!      scheduler reports them safe.
//! 4. With `idleTimeoutSeconds`: while the scheduler reports no work, groups do not shrink until
//!    the cluster has been idle that long; then every group goes to its floor (`minReplicas`, or
//!    zero without autoscaling) until work arrives again.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::jiff::Timestamp;
use thiserror::Error;

use crate::crd::AutoscalingSpec;

/// What the scheduler says about the whole cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Advice {
    /// Workers the backlog needs to finish within the target time, over all groups (never fewer
    /// than the workers holding data still needed).
    pub desired: u32,
    /// Unfinished tasks over all running jobs: zero means the cluster has no work.
    pub backlog_tasks: u64,
    /// Workers (by id, which is their pod's name) running nothing and holding no data the
    /// cluster still needs.
    pub safe_to_retire: BTreeSet<String>,
}

/// Why no advice could be had.
#[derive(Debug, Error)]
#[error("scaling advice from `{scheduler}` unavailable: {reason}")]
pub struct AdvisorError {
    pub scheduler: String,
    pub reason: String,
}

/// The scheduler's scaling answers.
pub trait ScalingAdvisor: Send + Sync {
    /// Advice from the scheduler at `scheduler_address`, asked with the tenant `token` when the
    /// scheduler requires one.
    fn advise<'a>(
        &'a self,
        scheduler_address: &'a str,
        token: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Advice, AdvisorError>>;
}

/// A worker group as the split sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupView {
    /// `None` for a group of fixed size.
    pub bounds: Option<AutoscalingSpec>,
    pub replicas: u32,
    /// Live pods of the group.
    pub current: u32,
    /// Live pods that may be deleted now: not ready, or reported safe to retire.
    pub removable: u32,
    /// Some pod of the group is pending past the timeout.
    pub stuck: bool,
}

impl GroupView {
    /// `(min, max)`, with a max below the min read as the min.
    fn range(&self) -> Option<(u32, u32)> {
        self.bounds
            .map(|b| (b.min_replicas, b.min_replicas.max(b.max_replicas)))
    }

    /// Where an idle cluster takes the group.
    fn floor(&self) -> u32 {
        self.range().map_or(0, |(min, _)| min)
    }
}

/// Whether the cluster has work, as far as the idle timeout is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Idle {
    /// There is work, the timeout is not set, or the scheduler did not answer: follow the advice.
    Busy,
    /// No work, for less than the idle timeout: groups keep their workers.
    Waiting,
    /// No work for the idle timeout or longer: groups go to their floor.
    TimedOut,
}

/// The idle state at `now`, and the idle-since time to record: idle starts when the scheduler
/// first reports no work and ends with any work or without an answer.
pub fn idle_state(
    timeout: Option<Duration>,
    advice: Option<&Advice>,
    idle_since: Option<Timestamp>,
    now: Timestamp,
) -> (Idle, Option<Timestamp>) {
    let (Some(timeout), Some(advice)) = (timeout, advice) else {
        return (Idle::Busy, None);
    };
    if advice.backlog_tasks > 0 {
        return (Idle::Busy, None);
    }
    let since = idle_since.filter(|s| *s <= now).unwrap_or(now);
    let idle_for = now.duration_since(since).unsigned_abs();
    let state = if idle_for >= timeout {
        Idle::TimedOut
    } else {
        Idle::Waiting
    };
    (state, Some(since))
}

/// How many workers each group should have (in the order of `groups`); see the module
/// documentation for the rule.
pub fn targets(groups: &[GroupView], advice: Option<&Advice>, idle: Idle) -> Vec<u32> {
    if idle == Idle::TimedOut {
        return groups.iter().map(GroupView::floor).collect();
    }
    let mut out: Vec<u32> = groups
        .iter()
        .map(|g| match g.range() {
            None => g.replicas,
            Some((min, max)) => match advice {
                None => g.replicas.clamp(min, max),
                Some(_) => g.current.clamp(min, max),
            },
        })
        .collect();
    let Some(advice) = advice else {
        return out;
    };
    let fixed: u32 = groups
        .iter()
        .zip(&out)
        .filter(|(g, _)| g.bounds.is_none())
        .map(|(_, t)| *t)
        .sum();
    let scaled: Vec<usize> = (0..groups.len())
        .filter(|&i| groups[i].bounds.is_some())
        .collect();
    let need = u64::from(advice.desired.saturating_sub(fixed));
    let total: u64 = scaled.iter().map(|&i| u64::from(out[i])).sum();
    if need > total {
        let mut extra = need - total;
        for &i in scaled.iter().filter(|&&i| !groups[i].stuck) {
            let Some((_, max)) = groups[i].range() else {
                continue;
            };
            let add = extra.min(u64::from(max - out[i]));
            out[i] += add as u32;
            extra -= add;
        }
    } else if need < total && idle == Idle::Busy {
        let mut excess = total - need;
        // First where workers can go now, then where they will be held until safe.
        for first_pass in [true, false] {
            for &i in scaled.iter().rev() {
                let g = &groups[i];
                let Some((min, _)) = g.range() else {
                    continue;
                };
                let mut take = u64::from(out[i] - min);
                if first_pass {
                    // Pods above the clamped count already use up some of the removable ones.
                    let over = g.current.saturating_sub(out[i]);
                    take = take.min(u64::from(g.removable.saturating_sub(over)));
                }
                let take = take.min(excess);
                out[i] -= take as u32;
                excess -= take;
            }
        }
    }
    out
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

    fn scaled(min: u32, max: u32, current: u32) -> GroupView {
        GroupView {
            bounds: Some(AutoscalingSpec {
                min_replicas: min,
                max_replicas: max,
            }),
            replicas: min,
            current,
            removable: current,
            stuck: false,
        }
    }

    fn fixed(replicas: u32, current: u32) -> GroupView {
        GroupView {
            bounds: None,
            replicas,
            current,
            removable: current,
            stuck: false,
        }
    }

    fn advise(desired: u32, backlog_tasks: u64) -> Advice {
        Advice {
            desired,
            backlog_tasks,
            safe_to_retire: BTreeSet::new(),
        }
    }

    #[test]
    fn fixed_groups_ignore_advice() {
        let groups = [fixed(3, 3)];
        assert_eq!(targets(&groups, Some(&advise(10, 50)), Idle::Busy), [3]);
        assert_eq!(targets(&groups, Some(&advise(0, 0)), Idle::Busy), [3]);
        assert_eq!(targets(&groups, None, Idle::Busy), [3]);
    }

    #[test]
    fn one_group_follows_the_advice_within_bounds() {
        let g = |current| [scaled(2, 5, current)];
        assert_eq!(targets(&g(3), Some(&advise(10, 9)), Idle::Busy), [5]);
        assert_eq!(targets(&g(3), Some(&advise(0, 0)), Idle::Busy), [2]);
        assert_eq!(targets(&g(3), Some(&advise(4, 9)), Idle::Busy), [4]);
        // No advice: the replicas, still within bounds.
        let mut no_advice = scaled(2, 5, 0);
        no_advice.replicas = 3;
        assert_eq!(targets(&[no_advice], None, Idle::Busy), [3]);
        no_advice.replicas = 9;
        assert_eq!(targets(&[no_advice], None, Idle::Busy), [5]);
    }

    #[test]
    fn increases_fill_groups_in_spec_order_after_fixed_groups() {
        let groups = [fixed(1, 1), scaled(1, 3, 1), scaled(0, 2, 0)];
        // 6 wanted: the fixed worker counts, the first group fills to 3, the second takes 2.
        assert_eq!(
            targets(&groups, Some(&advise(6, 100)), Idle::Busy),
            [1, 3, 2]
        );
        // More than every bound allows: each at its max.
        assert_eq!(
            targets(&groups, Some(&advise(50, 100)), Idle::Busy),
            [1, 3, 2]
        );
        // 3 wanted: only the first group grows.
        assert_eq!(
            targets(&groups, Some(&advise(3, 100)), Idle::Busy),
            [1, 2, 0]
        );
    }

    #[test]
    fn existing_workers_stay_in_their_group() {
        // The second group already has 2: the first is not grown to take them over.
        let groups = [scaled(0, 4, 0), scaled(0, 4, 2)];
        assert_eq!(targets(&groups, Some(&advise(3, 9)), Idle::Busy), [1, 2]);
    }

    #[test]
    fn stuck_groups_get_no_more_workers() {
        let mut first = scaled(0, 4, 2);
        first.stuck = true;
        let groups = [first, scaled(0, 4, 0)];
        assert_eq!(targets(&groups, Some(&advise(5, 9)), Idle::Busy), [2, 3]);
    }

    #[test]
    fn decreases_come_from_the_last_group_and_from_retirable_workers_first() {
        let groups = [scaled(1, 4, 3), scaled(0, 4, 3)];
        // 6 -> 4: the last group gives 2.
        assert_eq!(targets(&groups, Some(&advise(4, 9)), Idle::Busy), [3, 1]);
        // The last group's workers all hold data: the first group's go instead.
        let mut holding = groups;
        holding[1].removable = 0;
        assert_eq!(targets(&holding, Some(&advise(4, 9)), Idle::Busy), [1, 3]);
        // Nothing can go anywhere: the cut lands on the last group, held there until safe.
        holding[0].removable = 0;
        assert_eq!(targets(&holding, Some(&advise(4, 9)), Idle::Busy), [3, 1]);
        // Never below a minimum.
        assert_eq!(targets(&groups, Some(&advise(0, 0)), Idle::Busy), [1, 0]);
    }

    #[test]
    fn pods_above_the_max_use_up_removable_workers_first() {
        // 5 pods for a max of 3 (the max was lowered): 2 removable pods go for the max already.
        let mut over = scaled(0, 3, 5);
        over.removable = 2;
        let groups = [scaled(0, 4, 2), over];
        assert_eq!(targets(&groups, Some(&advise(4, 9)), Idle::Busy), [1, 3]);
    }

    #[test]
    fn idle_groups_wait_then_go_to_their_floor() {
        let groups = [fixed(2, 2), scaled(1, 4, 3)];
        let idle = advise(0, 0);
        assert_eq!(targets(&groups, Some(&idle), Idle::Waiting), [2, 3]);
        assert_eq!(targets(&groups, Some(&idle), Idle::TimedOut), [0, 1]);
        assert_eq!(targets(&groups, Some(&idle), Idle::Busy), [2, 1]);
    }

    #[test]
    fn idle_time_starts_at_the_first_idle_answer() {
        let t = |s: i64| Timestamp::from_second(1_700_000_000 + s).unwrap();
        let timeout = Some(Duration::from_secs(30));
        let idle = advise(0, 0);
        let busy = advise(2, 7);
        assert_eq!(
            idle_state(timeout, Some(&idle), None, t(0)),
            (Idle::Waiting, Some(t(0)))
        );
        assert_eq!(
            idle_state(timeout, Some(&idle), Some(t(0)), t(29)),
            (Idle::Waiting, Some(t(0)))
        );
        assert_eq!(
            idle_state(timeout, Some(&idle), Some(t(0)), t(30)),
            (Idle::TimedOut, Some(t(0)))
        );
        assert_eq!(
            idle_state(timeout, Some(&busy), Some(t(0)), t(31)),
            (Idle::Busy, None)
        );
        // No answer or no timeout: not idle.
        assert_eq!(
            idle_state(timeout, None, Some(t(0)), t(60)),
            (Idle::Busy, None)
        );
        assert_eq!(
            idle_state(None, Some(&idle), None, t(60)),
            (Idle::Busy, None)
        );
        // A recorded time in the future (clock skew) restarts the wait.
        assert_eq!(
            idle_state(timeout, Some(&idle), Some(t(90)), t(60)),
            (Idle::Waiting, Some(t(60)))
        );
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

//! Status helpers: conditions that keep their transition time while unchanged, and the pods stuck
//! in `Pending` past a timeout with the reason taken from their events, so a cluster never sits
//! stuck without saying why.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use crate::crd::PendingPod;

/// At most this many pending pods are listed in a status.
pub const MAX_PENDING_LISTED: usize = 20;

/// Sets condition `type_` in `conditions`, keeping its `lastTransitionTime` when its status did not
/// change.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<String>,
    generation: Option<i64>,
    now: Timestamp,
) {
    let status = if status { "True" } else { "False" }.to_string();
    let previous = conditions.iter().position(|c| c.type_ == type_);
    let last_transition_time = match previous.map(|i| &conditions[i]) {
        Some(old) if old.status == status => old.last_transition_time.clone(),
        _ => Time(now),
    };
    let condition = Condition {
        type_: type_.to_string(),
        status,
        reason: reason.to_string(),
        message: message.into(),
        observed_generation: generation,
        last_transition_time,
    };
    match previous {
        Some(i) => conditions[i] = condition,
        None => conditions.push(condition),
    }
}

/// The time an event last happened, whichever API (core or events.k8s.io) recorded it.
fn event_time(event: &Event) -> Option<Timestamp> {
    event
        .event_time
        .as_ref()
        .map(|t| t.0)
        .or_else(|| event.last_timestamp.as_ref().map(|t| t.0))
        .or_else(|| event.first_timestamp.as_ref().map(|t| t.0))
        .or_else(|| event.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

/// Why `pod` is pending, when nothing more specific is known from events.
fn reason_from_pod(pod: &Pod) -> (String, String) {
    let status = pod.status.as_ref();
    let scheduled = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "PodScheduled"));
    if let Some(c) = scheduled.filter(|c| c.status == "False") {
        return (
            c.reason
                .clone()
                .unwrap_or_else(|| "Unschedulable".to_string()),
            c.message.clone().unwrap_or_default(),
        );
    }
    let waiting = status
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .find_map(|c| c.state.as_ref()?.waiting.as_ref());
    if let Some(w) = waiting {
        return (
            w.reason
                .clone()
                .unwrap_or_else(|| "ContainerWaiting".to_string()),
            w.message.clone().unwrap_or_default(),
        );
    }
    match pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
        Some(node) => (
            "NotStarted".to_string(),
            format!("bound to node {node}, but no container has started"),
        ),
        None => (
            "NotScheduled".to_string(),
            "not bound to any node yet".to_string(),
        ),
    }
}

/// The pods of `pods` pending for `timeout` or longer at `now`, each with the reason and message
/// of its latest warning event (else what its status says), sorted by name, at most
/// [`MAX_PENDING_LISTED`].
pub fn pending_pods(
    pods: &[Pod],
    warnings: &[Event],
    now: Timestamp,
    timeout: Duration,
) -> Vec<PendingPod> {
    let mut latest: BTreeMap<&str, &Event> = BTreeMap::new();
    for event in warnings {
        let Some(uid) = event.involved_object.uid.as_deref() else {
            continue;
        };
        let newer = latest
            .get(uid)
            .is_none_or(|old| event_time(event) >= event_time(old));
        if newer {
            latest.insert(uid, event);
        }
    }
    let mut pending: Vec<PendingPod> = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| {
            let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
            matches!(phase, None | Some("Pending"))
        })
        .filter_map(|p| {
            let created = p.metadata.creation_timestamp.as_ref()?.0;
            let age = now.duration_since(created).unsigned_abs();
            if age < timeout {
                return None;
            }
            let event = p.metadata.uid.as_deref().and_then(|uid| latest.get(uid));
            let (reason, message) = match event {
                Some(e) => (
                    e.reason.clone().unwrap_or_default(),
                    e.message.clone().unwrap_or_default(),
                ),
                None => reason_from_pod(p),
            };
            Some(PendingPod {
                name: p.metadata.name.clone().unwrap_or_default(),
                pending_seconds: age.as_secs(),
                reason,
                message,
            })
        })
        .collect();
    pending.sort_by(|a, b| a.name.cmp(&b.name));
    pending.truncate(MAX_PENDING_LISTED);
    pending
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ObjectReference, PodCondition, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).unwrap()
    }

    fn pod(name: &str, created: i64, phase: &str, node: Option<&str>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                uid: Some(format!("uid-{name}")),
                creation_timestamp: Some(Time(at(created))),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: node.map(String::from),
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some(phase.to_string()),
                ..Default::default()
            }),
        }
    }

    fn warning(pod: &str, reason: &str, message: &str, when: i64) -> Event {
        Event {
            involved_object: ObjectReference {
                kind: Some("Pod".to_string()),
                name: Some(pod.to_string()),
                uid: Some(format!("uid-{pod}")),
                ..Default::default()
            },
            reason: Some(reason.to_string()),
            message: Some(message.to_string()),
            type_: Some("Warning".to_string()),
            last_timestamp: Some(Time(at(when))),
            ..Default::default()
        }
    }

    #[test]
    fn only_pods_past_the_timeout_are_listed_with_their_latest_event() {
        let pods = vec![
            pod("c-g-0", 0, "Pending", None),
            pod("c-g-1", 95, "Pending", None),
            pod("c-g-2", 0, "Running", Some("n1")),
        ];
        let events = vec![
            warning("c-g-0", "FailedScheduling", "old", 10),
            warning(
                "c-g-0",
                "FailedScheduling",
                "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                50,
            ),
            warning("c-g-1", "FailedScheduling", "too young to list", 96),
        ];
        let listed = pending_pods(&pods, &events, at(100), Duration::from_secs(30));
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].name, "c-g-0");
        assert_eq!(listed[0].pending_seconds, 100);
        assert_eq!(listed[0].reason, "FailedScheduling");
        assert!(listed[0].message.contains("Insufficient nvidia.com/gpu"));
    }

    #[test]
    fn without_events_the_pod_status_explains() {
        let mut unschedulable = pod("a", 0, "Pending", None);
        if let Some(status) = unschedulable.status.as_mut() {
            status.conditions = Some(vec![PodCondition {
                type_: "PodScheduled".to_string(),
                status: "False".to_string(),
                reason: Some("Unschedulable".to_string()),
                message: Some("0/1 nodes are available".to_string()),
                ..Default::default()
            }]);
        }
        let bound = pod("b", 0, "Pending", Some("gpu-1"));
        let listed = pending_pods(
            &[unschedulable, bound],
            &[],
            at(60),
            Duration::from_secs(30),
        );
        assert_eq!(listed[0].reason, "Unschedulable");
        assert_eq!(listed[1].reason, "NotStarted");
        assert!(listed[1].message.contains("gpu-1"));
    }

    #[test]
    fn transition_time_survives_unchanged_status() {
        let mut conditions = Vec::new();
        set_condition(
            &mut conditions,
            "Ready",
            false,
            "Starting",
            "",
            Some(1),
            at(0),
        );
        set_condition(
            &mut conditions,
            "Ready",
            false,
            "Starting",
            "again",
            Some(2),
            at(5),
        );
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].last_transition_time, Time(at(0)));
        assert_eq!(conditions[0].observed_generation, Some(2));
        set_condition(&mut conditions, "Ready", true, "Ready", "", Some(2), at(9));
        assert_eq!(conditions[0].last_transition_time, Time(at(9)));
        assert_eq!(conditions[0].status, "True");
    }
}

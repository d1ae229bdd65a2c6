//! The scheduler's scaling advice over gRPC (`Scheduler.GetScalingAdvice`), mapped onto one
//! worker group.
//!
//! The scheduler advises for the whole cluster; worker ids are their pods' names
//! (`{cluster}-{group}-{index}`), so the group's share is the desired count less the workers of
//! the other groups, and only the group's own retirable workers are offered for retirement. With
//! several autoscaled groups in one cluster each may claim the same backlog: the scheduler does not
//! yet split its backlog by group (it knows no resource tags; issue 4).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use futures::future::BoxFuture;
use tonic::transport::{Channel, Endpoint};
use wrk_proto::scheduler_client::SchedulerClient;
use wrk_proto::{Empty, ScalingRequest};

use crate::scaling::{Advice, AdvisorError, ScalingAdvisor};

/// How soon the backlog should be done when the operator asks.
const TARGET: Duration = Duration::from_secs(60);

/// Asks each cluster's scheduler, keeping one connection per scheduler address.
#[derive(Default)]
pub struct GrpcAdvisor {
    channels: Mutex<HashMap<String, Channel>>,
}

/// Whether worker `id` (a pod name `{cluster}-{group}-{index}`) belongs to `group`.
fn in_group(id: &str, group: &str) -> bool {
    id.rsplit_once('-').is_some_and(|(prefix, index)| {
        index.chars().all(|c| c.is_ascii_digit()) && prefix.ends_with(&format!("-{group}"))
    })
}

impl GrpcAdvisor {
    async fn channel(&self, address: &str) -> Result<Channel, String> {
        if let Some(channel) = self
            .channels
            .lock()
            .ok()
            .and_then(|m| m.get(address).cloned())
        {
            return Ok(channel);
        }
        let channel = Endpoint::from_shared(address.to_string())
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(10))
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        if let Ok(mut map) = self.channels.lock() {
            map.insert(address.to_string(), channel.clone());
        }
        Ok(channel)
    }

    async fn ask(&self, address: &str, group: &str) -> Result<Advice, String> {
        let mut client = SchedulerClient::new(self.channel(address).await?);
        let advice = client
            .get_scaling_advice(ScalingRequest {
                target_duration_ms: TARGET.as_millis() as u64,
            })
            .await
            .map_err(|s| s.message().to_string())?
            .into_inner();
        let status = client
            .get_cluster_status(Empty {})
            .await
            .map_err(|s| s.message().to_string())?
            .into_inner();
        let others = status
            .workers
            .iter()
            .filter(|w| !in_group(&w.worker_id, group))
            .count() as u32;
        Ok(Advice {
            recommended: advice.desired_workers.saturating_sub(others),
            safe_to_retire: advice
                .retirable_workers
                .into_iter()
                .filter(|id| in_group(id, group))
                .collect(),
        })
    }
}

impl ScalingAdvisor for GrpcAdvisor {
    fn advise<'a>(
        &'a self,
        scheduler_address: &'a str,
        group: &'a str,
    ) -> BoxFuture<'a, Result<Advice, AdvisorError>> {
        Box::pin(async move {
            self.ask(scheduler_address, group).await.map_err(|reason| {
                // A failed connection is not reused.
                if let Ok(mut map) = self.channels.lock() {
                    map.remove(scheduler_address);
                }
                AdvisorError {
                    cluster: scheduler_address.to_string(),
                    reason,
                }
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_membership_from_pod_names() {
        assert!(in_group("demo-a100-3", "a100"));
        assert!(in_group("my-demo-mig-1g-0", "mig-1g"));
        assert!(!in_group("demo-a100-3", "t4"));
        assert!(!in_group("demo-a100-x", "a100"));
        assert!(!in_group("local-0", "a100"));
    }

    #[tokio::test]
    async fn an_unreachable_scheduler_is_a_clear_error() {
        let advisor = GrpcAdvisor::default();
        let err = match advisor.advise("http://127.0.0.1:1", "a100").await {
            Err(e) => e.to_string(),
            Ok(advice) => panic!("advice from nowhere: {advice:?}"),
        };
        assert!(
            err.contains("scaling advice for `http://127.0.0.1:1` unavailable"),
            "{err}"
        );
    }
}

//! The scheduler's scaling advice over gRPC (`Scheduler.GetScalingAdvice`), asked with the
//! cluster's client token when its scheduler requires tenant tokens.
//!
//! The advice is for the whole cluster; [`crate::scaling::targets`] splits it over the worker
//! groups. Worker ids are their pods' names, so the scheduler's retirable workers name pods.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use futures::future::BoxFuture;
use tonic::transport::{Channel, Endpoint};
use wrk_proto::ScalingRequest;
use wrk_proto::auth::BearerToken;
use wrk_proto::scheduler_client::SchedulerClient;

use crate::scaling::{Advice, AdvisorError, ScalingAdvisor};

/// How soon the backlog should be done when the operator asks, unless configured.
pub const DEFAULT_TARGET: Duration = Duration::from_secs(60);

/// Asks each cluster's scheduler, keeping one connection per scheduler address.
pub struct GrpcAdvisor {
    target: Duration,
    channels: Mutex<HashMap<String, Channel>>,
}

impl Default for GrpcAdvisor {
    fn default() -> Self {
        GrpcAdvisor::new(DEFAULT_TARGET)
    }
}

impl GrpcAdvisor {
    /// An advisor asking for the workers that finish the backlog within `target`.
    pub fn new(target: Duration) -> Self {
        GrpcAdvisor {
            target,
            channels: Mutex::new(HashMap::new()),
        }
    }

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
            .map_err(|e| format!("cannot connect: {e}"))?;
        if let Ok(mut map) = self.channels.lock() {
            map.insert(address.to_string(), channel.clone());
        }
        Ok(channel)
    }

    async fn ask(&self, address: &str, token: Option<&str>) -> Result<Advice, String> {
        let bearer = BearerToken::new(token).map_err(|e| format!("the client token: {e}"))?;
        let mut client = SchedulerClient::with_interceptor(self.channel(address).await?, bearer);
        let advice = client
            .get_scaling_advice(ScalingRequest {
                target_duration_ms: self.target.as_millis().max(1) as u64,
            })
            .await
            .map_err(|s| s.message().to_string())?
            .into_inner();
        Ok(Advice {
            desired: advice.desired_workers,
            backlog_tasks: advice.backlog_tasks,
            safe_to_retire: advice.retirable_workers.into_iter().collect(),
        })
    }
}

impl ScalingAdvisor for GrpcAdvisor {
    fn advise<'a>(
        &'a self,
        scheduler_address: &'a str,
        token: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Advice, AdvisorError>> {
        Box::pin(async move {
            self.ask(scheduler_address, token).await.map_err(|reason| {
                // A failed connection is not reused.
                if let Ok(mut map) = self.channels.lock() {
                    map.remove(scheduler_address);
                }
                AdvisorError {
                    scheduler: scheduler_address.to_string(),
                    reason,
                }
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_unreachable_scheduler_is_a_clear_error() {
        let advisor = GrpcAdvisor::default();
        let err = match advisor.advise("http://127.0.0.1:1", None).await {
            Err(e) => e.to_string(),
            Ok(advice) => panic!("advice from nowhere: {advice:?}"),
        };
        assert!(
            err.contains("scaling advice from `http://127.0.0.1:1` unavailable: cannot connect"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_token_that_cannot_travel_is_refused_before_connecting() {
        let advisor = GrpcAdvisor::default();
        let err = match advisor
            .advise("http://127.0.0.1:1", Some("two words"))
            .await
        {
            Err(e) => e.to_string(),
            Ok(advice) => panic!("advice with a bad token: {advice:?}"),
        };
        assert!(err.contains("the client token"), "{err}");
    }
}

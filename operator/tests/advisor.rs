//! `GrpcAdvisor` against the real scheduler service (in process, on a loopback port) that
//! requires tenant and worker tokens: the advice comes only with a tenant token, names the worker
//! that attached as safe to retire while it holds nothing, and a missing or unknown token is a
//! clear error.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use wrk_operator::advisor::GrpcAdvisor;
use wrk_operator::scaling::ScalingAdvisor;
use wrk_proto::auth::BearerToken;
use wrk_proto::scheduler_client::SchedulerClient;
use wrk_proto::worker_message::Kind;
use wrk_proto::{Register, WorkerMessage};
use wrk_scheduler::SchedulerConfig;
use wrk_scheduler::tenants::Tenants;

const OPERATOR: &str = "operator-token-0123456789";
const WORKERS: &str = "worker-token-0123456789";

#[tokio::test]
async fn advice_needs_a_tenant_token_and_names_idle_workers() {
    tokio::time::timeout(Duration::from_secs(60), check_advice())
        .await
        .expect("the check finishes within a minute");
}

async fn check_advice() {
    let tenants = Tenants::parse(
        &format!("[[tenant]]\nname = \"wrk-operator\"\ntoken = \"{OPERATOR}\"\n"),
        Path::new("tenants.toml"),
    )
    .expect("tenants");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let config = SchedulerConfig {
        tenants: Some(Arc::new(tenants)),
        worker_token: Some(WORKERS.to_string()),
        ..Default::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let stopped = async {
        let _ = stopped.await;
    };
    let server = tokio::spawn(wrk_scheduler::serve(listener, None, config, stopped));

    // One worker attaches with the worker token, under its pod's name.
    let channel = tonic::transport::Endpoint::from_shared(url.clone())
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut worker =
        SchedulerClient::with_interceptor(channel, BearerToken::new(Some(WORKERS)).expect("token"));
    let register = WorkerMessage {
        kind: Some(Kind::Register(Register {
            worker_id: "demo-a100-0".to_string(),
            data_address: "http://127.0.0.1:1".to_string(),
            slots: 1,
            device: "cpu".to_string(),
            ..Default::default()
        })),
    };
    let outbound = futures::stream::iter(vec![register]).chain(futures::stream::pending());
    let mut inbound = worker
        .attach(outbound)
        .await
        .expect("the scheduler takes the worker")
        .into_inner();
    inbound
        .message()
        .await
        .expect("registered")
        .expect("a first message");

    let advisor = GrpcAdvisor::new(Duration::from_secs(60));
    let advice = advisor
        .advise(&url, Some(OPERATOR))
        .await
        .expect("advice with the operator's tenant token");
    assert_eq!(advice.desired, 0, "no work");
    assert_eq!(advice.backlog_tasks, 0);
    assert_eq!(
        advice.safe_to_retire.into_iter().collect::<Vec<_>>(),
        ["demo-a100-0"]
    );

    let missing = advisor.advise(&url, None).await.expect_err("no token");
    assert!(
        missing.to_string().contains("requires a tenant token"),
        "{missing}"
    );
    let unknown = advisor
        .advise(&url, Some("not-a-tenant-0000"))
        .await
        .expect_err("unknown token");
    assert!(
        unknown.to_string().contains("unknown tenant token"),
        "{unknown}"
    );
    // The worker token is not a tenant token.
    assert!(advisor.advise(&url, Some(WORKERS)).await.is_err());

    // The worker's stream stays open (a graceful stop would wait for it): stop the server hard.
    drop(inbound);
    drop(stop);
    server.abort();
}

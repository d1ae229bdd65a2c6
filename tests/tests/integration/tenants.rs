//! Tenants across real processes: a scheduler with a tenants file and a worker token; a worker
//! with the wrong token is refused; one tenant cannot list, read or cancel another's jobs; unknown
//! and missing tokens are refused with a clear message; a tenant's `max_tasks` holds, as its
//! jobs' timelines show.

use std::process::{Command, Output, Stdio};

use crate::common::*;
use wrk_proto::JobRef;

const ALICE: &str = "alice-token-0123456789";
const BOB: &str = "bob-token-0123456789ab";
const WORKERS: &str = "worker-token-0123456789";

fn wrk_as(token: Option<&str>, args: &[&str]) -> Output {
    let mut command = Command::new(wrk());
    command.args(args).env_remove("WRK_TOKEN");
    if let Some(token) = token {
        command.env("WRK_TOKEN", token);
    }
    command.output().expect("run wrk")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_isolated_and_unknown_tokens_are_refused() {
    let _ = guest("taxi-haversine");
    let data = taxi_dataset(20_000, 1, 10_000);
    let dir = tempfile::tempdir().unwrap();
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(
        &tenants,
        format!("[[tenant]]\nname = \"alice\"\ntoken = \"{ALICE}\"\n[[tenant]]\nname = \"bob\"\ntoken = \"{BOB}\"\n"),
    )
    .unwrap();

    let mut processes = Processes(Vec::new());
    let tenants_arg = tenants.to_str().expect("a UTF-8 temp path");
    let url = start_scheduler(
        &mut processes,
        &["--tenants", tenants_arg],
        &[("WRK_WORKER_TOKEN", WORKERS)],
    )
    .url;

    // A worker with the wrong token is refused and says why.
    let refused = Command::new(wrk())
        .args([
            "worker",
            "--scheduler",
            &url,
            "--listen",
            "127.0.0.1:0",
            "--token",
            "wrong-token-000000000",
        ])
        .output()
        .expect("run a worker with a wrong token");
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("unknown worker token"),
        "{}",
        stderr(&refused)
    );

    let worker = worker_command(&url, "w1", &[])
        .env("WRK_WORKER_TOKEN", WORKERS)
        .stderr(Stdio::null())
        .spawn()
        .expect("start wrk worker");
    processes.0.push(worker);
    wait_for_workers(&url, 1, Some(ALICE));

    // Alice runs a job.
    let job = workspace_root().join("guest-examples/taxi-haversine/job.toml");
    let source = format!("trips={}", data.path().display());
    let run = wrk_as(
        Some(ALICE),
        &[
            "submit",
            job.to_str().unwrap(),
            "--scheduler",
            &url,
            "--quiet",
            "--source",
            &source,
            "--module",
            guest("taxi-haversine").to_str().expect("a UTF-8 path"),
        ],
    );
    assert!(run.status.success(), "alice's job failed: {}", stderr(&run));
    let job_id = stderr(&run)
        .split_whitespace()
        .find(|w| w.starts_with("(job-"))
        .map(|w| w.trim_matches(|c| c == '(' || c == ')').to_string())
        .expect("the job id is reported");

    // Alice sees it; Bob does not, and cannot read or cancel it.
    let listed = |token| {
        let out = wrk_as(
            Some(token),
            &["status", "--scheduler", &url, "--output", "json"],
        );
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status JSON");
        json["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["id"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(listed(ALICE), vec![job_id.clone()]);
    assert!(listed(BOB).is_empty(), "bob lists no job");
    let cancel = wrk_as(Some(BOB), &["cancel", &job_id, "--scheduler", &url]);
    assert!(!cancel.status.success());
    assert!(
        stderr(&cancel).contains(&format!("no job `{job_id}`")),
        "{}",
        stderr(&cancel)
    );
    let mut bob = wrk_cli::client::connect(&url, Some(BOB)).await.unwrap();
    for status in [
        bob.get_job_result(JobRef {
            job_id: job_id.clone(),
        })
        .await
        .unwrap_err(),
        bob.watch_job(JobRef {
            job_id: job_id.clone(),
        })
        .await
        .map(|_| ())
        .unwrap_err(),
        bob.get_job_timeline(JobRef {
            job_id: job_id.clone(),
        })
        .await
        .unwrap_err(),
        bob.release_job(JobRef {
            job_id: job_id.clone(),
        })
        .await
        .unwrap_err(),
    ] {
        assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    }

    // The data plane: a result partition is served straight from the worker only with the
    // ticket the scheduler signed for its owner.
    let overrides = wrk_cli::job::Overrides {
        sources: vec![("trips".into(), data.path().display().to_string())],
        module: Some(guest("taxi-haversine")),
        ..Default::default()
    };
    let spec = wrk_cli::job::plan(&job, &overrides).unwrap();
    let mut alice = wrk_cli::client::connect(&url, Some(ALICE)).await.unwrap();
    let second = alice
        .submit_job(wrk_proto::SubmitJobRequest {
            job: Some(spec),
            keep_timeline: true,
            priority: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .job_id;
    let mut progress = alice
        .watch_job(JobRef {
            job_id: second.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    while let Some(p) = progress.message().await.unwrap() {
        if p.state() == wrk_proto::JobState::Succeeded {
            break;
        }
        assert_ne!(p.state(), wrk_proto::JobState::Failed, "{}", p.error);
    }
    let result = alice
        .get_job_result(JobRef {
            job_id: second.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let location = result
        .partitions
        .first()
        .expect("a result partition")
        .clone();
    let key = location.key.clone().unwrap();
    assert!(
        !location.ticket.is_empty(),
        "the scheduler signs locations when workers have a token"
    );
    let peers = wrk_host::transfer::PeerClient::new();
    let refused = peers
        .fetch(&location.address, &key, "")
        .await
        .expect_err("no ticket, no data");
    assert!(refused.to_string().contains("invalid ticket"), "{refused}");
    let forged = wrk_proto::auth::partition_ticket(b"a-guess", &key);
    assert!(
        peers.fetch(&location.address, &key, &forged).await.is_err(),
        "a forged ticket is refused"
    );
    let table = peers
        .fetch(&location.address, &key, &location.ticket)
        .await
        .expect("the owner's ticket works");
    assert_eq!(table.num_rows() as u64, location.rows);
    // The job's timeline, for a report: its owner's, and nobody else's.
    let second_ref = JobRef {
        job_id: second.clone(),
    };
    let timeline = alice
        .get_job_timeline(second_ref.clone())
        .await
        .expect("the owner reads the timeline")
        .into_inner();
    assert!(!timeline.tasks.is_empty(), "{timeline:?}");
    let refused = bob.get_job_timeline(second_ref).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::NotFound, "{refused:?}");
    alice.release_job(JobRef { job_id: second }).await.unwrap();

    // Unknown and missing tokens are refused.
    let unknown = wrk_as(
        Some("nobody-token-0123456789"),
        &["status", "--scheduler", &url],
    );
    assert!(!unknown.status.success());
    assert!(
        stderr(&unknown).contains("unknown tenant token"),
        "{}",
        stderr(&unknown)
    );
    let missing = wrk_as(None, &["status", "--scheduler", &url]);
    assert!(!missing.status.success());
    assert!(
        stderr(&missing).contains("requires a tenant token"),
        "{}",
        stderr(&missing)
    );
}

/// Pairs of a timeline's successful task executions that overlap in time, and the most that
/// ran at once.
fn concurrency(timeline: &wrk_proto::JobTimeline) -> usize {
    let mut edges: Vec<(u64, i32)> = timeline
        .tasks
        .iter()
        .filter(|t| t.error.is_empty())
        .flat_map(|t| [(t.start_us, 1), (t.end_us, -1)])
        .collect();
    // An end and a start at the same instant do not overlap.
    edges.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, step) in edges {
        now += step;
        most = most.max(now);
    }
    most as usize
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_never_runs_more_tasks_at_once_than_its_max_tasks() {
    let dir = tempfile::tempdir().unwrap();
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(
        &tenants,
        format!(
            "[[tenant]]\nname = \"alice\"\ntoken = \"{ALICE}\"\nmax_tasks = 1\n[[tenant]]\nname = \"bob\"\ntoken = \"{BOB}\"\nweight = 2\n"
        ),
    )
    .unwrap();
    let mut processes = Processes(Vec::new());
    let tenants_arg = tenants.to_str().expect("a UTF-8 temp path");
    let url = start_scheduler(&mut processes, &["--tenants", tenants_arg], &[]).url;
    processes
        .0
        .push(start_worker(&url, "w1", &["--slots", "4"]));
    wait_for_workers(&url, 1, Some(ALICE));

    let job = slow_job(dir.path(), "quota", 150, &[("slow", 6, &[])]);
    let spec = wrk_cli::job::plan(&job, &wrk_cli::job::Overrides::default()).unwrap();
    // Both at once: alice is held to one task while bob uses the other slots.
    let (alice, bob) = tokio::join!(
        run_with_timeline(&url, Some(ALICE), spec.clone(), 0),
        run_with_timeline(&url, Some(BOB), spec, 0),
    );
    assert_eq!(alice.tasks.len(), 6);
    assert_eq!(
        concurrency(&alice),
        1,
        "alice ran tasks at once: {:?}",
        alice.tasks
    );
    // The same measure sees bob's tasks overlap: it would see alice's.
    assert!(concurrency(&bob) >= 2, "{:?}", bob.tasks);

    // A bad quota names the file and the tenant.
    std::fs::write(
        &tenants,
        format!("[[tenant]]\nname = \"alice\"\ntoken = \"{ALICE}\"\nmax_taks = 1\n"),
    )
    .unwrap();
    let refused = Command::new(wrk())
        .args([
            "scheduler",
            "--listen",
            "127.0.0.1:0",
            "--tenants",
            tenants_arg,
        ])
        .output()
        .expect("run wrk scheduler");
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains(tenants_arg) && stderr(&refused).contains("max_taks"),
        "{}",
        stderr(&refused)
    );
}

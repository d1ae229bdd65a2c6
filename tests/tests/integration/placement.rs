//! Placement across real processes: worker tags and the stages that require them. Two workers
//! offer different tags (`wrk worker --tags`); a stage requiring one runs only on the worker
//! having it (as the job's timeline records), a stage requiring a tag nobody has waits and
//! says so in `wrk status` until a worker with it joins, and invalid tags are refused.

use std::collections::BTreeSet;
use std::process::Command;

use crate::common::*;

/// The workers that ran each stage's tasks, by stage name.
fn workers_by_stage(timeline: &wrk_proto::JobTimeline) -> Vec<(String, BTreeSet<String>)> {
    timeline
        .stages
        .iter()
        .enumerate()
        .map(|(s, stage)| {
            let workers = timeline
                .tasks
                .iter()
                .filter(|t| t.stage == s as u32 && t.error.is_empty())
                .map(|t| timeline.workers[t.worker as usize].worker_id.clone())
                .collect();
            (stage.name.clone(), workers)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tagged_stages_run_only_on_workers_with_the_tags() {
    let dir = tempfile::tempdir().unwrap();
    let mut processes = Processes(Vec::new());
    let scheduler = start_scheduler(&mut processes, &[], &[]);
    let url = scheduler.url.clone();

    let refused = Command::new(wrk())
        .args(["worker", "--scheduler", &url, "--tags", "big,Not OK"])
        .output()
        .expect("run wrk worker with a bad tag");
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("tag `Not OK` has characters other than"),
        "{stderr}"
    );

    processes
        .0
        .push(start_worker(&url, "w-big", &["--tags", "big,fast"]));
    let mut small = worker_command(&url, "w-small", &[]);
    small
        .env("WRK_WORKER_TAGS", "small")
        .stderr(std::process::Stdio::null());
    processes.0.push(small.spawn().expect("start wrk worker"));
    wait_for_workers(&url, 2, None);

    let status = Command::new(wrk())
        .args(["status", "--scheduler", &url, "--output", "json"])
        .output()
        .expect("wrk status");
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status JSON");
    let tags: Vec<(String, serde_json::Value)> = json["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["id"].as_str().unwrap().to_string(), w["tags"].clone()))
        .collect();
    assert_eq!(
        tags,
        [
            (
                "w-big".to_string(),
                serde_json::json!(["big", "cpu", "fast"])
            ),
            ("w-small".to_string(), serde_json::json!(["cpu", "small"])),
        ]
    );

    let job = slow_job(
        dir.path(),
        "tagged",
        100,
        &[
            ("anywhere", 6, &[]),
            ("big-only", 6, &["big"]),
            ("small-only", 6, &["small", "cpu"]),
        ],
    );
    let spec = wrk_cli::job::plan(&job, &wrk_cli::job::Overrides::default()).unwrap();
    let timeline = run_with_timeline(&url, None, spec, 0).await;
    let by_stage = workers_by_stage(&timeline);
    let set = |ids: &[&str]| ids.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(by_stage[1], ("big-only".to_string(), set(&["w-big"])));
    assert_eq!(by_stage[2], ("small-only".to_string(), set(&["w-small"])));
    assert_eq!(
        timeline.tasks.iter().filter(|t| t.error.is_empty()).count(),
        18
    );

    // A stage requiring a tag no worker has waits, and says why, until one joins.
    let job = slow_job(dir.path(), "waits", 10, &[("huge-only", 2, &["huge"])]);
    let result = dir.path().join("waits.parquet");
    let mut submit = spawn_submit(&url, &job, &result, &[]);
    let started = std::time::Instant::now();
    loop {
        let status = Command::new(wrk())
            .args(["status", "--scheduler", &url, "--output", "json"])
            .output()
            .expect("wrk status");
        let json: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status JSON");
        let waiting = json["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["name"] == "waits")
            .map(|j| j["waiting"].as_str().unwrap_or_default().to_string());
        if let Some(waiting) = waiting.filter(|w| !w.is_empty()) {
            assert_eq!(
                waiting,
                "waiting for a worker with tags [huge] (stage `huge-only`)"
            );
            break;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "the job never said what it waits for: {json}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(
        submit.try_wait().unwrap().is_none(),
        "the job waits rather than fails"
    );
    processes
        .0
        .push(start_worker(&url, "w-huge", &["--tags", "huge"]));
    let status = submit.wait().expect("wrk submit ends");
    assert!(
        status.success(),
        "the job ran once a worker with the tag joined"
    );
}

//! Recovery from lost workers across real processes: a scheduler and three workers run a
//! three-stage job while one worker is killed with SIGKILL, at ten different moments; every run
//! must still give the reference answer (running tasks move, lost outputs are recomputed).

use std::process::Child;
use std::time::Duration;

use crate::common::*;

#[test]
fn killing_a_worker_mid_job_ten_times_still_gives_the_reference_answer() {
    let data = taxi_dataset(60_000, 6, 10_000);
    let reference = taxi_reference(data.path());
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("recovery.toml");
    std::fs::write(
        &job,
        format!(
            r#"
name = "recovery"
[params]
delay_ms = "120"
[sources.trips]
path = "{data}"
[[stage]]
name = "read"
module = "{slow}"
source = "trips"
columns = ["pickup_longitude", "pickup_latitude", "dropoff_longitude", "dropoff_latitude", "passenger_count"]
[[stage]]
name = "distance"
module = "{taxi}"
inputs = [{{ stage = "read", pattern = "one-to-one" }}]
[[stage]]
name = "summary"
module = "{taxi}"
inputs = ["distance"]
"#,
            data = data.path().display(),
            slow = guest("test-guest-slow").display(),
            taxi = guest("taxi-haversine").display(),
        ),
    )
    .unwrap();

    let cache = dir.path().join("cache").to_string_lossy().into_owned();
    // One slot each, so a kill always catches tasks in flight; one compiled-component cache.
    let worker_args = ["--slots", "1", "--cache-dir", &cache];
    let mut processes = Processes(Vec::new());
    let scheduler = start_scheduler(
        &mut processes,
        &["--heartbeat-ms", "100", "--worker-timeout-secs", "2"],
        &[],
    );
    let (url, log) = (scheduler.url.clone(), scheduler.log.clone());
    let mut workers: Vec<Child> = (0..3)
        .map(|i| start_worker(&url, &format!("w{i}"), &worker_args))
        .collect();
    wait_for_workers(&url, 3, None);

    for round in 0..10u64 {
        let result = dir.path().join(format!("summary-{round}.parquet"));
        let submit = spawn_submit(&url, &job, &result, &[]);
        // Six 120 ms reads on three single-slot workers take two waves: kill inside the job.
        std::thread::sleep(Duration::from_millis(40 + round * 25));
        let victim = (round % 3) as usize;
        let id = format!("w{victim}-{round}");
        replace_worker(&mut workers, victim, &url, &id, &worker_args);

        let output = submit.wait_with_output().expect("wait for wrk submit");
        assert!(
            output.status.success(),
            "round {round}: the job failed after a worker was killed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert_summaries_match(&read_summary(&result), &reference);
    }
    processes.0.extend(workers);

    // The kills landed inside jobs: work was rerun or recomputed, not merely restarted idle.
    let log = log.lock().unwrap();
    let costly = costly_losses(&log);
    assert!(
        costly >= 5,
        "only {costly} of 10 kills hit running work:\n{}",
        log.join("\n")
    );
}

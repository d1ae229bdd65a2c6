//! Scheduler-only throughput: 1,000 simulated workers (in-process, no network) run a 1,000,000-task
//! graph (see [`graph`]) through the real state machine. Prints tasks/s, task transitions/s and
//! resident memory per task. `cargo bench -p wrk-scheduler`; `WRK_BENCH_TASKS` and
//! `WRK_BENCH_WORKERS` change the sizes.

use std::collections::VecDeque;
use std::time::Instant;

use tokio::sync::mpsc;
use wrk_proto::scheduler_message::Kind;
use wrk_proto::stage_input::Pattern;
use wrk_proto::{JobSpec, JobState, OutputMeta, Register, Stage, StageInput, TaskDone};
use wrk_scheduler::state::State;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Resident set size of this process, from the OS.
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// Three stages, about `tasks` in all: `a` ((tasks-1)/2 tasks) -> `b` one-to-one over `a` -> `c`,
/// one task gathering every output of `b`.
fn graph(tasks: usize) -> JobSpec {
    let wide = ((tasks - 1) / 2) as u32;
    let stage = |name: &str, num_tasks: u32, inputs: Vec<StageInput>| Stage {
        name: name.into(),
        module_hash: "bench".into(),
        num_tasks,
        inputs,
        ..Default::default()
    };
    JobSpec {
        name: "scale".into(),
        stages: vec![
            stage("a", wide, vec![]),
            stage(
                "b",
                wide,
                vec![StageInput {
                    stage: 0,
                    pattern: Pattern::OneToOne as i32,
                    ..Default::default()
                }],
            ),
            stage(
                "c",
                1,
                vec![StageInput {
                    stage: 1,
                    pattern: Pattern::All as i32,
                    ..Default::default()
                }],
            ),
        ],
        ..Default::default()
    }
}

fn main() {
    let tasks = env("WRK_BENCH_TASKS", 1_000_000);
    let workers = env("WRK_BENCH_WORKERS", 1_000);
    let mut state = State::new();
    let mut inboxes = Vec::new();
    for w in 0..workers {
        let (tx, rx) = mpsc::unbounded_channel();
        state
            .register_worker(
                &Register {
                    worker_id: format!("sim-{w:04}"),
                    data_address: format!("http://10.0.{}.{}:7071", w / 256, w % 256),
                    slots: 4,
                    ..Default::default()
                },
                tx,
            )
            .expect("unique worker ids");
        inboxes.push(rx);
    }
    let before = rss_bytes();
    let started = Instant::now();
    let (job_id, _) = state.submit("bench", graph(tasks));
    let total: usize = 2 * ((tasks - 1) / 2) + 1;
    let submitted = started.elapsed();
    let mut in_flight: VecDeque<wrk_proto::TaskId> = VecDeque::new();
    let mut transitions = 0u64;
    let mut completed = 0usize;
    let queue_assignments = |out: wrk_scheduler::state::Outgoing, in_flight: &mut VecDeque<_>| {
        for (_, message) in out {
            if let Some(Kind::Assign(assign)) = message.kind {
                for task in assign.tasks {
                    in_flight.push_back(task.task.expect("assigned task has an id"));
                }
            }
        }
    };
    queue_assignments(state.dispatch(), &mut in_flight);
    let mut peak_rss = rss_bytes();
    while let Some(task) = in_flight.pop_front() {
        let worker = state
            .worker_of(&task)
            .expect("an assigned task runs somewhere");
        let out = state.task_done(
            &worker,
            TaskDone {
                task: Some(task),
                outputs: vec![OutputMeta {
                    rows: 1000,
                    bytes: 8000,
                }],
                stats: None,
            },
        );
        transitions += 2; // ready -> running, running -> done
        completed += 1;
        queue_assignments(out, &mut in_flight);
        if completed.is_multiple_of(100_000) {
            peak_rss = peak_rss.max(rss_bytes());
        }
        // The simulated workers' inboxes are drained lazily: the messages were built and sent.
        if completed.is_multiple_of(10_000) {
            for inbox in &mut inboxes {
                while inbox.try_recv().is_ok() {}
            }
        }
    }
    let elapsed = started.elapsed();
    let result = state.result("bench", &job_id).expect("the job exists");
    assert_eq!(result.state(), JobState::Succeeded, "{}", result.error);
    assert_eq!(completed, total);
    let per_task = peak_rss.saturating_sub(before) as f64 / total as f64;
    println!(
        "scheduler, {workers} simulated workers, {total} tasks (3 stages): submit {:.2?}, run {:.2?}: \
         {:.0} tasks/s, {:.0} task transitions/s; peak RSS growth {:.0} bytes/task",
        submitted,
        elapsed,
        total as f64 / elapsed.as_secs_f64(),
        transitions as f64 / elapsed.as_secs_f64(),
        per_task
    );
}

//! The figures of a performance report, computed from a job's timeline: per stage, per worker,
//! per pair of workers, and the slowest task attempts.

use std::collections::BTreeMap;

use wrk_proto::{JobTimeline, TaskExecution};

/// Per-stage figures over the stage's task attempts.
#[derive(Debug, Clone, PartialEq)]
pub struct StageStats {
    pub name: String,
    /// Tasks of the stage in the job graph.
    pub tasks: u32,
    pub succeeded: u64,
    pub failed: u64,
    /// Sum of the attempts' durations (task-seconds of work), in microseconds.
    pub busy_us: u64,
    /// Duration percentiles of the successful attempts, in microseconds.
    pub mean_us: f64,
    pub p50_us: u64,
    pub p95_us: u64,
    pub max_us: u64,
    /// From the first attempt's start to the last one's end, in microseconds.
    pub span_us: u64,
    pub output_bytes: u64,
    pub output_rows: u64,
    pub fetched_bytes: u64,
}

impl StageStats {
    /// Successful tasks per second of the stage's span.
    pub fn tasks_per_second(&self) -> f64 {
        self.succeeded as f64 / (self.span_us.max(1) as f64 / 1e6)
    }

    /// Output bytes per second of the stage's span.
    pub fn output_bytes_per_second(&self) -> f64 {
        self.output_bytes as f64 / (self.span_us.max(1) as f64 / 1e6)
    }
}

/// Per-worker figures.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerStats {
    pub worker: String,
    pub device: String,
    pub slots: u32,
    pub attempts: u64,
    pub busy_us: u64,
    pub output_bytes: u64,
    pub fetched_bytes: u64,
    pub peak_memory_bytes: Option<u64>,
}

/// Bytes moved from one worker to another.
#[derive(Debug, Clone, PartialEq)]
pub struct PairStats {
    pub from: String,
    pub to: String,
    pub bytes: u64,
    pub transfers: u64,
}

/// The value at `quantile` (0..=1) of sorted `values` (nearest rank).
pub fn percentile(sorted: &[u64], quantile: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (quantile * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn duration(t: &TaskExecution) -> u64 {
    t.end_us.saturating_sub(t.start_us)
}

pub fn stages(timeline: &JobTimeline) -> Vec<StageStats> {
    timeline
        .stages
        .iter()
        .enumerate()
        .map(|(s, stage)| {
            let attempts: Vec<&TaskExecution> = timeline
                .tasks
                .iter()
                .filter(|t| t.stage as usize == s)
                .collect();
            let mut ok: Vec<u64> = attempts
                .iter()
                .filter(|t| t.error.is_empty())
                .map(|t| duration(t))
                .collect();
            ok.sort_unstable();
            let first = attempts.iter().map(|t| t.start_us).min().unwrap_or(0);
            let last = attempts.iter().map(|t| t.end_us).max().unwrap_or(0);
            StageStats {
                name: stage.name.clone(),
                tasks: stage.total,
                succeeded: ok.len() as u64,
                failed: (attempts.len() - ok.len()) as u64,
                busy_us: attempts.iter().map(|t| duration(t)).sum(),
                mean_us: if ok.is_empty() {
                    0.0
                } else {
                    ok.iter().sum::<u64>() as f64 / ok.len() as f64
                },
                p50_us: percentile(&ok, 0.5),
                p95_us: percentile(&ok, 0.95),
                max_us: ok.last().copied().unwrap_or(0),
                span_us: last.saturating_sub(first),
                output_bytes: attempts.iter().map(|t| t.output_bytes).sum(),
                output_rows: attempts.iter().map(|t| t.output_rows).sum(),
                fetched_bytes: attempts.iter().map(|t| t.fetched_bytes).sum(),
            }
        })
        .collect()
}

pub fn workers(timeline: &JobTimeline) -> Vec<WorkerStats> {
    let mut stats: Vec<WorkerStats> = timeline
        .workers
        .iter()
        .map(|w| WorkerStats {
            worker: w.worker_id.clone(),
            device: w.device.clone(),
            slots: w.slots,
            attempts: 0,
            busy_us: 0,
            output_bytes: 0,
            fetched_bytes: 0,
            peak_memory_bytes: None,
        })
        .collect();
    for t in &timeline.tasks {
        if let Some(w) = stats.get_mut(t.worker as usize) {
            w.attempts += 1;
            w.busy_us += duration(t);
            w.output_bytes += t.output_bytes;
            w.fetched_bytes += t.fetched_bytes;
        }
    }
    for m in &timeline.memory {
        if let Some(w) = stats.get_mut(m.worker as usize) {
            w.peak_memory_bytes = Some(w.peak_memory_bytes.unwrap_or(0).max(m.used_bytes));
        }
    }
    // Workers that only served data ran nothing: list the ones that ran tasks first.
    stats.sort_by(|a, b| b.attempts.cmp(&a.attempts).then(a.worker.cmp(&b.worker)));
    stats
}

/// Transfers summed by pair of workers, largest first.
pub fn pairs(timeline: &JobTimeline) -> Vec<PairStats> {
    let mut by_pair: BTreeMap<(u32, u32), (u64, u64)> = BTreeMap::new();
    for t in &timeline.transfers {
        let entry = by_pair.entry((t.from_worker, t.to_worker)).or_default();
        entry.0 += t.bytes;
        entry.1 += 1;
    }
    let name = |i: u32| {
        timeline
            .workers
            .get(i as usize)
            .map(|w| w.worker_id.clone())
            .unwrap_or_else(|| format!("#{i}"))
    };
    let mut pairs: Vec<PairStats> = by_pair
        .into_iter()
        .map(|((from, to), (bytes, transfers))| PairStats {
            from: name(from),
            to: name(to),
            bytes,
            transfers,
        })
        .collect();
    pairs.sort_by_key(|p| std::cmp::Reverse(p.bytes));
    pairs
}

/// The `count` longest task attempts, longest first.
pub fn slowest(timeline: &JobTimeline, count: usize) -> Vec<&TaskExecution> {
    let mut tasks: Vec<&TaskExecution> = timeline.tasks.iter().collect();
    tasks.sort_by_key(|t| std::cmp::Reverse(duration(t)));
    tasks.truncate(count);
    tasks
}

#[cfg(test)]
mod tests {
    use super::*;
    use wrk_proto::{StageProgress, TimelineWorker, TransferRecord};

    fn task(stage: u32, task: u32, worker: u32, start: u64, end: u64, ok: bool) -> TaskExecution {
        TaskExecution {
            stage,
            task,
            attempt: 1,
            worker,
            start_us: start,
            end_us: end,
            error: if ok { String::new() } else { "boom".into() },
            output_bytes: 100,
            output_rows: 10,
            fetched_bytes: 0,
        }
    }

    fn timeline() -> JobTimeline {
        let worker = |id: &str| TimelineWorker {
            worker_id: id.into(),
            device: "cpu".into(),
            pool_bytes: 0,
            slots: 2,
        };
        let stage = |name: &str, total| StageProgress {
            name: name.into(),
            total,
            done: total,
            running: 0,
        };
        JobTimeline {
            stages: vec![stage("map", 3), stage("reduce", 1)],
            workers: vec![worker("a"), worker("b")],
            tasks: vec![
                task(0, 0, 0, 0, 1_000_000, true),
                task(0, 1, 1, 0, 3_000_000, true),
                task(0, 2, 0, 1_000_000, 2_000_000, false),
                task(0, 2, 1, 3_000_000, 5_000_000, true),
                task(1, 0, 1, 5_000_000, 5_500_000, true),
            ],
            transfers: vec![
                TransferRecord {
                    from_worker: 0,
                    to_worker: 1,
                    bytes: 100,
                    ..Default::default()
                },
                TransferRecord {
                    from_worker: 0,
                    to_worker: 1,
                    bytes: 50,
                    ..Default::default()
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn stage_figures_count_attempts_and_use_successful_durations() {
        let stats = stages(&timeline());
        let map = &stats[0];
        assert_eq!((map.tasks, map.succeeded, map.failed), (3, 3, 1));
        assert_eq!(map.busy_us, 1_000_000 + 3_000_000 + 1_000_000 + 2_000_000);
        assert_eq!(
            (map.p50_us, map.p95_us, map.max_us),
            (2_000_000, 3_000_000, 3_000_000)
        );
        assert_eq!(map.span_us, 5_000_000);
        assert!((map.tasks_per_second() - 0.6).abs() < 1e-9);
        assert_eq!(stats[1].span_us, 500_000);
        assert_eq!(stats[1].output_bytes, 100);
    }

    #[test]
    fn worker_pair_and_slowest_figures() {
        let t = timeline();
        let w = workers(&t);
        assert_eq!(w[0].worker, "b", "the busiest worker first");
        assert_eq!((w[0].attempts, w[0].busy_us), (3, 5_500_000));
        let p = pairs(&t);
        assert_eq!(p.len(), 1);
        assert_eq!(
            (
                p[0].from.as_str(),
                p[0].to.as_str(),
                p[0].bytes,
                p[0].transfers
            ),
            ("a", "b", 150, 2)
        );
        let slow = slowest(&t, 2);
        assert_eq!((slow[0].stage, slow[0].task), (0, 1));
        assert_eq!(slow.len(), 2);
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        assert_eq!(percentile(&[], 0.5), 0);
        assert_eq!(percentile(&[7], 0.95), 7);
        let values: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&values, 0.5), 50);
        assert_eq!(percentile(&values, 0.95), 95);
        assert_eq!(percentile(&values, 1.0), 100);
    }
}

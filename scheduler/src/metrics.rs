//! The scheduler's Prometheus metrics: counters and histograms updated as events happen, gauges
//! read from the state when scraped, rendered in the Prometheus text format (0.0.4).

use std::cell::RefCell;

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder, exponential_buckets,
};

/// Every metric the scheduler exports. Cloning shares the same series.
#[derive(Clone)]
pub struct SchedulerMetrics {
    registry: Registry,
    /// The name of every metric family, whether it has series yet or not.
    names: Vec<String>,
    pub tasks_finished: IntCounterVec,
    pub task_duration: HistogramVec,
    pub workers_lost: IntCounter,
    pub jobs_submitted: IntCounter,
    pub workers: IntGauge,
    pub tasks: IntGaugeVec,
    pub ready_queue: IntGauge,
    pub queued: IntGaugeVec,
    pub jobs: IntGaugeVec,
    pub worker_memory_used: IntGaugeVec,
    pub worker_assigned: IntGaugeVec,
    pub transfer_bytes_per_second: IntGauge,
}

/// Registers a metric whose definition is fixed in this file: failure is a programming error
/// (a duplicate or malformed name), caught by the tests. Its name is added to `names`.
fn register<M: prometheus::core::Collector + Clone + 'static>(
    (registry, names): (&Registry, &RefCell<Vec<String>>),
    metric: M,
) -> M {
    names
        .borrow_mut()
        .extend(metric.desc().iter().map(|d| d.fq_name.clone()));
    registry
        .register(Box::new(metric.clone()))
        .unwrap_or_else(|e| panic!("invalid scheduler metric definition: {e}"));
    metric
}

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, help)
        .namespace("wrk")
        .subsystem("scheduler")
}

impl Default for SchedulerMetrics {
    fn default() -> Self {
        let registry = Registry::new();
        let names = RefCell::new(Vec::new());
        let target = (&registry, &names);
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            register(
                target,
                IntCounterVec::new(opts(name, help), labels).unwrap_or_else(|e| panic!("{e}")),
            )
        };
        let gauge_vec = |name: &str, help: &str, labels: &[&str]| {
            register(
                target,
                IntGaugeVec::new(opts(name, help), labels).unwrap_or_else(|e| panic!("{e}")),
            )
        };
        let counter = |name: &str, help: &str| {
            register(
                target,
                IntCounter::with_opts(opts(name, help)).unwrap_or_else(|e| panic!("{e}")),
            )
        };
        let gauge = |name: &str, help: &str| {
            register(
                target,
                IntGauge::with_opts(opts(name, help)).unwrap_or_else(|e| panic!("{e}")),
            )
        };
        // Task durations from 0.5 ms to ~4.4 min.
        let buckets = exponential_buckets(0.0005, 2.0, 20).unwrap_or_default();
        let task_duration = HistogramVec::new(
            HistogramOpts::new(
                "task_duration_seconds",
                "Wall time of successful task attempts on their worker, by stage",
            )
            .namespace("wrk")
            .subsystem("scheduler")
            .buckets(buckets),
            &["stage"],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        SchedulerMetrics {
            tasks_finished: counter_vec(
                "tasks_finished_total",
                "Task attempts that ended, by stage and outcome (succeeded, failed, retried)",
                &["stage", "outcome"],
            ),
            task_duration: register(target, task_duration),
            workers_lost: counter(
                "workers_lost_total",
                "Workers that died or stopped heartbeating",
            ),
            jobs_submitted: counter("jobs_submitted_total", "Jobs accepted"),
            workers: gauge("workers", "Workers attached"),
            tasks: gauge_vec(
                "tasks",
                "Tasks of running jobs by state (pending, running, done)",
                &["state"],
            ),
            ready_queue: gauge("ready_queue_tasks", "Tasks waiting for a worker"),
            queued: gauge_vec(
                "queued_tasks",
                "Tasks of unfinished jobs not started yet (waiting for inputs or a worker), by tenant and stage",
                &["tenant", "stage"],
            ),
            jobs: gauge_vec("jobs", "Jobs by state", &["state"]),
            worker_memory_used: gauge_vec(
                "worker_memory_used_bytes",
                "Bytes of partitions each worker holds (from its heartbeats)",
                &["worker"],
            ),
            worker_assigned: gauge_vec(
                "worker_assigned_tasks",
                "Tasks assigned to each worker, running or queued there",
                &["worker"],
            ),
            transfer_bytes_per_second: gauge(
                "transfer_bytes_per_second",
                "The rate placement assumes partitions move between workers at: the mean of the workers' measured fetch rates (1 GB/s until one is measured)",
            ),
            names: names.into_inner(),
            registry,
        }
    }
}

impl SchedulerMetrics {
    /// The name of every metric family exported (histograms add `_bucket`, `_sum` and `_count`),
    /// including those without series yet.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The Prometheus text exposition of every series.
    pub fn render(&self) -> String {
        TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .unwrap_or_else(|e| format!("# encoding metrics failed: {e}\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_defined_and_rendered() {
        let metrics = SchedulerMetrics::default();
        metrics.jobs_submitted.inc();
        metrics
            .tasks_finished
            .with_label_values(&["map", "succeeded"])
            .inc();
        let text = metrics.render();
        assert!(
            text.contains("# TYPE wrk_scheduler_jobs_submitted_total counter"),
            "{text}"
        );
        assert!(
            text.contains(
                r#"wrk_scheduler_tasks_finished_total{outcome="succeeded",stage="map"} 1"#
            ),
            "{text}"
        );
    }
}

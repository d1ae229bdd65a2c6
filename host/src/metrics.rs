//! The worker's Prometheus metrics: counters and histograms updated as tasks run and data moves,
//! gauges read when scraped, rendered in the Prometheus text format (0.0.4).

use std::cell::RefCell;

use prometheus::{
    Counter, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder, exponential_buckets,
};

use crate::memory::{PoolStats, Tier};

/// Every metric a worker exports. Cloning shares the same series.
#[derive(Clone)]
pub struct WorkerMetrics {
    registry: Registry,
    /// The name of every metric family, whether it has series yet or not.
    names: Vec<String>,
    pub tasks_finished: IntCounterVec,
    pub task_duration: Histogram,
    pub instantiate_duration: Histogram,
    pub guest_copy_bytes: IntCounterVec,
    pub transfer_bytes: IntCounterVec,
    pub running_tasks: IntGauge,
    pub slots: IntGauge,
    pub partitions: IntGauge,
    pub partition_bytes: IntGauge,
    pub pool_size: IntGauge,
    pub pool_used: IntGauge,
    pub pool_peak: IntGauge,
    pub pool_leased: IntGauge,
    pub spilled_partitions: IntGauge,
    pub spilled_now: IntGaugeVec,
    pub spills: IntCounter,
    pub unspills: IntCounter,
    pub spilled_bytes: IntCounterVec,
    pub unspilled_bytes: IntCounter,
    pub spill_seconds: Counter,
    pub unspill_seconds: Counter,
}

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, help).namespace("wrk").subsystem("worker")
}

/// The counter of compile-cache outcomes (`memory`, `disk`, `compiled`), owned by the engine
/// and registered by the worker.
pub fn compile_cache_counter() -> IntCounterVec {
    IntCounterVec::new(
        opts(
            "compile_cache_total",
            "Components prepared for tasks, by where they came from (memory, disk, compiled)",
        ),
        &["outcome"],
    )
    .unwrap_or_else(|e| panic!("invalid worker metric definition: {e}"))
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
        .unwrap_or_else(|e| panic!("invalid worker metric definition: {e}"));
    metric
}

impl WorkerMetrics {
    /// The metrics of one worker; `compile_cache` is the engine's cache-outcome counter.
    pub fn new(compile_cache: IntCounterVec) -> Self {
        let registry = Registry::new();
        let names = RefCell::new(Vec::new());
        let target = (&registry, &names);
        register(target, compile_cache);
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            register(
                target,
                IntCounterVec::new(opts(name, help), labels).unwrap_or_else(|e| panic!("{e}")),
            )
        };
        let gauge = |name: &str, help: &str| {
            register(
                target,
                IntGauge::with_opts(opts(name, help)).unwrap_or_else(|e| panic!("{e}")),
            )
        };
        let counter = |name: &str, help: &str| {
            register(
                target,
                IntCounter::with_opts(opts(name, help)).unwrap_or_else(|e| panic!("{e}")),
            )
        };
        let float_counter = |name: &str, help: &str| {
            register(
                target,
                Counter::with_opts(opts(name, help)).unwrap_or_else(|e| panic!("{e}")),
            )
        };
        let gauge_vec = |name: &str, help: &str, labels: &[&str]| {
            register(
                target,
                IntGaugeVec::new(opts(name, help), labels).unwrap_or_else(|e| panic!("{e}")),
            )
        };
        let histogram = |name: &str, help: &str, start: f64| {
            let buckets = exponential_buckets(start, 2.0, 20).unwrap_or_default();
            let opts = HistogramOpts::new(name, help)
                .namespace("wrk")
                .subsystem("worker")
                .buckets(buckets);
            register(
                target,
                Histogram::with_opts(opts).unwrap_or_else(|e| panic!("{e}")),
            )
        };
        WorkerMetrics {
            tasks_finished: counter_vec(
                "tasks_finished_total",
                "Task attempts that ended, by outcome",
                &["outcome"],
            ),
            task_duration: histogram(
                "task_duration_seconds",
                "Wall time of task attempts, inputs to outputs",
                0.0005,
            ),
            instantiate_duration: histogram(
                "instantiate_duration_seconds",
                "Time to instantiate a compiled component for one task",
                0.000_005,
            ),
            guest_copy_bytes: counter_vec(
                "guest_copy_bytes_total",
                "Bytes tasks explicitly copied between host tables and guest memory, by direction",
                &["direction"],
            ),
            transfer_bytes: counter_vec(
                "transfer_bytes_total",
                "Partition bytes moved between workers, by direction and transport",
                &["direction", "transport"],
            ),
            running_tasks: gauge("running_tasks", "Tasks running now"),
            slots: gauge("slots", "Tasks the worker runs at once"),
            partitions: gauge("partitions", "Partitions held"),
            partition_bytes: gauge("partition_bytes", "Bytes of partitions held in memory"),
            pool_size: gauge("pool_size_bytes", "Configured size of the memory pool"),
            pool_used: gauge(
                "pool_used_bytes",
                "Bytes of the memory pool in use: buffers held plus unused leases",
            ),
            pool_peak: gauge(
                "pool_peak_bytes",
                "The most bytes of the memory pool in use",
            ),
            pool_leased: gauge(
                "pool_leased_bytes",
                "Bytes of the memory pool reserved by leases of running tasks",
            ),
            spilled_partitions: gauge(
                "spilled_partitions",
                "Partitions held outside the memory pool (spilled)",
            ),
            spilled_now: gauge_vec(
                "pool_spilled_bytes",
                "Bytes of partitions spilled out of the memory pool now, by tier",
                &["tier"],
            ),
            spills: counter(
                "spills_total",
                "Partitions moved out of the memory pool under pressure",
            ),
            unspills: counter(
                "unspills_total",
                "Spilled partitions read back into the memory pool",
            ),
            spilled_bytes: counter_vec(
                "spilled_bytes_total",
                "Bytes spilled out of the memory pool, by tier",
                &["tier"],
            ),
            unspilled_bytes: counter(
                "unspilled_bytes_total",
                "Bytes read back into the memory pool",
            ),
            spill_seconds: float_counter(
                "spill_seconds_total",
                "Time spent spilling partitions out of the memory pool",
            ),
            unspill_seconds: float_counter(
                "unspill_seconds_total",
                "Time spent reading spilled partitions back into the memory pool",
            ),
            names: names.into_inner(),
            registry,
        }
    }

    /// Counts bytes moved over TCP in one direction (`fetched` or `served`).
    pub fn count_transfer(&self, direction: &'static str, bytes: usize) {
        self.transfer_bytes
            .with_label_values(&[direction, "tcp"])
            .inc_by(bytes as u64);
    }

    /// Brings the pool series up to `stats` (counters move by what changed since last time).
    pub fn observe_pool(&self, stats: &PoolStats) {
        let gauge = |g: &IntGauge, v: u64| g.set(i64::try_from(v).unwrap_or(i64::MAX));
        gauge(&self.pool_size, stats.size);
        gauge(&self.pool_used, stats.used);
        gauge(&self.pool_peak, stats.peak);
        gauge(&self.pool_leased, stats.leased);
        let advance = |c: &IntCounter, v: u64| c.inc_by(v.saturating_sub(c.get()));
        for tier in Tier::ALL {
            let (now, total) = match tier {
                Tier::Host => (stats.spilled_host, stats.spilled_host_total),
                Tier::Disk => (stats.spilled_disk, stats.spilled_disk_total),
            };
            gauge(&self.spilled_now.with_label_values(&[tier.as_str()]), now);
            advance(
                &self.spilled_bytes.with_label_values(&[tier.as_str()]),
                total,
            );
        }
        advance(&self.spills, stats.spills);
        advance(&self.unspills, stats.unspills);
        advance(&self.unspilled_bytes, stats.unspilled_bytes_total);
        let advance_secs = |c: &Counter, v: f64| {
            if v > c.get() {
                c.inc_by(v - c.get());
            }
        };
        advance_secs(&self.spill_seconds, stats.spill_seconds);
        advance_secs(&self.unspill_seconds, stats.unspill_seconds);
    }

    /// The name of every metric family exported (histograms add `_bucket`, `_sum` and `_count`),
    /// including those without series yet.
    pub fn names(&self) -> &[String] {
        &self.names
    }

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
        let metrics = WorkerMetrics::new(compile_cache_counter());
        metrics.count_transfer("served", 10);
        metrics.observe_pool(&PoolStats {
            size: 1000,
            used: 400,
            spilled_disk: 300,
            spilled_disk_total: 300,
            spills: 2,
            spill_seconds: 0.5,
            ..PoolStats::default()
        });
        metrics.observe_pool(&PoolStats {
            size: 1000,
            used: 500,
            spilled_disk_total: 450,
            spills: 3,
            spill_seconds: 0.75,
            ..PoolStats::default()
        });
        let text = metrics.render();
        for series in [
            "wrk_worker_pool_size_bytes 1000",
            "wrk_worker_pool_used_bytes 500",
            "wrk_worker_spills_total 3",
            "wrk_worker_spill_seconds_total 0.75",
            r#"wrk_worker_spilled_bytes_total{tier="disk"} 450"#,
            r#"wrk_worker_spilled_bytes_total{tier="host"} 0"#,
            r#"wrk_worker_pool_spilled_bytes{tier="disk"} 0"#,
        ] {
            assert!(text.contains(series), "{series} in {text}");
        }
        assert!(
            text.contains("# TYPE wrk_worker_transfer_bytes_total counter"),
            "{text}"
        );
        assert!(
            text.contains(
                r#"wrk_worker_transfer_bytes_total{direction="served",transport="tcp"} 10"#
            ),
            "{text}"
        );
    }
}

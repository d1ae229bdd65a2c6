//! The worker's Prometheus metrics: counters and histograms updated as tasks run and data moves,
//! gauges read when scraped, rendered in the Prometheus text format (0.0.4).

use std::cell::RefCell;

use prometheus::{
    Counter, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder, exponential_buckets,
};

use crate::memory::{PoolStats, Tier};

/// Every metric a worker exports. Cloning shares the same series.
#[derive(Clone)]
pub struct WorkerMetrics {
    registry: Registry,
    /// The name of every metric family, whether it has series yet or not.
    names: Vec<String>,
    /// `tasks_finished_total` by outcome, each series resolved once (not per task).
    pub tasks_succeeded: IntCounter,
    pub tasks_failed: IntCounter,
    pub task_duration: Histogram,
    pub instantiate_duration: Histogram,
    /// `guest_copy_bytes_total` by direction, each series resolved once.
    pub copied_into_guest: IntCounter,
    pub copied_out_of_guest: IntCounter,
    pub transfer_bytes: IntCounterVec,
    pub shuffle_bytes: IntCounterVec,
    pub running_tasks: IntGauge,
    pub slots: IntGauge,
    pub partitions: IntGauge,
    pub partition_bytes: IntGauge,
    pub pool_size: IntGauge,
    pub pool_used: IntGauge,
    pub pool_peak: IntGauge,
    pub pool_leased: IntGauge,
    pub spilled_partitions: IntGauge,
    pub shuffle_pieces: IntGauge,
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
        let tasks_finished = counter_vec(
            "tasks_finished_total",
            "Task attempts that ended, by outcome",
            &["outcome"],
        );
        let guest_copy_bytes = counter_vec(
            "guest_copy_bytes_total",
            "Bytes tasks explicitly copied between host tables and guest memory, by direction",
            &["direction"],
        );
        WorkerMetrics {
            tasks_succeeded: tasks_finished.with_label_values(&["succeeded"]),
            tasks_failed: tasks_finished.with_label_values(&["failed"]),
            copied_into_guest: guest_copy_bytes.with_label_values(&["into_guest"]),
            copied_out_of_guest: guest_copy_bytes.with_label_values(&["out_of_guest"]),
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
            transfer_bytes: counter_vec(
                "transfer_bytes_total",
                "Partition bytes moved between workers, by direction and transport",
                &["direction", "transport"],
            ),
            shuffle_bytes: counter_vec(
                "shuffle_bytes_total",
                "Shuffle piece bytes moved between workers, by direction and transport (local pieces move no bytes)",
                &["direction", "transport"],
            ),
            running_tasks: gauge("running_tasks", "Tasks running now"),
            slots: gauge("slots", "Tasks the worker runs at once"),
            partitions: gauge("partitions", "Partitions held"),
            partition_bytes: gauge(
                "partition_bytes",
                "Bytes of partitions and shuffle pieces held in memory",
            ),
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
                "Partitions and shuffle pieces held outside the memory pool (spilled)",
            ),
            shuffle_pieces: gauge(
                "shuffle_pieces",
                "Shuffle pieces held for the reducers on this worker, in memory or spilled",
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

    /// Registers the series of a GPU worker (only GPU workers export them): NVML telemetry under
    /// the `wrk_gpu_*` names the monitoring README and Grafana dashboard use, labelled with the
    /// device ordinal `gpu`, plus the device pool and host<->device transfer counters.
    pub fn register_gpu(&mut self, ordinal: u32) -> GpuMetrics {
        let names = RefCell::new(std::mem::take(&mut self.names));
        let target = (&self.registry, &names);
        let gpu_opts = |name: &str, help: &str| {
            Opts::new(name, help)
                .namespace("wrk")
                .subsystem("gpu")
                .const_label("gpu", ordinal.to_string())
        };
        let gauge = |name: &str, help: &str| {
            register(
                target,
                GaugeVec::new(gpu_opts(name, help), &[]).unwrap_or_else(|e| panic!("{e}")),
            )
        };
        let worker_gauge = |name: &str, help: &str| {
            register(
                target,
                IntGaugeVec::new(opts(name, help), &[]).unwrap_or_else(|e| panic!("{e}")),
            )
        };
        let worker_counter = |name: &str, help: &str| {
            register(
                target,
                IntCounterVec::new(opts(name, help), &["direction"])
                    .unwrap_or_else(|e| panic!("{e}")),
            )
        };
        let metrics = GpuMetrics {
            memory_used_bytes: gauge("memory_used_bytes", "Device memory used (NVML)"),
            memory_total_bytes: gauge("memory_total_bytes", "Device memory in all (NVML)"),
            sm_utilization_ratio: gauge(
                "sm_utilization_ratio",
                "Fraction of time a kernel ran on the SMs, 0-1 (NVML)",
            ),
            pcie_rx_bytes_per_second: gauge(
                "pcie_rx_bytes_per_second",
                "PCIe traffic into the device (NVML)",
            ),
            pcie_tx_bytes_per_second: gauge(
                "pcie_tx_bytes_per_second",
                "PCIe traffic out of the device (NVML)",
            ),
            pcie_max_bytes_per_second: gauge(
                "pcie_max_bytes_per_second",
                "The PCIe link's capacity per direction, from its generation and width (NVML)",
            ),
            nvlink_rx_bytes_per_second: gauge(
                "nvlink_rx_bytes_per_second",
                "NVLink traffic into the device, where NVLink exists (NVML)",
            ),
            nvlink_tx_bytes_per_second: gauge(
                "nvlink_tx_bytes_per_second",
                "NVLink traffic out of the device, where NVLink exists (NVML)",
            ),
            temperature_celsius: gauge("temperature_celsius", "GPU temperature (NVML)"),
            power_watts: gauge("power_watts", "Power draw (NVML)"),
            device_pool_size_bytes: worker_gauge(
                "device_pool_size_bytes",
                "The size of the worker's device memory pool",
            ),
            device_pool_used_bytes: worker_gauge(
                "device_pool_used_bytes",
                "Bytes of the device memory pool in use",
            ),
            device_pool_peak_bytes: worker_gauge(
                "device_pool_peak_bytes",
                "Highest use of the device memory pool since the worker started",
            ),
            device_pool_evictions: register(
                target,
                IntCounterVec::new(
                    opts(
                        "device_pool_evictions_total",
                        "Times the device pool was full and spilled device tables to host memory",
                    ),
                    &[],
                )
                .unwrap_or_else(|e| panic!("{e}")),
            ),
            device_pool_evicted_bytes: register(
                target,
                IntCounterVec::new(
                    opts(
                        "device_pool_evicted_bytes_total",
                        "Device memory freed by spilling device tables to host memory",
                    ),
                    &[],
                )
                .unwrap_or_else(|e| panic!("{e}")),
            ),
            device_join_indexes: register(
                target,
                IntCounterVec::new(
                    opts(
                        "device_join_indexes_total",
                        "Device join indexes on broadcast tables, by outcome: built, or reused from the worker's cache",
                    ),
                    &["outcome"],
                )
                .unwrap_or_else(|e| panic!("{e}")),
            ),
            operators: DeviceOperatorMetrics(register(
                target,
                IntCounterVec::new(
                    opts(
                        "device_operators_total",
                        "Table operators of guests run by a GPU worker, by operator and where they ran (device, or host when no kernel covers them)",
                    ),
                    &["operator", "ran_on"],
                )
                .unwrap_or_else(|e| panic!("{e}")),
            )),
            transfers: DeviceTransferMetrics {
                bytes: worker_counter(
                    "device_transfer_bytes_total",
                    "Bytes copied between host and device memory, by direction (to_device, to_host)",
                ),
                count: worker_counter(
                    "device_transfers_total",
                    "Copies between host and device memory, by direction (to_device, to_host)",
                ),
            },
        };
        self.names = names.into_inner();
        metrics
    }

    /// Counts bytes moved over TCP in one direction (`fetched` or `served`).
    pub fn count_transfer(&self, direction: &'static str, bytes: usize) {
        self.transfer_bytes
            .with_label_values(&[direction, "tcp"])
            .inc_by(bytes as u64);
    }

    /// Counts shuffle bytes in one direction (`sent` or `received`) over one transport.
    pub fn count_shuffle(&self, direction: &'static str, transport: &'static str, bytes: usize) {
        self.shuffle_bytes
            .with_label_values(&[direction, transport])
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

/// Counters of host<->device copies.
#[derive(Clone)]
pub struct DeviceTransferMetrics {
    bytes: IntCounterVec,
    count: IntCounterVec,
}

impl DeviceTransferMetrics {
    pub fn record(&self, direction: &str, bytes: u64) {
        self.bytes.with_label_values(&[direction]).inc_by(bytes);
        self.count.with_label_values(&[direction]).inc();
    }
}

/// Counters of the guests' operators on a GPU worker.
#[derive(Clone)]
pub struct DeviceOperatorMetrics(IntCounterVec);

impl DeviceOperatorMetrics {
    pub fn record(&self, operator: &str, ran_on: &str) {
        self.0.with_label_values(&[operator, ran_on]).inc();
    }
}

/// The series of a GPU worker (see [`WorkerMetrics::register_gpu`]). A value NVML does not
/// report on the device is left out of the exposition rather than shown as zero.
#[derive(Clone)]
pub struct GpuMetrics {
    memory_used_bytes: GaugeVec,
    memory_total_bytes: GaugeVec,
    sm_utilization_ratio: GaugeVec,
    pcie_rx_bytes_per_second: GaugeVec,
    pcie_tx_bytes_per_second: GaugeVec,
    pcie_max_bytes_per_second: GaugeVec,
    nvlink_rx_bytes_per_second: GaugeVec,
    nvlink_tx_bytes_per_second: GaugeVec,
    temperature_celsius: GaugeVec,
    power_watts: GaugeVec,
    device_pool_size_bytes: IntGaugeVec,
    device_pool_used_bytes: IntGaugeVec,
    device_pool_peak_bytes: IntGaugeVec,
    device_pool_evictions: IntCounterVec,
    device_pool_evicted_bytes: IntCounterVec,
    device_join_indexes: IntCounterVec,
    pub operators: DeviceOperatorMetrics,
    pub transfers: DeviceTransferMetrics,
}

impl GpuMetrics {
    /// Updates the gauges from an NVML sample.
    pub fn observe(&self, sample: &wrk_proto::GpuTelemetry) {
        let set = |gauge: &GaugeVec, value: Option<f64>| match value {
            Some(v) => gauge.with_label_values::<&str>(&[]).set(v),
            None => {
                let _ = gauge.remove_label_values::<&str>(&[]);
            }
        };
        set(
            &self.memory_used_bytes,
            Some(sample.memory_used_bytes as f64),
        );
        set(
            &self.memory_total_bytes,
            Some(sample.memory_total_bytes as f64),
        );
        set(&self.sm_utilization_ratio, sample.sm_utilization);
        set(
            &self.pcie_rx_bytes_per_second,
            sample.pcie_rx_bytes_per_second,
        );
        set(
            &self.pcie_tx_bytes_per_second,
            sample.pcie_tx_bytes_per_second,
        );
        set(
            &self.pcie_max_bytes_per_second,
            sample.pcie_max_bytes_per_second,
        );
        set(
            &self.nvlink_rx_bytes_per_second,
            sample.nvlink_rx_bytes_per_second,
        );
        set(
            &self.nvlink_tx_bytes_per_second,
            sample.nvlink_tx_bytes_per_second,
        );
        set(&self.temperature_celsius, sample.temperature_celsius);
        set(&self.power_watts, sample.power_watts);
    }

    /// Updates the device pool series.
    pub fn observe_pool(&self, stats: &crate::gpu::pool::PoolStats) {
        let set = |gauge: &IntGaugeVec, value: u64| {
            gauge
                .with_label_values::<&str>(&[])
                .set(i64::try_from(value).unwrap_or(i64::MAX))
        };
        set(&self.device_pool_size_bytes, stats.capacity);
        set(&self.device_pool_used_bytes, stats.used);
        set(&self.device_pool_peak_bytes, stats.peak);
        let advance = |counter: &IntCounterVec, total: u64| {
            let counter = counter.with_label_values::<&str>(&[]);
            counter.inc_by(total.saturating_sub(counter.get()));
        };
        advance(&self.device_pool_evictions, stats.evictions);
        advance(&self.device_pool_evicted_bytes, stats.evicted_bytes);
    }

    /// Updates the join index counters from the cache's totals.
    pub fn observe_join_indexes(&self, stats: &crate::gpu::join_index::JoinIndexStats) {
        for (outcome, total) in [("built", stats.builds), ("reused", stats.hits)] {
            let counter = self.device_join_indexes.with_label_values(&[outcome]);
            counter.inc_by(total.saturating_sub(counter.get()));
        }
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
        assert!(
            !text.contains("wrk_gpu_"),
            "a CPU worker exports no GPU series"
        );
    }

    #[test]
    fn gpu_series_use_the_dashboard_names_and_leave_out_what_nvml_lacks() {
        let mut metrics = WorkerMetrics::new(compile_cache_counter());
        let gpu = metrics.register_gpu(1);
        gpu.observe(&wrk_proto::GpuTelemetry {
            memory_used_bytes: 5 << 30,
            memory_total_bytes: 80 << 30,
            sm_utilization: Some(0.5),
            temperature_celsius: Some(61.0),
            power_watts: Some(300.5),
            pcie_tx_bytes_per_second: Some(1e9),
            pcie_rx_bytes_per_second: Some(2e9),
            ..Default::default()
        });
        gpu.observe_pool(&crate::gpu::pool::PoolStats {
            capacity: 64 << 30,
            used: 1 << 30,
            peak: 2 << 30,
            evictions: 3,
            evicted_bytes: 5 << 20,
            ..Default::default()
        });
        gpu.transfers.record("to_device", 4096);
        gpu.transfers.record("to_device", 4096);
        gpu.observe_join_indexes(&crate::gpu::join_index::JoinIndexStats {
            hits: 7,
            builds: 2,
            ..Default::default()
        });
        let text = metrics.render();
        for line in [
            r#"wrk_gpu_memory_used_bytes{gpu="1"} 5368709120"#,
            r#"wrk_gpu_sm_utilization_ratio{gpu="1"} 0.5"#,
            r#"wrk_gpu_temperature_celsius{gpu="1"} 61"#,
            r#"wrk_gpu_power_watts{gpu="1"} 300.5"#,
            r#"wrk_gpu_pcie_rx_bytes_per_second{gpu="1"} 2000000000"#,
            "wrk_worker_device_pool_used_bytes 1073741824",
            "wrk_worker_device_pool_evictions_total 3",
            "wrk_worker_device_pool_evicted_bytes_total 5242880",
            r#"wrk_worker_device_transfer_bytes_total{direction="to_device"} 8192"#,
            r#"wrk_worker_device_transfers_total{direction="to_device"} 2"#,
            r#"wrk_worker_device_join_indexes_total{outcome="built"} 2"#,
            r#"wrk_worker_device_join_indexes_total{outcome="reused"} 7"#,
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        // NVLink is absent on this sample: no series rather than a zero.
        assert!(
            !text.contains("wrk_gpu_nvlink_rx_bytes_per_second{"),
            "{text}"
        );
        assert!(
            metrics
                .names()
                .iter()
                .any(|n| n == "wrk_gpu_nvlink_rx_bytes_per_second")
        );
    }
}

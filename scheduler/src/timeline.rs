//! What the dashboard and performance reports show of task executions, kept cheaply enough for
//! the scheduler's hot path: bounded rings of recent executions and transfers (served to the
//! dashboard by cursor), per-job records (served to `wrk submit --report`), and per-worker memory
//! samples taken from heartbeats.
//!
//! Every record is appended once, when the scheduler learns that a task attempt ended; nothing
//! here walks a job graph.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Executions and transfers kept for the live dashboard (each ring).
pub const RECENT_RECORDS: usize = 50_000;
/// Executions (and, separately, transfers) kept per job for its report; more are counted as
/// dropped.
pub const JOB_RECORDS: usize = 1_000_000;
/// Finished jobs whose records are kept until their client releases them; older ones go first.
pub const RETAINED_JOB_TIMELINES: usize = 32;
/// Memory samples kept per worker, at most one per [`MEMORY_SAMPLE_INTERVAL_US`].
pub const MEMORY_SAMPLES: usize = 600;
pub const MEMORY_SAMPLE_INTERVAL_US: u64 = 1_000_000;
/// Longest error message kept with a failed execution.
const ERROR_CHARS: usize = 500;

/// One task attempt that ended, as the scheduler saw it (its error, if it failed, is kept
/// beside it: failures are rare and the record stays small and `Copy`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Execution {
    pub stage: u32,
    pub task: u32,
    pub attempt: u32,
    /// The worker that ran it, in [`WorkerNames`].
    pub worker: u32,
    /// Microseconds since the scheduler's [`Clock`] epoch.
    pub start_us: u64,
    pub end_us: u64,
    pub output_bytes: u64,
    pub output_rows: u64,
    /// Input bytes the task read from other workers' partitions.
    pub fetched_bytes: u64,
}

/// Shortens a failed attempt's error to what the dashboard and reports keep.
pub fn short_error(error: &str) -> Box<str> {
    match error.char_indices().nth(ERROR_CHARS) {
        Some((cut, _)) => format!("{}…", &error[..cut]).into_boxed_str(),
        None => error.into(),
    }
}

/// Partition bytes a task read from one other worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Transfer {
    pub stage: u32,
    pub task: u32,
    /// Workers, in [`WorkerNames`].
    pub from: u32,
    pub to: u32,
    pub bytes: u64,
    /// When the reading task started (microseconds since the epoch).
    pub at_us: u64,
}

/// The scheduler's time base: microseconds since it started, and the wall-clock time then.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    epoch: Instant,
    epoch_unix_ms: u64,
}

impl Default for Clock {
    fn default() -> Self {
        Clock {
            epoch: Instant::now(),
            epoch_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
        }
    }
}

impl Clock {
    /// A clock whose epoch is `epoch` (tests use one in the past).
    pub fn with_epoch(epoch: Instant) -> Clock {
        Clock {
            epoch,
            ..Clock::default()
        }
    }

    pub fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Wall-clock milliseconds since 1970 at the epoch.
    pub fn epoch_unix_ms(&self) -> u64 {
        self.epoch_unix_ms
    }
}

/// A bounded ring with a cursor: every item gets the next sequence number, the oldest go when
/// it is full, and readers ask for what came after the last sequence number they saw.
#[derive(Debug, Clone)]
pub struct Ring<T> {
    items: VecDeque<T>,
    /// Sequence number of `items[0]`.
    first: u64,
    capacity: usize,
}

/// A page of a [`Ring`] read by cursor.
#[derive(Debug)]
pub struct Page<'a, T> {
    /// `(sequence number, item)` from the cursor on (or from the oldest kept).
    pub items: Vec<(u64, &'a T)>,
    /// The cursor to ask with next time.
    pub next: u64,
    /// Items after the cursor that the ring no longer holds.
    pub missed: u64,
}

impl<T> Ring<T> {
    pub fn new(capacity: usize) -> Self {
        Ring {
            items: VecDeque::new(),
            first: 0,
            capacity: capacity.max(1),
        }
    }

    pub fn push(&mut self, item: T) {
        if self.items.len() == self.capacity {
            self.items.pop_front();
            self.first += 1;
        }
        self.items.push_back(item);
    }

    /// The sequence number the next item will get.
    pub fn end(&self) -> u64 {
        self.first + self.items.len() as u64
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Up to `limit` items from sequence number `cursor` on.
    pub fn since(&self, cursor: u64, limit: usize) -> Page<'_, T> {
        let missed = self.first.saturating_sub(cursor);
        let start = cursor.max(self.first).min(self.end());
        let skip = (start - self.first) as usize;
        let items: Vec<(u64, &T)> = self
            .items
            .range(skip..)
            .take(limit)
            .enumerate()
            .map(|(i, item)| (start + i as u64, item))
            .collect();
        Page {
            next: start + items.len() as u64,
            items,
            missed,
        }
    }
}

/// Every worker id the scheduler has seen, numbered once: records name workers by number, so
/// recording costs no string copies or reference counts, and names outlive departed workers.
#[derive(Debug, Default, Clone)]
pub struct WorkerNames {
    names: Vec<Arc<str>>,
    numbers: HashMap<Arc<str>, u32>,
}

impl WorkerNames {
    /// The number of worker `id`, given one if it is new.
    pub fn intern(&mut self, id: &str) -> u32 {
        if let Some(&number) = self.numbers.get(id) {
            return number;
        }
        let number = self.names.len() as u32;
        let name: Arc<str> = Arc::from(id);
        self.names.push(name.clone());
        self.numbers.insert(name, number);
        number
    }

    /// The number of a worker seen before.
    pub fn number(&self, id: &str) -> Option<u32> {
        self.numbers.get(id).copied()
    }

    pub fn name(&self, number: u32) -> &str {
        self.names.get(number as usize).map_or("", |n| n)
    }
}

/// A recent execution for the dashboard.
#[derive(Debug, Clone, PartialEq)]
pub struct RecentExecution {
    pub job: u64,
    pub execution: Execution,
    pub error: Option<Box<str>>,
}

/// The cluster's recent executions and transfers (transfers with the number of their job).
#[derive(Debug, Clone)]
pub struct Recent {
    pub executions: Ring<RecentExecution>,
    pub transfers: Ring<(u64, Transfer)>,
}

impl Default for Recent {
    fn default() -> Self {
        Recent {
            executions: Ring::new(RECENT_RECORDS),
            transfers: Ring::new(RECENT_RECORDS),
        }
    }
}

/// A job's executions and transfers, bounded by [`JOB_RECORDS`].
#[derive(Debug, Default, Clone)]
pub struct JobRecords {
    pub executions: Vec<Execution>,
    /// Errors of failed executions, by index in `executions`, in order.
    pub errors: Vec<(usize, Box<str>)>,
    pub transfers: Vec<Transfer>,
    pub dropped_executions: u64,
    pub dropped_transfers: u64,
}

impl JobRecords {
    pub fn push_execution(&mut self, execution: Execution, error: Option<&str>) {
        if self.executions.len() < JOB_RECORDS {
            if let Some(error) = error {
                self.errors
                    .push((self.executions.len(), short_error(error)));
            }
            self.executions.push(execution);
        } else {
            self.dropped_executions += 1;
        }
    }

    pub fn push_transfer(&mut self, transfer: Transfer) {
        if self.transfers.len() < JOB_RECORDS {
            self.transfers.push(transfer);
        } else {
            self.dropped_transfers += 1;
        }
    }
}

/// A worker's pool use over time: at most one sample per interval, the newest
/// [`MEMORY_SAMPLES`] kept.
#[derive(Debug, Default, Clone)]
pub struct MemoryHistory {
    samples: VecDeque<(u64, u64)>,
}

impl MemoryHistory {
    /// Records `used_bytes` at `now_us` unless the last sample is more recent than the interval.
    pub fn sample(&mut self, now_us: u64, used_bytes: u64) {
        if let Some(&(last, _)) = self.samples.back()
            && now_us < last + MEMORY_SAMPLE_INTERVAL_US
        {
            return;
        }
        if self.samples.len() == MEMORY_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back((now_us, used_bytes));
    }

    /// Samples `(at_us, used_bytes)` within `[from_us, to_us]`.
    pub fn between(&self, from_us: u64, to_us: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.samples
            .iter()
            .copied()
            .filter(move |&(t, _)| t >= from_us && t <= to_us)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_serves_increments_by_cursor_and_reports_what_it_dropped() {
        let mut ring = Ring::new(3);
        for i in 0..5u32 {
            ring.push(i);
        }
        assert_eq!((ring.len(), ring.end()), (3, 5));
        let page = ring.since(0, 10);
        assert_eq!(page.missed, 2, "items 0 and 1 were dropped");
        assert_eq!(
            page.items
                .iter()
                .map(|(s, i)| (*s, **i))
                .collect::<Vec<_>>(),
            [(2, 2), (3, 3), (4, 4)]
        );
        assert_eq!(page.next, 5);
        let page = ring.since(3, 1);
        assert_eq!(
            (page.items.len(), *page.items[0].1, page.next, page.missed),
            (1, 3, 4, 0)
        );
        let page = ring.since(5, 10);
        assert!(page.items.is_empty());
        assert_eq!(page.next, 5);
        // A cursor from the future (a restarted scheduler) reads from the end, not past it.
        let page = ring.since(99, 10);
        assert_eq!((page.items.len(), page.next), (0, 5));
    }

    #[test]
    fn job_records_are_bounded() {
        let mut records = JobRecords::default();
        let transfer = Transfer {
            stage: 0,
            task: 0,
            from: 0,
            to: 1,
            bytes: 1,
            at_us: 0,
        };
        for _ in 0..JOB_RECORDS + 2 {
            records.push_transfer(transfer);
        }
        assert_eq!(records.transfers.len(), JOB_RECORDS);
        assert_eq!(records.dropped_transfers, 2);
        let execution = Execution {
            stage: 0,
            task: 0,
            attempt: 1,
            worker: 0,
            start_us: 0,
            end_us: 1,
            output_bytes: 0,
            output_rows: 0,
            fetched_bytes: 0,
        };
        records.push_execution(execution, None);
        records.push_execution(execution, Some("boom"));
        assert_eq!(records.errors, [(1, "boom".into())]);
    }

    #[test]
    fn worker_names_are_numbered_once() {
        let mut names = WorkerNames::default();
        assert_eq!(
            (names.intern("a"), names.intern("b"), names.intern("a")),
            (0, 1, 0)
        );
        assert_eq!(
            (names.name(1), names.number("b"), names.number("c")),
            ("b", Some(1), None)
        );
    }

    #[test]
    fn memory_history_samples_at_most_once_per_interval_and_keeps_the_newest() {
        let mut history = MemoryHistory::default();
        history.sample(0, 1);
        history.sample(MEMORY_SAMPLE_INTERVAL_US / 2, 2);
        history.sample(MEMORY_SAMPLE_INTERVAL_US, 3);
        assert_eq!(
            history.between(0, u64::MAX).collect::<Vec<_>>(),
            [(0, 1), (MEMORY_SAMPLE_INTERVAL_US, 3)]
        );
        for i in 0..MEMORY_SAMPLES as u64 + 5 {
            history.sample((i + 2) * MEMORY_SAMPLE_INTERVAL_US, i);
        }
        let kept: Vec<_> = history.between(0, u64::MAX).collect();
        assert_eq!(kept.len(), MEMORY_SAMPLES);
        assert_eq!(kept.last().map(|s| s.1), Some(MEMORY_SAMPLES as u64 + 4));
        assert_eq!(
            history
                .between(3 * MEMORY_SAMPLE_INTERVAL_US, 4 * MEMORY_SAMPLE_INTERVAL_US)
                .count(),
            0,
            "the oldest samples are gone"
        );
    }

    #[test]
    fn long_errors_are_shortened_on_a_character_boundary() {
        let long = "é".repeat(ERROR_CHARS + 10);
        let short = short_error(&long);
        assert_eq!(short.chars().count(), ERROR_CHARS + 1);
        assert_eq!(&*short_error("boom"), "boom");
    }
}

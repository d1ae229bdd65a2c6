//! `wrk submit --report`: a job's performance report as one self-contained HTML file (style,
//! script and data inline, nothing fetched), viewable offline. Tables are plain HTML; the task
//! stream and the charts are drawn from the embedded data by the dashboard's drawing code.

mod stats;

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use wrk_proto::{JobState, JobTimeline};
use wrk_scheduler::dashboard::{STYLE_CSS, TIMELINE_JS};

pub use stats::{PairStats, StageStats, WorkerStats, percentile};

/// Drawing of the report's task stream and charts from its embedded data.
const REPORT_JS: &str = include_str!("report/report.js");
/// Task attempts drawn in the stream at most; larger jobs are sampled evenly (the tables count
/// every attempt).
const MAX_DRAWN_TASKS: usize = 200_000;
/// Rows of the slowest-tasks and failed-attempts tables.
const TOP_ROWS: usize = 20;

/// Escapes text for HTML element content and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn bytes(n: u64) -> String {
    bytes_f(n as f64)
}

fn bytes_f(n: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n;
    let mut unit = 0;
    while value >= 1024.0 && unit < units.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{value:.0} B")
    } else {
        format!("{value:.1} {}", units[unit])
    }
}

fn duration(us: f64) -> String {
    if us < 1_000.0 {
        format!("{us:.0} µs")
    } else if us < 1e6 {
        format!("{:.2} ms", us / 1e3)
    } else if us < 120e6 {
        format!("{:.2} s", us / 1e6)
    } else {
        format!("{:.1} min", us / 60e6)
    }
}

/// `YYYY-MM-DD HH:MM:SS UTC` of milliseconds since 1970.
fn utc(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

fn state_name(state: i32) -> &'static str {
    match JobState::try_from(state).unwrap_or(JobState::Unspecified) {
        JobState::Succeeded => "succeeded",
        JobState::Failed => "failed",
        JobState::Cancelled => "cancelled",
        JobState::Running => "running",
        JobState::Pending => "pending",
        JobState::Unspecified => "unknown",
    }
}

/// The data the report's script draws from, as JSON safe to embed in a `<script>` element.
fn embedded_data(timeline: &JobTimeline) -> Result<String> {
    let step = timeline.tasks.len().div_ceil(MAX_DRAWN_TASKS).max(1);
    let tasks: Vec<serde_json::Value> = timeline
        .tasks
        .iter()
        .step_by(step)
        .map(|t| {
            serde_json::json!([
                t.stage,
                t.task,
                t.attempt,
                t.worker,
                t.start_us,
                t.end_us,
                t.error.is_empty()
            ])
        })
        .collect();
    let data = serde_json::json!({
        "duration_us": timeline.duration_us,
        "stages": timeline.stages.iter().map(|s| &s.name).collect::<Vec<_>>(),
        "workers": timeline.workers.iter().map(|w| &w.worker_id).collect::<Vec<_>>(),
        "slots": timeline.workers.iter().map(|w| w.slots).collect::<Vec<_>>(),
        "tasks": tasks,
        "sampled_every": step,
        "transfers": timeline
            .transfers
            .iter()
            .map(|t| serde_json::json!([t.from_worker, t.to_worker, t.bytes, t.at_us]))
            .collect::<Vec<_>>(),
        "memory": timeline
            .memory
            .iter()
            .map(|m| serde_json::json!([m.worker, m.at_us, m.used_bytes]))
            .collect::<Vec<_>>(),
    });
    // `</script>` (or `<!--`) inside the data would end the element early: escape every `<`.
    Ok(serde_json::to_string(&data)?.replace('<', "\\u003c"))
}

/// The report of `timeline` as one HTML document.
pub fn render(timeline: &JobTimeline) -> Result<String> {
    let stages = stats::stages(timeline);
    let workers = stats::workers(timeline);
    let pairs = stats::pairs(timeline);
    let slowest = stats::slowest(timeline, TOP_ROWS);
    let state = state_name(timeline.state);
    let attempts = timeline.tasks.len() as u64 + timeline.dropped_tasks;
    let failed: Vec<_> = timeline
        .tasks
        .iter()
        .filter(|t| !t.error.is_empty())
        .collect();
    let output: u64 = stages.iter().map(|s| s.output_bytes).sum();
    let moved: u64 = timeline.transfers.iter().map(|t| t.bytes).sum();
    let seconds = timeline.duration_us.max(1) as f64 / 1e6;
    let succeeded: u64 = stages.iter().map(|s| s.succeeded).sum();
    let stage_name = |s: u32| {
        timeline
            .stages
            .get(s as usize)
            .map_or(String::new(), |s| s.name.clone())
    };
    let worker_name = |w: u32| {
        timeline
            .workers
            .get(w as usize)
            .map_or(String::new(), |w| w.worker_id.clone())
    };

    let mut h = String::new();
    let title = format!("wrk report: {} ({})", timeline.name, timeline.job_id);
    let _ = write!(
        h,
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{}</title>\n<style>\n{STYLE_CSS}</style>\n</head>\n<body>\n",
        escape(&title)
    );
    let _ = write!(
        h,
        "<header><h1>wrk</h1><span class=\"summary\">performance report of <b>{}</b> \
         <span class=\"mono\">{}</span> · submitted {}</span>\
         <span class=\"state {state}\" id=\"job-state\">{state}</span></header>\n<main>\n",
        escape(&timeline.name),
        escape(&timeline.job_id),
        utc(timeline.submitted_unix_ms)
    );

    // Summary.
    let _ = write!(h, "<section><h2>Summary</h2><div class=\"cards\">");
    for (value, what) in [
        (duration(timeline.duration_us as f64), "submission to end"),
        (format!("{succeeded}"), "tasks succeeded"),
        (format!("{}", failed.len()), "failed attempts"),
        (
            format!("{:.1}", succeeded as f64 / seconds),
            "tasks per second",
        ),
        (format!("{}", workers.len()), "workers involved"),
        (bytes(output), "output"),
        (bytes(moved), "moved between workers"),
    ] {
        let _ = write!(h, "<div><b>{}</b><span>{what}</span></div>", escape(&value));
    }
    let _ = write!(h, "</div>");
    if !timeline.error.is_empty() {
        let _ = write!(h, "<p class=\"error\">{}</p>", escape(&timeline.error));
    }
    if timeline.dropped_tasks > 0 || timeline.dropped_transfers > 0 {
        let _ = write!(
            h,
            "<p class=\"muted\">The scheduler kept the first {} of {attempts} task attempts and \
             the first {} transfers of this job; the figures below cover those.</p>",
            timeline.tasks.len(),
            timeline.transfers.len()
        );
    }
    let _ = writeln!(h, "</section>");

    // Per-stage table.
    let _ = write!(
        h,
        "<section><h2>Stages <small>durations of successful attempts; throughput over each \
         stage's span (first start to last end)</small></h2><table id=\"stages\"><thead><tr>\
         <th>stage</th><th class=num>tasks</th><th class=num>failed attempts</th>\
         <th class=num>task time</th><th class=num>mean</th><th class=num>p50</th>\
         <th class=num>p95</th><th class=num>max</th><th class=num>span</th>\
         <th class=num>tasks/s</th><th class=num>output</th><th class=num>output/s</th>\
         <th class=num>rows</th><th class=num>fetched</th></tr></thead><tbody>"
    );
    for s in &stages {
        let _ = write!(
            h,
            "<tr data-stage=\"{name}\"><td>{name}</td><td class=num>{}/{}</td><td class=num>{}</td>\
             <td class=num>{}</td><td class=num>{}</td><td class=num>{}</td><td class=num>{}</td>\
             <td class=num>{}</td><td class=num>{}</td><td class=num>{:.1}</td><td class=num>{}</td>\
             <td class=num>{}/s</td><td class=num>{}</td><td class=num>{}</td></tr>",
            s.succeeded,
            s.tasks,
            s.failed,
            duration(s.busy_us as f64),
            duration(s.mean_us),
            duration(s.p50_us as f64),
            duration(s.p95_us as f64),
            duration(s.max_us as f64),
            duration(s.span_us as f64),
            s.tasks_per_second(),
            bytes(s.output_bytes),
            bytes_f(s.output_bytes_per_second()),
            s.output_rows,
            bytes(s.fetched_bytes),
            name = escape(&s.name),
        );
    }
    let _ = writeln!(h, "</tbody></table></section>");

    // Task stream and throughput (drawn by the script).
    let _ = writeln!(
        h,
        "<section><h2>Task stream <small>one lane per worker, one bar per task attempt, coloured \
         by stage; failed attempts in red</small></h2><div class=\"legend\" id=\"legend\"></div>\
         <div class=\"canvas-box\"><canvas id=\"stream\" height=\"60\"></canvas></div>\
         <p class=\"muted\" id=\"stream-note\"></p></section>\n\
         <section><h2>Progress <small>tasks finished over time, by stage</small></h2>\
         <div class=\"legend\" id=\"progress-legend\"></div>\
         <canvas id=\"progress\" height=\"140\"></canvas></section>"
    );

    // Workers.
    let _ = write!(
        h,
        "<section><h2>Workers <small>utilisation: task time over the job's duration times the \
         worker's slots</small></h2><table id=\"workers\"><thead><tr><th>worker</th>\
         <th>device</th><th class=num>attempts</th><th class=num>task time</th>\
         <th class=num>utilisation</th><th class=num>output</th><th class=num>fetched</th>\
         <th class=num>peak memory</th></tr></thead><tbody>"
    );
    for w in &workers {
        let utilisation = if w.slots > 0 {
            format!(
                "{:.0}%",
                100.0 * w.busy_us as f64 / (timeline.duration_us.max(1) as f64 * w.slots as f64)
            )
        } else {
            "-".to_string()
        };
        let _ = write!(
            h,
            "<tr data-worker=\"{id}\"><td class=mono>{id}</td><td>{}</td><td class=num>{}</td>\
             <td class=num>{}</td><td class=num>{utilisation}</td><td class=num>{}</td>\
             <td class=num>{}</td><td class=num>{}</td></tr>",
            escape(if w.device.is_empty() {
                "(left)"
            } else {
                &w.device
            }),
            w.attempts,
            duration(w.busy_us as f64),
            bytes(w.output_bytes),
            bytes(w.fetched_bytes),
            w.peak_memory_bytes.map_or("-".to_string(), bytes),
            id = escape(&w.worker),
        );
    }
    let _ = writeln!(h, "</tbody></table></section>");

    // Memory.
    let _ = writeln!(
        h,
        "<section><h2>Worker memory <small>bytes of partitions held, from heartbeats</small></h2>\
         <div class=\"legend\" id=\"memory-legend\"></div>\
         <canvas id=\"memory\" height=\"160\"></canvas><p class=\"muted\" id=\"memory-note\"></p>\
         </section>"
    );

    // Transfers.
    let _ = write!(
        h,
        "<section><h2>Transfers <small>partition bytes tasks read from other workers</small></h2>\
         <canvas id=\"transfer-chart\" height=\"120\"></canvas><table id=\"transfers\"><thead><tr>\
         <th>from</th><th>to</th><th class=num>bytes</th><th class=num>transfers</th></tr></thead>\
         <tbody>"
    );
    if pairs.is_empty() {
        let _ = write!(
            h,
            "<tr><td colspan=4 class=empty>none: every task read its inputs on the worker that \
             held them</td></tr>"
        );
    }
    for p in &pairs {
        let _ = write!(
            h,
            "<tr><td class=mono>{}</td><td class=mono>{}</td><td class=num>{}</td>\
             <td class=num>{}</td></tr>",
            escape(&p.from),
            escape(&p.to),
            bytes(p.bytes),
            p.transfers
        );
    }
    let _ = writeln!(h, "</tbody></table></section>");

    // Slowest attempts.
    let _ = write!(
        h,
        "<section><h2>Slowest task attempts</h2><table id=\"slowest\"><thead><tr><th>stage</th>\
         <th class=num>task</th><th class=num>attempt</th><th>worker</th>\
         <th class=num>started</th><th class=num>duration</th><th class=num>output</th>\
         <th class=num>fetched</th><th>outcome</th></tr></thead><tbody>"
    );
    for t in &slowest {
        let _ = write!(
            h,
            "<tr><td>{}</td><td class=num>{}</td><td class=num>{}</td><td class=mono>{}</td>\
             <td class=num>+{}</td><td class=num>{}</td><td class=num>{}</td><td class=num>{}</td>{}</tr>",
            escape(&stage_name(t.stage)),
            t.task,
            t.attempt,
            escape(&worker_name(t.worker)),
            duration(t.start_us as f64),
            duration(t.end_us.saturating_sub(t.start_us) as f64),
            bytes(t.output_bytes),
            bytes(t.fetched_bytes),
            if t.error.is_empty() {
                "<td>ok</td>".to_string()
            } else {
                format!("<td class=error>{}</td>", escape(&t.error))
            }
        );
    }
    let _ = writeln!(h, "</tbody></table></section>");

    if !failed.is_empty() {
        let _ = write!(
            h,
            "<section><h2>Failed attempts</h2><table id=\"failed\"><thead><tr><th>stage</th>\
             <th class=num>task</th><th class=num>attempt</th><th>worker</th><th>error</th></tr>\
             </thead><tbody>"
        );
        for t in failed.iter().take(TOP_ROWS) {
            let _ = write!(
                h,
                "<tr><td>{}</td><td class=num>{}</td><td class=num>{}</td><td class=mono>{}</td>\
                 <td class=error>{}</td></tr>",
                escape(&stage_name(t.stage)),
                t.task,
                t.attempt,
                escape(&worker_name(t.worker)),
                escape(&t.error)
            );
        }
        let _ = writeln!(h, "</tbody></table></section>");
    }

    let _ = write!(
        h,
        "</main>\n<div id=\"tooltip\"></div>\n\
         <script type=\"application/json\" id=\"report-data\">{}</script>\n\
         <script>\n{TIMELINE_JS}</script>\n<script>\n{REPORT_JS}</script>\n</body>\n</html>\n",
        embedded_data(timeline)?
    );
    Ok(h)
}

/// Writes the report of `timeline` to `path`.
pub fn write(path: &Path, timeline: &JobTimeline) -> Result<()> {
    let html = render(timeline)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create `{}`", dir.display()))?;
    }
    std::fs::write(path, html)
        .with_context(|| format!("cannot write the report to `{}`", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use wrk_proto::{StageProgress, TaskExecution, TimelineWorker};

    #[test]
    fn dates_are_utc_civil_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400_000), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_767_225_599_000), "2025-12-31 23:59:59 UTC");
    }

    #[test]
    fn the_report_escapes_names_and_embeds_no_closing_script_tag() {
        let timeline = JobTimeline {
            job_id: "job-000001".into(),
            name: "<b>evil</b>".into(),
            state: JobState::Failed as i32,
            error: "stage `x` failed: </script><script>alert(1)</script>".into(),
            duration_us: 2_000_000,
            stages: vec![StageProgress {
                name: "</script>".into(),
                total: 1,
                done: 0,
                running: 0,
            }],
            workers: vec![TimelineWorker {
                worker_id: "w<1>".into(),
                device: "cpu".into(),
                pool_bytes: 0,
                slots: 1,
            }],
            tasks: vec![TaskExecution {
                worker: 0,
                start_us: 10,
                end_us: 1_000_010,
                error: "trap </script>".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let html = render(&timeline).unwrap();
        assert!(!html.contains("<b>evil</b>"));
        assert!(html.contains("&lt;b&gt;evil&lt;/b&gt;"));
        assert_eq!(
            html.matches("</script>").count(),
            3,
            "only the three script elements close"
        );
        assert!(html.contains("w&lt;1&gt;"));
        assert!(html.contains("id=\"failed\""), "failed attempts are listed");
        for external in ["src=\"http", "href=\"http", "<link", "<script src"] {
            assert!(!html.contains(external), "the report loads {external}");
        }
    }

    #[test]
    fn sizes_and_durations_read_well() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(3 << 20), "3.0 MiB");
        assert_eq!(duration(1_500.0), "1.50 ms");
        assert_eq!(duration(2_500_000.0), "2.50 s");
        assert_eq!(duration(600e6), "10.0 min");
        assert_eq!(escape("a&'\""), "a&amp;&#39;&quot;");
    }
}

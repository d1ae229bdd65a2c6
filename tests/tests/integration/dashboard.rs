//! The scheduler's web dashboard and `wrk submit --report`, end to end: a scheduler and two
//! worker processes run the taxi job; the dashboard's JSON endpoints show its tasks and
//! transfers; headless Chromium (Debian's `chromium`; `tests/run.sh` installs it) renders the
//! dashboard and the report with the job's workers and tasks and without a single console
//! message. Without a Chromium the browser part is skipped with a line saying so.
//!
//! Screenshots go to a temporary directory; with `WRK_UPDATE_SCREENSHOTS=1` they replace
//! `docs/dashboard.png` and `docs/report.png`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::common::*;

/// A Chromium on the PATH, if any.
fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |dir| dir.join(name)))
        .find(|candidate| candidate.is_file())
}

/// What headless Chromium made of a page: its DOM after scripts ran, and the console messages
/// it logged (our pages log none).
struct Rendered {
    dom: String,
    console: Vec<String>,
}

fn headless(browser: &Path, profile: &Path) -> Command {
    let mut command = Command::new(browser);
    command
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            "--window-size=1400,900",
            // Scripts run for this much virtual time (timers fire at once; fetches are real).
            "--virtual-time-budget=6000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .stdin(Stdio::null());
    command
}

/// Renders `url`, and saves a screenshot of it to `screenshot`.
fn render(browser: &Path, url: &str, screenshot: &Path) -> Rendered {
    let profile = tempfile::tempdir().unwrap();
    let output = headless(browser, profile.path())
        .args(["--enable-logging=stderr", "--v=0", "--dump-dom", url])
        .output()
        .expect("run chromium");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "chromium --dump-dom {url} failed: {stderr}"
    );
    let console = stderr
        .lines()
        .filter(|l| l.contains(":CONSOLE"))
        .map(str::to_string)
        .collect();
    let shot = headless(browser, profile.path())
        .arg(format!("--screenshot={}", screenshot.display()))
        .arg(url)
        .output()
        .expect("run chromium");
    assert!(shot.status.success(), "chromium --screenshot {url} failed");
    let png = std::fs::read(screenshot).expect("chromium wrote the screenshot");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "a real screenshot of {url}"
    );
    Rendered {
        dom: String::from_utf8_lossy(&output.stdout).into_owned(),
        console,
    }
}

/// The integer value of attribute `name` on the element with id `id` in a dumped DOM.
fn attribute(dom: &str, id: &str, name: &str) -> Option<u64> {
    let at = dom.find(&format!("id=\"{id}\""))?;
    let tag_start = dom[..at].rfind('<')?;
    let tag_end = at + dom[at..].find('>')?;
    let tag = &dom[tag_start..tag_end];
    let value = tag.split(&format!("{name}=\"")).nth(1)?.split('"').next()?;
    value.parse().ok()
}

fn api(http: &str, path: &str) -> serde_json::Value {
    let (head, body) = http_get(http, path);
    assert!(
        head.to_lowercase().contains("application/json"),
        "{path}: {head}"
    );
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path} is not JSON ({e}): {body}"))
}

#[test]
fn dashboard_and_report_show_the_job_that_just_ran() {
    let _ = guest("taxi-haversine");
    // Six files: six `distance` tasks over two workers, then one `summary` reading them all.
    let data = taxi_dataset(120_000, 6, 10_000);
    let mut processes = Processes(Vec::new());
    let scheduler = start_scheduler(&mut processes, &[], &[]);
    let (url, http) = (scheduler.url.clone(), scheduler.http.clone());
    processes
        .0
        .push(start_worker(&url, "w1", &["--tags", "nvme"]));
    processes.0.push(start_worker(&url, "w2", &[]));
    wait_for_workers(&url, 2, None);
    let out = tempfile::tempdir().unwrap();
    let report = out.path().join("report.html");
    let run = Command::new(wrk())
        .arg("submit")
        .arg(workspace_root().join("guest-examples/taxi-haversine/job.toml"))
        .args(["--scheduler", &url, "--quiet", "--report"])
        .arg(&report)
        .arg("--output")
        .arg(out.path().join("summary.parquet"))
        .arg("--source")
        .arg(format!("trips={}", data.path().display()))
        .arg("--module")
        .arg(guest("taxi-haversine"))
        .output()
        .expect("run wrk submit");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "wrk submit failed: {stderr}");
    assert!(stderr.contains("wrote the performance report"), "{stderr}");

    // The JSON endpoints: the job's seven task executions, on the two workers.
    let tasks = api(&http, "/api/tasks");
    let items = tasks["items"].as_array().expect("items");
    let job: Vec<&serde_json::Value> = items.iter().filter(|t| t["job"] == "job-000001").collect();
    let mut by_stage: BTreeMap<&str, usize> = BTreeMap::new();
    for t in &job {
        assert_eq!(t["ok"], true, "{t}");
        assert!(t["end_us"].as_u64() >= t["start_us"].as_u64(), "{t}");
        assert!(t["output_bytes"].as_u64() > Some(0), "{t}");
        *by_stage.entry(t["stage"].as_str().unwrap()).or_default() += 1;
    }
    assert_eq!(
        by_stage,
        BTreeMap::from([("distance", 6), ("summary", 1)]),
        "{tasks}"
    );
    let ran_on: BTreeSet<&str> = job.iter().map(|t| t["worker"].as_str().unwrap()).collect();
    assert!(
        ran_on.is_subset(&BTreeSet::from(["w1", "w2"])),
        "{ran_on:?}"
    );
    // Increments by cursor: nothing new since.
    let next = tasks["next"].as_u64().expect("next");
    let again = api(&http, &format!("/api/tasks?since={next}"));
    assert_eq!(again["items"].as_array().map(Vec::len), Some(0), "{again}");
    assert_eq!(again["next"].as_u64(), Some(next));
    // Transfers: what the summary task fetched from the other worker, as it reported.
    let transfers = api(&http, "/api/transfers");
    let moved: u64 = transfers["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|t| t["bytes"].as_u64().unwrap())
        .sum();
    let fetched: u64 = job
        .iter()
        .map(|t| t["fetched_bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(moved, fetched, "{transfers}");
    let distance_workers: BTreeSet<&str> = job
        .iter()
        .filter(|t| t["stage"] == "distance")
        .map(|t| t["worker"].as_str().unwrap())
        .collect();
    if distance_workers.len() == 2 {
        assert!(
            moved > 0,
            "the summary read outputs of both workers: {transfers}"
        );
    }
    let workers = api(&http, "/api/workers");
    let ids: Vec<&str> = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["w1", "w2"]);
    // Given tags and the automatic `cpu` (no GPU here), sorted.
    assert_eq!(
        workers["workers"][0]["tags"],
        serde_json::json!(["cpu", "nvme"])
    );
    assert_eq!(workers["workers"][1]["tags"], serde_json::json!(["cpu"]));
    let jobs = api(&http, "/api/jobs");
    assert_eq!(jobs["jobs"][0]["id"], "job-000001", "{jobs}");
    assert_eq!(jobs["jobs"][0]["state"], "succeeded", "{jobs}");
    assert_eq!(jobs["jobs"][0]["priority"], 0, "{jobs}");
    assert_eq!(jobs["jobs"][0]["waiting"], "", "{jobs}");
    let (head, page) = http_get(&http, "/");
    assert!(head.to_lowercase().contains("text/html"), "{head}");
    assert!(page.contains("<canvas id=\"stream\""));

    // The report is one file that loads nothing.
    let html = std::fs::read_to_string(&report).expect("the report was written");
    for external in [
        "<script src",
        "<link",
        "src=\"http",
        "href=\"http",
        "url(http",
    ] {
        assert!(!html.contains(external), "the report loads `{external}`");
    }

    let Some(browser) = chromium() else {
        println!(
            "skipping the browser checks: no chromium on the PATH (Debian: apt-get install chromium)"
        );
        return;
    };
    let shots = if std::env::var_os("WRK_UPDATE_SCREENSHOTS").is_some() {
        workspace_root().join("docs")
    } else {
        out.path().to_path_buf()
    };

    let dashboard = render(&browser, &format!("{http}/"), &shots.join("dashboard.png"));
    let dom = &dashboard.dom;
    assert!(
        dashboard.console.is_empty(),
        "the dashboard logged to the console:\n{}",
        dashboard.console.join("\n")
    );
    assert!(dom.contains("id=\"status\" class=\"live\""), "{dom}");
    for worker in ["w1", "w2"] {
        assert!(
            dom.contains(&format!("data-worker=\"{worker}\"")),
            "worker {worker} in the dashboard"
        );
    }
    assert!(
        dom.contains("<span class=\"tag\">nvme</span>"),
        "w1's tag in the dashboard"
    );
    assert!(
        dom.contains("data-job=\"job-000001\""),
        "the job in the dashboard"
    );
    assert_eq!(
        dom.matches("data-task=\"job-000001/distance/").count(),
        6,
        "the six distance tasks in the recent tasks"
    );
    assert!(dom.contains("data-task=\"job-000001/summary/0\""));
    assert_eq!(
        attribute(dom, "stream", "data-drawn"),
        Some(job.len() as u64),
        "every task of the job drawn in the task stream"
    );

    let report_view = render(
        &browser,
        &format!("file://{}", report.display()),
        &shots.join("report.png"),
    );
    let dom = &report_view.dom;
    assert!(
        report_view.console.is_empty(),
        "the report logged to the console:\n{}",
        report_view.console.join("\n")
    );
    assert!(
        dom.contains("data-rendered=\"true\""),
        "the report's script ran"
    );
    assert_eq!(
        attribute(dom, "stream", "data-drawn"),
        Some(7),
        "the report draws the job's seven task attempts"
    );
    assert!(
        dom.contains("<tr data-stage=\"distance\"><td>distance</td><td class=\"num\">6/6</td>"),
        "{dom}"
    );
    assert!(
        dom.contains("<tr data-stage=\"summary\"><td>summary</td><td class=\"num\">1/1</td>"),
        "{dom}"
    );
    for worker in &ran_on {
        assert!(
            dom.contains(&format!("data-worker=\"{worker}\"")),
            "worker {worker} in the report"
        );
    }
    assert!(dom.contains("succeeded"));
}

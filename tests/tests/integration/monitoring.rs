//! The operator's monitoring files (`operator/chart/monitoring/`): the alert rules pass
//! `promtool check rules`, every Grafana panel's query parses as PromQL (checked by promtool as a
//! recording rule), and every series the dashboard and the rules use is one the scheduler or the
//! workers export, or one the monitoring README lists as planned (pool and GPU series).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use crate::common::workspace_root;

fn monitoring() -> PathBuf {
    workspace_root().join("operator/chart/monitoring")
}

fn read(name: &str) -> String {
    let path = monitoring().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// `promtool check rules` on `path`; panics with its findings.
fn promtool_check_rules(path: &std::path::Path) {
    let output = Command::new("promtool")
        .args(["check", "rules"])
        .arg(path)
        .output()
        .expect("promtool is needed: install Debian's `prometheus` package (tests/run.sh does)");
    assert!(
        output.status.success(),
        "promtool rejects {}:\n{}{}",
        path.display(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The metric names a PromQL expression selects (functions, keywords, label names, strings
/// and durations left out).
fn metric_names(expr: &str) -> BTreeSet<String> {
    const KEYWORDS: [&str; 12] = [
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "offset",
        "bool",
        "inf",
    ];
    // Aggregations may take their grouping before their argument (`sum by (x) (...)`).
    const AGGREGATIONS: [&str; 14] = [
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    ];
    const GROUPING: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' {
            i += 1;
            while i < chars.len() && chars[i] != c {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c == '{' || c == '[' {
            let close = if c == '{' { '}' } else { ']' };
            while i < chars.len() && chars[i] != close {
                if chars[i] == '"' {
                    i += 1;
                    while i < chars.len() && chars[i] != '"' {
                        i += if chars[i] == '\\' { 2 } else { 1 };
                    }
                }
                i += 1;
            }
            i += 1;
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || "_:".contains(chars[i])) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            let called = chars.get(next) == Some(&'(');
            if GROUPING.contains(&word.as_str()) && called {
                // Label names in `by (...)` and the like.
                while i < chars.len() && chars[i] != ')' {
                    i += 1;
                }
            } else if !called
                && !KEYWORDS.contains(&word.to_lowercase().as_str())
                && !AGGREGATIONS.contains(&word.as_str())
            {
                names.insert(word);
            }
        } else if c.is_ascii_digit() {
            // Numbers, including durations such as `5m` and exponents such as `1e6`.
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    names
}

/// Series names `wrk` exports now: the scheduler's and a worker's, with histogram suffixes.
fn exported() -> BTreeSet<String> {
    let scheduler = wrk_scheduler::metrics::SchedulerMetrics::default();
    let worker = wrk_host::metrics::WorkerMetrics::new(wrk_host::metrics::compile_cache_counter());
    let mut names = BTreeSet::new();
    for name in scheduler.names().iter().chain(worker.names()) {
        for suffix in ["", "_bucket", "_sum", "_count"] {
            names.insert(format!("{name}{suffix}"));
        }
    }
    names
}

/// Series the monitoring README lists as planned (its table rows starting with a series name).
fn planned() -> BTreeSet<String> {
    read("README.md")
        .lines()
        .filter_map(|line| line.strip_prefix("| `wrk_"))
        .filter_map(|rest| rest.split('`').next())
        .map(|name| format!("wrk_{name}"))
        .collect()
}

/// Every panel query of the Grafana dashboard, with Grafana's variables given values.
fn dashboard_queries() -> Vec<(String, String)> {
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("grafana-dashboard.json")).expect("the dashboard is JSON");
    assert_eq!(dashboard["uid"], "wrk-overview");
    let mut panels: Vec<&serde_json::Value> = Vec::new();
    let mut stack: Vec<&serde_json::Value> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .collect();
    while let Some(panel) = stack.pop() {
        if let Some(nested) = panel["panels"].as_array() {
            stack.extend(nested);
        }
        panels.push(panel);
    }
    let mut queries = Vec::new();
    for panel in panels {
        let title = panel["title"].as_str().unwrap_or_default().to_string();
        if panel["type"] == "row" {
            continue;
        }
        let targets = panel["targets"]
            .as_array()
            .unwrap_or_else(|| panic!("panel `{title}` has no targets"));
        assert!(!targets.is_empty(), "panel `{title}` has no queries");
        for target in targets {
            let expr = target["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("panel `{title}`: a target without expr"));
            let expr = expr
                .replace("$__rate_interval", "5m")
                .replace("$namespace", ".*");
            assert!(
                !expr.contains('$'),
                "panel `{title}`: unknown variable in {expr}"
            );
            queries.push((title.clone(), expr));
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
    {
        if let Some(query) = variable["query"]["query"].as_str() {
            let inner = query
                .strip_prefix("label_values(")
                .and_then(|q| q.split(',').next())
                .unwrap_or_else(|| panic!("variable query {query} is not label_values(...)"));
            queries.push((format!("variable {}", variable["name"]), inner.to_string()));
        }
    }
    queries
}

#[test]
fn alert_rules_pass_promtool() {
    promtool_check_rules(&monitoring().join("wrk-alerts.rules.yaml"));
}

#[test]
fn grafana_queries_parse_as_promql() {
    let queries = dashboard_queries();
    assert!(queries.len() >= 20, "{} queries", queries.len());
    // Each query as a recording rule: promtool parses it.
    let mut rules = String::from("groups:\n  - name: grafana-panels\n    rules:\n");
    for (i, (_, expr)) in queries.iter().enumerate() {
        let expr = serde_json::to_string(expr).unwrap();
        rules.push_str(&format!(
            "      - record: wrk:grafana_panel_{i}\n        expr: {expr}\n"
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("grafana-panels.rules.yaml");
    std::fs::write(&path, rules).unwrap();
    promtool_check_rules(&path);
}

#[test]
fn dashboards_and_alerts_use_only_exported_or_planned_series() {
    let exported = exported();
    let planned = planned();
    assert!(
        exported.contains("wrk_scheduler_queued_tasks"),
        "queue depth per tenant and stage is exported"
    );
    for gpu in [
        "wrk_gpu_memory_used_bytes",
        "wrk_gpu_sm_utilization_ratio",
        "wrk_gpu_pcie_rx_bytes_per_second",
        "wrk_gpu_pcie_tx_bytes_per_second",
    ] {
        assert!(planned.contains(gpu), "the README documents {gpu}");
    }
    let mut used: Vec<(String, String)> = dashboard_queries();
    let rules: serde_json::Value =
        serde_saphyr::from_str(&read("wrk-alerts.rules.yaml")).expect("the rules are YAML");
    let mut alerts = 0;
    for group in rules["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            let name = rule["alert"]
                .as_str()
                .expect("alerting rules only")
                .to_string();
            used.push((name, rule["expr"].as_str().expect("expr").to_string()));
            alerts += 1;
        }
    }
    assert_eq!(alerts, 3, "the three alerts of seed 000");
    let mut seen = BTreeSet::new();
    for (what, expr) in &used {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{what}: no series in {expr}");
        for name in names {
            assert!(
                exported.contains(&name) || planned.contains(&name),
                "{what} uses `{name}`, which wrk does not export and the monitoring README \
                 does not list as planned"
            );
            seen.insert(name);
        }
    }
    for required in [
        "wrk_scheduler_tasks_finished_total",
        "wrk_scheduler_queued_tasks",
        "wrk_worker_pool_used_bytes",
        "wrk_worker_spilled_bytes_total",
        "wrk_gpu_sm_utilization_ratio",
    ] {
        assert!(
            seen.contains(required),
            "no panel or alert shows {required}"
        );
    }
}

#[test]
fn metric_names_are_extracted_from_promql() {
    let names = metric_names(
        r#"histogram_quantile(0.95, sum by (stage, le) (rate(wrk_a_bucket{ns=~"x{1}", b="c"}[5m])))
           / on (pod) group_left wrk_b > 1e6 and wrk_c offset 5m"#,
    );
    assert_eq!(
        names,
        BTreeSet::from(["wrk_a_bucket".into(), "wrk_b".into(), "wrk_c".into()])
    );
}

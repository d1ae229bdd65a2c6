//! Job files: the TOML a data engineer writes, and its translation into the scheduler's job graph
//! (modules read and hashed, sources split into partitions by row groups).
//!
//! ```toml
//! name = "taxi-haversine"
//! module = "../../target/wasm32-wasip2/release/taxi_haversine.wasm"  # default for every stage
//!
//! [params]
//! radius_km = "6371"
//!
//! [sources.trips]
//! path = "../../data/taxi"        # relative paths are relative to this file
//!
//! [[stage]]
//! name = "distance"
//! source = "trips"                # one task per partition of the source
//! columns = ["pickup_longitude"]  # projection (optional)
//!
//! [[stage]]
//! name = "summary"
//! inputs = ["distance"]           # every output of `distance`, in one task
//! requires = ["gpu"]              # only on workers with all these tags (optional)
//! ```
//!
//! `persist = "NAME"` keeps the final stages' outputs on the workers as the tenant's dataset
//! `NAME`; a stage of a later job reads it with `dataset = "NAME"` (one task per partition).
//! A top-level `priority = N` (default 0; `wrk submit --priority` overrides it) orders the
//! tenant's jobs: ready tasks of higher-priority jobs start first.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use wrk_proto::stage_input::Pattern;
use wrk_proto::{Grant, JobSpec, Limits, Module, Stage, StageInput};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobFile {
    pub name: String,
    /// Default module for stages that name none.
    pub module: Option<PathBuf>,
    #[serde(default)]
    pub params: BTreeMap<String, toml::Value>,
    #[serde(default)]
    pub sources: BTreeMap<String, PathEntry>,
    #[serde(default)]
    pub sinks: BTreeMap<String, PathEntry>,
    #[serde(default)]
    pub limits: LimitsEntry,
    #[serde(rename = "stage", default)]
    pub stages: Vec<StageEntry>,
    /// Keep the final stages' outputs on the workers as a dataset of this name.
    pub persist: Option<String>,
    /// Among the tenant's jobs, higher starts first.
    pub priority: Option<i32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathEntry {
    pub path: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsEntry {
    pub task_timeout_secs: Option<f64>,
    pub task_memory_mib: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageEntry {
    pub name: String,
    pub module: Option<PathBuf>,
    /// Read this source: one task per partition.
    pub source: Option<String>,
    /// Read this persisted dataset (of the tenant submitting): one task per partition.
    pub dataset: Option<String>,
    #[serde(default)]
    pub columns: Vec<String>,
    /// Target partition size in MiB (default 256).
    pub partition_mib: Option<u64>,
    /// Consume earlier stages' outputs.
    #[serde(default)]
    pub inputs: Vec<InputEntry>,
    /// Task count for a stage with neither a source nor one-to-one inputs (default 1; for the
    /// reducers of an exchange, the partition count, by default the mappers' task count).
    pub tasks: Option<u32>,
    #[serde(default)]
    pub params: BTreeMap<String, toml::Value>,
    /// Worker tags the stage's tasks need, all of them.
    #[serde(default)]
    pub requires: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum InputEntry {
    /// `"stage"`: every output of that stage.
    All(String),
    /// `{ stage = "x", pattern = "one-to-one" | "all" | "broadcast" }`, or
    /// `{ stage = "x", exchange = "name" }`: the stage's tasks are the reducers of exchange
    /// `name`, which the tasks of `x` send to.
    Detailed {
        stage: String,
        pattern: Option<PatternEntry>,
        exchange: Option<String>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PatternEntry {
    OneToOne,
    All,
    Broadcast,
    Shuffle,
}

/// Overrides given on the command line.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub params: Vec<(String, String)>,
    pub sources: Vec<(String, String)>,
    pub sinks: Vec<(String, String)>,
    /// Replaces the job's default `module` (stages naming their own module keep it).
    pub module: Option<PathBuf>,
    /// Persists the job's output as this dataset (`--persist`), overriding the file's `persist`.
    pub persist: Option<String>,
    /// Replaces the job file's `priority`.
    pub priority: Option<i32>,
}

/// A planned job: its graph and the priority to submit it at.
#[derive(Debug, Clone)]
pub struct Plan {
    pub spec: JobSpec,
    pub priority: i32,
}

fn param_text(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn resolve(base: &Path, path: &str) -> String {
    if path.contains("://") || Path::new(path).is_absolute() {
        path.to_string()
    } else {
        base.join(path).to_string_lossy().into_owned()
    }
}

/// The job file's grants (paths resolved against `base`), with command-line overrides.
fn grants(
    base: &Path,
    entries: &BTreeMap<String, PathEntry>,
    overrides: &[(String, String)],
) -> HashMap<String, Grant> {
    let mut grants: HashMap<String, Grant> = entries
        .iter()
        .map(|(name, entry)| {
            (
                name.clone(),
                Grant {
                    uri: resolve(base, &entry.path),
                },
            )
        })
        .collect();
    for (name, uri) in overrides {
        grants.insert(name.clone(), Grant { uri: uri.clone() });
    }
    grants
}

/// Reads a job file.
pub fn load(path: &Path) -> Result<JobFile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read job file `{}`", path.display()))?;
    toml::from_str(&text).with_context(|| format!("job file `{}` is not valid", path.display()))
}

/// Builds the job graph of a job file located at `path`.
pub fn plan(path: &Path, overrides: &Overrides) -> Result<JobSpec> {
    plan_job(path, overrides).map(|plan| plan.spec)
}

/// [`plan`], with the priority to submit the job at (the override, else the file's, else 0).
pub fn plan_job(path: &Path, overrides: &Overrides) -> Result<Plan> {
    let file = load(path)?;
    let priority = overrides.priority.or(file.priority).unwrap_or(0);
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let spec = build_spec(file, &base, overrides)
        .with_context(|| format!("job file `{}`", path.display()))?;
    Ok(Plan { spec, priority })
}

fn build_spec(file: JobFile, base: &Path, overrides: &Overrides) -> Result<JobSpec> {
    if file.stages.is_empty() {
        bail!("the job has no [[stage]]");
    }
    let mut params: HashMap<String, String> = file
        .params
        .iter()
        .map(|(k, v)| (k.clone(), param_text(v)))
        .collect();
    params.extend(overrides.params.iter().cloned());
    let sources = grants(base, &file.sources, &overrides.sources);
    let sinks = grants(base, &file.sinks, &overrides.sinks);

    let mut modules: Vec<Module> = Vec::new();
    let mut module_hashes: HashMap<PathBuf, String> = HashMap::new();
    let mut stages: Vec<Stage> = Vec::new();
    let mut stage_index: HashMap<String, u32> = HashMap::new();
    for entry in &file.stages {
        let module_path = match (&entry.module, &overrides.module, &file.module) {
            (Some(own), _, _) => PathBuf::from(resolve(base, &own.to_string_lossy())),
            // A module given on the command line is relative to where the command runs.
            (None, Some(given), _) => given.clone(),
            (None, None, Some(default)) => PathBuf::from(resolve(base, &default.to_string_lossy())),
            (None, None, None) => bail!(
                "stage `{}` names no module and the job has no default `module`",
                entry.name
            ),
        };
        let hash = match module_hashes.get(&module_path) {
            Some(hash) => hash.clone(),
            None => {
                let wasm = std::fs::read(&module_path).with_context(|| {
                    format!(
                        "stage `{}`: cannot read module `{}`",
                        entry.name,
                        module_path.display()
                    )
                })?;
                let hash = wrk_host::engine::module_hash(&wasm);
                let name = module_path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| module_path.display().to_string());
                modules.push(Module {
                    hash: hash.clone(),
                    wasm,
                    name,
                });
                module_hashes.insert(module_path.clone(), hash.clone());
                hash
            }
        };

        let mut inputs = Vec::new();
        let mut one_to_one_tasks = None;
        let mut mapper_tasks = None;
        for input in &entry.inputs {
            let (name, pattern, exchange) = match input {
                InputEntry::All(name) => (name, Pattern::All, String::new()),
                InputEntry::Detailed {
                    stage,
                    pattern,
                    exchange,
                } => {
                    let pattern = match (pattern, exchange) {
                        (None | Some(PatternEntry::Shuffle), Some(_)) => Pattern::Shuffle,
                        (Some(PatternEntry::Shuffle), None) => bail!(
                            "stage `{}`: a shuffle input from `{stage}` needs an `exchange` name (the name its mappers send to)",
                            entry.name
                        ),
                        (Some(other), Some(exchange)) => bail!(
                            "stage `{}`: input `{stage}` names exchange `{exchange}` but has pattern {other:?}; exchanges are shuffle inputs",
                            entry.name
                        ),
                        (None, None) => bail!(
                            "stage `{}`: input `{stage}` needs a `pattern` or an `exchange`",
                            entry.name
                        ),
                        (Some(PatternEntry::OneToOne), None) => Pattern::OneToOne,
                        (Some(PatternEntry::All), None) => Pattern::All,
                        (Some(PatternEntry::Broadcast), None) => Pattern::Broadcast,
                    };
                    (stage, pattern, exchange.clone().unwrap_or_default())
                }
            };
            let Some(&index) = stage_index.get(name) else {
                bail!(
                    "stage `{}` takes input from `{name}`, which is not an earlier stage",
                    entry.name
                );
            };
            if pattern == Pattern::OneToOne {
                one_to_one_tasks = Some(stages[index as usize].num_tasks);
            }
            if pattern == Pattern::Shuffle {
                mapper_tasks = Some(stages[index as usize].num_tasks);
            }
            inputs.push(StageInput {
                stage: index,
                pattern: pattern as i32,
                exchange,
            });
        }

        if let (Some(source), Some(dataset)) = (&entry.source, &entry.dataset) {
            bail!(
                "stage `{}` reads both source `{source}` and dataset `{dataset}`; a stage reads one of them",
                entry.name
            );
        }
        let partitions = match &entry.source {
            Some(source) => {
                let Some(grant) = sources.get(source) else {
                    let known: Vec<&String> = sources.keys().collect();
                    bail!(
                        "stage `{}` reads source `{source}`, which the job does not declare (sources: {known:?})",
                        entry.name
                    );
                };
                let target = entry
                    .partition_mib
                    .map(|m| m.max(1) << 20)
                    .unwrap_or(wrk_host::io::DEFAULT_PARTITION_BYTES);
                wrk_host::io::plan_partitions(&grant.uri, &entry.columns, target).with_context(
                    || format!("stage `{}`: planning source `{source}`", entry.name),
                )?
            }
            None => Vec::new(),
        };
        let num_tasks = if !partitions.is_empty() {
            partitions.len() as u32
        } else if entry.dataset.is_some() {
            // The scheduler knows the dataset's partition count (and so sets it, and the
            // counts of stages left at 0 that follow it).
            0
        } else if let Some(n) = one_to_one_tasks {
            n
        } else {
            // A reducer stage has as many partitions as it has mappers unless it says otherwise.
            entry.tasks.or(mapper_tasks).unwrap_or(1)
        };
        for tag in &entry.requires {
            wrk_scheduler::tags::check(tag)
                .with_context(|| format!("stage `{}` requires tag `{tag}`", entry.name))?;
        }
        stage_index.insert(entry.name.clone(), stages.len() as u32);
        stages.push(Stage {
            name: entry.name.clone(),
            module_hash: hash,
            params: entry
                .params
                .iter()
                .map(|(k, v)| (k.clone(), param_text(v)))
                .collect(),
            num_tasks,
            partitions,
            inputs,
            dataset: entry.dataset.clone().unwrap_or_default(),
            requires: entry.requires.clone(),
        });
    }
    Ok(JobSpec {
        name: file.name,
        params,
        modules,
        stages,
        sources,
        sinks,
        limits: Some(Limits {
            task_timeout_ms: file
                .limits
                .task_timeout_secs
                .map(|s| (s * 1000.0) as u64)
                .unwrap_or(0),
            task_memory_bytes: file.limits.task_memory_mib.map(|m| m << 20).unwrap_or(0),
        }),
        persist: overrides
            .persist
            .clone()
            .or(file.persist)
            .unwrap_or_default(),
    })
}

/// Parses `key=value`.
pub fn key_value(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("expected KEY=VALUE, got `{text}`"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_module(dir: &Path) {
        std::fs::write(dir.join("m.wasm"), b"not really wasm, hashed only").unwrap();
    }

    #[test]
    fn stages_inputs_and_task_counts() {
        let dir = tempfile::tempdir().unwrap();
        write_module(dir.path());
        let file: JobFile = toml::from_str(
            r#"
            name = "j"
            module = "m.wasm"
            [params]
            k = 3
            [[stage]]
            name = "gen"
            tasks = 4
            [[stage]]
            name = "map"
            inputs = [{ stage = "gen", pattern = "one-to-one" }]
            [[stage]]
            name = "reduce"
            inputs = ["map"]
            params = { phase = "final" }
            "#,
        )
        .unwrap();
        let spec = build_spec(file, dir.path(), &Overrides::default()).unwrap();
        let counts: Vec<u32> = spec.stages.iter().map(|s| s.num_tasks).collect();
        assert_eq!(counts, vec![4, 4, 1]);
        assert_eq!(
            spec.modules.len(),
            1,
            "one module shared by every stage is sent once"
        );
        assert_eq!(spec.params["k"], "3");
        assert_eq!(spec.stages[2].params["phase"], "final");
        assert_eq!(spec.stages[1].inputs[0].pattern(), Pattern::OneToOne);
        assert_eq!(spec.stages[2].inputs[0].pattern(), Pattern::All);
    }

    #[test]
    fn unknown_stage_source_and_module_are_named() {
        let dir = tempfile::tempdir().unwrap();
        write_module(dir.path());
        let bad = |text: &str| {
            let file: JobFile = toml::from_str(text).unwrap();
            format!(
                "{:#}",
                build_spec(file, dir.path(), &Overrides::default()).unwrap_err()
            )
        };
        let err = bad("name='j'\nmodule='m.wasm'\n[[stage]]\nname='a'\ninputs=['b']");
        assert!(err.contains("stage `a` takes input from `b`"), "{err}");
        let err = bad("name='j'\nmodule='m.wasm'\n[[stage]]\nname='a'\nsource='trips'");
        assert!(
            err.contains("reads source `trips`, which the job does not declare"),
            "{err}"
        );
        let err = bad("name='j'\n[[stage]]\nname='a'\nmodule='missing.wasm'");
        assert!(
            err.contains("stage `a`: cannot read module") && err.contains("missing.wasm"),
            "{err}"
        );
    }

    #[test]
    fn a_module_override_replaces_the_default_module_only() {
        let dir = tempfile::tempdir().unwrap();
        write_module(dir.path());
        let other = dir.path().join("other.wasm");
        std::fs::write(&other, b"another module").unwrap();
        let file: JobFile = toml::from_str(
            "name='j'\nmodule='missing.wasm'\n[[stage]]\nname='a'\n[[stage]]\nname='b'\nmodule='m.wasm'",
        )
        .unwrap();
        let overrides = Overrides {
            module: Some(other),
            ..Overrides::default()
        };
        let spec = build_spec(file, dir.path(), &overrides).unwrap();
        let names: Vec<&str> = spec.modules.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["other.wasm", "m.wasm"]);
    }

    #[test]
    fn priorities_and_stage_requirements_are_read_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        write_module(dir.path());
        let job = dir.path().join("job.toml");
        std::fs::write(
            &job,
            "name='j'\nmodule='m.wasm'\npriority=3\n[[stage]]\nname='a'\nrequires=['gpu','h100']",
        )
        .unwrap();
        let plan = plan_job(&job, &Overrides::default()).unwrap();
        assert_eq!(plan.priority, 3);
        assert_eq!(plan.spec.stages[0].requires, ["gpu", "h100"]);
        let overridden = Overrides {
            priority: Some(-2),
            ..Overrides::default()
        };
        assert_eq!(plan_job(&job, &overridden).unwrap().priority, -2);
        std::fs::write(
            &job,
            "name='j'\nmodule='m.wasm'\n[[stage]]\nname='a'\nrequires=['GPU']",
        )
        .unwrap();
        let err = format!("{:#}", plan_job(&job, &Overrides::default()).unwrap_err());
        assert!(
            err.contains("stage `a` requires tag `GPU`") && err.contains("characters other than"),
            "{err}"
        );
        std::fs::write(&job, "name='j'\nmodule='m.wasm'\n[[stage]]\nname='a'").unwrap();
        assert_eq!(plan_job(&job, &Overrides::default()).unwrap().priority, 0);
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err =
            toml::from_str::<JobFile>("name='j'\n[[stage]]\nname='a'\nmodlue='x'").unwrap_err();
        assert!(err.to_string().contains("modlue"), "{err}");
    }
}

//! Validation of submitted job graphs: every problem a client can cause is reported before the
//! job is accepted, naming the stage or module at fault.

use std::collections::{HashMap, HashSet};

use wrk_proto::stage_input::Pattern;
use wrk_proto::{JobSpec, Module};

/// Why a job graph was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GraphError {
    #[error("the job has no stages")]
    NoStages,
    #[error("stage {index} has no name")]
    UnnamedStage { index: usize },
    #[error("two stages are named `{name}`")]
    DuplicateStage { name: String },
    #[error("stage `{stage}` has no tasks (num_tasks is 0)")]
    NoTasks { stage: String },
    #[error("stage `{stage}` reads {partitions} input partitions but declares {tasks} tasks")]
    PartitionCount {
        stage: String,
        partitions: usize,
        tasks: u32,
    },
    #[error("stage `{stage}` takes input from stage #{input}, which is not an earlier stage")]
    ForwardInput { stage: String, input: u32 },
    #[error(
        "stage `{stage}` maps one-to-one over stage `{input}`, but has {tasks} tasks where `{input}` has {input_tasks}"
    )]
    OneToOneMismatch {
        stage: String,
        input: String,
        tasks: u32,
        input_tasks: u32,
    },
    #[error("stage `{stage}` reads a shuffle input from stage `{input}` without an exchange name")]
    UnnamedExchange { stage: String, input: String },
    #[error(
        "exchange `{exchange}` is declared twice (by stages `{first}` and `{second}`): mappers send to an exchange by name, so names must be unique in a job"
    )]
    DuplicateExchange {
        exchange: String,
        first: String,
        second: String,
    },
    #[error(
        "stage `{stage}` names exchange `{exchange}` on a {pattern} input from `{input}`; only shuffle inputs have exchanges"
    )]
    ExchangeOnNonShuffle {
        stage: String,
        exchange: String,
        input: String,
        pattern: &'static str,
    },
    #[error("stage `{stage}` runs module {hash}, which the job does not include")]
    UnknownModule { stage: String, hash: String },
    #[error("stage `{stage}` requires an invalid worker tag: {source}")]
    InvalidTag {
        stage: String,
        source: crate::tags::TagError,
    },
    #[error("module `{name}` does not match its hash: declared {declared}, actual {actual}")]
    ModuleHash {
        name: String,
        declared: String,
        actual: String,
    },
}

/// Lower-case hex SHA-256.
pub fn content_hash(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// Checks a job graph; `known_modules` are hashes the scheduler already holds.
pub fn validate(spec: &JobSpec, known_modules: &HashSet<String>) -> Result<(), GraphError> {
    if spec.stages.is_empty() {
        return Err(GraphError::NoStages);
    }
    let mut modules: HashSet<&str> = known_modules.iter().map(String::as_str).collect();
    for Module { hash, wasm, name } in &spec.modules {
        let actual = content_hash(wasm);
        if actual != *hash {
            return Err(GraphError::ModuleHash {
                name: name.clone(),
                declared: hash.clone(),
                actual,
            });
        }
        modules.insert(hash);
    }
    let mut names: HashMap<&str, usize> = HashMap::new();
    let mut exchanges: HashMap<&str, &str> = HashMap::new();
    for (index, stage) in spec.stages.iter().enumerate() {
        if stage.name.is_empty() {
            return Err(GraphError::UnnamedStage { index });
        }
        if names.insert(&stage.name, index).is_some() {
            return Err(GraphError::DuplicateStage {
                name: stage.name.clone(),
            });
        }
        if stage.num_tasks == 0 {
            return Err(GraphError::NoTasks {
                stage: stage.name.clone(),
            });
        }
        for tag in &stage.requires {
            crate::tags::check(tag).map_err(|source| GraphError::InvalidTag {
                stage: stage.name.clone(),
                source,
            })?;
        }
        if !stage.partitions.is_empty() && stage.partitions.len() != stage.num_tasks as usize {
            return Err(GraphError::PartitionCount {
                stage: stage.name.clone(),
                partitions: stage.partitions.len(),
                tasks: stage.num_tasks,
            });
        }
        if !modules.contains(stage.module_hash.as_str()) {
            return Err(GraphError::UnknownModule {
                stage: stage.name.clone(),
                hash: stage.module_hash.clone(),
            });
        }
        for input in &stage.inputs {
            let Some(upstream) = spec
                .stages
                .get(input.stage as usize)
                .filter(|_| (input.stage as usize) < index)
            else {
                return Err(GraphError::ForwardInput {
                    stage: stage.name.clone(),
                    input: input.stage,
                });
            };
            match (input.pattern(), input.exchange.as_str()) {
                (Pattern::Shuffle, "") => {
                    return Err(GraphError::UnnamedExchange {
                        stage: stage.name.clone(),
                        input: upstream.name.clone(),
                    });
                }
                (Pattern::Shuffle, exchange) => {
                    if let Some(first) = exchanges.insert(exchange, &stage.name) {
                        return Err(GraphError::DuplicateExchange {
                            exchange: exchange.to_string(),
                            first: first.to_string(),
                            second: stage.name.clone(),
                        });
                    }
                }
                (_, "") => {}
                (pattern, exchange) => {
                    return Err(GraphError::ExchangeOnNonShuffle {
                        stage: stage.name.clone(),
                        exchange: exchange.to_string(),
                        input: upstream.name.clone(),
                        pattern: pattern.as_str_name(),
                    });
                }
            }
            if input.pattern() == Pattern::OneToOne && upstream.num_tasks != stage.num_tasks {
                return Err(GraphError::OneToOneMismatch {
                    stage: stage.name.clone(),
                    input: upstream.name.clone(),
                    tasks: stage.num_tasks,
                    input_tasks: upstream.num_tasks,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use wrk_proto::{Stage, StageInput};

    fn spec() -> JobSpec {
        let wasm = b"module".to_vec();
        let hash = content_hash(&wasm);
        JobSpec {
            name: "j".into(),
            modules: vec![Module {
                hash: hash.clone(),
                wasm,
                name: "m.wasm".into(),
            }],
            stages: vec![
                Stage {
                    name: "map".into(),
                    module_hash: hash.clone(),
                    num_tasks: 4,
                    ..Default::default()
                },
                Stage {
                    name: "reduce".into(),
                    module_hash: hash,
                    num_tasks: 1,
                    inputs: vec![StageInput {
                        stage: 0,
                        pattern: Pattern::All as i32,
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn a_valid_graph_passes() {
        assert_eq!(validate(&spec(), &HashSet::new()), Ok(()));
    }

    #[test]
    fn errors_name_the_stage() {
        let mut s = spec();
        s.stages[1].inputs[0].pattern = Pattern::OneToOne as i32;
        let err = validate(&s, &HashSet::new()).unwrap_err().to_string();
        assert!(
            err.contains("`reduce` maps one-to-one over stage `map`"),
            "{err}"
        );

        let mut s = spec();
        s.stages[0].inputs.push(StageInput {
            stage: 1,
            pattern: 0,
            ..Default::default()
        });
        let err = validate(&s, &HashSet::new()).unwrap_err().to_string();
        assert!(err.contains("`map` takes input from stage #1"), "{err}");

        let mut s = spec();
        s.stages[1].inputs[0].pattern = Pattern::Shuffle as i32;
        let err = validate(&s, &HashSet::new()).unwrap_err().to_string();
        assert!(
            err.contains(
                "stage `reduce` reads a shuffle input from stage `map` without an exchange name"
            ),
            "{err}"
        );
        s.stages[1].inputs[0].exchange = "by-key".into();
        assert_eq!(validate(&s, &HashSet::new()), Ok(()));
        s.stages.push(Stage {
            name: "again".into(),
            ..s.stages[1].clone()
        });
        let err = validate(&s, &HashSet::new()).unwrap_err().to_string();
        assert!(
            err.contains("exchange `by-key` is declared twice (by stages `reduce` and `again`)"),
            "{err}"
        );
        s.stages[2].inputs[0].pattern = Pattern::All as i32;
        let err = validate(&s, &HashSet::new()).unwrap_err().to_string();
        assert!(err.contains("only shuffle inputs have exchanges"), "{err}");

        let mut s = spec();
        s.modules[0].wasm.push(0);
        let err = validate(&s, &HashSet::new()).unwrap_err().to_string();
        assert!(
            err.contains("module `m.wasm` does not match its hash"),
            "{err}"
        );
    }
}

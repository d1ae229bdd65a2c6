//! The wasmtime engine that runs `wrk:task` components: pooling allocation, components compiled
//! once per content hash (cached in memory and on disk), per-task limits (epoch deadline, memory
//! cap) and the classification of every way a task can fail.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, Linker, Resource, types::ComponentItem};
use wasmtime::{
    Config, Enabled, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, Trap,
    UpdateDeadline,
};
use wasmtime_wasi::WasiCtxBuilder;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;

use crate::guest_api::bindings::{Task, TaskPre};
use crate::guest_api::{CopyStats, TaskInfo, TaskState, TaskTable, WIT_PACKAGE, WIT_VERSION};
use crate::limits::{MemoryLimitExceeded, MemoryLimiter};
use crate::store::TaskMemory;
use prometheus::{IntCounter, IntCounterVec};

/// How often the epoch advances; task deadlines are counted in these ticks.
const EPOCH_TICK: Duration = Duration::from_millis(10);
/// Guest stdout and stderr kept for error reports (a panic message, say).
const GUEST_OUTPUT_BYTES: usize = 64 * 1024;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Where compiled components are kept between runs; `None` keeps them in memory only.
    pub cache_dir: Option<PathBuf>,
    /// Tasks that may run at once on this engine (sizes the instance pool).
    pub max_concurrent_tasks: u32,
    pub default_task_memory: u64,
    pub default_task_timeout: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            cache_dir: None,
            max_concurrent_tasks: 16,
            default_task_memory: 1 << 30,
            default_task_timeout: Duration::from_secs(600),
        }
    }
}

/// Limits for one task attempt.
#[derive(Debug, Clone, Copy)]
pub struct TaskLimits {
    pub memory_bytes: u64,
    pub timeout: Duration,
}

/// Everything that can go wrong preparing or running a task; each names the module.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error("module `{module}` is not a valid wrk:task component: {detail}")]
    InvalidModule { module: String, detail: String },
    #[error(
        "module `{module}` was built against {found}, but this worker implements {WIT_PACKAGE}@{WIT_VERSION}: rebuild it with a compatible wrk-sdk"
    )]
    IncompatibleWit { module: String, found: String },
    #[error("module `{module}` does not match its hash: expected {expected}, got {actual}")]
    HashMismatch {
        module: String,
        expected: String,
        actual: String,
    },
    #[error("module `{module}` trapped: {trap}{}", guest_output_suffix(.guest_output))]
    Trap {
        module: String,
        trap: String,
        guest_output: String,
    },
    #[error("module `{module}` exceeded its time limit of {limit:?} and was stopped")]
    Timeout { module: String, limit: Duration },
    #[error("module `{module}` was stopped: its task was cancelled")]
    Cancelled { module: String },
    #[error("module `{module}` was stopped: {source}")]
    MemoryLimit {
        module: String,
        source: MemoryLimitExceeded,
    },
    #[error(
        "module `{module}` could not get memory while other tasks held it ({detail}); it may succeed when run again"
    )]
    GaveWay { module: String, detail: String },
    #[error("module `{module}` returned an error ({code}): {message}")]
    Guest {
        module: String,
        code: String,
        message: String,
    },
    #[error("the worker failed running module `{module}`: {detail}")]
    Host { module: String, detail: String },
}

impl TaskError {
    /// Whether another attempt may succeed.
    pub fn retriable(&self) -> bool {
        matches!(self, TaskError::GaveWay { .. })
    }
}

fn guest_output_suffix(output: &str) -> String {
    if output.trim().is_empty() {
        String::new()
    } else {
        format!("; guest output: {}", output.trim())
    }
}

/// The engine could not be set up (an impossible pool configuration, an unwritable cache).
#[derive(Debug, thiserror::Error)]
#[error("cannot start the WebAssembly engine: {0}")]
pub struct EngineError(String);

/// A component compiled and linked against the host, ready to instantiate cheaply.
pub struct CompiledTask {
    pre: TaskPre<TaskState>,
    pub name: String,
    pub hash: String,
}

/// What a successful task produced.
#[derive(Debug)]
pub struct TaskRun {
    /// Where the task left them: in host memory, or (on a GPU worker) on the device.
    pub outputs: Vec<TaskTable>,
    pub copies: CopyStats,
    pub guest_memory_peak: usize,
    /// Instantiation time (the compiled component was already at hand).
    pub instantiate: Duration,
    pub duration: Duration,
}

/// Advances the engine's epoch on a background thread until dropped.
struct EpochTicker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EpochTicker {
    fn start(engine: Engine) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("wrk-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    engine.increment_epoch();
                }
            })
            .ok();
        EpochTicker { stop, thread }
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Compiles, caches and runs task components.
pub struct TaskEngine {
    engine: Engine,
    linker: Linker<TaskState>,
    compiled: Mutex<HashMap<String, Arc<CompiledTask>>>,
    cache_dir: Option<PathBuf>,
    config: EngineConfig,
    /// Components prepared, by where they came from: `memory`, `disk` or `compiled`.
    cache_outcomes: IntCounterVec,
    /// Its `memory` series, counted at every task (resolved once).
    memory_hits: IntCounter,
    _ticker: EpochTicker,
}

/// Where compiled components are cached by default: `$WRK_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/wrk/components`, else `$HOME/.cache/wrk/components`.
pub fn default_cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("WRK_CACHE_DIR") {
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))?;
    Some(base.join("wrk").join("components"))
}

/// Lower-case hex SHA-256 of a module's bytes: its identity everywhere in `wrk`.
pub fn module_hash(wasm: &[u8]) -> String {
    hex::encode(Sha256::digest(wasm))
}

impl TaskEngine {
    pub fn new(config: EngineConfig) -> Result<Self, EngineError> {
        Self::build(config).map_err(|e| EngineError(format!("{e:#}")))
    }

    fn build(config: EngineConfig) -> wasmtime::Result<Self> {
        const DECOMMIT_BATCH: usize = 8;
        const KEEP_RESIDENT: usize = 1 << 20;
        let mut pool = PoolingAllocationConfig::default();
        let components = config.max_concurrent_tasks.max(1) * 2 + 4 + DECOMMIT_BATCH as u32;
        pool.total_component_instances(components)
            .total_core_instances(components * 16)
            .total_memories(components * 4)
            .total_tables(components * 8)
            .max_memory_size(config.default_task_memory.max(64 << 20) as usize * 4)
            // Returning a finished task's memory to the OS flushes the TLB of every core; doing
            // it for several instances at once costs one flush instead of one per task (+13%
            // no-op tasks/s). Up to this many finished guests' memories stay resident meanwhile:
            // guests are small, their data lives in the host.
            .decommit_batch_size(DECOMMIT_BATCH)
            // A finished guest's dirty pages (found with the PAGEMAP_SCAN ioctl where the kernel
            // has it, Linux 6.7+) are reset with memset up to this many bytes instead of being
            // returned to the OS: the next task in the slot takes no page faults and nothing is
            // decommitted (no TLB flush). A no-op task dirties about four pages.
            .linear_memory_keep_resident(KEEP_RESIDENT)
            .table_keep_resident(KEEP_RESIDENT)
            .pagemap_scan(Enabled::Auto);
        let mut wasm_config = Config::new();
        wasm_config
            .wasm_component_model(true)
            .epoch_interruption(true)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&wasm_config)?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
        Task::add_to_linker::<TaskState, wasmtime::component::HasSelf<TaskState>>(
            &mut linker,
            |s| s,
        )?;
        let cache_dir = match &config.cache_dir {
            Some(dir) => {
                let mut hasher = DefaultHasher::new();
                engine.precompile_compatibility_hash().hash(&mut hasher);
                let dir = dir.join(format!("{:016x}", hasher.finish()));
                std::fs::create_dir_all(&dir).map_err(wasmtime::Error::new)?;
                Some(dir)
            }
            None => None,
        };
        let cache_outcomes = crate::metrics::compile_cache_counter();
        Ok(TaskEngine {
            _ticker: EpochTicker::start(engine.clone()),
            engine,
            linker,
            compiled: Mutex::new(HashMap::new()),
            cache_dir,
            config,
            memory_hits: cache_outcomes.with_label_values(&["memory"]),
            cache_outcomes,
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Where this engine keeps compiled components on disk, if anywhere.
    pub fn cache_dir(&self) -> Option<&Path> {
        self.cache_dir.as_deref()
    }

    /// The compiled component for `hash`, if this engine already has it in memory.
    pub fn cached(&self, hash: &str) -> Option<Arc<CompiledTask>> {
        let found = self.compiled.lock().ok()?.get(hash).cloned();
        if found.is_some() {
            self.memory_hits.inc();
        }
        found
    }

    /// The counter of compile-cache outcomes, for the worker's metrics.
    pub fn cache_outcomes(&self) -> IntCounterVec {
        self.cache_outcomes.clone()
    }

    fn count_cache(&self, outcome: &str) {
        self.cache_outcomes.with_label_values(&[outcome]).inc();
    }

    /// Compiles `wasm` (or loads it from the disk cache) and links it; once per content hash.
    pub fn prepare(
        &self,
        name: &str,
        hash: &str,
        wasm: &[u8],
    ) -> Result<Arc<CompiledTask>, TaskError> {
        if let Some(done) = self.cached(hash) {
            return Ok(done);
        }
        let actual = module_hash(wasm);
        if actual != hash {
            return Err(TaskError::HashMismatch {
                module: name.to_string(),
                expected: hash.to_string(),
                actual,
            });
        }
        let invalid = |detail: String| TaskError::InvalidModule {
            module: name.to_string(),
            detail,
        };
        let component = self
            .load_component(hash, wasm)
            .map_err(|e| invalid(format!("{e:#}")))?;
        self.check_wit_version(name, &component)?;
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| invalid(format!("{e:#}")))?;
        let pre = TaskPre::new(pre).map_err(|e| invalid(format!("{e:#}")))?;
        let compiled = Arc::new(CompiledTask {
            pre,
            name: name.to_string(),
            hash: hash.to_string(),
        });
        if let Ok(mut map) = self.compiled.lock() {
            map.insert(hash.to_string(), compiled.clone());
        }
        Ok(compiled)
    }

    fn load_component(&self, hash: &str, wasm: &[u8]) -> wasmtime::Result<Component> {
        let Some(dir) = &self.cache_dir else {
            self.count_cache("compiled");
            return Component::new(&self.engine, wasm);
        };
        let path = dir.join(format!("{hash}.cwasm"));
        // Read, not mapped: a mapped artifact that someone truncates or rewrites under a running
        // worker (a shared cache, a cleanup) would crash the process with SIGBUS.
        if let Ok(bytes) = std::fs::read(&path) {
            // SAFETY: the bytes come from a file written by `serialize` of an engine with the same
            // compatibility hash (it is in the directory named after it), in a cache directory
            // owned by the worker; deserialization checks the header and engine settings, and a
            // damaged file fails it and is rebuilt below.
            match unsafe { Component::deserialize(&self.engine, &bytes) } {
                Ok(component) => {
                    self.count_cache("disk");
                    return Ok(component);
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), "discarding unreadable compiled component: {e:#}")
                }
            }
        }
        let component = Component::new(&self.engine, wasm)?;
        self.count_cache("compiled");
        if let Err(e) = self.store_compiled(&path, &component) {
            tracing::warn!(path = %path.display(), "cannot cache compiled component: {e:#}");
        }
        Ok(component)
    }

    fn store_compiled(&self, path: &Path, component: &Component) -> wasmtime::Result<()> {
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let bytes = component.serialize()?;
        // Unique per writer: several workers may share one cache directory.
        let partial = path.with_extension(format!(
            "partial-{}-{}",
            std::process::id(),
            WRITES.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&partial, bytes).map_err(wasmtime::Error::new)?;
        std::fs::rename(&partial, path).map_err(wasmtime::Error::new)?;
        Ok(())
    }

    /// Rejects components built against an incompatible `wrk:task` version with a clear message
    /// (semver: same major, or same minor while the major is 0).
    fn check_wit_version(&self, name: &str, component: &Component) -> Result<(), TaskError> {
        let ty = component.component_type();
        for (import, item) in ty.imports(&self.engine) {
            if !matches!(item.ty, ComponentItem::ComponentInstance(_)) {
                continue;
            }
            let Some(rest) = import.strip_prefix(&format!("{WIT_PACKAGE}/")) else {
                continue;
            };
            let version = rest.split_once('@').map(|(_, v)| v).unwrap_or("");
            if !compatible_version(version, WIT_VERSION) {
                return Err(TaskError::IncompatibleWit {
                    module: name.to_string(),
                    found: format!(
                        "{WIT_PACKAGE}@{}",
                        if version.is_empty() {
                            "(unversioned)"
                        } else {
                            version
                        }
                    ),
                });
            }
        }
        Ok(())
    }

    /// Runs one task attempt in a fresh store, its tables counted in `memory`. Blocking: call
    /// it from a blocking thread. Setting `cancel` stops the guest within an epoch tick.
    pub fn run(
        &self,
        compiled: &CompiledTask,
        info: Arc<TaskInfo>,
        inputs: Vec<TaskTable>,
        limits: TaskLimits,
        cancel: Arc<AtomicBool>,
        memory: Arc<TaskMemory>,
    ) -> Result<TaskRun, TaskError> {
        let started = Instant::now();
        let module = compiled.name.clone();
        let host_err = |e: wasmtime::Error| TaskError::Host {
            module: module.clone(),
            detail: format!("{e:#}"),
        };
        let output = MemoryOutputPipe::new(GUEST_OUTPUT_BYTES);
        let wasi = WasiCtxBuilder::new()
            .stdout(output.clone())
            .stderr(output.clone())
            .build();
        let memory_limit = usize::try_from(limits.memory_bytes).unwrap_or(usize::MAX);
        let mut store = Store::new(
            &self.engine,
            TaskState::new(info, wasi, MemoryLimiter::new(memory_limit), memory),
        );
        store.limiter(|state| &mut state.limiter);
        // Every tick: stop a cancelled task, interrupt one past its time limit, else go on.
        let deadline = started + limits.timeout;
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(move |_| {
            if cancel.load(Ordering::Relaxed) {
                return Err(wasmtime::Error::new(Cancelled));
            }
            if Instant::now() >= deadline {
                return Ok(UpdateDeadline::Interrupt);
            }
            Ok(UpdateDeadline::Continue(1))
        });

        let classify = |e: wasmtime::Error, store: &Store<TaskState>| {
            classify_failure(e, &module, limits.timeout, store.data().limiter, &output)
        };
        let task = match compiled.pre.instantiate(&mut store) {
            Ok(task) => task,
            Err(e) => return Err(classify(e, &store)),
        };
        let instantiate = started.elapsed();
        let handles = inputs
            .into_iter()
            .map(|table| store.data_mut().table.push(table))
            .collect::<Result<Vec<Resource<TaskTable>>, _>>()
            .map_err(|e| host_err(e.into()))?;
        let returned = match task.call_run(&mut store, &handles) {
            Ok(returned) => returned,
            Err(e) => return Err(classify(e, &store)),
        };
        let handles = returned.map_err(|e| match store.data_mut().gave_way.take() {
            // The guest failed after the pool turned it away for other tasks' sake.
            Some(detail) => TaskError::GaveWay {
                module: module.clone(),
                detail,
            },
            None => TaskError::Guest {
                module: module.clone(),
                code: format!("{:?}", e.code).to_lowercase(),
                message: e.message,
            },
        })?;
        let state = store.data_mut();
        // Outputs go to the store where they are: a device table stays on the device.
        let outputs = handles
            .into_iter()
            .map(|handle| state.table.delete(handle).map_err(|e| host_err(e.into())))
            .collect::<Result<Vec<TaskTable>, _>>()?;
        Ok(TaskRun {
            outputs,
            copies: state.copies,
            guest_memory_peak: state.limiter.peak,
            instantiate,
            duration: started.elapsed(),
        })
    }
}

/// The error a cancelled task's guest is stopped with.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the task was cancelled")]
struct Cancelled;

fn classify_failure(
    error: wasmtime::Error,
    module: &str,
    timeout: Duration,
    limiter: MemoryLimiter,
    output: &MemoryOutputPipe,
) -> TaskError {
    let module = module.to_string();
    if error.downcast_ref::<Cancelled>().is_some()
        || error
            .chain()
            .any(|e| e.downcast_ref::<Cancelled>().is_some())
    {
        return TaskError::Cancelled { module };
    }
    let exceeded = error.downcast_ref::<MemoryLimitExceeded>().or_else(|| {
        error
            .chain()
            .find_map(|e| e.downcast_ref::<MemoryLimitExceeded>())
    });
    if let Some(exceeded) = exceeded {
        return TaskError::MemoryLimit {
            module,
            source: *exceeded,
        };
    }
    let guest_output = tail(&output.contents());
    let trap = error
        .downcast_ref::<Trap>()
        .or_else(|| error.chain().find_map(|e| e.downcast_ref::<Trap>()));
    match trap {
        Some(Trap::Interrupt) => TaskError::Timeout {
            module,
            limit: timeout,
        },
        Some(trap) => {
            // The guest's allocator aborts when memory.grow fails at the pool's hard cap.
            let near_cap = limiter.peak + (64 << 20) >= limiter.memory_limit;
            if *trap == Trap::UnreachableCodeReached && near_cap && guest_output.is_empty() {
                return TaskError::MemoryLimit {
                    module,
                    source: MemoryLimitExceeded {
                        requested: limiter.peak,
                        limit: limiter.memory_limit,
                    },
                };
            }
            TaskError::Trap {
                module,
                trap: trap.to_string(),
                guest_output,
            }
        }
        None => TaskError::Trap {
            module,
            trap: format!("{error:#}"),
            guest_output,
        },
    }
}

/// The last few lines a guest printed, without Rust's hint about backtraces (a guest has none).
fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text: Vec<&str> = text
        .lines()
        .filter(|line| !line.starts_with("note: run with `RUST_BACKTRACE=1`"))
        .collect();
    let text = text.join("\n");
    let start = text.len().saturating_sub(2000);
    let start = (start..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len());
    text[start..].trim().to_string()
}

/// Whether a component built against `found` runs on a host implementing `ours`.
fn compatible_version(found: &str, ours: &str) -> bool {
    let parse = |v: &str| -> Option<(u64, u64)> {
        let mut parts = v.split('.');
        Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
    };
    match (parse(found), parse(ours)) {
        (Some((0, found_minor)), Some((0, our_minor))) => found_minor == our_minor,
        (Some((found_major, _)), Some((our_major, _))) => found_major == our_major,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn semver_compatibility_of_wit_versions() {
        assert!(compatible_version("0.1.0", "0.1.0"));
        assert!(compatible_version("0.1.7", "0.1.0"));
        assert!(!compatible_version("0.2.0", "0.1.0"));
        assert!(!compatible_version("1.0.0", "0.1.0"));
        assert!(!compatible_version("", "0.1.0"));
        assert!(compatible_version("1.4.0", "1.0.0"));
    }

    #[test]
    fn garbage_bytes_are_an_invalid_module_naming_it() {
        let engine = TaskEngine::new(EngineConfig::default()).unwrap();
        let wasm = b"\0asm definitely not a component";
        let err = match engine.prepare("broken.wasm", &module_hash(wasm), wasm) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("garbage compiled"),
        };
        assert!(
            err.contains("module `broken.wasm` is not a valid wrk:task component"),
            "{err}"
        );
    }

    #[test]
    fn hash_mismatch_is_reported() {
        let engine = TaskEngine::new(EngineConfig::default()).unwrap();
        let err = match engine.prepare("m.wasm", "00", b"abc") {
            Err(e) => e.to_string(),
            Ok(_) => panic!("accepted a wrong hash"),
        };
        assert!(err.contains("does not match its hash"), "{err}");
    }
}

//! The task engine with real components: the on-disk cache of compiled components, and explicit
//! copies counted in a task's statistics.

use std::sync::Arc;
use std::time::Duration;

use crate::common::guest;
use wrk_host::engine::{EngineConfig, TaskEngine, TaskLimits, module_hash};
use wrk_host::guest_api::TaskInfo;
use wrk_host::memory::SpillDir;
use wrk_host::store::{PartitionStore, TaskMemory};

fn engine(cache: &std::path::Path) -> TaskEngine {
    TaskEngine::new(EngineConfig {
        cache_dir: Some(cache.to_path_buf()),
        ..EngineConfig::default()
    })
    .unwrap()
}

/// A task's share of a 1 GiB pool spilling under `dir`.
fn task_memory(dir: &std::path::Path) -> Arc<TaskMemory> {
    let spill = SpillDir::open(dir, "engine-test").unwrap();
    Arc::new(PartitionStore::new(1 << 30, spill)).begin_task("test")
}

fn limits() -> TaskLimits {
    TaskLimits {
        memory_bytes: 64 << 20,
        timeout: Duration::from_secs(30),
    }
}

#[test]
fn compiled_components_are_cached_on_disk_and_damaged_entries_are_rebuilt() {
    let wasm = std::fs::read(guest("noop")).unwrap();
    let hash = module_hash(&wasm);
    let cache = tempfile::tempdir().unwrap();

    let first = engine(cache.path());
    first.prepare("noop.wasm", &hash, &wasm).unwrap();
    let dir = first.cache_dir().unwrap().to_path_buf();
    let cached = dir.join(format!("{hash}.cwasm"));
    assert!(cached.is_file(), "compiling writes {}", cached.display());
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().contains("partial"))
        .collect();
    assert!(leftovers.is_empty(), "no partial files left: {leftovers:?}");

    // A second engine (another worker, or a restart) loads the artifact instead of compiling.
    let modified = std::fs::metadata(&cached).unwrap().modified().unwrap();
    let second = engine(cache.path());
    let compiled = second.prepare("noop.wasm", &hash, &wasm).unwrap();
    assert_eq!(
        std::fs::metadata(&cached).unwrap().modified().unwrap(),
        modified,
        "reused, not rewritten"
    );
    let run = second
        .run(
            &compiled,
            Arc::new(TaskInfo::default()),
            vec![],
            limits(),
            Default::default(),
            task_memory(cache.path()),
        )
        .unwrap();
    assert!(run.outputs.is_empty());

    // A damaged artifact is discarded and rebuilt, not trusted.
    std::fs::write(&cached, b"not a compiled component").unwrap();
    let third = engine(cache.path());
    let compiled = third.prepare("noop.wasm", &hash, &wasm).unwrap();
    third
        .run(
            &compiled,
            Arc::new(TaskInfo::default()),
            vec![],
            limits(),
            Default::default(),
            task_memory(cache.path()),
        )
        .unwrap();
    assert!(
        std::fs::metadata(&cached).unwrap().len() > 1000,
        "the artifact was rewritten"
    );
}

/// Replaces every occurrence of `from` by `to` (same length, so the component stays well formed).
fn patch(bytes: &[u8], from: &[u8], to: &[u8]) -> (Vec<u8>, usize) {
    assert_eq!(from.len(), to.len());
    let mut out = bytes.to_vec();
    let mut count = 0;
    let mut i = 0;
    while i + from.len() <= out.len() {
        if &out[i..i + from.len()] == from {
            out[i..i + from.len()].copy_from_slice(to);
            count += 1;
            i += from.len();
        } else {
            i += 1;
        }
    }
    (out, count)
}

#[test]
fn components_built_against_an_incompatible_wit_version_are_refused_by_name() {
    let wasm = std::fs::read(guest("noop")).unwrap();
    // The same component, as if built against wrk:task@0.2.0.
    let (newer, count) = patch(
        &wasm,
        b"wrk:task/dataframe@0.1.0",
        b"wrk:task/dataframe@0.2.0",
    );
    assert!(count > 0, "the component imports wrk:task/dataframe@0.1.0");
    let (newer, _) = patch(&newer, b"wrk:task/types@0.1.0", b"wrk:task/types@0.2.0");
    let engine = TaskEngine::new(EngineConfig::default()).unwrap();
    let err = match engine.prepare("newer.wasm", &module_hash(&newer), &newer) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a component built against wrk:task@0.2.0 was accepted"),
    };
    assert!(
        err.contains("module `newer.wasm` was built against wrk:task@0.2.0")
            && err.contains("implements wrk:task@0.1.0"),
        "{err}"
    );
    // A patch release of the same minor is compatible.
    let (patch_release, _) = patch(&wasm, b"@0.1.0", b"@0.1.9");
    engine
        .prepare("patched.wasm", &module_hash(&patch_release), &patch_release)
        .map(|_| ())
        .unwrap_or_else(|e| panic!("wrk:task@0.1.9 should be accepted: {e}"));
}

/// Guests' memory slots are reused with their dirty pages reset in place (not returned to the
/// OS): every task must still start from the component's initial memory.
#[test]
fn each_task_starts_from_fresh_guest_memory_in_a_reused_slot() {
    let wasm = std::fs::read(guest("test-guest-memory")).unwrap();
    let engine = TaskEngine::new(EngineConfig {
        max_concurrent_tasks: 1,
        ..EngineConfig::default()
    })
    .unwrap();
    let compiled = engine
        .prepare("memory.wasm", &module_hash(&wasm), &wasm)
        .unwrap();
    let spill = tempfile::tempdir().unwrap();
    let info = Arc::new(TaskInfo {
        stage_name: "fresh".into(),
        ..TaskInfo::default()
    });
    for attempt in 0..40 {
        let run = engine.run(
            &compiled,
            info.clone(),
            vec![],
            limits(),
            Default::default(),
            task_memory(spill.path()),
        );
        if let Err(e) = run {
            panic!("task {attempt}: {e}");
        }
    }
}

#[test]
fn a_cancelled_task_stops_within_moments() {
    let wasm = std::fs::read(guest("test-guest-spin")).unwrap();
    let engine = TaskEngine::new(EngineConfig::default()).unwrap();
    let compiled = engine
        .prepare("spin.wasm", &module_hash(&wasm), &wasm)
        .unwrap();
    let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = cancel.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        flag.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let started = std::time::Instant::now();
    let long = TaskLimits {
        memory_bytes: 64 << 20,
        timeout: Duration::from_secs(60),
    };
    let spill = tempfile::tempdir().unwrap();
    let err = engine
        .run(
            &compiled,
            Arc::new(TaskInfo::default()),
            vec![],
            long,
            cancel,
            task_memory(spill.path()),
        )
        .expect_err("a looping guest does not finish");
    assert!(
        err.to_string()
            .contains("module `spin.wasm` was stopped: its task was cancelled"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "stopped after {:?}",
        started.elapsed()
    );
}

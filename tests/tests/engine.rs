//! The task engine with real components: the on-disk cache of compiled components, and explicit
//! copies counted in a task's statistics.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::guest;
use wrk_host::engine::{EngineConfig, TaskEngine, TaskLimits, module_hash};
use wrk_host::guest_api::TaskInfo;

fn engine(cache: &std::path::Path) -> TaskEngine {
    TaskEngine::new(EngineConfig {
        cache_dir: Some(cache.to_path_buf()),
        ..EngineConfig::default()
    })
    .unwrap()
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
        .run(&compiled, Arc::new(TaskInfo::default()), vec![], limits())
        .unwrap();
    assert!(run.outputs.is_empty());

    // A damaged artifact is discarded and rebuilt, not trusted.
    std::fs::write(&cached, b"not a compiled component").unwrap();
    let third = engine(cache.path());
    let compiled = third.prepare("noop.wasm", &hash, &wasm).unwrap();
    third
        .run(&compiled, Arc::new(TaskInfo::default()), vec![], limits())
        .unwrap();
    assert!(
        std::fs::metadata(&cached).unwrap().len() > 1000,
        "the artifact was rewritten"
    );
}

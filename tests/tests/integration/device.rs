//! `wrk worker --device`: a worker asked for a GPU it cannot have exits at start with a clear
//! error; `auto` registers with the device it found (the CPU on a machine without a GPU) and
//! `wrk status` shows it.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::{Processes, has_gpu, start_scheduler, wait_for_workers, worker_command, wrk};

/// Runs `wrk worker` with `args` and `env` against an address nothing listens on; returns its
/// exit status and stderr once it exits (a worker that starts keeps retrying the scheduler).
fn worker_start(args: &[&str], env: &[(&str, &str)]) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(wrk())
        .args([
            "worker",
            "--scheduler",
            "http://127.0.0.1:9",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(args)
        .env_remove("WRK_DEVICE")
        .envs(env.iter().copied())
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start wrk worker");
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait for the worker") {
            let output = child.wait_with_output().expect("worker output");
            return (status, String::from_utf8_lossy(&output.stderr).into_owned());
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the worker with {args:?} {env:?} did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_worker_asked_for_a_missing_gpu_exits_with_a_clear_error() {
    if has_gpu() {
        println!("SKIPPED the missing-GPU check: this machine has a GPU");
        return;
    }
    for (args, env) in [
        (vec!["--device", "gpu:0"], vec![]),
        (vec![], vec![("WRK_DEVICE", "cuda")]),
    ] {
        let (status, stderr) = worker_start(&args, &env);
        assert!(!status.success(), "{args:?} {env:?}: {stderr}");
        assert!(
            stderr.contains("--device gpu:0 was asked for but no GPU can be used"),
            "{args:?} {env:?}: {stderr}"
        );
        assert!(
            stderr.contains("libcuda.so"),
            "the reason is given: {stderr}"
        );
    }
    let (status, stderr) = worker_start(&["--device", "gpu:x"], &[]);
    assert!(!status.success());
    assert!(stderr.contains("expected `cpu`, `gpu:N`"), "{stderr}");
}

#[test]
fn auto_and_cpu_workers_register_with_their_device() {
    let mut processes = Processes(Vec::new());
    let scheduler = start_scheduler(&mut processes, &["--heartbeat-ms", "100"], &[]);
    // The emulated GPU runs the GPU start-up (kernels, pool, self-test against the CPU
    // backend) on the CUDA emulator; it needs a C++ compiler.
    let emulated = wrk_host::gpu::emulator::compiler_present();
    let mut workers = vec![("auto-worker", "auto"), ("cpu-worker", "cpu")];
    if emulated {
        workers.push(("emulated-worker", "emulated-gpu"));
    } else {
        println!("SKIPPED the emulated-gpu worker: no C++ compiler (`c++` or $CXX)");
    }
    for (id, device) in &workers {
        let child = worker_command(&scheduler.url, id, &["--device", device])
            .env("WRK_LOG", "info")
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start wrk worker");
        processes.0.push(child);
    }
    wait_for_workers(&scheduler.url, workers.len(), None);
    let output = Command::new(wrk())
        .args(["status", "--scheduler", &scheduler.url, "--output", "json"])
        .env_remove("WRK_TOKEN")
        .output()
        .expect("wrk status");
    let status: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON status");
    let device = |id: &str| {
        status["workers"]
            .as_array()
            .expect("workers")
            .iter()
            .find(|w| w["id"] == id)
            .unwrap_or_else(|| panic!("{id} in {status}"))
            .clone()
    };
    assert_eq!(device("cpu-worker")["device"], "cpu");
    assert!(device("cpu-worker")["gpu"].is_null());
    let auto = device("auto-worker");
    if has_gpu() {
        assert_eq!(auto["device"], "gpu:0");
        assert!(auto["gpu"]["name"].as_str().is_some_and(|n| !n.is_empty()));
    } else {
        assert_eq!(auto["device"], "cpu", "{auto}");
        assert!(auto["gpu"].is_null());
    }
    if emulated {
        let worker = device("emulated-worker");
        assert_eq!(worker["device"], "emulated-gpu", "{worker}");
        assert_eq!(
            worker["gpu"]["name"], "CUDA emulator (host CPU)",
            "{worker}"
        );
        assert!(
            worker["gpu"]["device_pool_bytes"]
                .as_u64()
                .is_some_and(|b| b > 0)
        );
    }
    // The dashboard's worker list carries the same device.
    let (_, body) = crate::common::http_get(&scheduler.http, "/api/workers");
    assert!(body.contains("\"device\":\"cpu\""), "{body}");
}

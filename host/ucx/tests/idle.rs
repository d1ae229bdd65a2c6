//! An idle `Ucx` sleeps on its event fd instead of busy-polling: its progress threads use almost
//! no CPU while nothing is sent, and still wake up at once for the next message.
//! (Alone in its test binary: it measures every `ucx-progress` thread of the process.)

use std::time::{Duration, Instant};

use bytes::Bytes;
use wrk_ucx::{Ucx, UcxConfig};

/// CPU time (user + system, in clock ticks) of this process's UCX progress threads.
fn progress_threads_cpu_ticks() -> u64 {
    let mut ticks = 0;
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let path = task.unwrap().path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if comm.trim() != "ucx-progress" {
            continue;
        }
        let stat = std::fs::read_to_string(path.join("stat")).unwrap();
        // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let fields: Vec<&str> = after.split(' ').collect();
        ticks += fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    }
    ticks
}

async fn idle_check(transports: Option<&str>) {
    let config = UcxConfig {
        transports: transports.map(str::to_string),
        ..UcxConfig::default()
    };
    let (a, _a_in) = Ucx::start(config.clone()).unwrap();
    let (b, mut b_in) = Ucx::start(config).unwrap();
    a.send(
        b.address(),
        b"warm".to_vec(),
        Bytes::from(vec![1u8; 1 << 20]),
    )
    .await
    .unwrap();
    b_in.recv().await.unwrap();

    let before = progress_threads_cpu_ticks();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let used = progress_threads_cpu_ticks() - before;
    // Two busy-polling threads would use about 2 x 200 ticks (USER_HZ = 100) in 2 s.
    assert!(used <= 20, "idle progress threads used {used} ticks in 2 s");

    let started = Instant::now();
    a.send(b.address(), b"wake".to_vec(), Bytes::from_static(b"x"))
        .await
        .unwrap();
    let message = b_in.recv().await.unwrap();
    assert_eq!(message.header, b"wake");
    assert!(
        started.elapsed() < Duration::from_millis(50),
        "wake-up took {:?}",
        started.elapsed()
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_workers_sleep_and_wake_up() {
    idle_check(None).await;
    idle_check(Some("tcp")).await;
}

//! Two processes: this test binary re-runs itself as a child receiver (selected by an environment
//! variable) and the parent sends it 1 GiB in 4 MiB messages; both sides checksum the stream.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use wrk_ucx::{Ucx, UcxConfig};

const CHILD_ENV: &str = "WRK_UCX_TEST_RECEIVER";
const TOTAL: usize = 1 << 30;
const CHUNK: usize = 4 << 20;
const COUNT: u64 = (TOTAL / CHUNK) as u64;

fn config(transports: Option<&str>) -> UcxConfig {
    UcxConfig {
        transports: transports.map(str::to_string),
        send_timeout: Some(Duration::from_secs(60)),
        ..UcxConfig::default()
    }
}

/// Kills the child if the parent fails before it finished.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The receiving side, in the child process: prints its address, receives COUNT messages in
/// order, prints the checksum.
async fn receiver(transports: Option<&str>) {
    let (ucx, mut incoming) = Ucx::start(config(transports)).unwrap();
    let hex: String = ucx.address().iter().map(|b| format!("{b:02x}")).collect();
    let mut out = std::io::stdout().lock();
    writeln!(out, "ADDR {hex}").unwrap();
    out.flush().unwrap();
    drop(out);
    let mut sum = 0u64;
    let mut bytes = 0usize;
    for index in 0..COUNT {
        let message = tokio::time::timeout(Duration::from_secs(60), incoming.recv())
            .await
            .expect("message within 60 s")
            .expect("receiver running");
        assert_eq!(message.header, index.to_le_bytes(), "out of order");
        bytes += message.payload.len();
        sum = common::checksum(sum, &message.payload);
    }
    println!("SUM {sum:016x} {bytes}");
    ucx.shutdown().await;
}

async fn one_gib(test_name: &str, transports: Option<&str>) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    if std::env::var_os(CHILD_ENV).is_some() {
        receiver(transports).await;
        return;
    }
    let child = Command::new(std::env::current_exe().unwrap())
        .args([test_name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = ChildGuard(child);
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let next_line = |lines: &mut std::io::Lines<BufReader<std::process::ChildStdout>>,
                     prefix: &str| loop {
        let line = lines.next().expect("child output").unwrap();
        // The test harness may print its own text before ours on the same line.
        if let Some((_, rest)) = line.split_once(prefix) {
            return rest.to_string();
        }
    };
    let hex = next_line(&mut lines, "ADDR ");
    let peer: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();

    let (ucx, _incoming) = Ucx::start(config(transports)).unwrap();
    let chunks: Vec<_> = (0..COUNT).map(|i| common::pattern(i, CHUNK)).collect();
    let expected = chunks
        .iter()
        .fold(0u64, |sum, chunk| common::checksum(sum, chunk));
    let started = Instant::now();
    let results: Vec<_> = futures::stream::iter(chunks.into_iter().enumerate())
        .map(|(i, chunk)| ucx.send(&peer, (i as u64).to_le_bytes().to_vec(), chunk))
        .buffered(8)
        .collect()
        .await;
    for result in results {
        result.unwrap();
    }
    let reported = tokio::task::spawn_blocking(move || {
        let sum = next_line(&mut lines, "SUM ");
        // Keep reading to the end, so the child's last writes do not fail.
        while lines.next().is_some() {}
        sum
    })
    .await
    .unwrap();
    let elapsed = started.elapsed();
    eprintln!(
        "{test_name}: 1 GiB in {elapsed:?} = {:.2} GB/s",
        TOTAL as f64 / elapsed.as_secs_f64() / 1e9
    );
    assert_eq!(
        reported,
        format!("{expected:016x} {TOTAL}"),
        "checksum or size differs"
    );
    assert!(child.0.wait().unwrap().success());
    ucx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gib_between_processes_default_transports() {
    one_gib("one_gib_between_processes_default_transports", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gib_between_processes_over_tcp() {
    one_gib("one_gib_between_processes_over_tcp", Some("tcp")).await;
}

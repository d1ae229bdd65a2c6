//! Throughput of the UCX layer between two processes: the parent sends `--bytes` in messages of
//! `--chunk` bytes (at most `--window` in flight) to a child process started from this same
//! binary, `--runs` times, and prints GB/s per run and the median.
//!
//! ```text
//! cargo run --release -p wrk-ucx --example ucx_bench -- --bytes 1073741824 --chunk 4194304
//! UCX_TLS=tcp cargo run --release -p wrk-ucx --example ucx_bench
//! ```
//!
//! Transport selection comes from `UCX_TLS` in the environment (both processes inherit it), or
//! `--tls`. A run is timed from the first send to the child's report that every byte arrived.
//!
//! `--segments N` sends each message as N large segments, each behind a 64-byte one (the shape
//! of an Arrow IPC stream), with `Ucx::send_segments`; `--part-threshold BYTES` sets
//! `UcxConfig::part_threshold` (without it a message goes whole, its segments as one I/O vector).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use wrk_ucx::{Ucx, UcxConfig};

const CHILD_ENV: &str = "WRK_UCX_BENCH_RECEIVER";

#[derive(Clone)]
struct Args {
    bytes: u64,
    chunk: usize,
    window: usize,
    runs: usize,
    tls: Option<String>,
    segments: usize,
    part_threshold: Option<usize>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        bytes: 1 << 30,
        chunk: 4 << 20,
        window: 8,
        runs: 5,
        tls: None,
        segments: 1,
        part_threshold: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<u64>()
                .map_err(|e| format!("{flag} {value}: {e}"))
        };
        match flag.as_str() {
            "--bytes" => args.bytes = number()?,
            "--chunk" => args.chunk = number()? as usize,
            "--window" => args.window = number()? as usize,
            "--runs" => args.runs = number()? as usize,
            "--tls" => args.tls = Some(value.clone()),
            "--segments" => args.segments = number()? as usize,
            "--part-threshold" => args.part_threshold = Some(number()? as usize),
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    if args.chunk == 0 || args.window == 0 || args.runs == 0 || args.segments == 0 {
        return Err("--chunk, --window, --runs and --segments must be positive".into());
    }
    Ok(args)
}

fn config(args: &Args) -> UcxConfig {
    UcxConfig {
        transports: args.tls.clone(),
        part_threshold: args.part_threshold,
        ..UcxConfig::default()
    }
}

/// `payload` as `segments` large segments, each behind a 64-byte one (fewer when it is short).
fn split(payload: Bytes, segments: usize) -> Vec<Bytes> {
    if segments == 1 {
        return vec![payload];
    }
    let step = payload.len().div_ceil(segments).max(1);
    let mut out = Vec::with_capacity(2 * segments);
    let mut at = 0;
    while at < payload.len() {
        let end = (at + step).min(payload.len());
        let small = (at + 64).min(end);
        out.push(payload.slice(at..small));
        out.push(payload.slice(small..end));
        at = end;
    }
    out
}

/// Child: prints its address, then for each run prints `DONE <bytes>` once that many arrived.
async fn receiver(args: Args) -> Result<(), String> {
    let (ucx, mut incoming) = Ucx::start(config(&args)).map_err(|e| e.to_string())?;
    let hex: String = ucx.address().iter().map(|b| format!("{b:02x}")).collect();
    let mut out = std::io::stdout();
    writeln!(out, "ADDR {hex}").map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    for _ in 0..args.runs {
        let mut got = 0u64;
        while got < args.bytes {
            let message = incoming.recv().await.ok_or("UCX layer stopped")?;
            got += message.payload.len() as u64;
        }
        writeln!(out, "DONE {got}").map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
    }
    ucx.shutdown().await;
    Ok(())
}

async fn sender(args: Args) -> Result<(), String> {
    let mut child = Command::new(std::env::current_exe().map_err(|e| e.to_string())?)
        .args(std::env::args().skip(1))
        .env(CHILD_ENV, "1")
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let stdout = child.stdout.take().ok_or("child has no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let mut read_line = move || -> Result<String, String> {
        match lines.next() {
            Some(line) => line.map_err(|e| e.to_string()),
            None => Err("child exited early".into()),
        }
    };
    let first = read_line()?;
    let hex = first
        .strip_prefix("ADDR ")
        .ok_or(format!("unexpected child output {first}"))?;
    let peer = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2).unwrap_or("zz"), 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|e| e.to_string())?;

    let (ucx, _incoming) = Ucx::start(config(&args)).map_err(|e| e.to_string())?;
    let chunk = Bytes::from(
        (0..args.chunk)
            .map(|i| (i * 131 % 251) as u8)
            .collect::<Vec<_>>(),
    );
    let messages = args.bytes.div_ceil(args.chunk as u64);
    let mut rates = Vec::new();
    for run in 0..args.runs {
        let started = Instant::now();
        let mut sends = futures::stream::iter(0..messages)
            .map(|i| {
                let left = args.bytes - i * args.chunk as u64;
                let payload = chunk.slice(..(args.chunk as u64).min(left) as usize);
                ucx.send_segments(
                    &peer,
                    i.to_le_bytes().to_vec(),
                    split(payload, args.segments),
                )
            })
            .buffered(args.window);
        while let Some(result) = sends.next().await {
            result.map_err(|e| e.to_string())?;
        }
        let (line, back) = tokio::task::spawn_blocking(move || (read_line(), read_line))
            .await
            .map_err(|e| e.to_string())?;
        read_line = back;
        let line = line?;
        if line != format!("DONE {}", args.bytes) {
            return Err(format!("unexpected child output {line}"));
        }
        let secs = started.elapsed().as_secs_f64();
        let rate = args.bytes as f64 / secs / 1e9;
        println!(
            "run {run}: {} bytes in {secs:.3} s = {rate:.2} GB/s",
            args.bytes
        );
        rates.push(rate);
    }
    rates.sort_by(f64::total_cmp);
    println!(
        "median {:.2} GB/s over {} runs ({} B in {} B messages of {} segments, window {}, UCX_TLS={})",
        rates[rates.len() / 2],
        args.runs,
        args.bytes,
        args.chunk,
        args.segments,
        args.window,
        args.tls
            .clone()
            .or_else(|| std::env::var("UCX_TLS").ok())
            .unwrap_or_else(|| "(default)".into()),
    );
    ucx.shutdown().await;
    let status = child.wait().map_err(|e| e.to_string())?;
    if !status.success() {
        return Err(format!("receiver exited with {status}"));
    }
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let result = match parse_args() {
        Ok(args) if std::env::var_os(CHILD_ENV).is_some() => receiver(args).await,
        Ok(args) => sender(args).await,
        Err(err) => Err(err),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("ucx_bench: {err}");
            ExitCode::FAILURE
        }
    }
}

//! Shuffle throughput between two processes: the bytes per second a mapper's worker pushes to a
//! reducer's worker through the shuffle transports (Arrow IPC pieces encoded, sent, decoded and
//! stored, each delivery acknowledged), next to raw loopback TCP moving the same bytes in the
//! same chunk sizes, and `ucx_perftest` (when installed) for UCX, in one run. A second raw TCP
//! figure has the receiver keep what it reads, as the shuffle's receiver keeps its pieces: it
//! reads into [`MAPPERS`] buffers of a piece each in turn, where the plain raw receiver reads
//! every chunk into the same (cache-warm) buffer.
//!
//! ```text
//! cargo run --release -p wrk-host --features ucx --example shuffle_bench -- [GIB] [PIECE_MIB] [tcp|ucx|all]
//! ```
//!
//! The process re-runs itself as the receiving side (`receive tcp|ucx|raw|raw-kept PIECE_BYTES`),
//! which prints its address on stdout and serves until its stdin closes.

use std::io::{BufRead, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use arrow::array::{Float64Array, Int64Array};
use arrow::record_batch::RecordBatch;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use wrk_host::memory::spill::SpillDir;
use wrk_host::metrics::{WorkerMetrics, compile_cache_counter};
use wrk_host::shuffle::pieces::PieceStore;
use wrk_host::shuffle::tcp::{TcpReceiver, TcpSender};
use wrk_host::shuffle::transport::{Delivery, Transport};
use wrk_host::store::PartitionStore;
use wrk_host::table::Table;
use wrk_proto::ShufflePeer;

/// Deliveries in flight at once, as a mapper keeps them.
const IN_FLIGHT: usize = 4;
/// Mappers the deliveries are spread over, so the receiver keeps at most this many pieces.
const MAPPERS: usize = 16;
/// Runs of each path (raw and shuffle, perftest and shuffle), alternated.
const ROUNDS: usize = 3;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn metrics() -> WorkerMetrics {
    WorkerMetrics::new(compile_cache_counter())
}

/// A piece store over a partition store with a pool of `pool` bytes, spilling under `spill`.
fn piece_store(pool: u64, spill: &std::path::Path) -> Result<Arc<PieceStore>> {
    let spill = SpillDir::open(spill, "shuffle-bench")?;
    Ok(Arc::new(PieceStore::new(Arc::new(PartitionStore::new(
        pool, spill,
    )))))
}

/// Reads a raw stream (a `u64` length, then the bytes) and answers one byte. `kept`: the piece
/// size, the bytes go into [`MAPPERS`] buffers of that size in turn (each touched beforehand);
/// otherwise every read goes into the start of one 4 MiB buffer.
async fn read_raw(mut stream: TcpStream, kept: Option<usize>) {
    let (size, count) = match kept {
        Some(piece) => (piece, MAPPERS),
        None => (4 << 20, 1),
    };
    let mut buffers: Vec<Vec<u8>> = (0..count).map(|_| vec![1u8; size]).collect();
    let Ok(expected) = stream.read_u64().await else {
        return;
    };
    let (mut total, mut current, mut filled) = (0u64, 0usize, 0usize);
    while total < expected {
        let start = if kept.is_some() { filled } else { 0 };
        match stream.read(&mut buffers[current][start..]).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                total += n as u64;
                filled += n;
                if filled == size {
                    filled = 0;
                    current = (current + 1) % count;
                }
            }
        }
    }
    let _ = stream.write_all(&[1]).await;
}

async fn receive(kind: &str, piece_bytes: Option<usize>) -> Result<()> {
    let spill = tempfile::tempdir()?;
    // Pieces of replaced attempts leave the pool at once: a few GiB is plenty.
    let store = piece_store(4 << 30, spill.path())?;
    let mut out = std::io::stdout();
    // Keeps the UCX receiver (in builds with UCX) serving until the end.
    #[cfg(feature = "ucx")]
    let _ucx;
    match kind {
        "tcp" => {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            writeln!(out, "{}", listener.local_addr()?)?;
            let receiver = Arc::new(TcpReceiver {
                store,
                secret: None,
                metrics: metrics(),
            });
            tokio::spawn(receiver.serve(listener));
        }
        "raw" | "raw-kept" => {
            let kept = match kind {
                "raw-kept" => Some(piece_bytes.ok_or("raw-kept needs the piece size")?),
                _ => None,
            };
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            writeln!(out, "{}", listener.local_addr()?)?;
            tokio::spawn(async move {
                while let Ok((stream, _)) = listener.accept().await {
                    tokio::spawn(read_raw(stream, kept));
                }
            });
        }
        #[cfg(feature = "ucx")]
        "ucx" => {
            let transport = wrk_host::shuffle::ucx::UcxTransport::start(store, metrics(), None)?;
            writeln!(out, "{}", hex::encode(transport.address()))?;
            _ucx = transport;
        }
        other => return Err(format!("no receiver `{other}`").into()),
    }
    out.flush()?;
    // Serve until the parent closes stdin.
    tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        let _ = std::io::stdin().lock().read_line(&mut line);
    })
    .await?;
    Ok(())
}

fn spawn_receiver(kind: &str, piece_bytes: usize) -> Result<(Child, String)> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["receive", kind, &piece_bytes.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line)?;
    Ok((child, line.trim().to_string()))
}

/// One piece of about `bytes`: an int64 key and a float64 value column.
fn piece(bytes: usize) -> Table {
    let rows = bytes / 16;
    let keys = Int64Array::from_iter_values(0..rows as i64);
    let values = Float64Array::from_iter_values((0..rows).map(|i| i as f64 * 0.5));
    Table::new(
        RecordBatch::try_from_iter([
            ("key", Arc::new(keys) as _),
            ("value", Arc::new(values) as _),
        ])
        .unwrap_or_else(|e| panic!("a valid batch: {e}")),
    )
}

/// Pushes `count` pieces through `transport` (as attempts from `round`'s on, each replacing the
/// last one of its mapper); returns the bytes on the wire and the seconds.
async fn push(
    transport: Arc<dyn Transport>,
    peer: ShufflePeer,
    table: Table,
    count: usize,
    round: usize,
) -> Result<(u64, f64)> {
    let started = Instant::now();
    let mut in_flight = tokio::task::JoinSet::new();
    let mut bytes = 0u64;
    for i in 0..count {
        if in_flight.len() >= IN_FLIGHT
            && let Some(done) = in_flight.join_next().await
        {
            bytes += done??;
        }
        let delivery = Delivery {
            job_id: "bench".into(),
            exchange: "bench".into(),
            mapper: (i % MAPPERS) as u32,
            attempt: ((round * count + i) / MAPPERS) as u32 + 1,
            pieces: vec![(0, table.clone())],
            complete: Vec::new(),
        };
        let (transport, peer) = (transport.clone(), peer.clone());
        in_flight.spawn(async move {
            transport
                .deliver(&peer, delivery)
                .await
                .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
        });
    }
    while let Some(done) = in_flight.join_next().await {
        bytes += done??;
    }
    Ok((bytes, started.elapsed().as_secs_f64()))
}

/// Raw loopback TCP: `total` bytes in `chunk`-byte writes, then a one-byte answer.
async fn raw(address: &str, total: u64, chunk: usize) -> Result<f64> {
    let mut stream = TcpStream::connect(address).await?;
    stream.set_nodelay(true)?;
    let buffer = vec![7u8; chunk];
    let started = Instant::now();
    stream.write_u64(total).await?;
    let mut sent = 0u64;
    while sent < total {
        let n = chunk.min((total - sent) as usize);
        stream.write_all(&buffer[..n]).await?;
        sent += n as u64;
    }
    stream.read_u8().await?;
    Ok(started.elapsed().as_secs_f64())
}

/// `ucx_perftest` tag bandwidth for `count` messages of `size` bytes, in GB/s.
#[cfg(feature = "ucx")]
fn ucx_perftest(size: usize, count: usize) -> Option<f64> {
    let port = "23457";
    let args = [
        "-t",
        "tag_bw",
        "-s",
        &size.to_string(),
        "-n",
        &count.to_string(),
    ];
    let mut server = Command::new("ucx_perftest")
        .args(["-p", port])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(std::time::Duration::from_millis(500));
    let client = Command::new("ucx_perftest")
        .args(["127.0.0.1", "-p", port])
        .args(args)
        .output()
        .ok();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&client?.stdout).into_owned();
    let fields: Vec<&str> = text
        .lines()
        .find(|l| l.starts_with("Final:"))?
        .split_whitespace()
        .collect();
    // Final: iterations, overhead (50%, average, overall), bandwidth in MiB/s (average, overall).
    let mib_per_s: f64 = fields.get(6)?.parse().ok()?;
    Some(mib_per_s * 1_048_576.0 / 1e9)
}

/// The TCP paths: raw loopback TCP and the shuffle over TCP, alternated, best of each.
async fn tcp_and_raw(
    table: &Table,
    count: usize,
    piece_bytes: usize,
    piece_mib: usize,
) -> Result<()> {
    let (raw_child, raw_address) = spawn_receiver("raw", piece_bytes)?;
    let (kept_child, kept_address) = spawn_receiver("raw-kept", piece_bytes)?;
    let (tcp_child, tcp_address) = spawn_receiver("tcp", piece_bytes)?;
    let peer = ShufflePeer {
        worker_id: "receiver".into(),
        tcp_address,
        ucx_address: Vec::new(),
    };
    // Alternated, best of each: a busy machine slows whichever runs at a bad moment.
    let sender: Arc<dyn Transport> = Arc::new(TcpSender::new(None));
    let (mut raw_rate, mut kept_rate, mut tcp_rate) = (0f64, 0f64, 0f64);
    for round in 0..ROUNDS {
        let (bytes, seconds) =
            push(sender.clone(), peer.clone(), table.clone(), count, round).await?;
        let raw_seconds = raw(&raw_address, bytes, piece_bytes).await?;
        let kept_seconds = raw(&kept_address, bytes, piece_bytes).await?;
        raw_rate = raw_rate.max(bytes as f64 / raw_seconds / 1e9);
        kept_rate = kept_rate.max(bytes as f64 / kept_seconds / 1e9);
        tcp_rate = tcp_rate.max(bytes as f64 / seconds / 1e9);
    }
    println!("| path | GB/s | vs raw |");
    println!("|---|---:|---:|");
    println!("| raw loopback TCP (same bytes, {piece_mib} MiB writes) | {raw_rate:.2} | 1.00x |");
    println!(
        "| raw loopback TCP, the receiver keeping the last {MAPPERS} pieces' bytes | {kept_rate:.2} | {:.2}x |",
        kept_rate / raw_rate
    );
    println!(
        "| shuffle over TCP (encode, send, decode, store, ack) | {tcp_rate:.2} | {:.2}x ({:.2}x of the keeping raw receiver) |",
        tcp_rate / raw_rate,
        tcp_rate / kept_rate
    );
    for mut child in [raw_child, kept_child, tcp_child] {
        drop(child.stdin.take());
        child.wait()?;
    }
    Ok(())
}

async fn bench(gib: f64, piece_mib: usize, only: &str) -> Result<()> {
    let piece_bytes = piece_mib << 20;
    let count = ((gib * (1u64 << 30) as f64) / piece_bytes as f64).ceil() as usize;
    let table = piece(piece_bytes);
    println!(
        "shuffle bench: {count} pieces of {piece_mib} MiB ({gib} GiB), {IN_FLIGHT} in flight, between two processes on 127.0.0.1, best of {ROUNDS}"
    );
    if only != "ucx" {
        tcp_and_raw(&table, count, piece_bytes, piece_mib).await?;
    }
    #[cfg(feature = "ucx")]
    if only != "tcp" {
        let (mut ucx_child, address) = spawn_receiver("ucx", piece_bytes)?;
        let spill = tempfile::tempdir()?;
        let store = piece_store(1 << 30, spill.path())?;
        let sender = wrk_host::shuffle::ucx::UcxTransport::start(store, metrics(), None)?;
        let peer = ShufflePeer {
            worker_id: "receiver".into(),
            tcp_address: String::new(),
            ucx_address: hex::decode(address)?,
        };
        let sender: Arc<dyn Transport> = Arc::new(sender);
        let (mut ucx_rate, mut perftest) = (0f64, None::<f64>);
        for round in 0..ROUNDS {
            let (bytes, seconds) =
                push(sender.clone(), peer.clone(), table.clone(), count, round).await?;
            ucx_rate = ucx_rate.max(bytes as f64 / seconds / 1e9);
            if let Some(rate) = ucx_perftest(piece_bytes, count) {
                perftest = Some(perftest.unwrap_or(0.0).max(rate));
            }
        }
        match perftest {
            Some(perftest) => {
                println!("| ucx_perftest tag_bw ({piece_mib} MiB messages) | {perftest:.2} | |");
                println!(
                    "| shuffle over UCX | {ucx_rate:.2} | {:.2}x of ucx_perftest |",
                    ucx_rate / perftest
                );
            }
            None => println!(
                "| shuffle over UCX (ucx_perftest not installed: apt-get install ucx-utils) | {ucx_rate:.2} | |"
            ),
        }
        drop(ucx_child.stdin.take());
        ucx_child.wait()?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("receive") {
        let piece_bytes = args.get(2).map(|a| a.parse()).transpose()?;
        return receive(
            args.get(1).map(String::as_str).unwrap_or("tcp"),
            piece_bytes,
        )
        .await;
    }
    let gib: f64 = args.first().map(|a| a.parse()).transpose()?.unwrap_or(2.0);
    let piece_mib: usize = args.get(1).map(|a| a.parse()).transpose()?.unwrap_or(4);
    let only = args.get(2).map(String::as_str).unwrap_or("all");
    bench(gib, piece_mib, only).await
}

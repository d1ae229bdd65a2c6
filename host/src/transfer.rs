//! Peer-to-peer partition transfer: the `Worker` gRPC service every worker serves, and the client
//! that peers (and `wrk submit`, for results) use to fetch a partition straight from the worker
//! holding it. Partitions travel as Arrow IPC streams cut into chunks.
//!
//! The client also measures the rate its large fetches move at; workers report it in their
//! heartbeats, and the scheduler weighs moving a task's inputs against waiting for the worker
//! that holds them by it (Dask's `bandwidth`).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow::buffer::Buffer;
use bytes::{Bytes, BytesMut};
use futures::Stream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};
use wrk_proto::auth::{TICKET_METADATA, ticket_is_valid};
use wrk_proto::worker_client::WorkerClient;
use wrk_proto::worker_server::Worker;
use wrk_proto::{DataChunk, MAX_MESSAGE_BYTES, PartitionKey};

use crate::memory::buffers::{self, PooledVec};
use crate::metrics::WorkerMetrics;
use crate::store::{PartitionId, PartitionStore};
use crate::table::{Table, decode_ipc_buffer};

/// Size of one chunk of a transfer.
const CHUNK_BYTES: usize = 4 << 20;
/// The most a fetch reserves up front for the stream its peer announces.
const PREALLOCATED_BYTES_LIMIT: u64 = 1 << 30;
/// The HTTP/2 flow-control window of one fetch.
const STREAM_WINDOW_BYTES: u32 = 8 << 20;
/// The largest HTTP/2 frame a peer may send us (the protocol's maximum; the default is 16 KiB).
const MAX_FRAME_BYTES: u32 = (1 << 24) - 1;
/// Segments of an IPC stream shorter than this are copied into a chunk with their neighbours;
/// longer ones go out as slices of the table's own buffer.
const COPIED_SEGMENT_BYTES: usize = 64 << 10;
/// Fetches smaller than this say more about latency than about bandwidth: not measured.
const MEASURED_FETCH_BYTES: usize = 1 << 20;
/// The weight of the latest large fetch in the measured rate.
const RATE_WEIGHT: f64 = 0.2;

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("cannot reach worker at {address}: {detail}")]
    Connect { address: String, detail: String },
    #[error("worker at {address} could not send partition {key}: {status}")]
    Fetch {
        address: String,
        key: String,
        status: String,
    },
    #[error("partition {key} from worker at {address} is not a valid Arrow IPC stream: {detail}")]
    Decode {
        address: String,
        key: String,
        detail: String,
    },
}

/// Serves the partitions of one worker's store.
pub struct DataService {
    worker_id: String,
    store: Arc<PartitionStore>,
    metrics: WorkerMetrics,
    /// When set (the cluster's worker token), a fetch must carry the partition's ticket.
    ticket_secret: Option<Vec<u8>>,
}

impl DataService {
    pub fn new(
        worker_id: String,
        store: Arc<PartitionStore>,
        metrics: WorkerMetrics,
        ticket_secret: Option<Vec<u8>>,
    ) -> Self {
        DataService {
            worker_id,
            store,
            metrics,
            ticket_secret,
        }
    }
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<DataChunk, Status>> + Send>>;

#[tonic::async_trait]
impl Worker for DataService {
    type FetchPartitionStream = ChunkStream;

    async fn fetch_partition(
        &self,
        request: Request<PartitionKey>,
    ) -> Result<Response<ChunkStream>, Status> {
        if let Some(secret) = &self.ticket_secret {
            let ticket = request
                .metadata()
                .get(TICKET_METADATA)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            if !ticket_is_valid(secret, request.get_ref(), ticket) {
                return Err(Status::permission_denied(format!(
                    "a missing or invalid ticket for partition {}",
                    request.get_ref()
                )));
            }
        }
        let key = request.into_inner();
        let store = self.store.clone();
        let id = PartitionId::from(&key);
        let segments = tokio::task::spawn_blocking(move || store.ipc_stream(&id))
            .await
            .map_err(|e| Status::internal(format!("encoding partition {key}: {e}")))?
            .ok_or_else(|| {
                Status::not_found(format!(
                    "partition {key} is not held by worker {}",
                    self.worker_id
                ))
            })?
            .map_err(|e| Status::internal(format!("encoding partition {key}: {e}")))?;
        let chunks = chunks(segments);
        self.metrics
            .count_transfer("served", chunks.iter().map(|c| c.ipc.len()).sum::<usize>());
        Ok(Response::new(Box::pin(tokio_stream::iter(
            chunks.into_iter().map(Ok),
        ))))
    }
}

/// Cuts an IPC stream's segments into chunks of at most [`CHUNK_BYTES`]: large segments (the
/// tables' buffers) are sliced, not copied; runs of small ones (the messages' headers, short
/// columns) are copied together so that a wide table does not go out as thousands of tiny
/// messages. The first chunk carries the stream's length.
fn chunks(segments: Vec<Buffer>) -> Vec<DataChunk> {
    let stream_bytes: usize = segments.iter().map(|s| s.len()).sum();
    let mut chunks = Vec::with_capacity(stream_bytes / CHUNK_BYTES + 2);
    let mut small = BytesMut::new();
    let flush = |small: &mut BytesMut, chunks: &mut Vec<DataChunk>| {
        if !small.is_empty() {
            chunks.push(DataChunk {
                ipc: small.split().freeze(),
                stream_bytes: 0,
            });
        }
    };
    for segment in segments {
        if segment.len() < COPIED_SEGMENT_BYTES {
            small.extend_from_slice(&segment);
            if small.len() >= CHUNK_BYTES {
                flush(&mut small, &mut chunks);
            }
            continue;
        }
        flush(&mut small, &mut chunks);
        let segment = Bytes::from(segment);
        let mut start = 0;
        while start < segment.len() {
            let end = (start + CHUNK_BYTES).min(segment.len());
            chunks.push(DataChunk {
                ipc: segment.slice(start..end),
                stream_bytes: 0,
            });
            start = end;
        }
    }
    flush(&mut small, &mut chunks);
    match chunks.first_mut() {
        Some(first) => first.stream_bytes = stream_bytes as u64,
        None => chunks.push(DataChunk::default()),
    }
    chunks
}

/// Fetches partitions from peers, keeping one connection per peer address.
#[derive(Default, Clone)]
pub struct PeerClient {
    channels: Arc<Mutex<HashMap<String, Channel>>>,
    metrics: Option<WorkerMetrics>,
    rate: Arc<TransferRate>,
}

/// The bytes per second of large fetches, smoothed; 0 (as `f64` bits) until one is measured.
#[derive(Default)]
struct TransferRate {
    bits: AtomicU64,
}

impl TransferRate {
    fn observe(&self, bytes: usize, elapsed: Duration) {
        if bytes < MEASURED_FETCH_BYTES || elapsed.is_zero() {
            return;
        }
        let sample = bytes as f64 / elapsed.as_secs_f64();
        // Concurrent fetches may update it at once; either order is a fine average.
        let _ = self
            .bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let rate = f64::from_bits(bits);
                let next = if rate > 0.0 {
                    rate + (sample - rate) * RATE_WEIGHT
                } else {
                    sample
                };
                Some(next.to_bits())
            });
    }

    fn bytes_per_second(&self) -> Option<f64> {
        Some(f64::from_bits(self.bits.load(Ordering::Relaxed))).filter(|rate| *rate > 0.0)
    }
}

impl PeerClient {
    pub fn new() -> Self {
        Self::default()
    }

    /// A client that counts the bytes it fetches in a worker's metrics.
    pub fn with_metrics(metrics: WorkerMetrics) -> Self {
        PeerClient {
            channels: Arc::default(),
            metrics: Some(metrics),
            rate: Arc::default(),
        }
    }

    /// The rate this client's fetches of a megabyte or more moved at (smoothed, the latest
    /// weighing a fifth); None before the first.
    pub fn transfer_bytes_per_second(&self) -> Option<f64> {
        self.rate.bytes_per_second()
    }

    async fn channel(&self, address: &str) -> Result<Channel, TransferError> {
        if let Some(channel) = self
            .channels
            .lock()
            .ok()
            .and_then(|m| m.get(address).cloned())
        {
            return Ok(channel);
        }
        let connect_err = |detail: String| TransferError::Connect {
            address: address.to_string(),
            detail,
        };
        let channel = Endpoint::from_shared(address.to_string())
            .map_err(|e| connect_err(e.to_string()))?
            // A partition is megabytes: HTTP/2's default 64 KiB windows would stall the stream
            // on window updates.
            .initial_stream_window_size(Some(STREAM_WINDOW_BYTES))
            .initial_connection_window_size(Some(2 * STREAM_WINDOW_BYTES))
            .max_frame_size(Some(MAX_FRAME_BYTES))
            .tcp_nodelay(true)
            .connect()
            .await
            .map_err(|e| connect_err(e.to_string()))?;
        if let Ok(mut map) = self.channels.lock() {
            map.insert(address.to_string(), channel.clone());
        }
        Ok(channel)
    }

    /// Fetches one partition from the worker at `address`, presenting its ticket (empty when the
    /// cluster needs none).
    pub async fn fetch(
        &self,
        address: &str,
        key: &PartitionKey,
        ticket: &str,
    ) -> Result<Table, TransferError> {
        let fetch_err = |status: String| TransferError::Fetch {
            address: address.to_string(),
            key: key.to_string(),
            status,
        };
        let mut client = WorkerClient::new(self.channel(address).await?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES);
        let mut request = tonic::Request::new(key.clone());
        if !ticket.is_empty() {
            let value = ticket
                .parse()
                .map_err(|_| fetch_err("the partition's ticket is not valid metadata".into()))?;
            request.metadata_mut().insert(TICKET_METADATA, value);
        }
        let started = Instant::now();
        let mut stream = client
            .fetch_partition(request)
            .await
            .map_err(|s| fetch_err(s.message().to_string()))?
            .into_inner();
        let mut received: Option<PooledVec<u8>> = None;
        let mut declared = 0u64;
        while let Some(chunk) = stream
            .message()
            .await
            .map_err(|s| fetch_err(s.message().to_string()))?
        {
            let block = received.get_or_insert_with(|| {
                declared = chunk.stream_bytes;
                // The worker's reusable blocks are resident already: no page faults. Beyond
                // the first GiB the block grows as bytes arrive, whatever was announced.
                let room = chunk.stream_bytes.min(PREALLOCATED_BYTES_LIMIT);
                PooledVec::with_capacity(buffers::global(), room as usize)
            });
            if declared > 0 && (block.len() + chunk.ipc.len()) as u64 > declared {
                return Err(fetch_err(format!(
                    "the worker sent more than the {declared} bytes it announced"
                )));
            }
            block.extend_from_slice(&chunk.ipc);
        }
        let received = received.unwrap_or_else(|| PooledVec::with_capacity(buffers::global(), 0));
        if declared > 0 && received.len() as u64 != declared {
            return Err(fetch_err(format!(
                "the stream ended after {} of the {declared} bytes the worker announced",
                received.len()
            )));
        }
        self.rate.observe(received.len(), started.elapsed());
        if let Some(metrics) = &self.metrics {
            metrics.count_transfer("fetched", received.len());
        }
        let (address, key_text) = (address.to_string(), key.to_string());
        let stream = received.into_scalar_buffer().into_inner();
        let batch = tokio::task::spawn_blocking(move || decode_ipc_buffer(stream))
            .await
            .map_err(|e| TransferError::Decode {
                address: address.clone(),
                key: key_text.clone(),
                detail: e.to_string(),
            })?
            .map_err(|e| TransferError::Decode {
                address,
                key: key_text,
                detail: e.to_string(),
            })?;
        Ok(Table::new(batch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::record_batch::RecordBatch;
    use wrk_proto::auth::partition_ticket;
    use wrk_proto::worker_server::WorkerServer;

    fn service() -> (DataService, PartitionKey, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let spill = crate::memory::SpillDir::open(dir.path(), "w").unwrap();
        let store = Arc::new(PartitionStore::new(1 << 30, spill));
        let key = PartitionKey {
            job_id: "job-000001".into(),
            stage: 0,
            task: 0,
            output: 0,
        };
        let batch =
            RecordBatch::try_from_iter([("x", Arc::new(Int64Array::from(vec![1, 2])) as _)])
                .unwrap();
        store.insert(PartitionId::from(&key), Table::new(batch));
        let metrics = WorkerMetrics::new(crate::metrics::compile_cache_counter());
        (
            DataService::new("w".into(), store, metrics, Some(b"cluster-secret".to_vec())),
            key,
            dir,
        )
    }

    fn request(key: &PartitionKey, ticket: Option<&str>) -> Request<PartitionKey> {
        let mut request = Request::new(key.clone());
        if let Some(ticket) = ticket {
            request
                .metadata_mut()
                .insert(TICKET_METADATA, ticket.parse().unwrap());
        }
        request
    }

    #[tokio::test]
    async fn partitions_are_served_only_with_their_ticket() {
        let (service, key, _dir) = service();
        let missing = service
            .fetch_partition(request(&key, None))
            .await
            .err()
            .unwrap();
        assert_eq!(missing.code(), tonic::Code::PermissionDenied);
        assert!(
            missing
                .message()
                .contains("invalid ticket for partition job-000001/0/0/0"),
            "{missing:?}"
        );
        let forged = partition_ticket(b"guessed-secret", &key);
        let wrong = service
            .fetch_partition(request(&key, Some(&forged)))
            .await
            .err()
            .unwrap();
        assert_eq!(wrong.code(), tonic::Code::PermissionDenied);
        let ticket = partition_ticket(b"cluster-secret", &key);
        assert!(
            service
                .fetch_partition(request(&key, Some(&ticket)))
                .await
                .is_ok()
        );
    }

    fn chunk_bytes(chunks: &[DataChunk]) -> Vec<u8> {
        chunks.iter().flat_map(|c| c.ipc.to_vec()).collect()
    }

    #[test]
    fn large_segments_are_sliced_in_place_and_small_ones_sent_together() {
        let large = Buffer::from(vec![7u8; CHUNK_BYTES + CHUNK_BYTES / 2]);
        let small: Vec<Buffer> = (0..3u8).map(|i| Buffer::from(vec![i; 100])).collect();
        let segments = vec![
            small[0].clone(),
            small[1].clone(),
            large.clone(),
            small[2].clone(),
        ];
        let chunks = chunks(segments.clone());
        let lengths: Vec<usize> = chunks.iter().map(|c| c.ipc.len()).collect();
        assert_eq!(lengths, [200, CHUNK_BYTES, CHUNK_BYTES / 2, 100]);
        assert_eq!(chunks[1].ipc.as_ptr(), large.as_ptr(), "sliced, not copied");
        let total: usize = segments.iter().map(|s| s.len()).sum();
        assert_eq!(chunks[0].stream_bytes, total as u64);
        assert!(chunks[1..].iter().all(|c| c.stream_bytes == 0));
        let expected: Vec<u8> = segments.iter().flat_map(|s| s.to_vec()).collect();
        assert_eq!(chunk_bytes(&chunks), expected);
        assert_eq!(
            super::chunks(Vec::new()).len(),
            1,
            "an empty stream is one chunk"
        );
    }

    /// Serves `service` on a loopback port; its address.
    async fn serve(service: impl Worker) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(
                    WorkerServer::new(service).max_encoding_message_size(MAX_MESSAGE_BYTES),
                )
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        address
    }

    #[tokio::test]
    async fn a_partition_of_many_chunks_arrives_whole_over_grpc() {
        let (service, key, _dir) = service();
        let rows = 1_500_000;
        let big = RecordBatch::try_from_iter([
            ("x", Arc::new(Int64Array::from_iter_values(0..rows)) as _),
            (
                "y",
                Arc::new(arrow::array::Float64Array::from_iter_values(
                    (0..rows).map(|i| i as f64 / 2.0),
                )) as _,
            ),
        ])
        .unwrap();
        service
            .store
            .insert(PartitionId::from(&key), Table::new(big.clone()));
        let address = serve(service).await;
        let ticket = partition_ticket(b"cluster-secret", &key);
        let client = PeerClient::new();
        let fetched = client.fetch(&address, &key, &ticket).await.unwrap();
        assert_eq!(fetched.batch(), &big, "24 MB in 6 chunks");
        let rate = client.transfer_bytes_per_second().unwrap();
        assert!(rate > 1e6 && rate.is_finite(), "{rate} bytes/s");
    }

    #[test]
    fn only_large_fetches_count_toward_the_rate_and_the_latest_weighs_a_fifth() {
        let rate = TransferRate::default();
        rate.observe(64 << 10, Duration::from_millis(1));
        assert_eq!(rate.bytes_per_second(), None, "a small fetch is latency");
        rate.observe(100_000_000, Duration::from_millis(100));
        assert_eq!(rate.bytes_per_second(), Some(1e9));
        rate.observe(100_000_000, Duration::from_millis(50));
        let smoothed = rate.bytes_per_second().unwrap();
        assert!((smoothed - 1.2e9).abs() < 1.0, "{smoothed}");
        rate.observe(100_000_000, Duration::ZERO);
        assert_eq!(rate.bytes_per_second(), Some(smoothed));
    }

    /// A peer that announces one length and sends another.
    struct ShortPeer {
        announced: u64,
    }

    #[tonic::async_trait]
    impl Worker for ShortPeer {
        type FetchPartitionStream = ChunkStream;

        async fn fetch_partition(
            &self,
            _: Request<PartitionKey>,
        ) -> Result<Response<ChunkStream>, Status> {
            let mut chunks = chunks(ipc_segments_of(10));
            chunks[0].stream_bytes = self.announced;
            Ok(Response::new(Box::pin(tokio_stream::iter(
                chunks.into_iter().map(Ok),
            ))))
        }
    }

    fn ipc_segments_of(rows: i64) -> Vec<Buffer> {
        let batch = RecordBatch::try_from_iter([(
            "x",
            Arc::new(Int64Array::from_iter_values(0..rows)) as _,
        )])
        .unwrap();
        crate::table::ipc_segments(&batch).unwrap()
    }

    #[tokio::test]
    async fn a_stream_shorter_than_announced_is_refused_naming_the_partition() {
        let key = PartitionKey {
            job_id: "job-000007".into(),
            stage: 1,
            task: 2,
            output: 0,
        };
        let stream_bytes: u64 = chunks(ipc_segments_of(10))
            .iter()
            .map(|c| c.ipc.len() as u64)
            .sum();
        // One byte more than sent, and an absurd announcement (nothing is reserved for it).
        for announced in [stream_bytes + 1, u64::MAX] {
            let address = serve(ShortPeer { announced }).await;
            let err = PeerClient::new()
                .fetch(&address, &key, "")
                .await
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("could not send partition job-000007/1/2/0")
                    && err.contains(&format!(
                        "the stream ended after {stream_bytes} of the {announced} bytes"
                    )),
                "{err}"
            );
        }
    }
}

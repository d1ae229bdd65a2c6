//! Peer-to-peer partition transfer: the `Worker` gRPC service every worker serves, and the client
//! that peers (and `wrk submit`, for results) use to fetch a partition straight from the worker
//! holding it. Partitions travel as Arrow IPC streams cut into chunks.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use futures::Stream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};
use wrk_proto::worker_client::WorkerClient;
use wrk_proto::worker_server::Worker;
use wrk_proto::{DataChunk, MAX_MESSAGE_BYTES, PartitionKey};

use crate::metrics::WorkerMetrics;
use crate::store::{PartitionId, PartitionStore};
use crate::table::{Table, decode_ipc, encode_ipc};

/// Size of one chunk of a transfer.
const CHUNK_BYTES: usize = 4 << 20;

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
}

impl DataService {
    pub fn new(worker_id: String, store: Arc<PartitionStore>, metrics: WorkerMetrics) -> Self {
        DataService {
            worker_id,
            store,
            metrics,
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
        let key = request.into_inner();
        let Some(table) = self.store.get(&PartitionId::from(&key)) else {
            return Err(Status::not_found(format!(
                "partition {key} is not held by worker {}",
                self.worker_id
            )));
        };
        let bytes = tokio::task::spawn_blocking(move || encode_ipc(table.batch()))
            .await
            .map_err(|e| Status::internal(format!("encoding partition {key}: {e}")))?
            .map_err(|e| Status::internal(format!("encoding partition {key}: {e}")))?;
        self.metrics.count_transfer("served", bytes.len());
        let bytes = bytes::Bytes::from(bytes);
        let chunks: Vec<Result<DataChunk, Status>> = (0..bytes.len().max(1))
            .step_by(CHUNK_BYTES)
            .map(|start| {
                let end = (start + CHUNK_BYTES).min(bytes.len());
                Ok(DataChunk {
                    ipc: bytes.slice(start..end).to_vec(),
                })
            })
            .collect();
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }
}

/// Fetches partitions from peers, keeping one connection per peer address.
#[derive(Default, Clone)]
pub struct PeerClient {
    channels: Arc<Mutex<HashMap<String, Channel>>>,
    metrics: Option<WorkerMetrics>,
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
        }
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
            .connect()
            .await
            .map_err(|e| connect_err(e.to_string()))?;
        if let Ok(mut map) = self.channels.lock() {
            map.insert(address.to_string(), channel.clone());
        }
        Ok(channel)
    }

    /// Fetches one partition from the worker at `address`.
    pub async fn fetch(&self, address: &str, key: &PartitionKey) -> Result<Table, TransferError> {
        let fetch_err = |status: String| TransferError::Fetch {
            address: address.to_string(),
            key: key.to_string(),
            status,
        };
        let mut client = WorkerClient::new(self.channel(address).await?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES);
        let mut stream = client
            .fetch_partition(key.clone())
            .await
            .map_err(|s| fetch_err(s.message().to_string()))?
            .into_inner();
        let mut bytes = Vec::new();
        while let Some(chunk) = stream
            .message()
            .await
            .map_err(|s| fetch_err(s.message().to_string()))?
        {
            bytes.extend_from_slice(&chunk.ipc);
        }
        if let Some(metrics) = &self.metrics {
            metrics.count_transfer("fetched", bytes.len());
        }
        let (address, key_text) = (address.to_string(), key.to_string());
        let batch = tokio::task::spawn_blocking(move || decode_ipc(&bytes))
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

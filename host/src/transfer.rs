//! Peer-to-peer partition transfer: the `Worker` gRPC service every worker serves, and the client
//! that peers (and `wrk submit`, for results) use to fetch a partition straight from the worker
//! holding it. Partitions travel as Arrow IPC streams cut into chunks.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use futures::Stream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};
use wrk_proto::auth::{TICKET_METADATA, ticket_is_valid};
use wrk_proto::worker_client::WorkerClient;
use wrk_proto::worker_server::Worker;
use wrk_proto::{DataChunk, MAX_MESSAGE_BYTES, PartitionKey};

use crate::metrics::WorkerMetrics;
use crate::store::{PartitionId, PartitionStore};
use crate::table::{Table, decode_ipc};

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
        // A spilled partition is sent straight from its spill file (already an IPC stream).
        let store = self.store.clone();
        let id = PartitionId::from(&key);
        let bytes = tokio::task::spawn_blocking(move || store.ipc_bytes(&id))
            .await
            .map_err(|e| Status::internal(format!("encoding partition {key}: {e}")))?
            .ok_or_else(|| {
                Status::not_found(format!(
                    "partition {key} is not held by worker {}",
                    self.worker_id
                ))
            })?
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
        let mut stream = client
            .fetch_partition(request)
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

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::record_batch::RecordBatch;
    use wrk_proto::auth::partition_ticket;

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
}

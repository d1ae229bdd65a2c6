//! The transports that carry shuffle pieces from a mapper's worker to a reducer's worker, behind
//! one trait: in-process (the reducer runs on the same worker), TCP (the default between
//! workers) and UCX (where built and both peers have it).

use futures::future::BoxFuture;
use wrk_proto::ShufflePeer;

use super::pieces::{PartitionRef, PieceError, PieceStore};
use crate::table::Table;

/// Pieces of one mapper attempt for the partitions one worker receives, and the partitions
/// that attempt has finished sending there.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub job_id: String,
    pub exchange: String,
    pub mapper: u32,
    pub attempt: u32,
    pub pieces: Vec<(u32, Table)>,
    pub complete: Vec<u32>,
}

impl Delivery {
    fn partition(&self, partition: u32) -> PartitionRef {
        PartitionRef {
            job_id: self.job_id.clone(),
            exchange: self.exchange.clone(),
            partition,
        }
    }

    /// Stores the delivery in the receiving worker's piece store.
    pub fn store_in(self, store: &PieceStore) -> Result<(), PieceError> {
        for (partition, table) in &self.pieces {
            store.add(
                &self.partition(*partition),
                self.mapper,
                self.attempt,
                table.clone(),
            )?;
        }
        for &partition in &self.complete {
            store.complete(&self.partition(partition), self.mapper, self.attempt)?;
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("cannot reach the shuffle service of worker {worker} at {address}: {detail}")]
    Connect {
        worker: String,
        address: String,
        detail: String,
    },
    #[error("sending shuffle pieces to worker {worker} over {transport} failed: {detail}")]
    Send {
        worker: String,
        transport: &'static str,
        detail: String,
    },
    #[error("worker {worker} refused shuffle pieces: {detail}")]
    Refused { worker: String, detail: String },
}

/// Carries deliveries to peers; resolves with the bytes that went over the wire once the peer
/// stored the pieces.
pub trait Transport: Send + Sync {
    /// `local`, `tcp` or `ucx`, for metrics and errors.
    fn name(&self) -> &'static str;
    fn deliver<'a>(
        &'a self,
        peer: &'a ShufflePeer,
        delivery: Delivery,
    ) -> BoxFuture<'a, Result<u64, TransportError>>;
}

/// The reducer is on this worker: pieces go into its store as they are, never encoded.
pub struct InProcess {
    pub store: std::sync::Arc<PieceStore>,
}

impl Transport for InProcess {
    fn name(&self) -> &'static str {
        "local"
    }

    fn deliver<'a>(
        &'a self,
        peer: &'a ShufflePeer,
        delivery: Delivery,
    ) -> BoxFuture<'a, Result<u64, TransportError>> {
        Box::pin(async move {
            delivery
                .store_in(&self.store)
                .map_err(|e| TransportError::Refused {
                    worker: peer.worker_id.clone(),
                    detail: e.to_string(),
                })?;
            Ok(0)
        })
    }
}

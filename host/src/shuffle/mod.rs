//! The worker's side of the P2P shuffle: mappers push hash-partitions of their tables straight to
//! the workers of the reducers of an exchange; each reducer reads its own partition from its
//! worker's piece store. The scheduler tracks only the exchange (which mappers finished and
//! where each partition goes), never a task per mapper x reducer pair.
//!
//! - [`pieces`]: what a worker holds for the reducers placed on it;
//! - [`transport`]: the trait the transports implement, and the in-process one;
//! - [`tcp`]: the TCP transport (the default between workers);
//! - `ucx` (cargo feature `ucx`): the UCX transport, used between two workers that both have it,
//!   with a fallback to TCP on any UCX error.
//!
//! [`TaskShuffle`] is one task's view: the exchanges it sends to and receives from, with the
//! pushes still in flight.

pub mod pieces;
pub mod tcp;
pub mod transport;
#[cfg(feature = "ucx")]
pub mod ucx;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::task::JoinHandle;
use wrk_proto::{ExchangeSource, ExchangeTargets, ShufflePeer};

use crate::metrics::WorkerMetrics;
use crate::store::TaskMemory;
use crate::table::Table;
use pieces::{PartitionRef, PieceError, PieceStore};
use transport::{Delivery, InProcess, Transport, TransportError};

/// Deliveries one task may have in flight before `send` waits for the oldest.
const MAX_IN_FLIGHT: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum ShuffleError {
    #[error("this task sends to no exchange `{exchange}` (it sends to: {known})")]
    NotSending { exchange: String, known: String },
    #[error("this task receives no exchange `{exchange}` (it receives: {known})")]
    NotReceiving { exchange: String, known: String },
    #[error("exchange `{exchange}` has {expected} partitions, but {got} tables were sent")]
    PartitionCount {
        exchange: String,
        expected: u32,
        got: usize,
    },
    #[error("exchange `{exchange}`: {detail}")]
    Pieces { exchange: String, detail: String },
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error(transparent)]
    Piece(#[from] PieceError),
}

impl ShuffleError {
    /// Whether another attempt of the task may succeed: pieces that did not arrive or a peer
    /// that could not be reached (a lost worker), as opposed to the task's own mistakes.
    pub fn is_retriable(&self) -> bool {
        match self {
            ShuffleError::Transport(_) => true,
            ShuffleError::Piece(e) => e.is_retriable(),
            _ => false,
        }
    }
}

fn names<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let mut names: Vec<&str> = names.map(String::as_str).collect();
    names.sort_unstable();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// Which transport a worker uses between workers (`--transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// UCX when this build has it and it starts, else TCP.
    #[default]
    Auto,
    Tcp,
    /// UCX, or the worker does not start.
    Ucx,
}

impl std::str::FromStr for TransportChoice {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "auto" => Ok(TransportChoice::Auto),
            "tcp" => Ok(TransportChoice::Tcp),
            "ucx" => Ok(TransportChoice::Ucx),
            other => Err(format!(
                "unknown transport `{other}` (expected auto, tcp or ucx)"
            )),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("cannot use UCX for shuffles: {0}")]
pub struct UcxUnavailable(String);

/// The worker's shuffle service: its piece store and the transports to its peers.
pub struct ShuffleService {
    worker_id: String,
    store: Arc<PieceStore>,
    in_process: InProcess,
    tcp: tcp::TcpSender,
    #[cfg(feature = "ucx")]
    ucx: Option<ucx::UcxTransport>,
    /// Peers that UCX failed to reach: they get TCP from then on.
    ucx_failed: Mutex<HashSet<String>>,
    metrics: WorkerMetrics,
}

impl ShuffleService {
    /// `secret` is the cluster's worker token, which peers prove they hold. Starts UCX as
    /// `transport` says (inside a tokio runtime), sending Arrow buffers of `ucx_part_threshold`
    /// bytes or more as their own rendezvous when given.
    pub fn start(
        worker_id: String,
        store: Arc<PieceStore>,
        secret: Option<Vec<u8>>,
        metrics: WorkerMetrics,
        transport: TransportChoice,
        ucx_part_threshold: Option<usize>,
    ) -> Result<Self, UcxUnavailable> {
        #[cfg(feature = "ucx")]
        let start_ucx =
            || ucx::UcxTransport::start(store.clone(), metrics.clone(), ucx_part_threshold);
        #[cfg(feature = "ucx")]
        let ucx = match transport {
            TransportChoice::Tcp => None,
            TransportChoice::Auto => start_ucx()
                .inspect_err(|e| tracing::warn!("UCX did not start, shuffles use TCP: {e}"))
                .ok(),
            TransportChoice::Ucx => Some(start_ucx().map_err(|e| UcxUnavailable(e.to_string()))?),
        };
        #[cfg(not(feature = "ucx"))]
        if ucx_part_threshold.is_some() {
            tracing::warn!("--ucx-part-threshold has no effect: this wrk was built without UCX");
        }
        #[cfg(not(feature = "ucx"))]
        if transport == TransportChoice::Ucx {
            return Err(UcxUnavailable(
                "this wrk was built without the `ucx` cargo feature".into(),
            ));
        }
        Ok(ShuffleService {
            worker_id,
            in_process: InProcess {
                store: store.clone(),
            },
            store,
            tcp: tcp::TcpSender::new(secret),
            #[cfg(feature = "ucx")]
            ucx,
            ucx_failed: Mutex::default(),
            metrics,
        })
    }

    pub fn store(&self) -> &Arc<PieceStore> {
        &self.store
    }

    /// This worker's UCX address for its peers; empty without UCX.
    pub fn ucx_address(&self) -> Vec<u8> {
        #[cfg(feature = "ucx")]
        if let Some(ucx) = &self.ucx {
            return ucx.address();
        }
        Vec::new()
    }

    /// The transport `peer` gets: in-process for this worker, UCX when both have it (and it
    /// has not failed for this peer), TCP otherwise.
    fn transport(&self, peer: &ShufflePeer) -> &dyn Transport {
        if peer.worker_id == self.worker_id {
            return &self.in_process;
        }
        #[cfg(feature = "ucx")]
        if let Some(ucx) = &self.ucx
            && !peer.ucx_address.is_empty()
            && !self
                .ucx_failed
                .lock()
                .is_ok_and(|failed| failed.contains(&peer.worker_id))
        {
            return ucx;
        }
        &self.tcp
    }

    /// Delivers pieces to `peer`, counting the bytes sent; a UCX failure falls back to TCP.
    pub async fn deliver(
        &self,
        peer: &ShufflePeer,
        delivery: Delivery,
    ) -> Result<(), TransportError> {
        let transport = self.transport(peer);
        let retry = (transport.name() == "ucx").then(|| delivery.clone());
        let (transport, bytes) = match (transport.deliver(peer, delivery).await, retry) {
            (Ok(bytes), _) => (transport, bytes),
            (Err(e @ TransportError::Send { .. }), Some(delivery)) => {
                tracing::warn!(peer = %peer.worker_id, "UCX failed, falling back to TCP: {e}");
                if let Ok(mut failed) = self.ucx_failed.lock() {
                    failed.insert(peer.worker_id.clone());
                }
                (
                    &self.tcp as &dyn Transport,
                    self.tcp.deliver(peer, delivery).await?,
                )
            }
            (Err(e), _) => return Err(e),
        };
        self.metrics
            .count_shuffle("sent", transport.name(), bytes as usize);
        Ok(())
    }
}

/// A reducer's pieces of one exchange, taken one at a time (the guest's `pieces` resource).
#[derive(Debug)]
pub struct PieceStream {
    store: Arc<PieceStore>,
    ids: VecDeque<pieces::PieceId>,
}

impl PieceStream {
    /// The next piece, counted in `memory` (the task's working set), or `None` after the last.
    pub fn next(&mut self, memory: &TaskMemory) -> Result<Option<Table>, ShuffleError> {
        let Some(id) = self.ids.pop_front() else {
            return Ok(None);
        };
        let table = self.store.take(&id, Some(memory))?;
        memory
            .track(table.batch())
            .map_err(|e| ShuffleError::Piece(e.into()))?;
        Ok(Some(table))
    }
}

/// One task attempt's exchanges.
pub struct TaskShuffle {
    service: Arc<ShuffleService>,
    runtime: tokio::runtime::Handle,
    job_id: String,
    /// The task's index in its stage: its mapper number in the exchanges it sends to.
    mapper: u32,
    attempt: u32,
    sends: HashMap<String, ExchangeTargets>,
    receives: HashMap<String, ExchangeSource>,
    state: Mutex<TaskShuffleState>,
}

#[derive(Default)]
struct TaskShuffleState {
    in_flight: VecDeque<JoinHandle<Result<(), TransportError>>>,
    /// Partitions received, concatenated once.
    received: HashMap<String, Table>,
    /// The first failure that another attempt might not meet (a peer lost, pieces missing).
    retriable: Option<String>,
}

impl std::fmt::Debug for TaskShuffle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskShuffle")
            .field("job_id", &self.job_id)
            .field("mapper", &self.mapper)
            .field("attempt", &self.attempt)
            .field("sends", &self.sends.keys())
            .field("receives", &self.receives.keys())
            .finish()
    }
}

impl TaskShuffle {
    pub fn new(
        service: Arc<ShuffleService>,
        runtime: tokio::runtime::Handle,
        task: &wrk_proto::TaskId,
        sends: Vec<ExchangeTargets>,
        receives: Vec<ExchangeSource>,
    ) -> Self {
        TaskShuffle {
            service,
            runtime,
            job_id: task.job_id.clone(),
            mapper: task.index,
            attempt: task.attempt,
            sends: sends.into_iter().map(|s| (s.exchange.clone(), s)).collect(),
            receives: receives
                .into_iter()
                .map(|r| (r.exchange.clone(), r))
                .collect(),
            state: Mutex::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, TaskShuffleState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Notes a failure another attempt might not meet, and passes it on.
    fn noted(&self, error: ShuffleError) -> ShuffleError {
        if error.is_retriable() {
            self.state()
                .retriable
                .get_or_insert_with(|| error.to_string());
        }
        error
    }

    /// A shuffle failure of this attempt that a retry might not meet (set when the guest saw
    /// one, even if it turned it into its own error).
    pub fn retriable_failure(&self) -> Option<String> {
        self.state().retriable.clone()
    }

    /// Exchanges the task sends to, sorted.
    pub fn outgoing(&self) -> Vec<String> {
        let mut names: Vec<String> = self.sends.keys().cloned().collect();
        names.sort_unstable();
        names
    }

    fn targets(&self, exchange: &str) -> Result<&ExchangeTargets, ShuffleError> {
        self.sends
            .get(exchange)
            .ok_or_else(|| ShuffleError::NotSending {
                exchange: exchange.to_string(),
                known: names(self.sends.keys()),
            })
    }

    pub fn partitions(&self, exchange: &str) -> Result<u32, ShuffleError> {
        Ok(self.targets(exchange)?.partitions)
    }

    /// Sends `parts[i]` to the worker of partition i (skipping partitions this attempt does not
    /// send), without waiting for them to arrive unless too many deliveries are in flight.
    /// Called from the task's (blocking) thread.
    pub fn send(&self, exchange: &str, parts: Vec<Table>) -> Result<(), ShuffleError> {
        let targets = self.targets(exchange)?;
        if parts.len() != targets.partitions as usize
            || targets.partition_peer.len() != targets.partitions as usize
        {
            return Err(ShuffleError::PartitionCount {
                exchange: exchange.to_string(),
                expected: targets.partitions,
                got: parts.len(),
            });
        }
        let mut by_peer: Vec<Vec<(u32, Table)>> = vec![Vec::new(); targets.peers.len()];
        for (partition, table) in parts.into_iter().enumerate() {
            let peer = targets.partition_peer[partition] as usize;
            if let Some(pieces) = by_peer.get_mut(peer) {
                pieces.push((partition as u32, table));
            }
        }
        for (peer, pieces) in targets.peers.iter().zip(by_peer) {
            if pieces.is_empty() {
                continue;
            }
            self.wait_for_room()?;
            let delivery = Delivery {
                job_id: self.job_id.clone(),
                exchange: exchange.to_string(),
                mapper: self.mapper,
                attempt: self.attempt,
                pieces,
                complete: Vec::new(),
            };
            let (service, peer) = (self.service.clone(), peer.clone());
            let push = self
                .runtime
                .spawn(async move { service.deliver(&peer, delivery).await });
            self.state().in_flight.push_back(push);
        }
        Ok(())
    }

    /// Waits for the oldest deliveries while too many are in flight.
    fn wait_for_room(&self) -> Result<(), ShuffleError> {
        loop {
            let oldest = {
                let mut state = self.state();
                if state.in_flight.len() < MAX_IN_FLIGHT {
                    return Ok(());
                }
                state.in_flight.pop_front()
            };
            if let Some(push) = oldest {
                self.joined(self.runtime.block_on(push))?;
            }
        }
    }

    fn joined(
        &self,
        joined: Result<Result<(), TransportError>, tokio::task::JoinError>,
    ) -> Result<(), ShuffleError> {
        match joined {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(self.noted(e.into())),
            Err(e) => Err(ShuffleError::Pieces {
                exchange: String::new(),
                detail: format!("a delivery task failed: {e}"),
            }),
        }
    }

    /// Ends the mapper side after the guest returned: waits until every piece arrived, then
    /// tells each receiving worker this attempt is done with its partitions (those the guest
    /// sent nothing to included).
    pub async fn finish(&self) -> Result<(), ShuffleError> {
        loop {
            let next = self.state().in_flight.pop_front();
            match next {
                Some(push) => self.joined(push.await)?,
                None => break,
            }
        }
        let mut completions = Vec::new();
        for (exchange, targets) in &self.sends {
            let mut by_peer: Vec<Vec<u32>> = vec![Vec::new(); targets.peers.len()];
            for (partition, &peer) in targets.partition_peer.iter().enumerate() {
                if let Some(partitions) = by_peer.get_mut(peer as usize) {
                    partitions.push(partition as u32);
                }
            }
            for (peer, complete) in targets.peers.iter().zip(by_peer) {
                if complete.is_empty() {
                    continue;
                }
                let delivery = Delivery {
                    job_id: self.job_id.clone(),
                    exchange: exchange.clone(),
                    mapper: self.mapper,
                    attempt: self.attempt,
                    pieces: Vec::new(),
                    complete,
                };
                completions.push(self.service.deliver(peer, delivery));
            }
        }
        for result in futures::future::join_all(completions).await {
            result.map_err(|e| self.noted(e.into()))?;
        }
        Ok(())
    }

    fn source(&self, exchange: &str) -> Result<PartitionRef, ShuffleError> {
        let source = self
            .receives
            .get(exchange)
            .ok_or_else(|| ShuffleError::NotReceiving {
                exchange: exchange.to_string(),
                known: names(self.receives.keys()),
            })?;
        Ok(PartitionRef {
            job_id: self.job_id.clone(),
            exchange: exchange.to_string(),
            partition: source.partition,
        })
    }

    /// Checks, before the guest runs, that every partition the task receives is complete here.
    pub fn check_inputs(&self) -> Result<(), ShuffleError> {
        for (exchange, source) in &self.receives {
            self.service
                .store
                .check(&self.source(exchange)?, source.mappers)
                .map_err(|e| self.noted(e.into()))?;
        }
        Ok(())
    }

    /// This reducer's partition of `exchange`, every mapper's pieces concatenated (read back
    /// from disk where they spilled), counted in `memory`, the task's working set.
    pub fn receive(&self, exchange: &str, memory: &TaskMemory) -> Result<Table, ShuffleError> {
        if let Some(table) = self.state().received.get(exchange) {
            return Ok(table.clone());
        }
        let partition = self.source(exchange)?;
        let mappers = self.receives[exchange].mappers;
        let pieces = self
            .service
            .store
            .pieces(&partition, mappers, Some(memory))
            .map_err(|e| self.noted(e.into()))?;
        let pieces_err = |detail: String| ShuffleError::Pieces {
            exchange: exchange.to_string(),
            detail,
        };
        // Mappers that read a string column dictionary encoded and plain agree once decoded.
        let batches: Vec<&arrow::record_batch::RecordBatch> =
            pieces.iter().map(Table::batch).collect();
        let pieces =
            match crate::cpu::dictionary::unify(&batches).map_err(|e| pieces_err(e.to_string()))? {
                Some(unified) => unified.into_iter().map(Table::new).collect(),
                None => pieces,
            };
        let Some(first) = pieces.first() else {
            return Err(pieces_err(format!(
                "no mapper sent anything to partition {}: every mapper must call `send` (an empty table still carries the schema)",
                partition.partition
            )));
        };
        let schema = first.schema();
        if let Some(other) = pieces.iter().find(|p| p.schema() != schema) {
            return Err(pieces_err(format!(
                "mappers sent pieces with different schemas: {:?} and {:?}",
                schema.fields(),
                other.schema().fields()
            )));
        }
        let table = if pieces.len() == 1 {
            first.clone()
        } else {
            let batches: Vec<_> = pieces.iter().map(|p| p.batch().clone()).collect();
            Table::new(
                arrow::compute::concat_batches(&schema, &batches)
                    .map_err(|e| pieces_err(e.to_string()))?,
            )
        };
        memory
            .track(table.batch())
            .map_err(|e| self.noted(PieceError::from(e).into()))?;
        self.state()
            .received
            .insert(exchange.to_string(), table.clone());
        Ok(table)
    }

    /// This reducer's partition of `exchange` as a stream of its pieces (checked complete now,
    /// each piece read when taken).
    pub fn receive_pieces(&self, exchange: &str) -> Result<PieceStream, ShuffleError> {
        let partition = self.source(exchange)?;
        let mappers = self.receives[exchange].mappers;
        let ids = self
            .service
            .store
            .piece_ids(&partition, mappers)
            .map_err(|e| self.noted(e.into()))?;
        Ok(PieceStream {
            store: self.service.store.clone(),
            ids: ids.into(),
        })
    }

    /// Drops the partitions this task received, once it succeeded: no one else reads them.
    pub fn release_received(&self) {
        for exchange in self.receives.keys() {
            if let Ok(partition) = self.source(exchange) {
                self.service.store.release_partition(&partition);
            }
        }
    }
}

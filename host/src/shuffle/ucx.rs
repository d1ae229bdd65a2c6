//! The UCX shuffle transport (cargo feature `ucx`): deliveries travel as UCX active messages
//! between the workers' [`wrk_ucx::Ucx`] instances (shared memory on one host, the network
//! between hosts), each acknowledged once the receiver stored it, like the TCP transport.
//!
//! A message's UCX header is a kind byte (push or acknowledgement), a request id and, for a
//! push, the sender's UCX address (for the acknowledgement); its payload is a `u32` header
//! length, the `PushPieces` header, zeros up to the next multiple of [`PAYLOAD_ALIGN`] bytes and
//! the pieces' IPC streams (the TCP frame's contents), handed to UCX as an I/O vector over the
//! tables' own buffers ([`wrk_ucx::Ucx::send_segments`]). The receiver gets the frame in one of
//! its reusable blocks, every buffer at the offset (and so the alignment) it had in the IPC
//! stream, and decodes it in place.
//! Any UCX failure is returned to the caller, which falls back to TCP for that peer.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arrow::buffer::Buffer;
use bytes::Bytes;
use futures::future::BoxFuture;
use prost::Message as _;
use tokio::sync::{Mutex, oneshot};
use wrk_proto::{PushAck, PushPieces, ShufflePeer};
use wrk_ucx::{Incoming, ReceiveBuffer, ReceiveBuffers, Ucx, UcxConfig};

use super::pieces::PieceStore;
use super::tcp::{encode_off_thread, store_frame};
use super::transport::{Delivery, Transport, TransportError};
use crate::memory::buffers::{self, PooledVec};
use crate::metrics::WorkerMetrics;

/// The pieces' IPC streams start at a multiple of this many bytes into a push's payload, so
/// that in the receiver's block (aligned the same way) their buffers keep the IPC stream's
/// alignment and decode in place: a misaligned buffer would be copied to realign it.
const PAYLOAD_ALIGN: usize = 64;
const PUSH: u8 = 0;
const ACK: u8 = 1;
/// How long a delivery waits for its acknowledgement before the peer counts as failed.
const ACK_TIMEOUT: Duration = Duration::from_secs(20);
/// How long UCX may take to complete one send (a dead peer on shared memory never answers).
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// This worker's UCX endpoint for shuffles.
pub struct UcxTransport {
    ucx: Ucx,
    next_request: AtomicU64,
    waiting: Arc<Mutex<HashMap<u64, oneshot::Sender<PushAck>>>>,
}

impl UcxTransport {
    /// Starts UCX and the task that stores what peers push and answers them; Arrow buffers of
    /// `part_threshold` bytes or more go as their own rendezvous when given.
    pub fn start(
        store: Arc<PieceStore>,
        metrics: WorkerMetrics,
        part_threshold: Option<usize>,
    ) -> Result<Self, wrk_ucx::UcxError> {
        let config = UcxConfig {
            send_timeout: Some(SEND_TIMEOUT),
            receive_buffers: Some(Arc::new(ReusedBlocks)),
            part_threshold,
            ..UcxConfig::default()
        };
        let (ucx, incoming) = Ucx::start(config)?;
        let waiting: Arc<Mutex<HashMap<u64, oneshot::Sender<PushAck>>>> = Arc::default();
        tokio::spawn(receive(
            ucx.clone(),
            incoming,
            store,
            metrics,
            waiting.clone(),
        ));
        Ok(UcxTransport {
            ucx,
            next_request: AtomicU64::new(1),
            waiting,
        })
    }

    /// The address peers send to.
    pub fn address(&self) -> Vec<u8> {
        self.ucx.address().to_vec()
    }
}

/// Pushes are received into the worker's reusable blocks (resident, unlike a fresh allocation)
/// and the pieces decoded from them keep using the block, as over TCP.
#[derive(Debug)]
struct ReusedBlocks;

impl ReceiveBuffers for ReusedBlocks {
    fn allocate(&self, len: usize) -> Box<dyn ReceiveBuffer> {
        Box::new(ReusedBlock(PooledVec::with_capacity(
            buffers::global(),
            len,
        )))
    }
}

struct ReusedBlock(PooledVec<u8>);

// SAFETY: the vector was made with room for the `len` asked for; its unwritten tail is that
// room (a pooled block or a `Vec`'s heap memory), owned by the vector alone and never moved.
unsafe impl ReceiveBuffer for ReusedBlock {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        bytes::BufMut::chunk_mut(&mut self.0).as_mut_ptr()
    }

    unsafe fn finish(mut self: Box<Self>, len: usize) -> Bytes {
        // SAFETY: passed on from the caller: `len` bytes of the room were written.
        unsafe { bytes::BufMut::advance_mut(&mut self.0, len) };
        Bytes::from_owner(self.0.into_scalar_buffer().into_inner())
    }
}

fn header(kind: u8, request: u64, address: &[u8]) -> Vec<u8> {
    let mut header = Vec::with_capacity(9 + address.len());
    header.push(kind);
    header.extend_from_slice(&request.to_be_bytes());
    header.extend_from_slice(address);
    header
}

fn parse_header(header: &[u8]) -> Option<(u8, u64, &[u8])> {
    let (&kind, rest) = header.split_first()?;
    let (request, address) = rest.split_at_checked(8)?;
    Some((kind, u64::from_be_bytes(request.try_into().ok()?), address))
}

/// Stores pushes and answers them; completes the deliveries waiting for acknowledgements.
async fn receive(
    ucx: Ucx,
    mut incoming: Incoming,
    store: Arc<PieceStore>,
    metrics: WorkerMetrics,
    waiting: Arc<Mutex<HashMap<u64, oneshot::Sender<PushAck>>>>,
) {
    while let Some(message) = incoming.recv().await {
        let Some((kind, request, address)) = parse_header(&message.header) else {
            tracing::warn!("ignoring a UCX shuffle message with a malformed header");
            continue;
        };
        match kind {
            ACK => {
                if let Ok(ack) = PushAck::decode(message.payload)
                    && let Some(waiter) = waiting.lock().await.remove(&request)
                {
                    let _ = waiter.send(ack);
                }
            }
            PUSH => {
                metrics.count_shuffle("received", "ucx", message.payload.len());
                let address = address.to_vec();
                let stored = match split_payload(message.payload) {
                    Ok((header, payload)) => {
                        store_frame(store.clone(), header, Buffer::from(payload)).await
                    }
                    Err(e) => Err(e),
                };
                let ack = PushAck {
                    error: stored.err().unwrap_or_default(),
                }
                .encode_to_vec();
                if let Err(e) = ucx
                    .send(&address, header(ACK, request, &[]), Bytes::from(ack))
                    .await
                {
                    tracing::warn!("cannot acknowledge a UCX shuffle push: {e}");
                }
            }
            other => tracing::warn!("ignoring a UCX shuffle message of unknown kind {other}"),
        }
    }
}

/// The start of a push's payload: the `PushPieces` header's length and the header, padded to
/// [`PAYLOAD_ALIGN`].
fn frame_head(header: &[u8]) -> Vec<u8> {
    let len = (4 + header.len()).next_multiple_of(PAYLOAD_ALIGN);
    let mut head = Vec::with_capacity(len);
    head.extend_from_slice(&(header.len() as u32).to_be_bytes());
    head.extend_from_slice(header);
    head.resize(len, 0);
    head
}

/// A push's payload as its `PushPieces` header and the pieces' IPC streams.
fn split_payload(payload: Bytes) -> Result<(PushPieces, Bytes), String> {
    let length = payload
        .get(..4)
        .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or("a UCX shuffle push shorter than its header length")?;
    let header = payload
        .get(4..4 + length)
        .ok_or("a UCX shuffle push shorter than its header")?;
    let header = PushPieces::decode(header)
        .map_err(|e| format!("a shuffle frame header is not valid: {e}"))?;
    let start = (4 + length).next_multiple_of(PAYLOAD_ALIGN);
    if start > payload.len() {
        return Err("a UCX shuffle push shorter than its padded header".into());
    }
    Ok((header, payload.slice(start..)))
}

impl Transport for UcxTransport {
    fn name(&self) -> &'static str {
        "ucx"
    }

    fn deliver<'a>(
        &'a self,
        peer: &'a ShufflePeer,
        delivery: Delivery,
    ) -> BoxFuture<'a, Result<u64, TransportError>> {
        Box::pin(async move {
            let send_err = |detail: String| TransportError::Send {
                worker: peer.worker_id.clone(),
                transport: "ucx",
                detail,
            };
            let encoded = encode_off_thread(delivery, peer, "ucx").await?;
            let piece_bytes = encoded.payload_len();
            // The frame's header, then the tables' own buffers: UCX gathers them, no copy.
            let mut segments = Vec::with_capacity(1 + encoded.payload.len());
            segments.push(Bytes::from(frame_head(&encoded.header)));
            segments.extend(encoded.payload.into_iter().map(Bytes::from_owner));
            let request = self.next_request.fetch_add(1, Ordering::Relaxed);
            let (answer, acknowledged) = oneshot::channel();
            self.waiting.lock().await.insert(request, answer);
            let sent = self
                .ucx
                .send_segments(
                    &peer.ucx_address,
                    header(PUSH, request, self.ucx.address()),
                    segments,
                )
                .await;
            if let Err(e) = sent {
                self.waiting.lock().await.remove(&request);
                return Err(send_err(e.to_string()));
            }
            let ack = match tokio::time::timeout(ACK_TIMEOUT, acknowledged).await {
                Ok(Ok(ack)) => ack,
                Ok(Err(_)) | Err(_) => {
                    self.waiting.lock().await.remove(&request);
                    return Err(send_err(format!(
                        "no acknowledgement within {ACK_TIMEOUT:?}"
                    )));
                }
            };
            if !ack.error.is_empty() {
                return Err(TransportError::Refused {
                    worker: peer.worker_id.clone(),
                    detail: ack.error,
                });
            }
            Ok(piece_bytes)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shuffle::pieces::tests::{part, piece_store, values};
    use crate::table::Table;
    use arrow::array::{Float64Array, Int64Array};
    use arrow::record_batch::RecordBatch;

    fn table(rows: i64) -> Table {
        Table::new(
            RecordBatch::try_from_iter([
                ("k", Arc::new(Int64Array::from_iter_values(0..rows)) as _),
                (
                    "v",
                    Arc::new(Float64Array::from_iter_values((0..rows).map(|r| r as f64))) as _,
                ),
            ])
            .unwrap(),
        )
    }

    #[test]
    fn the_pieces_start_aligned_after_any_header_and_short_pushes_are_refused() {
        for len in [0usize, 1, 59, 60, 61, 123, 124, 125, 1000] {
            let header = PushPieces {
                job_id: "j".repeat(len),
                ..PushPieces::default()
            };
            let encoded = header.encode_to_vec();
            let head = frame_head(&encoded);
            assert_eq!(
                head.len() % PAYLOAD_ALIGN,
                0,
                "header of {} bytes",
                encoded.len()
            );
            let payload = Bytes::from([head.clone(), b"ipc".to_vec()].concat());
            let (decoded, pieces) = split_payload(payload).unwrap();
            assert_eq!(decoded, header);
            assert_eq!(&pieces[..], b"ipc");
            // Cut inside the padding or the header: refused, never a panic.
            let short = Bytes::from(head[..head.len() - 1].to_vec());
            assert!(split_payload(short).is_err());
            let short = Bytes::from(head[..4 + encoded.len() / 2].to_vec());
            assert!(split_payload(short).is_err());
        }
        assert!(split_payload(Bytes::from_static(b"\0\0")).is_err());
        assert!(split_payload(Bytes::from_static(b"\xff\xff\xff\xff")).is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pieces_with_large_buffers_arrive_intact_and_are_acknowledged() {
        deliver_large_buffers(None).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pieces_sent_one_rendezvous_per_large_buffer_arrive_intact() {
        deliver_large_buffers(Some(1 << 20)).await;
    }

    async fn deliver_large_buffers(part_threshold: Option<usize>) {
        let metrics = || WorkerMetrics::new(crate::metrics::compile_cache_counter());
        let (sender_store, _sender_dir) = piece_store(1 << 30);
        let (store, _dir) = piece_store(1 << 30);
        let store = Arc::new(store);
        let sender =
            UcxTransport::start(Arc::new(sender_store), metrics(), part_threshold).unwrap();
        let receiver = UcxTransport::start(store.clone(), metrics(), part_threshold).unwrap();
        let peer = ShufflePeer {
            worker_id: "reducer-worker".into(),
            tcp_address: String::new(),
            ucx_address: receiver.address(),
        };
        // 1 M rows: two 8 MiB buffers (rendezvous); 3 and 5 rows: a few bytes each.
        let delivery = Delivery {
            job_id: "job-000001".into(),
            exchange: "by-key".into(),
            mapper: 0,
            attempt: 1,
            pieces: vec![(0, table(1 << 20)), (1, table(3)), (0, table(5))],
            complete: vec![0, 1],
        };
        let sent = sender.deliver(&peer, delivery).await.unwrap();
        assert!(sent > 16 << 20, "{sent} bytes");
        assert_eq!(store.stats().pieces, 3);
        let first = values(&store.pieces(&part(0), 1, None).unwrap());
        let expected: Vec<i64> = (0..1 << 20).chain(0..5).collect();
        assert!(first == expected, "partition 0 corrupted");
        assert_eq!(values(&store.pieces(&part(1), 1, None).unwrap()), [0, 1, 2]);
        sender.ucx.shutdown().await;
        receiver.ucx.shutdown().await;
    }
}

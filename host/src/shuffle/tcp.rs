//! The TCP shuffle transport: each worker listens on a shuffle port; a mapper's worker keeps a
//! few connections per peer and writes framed deliveries, each acknowledged once stored.
//!
//! A connection starts with a challenge: the receiver sends a random nonce and the sender
//! answers with HMAC-SHA256(worker token, nonce) (zeros in a cluster without a token). Then
//! each frame is `u32` header length, a `PushPieces` header (protobuf), `u64` payload length and
//! the payload (the pieces' Arrow IPC streams back to back); the receiver answers every frame
//! with a length-prefixed `PushAck`.
//!
//! Neither side copies the data: the sender writes the IPC messages' headers and the tables'
//! own Arrow buffers to the socket with vectored writes, and the receiver reads the payload into
//! one block of the worker's reusable buffers (already resident, no page faults) and decodes
//! the pieces in place.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use std::io::IoSlice;

use arrow::buffer::Buffer;
use bytes::BufMut;
use futures::future::BoxFuture;
use hmac::{KeyInit, Mac};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use wrk_proto::{PieceMeta, PushAck, PushPieces, ShufflePeer};

use super::pieces::PieceStore;
use super::transport::{Delivery, Transport, TransportError};
use crate::memory::buffers::{self, PooledVec};
use crate::metrics::WorkerMetrics;
use crate::table::{Table, decode_ipc_buffer, ipc_segments};

const NONCE_BYTES: usize = 32;
/// Headers name pieces and partitions, never data: anything larger is not a sender of ours.
const MAX_HEADER_BYTES: u32 = 64 << 20;
/// Idle connections kept per peer.
const IDLE_PER_PEER: usize = 8;
/// Slices handed to one vectored write (Linux's `IOV_MAX`).
const MAX_SLICES: usize = 1024;

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

fn proof(secret: Option<&[u8]>, nonce: &[u8]) -> [u8; 32] {
    let Some(secret) = secret else {
        return [0; 32];
    };
    let mut mac = <HmacSha256 as KeyInit>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    mac.update(b"wrk-shuffle/");
    mac.update(nonce);
    mac.finalize().into_bytes().into()
}

fn proof_is_valid(secret: &[u8], nonce: &[u8], answer: &[u8]) -> bool {
    let Ok(mut mac) = <HmacSha256 as KeyInit>::new_from_slice(secret) else {
        return false;
    };
    mac.update(b"wrk-shuffle/");
    mac.update(nonce);
    mac.verify_slice(answer).is_ok()
}

/// Serves the shuffle port: stores what peers deliver in `store`.
pub struct TcpReceiver {
    pub store: Arc<PieceStore>,
    /// The cluster's worker token, when it has one: senders must prove they hold it.
    pub secret: Option<Vec<u8>>,
    pub metrics: WorkerMetrics,
}

impl TcpReceiver {
    /// Accepts connections until the task is aborted.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!("shuffle listener: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let receiver = self.clone();
            tokio::spawn(async move {
                if let Err(e) = receiver.connection(stream).await {
                    tracing::warn!(%peer, "shuffle connection closed: {e}");
                }
            });
        }
    }

    async fn connection(&self, mut stream: TcpStream) -> std::io::Result<()> {
        stream.set_nodelay(true)?;
        let nonce: [u8; NONCE_BYTES] = rand::random();
        stream.write_all(&nonce).await?;
        let mut answer = [0u8; 32];
        stream.read_exact(&mut answer).await?;
        if let Some(secret) = &self.secret
            && !proof_is_valid(secret, &nonce, &answer)
        {
            write_ack(
                &mut stream,
                "the sender did not prove it holds the cluster's worker token",
            )
            .await?;
            return Ok(());
        }
        write_ack(&mut stream, "").await?;
        loop {
            let header_len = match stream.read_u32().await {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            };
            if header_len > MAX_HEADER_BYTES {
                write_ack(&mut stream, "a shuffle frame header over 64 MiB").await?;
                return Ok(());
            }
            let mut header = vec![0u8; header_len as usize];
            stream.read_exact(&mut header).await?;
            let payload_len = stream.read_u64().await?;
            let payload = read_payload(&mut stream, payload_len).await?;
            self.metrics
                .count_shuffle("received", "tcp", payload_len as usize);
            let error = match PushPieces::decode(header.as_slice()) {
                Ok(header) => store_frame(self.store.clone(), header, payload).await.err(),
                Err(e) => Some(format!("a shuffle frame header is not valid: {e}")),
            };
            write_ack(&mut stream, error.as_deref().unwrap_or("")).await?;
        }
    }
}

/// Reads `length` bytes into one reusable block (a fresh allocation would fault in every page).
async fn read_payload(stream: &mut TcpStream, length: u64) -> std::io::Result<Buffer> {
    let length = usize::try_from(length)
        .map_err(|_| std::io::Error::other("a shuffle frame larger than this machine's memory"))?;
    let mut payload = PooledVec::<u8>::with_capacity(buffers::global(), length);
    while payload.len() < length {
        let missing = length - payload.len();
        let mut rest = (&mut payload).limit(missing);
        if stream.read_buf(&mut rest).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(payload.into_scalar_buffer().into_inner())
}

/// Decodes a received frame's pieces and stores them, off the async threads; the error is what
/// the acknowledgement tells the sender (any transport's).
pub(super) async fn store_frame(
    store: Arc<PieceStore>,
    header: PushPieces,
    payload: Buffer,
) -> Result<(), String> {
    tokio::task::spawn_blocking(move || {
        let delivery = decode_delivery(header, payload)?;
        delivery.store_in(&store).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| format!("storing shuffle pieces: {e}"))?
}

/// The pieces of a frame, decoded.
fn decode_delivery(header: PushPieces, payload: Buffer) -> Result<Delivery, String> {
    let declared: u64 = header.pieces.iter().map(|p| p.bytes).sum();
    if declared != payload.len() as u64 {
        return Err(format!(
            "the frame declares {declared} bytes of pieces but carries {}",
            payload.len()
        ));
    }
    let mut offset = 0usize;
    let mut pieces = Vec::with_capacity(header.pieces.len());
    for meta in &header.pieces {
        let bytes = payload.slice_with_length(offset, meta.bytes as usize);
        offset += meta.bytes as usize;
        let batch = decode_ipc_buffer(bytes).map_err(|e| {
            format!(
                "the piece of partition {} from mapper {} of exchange `{}` is not a valid Arrow IPC stream: {e}",
                meta.partition, header.mapper, header.exchange
            )
        })?;
        pieces.push((meta.partition, Table::new(batch)));
    }
    Ok(Delivery {
        job_id: header.job_id,
        exchange: header.exchange,
        mapper: header.mapper,
        attempt: header.attempt,
        pieces,
        complete: header.complete,
    })
}

async fn write_ack(stream: &mut TcpStream, error: &str) -> std::io::Result<()> {
    let ack = PushAck {
        error: error.to_string(),
    }
    .encode_to_vec();
    let mut frame = Vec::with_capacity(4 + ack.len());
    frame.extend_from_slice(&(ack.len() as u32).to_be_bytes());
    frame.extend_from_slice(&ack);
    stream.write_all(&frame).await
}

async fn read_ack(stream: &mut TcpStream) -> std::io::Result<PushAck> {
    let len = stream.read_u32().await?;
    if len > MAX_HEADER_BYTES {
        return Err(std::io::Error::other("an acknowledgement over 64 MiB"));
    }
    let mut bytes = vec![0u8; len as usize];
    stream.read_exact(&mut bytes).await?;
    PushAck::decode(bytes.as_slice()).map_err(std::io::Error::other)
}

/// Delivers pieces to peers' shuffle ports, reusing connections.
#[derive(Default)]
pub struct TcpSender {
    secret: Option<Vec<u8>>,
    idle: Mutex<HashMap<String, Vec<TcpStream>>>,
}

impl TcpSender {
    pub fn new(secret: Option<Vec<u8>>) -> Self {
        TcpSender {
            secret,
            idle: Mutex::default(),
        }
    }

    async fn connection(&self, peer: &ShufflePeer) -> Result<TcpStream, TransportError> {
        let reused = self
            .idle
            .lock()
            .ok()
            .and_then(|mut idle| idle.get_mut(&peer.tcp_address).and_then(Vec::pop));
        if let Some(stream) = reused {
            return Ok(stream);
        }
        let connect_err = |detail: String| TransportError::Connect {
            worker: peer.worker_id.clone(),
            address: peer.tcp_address.clone(),
            detail,
        };
        let mut stream = TcpStream::connect(&peer.tcp_address)
            .await
            .map_err(|e| connect_err(e.to_string()))?;
        stream
            .set_nodelay(true)
            .map_err(|e| connect_err(e.to_string()))?;
        let mut nonce = [0u8; NONCE_BYTES];
        stream
            .read_exact(&mut nonce)
            .await
            .map_err(|e| connect_err(e.to_string()))?;
        stream
            .write_all(&proof(self.secret.as_deref(), &nonce))
            .await
            .map_err(|e| connect_err(e.to_string()))?;
        let ack = read_ack(&mut stream)
            .await
            .map_err(|e| connect_err(e.to_string()))?;
        if !ack.error.is_empty() {
            return Err(TransportError::Refused {
                worker: peer.worker_id.clone(),
                detail: ack.error,
            });
        }
        Ok(stream)
    }

    fn keep(&self, peer: &ShufflePeer, stream: TcpStream) {
        if let Ok(mut idle) = self.idle.lock() {
            let streams = idle.entry(peer.tcp_address.clone()).or_default();
            if streams.len() < IDLE_PER_PEER {
                streams.push(stream);
            }
        }
    }
}

/// A delivery ready for the wire: the frame header (protobuf) and the payload as the segments
/// of the pieces' IPC streams, in order.
pub struct EncodedDelivery {
    pub header: Vec<u8>,
    pub payload: Vec<Buffer>,
}

impl EncodedDelivery {
    pub fn payload_len(&self) -> u64 {
        self.payload.iter().map(|b| b.len() as u64).sum()
    }
}

/// Encodes a delivery as a frame header and its payload, without copying the tables' data.
pub fn encode_delivery(delivery: &Delivery) -> Result<EncodedDelivery, String> {
    let mut metas = Vec::with_capacity(delivery.pieces.len());
    let mut payload = Vec::with_capacity(delivery.pieces.len() * 8);
    for (partition, table) in &delivery.pieces {
        let segments = ipc_segments(table.batch()).map_err(|e| {
            format!("encoding the piece of partition {partition} as Arrow IPC: {e}")
        })?;
        metas.push(PieceMeta {
            partition: *partition,
            bytes: segments.iter().map(|b| b.len() as u64).sum(),
            rows: table.num_rows() as u64,
        });
        payload.extend(segments);
    }
    let header = PushPieces {
        job_id: delivery.job_id.clone(),
        exchange: delivery.exchange.clone(),
        mapper: delivery.mapper,
        attempt: delivery.attempt,
        pieces: metas,
        complete: delivery.complete.clone(),
    }
    .encode_to_vec();
    Ok(EncodedDelivery { header, payload })
}

/// [`encode_delivery`] off the async threads (sliced or dictionary columns make the encoder do
/// real work), its failures in the words of `transport`'s send errors to `peer`.
pub(super) async fn encode_off_thread(
    delivery: Delivery,
    peer: &ShufflePeer,
    transport: &'static str,
) -> Result<EncodedDelivery, TransportError> {
    let send_err = |detail: String| TransportError::Send {
        worker: peer.worker_id.clone(),
        transport,
        detail,
    };
    tokio::task::spawn_blocking(move || encode_delivery(&delivery))
        .await
        .map_err(|e| send_err(e.to_string()))?
        .map_err(send_err)
}

/// Writes every slice, as few system calls as the socket takes.
async fn write_all_vectored(stream: &mut TcpStream, parts: &[&[u8]]) -> std::io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = parts
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| IoSlice::new(p))
        .collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let count = rest.len().min(MAX_SLICES);
        let written = stream.write_vectored(&rest[..count]).await?;
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut rest, written);
    }
    Ok(())
}

impl Transport for TcpSender {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn deliver<'a>(
        &'a self,
        peer: &'a ShufflePeer,
        delivery: Delivery,
    ) -> BoxFuture<'a, Result<u64, TransportError>> {
        Box::pin(async move {
            let send_err = |detail: String| TransportError::Send {
                worker: peer.worker_id.clone(),
                transport: "tcp",
                detail,
            };
            let encoded = encode_off_thread(delivery, peer, "tcp").await?;
            let payload_len = encoded.payload_len();
            let mut stream = self.connection(peer).await?;
            let header_len = (encoded.header.len() as u32).to_be_bytes();
            let payload_len_bytes = payload_len.to_be_bytes();
            let mut parts: Vec<&[u8]> = Vec::with_capacity(3 + encoded.payload.len());
            parts.extend([&header_len[..], &encoded.header, &payload_len_bytes]);
            parts.extend(encoded.payload.iter().map(|b| b.as_slice()));
            let written = async {
                write_all_vectored(&mut stream, &parts).await?;
                read_ack(&mut stream).await
            }
            .await
            .map_err(|e| send_err(e.to_string()))?;
            if !written.error.is_empty() {
                return Err(TransportError::Refused {
                    worker: peer.worker_id.clone(),
                    detail: written.error,
                });
            }
            self.keep(peer, stream);
            Ok(payload_len)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shuffle::pieces::tests::{part, piece_store, values};
    use arrow::array::{Int64Array, StringArray};

    fn table(keys: &[i64], names: &[&str]) -> Table {
        Table::new(
            arrow::record_batch::RecordBatch::try_from_iter([
                ("k", Arc::new(Int64Array::from(keys.to_vec())) as _),
                ("s", Arc::new(StringArray::from(names.to_vec())) as _),
            ])
            .unwrap(),
        )
    }

    async fn receiver(secret: Option<&[u8]>) -> (Arc<PieceStore>, ShufflePeer, tempfile::TempDir) {
        let (store, dir) = piece_store(1 << 30);
        let store = Arc::new(store);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let receiver = Arc::new(TcpReceiver {
            store: store.clone(),
            secret: secret.map(<[u8]>::to_vec),
            metrics: WorkerMetrics::new(crate::metrics::compile_cache_counter()),
        });
        tokio::spawn(receiver.serve(listener));
        let peer = ShufflePeer {
            worker_id: "reducer-worker".into(),
            tcp_address: address,
            ucx_address: Vec::new(),
        };
        (store, peer, dir)
    }

    fn delivery(attempt: u32) -> Delivery {
        Delivery {
            job_id: "job-000001".into(),
            exchange: "by-key".into(),
            mapper: 3,
            attempt,
            pieces: vec![
                (0, table(&[1, 2], &["a", "b"])),
                (2, table(&[5], &["e"])),
                (0, table(&[], &[])),
            ],
            complete: vec![0, 1, 2],
        }
    }

    #[tokio::test]
    async fn deliveries_arrive_intact_over_reused_connections() {
        let (store, peer, _dir) = receiver(Some(b"token")).await;
        let sender = TcpSender::new(Some(b"token".to_vec()));
        assert!(sender.deliver(&peer, delivery(1)).await.unwrap() > 0);
        // The second delivery reuses the connection; the newer attempt replaces the first.
        sender.deliver(&peer, delivery(2)).await.unwrap();
        assert_eq!(sender.idle.lock().unwrap()[&peer.tcp_address].len(), 1);
        assert_eq!(store.stats().pieces, 3, "attempt 2 replaced attempt 1");
        let err = store.check(&part(0), 4).unwrap_err().to_string();
        assert!(err.contains("mapper(s) 0, 1, 2 of 4"), "{err}");
        // Only mapper 3 sent here: complete the others' (empty) slots to read the partitions.
        for partition in 0..3 {
            for mapper in 0..3 {
                store.complete(&part(partition), mapper, 1).unwrap();
            }
        }
        assert_eq!(values(&store.pieces(&part(0), 4, None).unwrap()), [1, 2]);
        assert!(store.pieces(&part(1), 4, None).unwrap().is_empty());
        assert_eq!(values(&store.pieces(&part(2), 4, None).unwrap()), [5]);
    }

    #[tokio::test]
    async fn a_sender_without_the_token_is_refused() {
        let (store, peer, _dir) = receiver(Some(b"token")).await;
        let sender = TcpSender::new(Some(b"guess".to_vec()));
        let err = sender.deliver(&peer, delivery(1)).await.unwrap_err();
        assert!(
            err.to_string()
                .contains("did not prove it holds the cluster's worker token"),
            "{err}"
        );
        assert_eq!(store.stats().pieces, 0);
        let err = TcpSender::new(None)
            .deliver(&peer, delivery(1))
            .await
            .unwrap_err();
        assert!(matches!(err, TransportError::Refused { .. }), "{err}");
    }

    #[tokio::test]
    async fn an_unreachable_peer_is_named() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        drop(listener);
        let peer = ShufflePeer {
            worker_id: "gone".into(),
            tcp_address: address.clone(),
            ucx_address: Vec::new(),
        };
        let err = TcpSender::new(None)
            .deliver(&peer, delivery(1))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("worker gone at {address}")), "{err}");
    }

    #[test]
    fn a_truncated_frame_is_refused_with_the_piece_named() {
        let encoded = encode_delivery(&delivery(1)).unwrap();
        let header = PushPieces::decode(encoded.header.as_slice()).unwrap();
        let mut bytes: Vec<u8> = encoded
            .payload
            .iter()
            .flat_map(|b| b.as_slice().to_vec())
            .collect();
        let err = decode_delivery(header.clone(), Buffer::from(bytes[..10].to_vec())).unwrap_err();
        assert!(err.contains("declares"), "{err}");
        // Corrupt the first piece's body, keep the length.
        let first = header.pieces[0].bytes as usize;
        for b in &mut bytes[8..first] {
            *b = 0xff;
        }
        let err = decode_delivery(header, Buffer::from(bytes)).unwrap_err();
        assert!(
            err.contains("partition 0 from mapper 3 of exchange `by-key`"),
            "{err}"
        );
    }
}

//! Payloads sent in parts (large segments as rendezvous of their own, small ones gathered):
//! they arrive intact, in one receive buffer, aligned as they were sent and in order per sender;
//! messages over the size limit are refused on both sides.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use wrk_ucx::{Incoming, Message, ReceiveBuffer, ReceiveBuffers, Ucx, UcxConfig, UcxError};

fn config() -> UcxConfig {
    UcxConfig {
        send_timeout: Some(Duration::from_secs(10)),
        ..UcxConfig::default()
    }
}

fn over(transports: Option<&str>) -> UcxConfig {
    UcxConfig {
        transports: transports.map(str::to_string),
        ..config()
    }
}

async fn recv(incoming: &mut Incoming) -> Message {
    tokio::time::timeout(Duration::from_secs(60), incoming.recv())
        .await
        .expect("message within 60 s")
        .expect("receiver still running")
}

/// Receive buffers of 64-byte aligned memory with a guard word past the room asked for, and a
/// count of the buffers made.
#[derive(Debug, Default)]
struct Aligned(AtomicUsize);

const GUARD: u64 = 0xABAB_ABAB_ABAB_ABAB;

#[repr(align(64))]
#[derive(Clone, Copy)]
struct Line([u64; 8]);

struct AlignedBuffer {
    lines: Vec<Line>,
    room: usize,
}

impl AlignedBuffer {
    fn guard(&self) -> u64 {
        let words = self.lines.len() * 8;
        self.lines[(words - 1) / 8].0[(words - 1) % 8]
    }
}

impl AsRef<[u8]> for AlignedBuffer {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the lines are plain initialised memory of at least `room` bytes.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), self.room) }
    }
}

// SAFETY: the lines hold `room` bytes plus a guard word, owned by the vector, never moved.
unsafe impl ReceiveBuffer for AlignedBuffer {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.lines.as_mut_ptr().cast::<u8>()
    }

    unsafe fn finish(mut self: Box<Self>, len: usize) -> Bytes {
        assert_eq!(self.guard(), GUARD, "UCX wrote past the room it was given");
        self.room = len;
        Bytes::from_owner(*self)
    }
}

impl ReceiveBuffers for Aligned {
    fn allocate(&self, len: usize) -> Box<dyn ReceiveBuffer> {
        self.0.fetch_add(1, Ordering::Relaxed);
        let lines = (len + 8).div_ceil(64);
        let mut lines = vec![Line([0; 8]); lines];
        let words = lines.len() * 8;
        lines[(words - 1) / 8].0[(words - 1) % 8] = GUARD;
        Box::new(AlignedBuffer { lines, room: len })
    }
}

fn segments(index: u64, shape: &[usize]) -> Vec<Bytes> {
    shape
        .iter()
        .enumerate()
        .map(|(j, &size)| common::pattern(index * 100 + j as u64, size))
        .collect()
}

fn joined(index: u64, shape: &[usize]) -> Vec<u8> {
    segments(index, shape).concat()
}

/// Arrow-like shapes: small headers between large buffers whose lengths are multiples of 64.
/// With a 4 KiB part threshold the 5 KiB parts go eagerly, the megabyte ones by rendezvous.
const SHAPES: [&[usize]; 5] = [
    &[200, 5 << 10, 72, 5 << 10, 8],
    &[136, 2 << 20, 0, 64, 2 << 20, 8],
    &[8 << 20, 5 << 10, 3, 1 << 20],
    &[96, 3 << 20, 5 << 10],
    &[10, 20, 30],
];

/// Whether a payload of `shape` goes in parts with a 4 KiB threshold.
fn in_parts(shape: &[usize]) -> bool {
    shape.iter().any(|&s| s >= 4 << 10)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parts_of_eager_and_rendezvous_sizes_arrive_intact_and_aligned() {
    parts_arrive(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parts_arrive_intact_and_aligned_over_tcp() {
    parts_arrive(Some("tcp")).await;
}

async fn parts_arrive(transports: Option<&str>) {
    let buffers = Arc::new(Aligned::default());
    let small_parts = UcxConfig {
        part_threshold: Some(4 << 10),
        ..over(transports)
    };
    let (a, _a_in) = Ucx::start(small_parts.clone()).unwrap();
    let (c, _c_in) = Ucx::start(small_parts).unwrap();
    let (b, mut b_in) = Ucx::start(UcxConfig {
        receive_buffers: Some(buffers.clone()),
        ..over(transports)
    })
    .unwrap();
    // Two senders, each with every message in flight at once: parts of different messages
    // interleave on the receiver.
    let sends = |from: &Ucx, sender: u8| {
        let to = b.address().to_vec();
        let from = from.clone();
        futures::future::try_join_all((0u64..).zip(SHAPES).map(move |(i, shape)| {
            let (from, to) = (from.clone(), to.clone());
            async move {
                let index = i + u64::from(sender) * 10;
                from.send_segments(&to, vec![sender, i as u8], segments(index, shape))
                    .await
            }
        }))
    };
    let (ra, rc) = tokio::join!(sends(&a, 1), sends(&c, 2));
    ra.unwrap();
    rc.unwrap();
    let mut next = [0usize; 3];
    for _ in 0..2 * SHAPES.len() {
        let message = recv(&mut b_in).await;
        let [sender, i] = message.header[..] else {
            panic!("unexpected header {:?}", message.header);
        };
        let sender = usize::from(sender);
        assert_eq!(
            usize::from(i),
            next[sender],
            "sender {sender}: out of order"
        );
        next[sender] += 1;
        let shape = SHAPES[usize::from(i)];
        let index = u64::from(i) + sender as u64 * 10;
        assert!(
            message.payload == joined(index, shape),
            "sender {sender}: message {i} corrupted"
        );
        if in_parts(shape) {
            assert_eq!(
                message.payload.as_ptr() as usize % 64,
                0,
                "message {i} not in the receive buffer's aligned memory"
            );
        }
    }
    assert_eq!(next, [0, SHAPES.len(), SHAPES.len()]);
    // One buffer per message sent in parts, whatever its number of parts.
    let split = SHAPES.iter().filter(|shape| in_parts(shape)).count();
    assert_eq!(split, 4);
    assert_eq!(buffers.0.load(Ordering::Relaxed), 2 * split);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_over_the_limit_are_refused() {
    let buffers = Arc::new(Aligned::default());
    let in_parts = UcxConfig {
        part_threshold: Some(4 << 10),
        ..config()
    };
    let (a, _a_in) = Ucx::start(in_parts.clone()).unwrap();
    let (b, mut b_in) = Ucx::start(UcxConfig {
        receive_buffers: Some(buffers.clone()),
        max_message_bytes: 3 << 20,
        ..in_parts
    })
    .unwrap();
    // The sender's own limit refuses at once.
    let err = b
        .send_segments(a.address(), vec![], segments(0, &[100, 4 << 20]))
        .await
        .unwrap_err();
    assert!(
        matches!(err, UcxError::MessageTooLarge { len, max } if len == (4 << 20) + 100 && max == 3 << 20),
        "{err}"
    );
    // The receiver refuses a larger message, whole or in parts, before allocating for it,
    // and goes on with the next.
    let shape: &[usize] = &[64, 1 << 20, 8, 1 << 20, 8];
    a.send(b.address(), b"whole".to_vec(), common::pattern(1, 4 << 20))
        .await
        .unwrap();
    a.send_segments(b.address(), b"parts".to_vec(), segments(2, &[64, 4 << 20]))
        .await
        .unwrap();
    a.send_segments(b.address(), b"fits".to_vec(), segments(3, shape))
        .await
        .unwrap();
    let message = recv(&mut b_in).await;
    assert_eq!(message.header, b"fits");
    assert!(message.payload == joined(3, shape), "payload corrupted");
    assert_eq!(buffers.0.load(Ordering::Relaxed), 1);
}

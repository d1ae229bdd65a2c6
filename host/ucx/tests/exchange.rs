//! Two `Ucx` instances in one process: payloads of all sizes arrive intact and in order, many
//! concurrent sends keep per-sender order, and failures are errors, never hangs.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use wrk_ucx::{Incoming, Message, Ucx, UcxConfig, UcxError};

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

fn config(transports: Option<&str>) -> UcxConfig {
    UcxConfig {
        transports: transports.map(str::to_string),
        send_timeout: Some(Duration::from_secs(5)),
        ..UcxConfig::default()
    }
}

async fn recv(incoming: &mut Incoming) -> Message {
    tokio::time::timeout(Duration::from_secs(60), incoming.recv())
        .await
        .expect("message within 60 s")
        .expect("receiver still running")
}

fn header(index: u64) -> Vec<u8> {
    format!("piece-{index}").into_bytes()
}

async fn sizes_round_trip(transports: Option<&str>) {
    init_tracing();
    let (a, mut a_in) = Ucx::start(config(transports)).unwrap();
    let (b, mut b_in) = Ucx::start(config(transports)).unwrap();
    let sizes = [0usize, 1024, 8 << 20, 64 << 20, 0, 3];
    for (i, &size) in sizes.iter().enumerate() {
        let i = i as u64;
        a.send(b.address(), header(i), common::pattern(i, size))
            .await
            .unwrap();
    }
    for (i, &size) in sizes.iter().enumerate() {
        let message = recv(&mut b_in).await;
        assert_eq!(message.header, header(i as u64));
        assert_eq!(message.payload.len(), size);
        assert!(
            message.payload == common::pattern(i as u64, size),
            "payload {i} corrupted"
        );
    }
    // And back, with the sends pipelined rather than one at a time.
    let sends = sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| a_send(&b, a.address(), i as u64, size));
    futures::future::try_join_all(sends).await.unwrap();
    for (i, &size) in sizes.iter().enumerate() {
        let message = recv(&mut a_in).await;
        assert_eq!(message.header, header(i as u64));
        assert!(
            message.payload == common::pattern(i as u64, size),
            "payload {i} corrupted"
        );
    }
    a.shutdown().await;
    b.shutdown().await;
    assert!(b_in.recv().await.is_none(), "incoming ends after shutdown");
}

async fn a_send(from: &Ucx, to: &[u8], index: u64, size: usize) -> Result<(), UcxError> {
    from.send(to, header(index), common::pattern(index, size))
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sizes_arrive_intact_and_in_order_default_transports() {
    sizes_round_trip(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sizes_arrive_intact_and_in_order_over_tcp() {
    sizes_round_trip(Some("tcp")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sizes_arrive_intact_and_in_order_over_shared_memory() {
    sizes_round_trip(Some("posix,sysv,cma,self")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_sends_keep_per_sender_order() {
    init_tracing();
    let (a, _a_in) = Ucx::start(config(None)).unwrap();
    let (c, _c_in) = Ucx::start(config(None)).unwrap();
    let (b, mut b_in) = Ucx::start(config(None)).unwrap();
    const N: u64 = 300;
    // Mixed sizes: eager, medium, and rendezvous every 50th message.
    let size = |i: u64| {
        if i % 50 == 49 {
            4 << 20
        } else {
            (i as usize * 977) % (200 << 10)
        }
    };
    let sends_from = |from: &Ucx, tag: u8| {
        let from = from.clone();
        let to = b.address().to_vec();
        (0..N).map(move |i| {
            let from = from.clone();
            let to = to.clone();
            async move {
                let mut header = vec![tag];
                header.extend_from_slice(&i.to_le_bytes());
                from.send(
                    &to,
                    header,
                    common::pattern(i + u64::from(tag) * 1000, size(i)),
                )
                .await
            }
        })
    };
    // join_all polls the futures in order, so each sender queues its messages in index order;
    // both senders run at the same time.
    let (ra, rc) = tokio::join!(
        futures::future::join_all(sends_from(&a, 1)),
        futures::future::join_all(sends_from(&c, 2)),
    );
    for result in ra.into_iter().chain(rc) {
        result.unwrap();
    }
    let mut next = [0u64; 3];
    for _ in 0..2 * N {
        let message = recv(&mut b_in).await;
        let tag = message.header[0];
        let index = u64::from_le_bytes(message.header[1..9].try_into().unwrap());
        assert_eq!(index, next[tag as usize], "sender {tag}: out of order");
        next[tag as usize] += 1;
        assert!(
            message.payload == common::pattern(index + u64::from(tag) * 1000, size(index)),
            "sender {tag}: payload {index} corrupted"
        );
    }
    assert_eq!(next, [0, N, N]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_truncated_addresses_are_refused() {
    init_tracing();
    let (a, _a_in) = Ucx::start(config(None)).unwrap();
    let (b, _b_in) = Ucx::start(config(None)).unwrap();
    let garbage: Vec<u8> = (0..200u32).map(|i| (i * 7 + 3) as u8).collect();
    for peer in [&garbage[..], &[][..], &b.address()[..b.address().len() - 1]] {
        let err = a
            .send(peer, b"h".to_vec(), Bytes::from_static(b"x"))
            .await
            .unwrap_err();
        assert!(matches!(err, UcxError::InvalidAddress { .. }), "{err}");
    }
    // A failed send does not spoil the layer.
    a.send(b.address(), b"h".to_vec(), Bytes::from_static(b"x"))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_header_is_refused() {
    let (a, _a_in) = Ucx::start(config(None)).unwrap();
    let (b, _b_in) = Ucx::start(config(None)).unwrap();
    let err = a
        .send(b.address(), vec![0; 1 << 20], Bytes::new())
        .await
        .unwrap_err();
    assert!(matches!(err, UcxError::HeaderTooLarge { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sending_after_shutdown_is_closed() {
    let (a, mut a_in) = Ucx::start(config(None)).unwrap();
    let (b, _b_in) = Ucx::start(config(None)).unwrap();
    a.shutdown().await;
    let err = a
        .send(b.address(), b"h".to_vec(), Bytes::new())
        .await
        .unwrap_err();
    assert!(matches!(err, UcxError::Closed), "{err}");
    assert!(a_in.recv().await.is_none());
}

async fn send_to_departed_peer(transports: Option<&str>, peer_error_handling: bool) {
    init_tracing();
    let config = UcxConfig {
        peer_error_handling,
        send_timeout: Some(Duration::from_secs(3)),
        ..config(transports)
    };
    let (a, _a_in) = Ucx::start(config.clone()).unwrap();
    let (b, mut b_in) = Ucx::start(config).unwrap();
    let address = b.address().to_vec();
    // Connected and working first, then the peer goes away.
    a.send(&address, b"before".to_vec(), common::pattern(1, 1 << 20))
        .await
        .unwrap();
    assert_eq!(recv(&mut b_in).await.header, b"before");
    b.shutdown().await;
    drop(b);
    let started = Instant::now();
    let mut errors = 0;
    for i in 0..3u64 {
        let sent = tokio::time::timeout(
            Duration::from_secs(30),
            a.send(&address, b"after".to_vec(), common::pattern(i, 8 << 20)),
        )
        .await
        .expect("a send to a departed peer must finish in bounded time");
        if let Err(err) = sent {
            eprintln!("send {i} to departed peer: {err}");
            errors += 1;
        }
    }
    eprintln!("{errors} errors in {:?}", started.elapsed());
    assert!(errors > 0, "sends to a departed peer all reported success");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn departed_peer_gives_errors_default_transports() {
    send_to_departed_peer(None, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn departed_peer_gives_errors_over_tcp() {
    send_to_departed_peer(Some("tcp"), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn departed_peer_gives_errors_with_peer_error_handling() {
    send_to_departed_peer(None, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segmented_payloads_arrive_as_one_contiguous_payload() {
    init_tracing();
    let (a, _a_in) = Ucx::start(config(None)).unwrap();
    let (b, mut b_in) = Ucx::start(config(None)).unwrap();
    // Small (eager) and large (rendezvous) messages, of odd and empty segments.
    let shapes: [&[usize]; 4] = [
        &[3, 0, 1000, 5],
        &[8 << 20, 7, 4 << 20],
        &[0, 0],
        &[1, 16 << 20],
    ];
    for (i, shape) in shapes.iter().enumerate() {
        let segments: Vec<Bytes> = shape
            .iter()
            .enumerate()
            .map(|(j, &size)| common::pattern((i * 10 + j) as u64, size))
            .collect();
        a.send_segments(b.address(), header(i as u64), segments)
            .await
            .unwrap();
    }
    for (i, shape) in shapes.iter().enumerate() {
        let message = recv(&mut b_in).await;
        assert_eq!(message.header, header(i as u64));
        let expected: Vec<u8> = shape
            .iter()
            .enumerate()
            .flat_map(|(j, &size)| common::pattern((i * 10 + j) as u64, size).to_vec())
            .collect();
        assert_eq!(message.payload.len(), expected.len(), "message {i}");
        assert!(message.payload == expected, "message {i} corrupted");
    }
}

/// Receive buffers from the caller: a `Vec` with a guard byte past the room asked for, and a
/// count of the buffers made.
#[derive(Debug, Default)]
struct Counted(std::sync::atomic::AtomicUsize);

struct Guarded(Vec<u8>);

// SAFETY: the vector holds `len + 1` initialised bytes; the first `len` are the room.
unsafe impl wrk_ucx::ReceiveBuffer for Guarded {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr()
    }

    unsafe fn finish(mut self: Box<Self>, len: usize) -> Bytes {
        assert_eq!(
            self.0.pop(),
            Some(0xAB),
            "UCX wrote past the room it was given"
        );
        self.0.truncate(len);
        Bytes::from(self.0)
    }
}

impl wrk_ucx::ReceiveBuffers for Counted {
    fn allocate(&self, len: usize) -> Box<dyn wrk_ucx::ReceiveBuffer> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut room = vec![0u8; len];
        room.push(0xAB);
        Box::new(Guarded(room))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_payloads_are_received_into_the_callers_buffers() {
    init_tracing();
    let counted = std::sync::Arc::new(Counted::default());
    let (a, _a_in) = Ucx::start(config(None)).unwrap();
    let (b, mut b_in) = Ucx::start(UcxConfig {
        receive_buffers: Some(counted.clone()),
        ..config(None)
    })
    .unwrap();
    let sizes = [16usize << 20, 100, 3 << 20];
    for (i, &size) in sizes.iter().enumerate() {
        a.send(
            b.address(),
            header(i as u64),
            common::pattern(i as u64, size),
        )
        .await
        .unwrap();
    }
    for (i, &size) in sizes.iter().enumerate() {
        let message = recv(&mut b_in).await;
        assert!(
            message.payload == common::pattern(i as u64, size),
            "payload {i} corrupted"
        );
    }
    // The two large ones went through rendezvous into the caller's buffers; 100 bytes arrive
    // eagerly.
    assert_eq!(counted.0.load(std::sync::atomic::Ordering::Relaxed), 2);
}

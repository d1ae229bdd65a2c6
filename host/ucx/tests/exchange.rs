//! Two `Ucx` instances in one process: payloads of all sizes arrive intact and in order, many
//! concurrent sends keep per-sender order, and failures are errors, never hangs.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
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
        a.send(b.address(), header(i), common::pattern(i, size)).await.unwrap();
    }
    for (i, &size) in sizes.iter().enumerate() {
        let message = recv(&mut b_in).await;
        assert_eq!(message.header, header(i as u64));
        assert_eq!(message.payload.len(), size);
        assert!(message.payload == common::pattern(i as u64, size), "payload {i} corrupted");
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
        assert!(message.payload == common::pattern(i as u64, size), "payload {i} corrupted");
    }
    a.shutdown().await;
    b.shutdown().await;
    assert!(b_in.recv().await.is_none(), "incoming ends after shutdown");
}

async fn a_send(from: &Ucx, to: &[u8], index: u64, size: usize) -> Result<(), UcxError> {
    from.send(to, header(index), common::pattern(index, size)).await
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

//! A safe, tokio-friendly layer over UCX for wrk's peer-to-peer transfers.
//!
//! One [`Ucx`] is one UCP context and worker, owned and driven by a dedicated progress thread
//! (UCX's `UCS_THREAD_MODE_SINGLE` workers must be used from one thread). The async side talks to
//! it through a command channel; when idle the thread arms the worker and sleeps on its event fd
//! (after spinning for [`UcxConfig::spin`]). Peers connect by exchanging the bytes of
//! [`Ucx::address`] through a control plane (the scheduler); endpoints are created on first send
//! and cached.
//!
//! A message is a small header and a payload of any size ([`Message`]), sent as a UCX active
//! message: eager for small payloads, rendezvous (zero-copy into the received `Bytes`) for large
//! ones. A payload given as segments goes as one I/O vector, or (with
//! [`UcxConfig::part_threshold`]) in parts, each large segment as its own rendezvous (UCX moves
//! a contiguous buffer with a single copy, an I/O vector through its copy pipeline); either way
//! it arrives as one contiguous payload.
//! Messages from one sender arrive in the order they were sent. Failures come back as
//! [`UcxError`] values so that callers can fall back to TCP.
//!
//! ```no_run
//! # async fn demo() -> Result<(), wrk_ucx::UcxError> {
//! use wrk_ucx::{Ucx, UcxConfig};
//! let (a, _a_in) = Ucx::start(UcxConfig::default())?;
//! let (b, mut b_in) = Ucx::start(UcxConfig::default())?;
//! a.send(b.address(), b"piece 0".to_vec(), bytes::Bytes::from(vec![0u8; 1 << 20])).await?;
//! let message = b_in.recv().await.expect("b is running");
//! assert_eq!(message.payload.len(), 1 << 20);
//! # Ok(()) }
//! ```

mod address;
mod assembly;
mod config;
mod error;
mod parts;
mod progress;
mod receive;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

pub use config::UcxConfig;
pub use error::{Status, UcxError};
use progress::{Command, Progress};
pub use receive::{ReceiveBuffer, ReceiveBuffers};

/// A received message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The header the sender passed (small: at most the worker's active-message header limit).
    pub header: Vec<u8>,
    /// The payload.
    pub payload: Bytes,
}

pub(crate) type SendResult = Result<(), UcxError>;

/// One UCX context and worker, driven by its own thread. Cheap to clone; the thread stops on
/// [`Ucx::shutdown`] or when the last clone is dropped. Dropping the last clone without
/// `shutdown` blocks the dropping thread until the progress thread has finished (at most
/// [`UcxConfig::shutdown_timeout`] plus UCX's teardown): prefer `shutdown().await` in async code.
#[derive(Clone)]
pub struct Ucx {
    shared: Arc<Shared>,
}

struct Shared {
    commands: std_mpsc::Sender<Command>,
    wake: Arc<OwnedFd>,
    address: Vec<u8>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The messages received by a [`Ucx`] from all peers; per sender in the order they were sent.
pub struct Incoming {
    receiver: mpsc::UnboundedReceiver<Message>,
}

impl Incoming {
    /// The next message; `None` once the [`Ucx`] has shut down and everything was read.
    pub async fn recv(&mut self) -> Option<Message> {
        self.receiver.recv().await
    }

    /// The underlying channel, for `select!`-style use.
    pub fn into_inner(self) -> mpsc::UnboundedReceiver<Message> {
        self.receiver
    }
}

impl Ucx {
    /// Creates the context and worker on a new progress thread. Blocks until UCX is initialised
    /// (transport discovery takes some milliseconds: call it from `spawn_blocking` in async code).
    pub fn start(config: UcxConfig) -> Result<(Ucx, Incoming), UcxError> {
        // SAFETY: eventfd has no memory-safety preconditions; the result is checked below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(UcxError::Io(std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a freshly created descriptor owned by nothing else.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let (commands, command_rx) = std_mpsc::channel();
        let (incoming, receiver) = mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let thread_wake = Arc::clone(&wake);
        let thread = std::thread::Builder::new()
            .name("ucx-progress".into())
            .spawn(
                move || match Progress::new(config, thread_wake, command_rx, incoming) {
                    Ok((progress, address)) => {
                        if ready_tx.send(Ok(address)).is_ok() {
                            progress.run();
                        }
                    }
                    Err(err) => {
                        let _ = ready_tx.send(Err(err));
                    }
                },
            )?;
        let address = match ready_rx.recv() {
            Ok(Ok(address)) => address,
            Ok(Err(err)) => {
                let _ = thread.join();
                return Err(err);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(UcxError::Closed);
            }
        };
        let shared = Shared {
            commands,
            wake,
            address,
            thread: Mutex::new(Some(thread)),
        };
        Ok((
            Ucx {
                shared: Arc::new(shared),
            },
            Incoming { receiver },
        ))
    }

    /// This worker's address, to publish to peers (through the scheduler). Opaque bytes: UCX's
    /// worker address in a checked envelope.
    pub fn address(&self) -> &[u8] {
        &self.shared.address
    }

    /// Sends one message (`header` and `payload`) to the worker whose [`Ucx::address`] is
    /// `peer`, creating and caching the endpoint on first use. Resolves when UCX reports the
    /// send complete (the payload has been handed to the peer or to the transport).
    ///
    /// Dropping the future does not cancel the send: the progress thread keeps the buffers until
    /// UCX is done with them. A send that fails or times out may still have been delivered:
    /// a caller that retries over another transport must tolerate duplicates.
    pub async fn send(&self, peer: &[u8], header: Vec<u8>, payload: Bytes) -> Result<(), UcxError> {
        self.send_segments(peer, header, vec![payload]).await
    }

    /// Sends one message whose payload is `segments` back to back, without copying them
    /// together; the peer receives one contiguous payload, each segment at its offset. By
    /// default UCX reads the segments as one I/O vector; with [`UcxConfig::part_threshold`] set,
    /// segments of at least that many bytes go as parts of their own (single-copy rendezvous),
    /// the runs of smaller ones between them as I/O vectors. Otherwise as [`Ucx::send`].
    pub async fn send_segments(
        &self,
        peer: &[u8],
        header: Vec<u8>,
        segments: Vec<Bytes>,
    ) -> Result<(), UcxError> {
        let (reply, result) = oneshot::channel();
        self.shared.command(Command::Send {
            peer: peer.to_vec(),
            header,
            payload: segments,
            reply,
        })?;
        result.await.unwrap_or(Err(UcxError::Closed))
    }

    /// Stops the layer: closes endpoints, waits (at most [`UcxConfig::shutdown_timeout`]) for
    /// outstanding operations, destroys the worker. Later sends fail with [`UcxError::Closed`];
    /// [`Incoming::recv`] returns `None` once drained. Affects every clone.
    pub async fn shutdown(&self) {
        let (done, finished) = oneshot::channel();
        if self
            .shared
            .command(Command::Shutdown { done: Some(done) })
            .is_ok()
        {
            let _ = finished.await;
        }
    }
}

impl Shared {
    fn command(&self, command: Command) -> Result<(), UcxError> {
        self.commands.send(command).map_err(|_| UcxError::Closed)?;
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to the eventfd owned by `wake`. A failure
        // (counter overflow) still leaves the fd readable, which is all the wake-up needs.
        unsafe {
            libc::write(
                self.wake.as_raw_fd(),
                (&one as *const u64).cast::<std::ffi::c_void>(),
                8,
            )
        };
        Ok(())
    }
}

impl Drop for Shared {
    /// The last handle is gone: stop the thread and wait for it (bounded by the shutdown timeout).
    fn drop(&mut self) {
        let _ = self.command(Command::Shutdown { done: None });
        let thread = match self.thread.get_mut() {
            Ok(thread) => thread.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        if let Some(thread) = thread
            && thread.join().is_err()
        {
            tracing::error!("the UCX progress thread panicked");
        }
    }
}

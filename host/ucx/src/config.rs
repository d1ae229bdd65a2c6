//! [`UcxConfig`]: what the caller may choose about the UCX layer. Anything left unset is UCX's
//! own default, including whatever the `UCX_*` environment variables say (the configuration is
//! read with `ucp_config_read`, then the options given here are applied with `ucp_config_modify`).

use std::sync::Arc;
use std::time::Duration;

use crate::receive::ReceiveBuffers;

/// Settings of one [`crate::Ucx`] instance.
#[derive(Debug, Clone)]
pub struct UcxConfig {
    /// Transport selection, as `UCX_TLS` (e.g. `"tcp"`, `"sm,self"`, `"posix,sysv,cma,self"`).
    /// `None`: UCX's own choice (or `UCX_TLS` from the environment).
    pub transports: Option<String>,
    /// Further UCX options as `(name, value)`, names without the `UCX_` prefix
    /// (e.g. `("RNDV_THRESH", "64k")`), applied after `transports`.
    pub options: Vec<(String, String)>,
    /// Create endpoints with `UCP_ERR_HANDLING_MODE_PEER`, so that a peer's failure completes the
    /// sends to it with an error quickly. Off by default: in UCX 1.13 this mode disables the
    /// shared-memory lanes, so everything between two processes of one host goes over TCP.
    /// Both sides of a pair should use the same setting.
    pub peer_error_handling: bool,
    /// A send that UCX has not completed within this time is cancelled (`ucp_request_cancel`)
    /// and reported as [`crate::UcxError::TimedOut`]; its endpoint is closed and the next send
    /// to that peer connects again. `None`: wait for UCX however long it takes.
    pub send_timeout: Option<Duration>,
    /// After any activity the progress thread keeps polling UCX for this long before it arms
    /// the worker and sleeps on its event fd (short bursts of messages are then handled without
    /// a wake-up). Keep it short: on small machines long busy-polling starves everything else.
    pub spin: Duration,
    /// How long [`crate::Ucx::shutdown`] waits for outstanding operations and endpoint closes.
    pub shutdown_timeout: Duration,
    /// Where large payloads are received. `None`: a fresh `Vec` each.
    pub receive_buffers: Option<Arc<dyn ReceiveBuffers>>,
    /// When set, payload segments ([`crate::Ucx::send_segments`]) of at least this many bytes
    /// are sent as parts of their own, contiguous buffers that UCX moves with a single copy
    /// (rendezvous: CMA on one host, zero-copy RDMA between hosts); the smaller segments between
    /// them are gathered into one part each. `None` (the default): a payload goes whole, its
    /// segments as one I/O vector, which UCX 1.13 moves through its copy pipeline. On one
    /// 2-core host the pipeline is faster (the sender and the receiver each make one of its
    /// two copies, where the single copy falls on the receiver alone: see
    /// `docs/benchmarks.md`); the parts are for links where the pipeline is the slower path.
    pub part_threshold: Option<usize>,
    /// The largest payload sent or received. A larger send fails with
    /// [`crate::UcxError::MessageTooLarge`]; a larger incoming message is refused before
    /// anything is allocated for it. Both sides of a pair should use the same setting.
    pub max_message_bytes: u64,
}

impl Default for UcxConfig {
    fn default() -> Self {
        UcxConfig {
            transports: None,
            options: Vec::new(),
            peer_error_handling: false,
            send_timeout: Some(Duration::from_secs(30)),
            spin: Duration::from_micros(50),
            shutdown_timeout: Duration::from_secs(5),
            receive_buffers: None,
            part_threshold: None,
            max_message_bytes: 4 << 30,
        }
    }
}

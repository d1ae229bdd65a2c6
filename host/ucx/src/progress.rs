//! The progress thread: the only thread that touches the UCP context, worker and endpoints
//! (the worker is created with `UCS_THREAD_MODE_SINGLE`).
//!
//! Loop: take commands from the async side (a channel plus an eventfd to wake the thread), call
//! `ucp_worker_progress` until it has nothing left, handle what UCX's callbacks recorded, expire
//! timed-out sends, and when nothing happened for [`UcxConfig::spin`] arm the worker
//! (`ucp_worker_arm`, `UCP_FEATURE_WAKEUP`) and sleep in `poll(2)` on the worker's event fd
//! (`ucp_worker_get_efd`) and the command eventfd.
//!
//! Messages are UCX active messages (id [`AM_ID`]). The wire header is a 16-byte prefix (the
//! sending endpoint's random stream id and the message's sequence number in that stream, both
//! u64 little endian) followed by the caller's header. Small payloads arrive eagerly and are
//! copied out of UCX's buffer; large ones arrive as rendezvous descriptors and are received with
//! `ucp_am_recv_data_nbx` straight into the buffer that becomes the message's `Bytes` (no extra
//! copy). Messages of a stream are delivered in sequence order, whatever order their payloads
//! complete in, so messages from one sender are never reordered.
//!
//! UCX's callbacks run on this thread inside UCX calls; they only record what happened in a
//! thread-local [`Events`] list that the loop takes and handles after each call.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{CString, c_int, c_void};
use std::hash::{BuildHasher, RandomState};
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, trace, warn};
use wrk_ucx_sys as sys;

use crate::address;
use crate::config::UcxConfig;
use crate::error::{Status, UcxError};
use crate::receive::ReceiveBuffer;
use crate::{Message, SendResult};

/// The active-message id of wrk messages.
const AM_ID: u32 = 0x5752;
/// Bytes of the stream id + sequence number prefix of every wire header.
const WIRE_PREFIX: usize = 16;
/// Upper bound on `ucp_worker_progress` calls in one loop turn, so commands are not starved.
const MAX_PROGRESS_CALLS: usize = 256;
/// Longest sleep without re-checking timers: a safety net, wake-ups come from the fds.
const MAX_SLEEP: Duration = Duration::from_millis(100);

/// A request from the async side.
pub(crate) enum Command {
    Send {
        peer: Vec<u8>,
        header: Vec<u8>,
        /// The payload, as segments sent back to back (an I/O vector when there are several).
        payload: Vec<Bytes>,
        reply: oneshot::Sender<SendResult>,
    },
    Shutdown {
        done: Option<oneshot::Sender<()>>,
    },
}

/// What UCX's callbacks recorded since the loop last looked.
#[derive(Default)]
struct Events {
    /// `(token, status, received length)` of finished sends, receives and endpoint closes.
    completed: Vec<(u64, sys::ucs_status_t, usize)>,
    /// Active messages that arrived.
    arrivals: Vec<Arrival>,
    /// Endpoints UCX reported failed (only with peer error handling), by stream id.
    failed_endpoints: Vec<(u64, sys::ucs_status_t)>,
}

thread_local! {
    static EVENTS: RefCell<Events> = RefCell::new(Events::default());
}

fn take_events() -> Events {
    EVENTS.with_borrow_mut(std::mem::take)
}

struct Arrival {
    stream: u64,
    seq: u64,
    header: Vec<u8>,
    body: ArrivalBody,
}

enum ArrivalBody {
    /// Eager data, already copied out of UCX's buffer.
    Eager(Vec<u8>),
    /// A rendezvous descriptor to pass to `ucp_am_recv_data_nbx`.
    Rendezvous { desc: *mut c_void, len: usize },
}

fn user_data(token: u64) -> *mut c_void {
    ptr::without_provenance_mut(token as usize)
}

unsafe extern "C" fn on_am(
    _arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: UCX passes receive parameters valid for the duration of the callback.
    let recv_attr = unsafe { (*param).recv_attr };
    let rendezvous = recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    let wire: &[u8] = if header_length == 0 || header.is_null() {
        &[]
    } else {
        // SAFETY: UCX passes a header of `header_length` bytes, valid during the callback.
        unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) }
    };
    let Some((prefix, user_header)) = wire.split_first_chunk::<WIRE_PREFIX>() else {
        warn!(
            header_length,
            "UCX active message without the wrk header prefix: dropped"
        );
        // Refusing a rendezvous makes the sender's send complete with this error.
        return if rendezvous {
            sys::UCS_ERR_INVALID_PARAM
        } else {
            sys::UCS_OK
        };
    };
    let (stream, seq) = prefix.split_at(8);
    let stream = u64::from_le_bytes(stream.try_into().unwrap_or_default());
    let seq = u64::from_le_bytes(seq.try_into().unwrap_or_default());
    let body = if rendezvous {
        ArrivalBody::Rendezvous {
            desc: data,
            len: length,
        }
    } else if length == 0 || data.is_null() {
        ArrivalBody::Eager(Vec::new())
    } else {
        // SAFETY: without the rendezvous flag `data` points to `length` received bytes, valid
        // during the callback (we return UCS_OK, so UCX keeps ownership).
        ArrivalBody::Eager(
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) }.to_vec(),
        )
    };
    EVENTS.with_borrow_mut(|events| {
        events.arrivals.push(Arrival {
            stream,
            seq,
            header: user_header.to_vec(),
            body,
        })
    });
    if rendezvous {
        // Keep the descriptor: the loop starts ucp_am_recv_data_nbx on it.
        sys::UCS_INPROGRESS
    } else {
        sys::UCS_OK
    }
}

unsafe extern "C" fn on_send_done(
    _request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    let token = user_data.addr() as u64;
    EVENTS.with_borrow_mut(|events| events.completed.push((token, status, 0)));
}

unsafe extern "C" fn on_recv_done(
    _request: *mut c_void,
    status: sys::ucs_status_t,
    length: usize,
    user_data: *mut c_void,
) {
    let token = user_data.addr() as u64;
    EVENTS.with_borrow_mut(|events| events.completed.push((token, status, length)));
}

unsafe extern "C" fn on_endpoint_error(
    arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    let stream = arg.addr() as u64;
    EVENTS.with_borrow_mut(|events| events.failed_endpoints.push((stream, status)));
}

/// Owns a UCP context; `ucp_cleanup` on drop.
struct Context(sys::ucp_context_h);

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the context was created by ucp_init_version and its worker is already
        // destroyed (a `Worker` is always dropped before its `Context`).
        unsafe { sys::ucp_cleanup(self.0) }
    }
}

/// Owns a UCP worker; `ucp_worker_destroy` (which also destroys its endpoints) on drop.
struct Worker(sys::ucp_worker_h);

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: the worker was created by ucp_worker_create on this thread and is destroyed once.
        unsafe { sys::ucp_worker_destroy(self.0) }
    }
}

/// UCP configuration handle; `ucp_config_release` on drop.
struct ConfigHandle(*mut sys::ucp_config_t);

impl Drop for ConfigHandle {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_config_read and is released once.
        unsafe { sys::ucp_config_release(self.0) }
    }
}

fn check(call: &'static str, status: sys::ucs_status_t) -> Result<(), UcxError> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(UcxError::Setup {
            call,
            status: Status::new(status),
        })
    }
}

/// An endpoint to a peer and the outgoing stream on it.
struct Endpoint {
    ep: sys::ucp_ep_h,
    peer: String,
    stream: u64,
    next_seq: u64,
}

/// Buffers that UCX reads from until the send completes.
struct SendBuffers {
    _header: Vec<u8>,
    _payload: Vec<Bytes>,
    /// The I/O vector over the payload's segments, when it has several.
    _iov: Vec<sys::ucp_dt_iov_t>,
}

enum Pending {
    Send {
        request: *mut c_void,
        /// The endpoint's stream id, which (unlike its handle) is never reused.
        stream: u64,
        peer: String,
        /// Taken when the caller has been answered (on completion or timeout).
        reply: Option<oneshot::Sender<SendResult>>,
        deadline: Option<Instant>,
        _buffers: SendBuffers,
    },
    Receive {
        request: *mut c_void,
        buffer: Box<dyn ReceiveBuffer>,
        /// Bytes the buffer has room for.
        len: usize,
        header: Vec<u8>,
        stream: u64,
        seq: u64,
    },
    Close {
        request: *mut c_void,
        peer: String,
    },
}

impl Pending {
    fn request(&self) -> *mut c_void {
        match self {
            Pending::Send { request, .. }
            | Pending::Receive { request, .. }
            | Pending::Close { request, .. } => *request,
        }
    }
}

enum Slot {
    Receiving,
    Ready(Message),
    Lost,
}

/// Incoming side of one sender's stream: messages wait here until all earlier ones are delivered.
#[derive(Default)]
struct InStream {
    next_seq: u64,
    slots: BTreeMap<u64, Slot>,
}

/// The state owned by the progress thread.
pub(crate) struct Progress {
    // Field order matters for drop: the worker before the context.
    worker: Worker,
    context: Context,
    efd: c_int,
    wake: Arc<OwnedFd>,
    commands: Receiver<Command>,
    incoming: mpsc::UnboundedSender<Message>,
    config: UcxConfig,
    max_header: usize,
    endpoints: HashMap<Vec<u8>, Endpoint>,
    pending: HashMap<u64, Pending>,
    streams: HashMap<u64, InStream>,
    next_token: u64,
    random: RandomState,
}

impl Progress {
    /// Creates the context and worker; returns the state and this worker's published address.
    pub(crate) fn new(
        config: UcxConfig,
        wake: Arc<OwnedFd>,
        commands: Receiver<Command>,
        incoming: mpsc::UnboundedSender<Message>,
    ) -> Result<(Progress, Vec<u8>), UcxError> {
        let context = create_context(&config)?;

        let worker_params = sys::ucp_worker_params_t {
            field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut worker = ptr::null_mut();
        // SAFETY: the context is live, the parameters are initialised for the fields in
        // field_mask, and `worker` is a valid out-pointer.
        check("ucp_worker_create", unsafe {
            sys::ucp_worker_create(context.0, &worker_params, &mut worker)
        })?;
        let worker = Worker(worker);

        let handler = sys::ucp_am_handler_param_t {
            field_mask: u64::from(
                sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG,
            ),
            id: AM_ID,
            flags: sys::UCP_AM_FLAG_WHOLE_MSG,
            cb: Some(on_am),
            arg: ptr::null_mut(),
        };
        // SAFETY: the worker is live; the handler is a plain function that does not use `arg`.
        check("ucp_worker_set_am_recv_handler", unsafe {
            sys::ucp_worker_set_am_recv_handler(worker.0, &handler)
        })?;

        let mut attr = sys::ucp_worker_attr_t {
            field_mask: u64::from(sys::UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER),
            ..Default::default()
        };
        // SAFETY: the worker is live and `attr` asks only for max_am_header.
        check("ucp_worker_query", unsafe {
            sys::ucp_worker_query(worker.0, &mut attr)
        })?;
        let max_header = attr.max_am_header.saturating_sub(WIRE_PREFIX);

        let mut efd: c_int = -1;
        // SAFETY: the worker is live (created with UCP_FEATURE_WAKEUP); `efd` is an out-pointer.
        // The fd stays owned by the worker.
        check("ucp_worker_get_efd", unsafe {
            sys::ucp_worker_get_efd(worker.0, &mut efd)
        })?;

        let mut address_ptr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut address_len: usize = 0;
        // SAFETY: the worker is live; both arguments are valid out-pointers.
        check("ucp_worker_get_address", unsafe {
            sys::ucp_worker_get_address(worker.0, &mut address_ptr, &mut address_len)
        })?;
        // SAFETY: UCX returned a buffer of `address_len` bytes, valid until it is released below.
        let ucx_address =
            unsafe { std::slice::from_raw_parts(address_ptr.cast::<u8>(), address_len) }.to_vec();
        // SAFETY: the buffer came from ucp_worker_get_address on this worker and is released once.
        unsafe { sys::ucp_worker_release_address(worker.0, address_ptr) };
        let published = address::encode(&ucx_address)?;
        debug!(
            peer = %address::peer_id(&published),
            address_bytes = ucx_address.len(),
            max_header,
            "UCX worker ready"
        );

        Ok((
            Progress {
                worker,
                context,
                efd,
                wake,
                commands,
                incoming,
                config,
                max_header,
                endpoints: HashMap::new(),
                pending: HashMap::new(),
                streams: HashMap::new(),
                next_token: 1,
                random: RandomState::new(),
            },
            published,
        ))
    }

    /// Runs until a shutdown command (or until every handle is gone), then tears down.
    pub(crate) fn run(mut self) {
        let mut last_activity = Instant::now();
        let done = loop {
            let mut active = false;
            match self.take_commands() {
                Ok(any) => active |= any,
                Err(done) => break done,
            }
            active |= self.progress();
            active |= self.handle_events();
            self.expire_sends();
            if active {
                last_activity = Instant::now();
            } else if last_activity.elapsed() < self.config.spin {
                std::thread::yield_now();
            } else {
                self.sleep(MAX_SLEEP);
            }
        };
        self.finish(done);
    }

    /// Handles queued commands; `Err` with the shutdown notifier when asked to stop.
    fn take_commands(&mut self) -> Result<bool, Option<oneshot::Sender<()>>> {
        let mut any = false;
        loop {
            match self.commands.try_recv() {
                Ok(Command::Send {
                    peer,
                    header,
                    payload,
                    reply,
                }) => {
                    any = true;
                    self.start_send(peer, header, payload, reply);
                }
                Ok(Command::Shutdown { done }) => return Err(done),
                Err(TryRecvError::Empty) => return Ok(any),
                Err(TryRecvError::Disconnected) => return Err(None),
            }
        }
    }

    /// Calls `ucp_worker_progress` until it reports nothing more (bounded).
    fn progress(&mut self) -> bool {
        let mut any = false;
        for _ in 0..MAX_PROGRESS_CALLS {
            // SAFETY: the worker is live and driven only from this thread.
            if unsafe { sys::ucp_worker_progress(self.worker.0) } == 0 {
                break;
            }
            any = true;
        }
        any
    }

    /// Arms the worker and sleeps until UCX or the async side has something, or `limit` passes
    /// (shortened to the nearest send deadline).
    fn sleep(&mut self, limit: Duration) {
        // SAFETY: the worker is live and driven only from this thread.
        let status = unsafe { sys::ucp_worker_arm(self.worker.0) };
        if status == sys::UCS_ERR_BUSY {
            return; // events are pending: progress again
        }
        let mut timeout = limit;
        if status != sys::UCS_OK {
            warn!(status = %Status::new(status), "ucp_worker_arm failed; polling UCX every 1 ms");
            timeout = Duration::from_millis(1);
        }
        let now = Instant::now();
        for pending in self.pending.values() {
            if let Pending::Send {
                deadline: Some(deadline),
                ..
            } = pending
            {
                timeout = timeout.min(deadline.saturating_duration_since(now));
            }
        }
        let mut fds = [
            libc::pollfd {
                fd: self.efd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let millis = c_int::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(c_int::MAX);
        // SAFETY: `fds` is a valid array of two pollfd for the duration of the call.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, millis) };
        if ready > 0 && fds[1].revents & libc::POLLIN != 0 {
            let mut counter = 0u64;
            // SAFETY: reads 8 bytes into a u64 from the non-blocking eventfd, resetting it.
            let n = unsafe {
                libc::read(
                    self.wake.as_raw_fd(),
                    (&mut counter as *mut u64).cast::<c_void>(),
                    8,
                )
            };
            trace!(n, counter, "woken by the async side");
        }
    }

    fn token(&mut self) -> u64 {
        let token = self.next_token;
        self.next_token += 1;
        token
    }

    fn start_send(
        &mut self,
        peer: Vec<u8>,
        header: Vec<u8>,
        payload: Vec<Bytes>,
        reply: oneshot::Sender<SendResult>,
    ) {
        if header.len() > self.max_header {
            let _ = reply.send(Err(UcxError::HeaderTooLarge {
                len: header.len(),
                max: self.max_header,
            }));
            return;
        }
        let (ep, peer_id, stream, seq) = match self.endpoint(peer) {
            Ok(endpoint) => (
                endpoint.ep,
                endpoint.peer.clone(),
                endpoint.stream,
                endpoint.next_seq,
            ),
            Err(err) => {
                let _ = reply.send(Err(err));
                return;
            }
        };
        let mut wire = Vec::with_capacity(WIRE_PREFIX + header.len());
        wire.extend_from_slice(&stream.to_le_bytes());
        wire.extend_from_slice(&seq.to_le_bytes());
        wire.extend_from_slice(&header);
        let token = self.token();
        let mut param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA,
            user_data: user_data(token),
            ..Default::default()
        };
        param.cb.send = Some(on_send_done);
        let bytes: usize = payload.iter().map(Bytes::len).sum();
        // One segment goes as it is; several as an I/O vector, so none is copied together.
        let iov: Vec<sys::ucp_dt_iov_t> = if payload.len() > 1 {
            param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE;
            param.datatype = sys::ucp_datatype_t::from(sys::UCP_DATATYPE_IOV);
            payload
                .iter()
                .map(|segment| sys::ucp_dt_iov_t {
                    buffer: segment.as_ptr().cast_mut().cast::<c_void>(),
                    length: segment.len(),
                })
                .collect()
        } else {
            Vec::new()
        };
        let (buffer, count) = match payload.first() {
            _ if !iov.is_empty() => (iov.as_ptr().cast::<c_void>(), iov.len()),
            Some(segment) => (segment.as_ptr().cast::<c_void>(), segment.len()),
            None => (ptr::null(), 0),
        };
        // SAFETY: the endpoint belongs to this worker and thread; `wire`, the payload's
        // segments and the I/O vector over them are kept alive (in `Pending::Send`) until UCX
        // reports completion, or are no longer needed when the call completes at once. UCX
        // only reads through the vector's (const-cast) pointers.
        let request = unsafe {
            sys::ucp_am_send_nbx(
                ep,
                AM_ID,
                wire.as_ptr().cast::<c_void>(),
                wire.len(),
                buffer,
                count,
                &param,
            )
        };
        if sys::UCS_PTR_IS_ERR(request) {
            let status = Status::new(sys::UCS_PTR_RAW_STATUS(request));
            warn!(peer = %peer_id, %status, "UCX send failed at once");
            let _ = reply.send(Err(UcxError::Send {
                peer: peer_id,
                status,
            }));
            self.retire_endpoint(stream);
            return;
        }
        if let Some(endpoint) = self.endpoints.values_mut().find(|e| e.stream == stream) {
            endpoint.next_seq += 1;
        }
        if request.is_null() {
            trace!(peer = %peer_id, seq, bytes, "UCX send completed at once");
            let _ = reply.send(Ok(()));
            return;
        }
        let deadline = self.config.send_timeout.map(|t| Instant::now() + t);
        self.pending.insert(
            token,
            Pending::Send {
                request,
                stream,
                peer: peer_id,
                reply: Some(reply),
                deadline,
                _buffers: SendBuffers {
                    _header: wire,
                    _payload: payload,
                    _iov: iov,
                },
            },
        );
    }

    /// The cached endpoint to `peer`, created on first use.
    fn endpoint(&mut self, peer: Vec<u8>) -> Result<&Endpoint, UcxError> {
        if !self.endpoints.contains_key(&peer) {
            let ucx_address = address::decode(&peer)?;
            let peer_id = address::peer_id(&peer);
            let stream = self
                .random
                .hash_one((std::process::id(), self.next_token, &peer));
            self.next_token += 1;
            let mut params = sys::ucp_ep_params_t {
                field_mask: u64::from(sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS),
                address: ucx_address.as_ptr().cast::<sys::ucp_address_t>(),
                ..Default::default()
            };
            if self.config.peer_error_handling {
                params.field_mask |= u64::from(
                    sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
                );
                params.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
                params.err_handler = sys::ucp_err_handler_t {
                    cb: Some(on_endpoint_error),
                    arg: user_data(stream),
                };
            }
            let mut ep = ptr::null_mut();
            // SAFETY: the worker is live and used from this thread only; the address bytes
            // passed the envelope's length and checksum check and live during the call; `ep` is
            // a valid out-pointer.
            let status = unsafe { sys::ucp_ep_create(self.worker.0, &params, &mut ep) };
            if status != sys::UCS_OK {
                let status = Status::new(status);
                warn!(peer = %peer_id, %status, "UCX endpoint creation failed");
                return Err(UcxError::Connect {
                    peer: peer_id,
                    status,
                });
            }
            debug!(peer = %peer_id, stream, "UCX endpoint created");
            self.endpoints.insert(
                peer.clone(),
                Endpoint {
                    ep,
                    peer: peer_id,
                    stream,
                    next_seq: 0,
                },
            );
        }
        self.endpoints.get(&peer).ok_or(UcxError::Closed)
    }

    /// Removes a failed endpoint from the cache and closes it; the next send reconnects.
    fn retire_endpoint(&mut self, stream: u64) {
        let Some(key) = self
            .endpoints
            .iter()
            .find(|(_, e)| e.stream == stream)
            .map(|(k, _)| k.clone())
        else {
            return; // already retired
        };
        if let Some(endpoint) = self.endpoints.remove(&key) {
            debug!(peer = %endpoint.peer, "closing UCX endpoint");
            self.close_endpoint(endpoint);
        }
    }

    fn close_endpoint(&mut self, endpoint: Endpoint) {
        let token = self.token();
        let mut param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA,
            user_data: user_data(token),
            ..Default::default()
        };
        if self.config.peer_error_handling {
            // Allowed (and needed after a failure) only with UCP_ERR_HANDLING_MODE_PEER.
            param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
        }
        param.cb.send = Some(on_send_done);
        // SAFETY: the endpoint belongs to this worker, is closed once (it was removed from the
        // cache), and is not used after this call.
        let request = unsafe { sys::ucp_ep_close_nbx(endpoint.ep, &param) };
        if sys::UCS_PTR_IS_ERR(request) {
            let status = Status::new(sys::UCS_PTR_RAW_STATUS(request));
            debug!(peer = %endpoint.peer, %status, "UCX endpoint close reported an error");
        } else if !request.is_null() {
            self.pending.insert(
                token,
                Pending::Close {
                    request,
                    peer: endpoint.peer,
                },
            );
        }
    }

    /// Handles what the callbacks recorded; true when there was anything.
    fn handle_events(&mut self) -> bool {
        let events = take_events();
        if events.completed.is_empty()
            && events.arrivals.is_empty()
            && events.failed_endpoints.is_empty()
        {
            return false;
        }
        for (stream, status) in events.failed_endpoints {
            let found = self.endpoints.values().find(|e| e.stream == stream);
            if let Some(peer) = found.map(|e| e.peer.clone()) {
                warn!(peer = %peer, status = %Status::new(status), "UCX endpoint failed");
                self.retire_endpoint(stream);
            }
        }
        let mut touched = Vec::new();
        for arrival in events.arrivals {
            touched.push(arrival.stream);
            self.accept(arrival);
        }
        for (token, status, length) in events.completed {
            if let Some(stream) = self.complete(token, status, length) {
                touched.push(stream);
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for stream in touched {
            self.deliver(stream);
        }
        true
    }

    /// Files an arrived message in its stream; starts the receive of a rendezvous payload.
    fn accept(&mut self, arrival: Arrival) {
        let Arrival {
            stream,
            seq,
            header,
            body,
        } = arrival;
        let state = self.streams.entry(stream).or_default();
        if seq < state.next_seq || state.slots.contains_key(&seq) {
            warn!(stream, seq, "duplicate UCX message dropped");
            if let ArrivalBody::Rendezvous { desc, .. } = body {
                // SAFETY: the descriptor came from this worker's AM callback, which returned
                // UCS_INPROGRESS, and is released once.
                unsafe { sys::ucp_am_data_release(self.worker.0, desc) };
            }
            return;
        }
        match body {
            ArrivalBody::Eager(data) => {
                let message = Message {
                    header,
                    payload: Bytes::from(data),
                };
                state.slots.insert(seq, Slot::Ready(message));
            }
            ArrivalBody::Rendezvous { desc, len } => {
                let mut buffer = match &self.config.receive_buffers {
                    Some(buffers) => buffers.allocate(len),
                    None => crate::receive::fresh(len),
                };
                let token = self.token();
                let mut param = sys::ucp_request_param_t {
                    op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK
                        | sys::UCP_OP_ATTR_FIELD_USER_DATA,
                    user_data: user_data(token),
                    ..Default::default()
                };
                param.cb.recv_am = Some(on_recv_done);
                // SAFETY: `desc` is a rendezvous descriptor from this worker's AM callback;
                // `buffer` has room for `len` bytes that stay put (it is kept in
                // `Pending::Receive`) until UCX reports completion (`ReceiveBuffer`'s contract).
                let request = unsafe {
                    sys::ucp_am_recv_data_nbx(
                        self.worker.0,
                        desc,
                        buffer.as_mut_ptr().cast::<c_void>(),
                        len,
                        &param,
                    )
                };
                let state = self.streams.entry(stream).or_default();
                if sys::UCS_PTR_IS_ERR(request) {
                    let status = Status::new(sys::UCS_PTR_RAW_STATUS(request));
                    warn!(stream, seq, %status, "UCX rendezvous receive failed: message lost");
                    state.slots.insert(seq, Slot::Lost);
                } else if request.is_null() {
                    // SAFETY: the receive completed at once and wrote all `len` bytes.
                    let payload = unsafe { buffer.finish(len) };
                    let message = Message { header, payload };
                    state.slots.insert(seq, Slot::Ready(message));
                } else {
                    state.slots.insert(seq, Slot::Receiving);
                    self.pending.insert(
                        token,
                        Pending::Receive {
                            request,
                            buffer,
                            len,
                            header,
                            stream,
                            seq,
                        },
                    );
                }
            }
        }
    }

    /// Finishes one request; returns the stream whose delivery may advance.
    fn complete(&mut self, token: u64, status: sys::ucs_status_t, length: usize) -> Option<u64> {
        let pending = self.pending.remove(&token)?;
        // SAFETY: the request handle was returned by a UCX *_nbx call on this worker, its
        // callback has fired, and it is freed once (its entry was just removed).
        unsafe { sys::ucp_request_free(pending.request()) };
        match pending {
            Pending::Send {
                stream,
                peer,
                reply,
                ..
            } => {
                let result = if status == sys::UCS_OK {
                    Ok(())
                } else {
                    let status = Status::new(status);
                    warn!(peer = %peer, %status, "UCX send failed");
                    self.retire_endpoint(stream);
                    Err(UcxError::Send { peer, status })
                };
                if let Some(reply) = reply {
                    let _ = reply.send(result);
                }
                None
            }
            Pending::Receive {
                buffer,
                len,
                header,
                stream,
                seq,
                ..
            } => {
                let slot = if status == sys::UCS_OK && length <= len {
                    // SAFETY: UCX reports `length` bytes written into the buffer, within the
                    // room it was given.
                    let payload = unsafe { buffer.finish(length) };
                    Slot::Ready(Message { header, payload })
                } else {
                    warn!(stream, seq, status = %Status::new(status), "UCX receive failed: message lost");
                    Slot::Lost
                };
                if let Some(state) = self.streams.get_mut(&stream) {
                    state.slots.insert(seq, slot);
                }
                Some(stream)
            }
            Pending::Close { peer, .. } => {
                debug!(peer = %peer, status = %Status::new(status), "UCX endpoint closed");
                None
            }
        }
    }

    /// Hands the stream's messages that are next in sequence to the incoming channel.
    fn deliver(&mut self, stream: u64) {
        let Some(state) = self.streams.get_mut(&stream) else {
            return;
        };
        while let Some(entry) = state.slots.first_entry() {
            if *entry.key() != state.next_seq || matches!(entry.get(), Slot::Receiving) {
                break;
            }
            state.next_seq += 1;
            if let Slot::Ready(message) = entry.remove()
                && self.incoming.send(message).is_err()
            {
                trace!("incoming messages are no longer read: message dropped");
            }
        }
    }

    /// Cancels sends past their deadline and answers their callers with `TimedOut`.
    fn expire_sends(&mut self) {
        let Some(after) = self.config.send_timeout else {
            return;
        };
        let now = Instant::now();
        let mut expired = Vec::new();
        for pending in self.pending.values_mut() {
            if let Pending::Send {
                request,
                stream,
                peer,
                reply,
                deadline,
                ..
            } = pending
                && deadline.is_some_and(|d| d <= now)
            {
                *deadline = None;
                if let Some(reply) = reply.take() {
                    warn!(peer = %peer, ?after, "UCX send timed out: cancelling");
                    let _ = reply.send(Err(UcxError::TimedOut {
                        peer: peer.clone(),
                        after,
                    }));
                }
                expired.push((*request, *stream));
            }
        }
        for (request, stream) in expired {
            // SAFETY: the request is outstanding on this worker (its callback has not fired, so
            // it is still in `pending`); it stays there until the callback reports completion.
            unsafe { sys::ucp_request_cancel(self.worker.0, request) };
            self.retire_endpoint(stream);
        }
    }

    /// Closes endpoints, waits (bounded) for outstanding operations, destroys the worker and
    /// context. Buffers of operations UCX never completed are leaked on purpose: a peer might
    /// still access them.
    fn finish(mut self, done: Option<oneshot::Sender<()>>) {
        let mut notify: Vec<oneshot::Sender<()>> = done.into_iter().collect();
        while let Ok(command) = self.commands.try_recv() {
            match command {
                Command::Send { reply, .. } => {
                    let _ = reply.send(Err(UcxError::Closed));
                }
                Command::Shutdown { done } => notify.extend(done),
            }
        }
        let endpoints: Vec<Endpoint> = self.endpoints.drain().map(|(_, e)| e).collect();
        for endpoint in endpoints {
            self.close_endpoint(endpoint);
        }
        let deadline = Instant::now() + self.config.shutdown_timeout;
        let mut cancelled = false;
        loop {
            let busy = self.progress() | self.handle_events();
            self.expire_sends();
            if self.pending.is_empty() {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                if cancelled {
                    break;
                }
                // Last resort: cancel what is left, and give UCX a moment to complete it.
                cancelled = true;
                for pending in self.pending.values() {
                    // SAFETY: each request is outstanding on this worker (still in `pending`).
                    unsafe { sys::ucp_request_cancel(self.worker.0, pending.request()) };
                }
                continue;
            }
            if !busy {
                self.sleep((deadline - now).min(Duration::from_millis(10)));
            }
        }
        let left = std::mem::take(&mut self.pending);
        let Progress {
            worker, context, ..
        } = self;
        if !left.is_empty() {
            warn!(
                operations = left.len(),
                "UCX operations still outstanding at shutdown; their buffers are leaked"
            );
        }
        let mut replies = Vec::new();
        for mut pending in left.into_values() {
            // SAFETY: the request is outstanding on this worker and freed once; UCX asserts at
            // worker destruction that every request was handed back. No callback fires for it
            // afterwards.
            unsafe { sys::ucp_request_free(pending.request()) };
            if let Pending::Send { reply, .. } = &mut pending {
                replies.extend(reply.take());
            }
            std::mem::forget(pending);
        }
        drop(worker);
        drop(context);
        for reply in replies {
            let _ = reply.send(Err(UcxError::Closed));
        }
        for done in notify {
            let _ = done.send(());
        }
        debug!("UCX worker shut down");
    }
}

fn create_context(config: &UcxConfig) -> Result<Context, UcxError> {
    let mut handle = ptr::null_mut();
    // SAFETY: NULL env prefix and file name mean "UCX_" and none; `handle` is an out-pointer.
    check("ucp_config_read", unsafe {
        sys::ucp_config_read(ptr::null(), ptr::null(), &mut handle)
    })?;
    let handle = ConfigHandle(handle);
    let options = config
        .transports
        .iter()
        .map(|tls| ("TLS".to_string(), tls.clone()))
        .chain(config.options.iter().cloned());
    for (name, value) in options {
        let refused = |reason: String| UcxError::Config {
            name: name.clone(),
            value: value.clone(),
            reason,
        };
        let c_name = CString::new(name.as_str()).map_err(|e| refused(e.to_string()))?;
        let c_value = CString::new(value.as_str()).map_err(|e| refused(e.to_string()))?;
        // SAFETY: the configuration handle is live; both strings are NUL-terminated and live
        // during the call.
        let status = unsafe { sys::ucp_config_modify(handle.0, c_name.as_ptr(), c_value.as_ptr()) };
        if status != sys::UCS_OK {
            return Err(refused(Status::new(status).to_string()));
        }
    }
    let params = sys::ucp_params_t {
        field_mask: u64::from(sys::UCP_PARAM_FIELD_FEATURES),
        features: u64::from(sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP),
        ..Default::default()
    };
    let mut context = ptr::null_mut();
    // SAFETY: the parameters are initialised for the fields in field_mask, the configuration
    // handle is live, and `context` is an out-pointer. The API version is the one the bindings
    // were generated for.
    check("ucp_init", unsafe {
        sys::ucp_init_version(
            sys::UCP_API_MAJOR,
            sys::UCP_API_MINOR,
            &params,
            handle.0,
            &mut context,
        )
    })?;
    Ok(Context(context))
}

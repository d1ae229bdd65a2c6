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
//! With [`UcxConfig::part_threshold`] set, a payload with large segments goes in parts instead
//! ([`crate::parts`], active-message id [`PART_AM_ID`]): each large segment as its own
//! contiguous rendezvous (UCX moves it with a single copy, where it would pass an I/O vector
//! through its copy pipeline), put together at the receiver in one buffer ([`Assembly`]). The
//! caller's send completes when every part has.
//!
//! UCX's callbacks run on this thread inside UCX calls; they only record what happened in a
//! thread-local [`Events`] list that the loop takes and handles after each call.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{CString, c_int, c_void};
use std::hash::{BuildHasher, RandomState};
use std::ops::Range;
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
use crate::assembly::Assembly;
use crate::config::UcxConfig;
use crate::error::{Status, UcxError};
use crate::parts::{self, MAX_PARTS, PART_AM_ID, PART_PREFIX, PartHeader};
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
    /// Where the payload belongs, for a part of a message.
    part: Option<PartHeader>,
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

/// The `arg` of the part handler, telling [`on_am`] which kind of wire header to expect.
const PART_HANDLER: usize = 1;

/// A parsed wire header.
struct Wire<'a> {
    stream: u64,
    seq: u64,
    /// Where the payload belongs, for a part of a message.
    part: Option<PartHeader>,
    /// The caller's header.
    user: &'a [u8],
}

/// Parses the wire header of a whole message, or of a part when `part`.
fn parse_wire(wire: &[u8], part: bool) -> Result<Wire<'_>, String> {
    if part {
        let (part, user) = PartHeader::decode(wire).map_err(|e| e.to_string())?;
        return Ok(Wire {
            stream: part.stream,
            seq: part.seq,
            part: Some(part),
            user,
        });
    }
    let (prefix, user) = wire.split_first_chunk::<WIRE_PREFIX>().ok_or(format!(
        "a header of {} bytes, without the {WIRE_PREFIX}-byte wrk prefix",
        wire.len()
    ))?;
    let (stream, seq) = prefix.split_at(8);
    Ok(Wire {
        stream: u64::from_le_bytes(stream.try_into().unwrap_or_default()),
        seq: u64::from_le_bytes(seq.try_into().unwrap_or_default()),
        part: None,
        user,
    })
}

unsafe extern "C" fn on_am(
    arg: *mut c_void,
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
    let Wire {
        stream,
        seq,
        part,
        user,
    } = match parse_wire(wire, arg.addr() == PART_HANDLER) {
        Ok(parsed) => parsed,
        Err(reason) => {
            warn!(header_length, "UCX active message refused: {reason}");
            // Refusing a rendezvous makes the sender's send complete with this error.
            return if rendezvous {
                sys::UCS_ERR_INVALID_PARAM
            } else {
                sys::UCS_OK
            };
        }
    };
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
            part,
            header: user.to_vec(),
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

/// Starts one active message `am_id` of `wire` header and `segments` payload (passed as the
/// I/O vector `iov` when there are several) whose completion reports `user_data`. Returns UCX's
/// request: null when it completed at once, or an error status.
///
/// # Safety
///
/// `ep` is an endpoint of the calling thread's worker; `wire`, the segments' bytes and `iov`'s
/// heap buffer stay alive and unchanged until the request completes.
unsafe fn post_send(
    ep: sys::ucp_ep_h,
    am_id: u32,
    wire: &[u8],
    segments: &[Bytes],
    iov: &mut Vec<sys::ucp_dt_iov_t>,
    user_data: *mut c_void,
) -> *mut c_void {
    let mut param = sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA,
        user_data,
        ..Default::default()
    };
    param.cb.send = Some(on_send_done);
    // One segment goes as it is; several as an I/O vector, so none is copied together.
    if segments.len() > 1 {
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE;
        param.datatype = sys::ucp_datatype_t::from(sys::UCP_DATATYPE_IOV);
        iov.extend(segments.iter().map(|segment| sys::ucp_dt_iov_t {
            buffer: segment.as_ptr().cast_mut().cast::<c_void>(),
            length: segment.len(),
        }));
    }
    let (buffer, count) = match segments.first() {
        _ if !iov.is_empty() => (iov.as_ptr().cast::<c_void>(), iov.len()),
        Some(segment) => (segment.as_ptr().cast::<c_void>(), segment.len()),
        None => (ptr::null(), 0),
    };
    // SAFETY: passed on from the caller; UCX only reads through the vector's (const-cast)
    // pointers.
    unsafe {
        sys::ucp_am_send_nbx(
            ep,
            am_id,
            wire.as_ptr().cast::<c_void>(),
            wire.len(),
            buffer,
            count,
            &param,
        )
    }
}

/// Starts receiving the rendezvous payload of `desc` (`len` bytes) into `target`; the
/// completion reports `user_data`. Returns UCX's request: null when it completed at once, or an
/// error status.
///
/// # Safety
///
/// `worker` is the calling thread's worker and `desc` a rendezvous descriptor from its AM
/// callback, not used before; `target` points to `len` writable bytes that nothing else uses
/// and that stay put until the request completes.
unsafe fn receive_into(
    worker: sys::ucp_worker_h,
    desc: *mut c_void,
    target: *mut u8,
    len: usize,
    user_data: *mut c_void,
) -> *mut c_void {
    let mut param = sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA,
        user_data,
        ..Default::default()
    };
    param.cb.recv_am = Some(on_recv_done);
    // SAFETY: passed on from the caller.
    unsafe { sys::ucp_am_recv_data_nbx(worker, desc, target.cast::<c_void>(), len, &param) }
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
    /// The wire header of each active message (one, or one per part).
    _headers: Vec<Vec<u8>>,
    _payload: Vec<Bytes>,
    /// The I/O vector of each active message whose payload has several segments.
    _iovs: Vec<Vec<sys::ucp_dt_iov_t>>,
}

/// One caller's send: one active message, or one per part, all to one endpoint.
struct SendGroup {
    /// The endpoint's stream id, which (unlike its handle) is never reused.
    stream: u64,
    peer: String,
    /// Taken when the caller has been answered (on completion, failure or timeout).
    reply: Option<oneshot::Sender<SendResult>>,
    deadline: Option<Instant>,
    /// Requests of the send UCX has not completed yet.
    outstanding: usize,
    _buffers: SendBuffers,
}

enum Pending {
    Send {
        request: *mut c_void,
        /// The [`SendGroup`] it belongs to.
        group: u64,
    },
    /// A rendezvous part of a message received into its [`Assembly`].
    ReceivePart {
        request: *mut c_void,
        stream: u64,
        seq: u64,
        /// Bytes the part must fill.
        len: usize,
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
            | Pending::ReceivePart { request, .. }
            | Pending::Receive { request, .. }
            | Pending::Close { request, .. } => *request,
        }
    }
}

enum Slot {
    Receiving,
    /// A message sent in parts, not all in yet.
    Assembling(Box<Assembly>),
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
    /// Sends not completed yet, by group id (a token).
    sends: HashMap<u64, SendGroup>,
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
        let part_handler = sys::ucp_am_handler_param_t {
            id: PART_AM_ID,
            arg: ptr::without_provenance_mut(PART_HANDLER),
            ..handler
        };
        for handler in [handler, part_handler] {
            // SAFETY: the worker is live; the handler is a plain function that reads `arg` as
            // a number, never through it.
            check("ucp_worker_set_am_recv_handler", unsafe {
                sys::ucp_worker_set_am_recv_handler(worker.0, &handler)
            })?;
        }

        let mut attr = sys::ucp_worker_attr_t {
            field_mask: u64::from(sys::UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER),
            ..Default::default()
        };
        // SAFETY: the worker is live and `attr` asks only for max_am_header.
        check("ucp_worker_query", unsafe {
            sys::ucp_worker_query(worker.0, &mut attr)
        })?;
        // Part 0 carries the caller's header after the longer part prefix.
        let max_header = attr
            .max_am_header
            .saturating_sub(PART_PREFIX.max(WIRE_PREFIX));

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
                sends: HashMap::new(),
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
        for deadline in self.sends.values().filter_map(|send| send.deadline) {
            timeout = timeout.min(deadline.saturating_duration_since(now));
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
        let bytes: u64 = payload.iter().map(|s| s.len() as u64).sum();
        if bytes > self.config.max_message_bytes {
            let _ = reply.send(Err(UcxError::MessageTooLarge {
                len: bytes,
                max: self.config.max_message_bytes,
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
        // The active messages to send: `(id, wire header, segments)`.
        let split = match self.config.part_threshold {
            Some(threshold) => parts::plan(&payload, threshold),
            None => Vec::new(),
        };
        let messages: Vec<(u32, Vec<u8>, Range<usize>)> = match u32::try_from(split.len())
            .ok()
            .filter(|&n| (2..=MAX_PARTS).contains(&n))
        {
            Some(count) => (0u32..)
                .zip(split)
                .map(|(index, part)| {
                    let wire = PartHeader {
                        stream,
                        seq,
                        index,
                        count,
                        offset: part.offset,
                        total: bytes,
                    }
                    .encode(if index == 0 { &header } else { &[] });
                    (PART_AM_ID, wire, part.segments)
                })
                .collect(),
            None => {
                let mut wire = Vec::with_capacity(WIRE_PREFIX + header.len());
                wire.extend_from_slice(&stream.to_le_bytes());
                wire.extend_from_slice(&seq.to_le_bytes());
                wire.extend_from_slice(&header);
                vec![(AM_ID, wire, 0..payload.len())]
            }
        };
        let group = self.token();
        let mut headers = Vec::with_capacity(messages.len());
        let mut iovs = Vec::new();
        let mut requests = Vec::new();
        let mut failure = None;
        for (am_id, wire, segments) in messages {
            let token = self.token();
            let mut iov = Vec::new();
            // SAFETY: the endpoint belongs to this worker and thread; the wire header (whose
            // heap buffer does not move when the `Vec` does), the payload's segments and the I/O
            // vector are kept in the send group until UCX reports every request complete.
            let request = unsafe {
                post_send(
                    ep,
                    am_id,
                    &wire,
                    &payload[segments],
                    &mut iov,
                    user_data(token),
                )
            };
            headers.push(wire);
            if !iov.is_empty() {
                iovs.push(iov);
            }
            if sys::UCS_PTR_IS_ERR(request) {
                failure = Some(Status::new(sys::UCS_PTR_RAW_STATUS(request)));
                break;
            }
            if !request.is_null() {
                requests.push((token, request));
            }
        }
        let mut reply = Some(reply);
        if let Some(status) = failure {
            warn!(peer = %peer_id, %status, "UCX send failed at once");
            if let Some(reply) = reply.take() {
                let _ = reply.send(Err(UcxError::Send {
                    peer: peer_id.clone(),
                    status,
                }));
            }
            self.retire_endpoint(stream);
        } else {
            if let Some(endpoint) = self.endpoints.values_mut().find(|e| e.stream == stream) {
                endpoint.next_seq += 1;
            }
            if requests.is_empty() {
                trace!(peer = %peer_id, seq, bytes, "UCX send completed at once");
                if let Some(reply) = reply.take() {
                    let _ = reply.send(Ok(()));
                }
            }
        }
        if requests.is_empty() {
            return;
        }
        for &(token, request) in &requests {
            self.pending.insert(token, Pending::Send { request, group });
        }
        self.sends.insert(
            group,
            SendGroup {
                stream,
                peer: peer_id,
                reply,
                deadline: self.config.send_timeout.map(|t| Instant::now() + t),
                outstanding: requests.len(),
                _buffers: SendBuffers {
                    _headers: headers,
                    _payload: payload,
                    _iovs: iovs,
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
            part,
            header,
            body,
        } = arrival;
        if let Some(part) = part {
            return self.accept_part(part, header, body);
        }
        let state = self.streams.entry(stream).or_default();
        if seq < state.next_seq || state.slots.contains_key(&seq) {
            warn!(stream, seq, "duplicate UCX message dropped");
            self.release(body);
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
            ArrivalBody::Rendezvous { len, .. } if len as u64 > self.config.max_message_bytes => {
                warn!(
                    stream,
                    seq,
                    len,
                    max = self.config.max_message_bytes,
                    "UCX message over the size limit refused: message lost"
                );
                state.slots.insert(seq, Slot::Lost);
                self.release(body);
            }
            ArrivalBody::Rendezvous { desc, len } => {
                let mut buffer = match &self.config.receive_buffers {
                    Some(buffers) => buffers.allocate(len),
                    None => crate::receive::fresh(len),
                };
                let token = self.token();
                // SAFETY: `desc` is a rendezvous descriptor from this worker's AM callback;
                // `buffer` has room for `len` bytes that stay put (it is kept in
                // `Pending::Receive`) until UCX reports completion (`ReceiveBuffer`'s contract).
                let request = unsafe {
                    receive_into(
                        self.worker.0,
                        desc,
                        buffer.as_mut_ptr(),
                        len,
                        user_data(token),
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

    /// Puts an arrived part into its message's assembly (made by the first part to arrive).
    fn accept_part(&mut self, part: PartHeader, header: Vec<u8>, body: ArrivalBody) {
        let (stream, seq) = (part.stream, part.seq);
        let token = self.token();
        let state = self.streams.entry(stream).or_default();
        if seq < state.next_seq {
            warn!(
                stream,
                seq,
                index = part.index,
                "part of a finished UCX message dropped"
            );
            self.release(body);
            return;
        }
        let max = self.config.max_message_bytes;
        let buffers = self.config.receive_buffers.as_ref();
        let slot =
            state
                .slots
                .entry(seq)
                .or_insert_with(|| match Assembly::new(&part, max, buffers) {
                    Ok(assembly) => Slot::Assembling(Box::new(assembly)),
                    Err(e) => {
                        warn!(stream, seq, "UCX message refused: {e}");
                        Slot::Lost
                    }
                });
        let Slot::Assembling(assembly) = slot else {
            // Refused, lost, or a whole message of the same number: nothing to put it into.
            self.release(body);
            return;
        };
        match body {
            ArrivalBody::Eager(data) => {
                if let Err(e) = assembly.write(&part, header, &data) {
                    assembly.fail(e);
                }
            }
            ArrivalBody::Rendezvous { desc, len } => match assembly.place(&part, header, len) {
                Err(e) => {
                    assembly.fail(e);
                    // SAFETY: the descriptor came from this worker's AM callback, which
                    // returned UCS_INPROGRESS, and is released once.
                    unsafe { sys::ucp_am_data_release(self.worker.0, desc) };
                }
                Ok(target) => {
                    // SAFETY: `desc` is a rendezvous descriptor from this worker's AM callback;
                    // `target` points to `len` bytes of the assembly's buffer, which stays put
                    // until the assembly has seen this receive finish (it is settled only then).
                    let request =
                        unsafe { receive_into(self.worker.0, desc, target, len, user_data(token)) };
                    if sys::UCS_PTR_IS_ERR(request) {
                        let status = Status::new(sys::UCS_PTR_RAW_STATUS(request));
                        assembly.fail(format!("receiving part {} failed: {status}", part.index));
                    } else if !request.is_null() {
                        assembly.started();
                        self.pending.insert(
                            token,
                            Pending::ReceivePart {
                                request,
                                stream,
                                seq,
                                len,
                            },
                        );
                    }
                }
            },
        }
        self.settle(stream, seq);
    }

    /// Turns a message's assembly into the message (or a loss) once it is settled.
    fn settle(&mut self, stream: u64, seq: u64) {
        let Some(slot) = self
            .streams
            .get_mut(&stream)
            .and_then(|state| state.slots.get_mut(&seq))
        else {
            return;
        };
        if !matches!(slot, Slot::Assembling(assembly) if assembly.is_settled()) {
            return;
        }
        if let Slot::Assembling(assembly) = std::mem::replace(slot, Slot::Lost) {
            match (*assembly).finish() {
                Ok(message) => *slot = Slot::Ready(message),
                Err(reason) => warn!(stream, seq, "UCX message lost: {reason}"),
            }
        }
    }

    /// Lets go of an arrival that is dropped.
    fn release(&self, body: ArrivalBody) {
        if let ArrivalBody::Rendezvous { desc, .. } = body {
            // SAFETY: the descriptor came from this worker's AM callback, which returned
            // UCS_INPROGRESS, and is released once (the body is consumed).
            unsafe { sys::ucp_am_data_release(self.worker.0, desc) };
        }
    }

    /// Finishes one request; returns the stream whose delivery may advance.
    fn complete(&mut self, token: u64, status: sys::ucs_status_t, length: usize) -> Option<u64> {
        let pending = self.pending.remove(&token)?;
        // SAFETY: the request handle was returned by a UCX *_nbx call on this worker, its
        // callback has fired, and it is freed once (its entry was just removed).
        unsafe { sys::ucp_request_free(pending.request()) };
        match pending {
            Pending::Send { group, .. } => {
                self.send_done(group, status);
                None
            }
            Pending::ReceivePart {
                stream, seq, len, ..
            } => {
                let assembly = self
                    .streams
                    .get_mut(&stream)
                    .and_then(|state| state.slots.get_mut(&seq));
                if let Some(Slot::Assembling(assembly)) = assembly {
                    assembly.received(if status != sys::UCS_OK {
                        Err(format!("receiving a part failed: {}", Status::new(status)))
                    } else if length != len {
                        Err(format!("a part of {len} bytes brought {length}"))
                    } else {
                        Ok(())
                    });
                }
                self.settle(stream, seq);
                Some(stream)
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

    /// One request of send `group` finished: the caller hears of the first failure, or of
    /// success once every request is done.
    fn send_done(&mut self, group: u64, status: sys::ucs_status_t) {
        let Some(send) = self.sends.get_mut(&group) else {
            return;
        };
        send.outstanding = send.outstanding.saturating_sub(1);
        let failed = status != sys::UCS_OK;
        if failed && let Some(reply) = send.reply.take() {
            let status = Status::new(status);
            warn!(peer = %send.peer, %status, "UCX send failed");
            let _ = reply.send(Err(UcxError::Send {
                peer: send.peer.clone(),
                status,
            }));
        }
        let stream = send.stream;
        if send.outstanding == 0
            && let Some(send) = self.sends.remove(&group)
            && let Some(reply) = send.reply
        {
            let _ = reply.send(Ok(()));
        }
        if failed {
            self.retire_endpoint(stream);
        }
    }

    /// Hands the stream's messages that are next in sequence to the incoming channel.
    fn deliver(&mut self, stream: u64) {
        let Some(state) = self.streams.get_mut(&stream) else {
            return;
        };
        while let Some(entry) = state.slots.first_entry() {
            if *entry.key() != state.next_seq
                || matches!(entry.get(), Slot::Receiving | Slot::Assembling(_))
            {
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
        for (&group, send) in &mut self.sends {
            if send.deadline.is_some_and(|d| d <= now) {
                send.deadline = None;
                if let Some(reply) = send.reply.take() {
                    warn!(peer = %send.peer, ?after, "UCX send timed out: cancelling");
                    let _ = reply.send(Err(UcxError::TimedOut {
                        peer: send.peer.clone(),
                        after,
                    }));
                }
                expired.push((group, send.stream));
            }
        }
        for (group, stream) in expired {
            for pending in self.pending.values() {
                if let Pending::Send { request, group: g } = pending
                    && *g == group
                {
                    // SAFETY: the request is outstanding on this worker (its callback has not
                    // fired, so it is still in `pending`); it stays there until the callback
                    // reports completion.
                    unsafe { sys::ucp_request_cancel(self.worker.0, *request) };
                }
            }
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
        let parts_left = left
            .values()
            .any(|pending| matches!(pending, Pending::ReceivePart { .. }));
        let Progress {
            worker,
            context,
            sends,
            streams,
            ..
        } = self;
        if !left.is_empty() {
            warn!(
                operations = left.len(),
                "UCX operations still outstanding at shutdown; their buffers are leaked"
            );
        }
        for pending in left.into_values() {
            // SAFETY: the request is outstanding on this worker and freed once; UCX asserts at
            // worker destruction that every request was handed back. No callback fires for it
            // afterwards.
            unsafe { sys::ucp_request_free(pending.request()) };
            std::mem::forget(pending);
        }
        // The buffers of sends and assemblies still in flight are leaked with them.
        let mut replies = Vec::new();
        for mut send in sends.into_values() {
            replies.extend(send.reply.take());
            std::mem::forget(send);
        }
        if parts_left {
            std::mem::forget(streams);
        } else {
            drop(streams);
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

//! Where large (rendezvous) payloads are received: a fresh `Vec` by default, or buffers the
//! caller supplies ([`crate::UcxConfig::receive_buffers`]), such as a pool of blocks that are
//! already resident: every page of a fresh multi-megabyte allocation faults on first touch.

use bytes::Bytes;

/// Makes the buffers large payloads are received into.
pub trait ReceiveBuffers: Send + Sync + std::fmt::Debug {
    /// A buffer with room for `len` bytes.
    fn allocate(&self, len: usize) -> Box<dyn ReceiveBuffer>;
}

/// A buffer a payload is received into, then handed over as the message's payload.
///
/// # Safety
///
/// [`ReceiveBuffer::as_mut_ptr`] must point to at least the `len` bytes the buffer was
/// allocated for, writable, used by nothing else and never moved until the buffer is finished
/// or dropped (UCX writes there from its own thread while the request is in flight).
pub unsafe trait ReceiveBuffer: Send {
    fn as_mut_ptr(&mut self) -> *mut u8;

    /// The first `len` bytes as the payload.
    ///
    /// # Safety
    ///
    /// Those bytes have been written, and `len` is at most what the buffer was allocated for.
    unsafe fn finish(self: Box<Self>, len: usize) -> Bytes;
}

// SAFETY: a `Vec` allocated with the capacity asked for owns that heap memory, which does not
// move when the `Vec` value does.
unsafe impl ReceiveBuffer for Vec<u8> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_slice().as_mut_ptr()
    }

    unsafe fn finish(mut self: Box<Self>, len: usize) -> Bytes {
        // SAFETY: passed on from the caller: `len` bytes within the capacity were written.
        unsafe { self.set_len(len) };
        Bytes::from(*self)
    }
}

/// The default: a fresh `Vec` per payload.
pub(crate) fn fresh(len: usize) -> Box<dyn ReceiveBuffer> {
    Box::new(Vec::<u8>::with_capacity(len))
}

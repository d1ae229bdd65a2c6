//! An incoming message sent in parts ([`crate::parts`]), put together in one receive buffer:
//! eager parts are copied to their offsets, rendezvous parts are received there by UCX. The
//! message is handed on once every part is in and they tile the payload; a refused or failed
//! part loses the message, and its buffer is dropped only once UCX no longer writes into it.

use std::sync::Arc;

use bytes::Bytes;

use crate::Message;
use crate::parts::{PartError, PartHeader, Tiling};
use crate::receive::{ReceiveBuffer, ReceiveBuffers};

pub(crate) struct Assembly {
    buffer: Box<dyn ReceiveBuffer>,
    tiling: Tiling,
    /// The caller's header, from part 0.
    header: Option<Vec<u8>>,
    /// Rendezvous receives UCX is still writing into `buffer`.
    receiving: usize,
    /// Why the message is lost, once a part was refused or failed.
    failed: Option<String>,
}

impl Assembly {
    /// The assembly of the message `first` (whichever part arrived first) belongs to, with a
    /// buffer for its whole payload; refused when the payload is over `max` bytes.
    pub(crate) fn new(
        first: &PartHeader,
        max: u64,
        buffers: Option<&Arc<dyn ReceiveBuffers>>,
    ) -> Result<Assembly, PartError> {
        let tiling = Tiling::new(first, max)?;
        let len = usize::try_from(tiling.total()).map_err(|_| PartError::TooLarge {
            total: tiling.total(),
            max: usize::MAX as u64,
        })?;
        let buffer = match buffers {
            Some(buffers) => buffers.allocate(len),
            None => crate::receive::fresh(len),
        };
        Ok(Assembly {
            buffer,
            tiling,
            header: None,
            receiving: 0,
            failed: None,
        })
    }

    /// Records part `part` of `len` bytes (with the caller's header `user` on part 0) and
    /// returns where in the buffer its bytes go: `len` writable bytes there.
    pub(crate) fn place(
        &mut self,
        part: &PartHeader,
        user: Vec<u8>,
        len: usize,
    ) -> Result<*mut u8, PartError> {
        self.tiling.place(part, len as u64)?;
        if part.index == 0 {
            self.header = Some(user);
        }
        // The offset is within the buffer's room (`place` checked offset + len <= total).
        let offset = part.offset as usize;
        Ok(self.buffer.as_mut_ptr().wrapping_add(offset))
    }

    /// Records an eager part and copies its bytes into place.
    pub(crate) fn write(
        &mut self,
        part: &PartHeader,
        user: Vec<u8>,
        data: &[u8],
    ) -> Result<(), PartError> {
        let target = self.place(part, user, data.len())?;
        // SAFETY: `place` returned a pointer to `data.len()` bytes of the buffer's room, which
        // is writable and used by nothing else (`ReceiveBuffer`'s contract); `data` is a
        // separate allocation.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), target, data.len()) };
        Ok(())
    }

    /// A rendezvous receive into the buffer started.
    pub(crate) fn started(&mut self) {
        self.receiving += 1;
    }

    /// A rendezvous receive into the buffer finished: `Err` with why it failed.
    pub(crate) fn received(&mut self, outcome: Result<(), String>) {
        self.receiving = self.receiving.saturating_sub(1);
        if let Err(reason) = outcome {
            self.fail(reason);
        }
    }

    /// Loses the message (the first reason is kept).
    pub(crate) fn fail(&mut self, reason: impl ToString) {
        self.failed.get_or_insert_with(|| reason.to_string());
    }

    /// Whether nothing writes into the buffer any more and the outcome is known.
    pub(crate) fn is_settled(&self) -> bool {
        self.receiving == 0 && (self.failed.is_some() || self.tiling.is_complete())
    }

    /// The message, once settled; `Err` with why it is lost.
    pub(crate) fn finish(self) -> Result<Message, String> {
        if let Some(reason) = self.failed {
            return Err(reason);
        }
        self.tiling.check().map_err(|e| e.to_string())?;
        let header = self
            .header
            .ok_or("the parts of a message arrived without part 0's header")?;
        let len = self.tiling.total() as usize;
        // SAFETY: the parts tile the payload (checked above), every rendezvous part completed
        // with its full length and every eager part was copied, so all `len` bytes of the room
        // were written.
        let payload: Bytes = unsafe { self.buffer.finish(len) };
        Ok(Message { header, payload })
    }
}

//! Where a GPU runtime's memory lives and its kernels run: a CUDA device (its context and
//! stream), or the CPU emulation of one ([`super::emulator`]). Every allocation, copy and
//! synchronisation of the GPU backend goes through here, so the operators above are the same
//! code on both.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

/// The device behind a runtime.
pub enum Backend {
    Cuda {
        context: Arc<CudaContext>,
        stream: Arc<CudaStream>,
    },
    /// Kernels compiled for the host and run by the emulator; memory in host RAM.
    Emulated,
}

/// A block of device memory (or of host memory standing in for it).
pub enum Memory {
    Cuda(CudaSlice<u8>),
    Host(HostMemory),
}

impl Drop for Memory {
    fn drop(&mut self) {
        // cudarc frees a slice (cuMemFreeAsync) without making its context current first, and a
        // thread that never touched the device (a transfer or runtime thread that drops the last
        // reference to a table) has none: the free would fail, leaking the memory, and cudarc
        // would hand its error to the next call on the context, from whichever thread.
        if let Memory::Cuda(slice) = self {
            let context = slice.stream().context();
            let current = cudarc::driver::result::ctx::get_current();
            if !matches!(current, Ok(Some(c)) if c == context.cu_ctx()) {
                // SAFETY: the context outlives the slice, which holds a reference to it.
                if let Err(e) =
                    unsafe { cudarc::driver::result::ctx::set_current(context.cu_ctx()) }
                {
                    tracing::warn!(error = %e, "making the CUDA context current to free a buffer");
                }
            }
        }
    }
}

/// Host memory standing in for device memory. Each buffer is mapped on its own and ends where
/// an inaccessible guard page begins, so a kernel that writes or reads past the end faults at
/// that instruction instead of corrupting the heap. The bytes are 8-byte aligned and start as
/// `0xA5` (device memory is not zeroed either, and a kernel reading what nothing wrote should
/// show it).
pub struct HostMemory {
    map: NonNull<c_void>,
    map_len: usize,
    data: *mut u8,
    capacity: usize,
}

// SAFETY: the mapping is owned by this value alone; kernels reach it only through addresses
// handed to a launch that joins its threads before returning.
unsafe impl Send for HostMemory {}
// SAFETY: as above; shared access only reads through copies.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    fn new(bytes: usize) -> Result<HostMemory, String> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .ok()
            .filter(|p| p.is_power_of_two())
            .unwrap_or(4096);
        let capacity = bytes.max(1).next_multiple_of(8);
        let data_len = capacity.next_multiple_of(page);
        let map_len = data_len + page;
        // SAFETY: a fresh private anonymous mapping; the result is checked.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(format!(
                "mapping {bytes} bytes of host memory for the emulated device failed: {}",
                std::io::Error::last_os_error()
            ));
        }
        let memory = HostMemory {
            map: NonNull::new(map).ok_or("mmap returned null")?,
            map_len,
            // SAFETY: `data_len - capacity` is within the mapping.
            data: unsafe { map.cast::<u8>().add(data_len - capacity) },
            capacity,
        };
        // SAFETY: the last page of our own mapping becomes the guard; the buffer's bytes are
        // within the mapping.
        unsafe {
            if libc::mprotect(map.cast::<u8>().add(data_len).cast(), page, libc::PROT_NONE) != 0 {
                return Err(format!(
                    "protecting the guard page of an emulated device buffer failed: {}",
                    std::io::Error::last_os_error()
                ));
            }
            std::ptr::write_bytes(memory.data, 0xA5, capacity);
        }
        Ok(memory)
    }

    fn bytes(&self) -> *mut u8 {
        self.data
    }

    /// Whether `what` up to byte `end` stays within the buffer.
    fn check(&self, what: &str, end: usize) -> Result<(), String> {
        if end > self.capacity {
            return Err(out_of_range(what, end, self.capacity));
        }
        Ok(())
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once here.
        unsafe { libc::munmap(self.map.as_ptr(), self.map_len) };
    }
}

/// A copy that fell outside a buffer or that the driver refused.
fn out_of_range(what: &str, end: usize, capacity: usize) -> String {
    format!("{what} up to byte {end} of a {capacity}-byte buffer")
}

impl Backend {
    pub fn is_emulated(&self) -> bool {
        matches!(self, Backend::Emulated)
    }

    /// `bytes` (at least one) of uninitialised memory.
    pub fn alloc(&self, bytes: usize) -> Result<Memory, String> {
        match self {
            // SAFETY: the memory is uninitialised; every caller writes it (a copy or a kernel)
            // before reading it.
            Backend::Cuda { stream, .. } => unsafe { stream.alloc::<u8>(bytes.max(1)) }
                .map(Memory::Cuda)
                .map_err(|e| e.to_string()),
            Backend::Emulated => HostMemory::new(bytes).map(Memory::Host),
        }
    }

    /// The address of byte `offset` of `memory`, as a kernel argument.
    pub fn address(&self, memory: &Memory, offset: u64) -> u64 {
        match (self, memory) {
            (Backend::Cuda { stream, .. }, Memory::Cuda(slice)) => {
                let (pointer, _sync) = slice.device_ptr(stream);
                pointer + offset
            }
            (_, Memory::Host(host)) => host.bytes() as u64 + offset,
            (Backend::Emulated, Memory::Cuda(_)) => 0,
        }
    }

    /// Copies `bytes` to the start of `memory`.
    pub fn write(&self, memory: &mut Memory, bytes: &[u8]) -> Result<(), String> {
        match (self, memory) {
            (Backend::Cuda { stream, .. }, Memory::Cuda(slice)) => {
                let capacity = slice.len();
                let mut target = slice
                    .try_slice_mut(0..bytes.len())
                    .ok_or_else(|| out_of_range("a write", bytes.len(), capacity))?;
                stream
                    .memcpy_htod(bytes, &mut target)
                    .map_err(|e| e.to_string())
            }
            (_, Memory::Host(host)) => {
                host.check("a write", bytes.len())?;
                // SAFETY: in bounds (checked), and `bytes` cannot overlap memory we own.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), host.bytes(), bytes.len()) };
                Ok(())
            }
            (Backend::Emulated, Memory::Cuda(_)) => Err(mixed()),
        }
    }

    /// Copies `out.len()` bytes of `memory` from byte `at` to `out`, waiting for the work
    /// before it.
    pub fn read(&self, memory: &Memory, at: usize, out: &mut [u8]) -> Result<(), String> {
        let end = at + out.len();
        match (self, memory) {
            (Backend::Cuda { stream, .. }, Memory::Cuda(slice)) => {
                let view = slice
                    .try_slice(at..end)
                    .ok_or_else(|| out_of_range("a read", end, slice.len()))?;
                stream.memcpy_dtoh(&view, out).map_err(|e| e.to_string())?;
                stream.synchronize().map_err(|e| e.to_string())
            }
            (_, Memory::Host(host)) => {
                host.check("a read", end)?;
                // SAFETY: in bounds (checked); no launch is running (launches are synchronous).
                unsafe {
                    std::ptr::copy_nonoverlapping(host.bytes().add(at), out.as_mut_ptr(), out.len())
                };
                Ok(())
            }
            (Backend::Emulated, Memory::Cuda(_)) => Err(mixed()),
        }
    }

    /// Copies `len` bytes from the start of `src` to byte `at` of `dst`.
    pub fn copy(
        &self,
        src: &Memory,
        len: usize,
        dst: &mut Memory,
        at: usize,
    ) -> Result<(), String> {
        match (self, src, dst) {
            (Backend::Cuda { stream, .. }, Memory::Cuda(src), Memory::Cuda(dst)) => {
                let source = src
                    .try_slice(0..len)
                    .ok_or_else(|| out_of_range("a copy", len, src.len()))?;
                let dst_len = dst.len();
                let mut target = dst
                    .try_slice_mut(at..at + len)
                    .ok_or_else(|| out_of_range("a copy", at + len, dst_len))?;
                stream
                    .memcpy_dtod(&source, &mut target)
                    .map_err(|e| e.to_string())
            }
            (_, Memory::Host(src), Memory::Host(dst)) => {
                src.check("a copy", len)?;
                dst.check("a copy", at + len)?;
                // SAFETY: both in bounds (checked); two owned buffers do not overlap.
                unsafe { std::ptr::copy_nonoverlapping(src.bytes(), dst.bytes().add(at), len) };
                Ok(())
            }
            _ => Err(mixed()),
        }
    }

    /// Waits for every copy and launch issued so far.
    pub fn synchronize(&self) -> Result<(), String> {
        match self {
            Backend::Cuda { stream, .. } => stream.synchronize().map_err(|e| e.to_string()),
            // Emulated launches and copies finish before they return.
            Backend::Emulated => Ok(()),
        }
    }
}

fn mixed() -> String {
    "a buffer of one backend was used with another".into()
}

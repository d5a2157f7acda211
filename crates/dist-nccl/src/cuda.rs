//! The few CUDA driver objects the backend needs, each owning its handle: a device's primary
//! context, a stream, an event, pinned host memory and a device scratch allocation. Their
//! `Drop`s never panic (a failed release is logged), unlike cudarc's safe types.
//!
//! Nothing here may be called before [`crate::loader::ensure_loaded`] succeeded: cudarc
//! panics on a missing library or symbol.

use std::ffi::c_void;

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;

use crate::{Error, Result};

/// The driver's name for an error (`CUDA_ERROR_...`).
pub(crate) fn driver_error_name(e: DriverError) -> String {
    match e.error_name() {
        Ok(name) => name.to_string_lossy().into_owned(),
        Err(_) => format!("{:?}", e.0),
    }
}

/// Maps a driver error to [`Error::Cuda`].
pub(crate) fn cuda_err(
    rank: usize,
    op: &'static str,
    call: &'static str,
) -> impl Fn(DriverError) -> Error {
    move |e| Error::Cuda {
        rank,
        op,
        call,
        code: driver_error_name(e),
    }
}

/// Number of CUDA devices on this machine (`rank` names the caller in errors); fails with
/// [`Error::Unavailable`] when the driver cannot be loaded.
pub fn device_count(rank: usize) -> Result<u32> {
    crate::loader::ensure_loaded()?;
    let n = cu::device::get_count().map_err(cuda_err(rank, "init", "cuDeviceGetCount"))?;
    Ok(n.max(0) as u32)
}

/// A device's primary context, made current on the calling thread by [`Device::bind`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Device {
    ordinal: u32,
    ctx: sys::CUcontext,
}

// SAFETY: a CUcontext is a process-wide handle the driver lets any thread make current; the
// primary context is retained for the life of the process (never released), so it stays valid.
unsafe impl Send for Device {}
// SAFETY: as above; `bind` only makes it current on the calling thread.
unsafe impl Sync for Device {}

impl Device {
    /// Retains device `ordinal`'s primary context (what the CUDA runtime and torch use, so
    /// buffers they allocate are valid in it).
    pub(crate) fn primary(rank: usize, ordinal: u32) -> Result<Device> {
        crate::loader::ensure_loaded()?;
        let dev = cu::device::get(ordinal as i32).map_err(cuda_err(rank, "init", "cuDeviceGet"))?;
        // SAFETY: `dev` is a device handle the driver just returned.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(cuda_err(
            rank,
            "init",
            "cuDevicePrimaryCtxRetain",
        ))?;
        Ok(Device { ordinal, ctx })
    }

    /// Device ordinal.
    pub(crate) fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Makes the context current on this thread (NCCL and the driver act on the current one).
    pub(crate) fn bind(&self, rank: usize, op: &'static str) -> Result<()> {
        // SAFETY: `ctx` is a retained primary context (see the `Send` impl).
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(cuda_err(rank, op, "cuCtxSetCurrent"))
    }
}

/// A non-blocking stream owned by the backend (NCCL's, as torch's per-device NCCL stream).
#[derive(Debug)]
pub(crate) struct Stream(sys::CUstream);

// SAFETY: a stream handle may be used from any thread whose current context owns it; every
// use binds the device first.
unsafe impl Send for Stream {}
// SAFETY: as above; the driver serialises work submitted to one stream.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a stream on the current context.
    pub(crate) fn new(rank: usize) -> Result<Stream> {
        let s = cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(cuda_err(
            rank,
            "init",
            "cuStreamCreate",
        ))?;
        Ok(Stream(s))
    }

    /// The raw handle.
    pub(crate) fn raw(&self) -> sys::CUstream {
        self.0
    }

    /// Makes this stream wait, on the GPU, for everything queued on `other` so far.
    pub(crate) fn wait_for(
        &self,
        other: sys::CUstream,
        rank: usize,
        op: &'static str,
    ) -> Result<()> {
        let ev = Event::new(rank, op)?;
        ev.record(other, rank, op)?;
        ev.block_stream(self.0, rank, op)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: the stream is owned by self and no longer used; the driver lets destroy
        // return at once and releases it when its work is done.
        if let Err(e) = unsafe { cu::stream::destroy(self.0) } {
            tracing::warn!(code = %driver_error_name(e), "dist-nccl: cuStreamDestroy failed");
        }
    }
}

/// An event without timing, to fence streams and to poll completion.
#[derive(Debug)]
pub(crate) struct Event(sys::CUevent);

// SAFETY: an event handle is usable from any thread; recording and querying are thread-safe.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event on the current context.
    pub(crate) fn new(rank: usize, op: &'static str) -> Result<Event> {
        let e = cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(cuda_err(rank, op, "cuEventCreate"))?;
        Ok(Event(e))
    }

    /// Records the event at the current end of `stream`.
    pub(crate) fn record(
        &self,
        stream: sys::CUstream,
        rank: usize,
        op: &'static str,
    ) -> Result<()> {
        // SAFETY: the event is live; `stream` is a live stream of the current context (the
        // caller's, vouched for by `DeviceBuffer::from_raw`, or ours).
        unsafe { cu::event::record(self.0, stream) }.map_err(cuda_err(rank, op, "cuEventRecord"))
    }

    /// Makes `stream` wait, on the GPU, for this event.
    pub(crate) fn block_stream(
        &self,
        stream: sys::CUstream,
        rank: usize,
        op: &'static str,
    ) -> Result<()> {
        // SAFETY: as in `record`.
        unsafe {
            cu::stream::wait_event(
                stream,
                self.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(cuda_err(rank, op, "cuStreamWaitEvent"))
    }

    /// True once the GPU has passed the event; an error if the context failed.
    pub(crate) fn is_done(&self) -> std::result::Result<bool, DriverError> {
        // SAFETY: the event is live.
        match unsafe { cu::event::query(self.0) } {
            Ok(()) => Ok(true),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is owned by self; destroying a pending event is allowed (the
        // driver releases it once reached).
        if let Err(e) = unsafe { cu::event::destroy(self.0) } {
            tracing::warn!(code = %driver_error_name(e), "dist-nccl: cuEventDestroy failed");
        }
    }
}

/// Page-locked host memory (for host staging: the copies run at full PCIe speed and can be
/// ordered on a stream).
#[derive(Debug)]
pub(crate) struct PinnedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain host memory owned by self.
unsafe impl Send for PinnedBuf {}

impl PinnedBuf {
    /// Allocates `len` bytes (at least one, so the pointer is never dangling).
    pub(crate) fn new(len: usize, rank: usize, op: &'static str) -> Result<PinnedBuf> {
        // SAFETY: plain allocation on the current context.
        let ptr = unsafe { cu::malloc_host(len.max(1), 0) }.map_err(cuda_err(
            rank,
            op,
            "cuMemAllocHost",
        ))?;
        Ok(PinnedBuf {
            ptr: ptr.cast(),
            len,
        })
    }

    /// The bytes.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `len` (or more) bytes owned by self, which `&mut self`
        // borrows exclusively; pinned memory is ordinary host memory to the CPU.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Copies `len` bytes from device address `src` into this buffer, ordered on `stream`,
    /// and waits for the copy.
    pub(crate) fn copy_from_device(
        &mut self,
        src: u64,
        stream: sys::CUstream,
        rank: usize,
        op: &'static str,
    ) -> Result<()> {
        let dst = self.as_mut_slice();
        // SAFETY: `src..src+len` is device memory the caller vouched for with
        // `DeviceBuffer::from_raw`; `dst` is this buffer's `len` bytes, borrowed until the
        // synchronize below returns.
        unsafe { cu::memcpy_dtoh_async(dst, src, stream) }.map_err(cuda_err(
            rank,
            op,
            "cuMemcpyDtoHAsync",
        ))?;
        // SAFETY: `stream` is live (vouched for by the caller).
        unsafe { cu::stream::synchronize(stream) }.map_err(cuda_err(
            rank,
            op,
            "cuStreamSynchronize",
        ))
    }

    /// Copies this buffer to device address `dst`, ordered on `stream`, and waits for it.
    pub(crate) fn copy_to_device(
        &mut self,
        dst: u64,
        stream: sys::CUstream,
        rank: usize,
        op: &'static str,
    ) -> Result<()> {
        let src = self.as_mut_slice();
        // SAFETY: as in `copy_from_device`, in the other direction.
        unsafe { cu::memcpy_htod_async(dst, &*src, stream) }.map_err(cuda_err(
            rank,
            op,
            "cuMemcpyHtoDAsync",
        ))?;
        // SAFETY: as above.
        unsafe { cu::stream::synchronize(stream) }.map_err(cuda_err(
            rank,
            op,
            "cuStreamSynchronize",
        ))
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAllocHost in `new`, freed once; any copy using it was
        // synchronised before returning.
        if let Err(e) = unsafe { cu::free_host(self.ptr.cast::<c_void>()) } {
            tracing::warn!(code = %driver_error_name(e), "dist-nccl: cuMemFreeHost failed");
        }
    }
}

/// A small device allocation the backend owns (barrier's one element).
#[derive(Debug)]
pub(crate) struct DeviceScratch {
    ptr: sys::CUdeviceptr,
}

impl DeviceScratch {
    /// Allocates `len` bytes on the current context.
    pub(crate) fn new(len: usize, rank: usize, op: &'static str) -> Result<DeviceScratch> {
        // SAFETY: plain allocation on the current context.
        let ptr =
            unsafe { cu::malloc_sync(len.max(1)) }.map_err(cuda_err(rank, op, "cuMemAlloc"))?;
        Ok(DeviceScratch { ptr })
    }

    /// Device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for DeviceScratch {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` and freed once; the backend drains its stream (or has
        // aborted the communicator) before dropping it.
        if let Err(e) = unsafe { cu::free_sync(self.ptr) } {
            tracing::warn!(code = %driver_error_name(e), "dist-nccl: cuMemFree failed");
        }
    }
}

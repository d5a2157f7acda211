//! [`DeviceAlloc`]: device memory the crate allocates itself (tests, benchmarks, and callers
//! with no other CUDA library).

use cudarc::driver::result as cu;
use dist_backend::DeviceBuffer;

use crate::cuda::{Device, cuda_err, driver_error_name};
use crate::{Error, Result};

/// An owned allocation of `len` bytes on one device, freed on drop.
#[derive(Debug)]
pub struct DeviceAlloc {
    device: Device,
    ptr: u64,
    len: usize,
}

impl DeviceAlloc {
    /// Allocates `len` bytes (uninitialised) on device `ordinal`. Fails with
    /// [`Error::Unavailable`] when the CUDA driver cannot be loaded.
    pub fn new(ordinal: u32, len: usize) -> Result<DeviceAlloc> {
        let device = Device::primary(0, ordinal)?;
        device.bind(0, "alloc")?;
        // SAFETY: a plain allocation on the bound context.
        let ptr =
            unsafe { cu::malloc_sync(len.max(1)) }.map_err(cuda_err(0, "alloc", "cuMemAlloc"))?;
        Ok(DeviceAlloc { device, ptr, len })
    }

    /// Allocates on device `ordinal` and copies `bytes` in.
    pub fn from_bytes(ordinal: u32, bytes: &[u8]) -> Result<DeviceAlloc> {
        let mut a = DeviceAlloc::new(ordinal, bytes.len())?;
        a.upload(bytes)?;
        Ok(a)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `bytes` (exactly [`len`](Self::len) of them) to the device, waiting for the copy.
    pub fn upload(&mut self, bytes: &[u8]) -> Result<()> {
        if bytes.len() != self.len {
            return Err(Error::Unsupported {
                rank: 0,
                op: "upload",
                reason: format!("{} bytes into an allocation of {}", bytes.len(), self.len),
            });
        }
        if self.len == 0 {
            return Ok(());
        }
        self.device.bind(0, "upload")?;
        // SAFETY: `ptr` holds `len` bytes owned by self, `&mut self` excludes other use; the
        // synchronous copy completes before returning.
        unsafe { cu::memcpy_htod_sync(self.ptr, bytes) }.map_err(cuda_err(
            0,
            "upload",
            "cuMemcpyHtoD",
        ))
    }

    /// Copies the device bytes out, after the work on the default stream (and every
    /// operation that returned) has finished.
    pub fn download(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.len];
        if self.len == 0 {
            return Ok(out);
        }
        self.device.bind(0, "download")?;
        // SAFETY: as in `upload`, reading.
        unsafe { cu::memcpy_dtoh_sync(&mut out[..], self.ptr) }.map_err(cuda_err(
            0,
            "download",
            "cuMemcpyDtoH",
        ))?;
        Ok(out)
    }

    /// The allocation as a buffer for a backend, ordered on the default stream.
    ///
    /// # Safety
    ///
    /// The returned buffer is a copy of a raw address: every operation given it must have
    /// completed on the default stream before this allocation is dropped, and operations
    /// given it must not overlap other reads and writes of it (the contract of
    /// [`DeviceBuffer::from_raw`]).
    pub unsafe fn buffer(&self) -> DeviceBuffer {
        // SAFETY: `ptr..ptr+len` is owned device memory of this device; the rest of the
        // contract is passed on to the caller (above).
        unsafe { DeviceBuffer::from_raw(self.ptr, self.len, self.device.ordinal(), 0) }
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if self.device.bind(0, "free").is_err() {
            return;
        }
        // SAFETY: allocated in `new`, freed once here.
        if let Err(e) = unsafe { cu::free_sync(self.ptr) } {
            tracing::warn!(code = %driver_error_name(e), "dist-nccl: cuMemFree failed");
        }
    }
}

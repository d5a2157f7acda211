/// Device memory a GPU backend reads or writes: a raw device address, its length, the device
/// and the stream on which the collective must be ordered. Host backends reject it with
/// `Unsupported`.
///
/// A backend dereferences the address on the device, so making one is `unsafe`
/// ([`DeviceBuffer::from_raw`]): the caller vouches for the memory, as NCCL's callers do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBuffer {
    ptr: u64,
    len: usize,
    device: u32,
    stream: u64,
}

impl DeviceBuffer {
    /// A buffer of `len` bytes at device address `ptr` (e.g. a `CUdeviceptr`) on device
    /// ordinal `device`, ordered on `stream` (e.g. a `CUstream`; 0 for the default stream).
    ///
    /// # Safety
    ///
    /// Until every operation given this buffer has completed on `stream` (for an operation
    /// that returns once enqueued, until the stream reaches it):
    /// * `ptr..ptr + len` is memory allocated on device `device`, valid for reads, and for
    ///   writes when the buffer is passed as a [`BufMut`];
    /// * nothing else writes it (or, for a [`BufRef`], nothing writes it at all) except work
    ///   ordered on `stream` before or after the operation;
    /// * `stream` is a live stream of device `device` (or 0).
    #[allow(
        unsafe_code,
        reason = "the contract above is what a GPU backend relies on"
    )]
    pub unsafe fn from_raw(ptr: u64, len: usize, device: u32, stream: u64) -> Self {
        DeviceBuffer {
            ptr,
            len,
            device,
            stream,
        }
    }

    /// A zero-length buffer on device `device`, ordered on the default stream: nothing to
    /// read or write, so no contract to vouch for (the empty tensors of a collective over an
    /// uneven split, and tests of routing).
    pub fn empty(device: u32) -> Self {
        DeviceBuffer {
            ptr: 0,
            len: 0,
            device,
            stream: 0,
        }
    }

    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device ordinal.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// Stream handle (0: the default stream).
    pub fn stream(&self) -> u64 {
        self.stream
    }
}

/// A read-only buffer handed to a backend.
#[derive(Debug)]
pub enum BufRef<'a> {
    /// Host memory.
    Host(&'a [u8]),
    /// Device memory.
    Device(DeviceBuffer),
}

/// A writable buffer handed to a backend.
#[derive(Debug)]
pub enum BufMut<'a> {
    /// Host memory.
    Host(&'a mut [u8]),
    /// Device memory.
    Device(DeviceBuffer),
}

impl BufRef<'_> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            BufRef::Host(b) => b.len(),
            BufRef::Device(d) => d.len,
        }
    }

    /// True when the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl BufMut<'_> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            BufMut::Host(b) => b.len(),
            BufMut::Device(d) => d.len,
        }
    }

    /// True when the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

//! Buffer descriptions: host bytes, or device memory plus the stream that orders work on it.

/// Device memory a GPU backend reads or writes: a raw pointer, its length, and the stream on
/// which the collective must be ordered. Host backends reject it with `Unsupported`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBuffer {
    /// Device address (e.g. a `CUdeviceptr`).
    pub ptr: u64,
    /// Length in bytes.
    pub len: usize,
    /// Device ordinal.
    pub device: u32,
    /// Stream handle (e.g. a `CUstream`), 0 for the default stream.
    pub stream: u64,
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

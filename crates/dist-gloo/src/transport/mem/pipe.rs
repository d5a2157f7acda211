//! A bounded in-memory byte stream between two ranks, with TCP's ways of ending: the writer
//! closes (the reader sees EOF after the bytes already written) or the reader goes away (the
//! writer's next write is a reset).

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// One rank's wake-up: bumped whenever one of its streams becomes readable or writable.
#[derive(Debug, Default)]
pub(super) struct Bell {
    rung: Mutex<u64>,
    cv: Condvar,
}

impl Bell {
    /// How often it has rung so far.
    pub(super) fn count(&self) -> u64 {
        *lock(&self.rung)
    }

    pub(super) fn ring(&self) {
        *lock(&self.rung) += 1;
        self.cv.notify_all();
    }

    /// Sleeps until it has rung more than `seen` times or `until` passes.
    pub(super) fn wait(&self, seen: u64, until: Instant) {
        let mut rung = lock(&self.rung);
        while *rung == seen {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            rung = self
                .cv
                .wait_timeout(rung, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Debug)]
struct Inner {
    bytes: VecDeque<u8>,
    writer_gone: bool,
    reader_gone: bool,
}

/// What a read found.
pub(super) enum Read {
    /// This many bytes (never 0).
    Bytes(usize),
    /// Nothing yet.
    Empty,
    /// The writer closed and everything it wrote has been read.
    Eof,
}

/// One direction of a connection.
#[derive(Debug)]
pub(super) struct Pipe {
    inner: Mutex<Inner>,
    capacity: usize,
}

impl Pipe {
    pub(super) fn new(capacity: usize) -> Self {
        Pipe {
            inner: Mutex::new(Inner {
                bytes: VecDeque::new(),
                writer_gone: false,
                reader_gone: false,
            }),
            capacity,
        }
    }

    /// Appends what fits of `parts` (in order). `Err` when the reader has gone (a reset).
    pub(super) fn write(&self, parts: [&[u8]; 2]) -> Result<usize, &'static str> {
        let mut g = lock(&self.inner);
        if g.reader_gone {
            return Err("connection reset by peer");
        }
        let mut n = 0;
        for p in parts {
            let k = p.len().min(self.capacity.saturating_sub(g.bytes.len()));
            g.bytes.extend(&p[..k]);
            n += k;
        }
        Ok(n)
    }

    /// Appends `bytes` whatever the bound, then closes the writing side: a rank leaving hands
    /// its last bytes over without waiting for the reader, as a socket's send queue does.
    pub(super) fn write_last(&self, bytes: &[u8]) {
        let mut g = lock(&self.inner);
        if !g.reader_gone {
            g.bytes.extend(bytes);
        }
        g.writer_gone = true;
    }

    /// Closes the reading side: unread bytes are dropped and later writes fail.
    pub(super) fn close_reader(&self) {
        let mut g = lock(&self.inner);
        g.reader_gone = true;
        g.bytes.clear();
    }

    /// Takes up to `dst.len()` bytes.
    pub(super) fn read(&self, dst: &mut [u8]) -> Read {
        let mut g = lock(&self.inner);
        if g.bytes.is_empty() {
            return if g.writer_gone {
                Read::Eof
            } else {
                Read::Empty
            };
        }
        let k = dst.len().min(g.bytes.len());
        let (a, b) = g.bytes.as_slices();
        let ka = k.min(a.len());
        dist_simd::copy::bulk(&mut dst[..ka], &a[..ka]);
        dist_simd::copy::bulk(&mut dst[ka..k], &b[..k - ka]);
        g.bytes.drain(..k);
        Read::Bytes(k)
    }
}

//! A single-producer, single-consumer byte ring in memory shared by two processes.
//!
//! Layout of one ring (offsets in bytes from its start, which is 128-byte aligned):
//!
//! | offset | field | written by |
//! | --: | --- | --- |
//! | 0 | `tail`: u64, bytes ever written | the writer |
//! | 8 | `writer_waiting`: u32, the writer sleeps until space frees | the writer (set), the reader (clear) |
//! | 128 | `head`: u64, bytes ever read | the reader |
//! | 136 | `reader_sleeping`: u32, the reader sleeps until bytes arrive | the reader (set), the writer (clear) |
//! | 256 | `cap` bytes of data | |
//!
//! `head` and `tail` are monotonic (never reset on wrap, as NCCL's step counters), so `tail -
//! head` is the fill and the two sides never write the same cache line in the fast path. Each
//! side caches the other's counter and rereads it only when its cached view says the ring is
//! empty (reader) or full (writer).
//!
//! Both counters come from a process this one does not control: every value read is checked
//! (`head <= tail <= head + cap`) and a ring that breaks it is reported as corrupt, never
//! indexed with.
//!
//! Sleeping is an eventcount over the two flags, so that a side never sleeps while the other
//! has just made progress it would miss (see [`RxRing::arm`] and [`TxRing::write`]): the
//! sleeper stores its flag, the other side stores its counter, and each then issues a `SeqCst`
//! fence before loading what the other stored. Two fences ordered this way cannot both miss the
//! other side's store (the store-buffering litmus test with fences), so either the sleeper sees
//! the new counter and does not sleep, or the other side sees the flag and rings the doorbell.

#![allow(
    unsafe_code,
    reason = "the ring lives in memory shared with another process"
)]

use std::io::{self, IoSlice};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use memmap2::MmapRaw;

/// Bytes of control lines before the data of each ring.
pub(crate) const CONTROL_BYTES: usize = 256;
const TAIL: usize = 0;
const WRITER_WAITING: usize = 8;
const HEAD: usize = 128;
const READER_SLEEPING: usize = 136;
/// The smallest copy out that a streaming read makes with non-temporal stores: below it the
/// fence that ends one costs more than the cache lines it spares.
const STREAMING_MIN_BYTES: usize = 4096;
/// The smallest copy out of the ring made with `dist_simd::copy::cached`'s vector moves rather
/// than `memcpy`, whose `rep movsb` is the faster of the two only while everything stays in
/// the core's own caches.
const CACHED_MIN_BYTES: usize = 64 << 10;

/// Maps every page of `map[at..at + len]` into this process, writable, now rather than at the
/// first write or read of each (`MADV_POPULATE_WRITE`, Linux 5.14).
///
/// Why: until the data has gone round a ring once, each of its 4 KiB pages faults at first
/// use on each side (the first fault allocating and zeroing the page), a few microseconds
/// each, which is more than a small message costs. With 2 MiB rings a job's first thousand or so messages of a few
/// KiB each ran at 6 us instead of 1 us (2 ranks, all_reduce of 2-8 KiB with 300 iterations per
/// size), long enough to spoil small benchmarks and a training job's first steps.
/// Populating only allocates and maps: it writes nothing, so a peer already using the ring is
/// not disturbed. A kernel without it keeps faulting lazily, as before.
fn populate(map: &MmapRaw, at: usize, len: usize) {
    if let Err(e) = map.advise_range(memmap2::Advice::PopulateWrite, at, len) {
        tracing::debug!(error = %e, "dist-gloo: could not prefault a shared-memory ring");
    }
}

/// One ring inside a shared mapping.
#[derive(Debug)]
struct Ring {
    map: Arc<MmapRaw>,
    /// Offset of the ring's control lines in `map`.
    at: usize,
    /// Data bytes (a power of two).
    cap: usize,
}

impl Ring {
    /// Checks that the ring fits in `map` at `at` and is aligned for its atomics.
    fn new(map: Arc<MmapRaw>, at: usize, cap: usize) -> io::Result<Self> {
        let end = at
            .checked_add(CONTROL_BYTES)
            .and_then(|e| e.checked_add(cap));
        if !cap.is_power_of_two()
            || !at.is_multiple_of(128)
            || end.is_none_or(|e| e > map.len())
            || !(map.as_ptr() as usize).is_multiple_of(128)
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a ring of {cap} bytes at offset {at} does not fit a mapping of {} bytes",
                    map.len()
                ),
            ));
        }
        populate(&map, at, CONTROL_BYTES + cap);
        Ok(Ring { map, at, cap })
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `new` checked that the control lines lie inside the mapping and that `at`
        // (hence `at + off` for the 8-aligned `off` used here) is 8-aligned in a 128-aligned
        // mapping; the mapping lives as long as `self.map`. Other processes access the word
        // only atomically too (this code on their side), so an `AtomicU64` view is sound.
        unsafe { &*self.map.as_mut_ptr().add(self.at + off).cast::<AtomicU64>() }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as in `u64_at`; `off` is 4-aligned.
        unsafe { &*self.map.as_mut_ptr().add(self.at + off).cast::<AtomicU32>() }
    }

    /// Copies `src` into the data area starting at position `pos` (wrapping).
    fn copy_in(&self, pos: u64, src: &[u8]) {
        debug_assert!(src.len() <= self.cap);
        let i = (pos as usize) & (self.cap - 1);
        let first = src.len().min(self.cap - i);
        let data = self.map.as_mut_ptr().wrapping_add(self.at + CONTROL_BYTES);
        // SAFETY: `i + first <= cap` and `src.len() - first <= i`, so both ranges lie in the
        // data area, which `new` checked is inside the mapping, and they do not overlap. The
        // reader does not touch these bytes: they lie between `tail` and `head + cap`, which
        // the writer owns until it publishes `tail` (Release) after this copy, so these
        // exclusive views (they end with this function) alias nothing. The mapping is not
        // `src`'s memory.
        let (to_end, from_start) = unsafe {
            (
                std::slice::from_raw_parts_mut(data.add(i), first),
                std::slice::from_raw_parts_mut(data, src.len() - first),
            )
        };
        let (s_first, s_rest) = src.split_at(first);
        dist_simd::copy::bulk(to_end, s_first);
        dist_simd::copy::bulk(from_start, s_rest);
    }

    /// Copies from position `pos` (wrapping) into `dst`, with stores that bypass the cache
    /// when `streaming` (see `dist_simd::copy::streaming`).
    fn copy_out(&self, pos: u64, dst: &mut [u8], streaming: bool) {
        debug_assert!(dst.len() <= self.cap);
        let i = (pos as usize) & (self.cap - 1);
        let first = dst.len().min(self.cap - i);
        let data = self.map.as_mut_ptr().wrapping_add(self.at + CONTROL_BYTES);
        // SAFETY: as in `copy_in`, with the roles swapped: the bytes between `head` and the
        // `tail` loaded with Acquire are the reader's until it publishes `head` (Release), so
        // nothing writes them while these shared views live (they end with this function).
        let (wrapped, start) = unsafe {
            (
                std::slice::from_raw_parts(data.add(i), first),
                std::slice::from_raw_parts(data, dst.len() - first),
            )
        };
        let cached = dst.len() >= CACHED_MIN_BYTES;
        let (d_first, d_rest) = dst.split_at_mut(first);
        if streaming {
            dist_simd::copy::streaming(d_first, wrapped);
            dist_simd::copy::streaming(d_rest, start);
        } else if cached {
            dist_simd::copy::cached(d_first, wrapped);
            dist_simd::copy::cached(d_rest, start);
        } else {
            dist_simd::copy::bulk(d_first, wrapped);
            dist_simd::copy::bulk(d_rest, start);
        }
    }

    fn corrupt(&self, head: u64, tail: u64) -> io::Error {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the shared-memory ring is corrupt (head {head}, tail {tail}, capacity {})",
                self.cap
            ),
        )
    }
}

/// The writing end of a ring.
#[derive(Debug)]
pub(crate) struct TxRing {
    ring: Ring,
    /// Bytes written (this side's `tail`, the only copy that is not a cache).
    tail: u64,
    /// The reader's `head` as last read.
    head: u64,
}

/// The reading end of a ring.
#[derive(Debug)]
pub(crate) struct RxRing {
    ring: Ring,
    /// Bytes read (this side's `head`).
    head: u64,
    /// The writer's `tail` as last read.
    tail: u64,
}

/// What a write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Wrote {
    /// Bytes taken.
    pub(crate) n: usize,
    /// The reader was asleep: ring its doorbell.
    pub(crate) wake: bool,
}

impl TxRing {
    /// The writing end of the ring of `cap` bytes at `at` in `map`, which starts empty.
    pub(crate) fn new(map: Arc<MmapRaw>, at: usize, cap: usize) -> io::Result<Self> {
        let ring = Ring::new(map, at, cap)?;
        let tail = ring.u64_at(TAIL).load(Ordering::Acquire);
        Ok(TxRing {
            ring,
            tail,
            head: tail,
        })
    }

    /// The whole mapping the ring lies in: the peer's segment, group area included.
    pub(crate) fn mapping(&self) -> Arc<MmapRaw> {
        self.ring.map.clone()
    }

    /// Free space, rereading the reader's `head` only when the cached one shows none.
    fn space(&mut self) -> io::Result<usize> {
        let cap = self.ring.cap as u64;
        if self.tail - self.head < cap {
            return Ok((cap - (self.tail - self.head)) as usize);
        }
        // Acquire: the reader's copies out of the bytes it frees happen before they are reused.
        let head = self.ring.u64_at(HEAD).load(Ordering::Acquire);
        if head < self.head || head > self.tail {
            return Err(self.ring.corrupt(head, self.tail));
        }
        self.head = head;
        Ok((cap - (self.tail - head)) as usize)
    }

    /// Copies as much of `bufs` (in order) as fits and publishes it. `n == 0` means the ring
    /// is full (or `bufs` is empty).
    pub(crate) fn write(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<Wrote> {
        let mut room = self.space()?;
        let mut n = 0;
        for b in bufs {
            if room == 0 {
                break;
            }
            let k = b.len().min(room);
            self.ring.copy_in(self.tail + n as u64, &b[..k]);
            n += k;
            room -= k;
        }
        if n == 0 {
            return Ok(Wrote { n, wake: false });
        }
        self.tail += n as u64;
        // Release: the bytes copied above are visible to a reader that loads this `tail`.
        self.ring.u64_at(TAIL).store(self.tail, Ordering::Release);
        // The writer's half of the eventcount: the store of `tail` before the load of the
        // reader's flag (see the module comment). The swap clears the flag so that a burst of
        // writes to a sleeping reader costs one doorbell, not one per write.
        fence(Ordering::SeqCst);
        let flag = self.ring.u32_at(READER_SLEEPING);
        let wake = flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::Relaxed) != 0;
        Ok(Wrote { n, wake })
    }

    /// Before sleeping on a full ring: raises the writer's flag, then reports whether space
    /// freed meanwhile (then do not sleep). The reader rings the doorbell when it frees space
    /// and sees the flag.
    pub(crate) fn arm(&mut self) -> io::Result<bool> {
        self.ring.u32_at(WRITER_WAITING).store(1, Ordering::Relaxed);
        // The sleeper's half of the eventcount: the flag's store before the load of `head`.
        fence(Ordering::SeqCst);
        Ok(self.space()? > 0)
    }

    /// After waking: lowers the writer's flag (a stale flag costs the reader doorbells).
    pub(crate) fn disarm(&self) {
        self.ring.u32_at(WRITER_WAITING).store(0, Ordering::Relaxed);
    }
}

impl RxRing {
    /// The reading end of the ring of `cap` bytes at `at` in `map`, which starts empty.
    pub(crate) fn new(map: Arc<MmapRaw>, at: usize, cap: usize) -> io::Result<Self> {
        let ring = Ring::new(map, at, cap)?;
        let head = ring.u64_at(HEAD).load(Ordering::Acquire);
        Ok(RxRing {
            ring,
            head,
            tail: head,
        })
    }

    /// Bytes ready, rereading the writer's `tail` only when the cached one shows none.
    pub(crate) fn ready(&mut self) -> io::Result<usize> {
        if self.tail > self.head {
            return Ok((self.tail - self.head) as usize);
        }
        // Acquire: pairs with the writer's Release store, so the bytes up to `tail` are there.
        let tail = self.ring.u64_at(TAIL).load(Ordering::Acquire);
        if tail < self.tail || tail - self.head > self.ring.cap as u64 {
            return Err(self.ring.corrupt(self.head, tail));
        }
        self.tail = tail;
        Ok((tail - self.head) as usize)
    }

    /// Copies up to `dst.len()` bytes out and frees them. Returns the bytes copied (0 when the
    /// ring is empty) and whether the writer waits for space (then ring its doorbell).
    /// `streaming`: `dst` is not read again soon, so a large copy may bypass the cache.
    pub(crate) fn read(&mut self, dst: &mut [u8], streaming: bool) -> io::Result<(usize, bool)> {
        let k = self.ready()?.min(dst.len());
        if k == 0 {
            return Ok((0, false));
        }
        self.ring.copy_out(
            self.head,
            &mut dst[..k],
            streaming && k >= STREAMING_MIN_BYTES,
        );
        self.head += k as u64;
        // Release: the copy above is done before the writer may reuse the bytes.
        self.ring.u64_at(HEAD).store(self.head, Ordering::Release);
        // The reader's half of the writer's eventcount (see `TxRing::arm`).
        fence(Ordering::SeqCst);
        let flag = self.ring.u32_at(WRITER_WAITING);
        let wake = flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::Relaxed) != 0;
        Ok((k, wake))
    }

    /// Before sleeping: raises the reader's flag, then reports whether bytes arrived meanwhile
    /// (then do not sleep). A writer that publishes after the flag is up rings the doorbell.
    pub(crate) fn arm(&mut self) -> io::Result<bool> {
        self.ring
            .u32_at(READER_SLEEPING)
            .store(1, Ordering::Relaxed);
        // The sleeper's half of the eventcount: the flag's store before the load of `tail`.
        fence(Ordering::SeqCst);
        Ok(self.ready()? > 0)
    }

    /// After waking: lowers the reader's flag (a stale flag costs the writer doorbells).
    pub(crate) fn disarm(&self) {
        self.ring
            .u32_at(READER_SLEEPING)
            .store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both ends of one ring of `cap` bytes in an anonymous mapping.
    fn pair(cap: usize) -> (TxRing, RxRing) {
        let map = Arc::new(
            memmap2::MmapOptions::new()
                .len(CONTROL_BYTES + cap)
                .map_anon()
                .map(MmapRaw::from)
                .expect("map"),
        );
        (
            TxRing::new(map.clone(), 0, cap).expect("tx"),
            RxRing::new(map, 0, cap).expect("rx"),
        )
    }

    #[test]
    fn bytes_come_out_in_order_across_many_wraps() {
        let (mut tx, mut rx) = pair(64);
        let src: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let (mut sent, mut got) = (0, Vec::new());
        let mut buf = [0u8; 23];
        while got.len() < src.len() {
            let end = (sent + 37).min(src.len());
            let (a, b) = src[sent..end].split_at((end - sent) / 2);
            sent += tx
                .write(&[IoSlice::new(a), IoSlice::new(b)])
                .expect("write")
                .n;
            let (k, _) = rx.read(&mut buf, false).expect("read");
            got.extend_from_slice(&buf[..k]);
        }
        assert_eq!(got, src);
    }

    #[test]
    fn a_full_ring_takes_nothing_and_an_empty_one_gives_nothing() {
        let (mut tx, mut rx) = pair(16);
        assert_eq!(tx.write(&[IoSlice::new(&[7u8; 40])]).expect("write").n, 16);
        assert_eq!(tx.write(&[IoSlice::new(&[1u8])]).expect("write").n, 0);
        let mut out = [0u8; 40];
        assert_eq!(rx.read(&mut out, false).expect("read").0, 16);
        assert_eq!(rx.read(&mut out, false).expect("read").0, 0);
        assert_eq!(&out[..16], &[7u8; 16]);
    }

    #[test]
    fn a_sleeping_side_is_woken_once_and_an_awake_one_never() {
        let (mut tx, mut rx) = pair(16);
        assert!(!tx.write(&[IoSlice::new(b"ab")]).expect("write").wake);
        let mut out = [0u8; 16];
        rx.read(&mut out, false).expect("read");
        assert!(!rx.arm().expect("arm"), "nothing arrived");
        assert!(tx.write(&[IoSlice::new(b"c")]).expect("write").wake);
        assert!(
            !tx.write(&[IoSlice::new(b"d")]).expect("write").wake,
            "one doorbell per sleep"
        );
        assert!(rx.arm().expect("arm"), "bytes are there: do not sleep");
        rx.disarm();
        // The writer's cached `head` is stale: the second write finds the space the first
        // did not see.
        while tx.write(&[IoSlice::new(&[0u8; 14])]).expect("write").n > 0 {}
        assert!(!tx.arm().expect("arm"), "full");
        assert!(
            rx.read(&mut out, false).expect("read").1,
            "the writer waits"
        );
        assert!(tx.arm().expect("arm"));
        tx.disarm();
    }

    /// A writer and a reader on two threads, both busy, the ring small enough to be full and
    /// empty many times: every byte arrives once and in order.
    #[test]
    fn two_threads_move_a_megabyte_through_a_small_ring() {
        two_threads_move_a_megabyte(256, 61, false);
    }

    /// The same with streaming reads large enough to bypass the cache, wrapping at offsets
    /// that are not 16-byte aligned.
    #[test]
    fn streaming_reads_move_a_megabyte_in_order() {
        two_threads_move_a_megabyte(1 << 14, 5003, true);
    }

    /// And with reads large enough for vector moves instead of `memcpy`.
    #[test]
    fn large_reads_move_a_megabyte_in_order() {
        two_threads_move_a_megabyte(1 << 18, 100_003, false);
    }

    fn two_threads_move_a_megabyte(cap: usize, read: usize, streaming: bool) {
        let (mut tx, mut rx) = pair(cap);
        let src: Vec<u8> = (0..1u32 << 20).map(|i| (i % 253) as u8).collect();
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut at = 0;
                while at < src.len() {
                    let end = (at + read + 36).min(src.len());
                    at += tx.write(&[IoSlice::new(&src[at..end])]).expect("write").n;
                }
            });
            let mut got = Vec::with_capacity(src.len());
            let mut buf = vec![0u8; read];
            while got.len() < src.len() {
                let (k, _) = rx.read(&mut buf, streaming).expect("read");
                got.extend_from_slice(&buf[..k]);
            }
            assert!(got == src, "bytes lost, duplicated or reordered");
        });
    }

    #[test]
    fn counters_out_of_bounds_are_corruption_not_an_index() {
        let (mut tx, mut rx) = pair(16);
        rx.ring.u64_at(TAIL).store(1000, Ordering::Relaxed);
        let e = rx.read(&mut [0u8; 4], false).expect_err("corrupt");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        tx.tail = 16;
        tx.ring.u64_at(HEAD).store(99, Ordering::Relaxed);
        assert!(tx.write(&[IoSlice::new(b"x")]).is_err());
    }
}

//! A second thread that takes half of each large copy by reference, for hosts with spare
//! cores.
//!
//! A copy by reference is one `process_vm_readv` on the receiving rank's thread, and one core
//! copying cannot stream what some machines' memory can: on a lent 16-core VM, 64 MiB took
//! 9.6-9.7 ms read by one thread and 4.0-4.5 ms read half each by two (the same on this
//! repository's 2-core host: 10.3 against 5.8 ms). While a large broadcast's root only waits,
//! its core is idle; where the host has at least two CPUs per local rank, the receiver of a
//! broadcast, scatter or gather hands half of each large frame to this thread and reads the
//! other half itself.
//!
//! The helper is owned by the mesh's [`super::cma::Cma`], started at the first split copy, and
//! joined when the mesh drops. It spins for [`HELPER_SPIN`] after each piece, since a large
//! message's frames follow each other within microseconds and a sleeping thread's wake-up
//! costs more than that on a VM, then sleeps on a condition variable.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Frames from this size are split between the caller and the helper: below it the hand-over
/// (a few cache lines each way, a wake-up after a pause) costs a noticeable share of the copy.
pub(super) const SPLIT_MIN_BYTES: usize = 256 << 10;

/// How long the helper polls for the next piece before it sleeps.
const HELPER_SPIN: Duration = Duration::from_micros(100);

/// How a piece is read: `cma::read_remote`, or a fake in tests.
pub(super) type ReadFn = fn(i32, u64, &mut [u8]) -> io::Result<()>;

/// One piece handed to the helper.
#[derive(Clone, Copy)]
struct Piece {
    pid: i32,
    addr: u64,
    /// Where it goes: the caller's destination, which the caller does not touch (nor return)
    /// until the helper reports the piece finished.
    dst: usize,
    len: usize,
}

/// What the caller and the helper share.
struct Shared {
    /// The piece posted and not yet taken.
    piece: Mutex<Option<Piece>>,
    /// The failure of the last piece, taken by the caller.
    failure: Mutex<Option<io::Error>>,
    /// Pieces posted so far.
    posted: AtomicU64,
    /// Pieces the helper finished so far.
    finished: AtomicU64,
    /// The helper waits on `wake` (or is about to): a poster must notify it.
    sleeping: AtomicBool,
    stop: AtomicBool,
    wake: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The helper thread of one mesh (see the module doc).
pub(super) struct ReadHelper {
    shared: Arc<Shared>,
    /// Held for the whole of a [`ReadHelper::read`]: one piece at a time, even if two threads
    /// copied through one mesh at once (its engine's lock keeps them apart today).
    caller: Mutex<()>,
    read: ReadFn,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ReadHelper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadHelper")
            .field("posted", &self.shared.posted.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl ReadHelper {
    /// Starts the helper of `rank`'s mesh, reading with `read`.
    pub(super) fn spawn(rank: usize, read: ReadFn) -> io::Result<Self> {
        let shared = Arc::new(Shared {
            piece: Mutex::new(None),
            failure: Mutex::new(None),
            posted: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            wake: Condvar::new(),
        });
        let theirs = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("dist-gloo-copy-{rank}"))
            .spawn(move || serve(&theirs, read))?;
        Ok(ReadHelper {
            shared,
            caller: Mutex::new(()),
            read,
            thread: Some(thread),
        })
    }

    /// Reads `dst.len()` bytes at `addr` in process `pid`: the second half (from a 4 KiB
    /// boundary of `dst`) on the helper, the first on this thread, at once. Returns once both
    /// are done, with the first failure.
    pub(super) fn read(&self, pid: i32, addr: u64, dst: &mut [u8]) -> io::Result<()> {
        let _one_at_a_time = lock(&self.caller);
        let at = (dst.len() / 2) & !4095;
        let (first, second) = dst.split_at_mut(at);
        let piece = Piece {
            pid,
            addr: addr.wrapping_add(at as u64),
            dst: second.as_mut_ptr() as usize,
            len: second.len(),
        };
        *lock(&self.shared.piece) = Some(piece);
        // SeqCst with the helper's store of `sleeping` and its load of `posted` (under the
        // lock it waits with): either it sees this piece, or this thread sees it asleep and
        // notifies it under that lock.
        let ticket = self.shared.posted.fetch_add(1, Ordering::SeqCst) + 1;
        if self.shared.sleeping.load(Ordering::SeqCst) {
            let _held = lock(&self.shared.piece);
            self.shared.wake.notify_one();
        }
        // Waits for the helper however this half ends, even by unwinding: it writes into
        // `second` until it reports.
        let wait = Finished {
            shared: &self.shared,
            ticket,
        };
        let mine = (self.read)(pid, addr, first);
        drop(wait);
        let theirs = lock(&self.shared.failure).take();
        mine?;
        theirs.map_or(Ok(()), Err)
    }
}

impl Drop for ReadHelper {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _held = lock(&self.shared.piece);
            self.shared.wake.notify_one();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits, when dropped, until the helper finished piece `ticket`.
struct Finished<'a> {
    shared: &'a Shared,
    ticket: u64,
}

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        let mut spins = 0u32;
        while self.shared.finished.load(Ordering::Acquire) < self.ticket {
            spins = spins.wrapping_add(1);
            // The helper's half takes about as long as this thread's: poll closely, but hand
            // the core over now and then in case the helper waits for it.
            if spins.is_multiple_of(256) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// The helper's loop: take each posted piece, read it, report it finished; stop when told.
#[allow(
    unsafe_code,
    reason = "the helper writes its half of the caller's buffer through a pointer the caller \
              hands over: a borrow cannot cross into a thread that outlives the call, and a \
              scoped thread per frame would cost a thread start per megabyte"
)]
fn serve(s: &Shared, read: ReadFn) {
    let mut taken = 0u64;
    loop {
        let mut since = Instant::now();
        let mut polls = 0u32;
        while s.posted.load(Ordering::Acquire) == taken {
            if s.stop.load(Ordering::Relaxed) {
                return;
            }
            polls = polls.wrapping_add(1);
            if !polls.is_multiple_of(64) || since.elapsed() < HELPER_SPIN {
                std::hint::spin_loop();
                continue;
            }
            let mut held = lock(&s.piece);
            s.sleeping.store(true, Ordering::SeqCst);
            while s.posted.load(Ordering::SeqCst) == taken && !s.stop.load(Ordering::SeqCst) {
                held = s.wake.wait(held).unwrap_or_else(|e| e.into_inner());
            }
            s.sleeping.store(false, Ordering::Relaxed);
            drop(held);
            since = Instant::now();
        }
        taken += 1;
        if let Some(p) = lock(&s.piece).take() {
            // SAFETY: `p.dst..p.dst + p.len` is the tail of a `&mut [u8]` that
            // `ReadHelper::read` split off and holds for the whole copy: it touches only the
            // head, and returns (or unwinds) only after `Finished` saw this piece reported
            // below, so the bytes are valid, writable and written by this thread alone until
            // then. The piece was stored under the lock it was taken from, after `posted` told
            // of it, so it is this ticket's.
            let dst = unsafe { std::slice::from_raw_parts_mut(p.dst as *mut u8, p.len) };
            if let Err(e) = read(p.pid, p.addr, dst) {
                *lock(&s.failure) = Some(e);
            }
        }
        s.finished.store(taken, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read that fills `dst` with the low byte of each source address, and fails from
    /// [`FAR`] on.
    fn fake(_pid: i32, addr: u64, dst: &mut [u8]) -> io::Result<()> {
        if addr >= FAR {
            return Err(io::Error::other("far"));
        }
        for (i, b) in dst.iter_mut().enumerate() {
            *b = (addr + i as u64) as u8;
        }
        Ok(())
    }

    const FAR: u64 = 1 << 40;

    #[test]
    fn both_halves_arrive_whole_at_odd_lengths_and_after_the_helper_slept() {
        let h = ReadHelper::spawn(0, fake).unwrap();
        for (k, len) in [0usize, 1, 4095, 4096, 8193, (1 << 20) + 5, 3 << 20]
            .into_iter()
            .enumerate()
        {
            let mut dst = vec![0u8; len];
            h.read(0, 7, &mut dst).unwrap();
            assert!(
                dst.iter()
                    .enumerate()
                    .all(|(i, &b)| b == (7 + i as u64) as u8),
                "length {len}"
            );
            if k % 2 == 1 {
                // Past the helper's spin: the next piece must wake it.
                std::thread::sleep(HELPER_SPIN * 20);
            }
        }
    }

    #[test]
    fn a_failure_of_either_half_fails_the_read() {
        let h = ReadHelper::spawn(0, fake).unwrap();
        let mut dst = vec![0u8; 1 << 20];
        let half = (dst.len() / 2) as u64;
        // Only the helper's half lies past FAR.
        assert!(h.read(0, FAR - half, &mut dst).is_err());
        // Both halves.
        assert!(h.read(0, FAR, &mut dst).is_err());
        // Neither: the failures above are not left behind for the next read.
        h.read(0, 0, &mut dst).unwrap();
    }

    #[test]
    fn two_threads_reading_through_one_helper_each_get_their_whole_frame() {
        let h = ReadHelper::spawn(0, fake).unwrap();
        std::thread::scope(|s| {
            for from in [3u64, 100] {
                let h = &h;
                s.spawn(move || {
                    for _ in 0..200 {
                        let mut dst = vec![0u8; 64 << 10];
                        h.read(0, from, &mut dst).unwrap();
                        assert!(
                            dst.iter()
                                .enumerate()
                                .all(|(i, &b)| b == (from + i as u64) as u8),
                            "from {from}"
                        );
                    }
                });
            }
        });
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn reads_this_process_through_cross_memory_attach() {
        let h = ReadHelper::spawn(0, super::super::cma::read_remote).unwrap();
        let src: Vec<u8> = (0..=250u8).cycle().take((2 << 20) + 3).collect();
        let mut dst = vec![0u8; src.len()];
        h.read(std::process::id() as i32, src.as_ptr() as u64, &mut dst)
            .unwrap();
        assert_eq!(src, dst);
    }
}

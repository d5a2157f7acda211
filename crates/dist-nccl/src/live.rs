//! [`Live`]: a created communicator with its stream, watchdog and issue order, and the one
//! path every operation takes through it (fence, enqueue, record, watch, wait).

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::nccl::sys::{self as nccl, ncclComm_t};
use dist_backend::DeviceBuffer;

use crate::comm::{Comm, check};
use crate::cuda::{Device, DeviceScratch, Event, Stream};
use crate::watchdog::{Completion, FlightRecord, Pending, Watch};
use crate::{Error, NcclOptions, Result};

/// How often a caller waiting for its operation polls the end event: short, because a
/// blocking wait is on the critical path of every collective.
const WAIT_POLL: Duration = Duration::from_micros(20);

/// The end event of one operation, polled by the watchdog and waiters.
struct EventDone(Event);

impl Completion for EventDone {
    fn poll(&self) -> std::result::Result<bool, String> {
        self.0.is_done().map_err(crate::cuda::driver_error_name)
    }
}

/// What one enqueue needs to know about its operation.
pub(crate) struct Call {
    /// Operation name.
    pub(crate) op: &'static str,
    /// Sequence number given by the caller, if any.
    pub(crate) seq: Option<u64>,
    /// How long the GPU may take.
    pub(crate) timeout: Duration,
    /// Bytes this rank contributes (for the flight recorder).
    pub(crate) bytes: usize,
    /// Wait for the GPU even if the options say not to (barrier).
    pub(crate) force_wait: bool,
}

/// A created communicator and what serves it.
pub(crate) struct Live {
    rank: usize,
    device: Device,
    // Dropped before the communicator is aborted (declaration order).
    scratch: Mutex<Option<DeviceScratch>>,
    stream: Stream,
    watch: Arc<Watch<Comm>>,
    watchdog: Mutex<Option<JoinHandle<()>>>,
    /// Serialises enqueues: NCCL calls on one communicator must not overlap.
    issue: Mutex<()>,
    seq: AtomicU64,
    blocking_wait: bool,
    drain: Duration,
}

impl Live {
    /// Starts serving `comm` on `device` (bound on this thread): a stream, and the watchdog.
    pub(crate) fn start(
        rank: usize,
        device: Device,
        comm: Comm,
        opts: &NcclOptions,
    ) -> Result<Live> {
        let stream = Stream::new(rank)?;
        let watch = Arc::new(Watch::new(rank, Arc::new(comm), opts.flight_records));
        let w = watch.clone();
        let interval = opts.watchdog_interval;
        let t = std::thread::Builder::new()
            .name(format!("dist-nccl-wd-r{rank}"))
            .spawn(move || {
                // Event queries act on the device's context.
                if let Err(e) = device.bind(rank, "watchdog") {
                    tracing::error!(%e, "dist-nccl: the watchdog could not bind its device");
                }
                w.run(interval);
            })
            .map_err(|e| Error::Cuda {
                rank,
                op: "init",
                call: "starting the watchdog thread",
                code: e.to_string(),
            })?;
        Ok(Live {
            rank,
            device,
            scratch: Mutex::new(None),
            stream,
            watch,
            watchdog: Mutex::new(Some(t)),
            issue: Mutex::new(()),
            seq: AtomicU64::new(0),
            blocking_wait: opts.blocking_wait,
            drain: opts.timeout,
        })
    }

    /// The device ordinal.
    pub(crate) fn ordinal(&self) -> u32 {
        self.device.ordinal()
    }

    /// The device.
    pub(crate) fn device(&self) -> Device {
        self.device
    }

    /// The communicator.
    pub(crate) fn comm(&self) -> &Comm {
        self.watch.comm()
    }

    /// Runs `f` (NCCL calls) with the communicator alone, device bound, outside the stream
    /// protocol (split).
    pub(crate) fn exclusive<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&Comm) -> Result<R>,
    ) -> Result<R> {
        let _issue = self.issue.lock().unwrap_or_else(|e| e.into_inner());
        self.device.bind(self.rank, op)?;
        self.watch.check(op, 0)?;
        f(self.comm())
    }

    /// A one-element device scratch (barrier), allocated once.
    pub(crate) fn scratch(&self) -> Result<u64> {
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if s.is_none() {
            self.device.bind(self.rank, "barrier")?;
            *s = Some(DeviceScratch::new(8, self.rank, "barrier")?);
        }
        Ok(s.as_ref().map_or(0, DeviceScratch::ptr))
    }

    /// Enqueues one operation: the NCCL stream waits for `user_stream` (so the inputs are
    /// ready), `f` issues the NCCL calls, an end event is recorded and `user_stream` waits for
    /// it (so later work sees the outputs); the watchdog watches the event. Returns after the
    /// GPU finished when blocking, else once enqueued.
    pub(crate) fn enqueue(
        &self,
        call: Call,
        user_stream: u64,
        f: impl FnOnce(ncclComm_t, nccl::cudaStream_t, u64) -> Result<()>,
    ) -> Result<()> {
        let rank = self.rank;
        let op = call.op;
        let user: cudarc::driver::sys::CUstream = user_stream as usize as *mut _;
        let seq = {
            let _issue = self.issue.lock().unwrap_or_else(|e| e.into_inner());
            let seq = call
                .seq
                .unwrap_or_else(|| self.seq.fetch_add(1, Ordering::Relaxed) + 1);
            self.device.bind(rank, op)?;
            self.watch.check(op, seq)?;
            self.stream.wait_for(user, rank, op)?;
            // Made before the NCCL calls: once they are enqueued, every failure must still
            // fence them.
            let end = Event::new(rank, op)?;
            let started = Instant::now();
            let stream: nccl::cudaStream_t = self.stream.raw().cast();
            self.comm().with(op, seq, |c| f(c, stream, seq))?;
            let fenced = end
                .record(self.stream.raw(), rank, op)
                .and_then(|()| end.block_stream(user, rank, op));
            if let Err(e) = fenced {
                // The kernel runs on, unordered with the caller's stream and unwatched: abort
                // the communicator (which ends it) and make the failure every later op's.
                self.watch.abort_with(crate::AbortCause::Unfenced {
                    op,
                    seq,
                    error: e.to_string(),
                });
                return Err(e);
            }
            self.watch.push(Pending {
                seq,
                op,
                bytes: call.bytes,
                started,
                timeout: call.timeout,
                done: Box::new(EventDone(end)),
            });
            seq
        };
        if self.blocking_wait || call.force_wait {
            self.watch.wait(op, seq, WAIT_POLL)?;
        }
        Ok(())
    }

    /// The flight recorder's entries.
    pub(crate) fn records(&self) -> Vec<FlightRecord> {
        self.watch.records()
    }

    /// Waits (up to the drain timeout) for pending operations, then stops the watchdog;
    /// operations still pending fail with [`crate::AbortCause::Closed`].
    pub(crate) fn close(&self) {
        let deadline = dist_backend::deadline_after(Instant::now(), self.drain);
        while self.watch.has_pending() && Instant::now() < deadline {
            if self.watch.tick(Instant::now()).is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if self.watch.has_pending() {
            self.watch.abort_with(crate::AbortCause::Closed);
        }
        self.watch.stop();
        if let Some(t) = self
            .watchdog
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = t.join();
        }
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.close();
        // Frees and stream destruction act on the device's context.
        let _ = self.device.bind(self.rank, "close");
    }
}

/// A device address plus a byte offset, as NCCL's `void*`.
pub(crate) fn at(b: &DeviceBuffer, offset: usize) -> *mut c_void {
    (b.ptr() + offset as u64) as usize as *mut c_void
}

/// Runs `f` between `ncclGroupStart` and `ncclGroupEnd` (the end runs even if `f` fails, so
/// NCCL's group depth stays balanced).
pub(crate) fn grouped(
    rank: usize,
    op: &'static str,
    seq: u64,
    f: impl FnOnce() -> Result<()>,
) -> Result<()> {
    // SAFETY: no arguments; NCCL keeps a per-thread group depth.
    let started = unsafe { nccl::ncclGroupStart() };
    check(started, rank, op, seq, "ncclGroupStart")?;
    let r = f();
    // SAFETY: as above, closing the group opened here.
    let ended = unsafe { nccl::ncclGroupEnd() };
    let end = check(ended, rank, op, seq, "ncclGroupEnd");
    r.and(end)
}

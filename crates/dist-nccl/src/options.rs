//! [`NcclOptions`]: how a backend picks its device, waits and watches.

use std::time::Duration;

/// Options of [`crate::NcclBackend`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NcclOptions {
    /// The device whose communicator serves operations that carry no buffer (barrier) when
    /// none was created yet; `None`: [`NcclOptions::local_rank`] modulo the device count, else
    /// the rank modulo it. Operations with buffers create the communicator on their buffer's
    /// device.
    pub device: Option<u32>,
    /// This process's rank among the ranks on its host, as the launcher says
    /// ([`NcclOptions::from_env`]: torchrun's `LOCAL_RANK`, Open MPI's, PMI's or Slurm's);
    /// chooses the default [`NcclOptions::device`].
    pub local_rank: Option<u32>,
    /// Each operation returns once the GPU has finished it (or the watchdog failed it), so a
    /// `Work` completes with the GPU; `false`: it returns once enqueued, ordered on the
    /// buffer's stream (NCCL's own semantics; torch's default). Env:
    /// `DIST_NCCL_BLOCKING_WAIT=0|1` (default 1).
    pub blocking_wait: bool,
    /// How often the watchdog polls `ncclCommGetAsyncError` and deadlines.
    pub watchdog_interval: Duration,
    /// How many finished operations the flight recorder keeps (`DIST_NCCL_TRACE_BUFFER_SIZE`).
    pub flight_records: usize,
    /// How long creation waits for peers and an abort waits for a call in progress.
    pub timeout: Duration,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            device: None,
            local_rank: None,
            blocking_wait: true,
            watchdog_interval: Duration::from_millis(100),
            flight_records: 2000,
            timeout: dist_backend::DEFAULT_TIMEOUT,
        }
    }
}

impl NcclOptions {
    /// The defaults, with the launcher's local rank (as `dist_backend::init` finds it:
    /// `LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_RANK`, PMI's or `SLURM_LOCALID`),
    /// `DIST_NCCL_BLOCKING_WAIT` and `DIST_NCCL_TRACE_BUFFER_SIZE` applied when set.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let mut o = NcclOptions {
            local_rank: dist_backend::init::local_rank_from_lookup(&|k| std::env::var(k).ok())
                .and_then(|lr| u32::try_from(lr).ok()),
            ..NcclOptions::default()
        };
        if let Some(v) = var("DIST_NCCL_BLOCKING_WAIT") {
            o.blocking_wait = v != "0";
        }
        if let Some(n) = var("DIST_NCCL_TRACE_BUFFER_SIZE").and_then(|v| v.parse().ok()) {
            o.flight_records = n;
        }
        o
    }
}

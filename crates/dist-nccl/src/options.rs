//! [`NcclOptions`]: how a backend picks its device, waits and watches.

use std::time::Duration;

/// Options of [`crate::NcclBackend`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NcclOptions {
    /// The device whose communicator serves operations that carry no buffer (barrier) when
    /// none was created yet; `None`: `LOCAL_RANK` modulo the device count, else the rank.
    /// Operations with buffers create the communicator on their buffer's device.
    pub device: Option<u32>,
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
            blocking_wait: true,
            watchdog_interval: Duration::from_millis(100),
            flight_records: 2000,
            timeout: dist_backend::DEFAULT_TIMEOUT,
        }
    }
}

impl NcclOptions {
    /// The defaults, with `LOCAL_RANK`, `DIST_NCCL_BLOCKING_WAIT` and
    /// `DIST_NCCL_TRACE_BUFFER_SIZE` applied when set.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let mut o = NcclOptions::default();
        if let Some(lr) = var("LOCAL_RANK").and_then(|v| v.parse().ok()) {
            o.device = Some(lr);
        }
        if let Some(v) = var("DIST_NCCL_BLOCKING_WAIT") {
            o.blocking_wait = v != "0";
        }
        if let Some(n) = var("DIST_NCCL_TRACE_BUFFER_SIZE").and_then(|v| v.parse().ok()) {
            o.flight_records = n;
        }
        o
    }
}

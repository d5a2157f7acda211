//! Debugging aids: the `DIST_DEBUG` level, the per-group flight recorder and its dump on a
//! group's first failure.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// How much the library logs about each operation, from `DIST_DEBUG` (torch's
/// `TORCH_DISTRIBUTED_DEBUG`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DebugLevel {
    /// Unset or `OFF`: failures only (a `warn` event plus the flight recorder dump).
    Off,
    /// `INFO`: group creation and destruction at `info`, each operation's completion at `debug`.
    Info,
    /// `DETAIL`: each operation's start and end at `info`, and before every collective a
    /// fingerprint check across ranks (op, dtype, count, root) that fails with an error naming
    /// both sides instead of a hang or garbage.
    Detail,
}

impl DebugLevel {
    /// Reads `DIST_DEBUG` (`OFF`, `INFO`, `DETAIL`, case-insensitive; anything else is `Off`).
    pub fn from_env() -> Self {
        match std::env::var("DIST_DEBUG")
            .unwrap_or_default()
            .to_ascii_uppercase()
            .as_str()
        {
            "INFO" => DebugLevel::Info,
            "DETAIL" => DebugLevel::Detail,
            _ => DebugLevel::Off,
        }
    }
}

/// Default number of operations a group's flight recorder keeps (`DIST_FLIGHT_RECORDER_SIZE`
/// overrides it).
pub const DEFAULT_FLIGHT_RECORDER_SIZE: usize = 64;

/// Where an operation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum OpState {
    /// Issued, waiting for earlier operations of the group.
    Scheduled,
    /// Running on the backend.
    Started,
    /// Finished successfully.
    Completed,
    /// Finished with an error.
    Failed,
}

/// One operation in a group's flight recorder.
#[derive(Clone, Debug, Serialize)]
pub struct FlightEntry {
    /// Issue number on this rank (0, 1, ...): collectives, point-to-point and group steps.
    pub id: u64,
    /// The group's sequence number of a collective or group step: the one number the
    /// executor orders by, frame headers carry and errors name (`all_reduce #5`), the same
    /// on every rank. `None` for point-to-point operations, which are matched by tag.
    pub seq: Option<u64>,
    /// The operation (`"all_reduce"`, `"isend"`, ...).
    pub op: &'static str,
    /// Element type name, when the operation has one.
    pub dtype: Option<String>,
    /// Element counts (per rank for uneven operations).
    pub counts: Vec<usize>,
    /// Root or peer (group rank), when the operation has one.
    pub peer: Option<usize>,
    /// Where it is.
    pub state: OpState,
    /// Unix time in milliseconds when it was issued.
    pub issued_ms: f64,
    /// Unix time in milliseconds when it started running.
    pub started_ms: Option<f64>,
    /// Unix time in milliseconds when it finished.
    pub finished_ms: Option<f64>,
    /// The error, when it failed.
    pub error: Option<String>,
}

fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1e3)
        .unwrap_or(0.0)
}

/// The last N operations of one group.
#[derive(Debug)]
pub(crate) struct FlightRecorder {
    cap: usize,
    inner: Mutex<(u64, VecDeque<FlightEntry>)>,
}

/// What describes an operation when it is issued.
pub(crate) struct OpInfo {
    pub(crate) op: &'static str,
    pub(crate) dtype: Option<String>,
    pub(crate) counts: Vec<usize>,
    pub(crate) peer: Option<usize>,
}

impl FlightRecorder {
    pub(crate) fn from_env() -> Self {
        let cap = std::env::var("DIST_FLIGHT_RECORDER_SIZE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_FLIGHT_RECORDER_SIZE);
        FlightRecorder {
            cap,
            inner: Mutex::new((0, VecDeque::new())),
        }
    }

    /// Records a new operation (with its group sequence number, for a collective); returns
    /// its issue number.
    pub(crate) fn issue(&self, info: OpInfo, seq: Option<u64>) -> u64 {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let id = g.0;
        g.0 += 1;
        if self.cap > 0 {
            if g.1.len() == self.cap {
                g.1.pop_front();
            }
            g.1.push_back(FlightEntry {
                id,
                seq,
                op: info.op,
                dtype: info.dtype,
                counts: info.counts,
                peer: info.peer,
                state: OpState::Scheduled,
                issued_ms: now_ms(),
                started_ms: None,
                finished_ms: None,
                error: None,
            });
        }
        id
    }

    pub(crate) fn started(&self, id: u64) {
        self.update(id, |e| {
            e.state = OpState::Started;
            e.started_ms = Some(now_ms());
        });
    }

    pub(crate) fn finished(&self, id: u64, error: Option<String>) {
        self.update(id, |e| {
            e.state = if error.is_some() {
                OpState::Failed
            } else {
                OpState::Completed
            };
            e.finished_ms = Some(now_ms());
            e.error = error;
        });
    }

    fn update(&self, id: u64, f: impl FnOnce(&mut FlightEntry)) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = g.1.iter_mut().rev().find(|e| e.id == id) {
            f(e);
        }
    }

    pub(crate) fn entries(&self) -> Vec<FlightEntry> {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.1.iter().cloned().collect()
    }
}

/// The flight recorder as a JSON object: `{"group", "rank", "world_size", "entries"}`, plus
/// `"error"` when a failure triggered the dump.
pub(crate) fn dump_json(
    group: &str,
    rank: usize,
    world_size: usize,
    entries: &[FlightEntry],
    error: Option<&str>,
) -> serde_json::Value {
    let mut v = serde_json::json!({
        "group": group,
        "rank": rank,
        "world_size": world_size,
        "entries": entries,
    });
    if let Some(e) = error {
        v["error"] = e.into();
    }
    v
}

/// Dumps a group's flight recorder on its first failure, and only then: after a failure every
/// later operation fails too (the group is aborted), and one dump per failure is what a person
/// reading 64 rank logs can use.
#[derive(Debug)]
pub(crate) struct FailureDump {
    dir: Option<PathBuf>,
    done: AtomicBool,
}

impl FailureDump {
    /// Dumps into `dir` when given (one file per group and rank), else into a `warn` event.
    pub(crate) fn new(dir: Option<PathBuf>) -> Self {
        FailureDump {
            dir,
            done: AtomicBool::new(false),
        }
    }

    /// The file a group's rank dumps to under `dir`: the group name with `/` turned into `.`,
    /// so every group of a job gets its own file in one flat directory.
    pub(crate) fn file_name(group: &str, rank: usize) -> String {
        format!("{}.rank{rank}.json", group.replace('/', "."))
    }

    /// Records a failure: the first one that `aborts` the group dumps `json()` and returns
    /// true, later ones return false. A failure that leaves the group usable (a monitored
    /// barrier's) dumps too, as long as none has aborted it, without using up the dump that
    /// the failure which does abort it will want.
    /// Whether a failure has aborted the group.
    pub(crate) fn aborted(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    pub(crate) fn on_failure(
        &self,
        group: &str,
        rank: usize,
        aborts: bool,
        json: impl FnOnce() -> serde_json::Value,
    ) -> bool {
        let already = if aborts {
            self.done.swap(true, Ordering::AcqRel)
        } else {
            self.done.load(Ordering::Acquire)
        };
        if already {
            return false;
        }
        let text = json().to_string();
        match &self.dir {
            Some(dir) => match write_dump(dir, &Self::file_name(group, rank), &text) {
                Ok(path) => {
                    tracing::warn!(rank, group, path = %path.display(), "flight recorder dumped");
                }
                Err(e) => {
                    tracing::warn!(rank, group, dir = %dir.display(), error = %e, flight_recorder = %text, "cannot write the flight recorder dump; here it is");
                }
            },
            None => tracing::warn!(rank, group, flight_recorder = %text, "flight recorder dump"),
        }
        true
    }
}

/// Writes `text` to `dir/name` through a temporary file, so a reader never sees half a dump.
fn write_dump(dir: &Path, name: &str, text: &str) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

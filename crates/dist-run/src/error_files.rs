//! The ranks' error files (`TORCHELASTIC_ERROR_FILE`): where each rank's is, what the failed
//! rank wrote there, and passing it on to a launcher above `distrun`.
//!
//! torchrun gives each rank a path; a rank that fails writes its error there as JSON (torch's
//! `@record`, or `dist`'s `record_panics` and `record`), and the launcher prints it as the
//! job's root cause, where an exit code alone says little. `distrun` does the same, and, when
//! it runs under a launcher that gave it a path of its own, copies the root cause there with
//! the exit code, as torch's agent does.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The variable that names an error file (torch's).
pub(crate) const VAR: &str = "TORCHELASTIC_ERROR_FILE";

/// Where this run's ranks write their error files: `--log-dir` (beside their logs), or a
/// directory of this run's own under the system's temporary one, removed when the run ends.
pub(crate) struct ErrorFiles {
    root: PathBuf,
    /// Whether the directory is this run's to remove.
    owned: bool,
}

impl ErrorFiles {
    /// In `log_dir` when there is one, else in a fresh directory of its own.
    pub(crate) fn new(log_dir: Option<&Path>, run_id: &str) -> Self {
        match log_dir {
            Some(d) => Self {
                root: d.to_path_buf(),
                owned: false,
            },
            None => Self {
                root: crate::fresh_temp_dir("distrun-errors", run_id),
                owned: true,
            },
        }
    }

    /// Rank `rank`'s error file in attempt `restart`, with its directory made and an earlier
    /// file of that name removed (a stale file would be read as this attempt's error).
    pub(crate) fn prepare(&self, restart: u32, rank: u32) -> Result<PathBuf, String> {
        let dir = self
            .root
            .join(format!("attempt_{restart}"))
            .join(format!("rank_{rank}"));
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("could not create {}: {e}", dir.display()))?;
        let path = dir.join("error.json");
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("could not remove {}: {e}", path.display())),
        }
        Ok(path)
    }
}

impl Drop for ErrorFiles {
    fn drop(&mut self) {
        if self.owned {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

/// What a failed rank wrote in its error file.
#[derive(Clone, Debug)]
pub(crate) struct RankError {
    /// The error, as the rank put it.
    pub(crate) message: String,
    /// Where it happened (torch's `py_callstack`: a traceback, a backtrace), if given.
    pub(crate) trace: Option<String>,
    /// When it was written: its `timestamp_ns` (which `dist` writes), else the file's
    /// modification time (files torch wrote; the kernel keeps it to a few milliseconds, so
    /// close errors may tie).
    pub(crate) written: Option<SystemTime>,
    /// The file as written, to pass on.
    data: serde_json::Value,
}

impl RankError {
    /// The trace's lines, less the message where the trace starts with it (a panic's does).
    pub(crate) fn trace_past_message(&self) -> Vec<&str> {
        let Some(trace) = &self.trace else {
            return Vec::new();
        };
        let message: Vec<&str> = self.message.lines().collect();
        let lines: Vec<&str> = trace.lines().collect();
        match lines.strip_prefix(message.as_slice()) {
            Some(rest) => rest.to_vec(),
            None => lines,
        }
    }

    /// The first line of the message, at most `max` characters: for one-line reports.
    pub(crate) fn headline(&self, max: usize) -> String {
        let line = self.message.lines().next().unwrap_or_default();
        match line.char_indices().nth(max) {
            Some((cut, _)) => format!("{}...", &line[..cut]),
            None => line.to_owned(),
        }
    }
}

/// Reads the error file at `path`: `None` if the rank wrote none, or nothing torch's launcher
/// could read either (not JSON, no `message`).
pub(crate) fn read(path: &Path) -> Option<RankError> {
    let text = std::fs::read_to_string(path).ok()?;
    let modified = std::fs::metadata(path).ok().and_then(|m| m.modified().ok());
    let data: serde_json::Value = serde_json::from_str(&text).ok()?;
    // torch accepts `message` as a string or as an object with its own `message`.
    let (message, trace) = match data.get("message")? {
        serde_json::Value::String(s) => (s.clone(), None),
        m => (
            m.get("message")?.as_str()?.to_owned(),
            m.get("extraInfo")
                .and_then(|x| x.get("py_callstack"))
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned),
        ),
    };
    let precise = data
        .get("message")
        .and_then(|m| {
            m.get("extraInfo")?
                .get("timestamp_ns")?
                .as_str()?
                .parse::<u64>()
                .ok()
        })
        .map(|ns| UNIX_EPOCH + Duration::from_nanos(ns));
    Some(RankError {
        message,
        trace,
        written: precise.or(modified),
        data,
    })
}

/// What goes to the launcher above `distrun` (its own [`VAR`]) when the job fails: the failed
/// rank's file with `errorCode` set to `code` (a rank killed by a signal could not say it), or,
/// where the rank wrote none, `what` in torch's shape.
pub(crate) fn pass_on(outer: &Path, rank: Option<&RankError>, code: i32, what: &str) {
    let data = match rank.map(|r| r.data.clone()) {
        Some(mut data) => {
            if let Some(m) = data.get_mut("message").and_then(|m| m.as_object_mut()) {
                m.insert("errorCode".to_owned(), code.into());
            }
            data
        }
        None => {
            let secs = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            serde_json::json!({
                "message": {
                    "message": what,
                    "extraInfo": { "py_callstack": what, "timestamp": secs.to_string() },
                    "errorCode": code,
                },
            })
        }
    };
    let written = serde_json::to_vec(&data)
        .map_err(std::io::Error::from)
        .and_then(|bytes| std::fs::write(outer, bytes));
    if let Err(e) = written {
        eprintln!(
            "distrun: could not write the error file {}: {e}",
            outer.display()
        );
    }
}

/// The launcher's own error file, if one started `distrun` with [`VAR`] set.
pub(crate) fn outer() -> Option<PathBuf> {
    std::env::var_os(VAR)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_of_torchs_shapes_read_and_pass_on_with_the_exit_code() {
        let dir = tempfile::tempdir().unwrap();
        let files = ErrorFiles::new(Some(dir.path()), "none");
        let path = files.prepare(2, 5).unwrap();
        assert_eq!(path, dir.path().join("attempt_2/rank_5/error.json"));
        assert!(read(&path).is_none(), "no file yet");

        std::fs::write(&path, r#"{"message": "plain words"}"#).unwrap();
        let e = read(&path).unwrap();
        assert_eq!((e.message.as_str(), e.trace), ("plain words", None));

        let full = r#"{"message": {"message": "ValueError: bad\nsecond line",
            "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "17"}}}"#;
        std::fs::write(&path, full).unwrap();
        let e = read(&path).unwrap();
        assert_eq!(e.message, "ValueError: bad\nsecond line");
        assert_eq!(e.trace.as_deref(), Some("Traceback ..."));
        assert_eq!(e.headline(8), "ValueErr...");
        assert_eq!(e.headline(100), "ValueError: bad");
        assert_eq!(e.trace_past_message(), ["Traceback ..."]);
        let panic = r#"{"message": {"message": "panic at a.rs:3: x",
            "extraInfo": {"py_callstack": "panic at a.rs:3: x\n   7: train::step"}}}"#;
        std::fs::write(&path, panic).unwrap();
        assert_eq!(
            read(&path).unwrap().trace_past_message(),
            ["   7: train::step"]
        );

        let outer = dir.path().join("outer.json");
        pass_on(&outer, Some(&e), 139, "unused");
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&outer).unwrap()).unwrap();
        assert_eq!(v["message"]["errorCode"], 139);
        assert_eq!(v["message"]["extraInfo"]["timestamp"], "17");
        pass_on(&outer, None, 3, "rank 1 failed: exit code 3");
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&outer).unwrap()).unwrap();
        assert_eq!(v["message"]["message"], "rank 1 failed: exit code 3");
        assert_eq!(v["message"]["errorCode"], 3);

        for junk in [
            "",
            "not json",
            r#"{"other": 1}"#,
            r#"{"message": {"x": 1}}"#,
        ] {
            std::fs::write(&path, junk).unwrap();
            assert!(read(&path).is_none(), "{junk:?}");
        }
        // Written when its `timestamp_ns` says; a file without one, when it was modified.
        let precise = r#"{"message": {"message": "m", "extraInfo": {"timestamp_ns": "1500000000000000001"}}}"#;
        std::fs::write(&path, precise).unwrap();
        assert_eq!(
            read(&path).and_then(|e| e.written),
            Some(UNIX_EPOCH + Duration::from_nanos(1_500_000_000_000_000_001))
        );
        std::fs::write(&path, r#"{"message": "m"}"#).unwrap();
        let modified = std::fs::metadata(&path).unwrap().modified().unwrap();
        assert_eq!(read(&path).and_then(|e| e.written), Some(modified));
        // A stale file from an earlier run is removed when the attempt prepares it.
        assert_eq!(files.prepare(2, 5).unwrap(), path);
        assert!(!path.exists());
        assert_eq!(read(&path).and_then(|e| e.written), None);
    }

    #[test]
    fn a_directory_of_its_own_goes_with_the_run() {
        let files = ErrorFiles::new(None, "job7");
        let path = files.prepare(0, 0).unwrap();
        std::fs::write(&path, "{}").unwrap();
        let root = files.root.clone();
        assert!(root.starts_with(std::env::temp_dir()));
        drop(files);
        assert!(!root.exists());
    }
}

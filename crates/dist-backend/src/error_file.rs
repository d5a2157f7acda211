//! The launcher's error file: how a rank tells `torchrun` (or `distrun`) why it failed.
//!
//! torch's elastic launcher gives each rank a path in `TORCHELASTIC_ERROR_FILE`. A rank that
//! fails writes its error there as JSON (what `@record` does in Python), and the launcher,
//! which otherwise sees only an exit code, prints that message as the job's root cause
//! instead of "error_file: <N/A>". `distrun` sets and reads the same file.
//!
//! The file's shape is torch's:
//! `{"message": {"message": "...", "extraInfo": {"py_callstack": "...", "timestamp": "..."}}}`,
//! the timestamp in whole seconds since the epoch, as a string. `extraInfo` also carries
//! `timestamp_ns`, the same time in nanoseconds (a string too): a launcher that must tell
//! which of several ranks' errors came first (`distrun` does) needs more than seconds, and
//! more than the file's modification time, which the kernel keeps to a few milliseconds.
//!
//! [`record_panics`] writes the file for a panic (process groups call it when they are
//! created under a launcher that set the variable); [`record`] also for an error a closure
//! returns, for programs whose `main` returns `Result`. The first error written wins: the
//! panics that follow a failure (other threads finding a peer gone) are not the root cause.

use std::fmt::Display;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The variable naming a rank's error file (torch's name, which `distrun` sets too).
pub const ERROR_FILE_VAR: &str = "TORCHELASTIC_ERROR_FILE";

/// Whether this process wrote its error file already.
static WRITTEN: AtomicBool = AtomicBool::new(false);
/// Installs the panic hook once.
static HOOK: Once = Once::new();

/// The path in [`ERROR_FILE_VAR`], if the launcher set one.
pub fn error_file_path() -> Option<PathBuf> {
    std::env::var_os(ERROR_FILE_VAR)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// Writes `message` (one line, the error) and `trace` (where it happened, the error's causes,
/// a backtrace) to the error file, if the launcher named one and nothing was written before.
/// Returns the path written, `None` when there was nothing to do.
pub fn write_error(message: &str, trace: &str) -> io::Result<Option<PathBuf>> {
    let Some(path) = error_file_path() else {
        return Ok(None);
    };
    if WRITTEN.swap(true, Ordering::SeqCst) {
        return Ok(None);
    }
    write_to(&path, message, trace, SystemTime::now())?;
    Ok(Some(path))
}

/// Writes the error file at `path` in torch's shape. It goes to a temporary file beside
/// `path` first and is renamed over it, so a launcher reading it as the rank dies never sees
/// half of it.
pub fn write_to(path: &Path, message: &str, trace: &str, at: SystemTime) -> io::Result<()> {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    let data = serde_json::json!({
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": trace,
                "timestamp": since.as_secs().to_string(),
                "timestamp_ns": since.as_nanos().to_string(),
            },
        },
    });
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp_name);
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        serde_json::to_writer(&mut f, &data)?;
        f.write_all(b"\n")?;
        f.sync_all()
    })();
    match written.and_then(|()| std::fs::rename(&tmp, path)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Makes a panic in any thread write the error file (when the launcher named one): the
/// panic's message and place, and a backtrace. The hook that was installed before still runs
/// after it, so the panic is printed as usual. Calling it again does nothing.
pub fn record_panics() {
    if error_file_path().is_none() {
        return;
    }
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            // Later panics are not the root cause; skip their backtraces too.
            if WRITTEN.load(Ordering::SeqCst) {
                previous(info);
                return;
            }
            let what = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "Box<dyn Any>".to_owned());
            let thread = std::thread::current();
            let thread = thread.name().unwrap_or("<unnamed>");
            let place = info
                .location()
                .map_or_else(String::new, |l| format!(" at {}:{}", l.file(), l.line()));
            let message = format!("panic in thread '{thread}'{place}: {what}");
            let backtrace = std::backtrace::Backtrace::force_capture().to_string();
            let trace = format!("{message}\n{}", from_the_panic(&backtrace));
            if let Err(e) = write_error(&message, &trace) {
                eprintln!("dist: could not write the error file: {e}");
            }
            previous(info);
        }));
    });
}

/// A captured backtrace from the frame that panicked on: the frames above it (this hook, std's
/// panic machinery) say nothing of the error. Frames are lines `   N: name`, each followed by
/// its `at file:line` lines; the last of std's is its panic entry point.
fn from_the_panic(backtrace: &str) -> &str {
    const STD_PANIC_FRAMES: [&str; 4] = [
        "__rust_end_short_backtrace",
        "rust_begin_unwind",
        "core::panicking::",
        "std::panicking::begin_panic",
    ];
    let is_frame = |l: &str| {
        let t = l.trim_start();
        t.split_once(": ")
            .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    let mut offset = 0;
    let mut from = 0;
    let mut in_std = false;
    for line in backtrace.split_inclusive('\n') {
        if is_frame(line) {
            if in_std {
                from = offset;
            }
            in_std = STD_PANIC_FRAMES.iter().any(|f| line.contains(f));
        }
        offset += line.len();
    }
    &backtrace[from..]
}

/// Runs `f` as torch's `@record` runs a function: a panic inside it, or the error it returns,
/// is written to the launcher's error file before it goes on (the panic unwinds on, the error
/// is returned). Where no launcher named a file, it only runs `f`.
///
/// ```no_run
/// fn train() -> Result<(), std::io::Error> {
///     Ok(())
/// }
///
/// fn main() -> Result<(), std::io::Error> {
///     dist_backend::error_file::record(train)
/// }
/// ```
pub fn record<T, E: Display>(f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    record_panics();
    let out = f();
    if let Err(e) = &out {
        let message = e.to_string();
        if let Err(io) = write_error(&message, &message) {
            eprintln!("dist: could not write the error file: {io}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_file_has_torchs_shape_and_is_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("error.json");
        std::fs::write(&path, "stale").unwrap();
        let at = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        write_to(&path, "rank 3 lost peer 1", "line one\n\"quoted\"", at).unwrap();
        let data: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(data["message"]["message"], "rank 3 lost peer 1");
        assert_eq!(
            data["message"]["extraInfo"]["py_callstack"],
            "line one\n\"quoted\""
        );
        assert_eq!(data["message"]["extraInfo"]["timestamp"], "1700000000");
        assert_eq!(
            data["message"]["extraInfo"]["timestamp_ns"],
            "1700000000123456789"
        );
        // Nothing but the file: the temporary one was renamed over it.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn the_trace_starts_at_the_frame_that_panicked() {
        let bt = "   0: dist_backend::error_file::record_panics::{{closure}}
             at ./src/error_file.rs:112:50
   1: std::panicking::panic_with_hook
   2: std::sys::backtrace::__rust_end_short_backtrace
   3: rust_begin_unwind
             at /rustc/library/std/src/panicking.rs:689:5
   4: core::panicking::panic_fmt
   5: train::step
             at ./src/main.rs:7:5
   6: main
";
        assert!(from_the_panic(bt).starts_with("   5: train::step\n"));
        // Without std's frames (a stripped binary), all of it.
        assert_eq!(from_the_panic("   0: <unknown>\n"), "   0: <unknown>\n");
        assert_eq!(from_the_panic(""), "");
    }

    #[test]
    fn a_missing_directory_is_an_error_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent").join("error.json");
        assert!(write_to(&path, "m", "t", SystemTime::now()).is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}

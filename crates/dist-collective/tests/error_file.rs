//! A process group made under a launcher that names an error file (`TORCHELASTIC_ERROR_FILE`)
//! records the first panic there, in torch's shape, as the rank's root cause.
//!
//! The rank is this test binary re-run as a child (the `panicking_rank` test, which does
//! nothing unless `DIST_TEST_PANICKING_RANK` is set), so that the variable and the panic hook
//! are the child's alone.

use std::process::Command;

use dist_collective::{InitOptions, init_process_group};

/// A 1-rank job: makes its group over a file store, then panics twice (two threads).
#[test]
fn panicking_rank() {
    let Some(store) = std::env::var_os("DIST_TEST_PANICKING_RANK") else {
        return;
    };
    let url = format!("file://{}", store.to_str().unwrap());
    let pg = init_process_group(
        InitOptions::new()
            .backend("gloo")
            .init_method(url)
            .rank(0)
            .world_size(1),
    )
    .unwrap();
    let mut v = [1.0f32];
    pg.all_reduce(&mut v, dist_collective::ReduceOp::Sum)
        .unwrap();
    // The first panic is the root cause; the second, after it, must not replace it.
    let first = std::thread::spawn(|| panic!("the loss went to NaN at step 7"));
    assert!(first.join().is_err());
    panic!("a later panic");
}

#[test]
fn a_groups_first_panic_is_written_to_the_error_file() {
    let dir = tempfile::tempdir().unwrap();
    let error_file = dir.path().join("error.json");
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["panicking_rank", "--exact", "--test-threads=1"])
        .env("DIST_TEST_PANICKING_RANK", dir.path().join("store"))
        .env("TORCHELASTIC_ERROR_FILE", &error_file)
        .output()
        .unwrap();
    assert!(!out.status.success(), "the rank did not fail");
    let data: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&error_file).unwrap_or_else(|e| {
            panic!(
                "no error file ({e}); the rank's stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        }))
        .unwrap();
    let message = data["message"]["message"].as_str().unwrap();
    assert!(
        message.contains("the loss went to NaN at step 7") && message.contains("error_file.rs"),
        "{message}"
    );
    let trace = data["message"]["extraInfo"]["py_callstack"]
        .as_str()
        .unwrap();
    // From the frame that panicked (`{closure#0}` in builds with line tables only).
    assert!(
        trace.contains("panicking_rank") || trace.contains("error_file.rs:"),
        "{trace}"
    );
    assert!(
        data["message"]["extraInfo"]["timestamp"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .is_ok()
    );
}

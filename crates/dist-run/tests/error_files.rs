//! The ranks' error files (`TORCHELASTIC_ERROR_FILE`) through `distrun`: what a failing rank
//! writes there is the root cause `distrun` reports, and what it passes to a launcher above it.
//!
//! Ranks are `sh -c` scripts, or this test binary re-run as a worker (the `error_worker` test,
//! which does nothing unless `DISTRUN_TEST_ERROR` is set) that fails through `dist`'s recorders.

use std::collections::BTreeSet;
use std::process::{Command, Output, Stdio};

const DISTRUN: &str = env!("CARGO_BIN_EXE_distrun");

fn distrun(args: &[&str]) -> Command {
    let mut c = Command::new(DISTRUN);
    c.args(args).stdin(Stdio::null());
    c
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// A rank: rank 1 fails as `DISTRUN_TEST_ERROR` says (`panic` or `error`), the others succeed.
#[test]
fn error_worker() -> Result<(), std::io::Error> {
    let Ok(how) = std::env::var("DISTRUN_TEST_ERROR") else {
        return Ok(());
    };
    if std::env::var("RANK").as_deref() != Ok("1") {
        return Ok(());
    }
    dist_backend::error_file::record(|| match how.as_str() {
        "panic" => panic!("rank 1 found a NaN in layer 7's gradients"),
        _ => Err(std::io::Error::other("no checkpoint shard for rank 1")),
    })
}

/// Runs 2 ranks of `error_worker` failing as `how`, with distrun's own error file at `outer`.
fn failing_job(how: &str, outer: &std::path::Path) -> Output {
    let exe = std::env::current_exe().unwrap().display().to_string();
    distrun(&[
        "--nproc-per-node",
        "2",
        "--",
        &exe,
        "error_worker",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("DISTRUN_TEST_ERROR", how)
    .env("TORCHELASTIC_ERROR_FILE", outer)
    .output()
    .unwrap()
}

/// The lines of distrun's report from the one naming `rank`'s error on.
fn error_section(stderr: &str, rank: u32) -> Vec<&str> {
    let head = format!("distrun: rank {rank}'s error (its error file):");
    stderr.lines().skip_while(|l| *l != head).collect()
}

#[test]
fn a_panicking_rank_is_reported_from_its_error_file_and_passed_on_with_its_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let outer = dir.path().join("outer.json");
    let out = failing_job("panic", &outer);
    let stderr = text(&out.stderr);
    // The test harness exits 101 when a test fails.
    assert_eq!(out.status.code(), Some(101), "{stderr}");
    let section = error_section(&stderr, 1);
    assert!(section.len() >= 5, "no error section: {stderr}");
    assert!(
        section[1].contains("panic in thread")
            && section[1].contains("rank 1 found a NaN in layer 7's gradients"),
        "{stderr}"
    );
    assert!(section[2].starts_with("distrun: its trace ("), "{stderr}");
    // The trace starts at the frame that panicked, not in the hook or std's panic machinery
    // (a frame's name is `{closure#0}` in some builds: its place says which it is).
    assert!(
        !section[3].contains("panicking") && !section[3].contains("record_panics"),
        "{stderr}"
    );
    assert!(
        section[3..5]
            .iter()
            .any(|l| l.contains("error_worker") || l.contains("error_files.rs:")),
        "{stderr}"
    );

    let passed = json(&outer);
    let message = passed["message"]["message"].as_str().unwrap();
    assert!(message.contains("rank 1 found a NaN"), "{passed}");
    assert_eq!(passed["message"]["errorCode"], 101, "{passed}");
    let secs: u64 = passed["message"]["extraInfo"]["timestamp"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(secs > 1_600_000_000, "{passed}");
}

#[test]
fn an_error_returned_through_record_is_the_root_cause() {
    let dir = tempfile::tempdir().unwrap();
    let outer = dir.path().join("outer.json");
    let out = failing_job("error", &outer);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(101), "{stderr}");
    let section = error_section(&stderr, 1);
    assert_eq!(
        section.get(1).copied(),
        Some("distrun:   no checkpoint shard for rank 1"),
        "{stderr}"
    );
    assert_eq!(
        json(&outer)["message"]["message"],
        "no checkpoint shard for rank 1"
    );
}

#[test]
fn a_script_may_write_torchs_plain_shape() {
    let dir = tempfile::tempdir().unwrap();
    let outer = dir.path().join("outer.json");
    let script = r#"if [ "$RANK" = 2 ]; then
            printf '{"message": "disk full on rank %s"}' "$RANK" > "$TORCHELASTIC_ERROR_FILE"
            exit 3
        fi"#;
    let out = distrun(&["--nproc-per-node", "3", "--", "sh", "-c", script])
        .env("TORCHELASTIC_ERROR_FILE", &outer)
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert_eq!(
        error_section(&stderr, 2).get(1).copied(),
        Some("distrun:   disk full on rank 2"),
        "{stderr}"
    );
    // Torch's plain shape is passed on as it is (it has no object to put the code in).
    assert_eq!(json(&outer)["message"], "disk full on rank 2");
}

#[test]
fn each_rank_gets_its_own_file_in_a_directory_that_goes_with_the_run() {
    let out = distrun(&[
        "--nproc-per-node",
        "3",
        "--",
        "sh",
        "-c",
        r#"echo "EF $TORCHELASTIC_ERROR_FILE""#,
    ])
    .env("TORCHELASTIC_ERROR_FILE", "/the/launchers/own")
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let files: BTreeSet<String> = text(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once("EF ").map(|(_, p)| p.to_owned()))
        .collect();
    assert_eq!(files.len(), 3, "one file per rank: {files:?}");
    for f in &files {
        let path = std::path::Path::new(f);
        assert!(path.ends_with("error.json"), "{f}");
        let run_dir = path.ancestors().nth(3).unwrap();
        assert!(!run_dir.exists(), "{} left behind", run_dir.display());
    }
}

#[test]
fn with_a_log_dir_the_error_files_stay_beside_the_logs() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"[ "$RANK" = 1 ] && echo '{"message": "bad input"}' > "$TORCHELASTIC_ERROR_FILE" && exit 4; true"#;
    let logs = dir.path().join("logs");
    let out = distrun(&[
        "--nproc-per-node",
        "2",
        "--log-dir",
        logs.to_str().unwrap(),
        "--",
        "sh",
        "-c",
        script,
    ])
    .env_remove("TORCHELASTIC_ERROR_FILE")
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    let kept = logs.join("attempt_0/rank_1/error.json");
    assert_eq!(json(&kept)["message"], "bad input");
    assert!(logs.join("attempt_0/rank_1/stderr.log").exists());
}

#[test]
fn the_rank_whose_error_came_first_is_the_root_cause_though_others_exit_before_it() {
    // As when rank 2 panics in a collective: its error is written first, then its peers hear
    // of it and exit at once, while rank 2 itself is still tearing down its groups.
    let script = r#"dir=${TORCHELASTIC_ERROR_FILE%/rank_*}
        if [ "$RANK" = 2 ]; then
            # Written aside and renamed, as dist writes it: whole, and dated, once it exists.
            # Dated to the nanosecond (the file's own time is kept to a few milliseconds).
            printf '{"message": {"message": "rank 2 chose to fail", "extraInfo":
                {"timestamp_ns": "%s"}}}' "$(date +%s%N)" > "$TORCHELASTIC_ERROR_FILE.tmp"
            mv "$TORCHELASTIC_ERROR_FILE.tmp" "$TORCHELASTIC_ERROR_FILE"
            exec sleep 60
        fi
        while [ ! -e "$dir/rank_2/error.json" ]; do sleep 0.01; done
        printf '{"message": {"message": "peer rank 2 was lost", "extraInfo":
            {"timestamp_ns": "%s"}}}' "$(date +%s%N)" > "$TORCHELASTIC_ERROR_FILE"
        exit 1"#;
    for _ in 0..3 {
        let out = distrun(&["--nproc-per-node", "4", "--", "sh", "-c", script])
            .env_remove("TORCHELASTIC_ERROR_FILE")
            .output()
            .unwrap();
        let stderr = text(&out.stderr);
        // distrun exits with the code of the first rank seen to fail.
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        let first = stderr
            .lines()
            .find(|l| l.contains("failed first"))
            .unwrap_or_else(|| panic!("{stderr}"));
        assert!(
            first.starts_with("distrun: rank 2 failed first")
                && first.contains("its error came first (rank ")
                && first.ends_with("was the first to exit, exit code 1)"),
            "{stderr}"
        );
        assert_eq!(
            error_section(&stderr, 2).get(1).copied(),
            Some("distrun:   rank 2 chose to fail"),
            "{stderr}"
        );
    }
}

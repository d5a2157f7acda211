//! `cargo xtask ci`: everything CI checks, cheapest first, stopping at the first failure.
//!
//! The order is fmt, clippy, clippy with dist-collective's nccl feature, check-layers, test,
//! test with the nccl feature (dist-collective's backend strings), multi-rank (`cargo xtask
//! test`: the multi-rank programs as real processes through `distrun`), two-hosts (`cargo
//! xtask test --netns`, where namespaces can be made), doc, then `cargo deny` when it is
//! installed.
//! A failing step is named in the error, with the command that failed, so the log's last line
//! says what to fix.

use std::process::Command;
use std::time::Instant;

use crate::{check_layers, util};

/// One step of the pipeline.
enum Step {
    /// Run this cargo command.
    Cargo(Command),
    /// Run this check in-process.
    InProcess(fn() -> Result<(), String>),
}

/// Runs the pipeline.
pub(crate) fn run() -> Result<(), String> {
    let started = Instant::now();
    let mut steps: Vec<(&str, Step)> = vec![
        ("fmt", cargo(&["fmt", "--all", "--check"])),
        (
            "clippy",
            cargo(&[
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]),
        ),
        // dist-collective's nccl feature is off in workspace builds; its code and tests
        // build and run without CUDA (NcclBackend reports the missing library), so CI checks
        // them too, for the price of one more build of dist-collective.
        (
            "clippy-nccl",
            cargo(&[
                "clippy",
                "-p",
                "dist-collective",
                "--features",
                "nccl",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]),
        ),
        ("check-layers", Step::InProcess(check_layers::run)),
        ("test", cargo(&["test", "--workspace"])),
        (
            "test-nccl",
            cargo(&[
                "test",
                "-p",
                "dist-collective",
                "--features",
                "nccl",
                "--lib",
                "--test",
                "backend_strings",
            ]),
        ),
        ("multi-rank", Step::InProcess(multi_rank)),
        // Two simulated hosts; it skips itself (and says why) without root or namespaces.
        ("two-hosts", Step::InProcess(crate::netns::run_netns)),
        ("doc", {
            let mut cmd = util::cargo();
            cmd.args(["doc", "--workspace", "--no-deps"])
                .env("RUSTDOCFLAGS", "-D warnings");
            Step::Cargo(cmd)
        }),
    ];
    if cargo_deny_installed() {
        steps.push((
            "deny",
            cargo(&["deny", "check", "bans", "licenses", "sources"]),
        ));
    }

    for (name, step) in steps {
        let t = Instant::now();
        match step {
            Step::Cargo(mut cmd) => {
                println!("==> {name}: {}", util::display(&cmd));
                let status = cmd
                    .status()
                    .map_err(|e| format!("step `{name}` could not start: {e}"))?;
                if !status.success() {
                    return Err(format!(
                        "step `{name}` failed ({status}): {}",
                        util::display(&cmd)
                    ));
                }
            }
            Step::InProcess(f) => {
                println!("==> {name}");
                f().map_err(|e| format!("step `{name}` failed: {e}"))?;
            }
        }
        println!("==> {name}: ok in {:.1?}", t.elapsed());
    }
    if !cargo_deny_installed() {
        println!(
            "==> deny: skipped, cargo-deny is not installed (cargo install cargo-deny --locked)"
        );
    }
    println!("ci: all steps passed in {:.1?}", started.elapsed());
    Ok(())
}

fn cargo(args: &[&str]) -> Step {
    let mut cmd = util::cargo();
    cmd.args(args);
    Step::Cargo(cmd)
}

/// `cargo xtask test` with its default world sizes.
fn multi_rank() -> Result<(), String> {
    crate::test::run_tests(&[])
}

/// True when `cargo deny --version` runs.
fn cargo_deny_installed() -> bool {
    util::cargo()
        .args(["deny", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
}

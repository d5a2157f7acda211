//! `cargo xtask`: the project's one entry point for automation.
//!
//! Each subcommand lives in its own module. Arguments are parsed by hand to keep this crate's
//! build small: it depends on `serde_json` and `nix` only, and builds into `target/xtask` (see
//! `.cargo/config.toml`) so it never invalidates the main build cache.

#![forbid(unsafe_code)]
mod bench;
mod check_layers;
mod ci;
mod netns;
mod placement;
mod soak;
mod test;
mod util;

use std::process::ExitCode;

const HELP: &str = "\
cargo xtask: automation for the dist workspace

USAGE:
    cargo xtask <COMMAND>

COMMANDS:
    ci              What CI runs, cheapest first, stopping at the first failure:
                    fmt, clippy, check-layers, test, doc, cargo-deny (if installed)
    check-layers    Fail if a dist-* crate depends on a crate above it in the layer DAG, or a
                    sans-IO module (dist-gloo proto/) names I/O, threads or clocks
    bench           nccl-tests-style collective benchmarks (`cargo xtask bench --help`)
    placement       A cache line's round trip between CPU 0 and CPU 1 in ns (50-74 on the
                    development VM; far more while the host has put the vCPUs far apart,
                    when copies from core to core run 3-16x slower); `bench` probes each cell
    test            Multi-rank programs as real processes through distrun (`--world-size N`)
    soak            The main job many times, then injected faults (kill, stall, mismatch,
                    store garbage); a table of failures, hangs and delays (`cargo xtask soak
                    --help`; long, so not part of ci)
    help            Print this message
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (cmd, rest) = match args.split_first() {
        Some((cmd, rest)) => (cmd.as_str(), rest),
        None => {
            print!("{HELP}");
            return ExitCode::SUCCESS;
        }
    };
    if cmd == "help" || cmd == "-h" || cmd == "--help" {
        print!("{HELP}");
        return ExitCode::SUCCESS;
    }
    if cmd == "test" {
        if rest.iter().any(|a| a == "-h" || a == "--help") {
            print!("{}", test::HELP);
            return ExitCode::SUCCESS;
        }
        return match test::run_tests(rest) {
            Ok(()) => ExitCode::SUCCESS,
            Err(msg) => {
                eprintln!("xtask test: {msg}");
                ExitCode::FAILURE
            }
        };
    }
    if cmd == "bench" {
        if rest.iter().any(|a| a == "-h" || a == "--help") {
            print!("{}", bench::HELP);
            return ExitCode::SUCCESS;
        }
        return match bench::run_bench(rest) {
            Ok(()) => ExitCode::SUCCESS,
            Err(msg) => {
                eprintln!("xtask bench: {msg}");
                ExitCode::FAILURE
            }
        };
    }
    if cmd == "soak" {
        if rest.iter().any(|a| a == "-h" || a == "--help") {
            print!("{}", soak::HELP);
            return ExitCode::SUCCESS;
        }
        return match soak::run_soak(rest) {
            Ok(()) => ExitCode::SUCCESS,
            Err(msg) => {
                eprintln!("xtask soak: {msg}");
                ExitCode::FAILURE
            }
        };
    }
    if let Some(extra) = rest.first() {
        eprintln!("xtask {cmd}: unexpected argument `{extra}`\n\n{HELP}");
        return ExitCode::from(2);
    }
    let result = match cmd {
        "ci" => ci::run(),
        "check-layers" => check_layers::run(),
        "placement" => match placement::round_trip_ns() {
            Some(ns) => {
                println!("{ns:.0}");
                Ok(())
            }
            None => Err("CPU 0 and CPU 1 cannot both be pinned here".to_string()),
        },
        other => {
            eprintln!("xtask: unknown command `{other}`\n\n{HELP}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("xtask {cmd}: {msg}");
            ExitCode::FAILURE
        }
    }
}

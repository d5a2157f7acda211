//! `distrun`: see the `dist_run` crate docs.

#![forbid(unsafe_code)]
use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = dist_run::Args::parse();
    let code = dist_run::run(&args);
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

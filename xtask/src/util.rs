//! Helpers shared by the subcommands: the project root and running `cargo`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root: `DIST_XTASK_ROOT` where set (an xtask binary carried to a machine
/// without a Rust toolchain, whose checkout lies elsewhere), else the parent of this crate's
/// directory.
pub(crate) fn project_root() -> PathBuf {
    if let Some(root) = std::env::var_os("DIST_XTASK_ROOT") {
        return PathBuf::from(root);
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// A `cargo` command rooted at the workspace, using the same cargo that runs us when known.
pub(crate) fn cargo() -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
    let mut cmd = Command::new(cargo);
    cmd.current_dir(project_root());
    cmd
}

/// `cmd` as a shell-like string, for messages.
pub(crate) fn display(cmd: &Command) -> String {
    let mut s = String::new();
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            s.push_str(&format!("{}={} ", k.to_string_lossy(), v.to_string_lossy()));
        }
    }
    // Show `cargo`, not the absolute path cargo gave us in $CARGO.
    let program = Path::new(cmd.get_program())
        .file_name()
        .unwrap_or(cmd.get_program());
    s.push_str(&program.to_string_lossy());
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

/// Runs `cmd` to completion with inherited stdio; an error names the command and its status.
pub(crate) fn run(cmd: &mut Command) -> Result<(), String> {
    let status = cmd
        .status()
        .map_err(|e| format!("could not start `{}`: {e}", display(cmd)))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`{}` failed with {status}", display(cmd)))
    }
}

/// Builds, in release mode and quietly, the binaries of `packages` and `examples` of them:
/// every example when `examples` is `["*"]`, else the ones named.
///
/// Target flags select only the targets they name, in every package given: the binaries are
/// named too (`--bins`), or a stale `distrun`/`ddp-train` left by an earlier build would run.
///
/// With `DIST_XTASK_PREBUILT` set it builds nothing and uses what `target/release` holds: on a
/// machine with no Rust toolchain (a lent GPU machine) the binaries are built elsewhere and
/// carried there.
pub(crate) fn build_release(packages: &[&str], examples: &[&str]) -> Result<(), String> {
    if std::env::var_os("DIST_XTASK_PREBUILT").is_some() {
        println!(
            "xtask: DIST_XTASK_PREBUILT is set, so the binaries in target/release are used as they are"
        );
        return Ok(());
    }
    let mut cmd = cargo();
    cmd.args(["build", "--release", "--quiet", "--bins"]);
    for p in packages {
        cmd.args(["-p", p]);
    }
    if examples == ["*"] {
        cmd.arg("--examples");
    } else {
        for e in examples {
            cmd.args(["--example", e]);
        }
    }
    run(&mut cmd)
}

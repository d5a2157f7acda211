//! `cargo xtask check-layers`: the internal dependency DAG, checked against `cargo metadata`,
//! and the sans-IO modules, checked for I/O, threads and clocks.
//!
//! Every `dist-*` workspace crate must be listed in [`LAYERS`] with the internal crates it may
//! depend on. Only normal dependencies count: dev- and build-dependencies may reach anywhere
//! (a backend's tests may use the facade). Backends (`dist-gloo`, `dist-nccl`) are reachable
//! from the typed layers only as optional dependencies, so that a build without the feature
//! never compiles them.

use serde_json::Value;

use crate::util;

/// What one crate may depend on.
struct Layer {
    /// The crate.
    name: &'static str,
    /// Internal crates it may depend on unconditionally.
    allowed: &'static [&'static str],
    /// Internal crates it may depend on only as optional dependencies (behind a feature).
    optional_only: &'static [&'static str],
}

const BACKENDS: &[&str] = &["dist-gloo", "dist-nccl"];

/// The allowed DAG, bottom to top. A crate not yet written is simply absent from the metadata.
const LAYERS: &[Layer] = &[
    Layer {
        name: "dist-simd",
        allowed: &[],
        optional_only: &[],
    },
    Layer {
        name: "dist-wire",
        allowed: &["dist-simd"],
        optional_only: &[],
    },
    Layer {
        name: "dist-backend",
        allowed: &["dist-wire"],
        optional_only: &[],
    },
    Layer {
        name: "dist-gloo",
        allowed: &["dist-backend", "dist-wire", "dist-simd"],
        optional_only: &[],
    },
    Layer {
        name: "dist-nccl",
        allowed: &["dist-backend", "dist-wire"],
        optional_only: &[],
    },
    Layer {
        name: "dist-collective",
        allowed: &["dist-backend", "dist-wire"],
        optional_only: BACKENDS,
    },
    Layer {
        name: "dist-parallel",
        allowed: &["dist-collective", "dist-backend", "dist-wire"],
        optional_only: BACKENDS,
    },
    Layer {
        name: "dist-rpc",
        allowed: &["dist-collective", "dist-backend", "dist-wire"],
        optional_only: BACKENDS,
    },
    Layer {
        name: "dist-run",
        allowed: &["dist-backend", "dist-wire"],
        optional_only: &[],
    },
    Layer {
        name: "dist",
        allowed: &[
            "dist-wire",
            "dist-backend",
            "dist-gloo",
            "dist-nccl",
            "dist-collective",
            "dist-parallel",
            "dist-rpc",
        ],
        optional_only: &[],
    },
];

/// Source directories that must stay sans-IO: a state machine that is given bytes and the
/// time, so that every driver (TCP, in-memory, shared memory, the simulation) runs the same
/// rules and tests can run it in virtual time.
const SANS_IO: &[&str] = &["crates/dist-gloo/src/proto"];

/// What a sans-IO file may not name: sockets, pollers, threads, files, processes, clocks and
/// blocking primitives.
const FORBIDDEN_IN_SANS_IO: &[&str] = &[
    "mio::",
    "std::net",
    "std::thread",
    "std::io::",
    "std::fs",
    "std::process",
    "std::sync",
    "Instant::now",
    "SystemTime",
    "tokio",
    "socket2",
    "nix::",
    "libc::",
];

/// Runs `cargo metadata` on the workspace and checks it, then scans the sans-IO modules.
pub(crate) fn run() -> Result<(), String> {
    let metadata = workspace_metadata()?;
    let mut violations = check(&metadata)?;
    violations.extend(check_sans_io(&util::project_root())?);
    if violations.is_empty() {
        println!("check-layers: ok");
        return Ok(());
    }
    for v in &violations {
        eprintln!("error: {v}");
    }
    Err(format!(
        "{} layering violation(s); the allowed DAG is in xtask/src/check_layers.rs",
        violations.len()
    ))
}

/// `cargo metadata --format-version 1 --no-deps` of the workspace, parsed.
fn workspace_metadata() -> Result<Value, String> {
    let mut cmd = util::cargo();
    cmd.args(["metadata", "--format-version", "1", "--no-deps"]);
    let out = cmd
        .output()
        .map_err(|e| format!("could not run `{}`: {e}", util::display(&cmd)))?;
    if !out.status.success() {
        return Err(format!(
            "`{}` failed ({}):\n{}",
            util::display(&cmd),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("cargo metadata output: {e}"))
}

/// True for the crates this check governs.
fn is_dist_crate(name: &str) -> bool {
    name == "dist" || name.starts_with("dist-")
}

/// Checks `metadata` (the JSON of `cargo metadata --format-version 1`) and returns one message
/// per offending crate or edge, sorted. `Err` means the JSON does not have the expected shape.
fn check(metadata: &Value) -> Result<Vec<String>, String> {
    let str_field = |v: &Value, key: &str| -> Result<String, String> {
        v.get(key)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| format!("cargo metadata: missing string field `{key}`"))
    };
    let members: Vec<String> = metadata
        .get("workspace_members")
        .and_then(Value::as_array)
        .ok_or("cargo metadata: missing `workspace_members`")?
        .iter()
        .filter_map(|id| id.as_str().map(str::to_owned))
        .collect();
    let packages = metadata
        .get("packages")
        .and_then(Value::as_array)
        .ok_or("cargo metadata: missing `packages`")?;

    // Workspace packages by name: a dependency on one of these is internal.
    let mut workspace = Vec::new();
    for pkg in packages {
        if members.contains(&str_field(pkg, "id")?) {
            workspace.push((str_field(pkg, "name")?, pkg));
        }
    }
    let internal = |name: &str| workspace.iter().any(|(n, _)| n == name);

    let mut violations = Vec::new();
    for (name, pkg) in &workspace {
        if !is_dist_crate(name) {
            continue;
        }
        let Some(layer) = LAYERS.iter().find(|l| l.name == name) else {
            violations.push(format!(
                "{name} is not in the layer table: add it to LAYERS in xtask/src/check_layers.rs \
                 with the crates it may depend on"
            ));
            continue;
        };
        let deps = pkg
            .get("dependencies")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("cargo metadata: {name} has no `dependencies`"))?;
        for dep in deps {
            // `kind` is null for normal dependencies, "dev" or "build" otherwise.
            if !dep.get("kind").is_none_or(Value::is_null) {
                continue;
            }
            let dep_name = str_field(dep, "name")?;
            if !internal(&dep_name) {
                continue;
            }
            let optional = dep.get("optional").and_then(Value::as_bool) == Some(true);
            let ok = layer.allowed.contains(&dep_name.as_str())
                || (optional && layer.optional_only.contains(&dep_name.as_str()));
            if !ok {
                let msg = format!("{name} -> {dep_name} is not allowed: {}", describe(layer));
                if !violations.contains(&msg) {
                    violations.push(msg);
                }
            }
        }
    }
    violations.sort();
    Ok(violations)
}

/// One message per forbidden name found in a `.rs` file under a [`SANS_IO`] directory of the
/// workspace at `root`, naming file, line and name.
fn check_sans_io(root: &std::path::Path) -> Result<Vec<String>, String> {
    let mut violations = Vec::new();
    for dir in SANS_IO {
        let mut files = Vec::new();
        collect_rs(&root.join(dir), &mut files)?;
        files.sort();
        for file in files {
            let text = std::fs::read_to_string(&file)
                .map_err(|e| format!("reading {}: {e}", file.display()))?;
            let shown = file
                .strip_prefix(root)
                .unwrap_or(&file)
                .display()
                .to_string();
            violations.extend(scan_sans_io(&shown, &text));
        }
    }
    Ok(violations)
}

/// The forbidden names in `text` (the file `name`), skipping comment lines.
fn scan_sans_io(name: &str, text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        for bad in FORBIDDEN_IN_SANS_IO {
            if code.contains(bad) {
                out.push(format!(
                    "{name}:{}: `{bad}` in a sans-IO module (it is given bytes and the time; the \
                     drivers do the I/O)",
                    i + 1
                ));
            }
        }
    }
    out
}

/// Every `.rs` file under `dir` but test modules (`tests.rs`).
fn collect_rs(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) -> Result<(), String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("reading {}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry
            .map_err(|e| format!("reading {}: {e}", dir.display()))?
            .path();
        if path.is_dir() {
            collect_rs(&path, out)?;
        } else if path.extension().is_some_and(|x| x == "rs")
            // Unit tests drive the module; they may take a clock origin.
            && path.file_name().is_some_and(|f| f != "tests.rs")
        {
            out.push(path);
        }
    }
    Ok(())
}

/// "dist-collective may depend on dist-backend, dist-wire, and on dist-gloo, dist-nccl only as
/// optional dependencies".
fn describe(layer: &Layer) -> String {
    let mut s = if layer.allowed.is_empty() {
        format!("{} may depend on no internal crate", layer.name)
    } else {
        format!("{} may depend on {}", layer.name, layer.allowed.join(", "))
    };
    if !layer.optional_only.is_empty() {
        s.push_str(&format!(
            ", and on {} only as optional dependencies (features)",
            layer.optional_only.join(", ")
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    /// A dependency: (name, kind, optional).
    type Dep = (&'static str, Option<&'static str>, bool);

    /// Synthetic `cargo metadata` JSON of a workspace of `crates`, each with its dependencies.
    fn metadata(crates: &[(&str, &[Dep])]) -> Value {
        let packages: Vec<Value> = crates
            .iter()
            .map(|(name, deps)| {
                let deps: Vec<Value> = deps
                    .iter()
                    .map(|(dep, kind, optional)| {
                        json!({ "name": dep, "kind": kind, "optional": optional })
                    })
                    .collect();
                json!({ "name": name, "id": format!("path+file:///ws/{name}#0.1.0"), "dependencies": deps })
            })
            .collect();
        let members: Vec<Value> = crates
            .iter()
            .map(|(name, _)| json!(format!("path+file:///ws/{name}#0.1.0")))
            .collect();
        json!({ "packages": packages, "workspace_members": members })
    }

    #[test]
    fn the_real_workspace_respects_the_layers() {
        let metadata = workspace_metadata().unwrap();
        assert_eq!(check(&metadata).unwrap(), Vec::<String>::new());
    }

    #[test]
    fn the_sans_io_modules_are_sans_io() {
        assert_eq!(
            check_sans_io(&util::project_root()).unwrap(),
            Vec::<String>::new()
        );
    }

    #[test]
    fn io_in_a_sans_io_module_is_named_with_its_line() {
        let text = "use std::time::Instant;\n// std::thread in a comment is fine\nfn f() { std::thread::yield_now(); let _ = Instant::now(); }\n";
        let v = scan_sans_io("proto/x.rs", text);
        assert_eq!(v.len(), 2, "{v:#?}");
        assert!(v[0].starts_with("proto/x.rs:3: `std::thread`"), "{}", v[0]);
        assert!(v[1].starts_with("proto/x.rs:3: `Instant::now`"), "{}", v[1]);
    }

    #[test]
    fn an_allowed_graph_passes() {
        let m = metadata(&[
            ("dist-simd", &[("bytemuck", None, false)]),
            (
                "dist-wire",
                &[("thiserror", None, false), ("dist-simd", None, false)],
            ),
            ("dist-backend", &[("dist-wire", None, false)]),
            (
                "dist-gloo",
                &[("dist-backend", None, false), ("dist-wire", None, false)],
            ),
            (
                "dist-collective",
                &[("dist-backend", None, false), ("dist-gloo", None, true)],
            ),
            ("dist", &[("dist-gloo", None, false)]),
            ("dist-run", &[("dist-backend", None, false)]),
        ]);
        assert_eq!(check(&m).unwrap(), Vec::<String>::new());
        // Dev-dependencies may reach up; external crates are not checked.
        let m = metadata(&[
            (
                "dist-wire",
                &[("dist", Some("dev"), false), ("half", None, false)],
            ),
            ("dist", &[("dist-wire", None, false)]),
        ]);
        assert!(check(&m).unwrap().is_empty());
    }

    #[test]
    fn an_upward_edge_is_named() {
        let m = metadata(&[
            ("dist-wire", &[("dist-backend", None, false)]),
            ("dist-backend", &[("dist-wire", None, false)]),
        ]);
        assert_eq!(
            check(&m).unwrap(),
            ["dist-wire -> dist-backend is not allowed: dist-wire may depend on dist-simd"]
        );
        let m = metadata(&[
            ("dist-simd", &[("dist-wire", None, false)]),
            ("dist-wire", &[("dist-simd", None, false)]),
        ]);
        assert_eq!(
            check(&m).unwrap(),
            ["dist-simd -> dist-wire is not allowed: dist-simd may depend on no internal crate"]
        );
        let m = metadata(&[
            ("dist-backend", &[("dist-gloo", None, false)]),
            ("dist-gloo", &[("dist-backend", None, false)]),
        ]);
        assert_eq!(
            check(&m).unwrap(),
            ["dist-backend -> dist-gloo is not allowed: dist-backend may depend on dist-wire"]
        );
    }

    #[test]
    fn a_backend_dependency_must_be_optional() {
        let m = metadata(&[
            ("dist-gloo", &[]),
            ("dist-collective", &[("dist-gloo", None, false)]),
        ]);
        assert_eq!(
            check(&m).unwrap(),
            [
                "dist-collective -> dist-gloo is not allowed: dist-collective may depend on \
              dist-backend, dist-wire, and on dist-gloo, dist-nccl only as optional dependencies \
              (features)"
            ]
        );
    }

    #[test]
    fn the_launcher_stays_off_the_backends() {
        let m = metadata(&[
            ("dist-gloo", &[]),
            ("dist-collective", &[]),
            (
                "dist-run",
                &[
                    ("dist-backend", None, false),
                    ("dist-wire", None, false),
                    ("dist-gloo", Some("dev"), false),
                    ("dist-collective", None, false),
                ],
            ),
        ]);
        assert_eq!(
            check(&m).unwrap(),
            [
                "dist-run -> dist-collective is not allowed: dist-run may depend on dist-backend, \
              dist-wire"
            ]
        );
    }

    #[test]
    fn siblings_and_unknown_crates_are_caught() {
        let m = metadata(&[
            ("dist-rpc", &[("dist-parallel", None, false)]),
            ("dist-parallel", &[("dist-shiny", None, false)]),
            ("dist-shiny", &[]),
        ]);
        let v = check(&m).unwrap();
        assert_eq!(v.len(), 3, "{v:#?}");
        assert!(v[0].starts_with("dist-parallel -> dist-shiny is not allowed"));
        assert!(v[1].starts_with("dist-rpc -> dist-parallel is not allowed"));
        assert!(v[2].starts_with("dist-shiny is not in the layer table"));
    }
}

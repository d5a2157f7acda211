#!/bin/bash
# Builds, on a machine with the Rust toolchain, what a lent GPU machine without one runs, into
# .gpu/ (git-ignored through .git/info/exclude): the GPU suites (dist-nccl's tests/gpu.rs,
# dist-collective's tests/gpu_device.rs), nccl_perf, and the binaries `cargo xtask bench`
# needs (xtask, distrun, gloo_bench) laid out as a project root with the peers' scripts, so
# that DIST_XTASK_ROOT=.gpu DIST_XTASK_PREBUILT=1 .gpu/target/release/xtask bench ... runs
# there as here. Then carry .gpu and run `bash .gpu/gpu.sh` and/or `bash .gpu/cores.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
rm -rf .gpu && mkdir -p .gpu/target/release/examples .gpu/xtask
# The path of the test executable cargo builds for `$@`.
test_exe() {
    cargo test --release --no-run --message-format=json "$@" |
        python3 -c 'import json, sys
for m in map(json.loads, sys.stdin):
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["executable"])'
}
cp "$(test_exe -p dist-nccl --test gpu)" .gpu/gpu
cp "$(test_exe -p dist-collective --features nccl --test gpu_device)" .gpu/gpu_device
cargo build --release --quiet -p dist-nccl --example nccl_perf
cargo build --release --quiet -p dist-gloo --example gloo_bench
cargo build --release --quiet -p dist-run -p xtask --bins
cp target/release/examples/nccl_perf .gpu/
cp target/release/examples/gloo_bench .gpu/target/release/examples/
cp target/release/distrun target/release/xtask .gpu/target/release/
strip .gpu/gpu .gpu/gpu_device .gpu/nccl_perf .gpu/target/release/distrun \
    .gpu/target/release/xtask .gpu/target/release/examples/gloo_bench
cp -r xtask/peers .gpu/xtask/
cp xtask/device/gpu.sh xtask/device/cores.sh .gpu/
du -sh .gpu

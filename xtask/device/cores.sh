#!/bin/bash
# On a machine with a core per rank (a lent GPU machine has 16), from what
# xtask/device/pack.sh put in .gpu/: every op against Open MPI's shared memory (where mpirun
# is installed) and, over TCP only, against torch's Gloo, on 2 and 4 ranks. Logs go to $OUT.
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/dist-cores}; mkdir -p "$OUT"
export DIST_XTASK_ROOT=$PWD DIST_XTASK_PREBUILT=1
X=target/release/xtask
nproc; cat /sys/kernel/mm/transparent_hugepage/enabled
# Only the comparison tables, not each side's own.
tables() { grep -v "^ *[0-9]\|^#  \|^# [A-Z]\|^#$\|distrun:\|dist-gloo benchmark\|xtask:"; }
if command -v mpirun >/dev/null; then
    echo "== shared memory against Open MPI's"
    timeout 200 $X bench all --world-size 2,4 -b 4 -e 64M -f 16 -n 30 --vs mpi-shm 2>&1 |
        tee "$OUT/shm.log" | tables
fi
echo "== TCP only against torch Gloo"
DIST_GLOO_TRANSPORT=tcp DIST_GLOO_CMA=0 timeout 200 $X bench all --world-size 2,4 -b 4 -e 64M \
    -f 16 -n 20 --vs torch 2>&1 | tee "$OUT/tcp_torch.log" | tables

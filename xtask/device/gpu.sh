#!/bin/bash
# On a GPU machine, from what xtask/device/pack.sh put in .gpu/: dist-nccl's GPU suite,
# dist-collective's device-buffer tests, nccl_perf for every op, and torch's NCCL all_reduce
# timed as nccl_perf times ours. Logs go to $OUT when set (the device tool's folder).
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/dist-gpu}; mkdir -p "$OUT"
nvidia-smi -L; nvidia-smi --query-gpu=driver_version,name,memory.total --format=csv
# NCCL's Python wheel ships libnccl.so.2 only; cudarc looks for libnccl.so.
NL=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
if [ -n "$NL" ]; then
    mkdir -p /tmp/dist-nccl-lib && ln -sf "$NL/libnccl.so.2" /tmp/dist-nccl-lib/libnccl.so
    export LD_LIBRARY_PATH=/tmp/dist-nccl-lib:$NL:${LD_LIBRARY_PATH:-}
fi
echo "== dist-nccl tests/gpu.rs"
timeout 150 ./gpu --test-threads=1 --nocapture 2>&1 | tee "$OUT/gpu.log"; echo "rc=${PIPESTATUS[0]}"
echo "== dist-collective tests/gpu_device.rs"
NCCL_DEBUG=WARN timeout 150 ./gpu_device --test-threads=1 --nocapture 2>&1 | tee "$OUT/gpu_device.log"
echo "rc=${PIPESTATUS[0]}"
echo "== nccl_perf"
for op in all_reduce broadcast all_gather reduce_scatter all_to_all; do
    timeout 60 ./nccl_perf $op -b 8 -e 256M -f 8 -n 20 -w 5; echo "rc=$?"
done 2>&1 | tee "$OUT/perf.log"
echo "== torch NCCL all_reduce"
PYTHONUNBUFFERED=1 timeout 90 python3 xtask/peers/torch_nccl.py 2>&1 | tee "$OUT/torch.log"

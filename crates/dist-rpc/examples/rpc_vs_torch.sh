#!/bin/sh
# rpc_bench (dist-rpc) and torch's rpc_sync over TensorPipe, back to back in one invocation, on
# the same sizes. Needs a release build of rpc_bench and distrun, and torch with RPC at
# /usr/bin/python3 (Debian: apt-get install python3-torch). torch 1.13 cannot use distrun's
# store, so its two ranks are started here with rank 0 serving the store on $PORT.
set -e
PORT=${PORT:-29731}
cd "$(dirname "$0")/../../.."
./target/release/distrun --nproc-per-node 2 -- ./target/release/examples/rpc_bench 2>&1 | grep '|' | sed 's/^\[rank 0\] //'
for r in 1 0; do
  RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT \
    /usr/bin/python3 crates/dist-rpc/examples/torch_rpc_bench.py > /tmp/torch_rpc_bench.$r.log 2>&1 &
done
wait
grep -E '^(torch|\|)' /tmp/torch_rpc_bench.0.log

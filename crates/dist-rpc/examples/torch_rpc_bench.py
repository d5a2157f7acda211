"""torch's rpc_sync (TensorPipe) on the sizes of rpc_bench.rs, with the same table, so the two
can run in one invocation:

    distrun --nproc-per-node 2 -- ./target/release/examples/rpc_bench
    distrun --nproc-per-node 2 -- /usr/bin/python3 crates/dist-rpc/examples/torch_rpc_bench.py

(`distrun` serves the store and sets TORCHELASTIC_USE_AGENT_STORE, which torch's env://
rendezvous honours.) A 1 MiB argument is a float32 tensor of 262,144 elements: TensorPipe sends
tensor storage out of band, as rpc_bench's raw-bytes path does.
"""
import os
import time

import torch
import torch.distributed.rpc as rpc


def add(a, b):
    return a + b


def nbytes(t):
    return t.numel() * t.element_size()


def echo(t):
    return t


def bench(n, warm, f):
    for _ in range(warm):
        f()
    s = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        s.append(time.perf_counter() - t)
    s.sort()
    return s[len(s) // 2], s[round(0.9 * (len(s) - 1))]


def main():
    rank = int(os.environ["RANK"])
    ws = int(os.environ["WORLD_SIZE"])
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, init_method="env://")
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=ws, rpc_backend_options=opts)
    if rank == 0:
        mib = 1 << 20
        t = torch.arange(mib // 4, dtype=torch.float32)
        small = bench(5000, 500, lambda: rpc.rpc_sync("w1", add, args=(1, 2)))
        to = bench(300, 30, lambda: rpc.rpc_sync("w1", nbytes, args=(t,)))
        ech = bench(300, 30, lambda: rpc.rpc_sync("w1", echo, args=(t,)))
        print(f"torch {torch.__version__} rpc_sync (TensorPipe)")
        print("| call | median | p90 | throughput (median) |")
        print("| --- | --- | --- | --- |")
        print(f"| small rpc_sync round trip | {small[0] * 1e6:.1f} µs | {small[1] * 1e6:.1f} µs | |")
        print(f"| 1 MiB tensor in, int back | {to[0] * 1e6:.0f} µs | {to[1] * 1e6:.0f} µs | {mib / to[0] / 1e6:.0f} MB/s |")
        print(f"| 1 MiB tensor echoed (2 MiB moved) | {ech[0] * 1e6:.0f} µs | {ech[1] * 1e6:.0f} µs | {2 * mib / ech[0] / 1e6:.0f} MB/s |")
    rpc.shutdown()


if __name__ == "__main__":
    main()

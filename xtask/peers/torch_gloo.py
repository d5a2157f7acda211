#!/usr/bin/env python3
"""torch.distributed's Gloo backend on this host, measured as `cargo xtask bench` measures ours.

    python3 torch_gloo.py --world-size 4 --sizes 4096,16777216 --ops all_reduce --out t.json

Ranks are spawned with torch.multiprocessing and meet through a FileStore in a fresh temporary
directory, so no TCP port has to be guessed in advance (Gloo's own pairs still use loopback TCP,
on ports the kernel assigns).
"""
import argparse
import datetime
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_common as pc  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def build(op, size, n):
    """The call to time for (op, size), a note saying which torch API it is, and the input
    tensor that `--fresh` rewrites before each timed call (None for a barrier)."""
    count = max(1, size // 4)
    zeros = lambda k: torch.zeros(k, dtype=torch.float32)  # noqa: E731
    if op in ("all_reduce", "allreduce_4B"):
        t = zeros(count if op == "all_reduce" else 1)
        return lambda: dist.all_reduce(t), "all_reduce SUM", t
    if op == "broadcast":
        t = zeros(count)
        return lambda: dist.broadcast(t, src=0), "broadcast src=0", t
    if op == "barrier":
        return dist.barrier, "barrier", None
    if op == "all_gather":
        inp, out = zeros(count), zeros(count * n)
        return lambda: dist.all_gather(list(out.chunk(n)), inp), "all_gather (list)", inp
    if op == "reduce_scatter":
        inp, out = zeros(count * n), zeros(count)
        if not hasattr(dist, "reduce_scatter_tensor"):
            raise NotImplementedError("this torch has no reduce_scatter_tensor")
        return lambda: dist.reduce_scatter_tensor(out, inp), "reduce_scatter_tensor", inp
    if op == "all_to_all":
        k = max(n, count // n * n)
        inp, out = zeros(k), zeros(k)
        return lambda: dist.all_to_all_single(out, inp), "all_to_all_single", inp
    raise ValueError(f"unknown op {op}")


def rank_main(rank, args, store_file):
    n = args.world_size
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=300))

    def max_over_ranks(values):
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    results = []
    for op, size in pc.plan(args.ops, args.sizes):
        try:
            fn, note, inp = build(op, size, n)
            fn()  # Gloo rejects some ops only when called: find out before timing.
        except (NotImplementedError, RuntimeError) as e:
            dist.barrier()
            r = pc.unsupported(op, size, str(e).splitlines()[0][:200])
        else:
            fresh = pc.rewriter(inp, lambda v: v.add_(0)) if args.fresh else None
            times = pc.measure(fn, size, dist.barrier, max_over_ranks, args.budget, fresh)
            r = pc.row(op, size, n, times, note)
        results.append(r)
        if rank == 0:
            pc.show(r)
    if rank == 0 and args.out:
        pc.save(args.out, {"system": "torch-gloo", "torch": torch.__version__, "world_size": n}, results)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--sizes", default="4096,65536,1048576,16777216")
    ap.add_argument("--ops", default="all_reduce,broadcast,all_gather,reduce_scatter,all_to_all")
    ap.add_argument("--budget", type=float, default=1.5, help="seconds of timed calls per op and size")
    ap.add_argument("--out", default="")
    ap.add_argument("--fresh", action="store_true",
                    help="rewrite each input's cache lines before every timed call")
    args = ap.parse_args()
    args.sizes = pc.split_list(args.sizes, int)
    args.ops = pc.split_list(args.ops)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="dist-peer-torch-") as d:
        mp.spawn(rank_main, args=(args, os.path.join(d, "store")), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()

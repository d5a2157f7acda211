#!/usr/bin/env python3
"""Open MPI (mpi4py + numpy) on this host, measured as `cargo xtask bench` measures ours.

Run under mpirun; the transport is chosen by mpirun's flags (`cargo xtask bench --vs mpi-tcp`
uses `--mca btl tcp,self`, `--vs mpi-shm` uses `--mca btl vader,self`):

    mpirun -np 2 --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo \
        python3 mpi.py --label tcp --sizes 4096 --out m.json
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_common as pc  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

COMM = MPI.COMM_WORLD


def build(op, size, n):
    """The call to time for (op, size), a note naming the MPI call, and the input buffer that
    `--fresh` rewrites before each timed call (None for a barrier)."""
    count = max(1, size // 4)
    # np.zeros maps fresh pages that are never written: every read of them hits the kernel's one
    # shared zero page, which stays in cache, so a read-only input (all_gather, all_to_all, the
    # broadcast root, reduce_scatter) would cost Open MPI no memory traffic at all. np.full
    # writes every page, as our benchmark fills its inputs and torch.zeros does.
    zeros = lambda k: np.full(k, 1.0, dtype=np.float32)  # noqa: E731
    if op in ("all_reduce", "allreduce_4B"):
        buf = zeros(count if op == "all_reduce" else 1)
        return lambda: COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), "Allreduce in place", buf
    if op == "broadcast":
        buf = zeros(count)
        return lambda: COMM.Bcast(buf, root=0), "Bcast root=0", buf
    if op == "barrier":
        return COMM.Barrier, "Barrier", None
    if op == "all_gather":
        inp, out = zeros(count), zeros(count * n)
        return lambda: COMM.Allgather(inp, out), "Allgather", inp
    if op == "reduce_scatter":
        inp, out = zeros(count * n), zeros(count)
        return lambda: COMM.Reduce_scatter_block(inp, out, op=MPI.SUM), "Reduce_scatter_block", inp
    if op == "all_to_all":
        k = max(n, count // n * n)
        inp, out = zeros(k), zeros(k)
        return lambda: COMM.Alltoall(inp, out), "Alltoall", inp
    raise ValueError(f"unknown op {op}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="tcp")
    ap.add_argument("--sizes", default="4096,65536,1048576,16777216")
    ap.add_argument("--ops", default="all_reduce,broadcast,all_gather,reduce_scatter,all_to_all")
    ap.add_argument("--budget", type=float, default=1.5)
    ap.add_argument("--out", default="")
    ap.add_argument("--fresh", action="store_true",
                    help="rewrite each input's cache lines before every timed call")
    args = ap.parse_args()
    n, rank = COMM.Get_size(), COMM.Get_rank()

    def max_over_ranks(values):
        a = np.array(values, dtype=np.float64)
        COMM.Allreduce(MPI.IN_PLACE, a, op=MPI.MAX)
        return a.tolist()

    results = []
    for op, size in pc.plan(pc.split_list(args.ops), pc.split_list(args.sizes, int)):
        fn, note, inp = build(op, size, n)
        fresh = pc.rewriter(inp, lambda v: np.add(v, 0, out=v)) if args.fresh else None
        times = pc.measure(fn, size, COMM.Barrier, max_over_ranks, args.budget, fresh)
        r = pc.row(op, size, n, times, note)
        results.append(r)
        if rank == 0:
            pc.show(r)
    if rank == 0 and args.out:
        meta = {"system": f"openmpi-{args.label}", "mpi": MPI.Get_library_version().splitlines()[0],
                "world_size": n}
        pc.save(args.out, meta, results)
    COMM.Barrier()


if __name__ == "__main__":
    main()

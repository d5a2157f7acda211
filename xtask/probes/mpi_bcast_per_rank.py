#!/usr/bin/env python3
"""Each rank's own times for Open MPI's Bcast, beside the per-iteration maximum over ranks that
`cargo xtask bench` reports, for docs/BENCHMARKS.md ("Why Open MPI's median leads small 2-rank
broadcasts over TCP").

A broadcast root that returns before its message has left (Open MPI copies an eager message into
its own fragment and writes it to the socket later, inside some later call) runs ahead in bursts:
most of its iterations are short and a few are very long. This prints, per rank and size, the
10th, 50th and 90th percentile and the mean of that rank's own iterations, then the median and
mean of the per-iteration maximum over ranks. Run it as `cargo xtask bench --vs mpi-tcp` runs
the peer:

    mpirun -np 2 --mca pml ob1 --mca btl tcp,self --mca oob_tcp_if_include lo \
        --mca btl_tcp_if_include lo python3 mpi_bcast_per_rank.py 2000 4096,16384
"""
import sys
import time

import numpy as np
from mpi4py import MPI

COMM = MPI.COMM_WORLD


def main():
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    sizes = [int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "4096,8192,16384,32768").split(",")]
    rank = COMM.Get_rank()
    for size in sizes:
        # Written pages, as the benchmark's inputs are (see xtask/peers/mpi.py).
        buf = np.full(max(1, size // 4), 1.0, dtype=np.float32)
        for _ in range(50):
            COMM.Bcast(buf, root=0)
        COMM.Barrier()
        own = np.zeros(iters)
        for i in range(iters):
            start = time.perf_counter()
            COMM.Bcast(buf, root=0)
            own[i] = time.perf_counter() - start
        worst = own.copy()
        COMM.Allreduce(MPI.IN_PLACE, worst, op=MPI.MAX)
        us = np.sort(own) * 1e6
        line = (
            f"rank {rank} {size:>6} B, {iters} iterations: own p10 {us[iters // 10]:.1f} "
            f"median {np.median(us):.1f} p90 {us[iters * 9 // 10]:.1f} mean {us.mean():.1f} us"
        )
        # Rank by rank, so that the lines do not interleave.
        for r in range(COMM.Get_size()):
            if r == rank:
                print(line, flush=True)
            COMM.Barrier()
        if rank == 0:
            print(
                f"  max over ranks: median {np.median(worst) * 1e6:.1f} mean {worst.mean() * 1e6:.1f} us",
                flush=True,
            )
        COMM.Barrier()


if __name__ == "__main__":
    main()

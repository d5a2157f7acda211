"""torch.distributed's NCCL all_reduce on one rank per GPU, timed as dist-nccl's nccl_perf
times ours: 5 warm-ups, then 20 calls enqueued back to back and one synchronize; prints
microseconds per call for 8 B to 256 MiB (factor 8). Run by xtask/device/gpu.sh."""
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device(f"cuda:{rank}"))
    if rank == 0:
        print(f"torch {torch.__version__} nccl {torch.cuda.nccl.version()} on {world} GPU(s)")
    size = 8
    while size <= 256 << 20:
        x = torch.ones(size // 4, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        us = (time.perf_counter() - t) / 20 * 1e6
        if rank == 0:
            print(f"torch all_reduce {size:>12} B {us:10.2f} us")
        size *= 8
    dist.destroy_process_group()


if __name__ == "__main__":
    n = torch.cuda.device_count()
    mp.spawn(rank_main, args=(n,), nprocs=n)

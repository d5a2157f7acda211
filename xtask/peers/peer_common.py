"""What both peer benchmarks share: sizes, bandwidth formulas, timing loop and JSON output.

The conventions are nccl-tests' and match `cargo xtask bench` exactly, so that one table can
hold both sides:

* size S is bytes per rank; all_gather's output and reduce_scatter's input are n*S;
  all_to_all sends S in total from each rank (S/n to every rank, itself included);
* algbw = bytes moved / time; busbw = algbw * 2(n-1)/n for all_reduce, (n-1)/n for
  all_gather, reduce_scatter and all_to_all, 1 for broadcast;
* each iteration is timed on every rank; the iteration's time is the max over ranks; the
  figure reported is the median of those maxima. 1 GB = 1e9 bytes.
"""
import json
import statistics
import time

LATENCY_OPS = ("barrier", "allreduce_4B")
BUS_FACTOR = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def moved_bytes(op, size, n):
    """Bytes the op's algbw is computed from."""
    if op in ("all_gather", "reduce_scatter"):
        return size * n
    return {"allreduce_4B": 4, "barrier": 0}.get(op, size)


def count_iters(estimate_s, budget_s, lo=5, hi=2000):
    """Enough iterations to fill the time budget, within [lo, hi]."""
    if estimate_s <= 0:
        return hi
    return int(max(lo, min(hi, budget_s / estimate_s)))


def measure(fn, size, barrier, max_over_ranks, budget_s, fresh=None):
    """Warms up, estimates one call's time, then times `count_iters` calls; returns the
    per-iteration maxima over ranks (seconds). `fresh`, where given, is called before each
    timed call, outside its time (`--fresh`: the input written as a training step writes it)."""
    big = size >= 16 << 20
    for _ in range(2 if big else 10):
        fn()
    barrier()
    k = 2 if big else 20
    start = time.perf_counter()
    for _ in range(k):
        fn()
    estimate = max_over_ranks([(time.perf_counter() - start) / k])[0]
    times = [0.0] * count_iters(estimate, budget_s)
    barrier()
    for i in range(len(times)):
        if fresh is not None:
            fresh()
        start = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - start
    return max_over_ranks(times)


def rewriter(buf, touch):
    """`--fresh`: a call that writes one float32 of each 64-byte cache line of `buf` with the
    value it holds (`touch` writes a strided view in place), so that its lines are dirty in this
    core's cache, as a training step leaves the gradients it then reduces. None for no buffer."""
    if buf is None:
        return None
    lines = buf[::16]
    return lambda: touch(lines)


def row(op, size, n, times, note):
    """One result in the JSON schema `cargo xtask bench` reads."""
    median = statistics.median(times)
    moved = moved_bytes(op, size, n)
    algbw = moved / median / 1e9 if moved and median > 0 else None
    factor = BUS_FACTOR.get(op)
    return {
        "op": op,
        "bytes_per_rank": size,
        "total_bytes": moved,
        "iters": len(times),
        "median_us": median * 1e6,
        "min_us": min(times) * 1e6,
        "mean_us": sum(times) / len(times) * 1e6,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * factor(n) if algbw is not None and factor else None,
        "note": note,
    }


def unsupported(op, size, why):
    return {"op": op, "bytes_per_rank": size, "unsupported": True, "note": why}


def show(r):
    if r.get("unsupported"):
        print(f"  {r['op']:<15} {r['bytes_per_rank']:>10}  unsupported: {r['note']}", flush=True)
        return
    bw = "" if r["busbw_GBps"] is None else f"  busbw {r['busbw_GBps']:.3f} GB/s"
    print(f"  {r['op']:<15} {r['bytes_per_rank']:>10}  {r['iters']:5d} iters"
          f"  median {r['median_us']:10.1f} us{bw}  ({r['note']})", flush=True)


def plan(ops, sizes):
    """(op, size) pairs in the order both sides run them: latency ops first."""
    out = [(op, 4 if op == "allreduce_4B" else 0) for op in ops if op in LATENCY_OPS]
    out += [(op, s) for op in ops if op not in LATENCY_OPS for s in sizes]
    return out


def save(path, meta, results):
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


def split_list(text, cast=str):
    return [cast(x) for x in text.split(",") if x]

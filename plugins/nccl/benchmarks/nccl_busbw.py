"""Bus bandwidth of pluribus collectives on the NCCL backend, 1 KiB to 1 GiB, like nccl-tests.

pluribus-bench measures numpy buffers; this script does the same on cupy buffers, one rank per
GPU (spawned processes, GPU = rank), with nccl-tests' definitions (from ``pluribus.bench``):
size is the per-rank buffer for all_reduce/broadcast/reduce and the whole gathered or scattered
buffer for all_gather/reduce_scatter; time is per operation, measured with CUDA events on the
caller's stream over back-to-back synchronous calls, the slowest rank counting; algbw =
size/time; busbw = algbw x bus factor; #wrong counts elements that differ from numpy's result.

    python plugins/nccl/benchmarks/nccl_busbw.py                      # every GPU, all_reduce
    python plugins/nccl/benchmarks/nccl_busbw.py --nproc 2 -C all_reduce,all_gather -e 256M
    python plugins/nccl/benchmarks/nccl_busbw.py --json busbw.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import pluribus as dist
from pluribus.bench import bus_factor, parse_size
from pluribus.bench.core import format_size, size_series

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


def _rank_value(rank: int) -> float:
    return float(rank % 4 + 1)  # exact in float32 sums for any realistic world


def measure(collective: str, nbytes: int, iters: int, warmup: int) -> dict:
    """Runs on every rank: time ``iters`` calls of ``collective`` on ``nbytes`` of float32."""
    import cupy

    rank, size = dist.get_rank(), dist.get_world_size()
    itemsize = 4
    if collective in ("all_gather", "reduce_scatter"):
        count = max(1, nbytes // itemsize // size)  # per-rank block; size = whole buffer
        total = count * size
    else:
        count = total = max(1, nbytes // itemsize)
    mine = cupy.full(
        count if collective != "reduce_scatter" else total, _rank_value(rank), np.float32
    )
    out = cupy.empty(total if collective == "all_gather" else count, np.float32)

    def once(check: bool) -> int:
        if collective == "all_reduce":
            buf = mine.copy() if check else mine
            dist.all_reduce(buf)
            expected = np.full(count, sum(_rank_value(r) for r in range(size)), np.float32)
            result = buf
        elif collective == "broadcast":
            buf = mine.copy() if check else mine
            dist.broadcast(buf, src=0)
            expected, result = np.full(count, _rank_value(0), np.float32), buf
        elif collective == "reduce":
            buf = mine.copy() if check else mine
            dist.reduce(buf, dst=0)
            expected = np.full(
                count,
                sum(_rank_value(r) for r in range(size)) if rank == 0 else _rank_value(rank),
                np.float32,
            )
            result = buf
        elif collective == "all_gather":
            dist.all_gather_into_tensor(out, mine)
            expected = np.repeat([_rank_value(r) for r in range(size)], count).astype(np.float32)
            result = out
        else:
            dist.reduce_scatter_tensor(out, mine)
            expected = np.full(count, sum(_rank_value(r) for r in range(size)), np.float32)
            result = out
        if not check:
            return 0
        return int(np.count_nonzero(cupy.asnumpy(result) != expected))

    wrong = once(check=True)
    for _ in range(warmup):
        once(check=False)
    stream = cupy.cuda.get_current_stream()
    stream.synchronize()
    dist.barrier()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(iters):
        once(check=False)
    end.record(stream)
    end.synchronize()
    seconds = cupy.cuda.get_elapsed_time(start, end) / 1000.0 / iters
    return {"seconds": seconds, "wrong": wrong, "bytes": total * itemsize, "count": total}


def run_size(collective: str, nbytes: int, iters: int, warmup: int) -> list[dict]:
    return [measure(collective, nbytes, iters, warmup)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-b", "--min-bytes", default="1K")
    p.add_argument("-e", "--max-bytes", default="1G")
    p.add_argument("-f", "--step-factor", type=float, default=2.0)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument(
        "-C",
        "--collectives",
        default="all_reduce",
        help=f"comma-separated, from {', '.join(COLLECTIVES)}, or all",
    )
    p.add_argument("--nproc", type=int, default=0, help="ranks (default: every visible GPU)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)

    status = dist.availability("nccl")
    if not status.ok:
        print(f"nccl is not available: {status.reason}\n  to fix: {status.remedy}", file=sys.stderr)
        return 2
    nproc = args.nproc or int(status.details.get("devices", 1))
    names = COLLECTIVES if args.collectives == "all" else tuple(args.collectives.split(","))
    sizes = size_series(parse_size(args.min_bytes), parse_size(args.max_bytes), args.step_factor)
    print(f"# pluribus nccl busbw: {nproc} rank(s), one GPU each; {status.version}")
    print(
        f"# {'collective':>14} {'size':>10} {'count':>12} {'time(us)':>10} "
        f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7}"
    )
    rows = []
    from pluribus.testing.harness import RankPool

    with RankPool(nproc, backend="nccl", mode="processes", timeout=600) as pool:
        for name in names:
            for nbytes in sizes:
                per_rank = [r[0] for r in pool.run(run_size, name, nbytes, args.iters, args.warmup)]
                seconds = max(r["seconds"] for r in per_rank)
                wrong = sum(r["wrong"] for r in per_rank)
                algbw = per_rank[0]["bytes"] / seconds / 1e9
                busbw = algbw * bus_factor(name, nproc)
                row = {
                    "collective": name,
                    "bytes": per_rank[0]["bytes"],
                    "count": per_rank[0]["count"],
                    "time_us": seconds * 1e6,
                    "algbw_GBps": algbw,
                    "busbw_GBps": busbw,
                    "wrong": wrong,
                    "nranks": nproc,
                }
                rows.append(row)
                print(
                    f"  {name:>14} {format_size(row['bytes']):>10} {row['count']:>12} "
                    f"{row['time_us']:>10.1f} {algbw:>12.2f} {busbw:>12.2f} {wrong:>7}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"nranks": nproc, "version": status.version, "time": time.time(), "rows": rows},
                fh,
                indent=1,
            )
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

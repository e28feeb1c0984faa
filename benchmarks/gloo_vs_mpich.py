"""pluribus gloo against MPICH in the same processes, alternating every few calls, so that both
see the same machine at the same moment.

``pluribus.bench --compare mpi4py`` runs each implementation's whole size sweep in turn; on a
machine shared with other work the load moves between those phases, and a same-run ratio can be
off by 2-3x at any size. Here every rank holds both a pluribus gloo group and ``MPI.COMM_WORLD``,
and for each size the two take turns in batches of ``--batch`` calls (``--batches`` of each).
Printed per size: the median of each implementation's batch means, their ratio (MPICH's time /
ours, i.e. busbw ours / MPICH's: above 1, we are faster), and the median of the ratios of the
batch pairs (each pair ran back to back). Each time is the slowest rank's, as in pluribus.bench.

    mpiexec -n 2 python benchmarks/gloo_vs_mpich.py -C all_reduce -b 256K -e 64M
    mpiexec -n 2 python benchmarks/gloo_vs_mpich.py -C reduce_scatter,all_gather,broadcast \
        -b 1M -e 16M -f 16

Sizes follow nccl-tests (the whole gathered or scattered buffer); float32, sum.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import numpy as np
import pluribus as pb
from mpi4py import MPI
from pluribus.bench.core import parse_size, size_series


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _calls(collective: str, nbytes: int, p: int, r: int):
    """(ours, MPICH's) for one size: each does one collective on its own buffers."""
    comm = MPI.COMM_WORLD
    n = nbytes // 4
    if collective == "all_reduce":
        a, b = np.zeros(n, np.float32), np.zeros(n, np.float32)  # zeros: sums never overflow
        return (
            lambda: pb.all_reduce(a, pb.ReduceOp.SUM),
            lambda: comm.Allreduce(MPI.IN_PLACE, b, MPI.SUM),
        )
    if collective == "broadcast":
        a, b = np.zeros(n, np.float32), np.zeros(n, np.float32)
        return lambda: pb.broadcast(a, 0), lambda: comm.Bcast(b, 0)
    per = n // p
    if collective == "all_gather":
        src, out, out2 = np.zeros(per, np.float32), np.empty(n, np.float32), np.empty(n, np.float32)
        return lambda: pb.all_gather(out, src), lambda: comm.Allgather(src, out2)
    if collective == "reduce_scatter":
        src, out = np.zeros(n, np.float32), np.empty(per, np.float32)
        return (
            lambda: pb.reduce_scatter(out, src, pb.ReduceOp.SUM),
            lambda: comm.Reduce_scatter_block(src, out, MPI.SUM),
        )
    raise ValueError(f"unknown collective {collective!r}")


def _batch(call, iters: int) -> float:
    """Seconds per call, slowest rank, after lining the ranks up with an MPI barrier."""
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    mine = (time.perf_counter() - start) / iters
    return MPI.COMM_WORLD.allreduce(mine, op=MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-C", "--collectives", default="all_reduce")
    parser.add_argument("-b", "--min-bytes", default="256K")
    parser.add_argument("-e", "--max-bytes", default="64M")
    parser.add_argument("-f", "--step-factor", type=float, default=2)
    parser.add_argument("--batch", type=int, default=5, help="calls per batch")
    parser.add_argument("--batches", type=int, default=9, help="batches of each per size")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    r, p = comm.Get_rank(), comm.Get_size()
    port = comm.bcast(_free_port() if r == 0 else None, root=0)
    pb.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=r, world_size=p)
    if r == 0:
        print(f"# {p} ranks, float32 sum; load before {os.getloadavg()}")
        print(
            f"# {'collective':>14} {'bytes':>10} {'ours us':>10} {'MPICH us':>10} "
            f"{'bw ratio':>8} {'pairs':>6}"
        )
    sizes = size_series(parse_size(args.min_bytes), parse_size(args.max_bytes), args.step_factor)
    for collective in args.collectives.split(","):
        for nbytes in sizes:
            ours, theirs = _calls(collective, nbytes, p, r)
            for call in (ours, theirs):  # warm up: pages, the arena, MPICH's buffers
                _batch(call, 2)
            pairs = [
                (_batch(ours, args.batch), _batch(theirs, args.batch)) for _ in range(args.batches)
            ]
            a = float(np.median([x for x, _ in pairs]))
            b = float(np.median([y for _, y in pairs]))
            paired = float(np.median([y / x for x, y in pairs]))
            if r == 0:
                print(
                    f"  {collective:>14} {nbytes:>10} {a * 1e6:>10.1f} {b * 1e6:>10.1f} "
                    f"{b / a:>8.2f} {paired:>6.2f}"
                )
    if r == 0:
        print(f"# load after {os.getloadavg()}")
    pb.destroy_process_group()


if __name__ == "__main__":
    main()

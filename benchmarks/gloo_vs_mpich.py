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
    mpiexec -n 2 python benchmarks/gloo_vs_mpich.py -C all_reduce -b 256K -e 64M --symmetric
    mpiexec -n 2 python benchmarks/gloo_vs_mpich.py -C reduce_scatter,all_gather,broadcast \
        -b 1M -e 16M -f 16

Sizes follow nccl-tests (the whole gathered or scattered buffer); float32, sum.

``--groups G`` runs every collective on sub-groups instead of the world: the ranks split into G
groups of consecutive ranks (``--strided``: rank r in group r % G, as a 2-D mesh's other
dimension), ``pluribus.new_group`` against ``MPI.COMM_WORLD.Split``, all G groups at once.
``--groups 1`` is a sub-group of every rank, which shows what a sub-group costs over the world.

    mpiexec -n 4 python benchmarks/gloo_vs_mpich.py -C all_reduce -b 256 -e 64M -f 4 --groups 2

``--symmetric`` (all-reduce only) adds a third implementation to each batch rotation: pluribus
on an array from ``pluribus.empty_symmetric``, which gloo reduces on one host without copying
it into its segment first, printed beside the plain array's time with its ratio to MPICH.
Memory traffic per byte of the array, per rank, at ``p`` ranks (a model: bytes read plus bytes
written, the arithmetic free). The copying path copies the ``(p-1)/p`` it does not reduce into
its slot (2(p-1)/p), reduces its part out of ``p`` sources into its slot (1 + 1/p), copies that
part into the array while it is in cache (1/p, the write) and the peers' parts out of their
slots (2(p-1)/p): 4 at 2 ranks, 4.5 at 4. The symmetric path only reduces (1 + 1/p, into the array
itself) and copies the peers' parts out of their arrays (2(p-1)/p): 2.5 at 2 ranks, 2.75 at
4. MPICH's single-copy all-reduce is about 3.5.
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


def _groups(count: int, strided: bool):
    """This rank's (pluribus group, MPI communicator, the group's first global rank): the
    world's (None: the default group), or with ``count`` its sub-group of ``count`` equal ones
    (see the module's docstring)."""
    comm = MPI.COMM_WORLD
    if not count:
        return None, comm, 0
    r, p = comm.Get_rank(), comm.Get_size()
    if p % count:
        raise ValueError(f"--groups {count} does not divide {p} ranks")
    size = p // count
    members = [
        [k for k in range(p) if k % count == g]
        if strided
        else list(range(g * size, (g + 1) * size))
        for g in range(count)
    ]
    mine, first = None, 0
    for ranks in members:  # every rank makes every group, in the same order
        made = pb.new_group(ranks)
        if r in ranks:
            mine, first = made, ranks[0]
    color = r % count if strided else r // size
    return mine, comm.Split(color, r), first


def _calls(collective: str, nbytes: int, group, comm, root: int, symmetric: bool):
    """(ours, MPICH's), or with ``symmetric`` (ours, ours on a symmetric array, MPICH's), for
    one size on ``group`` and ``comm`` (the same ranks, whose first is global rank ``root``):
    each does one collective on its own buffers."""
    n = nbytes // 4
    if collective == "all_reduce":
        a, b = np.zeros(n, np.float32), np.zeros(n, np.float32)  # zeros: sums never overflow
        calls = [
            lambda: pb.all_reduce(a, pb.ReduceOp.SUM, group),
            lambda: comm.Allreduce(MPI.IN_PLACE, b, MPI.SUM),
        ]
        if symmetric:
            shared = pb.empty_symmetric(n, np.float32, group=group)
            shared[...] = 0
            calls.insert(1, lambda: pb.all_reduce(shared, pb.ReduceOp.SUM, group))
        return calls
    if symmetric:
        raise ValueError("--symmetric measures all_reduce only")
    if collective == "broadcast":
        a, b = np.zeros(n, np.float32), np.zeros(n, np.float32)
        return lambda: pb.broadcast(a, root, group), lambda: comm.Bcast(b, 0)
    per = n // comm.Get_size()
    if collective == "all_gather":
        src, out, out2 = np.zeros(per, np.float32), np.empty(n, np.float32), np.empty(n, np.float32)
        return lambda: pb.all_gather(out, src, group), lambda: comm.Allgather(src, out2)
    if collective == "reduce_scatter":
        src, out = np.zeros(n, np.float32), np.empty(per, np.float32)
        return (
            lambda: pb.reduce_scatter(out, src, pb.ReduceOp.SUM, group),
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
    parser.add_argument(
        "--symmetric", action="store_true", help="also time all_reduce on empty_symmetric arrays"
    )
    parser.add_argument("--groups", type=int, default=0, help="run on this many sub-groups")
    parser.add_argument(
        "--strided", action="store_true", help="sub-groups of ranks r % G, not consecutive ranks"
    )
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    r, p = comm.Get_rank(), comm.Get_size()
    port = comm.bcast(_free_port() if r == 0 else None, root=0)
    pb.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=r, world_size=p)
    group, sub, root = _groups(args.groups, args.strided)
    if r == 0:
        where = ""
        if args.groups:
            how = "strided" if args.strided else "consecutive"
            where = f", {args.groups} {how} sub-groups of {sub.Get_size()} at once"
        print(f"# {p} ranks{where}, float32 sum; load before {os.getloadavg()}")
        shared = f" {'sym us':>10} {'sym ratio':>9} {'pairs':>6}" if args.symmetric else ""
        print(
            f"# {'collective':>14} {'bytes':>10} {'ours us':>10} {'MPICH us':>10} "
            f"{'bw ratio':>8} {'pairs':>6}{shared}"
        )
    sizes = size_series(parse_size(args.min_bytes), parse_size(args.max_bytes), args.step_factor)
    for collective in args.collectives.split(","):
        for nbytes in sizes:
            calls = _calls(collective, nbytes, group, sub, root, args.symmetric)
            for call in calls:  # warm up: pages, the arena, MPICH's buffers
                _batch(call, 2)
            rows = [[_batch(c, args.batch) for c in calls] for _ in range(args.batches)]
            theirs = [row[-1] for row in rows]
            b = float(np.median(theirs))
            line = f"  {collective:>14} {nbytes:>10}"
            for i in range(len(calls) - 1):
                ours = [row[i] for row in rows]
                a = float(np.median(ours))
                paired = float(np.median([y / x for x, y in zip(ours, theirs, strict=True)]))
                if i == 0:
                    line += f" {a * 1e6:>10.1f} {b * 1e6:>10.1f} {b / a:>8.2f} {paired:>6.2f}"
                else:
                    line += f" {a * 1e6:>10.1f} {b / a:>9.2f} {paired:>6.2f}"
            if r == 0:
                print(line)
    if r == 0:
        print(f"# load after {os.getloadavg()}")
    pb.destroy_process_group()


if __name__ == "__main__":
    main()

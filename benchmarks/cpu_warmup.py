"""How long an idle CPU takes to reach its speed: a 256 KiB all-reduce on fresh gloo ranks,
timed in blocks of 100 calls from the first, with and without ``--spin-ms`` of numpy arithmetic
on every rank before the first call.

    python benchmarks/cpu_warmup.py                  # pluribus, 2 ranks, 0 and 200 ms, twice
    mpiexec -n 2 python benchmarks/cpu_warmup.py --mpi

Each line is one fresh set of ranks: the median µs of each block of 100 calls on rank 0. Where
the first blocks are slower than the last ones without the spin and not with it, a benchmark
that times a size right after a few warm-up calls measures the CPU's ramp, not the library
(``pluribus-bench --warmup-seconds``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

BLOCK = 100


def _spin(ms: float) -> None:
    x, y = np.ones(1 << 16, np.float32), np.empty(1 << 16, np.float32)
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        np.add(x, x, out=y)


def _blocks(call, calls: int) -> list[float]:
    times = np.empty(calls)
    for i in range(calls):
        start = time.perf_counter()
        call()
        times[i] = time.perf_counter() - start
    return [round(float(np.median(times[k : k + BLOCK])) * 1e6, 1) for k in range(0, calls, BLOCK)]


def _pluribus(kib: int, spin_ms: float, calls: int) -> list[float]:
    import pluribus as pb

    a = np.zeros(kib * 256, np.float32)
    pb.barrier()
    _spin(spin_ms)
    pb.barrier()
    return _blocks(lambda: pb.all_reduce(a), calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kib", type=int, default=256)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--spin-ms", default="0,200", help="comma-separated, one run each")
    parser.add_argument("--runs", type=int, default=2, help="runs of each spin")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--mpi", action="store_true", help="MPICH under mpiexec instead")
    args = parser.parse_args()
    spins = [float(s) for s in args.spin_ms.split(",")] * args.runs
    if args.mpi:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        for ms in spins:  # one process set: only the first run starts idle
            a = np.zeros(args.kib * 256, np.float32)
            comm.Barrier()
            _spin(ms)
            comm.Barrier()
            blocks = _blocks(lambda a=a: comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM), args.calls)
            if comm.Get_rank() == 0:
                print(f"mpich {args.kib} KiB, spin {ms:g} ms: {blocks}")
        return
    from pluribus.testing import run_ranks

    for ms in spins:
        blocks = run_ranks(_pluribus, args.nproc, backend="gloo", args=(args.kib, ms, args.calls))
        print(f"pluribus gloo {args.kib} KiB, spin {ms:g} ms: {blocks[0]}")


if __name__ == "__main__":
    main()

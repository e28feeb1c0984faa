"""float32 all-reduce, 4 B to 64 MiB, 2 ranks: pluribus on ucc (and gloo) against raw mpi4py.

Run it as a plain script (it starts the ranks itself)::

    python benchmarks/ucc_quick.py [--json out.json] [--passes 2] [--rounds 5] [--max-mib 64]

Raw MPI runs under the venv's ``mpiexec -n 2`` (MPICH wheel) as ``Allreduce(IN_PLACE)``; each
pluribus backend runs in two spawned processes of its own (``pluribus.testing.RankPool``), never
inside the MPI job: the MPICH wheel's libmpi carries UCX symbols of its own, and sharing a process
with it slows ucxx down (or, loaded first, keeps libucx from loading). The libraries take turns,
``--passes`` times, so that each sees the machine's load; per size the best pass counts.

For each size it reports time per call (slower rank), algbw and busbw as nccl-tests defines them
(busbw = algbw * 2(n-1)/n), and the CPU time per call of a ucc rank's calling thread, which a
shared machine does not inflate the way it inflates wall time. The goal: at >= 1 MiB, ucc's busbw
at least 0.8x MPICH's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

BUSBW_GOAL = 0.8
GOAL_FROM = 1 << 20
RANKS = 2


def sizes(max_bytes: int) -> list[int]:
    out, n = [], 4
    while n <= max_bytes:
        out.append(n)
        n *= 4
    return out


def calls_for(nbytes: int) -> int:
    """Calls per timed block: about 30 ms of work at 1 GB/s, between 3 and 1000."""
    return int(min(1000, max(3, 30e6 / max(nbytes, 1))))


def _time_all(run_call, barrier, slowest, all_sizes, rounds) -> dict:
    """{size: (best seconds per call, its CPU seconds per call)} on this rank."""
    out = {}
    for nbytes in all_sizes:
        x = np.ones(nbytes // 4, dtype=np.float32)
        calls = calls_for(nbytes)
        for _ in range(max(2, calls // 10)):
            run_call(x)
        best = None
        for _ in range(rounds):
            barrier()
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                run_call(x)
            wall = slowest(time.perf_counter() - wall) / calls
            cpu = slowest(time.thread_time() - cpu) / calls
            if best is None or wall < best[0]:
                best = (wall, cpu)
        out[nbytes] = best
    return out


def pluribus_rank(all_sizes, rounds) -> dict:
    """Runs on every rank of a RankPool."""
    import pluribus as pb

    def slowest(seconds: float) -> float:
        v = np.array([seconds])
        pb.all_reduce(v, pb.ReduceOp.MAX)
        return float(v[0])

    return _time_all(lambda x: pb.all_reduce(x), pb.barrier, slowest, all_sizes, rounds)


def mpi_rank(all_sizes, rounds) -> None:
    """Runs on every rank of the MPI job; rank 0 prints the times as JSON."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD

    def call(x):
        comm.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM)

    times = _time_all(
        call, comm.Barrier, lambda s: comm.allreduce(s, op=MPI.MAX), all_sizes, rounds
    )
    if comm.rank == 0:
        print("RESULT " + json.dumps({str(k): v for k, v in times.items()}), flush=True)


def run_mpi(all_sizes, rounds) -> dict:
    venv_bin = os.path.dirname(sys.executable)
    mpiexec = os.path.join(venv_bin, "mpiexec")
    command = [mpiexec, "-n", str(RANKS), sys.executable, __file__, "--mpi-worker"]
    command += ["--rounds", str(rounds), "--max-bytes", str(all_sizes[-1])]
    out = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return {int(k): tuple(v) for k, v in json.loads(line[len("RESULT ") :]).items()}


def run_pluribus(backend, all_sizes, rounds, options) -> dict:
    from pluribus.testing import RankPool

    with RankPool(RANKS, backend, "processes", timeout=600, backend_options=options) as pool:
        return pool.run(pluribus_rank, all_sizes, rounds)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-mib", type=int, default=64)
    parser.add_argument("--max-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backends", default="ucc,gloo")
    parser.add_argument("--ucc-options", default="{}", help='JSON, e.g. {"ucc_spin_us": 0}')
    parser.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    all_sizes = sizes(args.max_bytes or args.max_mib << 20)
    if args.mpi_worker:
        mpi_rank(all_sizes, args.rounds)
        return 0

    import pluribus as pb

    backends = [b for b in args.backends.split(",") if pb.is_available(b)]
    libraries = ["mpi"] + backends
    best: dict[str, dict[int, tuple[float, float]]] = {lib: {} for lib in libraries}
    for _ in range(args.passes):
        for lib in libraries:
            if lib == "mpi":
                got = run_mpi(all_sizes, args.rounds)
            else:
                options = json.loads(args.ucc_options) if lib == "ucc" else None
                got = run_pluribus(lib, all_sizes, args.rounds, options)
            for n, value in got.items():
                if n not in best[lib] or value[0] < best[lib][n][0]:
                    best[lib][n] = value

    factor = 2 * (RANKS - 1) / RANKS
    rows = []
    for n in all_sizes:
        row = {"bytes": n}
        for lib in libraries:
            wall, cpu = best[lib][n]
            row[f"{lib}_us"] = wall * 1e6
            row[f"{lib}_busbw_GBps"] = n / wall * factor / 1e9
            row[f"{lib}_cpu_us"] = cpu * 1e6
        if "ucc" in libraries:
            row["ucc_vs_mpi_busbw"] = row["ucc_busbw_GBps"] / row["mpi_busbw_GBps"]
            if n >= GOAL_FROM:
                row["ok"] = row["ucc_vs_mpi_busbw"] >= BUSBW_GOAL
        rows.append(row)

    print(f"float32 all_reduce, {RANKS} ranks, best of {args.passes} passes x {args.rounds} rounds")
    print(f"load average now: {os.getloadavg()[0]:.1f} (on {os.cpu_count()} CPUs)")
    head = f"{'bytes':>10}" + "".join(
        f" {lib + ' us':>10} {lib + ' GB/s':>10}" for lib in libraries
    )
    print(head + (f" {'ucc cpu us':>10}  ucc/mpi busbw" if "ucc" in libraries else ""))
    for row in rows:
        line = f"{row['bytes']:>10}" + "".join(
            f" {row[lib + '_us']:>10.1f} {row[lib + '_busbw_GBps']:>10.3f}" for lib in libraries
        )
        if "ucc" in libraries:
            line += f" {row['ucc_cpu_us']:>10.1f}  {row['ucc_vs_mpi_busbw']:.2f}x"
            if "ok" in row:
                line += "  ok" if row["ok"] else "  below goal"
        print(line)
    if "ucc" in libraries:
        big = [r["ucc_vs_mpi_busbw"] for r in rows if r["bytes"] >= GOAL_FROM]
        if big:
            print(f"ucc/mpi busbw at >= 1 MiB: median {statistics.median(big):.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": RANKS, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

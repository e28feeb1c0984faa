"""pluribus ``all_reduce`` on the mpi backend against raw mpi4py ``Allreduce``, same buffers.

Run with two ranks::

    mpiexec -n 2 python benchmarks/mpi_vs_raw.py [--json out.json] [--breakdown]

For each size from 4 B to 64 MiB (float32, SUM) it times blocks of raw ``Allreduce(IN_PLACE)``
and of ``pluribus.all_reduce`` alternately, several rounds, and reports per call the best block
(the least disturbed by other load on a shared machine; the goals are judged on it) and the
median block of each, the ratio and the difference. The goals: at >= 64 KiB at most 1.10x raw;
at <= 4 KiB at most raw + 20 us. ``--breakdown`` also measures the CPU time of each piece of
pluribus's dispatch path on one rank (CPU time, so other load does not inflate it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

SIZES = [4 << (2 * i) for i in range(13)]  # 4 B, 16 B, ..., 64 MiB
RATIO_GOAL = 1.10
RATIO_FROM = 64 << 10
OVERHEAD_GOAL_US = 20.0
OVERHEAD_UP_TO = 4 << 10


def _calls_for(nbytes: int) -> int:
    """Calls per timed block: about 10 ms of work at 1.5 GB/s, at least 3 calls."""
    return int(min(1000, max(3, 10e6 / max(nbytes, 1) / 1.5)))


def time_block(comm, fn, calls: int) -> float:
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    # The slower rank decides the time a collective took.
    return comm.allreduce(elapsed, op=MPI.MAX) / calls


def measure(comm, rounds: int) -> list[dict]:
    import pluribus as pb

    rows = []
    for nbytes in SIZES:
        x = np.ones(max(nbytes // 4, 1), dtype=np.float32)

        def raw(x=x):
            comm.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM)

        def plur(x=x):
            pb.all_reduce(x)

        calls = _calls_for(nbytes)
        for fn in (raw, plur):  # warm up both paths
            time_block(comm, fn, max(2, calls // 10))
        raw_times, plur_times = [], []
        for _ in range(rounds):
            raw_times.append(time_block(comm, raw, calls))
            plur_times.append(time_block(comm, plur, calls))
        raw_us, plur_us = min(raw_times) * 1e6, min(plur_times) * 1e6
        raw_median = statistics.median(raw_times) * 1e6
        plur_median = statistics.median(plur_times) * 1e6
        row = {
            "bytes": nbytes,
            "calls": calls,
            "raw_us": raw_us,
            "pluribus_us": plur_us,
            "ratio": plur_us / raw_us,
            "overhead_us": plur_us - raw_us,
            "raw_median_us": raw_median,
            "pluribus_median_us": plur_median,
            "median_ratio": plur_median / raw_median,
        }
        if nbytes >= RATIO_FROM:
            row["goal"] = f"<= {RATIO_GOAL:.2f}x"
            row["ok"] = row["ratio"] <= RATIO_GOAL
        elif nbytes <= OVERHEAD_UP_TO:
            row["goal"] = f"<= raw + {OVERHEAD_GOAL_US:.0f} us"
            row["ok"] = row["overhead_us"] <= OVERHEAD_GOAL_US
        rows.append(row)
        if comm.Get_rank() == 0:
            print(_format(row), flush=True)
    return rows


def _format(row: dict) -> str:
    verdict = "" if "ok" not in row else ("ok  " if row["ok"] else "MISS") + f" ({row['goal']})"
    return (
        f"{_human(row['bytes']):>8} {row['raw_us']:11.1f} {row['pluribus_us']:11.1f} "
        f"{row['ratio']:6.2f}x {row['overhead_us']:+9.1f} | {row['raw_median_us']:11.1f} "
        f"{row['pluribus_median_us']:11.1f} {row['median_ratio']:6.2f}x  {verdict}"
    )


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024 or unit == "MiB":
            return f"{nbytes}{unit}" if unit == "B" else f"{nbytes:g}{unit}"
        nbytes /= 1024
    return str(nbytes)


def breakdown(calls: int = 20000) -> dict[str, float]:
    """Microseconds per call of each piece of the dispatch path, on this rank alone (4 bytes)."""
    import pluribus as pb
    from pluribus import distributed

    group = pb.get_default_group()
    x = np.ones(1, dtype=np.float32)
    hook = pb.get_plugin_manager().hook
    op = pb.ReduceOp.SUM
    self_comm = MPI.COMM_SELF

    def per_call(fn) -> float:
        """Least CPU time per call over 5 runs (thread CPU time: other load does not count)."""
        for _ in range(100):
            fn()
        best = float("inf")
        for _ in range(5):
            start = time.thread_time()
            for _ in range(calls // 5):
                fn()
            best = min(best, (time.thread_time() - start) / (calls // 5) * 1e6)
        return best

    # Everything on a one-rank MPI group (a COMM_SELF duplicate), so no peer's timing counts.
    from pluribus_mpi.backend import MPIBackend

    solo = MPIBackend(self_comm.Dup(), 60.0, False, "breakdown")
    solo_group = pb.ProcessGroup("breakdown", [0], 0, {"cpu": solo}, 60.0, group.store)
    manager = pb.get_plugin_manager()
    wrappers = [
        impl.plugin
        for impl in hook.pluribus_all_reduce.get_hookimpls()
        if impl.opts.get("wrapper") or impl.opts.get("hookwrapper")
    ]
    unwrapped = manager.subset_hook_caller("pluribus_all_reduce", remove_plugins=wrappers)
    backend_direct = solo.all_reduce
    group_direct = solo_group.direct("all_reduce", "cpu")  # None while a wrapper is registered

    def raw_blocking():
        self_comm.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM)

    pieces = {
        "MPI: Allreduce (the floor)": per_call(raw_blocking),
        "plugin: the backend's all_reduce": per_call(lambda: backend_direct(x, op)),
        "core: pb.all_reduce (checks + direct, or the hook chain under wrappers)": per_call(
            lambda: pb.all_reduce(x, group=solo_group)
        ),
        "core: argument checks (after the first call)": per_call(
            lambda: distributed._check_reduction(solo_group, x, op, "array")
        ),
        "per-call hook chain, no wrappers (async path)": per_call(
            lambda: unwrapped(group=solo_group, array=x, op=op, async_op=False)
        ),
        "per-call hook chain, with the wrappers": per_call(
            lambda: hook.pluribus_all_reduce(group=solo_group, array=x, op=op, async_op=False)
        ),
    }
    if group_direct is not None:
        pieces["core: the group's direct all_reduce (no wrappers)"] = per_call(
            lambda: group_direct(x, op)
        )
    solo.close()
    pieces["wrappers"] = [manager.get_name(w) for w in wrappers]  # type: ignore[assignment]
    return pieces


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds per size")
    parser.add_argument("--json", help="write the results here (rank 0)")
    parser.add_argument("--breakdown", action="store_true", help="time the dispatch path too")
    args = parser.parse_args(argv)

    import pluribus as pb
    import pluribus_mpi

    pluribus_mpi.setup_env()
    pb.init_process_group("mpi")
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        print(f"# {MPI.Get_library_version().splitlines()[0].strip()}; {size} ranks; float32 SUM")
        impls = pb.get_plugin_manager().hook.pluribus_all_reduce.get_hookimpls()
        print(f"# implementations of pluribus_all_reduce: {[i.plugin_name for i in impls]}")
        direct = pb.get_default_group().direct("all_reduce", "cpu")
        print(f"# the default group's direct all_reduce: {getattr(direct, '__qualname__', direct)}")
        print(
            f"{'':8} {'best block, per call':^40} | {'median block, per call':^32}\n"
            f"{'size':>8} {'raw us':>11} {'pluribus us':>11} {'ratio':>7} {'diff us':>9} | "
            f"{'raw us':>11} {'pluribus us':>11} {'ratio':>7}  goal (on best)"
        )
    rows = measure(comm, args.rounds)
    result = {"ranks": size, "library": MPI.Get_library_version().splitlines()[0], "rows": rows}
    if args.breakdown:
        pieces = breakdown()
        if rank == 0:
            print("# dispatch path, microseconds per call (one rank, 4 bytes):")
            for name, value in pieces.items():
                print(f"#   {name:45s} {value if isinstance(value, list) else f'{value:7.2f}'}")
        result["breakdown"] = pieces
    missed = [r for r in rows if r.get("ok") is False]
    if rank == 0:
        print(f"# {len(missed)} of {sum('ok' in r for r in rows)} goals missed")
        if args.json:
            with open(args.json, "w") as out:
                json.dump(result, out, indent=2)
    pb.destroy_process_group()
    return 1 if missed else 0


if __name__ == "__main__":
    from mpi4py import MPI

    sys.exit(main())

"""What ucc's default call check costs: a 4 KiB float32 all_reduce (and broadcast) with the
signature check on against off, in the same run, taking turns.

    python benchmarks/ucc_check_cost.py [--ranks 2] [--rounds 7] [--calls 2000] [--bytes 4096]

Each round times ``--calls`` calls per setting in two spawned ranks (``pluribus.testing.RankPool``)
and keeps the slower rank's median per-call wall time and CPU time of the calling thread (which
a loaded machine inflates less); the report is the median over rounds of the on/off ratios (the
machine is shared, so only ratios measured side by side mean anything).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pluribus as pb
from pluribus.testing import RankPool


def _time_calls(name: str, nbytes: int, calls: int) -> float:
    x = np.zeros(nbytes // 4, np.float32)
    call = (lambda: pb.all_reduce(x)) if name == "all_reduce" else (lambda: pb.broadcast(x, 0))
    for _ in range(50):
        call()
    pb.barrier()
    samples, cpu = [], []
    for _ in range(calls // 50):
        start, start_cpu = time.perf_counter(), time.thread_time()
        for _ in range(50):
            call()
        samples.append((time.perf_counter() - start) / 50)
        cpu.append((time.thread_time() - start_cpu) / 50)
    return statistics.median(samples), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--bytes", type=int, default=4096)
    args = parser.parse_args()
    pools = {
        on: RankPool(args.ranks, "ucc", "processes", 120, None, {"ucc_check_calls": on})
        for on in (True, False)
    }
    try:
        for name in ("all_reduce", "broadcast"):
            ratios, cpu_ratios = [], []
            times = {True: [], False: []}
            cpus = {True: [], False: []}
            for turn in range(args.rounds):
                got, got_cpu = {}, {}
                for on in (False, True) if turn % 2 else (True, False):
                    per_rank = pools[on].run(_time_calls, name, args.bytes, args.calls)
                    got[on] = max(wall for wall, _ in per_rank)
                    got_cpu[on] = max(cpu for _, cpu in per_rank)
                    times[on].append(got[on])
                    cpus[on].append(got_cpu[on])
                ratios.append(got[True] / got[False])
                cpu_ratios.append(got_cpu[True] / got_cpu[False])
            print(
                f"{name} {args.bytes} B, {args.ranks} ranks: wall per call on "
                f"{statistics.median(times[True]) * 1e6:.1f} us, off "
                f"{statistics.median(times[False]) * 1e6:.1f} us (on/off median "
                f"{statistics.median(ratios):.3f}); CPU of the calling thread per call on "
                f"{statistics.median(cpus[True]) * 1e6:.1f} us, off "
                f"{statistics.median(cpus[False]) * 1e6:.1f} us (on/off median "
                f"{statistics.median(cpu_ratios):.3f})"
            )
    finally:
        for pool in pools.values():
            pool.close()


if __name__ == "__main__":
    main()

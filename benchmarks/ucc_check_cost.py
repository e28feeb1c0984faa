"""What ucc's default call check costs: a 4 KiB float32 all_reduce (and broadcast) with the
signature check on against off, in the same run, taking turns.

    python benchmarks/ucc_check_cost.py [--ranks 2] [--rounds 7] [--calls 2000] [--bytes 4096]

Each round times ``--calls`` calls per setting in two spawned ranks (``pluribus.testing.RankPool``)
and keeps the slower rank's median per-call time; the report is the median over rounds of the
on/off ratio (the machine is shared, so only ratios measured side by side mean anything).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pluribus as pb
from pluribus.testing import RankPool


def _time_calls(name: str, nbytes: int, calls: int) -> float:
    x = np.ones(nbytes // 4, np.float32)
    call = (lambda: pb.all_reduce(x)) if name == "all_reduce" else (lambda: pb.broadcast(x, 0))
    for _ in range(50):
        call()
    pb.barrier()
    samples = []
    for _ in range(calls // 50):
        start = time.perf_counter()
        for _ in range(50):
            call()
        samples.append((time.perf_counter() - start) / 50)
    return statistics.median(samples)


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
            ratios, times = [], {True: [], False: []}
            for _ in range(args.rounds):
                got = {}
                for on in (False, True):
                    got[on] = max(pools[on].run(_time_calls, name, args.bytes, args.calls))
                    times[on].append(got[on])
                ratios.append(got[True] / got[False])
            print(
                f"{name} {args.bytes} B, {args.ranks} ranks: check on "
                f"{statistics.median(times[True]) * 1e6:.1f} us, off "
                f"{statistics.median(times[False]) * 1e6:.1f} us per call; on/off ratio median "
                f"{statistics.median(ratios):.3f} (rounds: {', '.join(f'{r:.3f}' for r in ratios)})"
            )
    finally:
        for pool in pools.values():
            pool.close()


if __name__ == "__main__":
    main()

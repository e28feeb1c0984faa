"""CPU time of one synchronous call of each collective on small float32 arrays (a threads world
of one, so the call is nearly all the core's own work: argument checks, dispatch, the flight
recorder) with the recorder off and on, in one process: what every call costs before any byte
moves, and what ``pluribus-run`` jobs, which switch the recorder on, pay for it.

    python benchmarks/recorder_cost.py
    PYTHONPATH=<old tree>/core/src python benchmarks/recorder_cost.py   # the same on other code
"""

from __future__ import annotations

import time

import numpy as np
import pluribus as pb
from pluribus.debug import flight_recorder
from pluribus.store import HashStore


def per_call(fn, calls: int = 5000, blocks: int = 20) -> float:
    """Best block's CPU microseconds per call (CPU time: other load does not inflate it)."""
    best = float("inf")
    for _ in range(blocks):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls * 1e6)
    return best


def calls() -> dict:
    x = np.ones(4, np.float32)
    out, whole, pieces = np.empty_like(x), np.empty(4, np.float32), [np.empty(4, np.float32)]
    return {
        "all_reduce": lambda: pb.all_reduce(x),
        "all_reduce out=": lambda: pb.all_reduce(x, out=out),
        "broadcast": lambda: pb.broadcast(x, 0),
        "all_gather": lambda: pb.all_gather(whole, x),
        "all_gather list": lambda: pb.all_gather(pieces, x),
        "reduce_scatter": lambda: pb.reduce_scatter(out, whole),
        "all_to_all": lambda: pb.all_to_all(pieces, [x]),
        "barrier": pb.barrier,
    }


def main() -> None:
    pb.init_process_group("threads", rank=0, world_size=1, store=HashStore())
    fns = calls()
    print(f"{'us CPU per call':>16}  " + "  ".join(f"{name:>15}" for name in fns))
    for size in (0, 256, 0, 256):
        flight_recorder.recorder.configure(size)
        row = "  ".join(f"{per_call(fn):15.2f}" for fn in fns.values())
        print(f"{'recorder on' if size else 'recorder off':>16}  {row}")
    flight_recorder.recorder.configure()
    pb.destroy_process_group()


if __name__ == "__main__":
    main()

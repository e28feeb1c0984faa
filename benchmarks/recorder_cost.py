"""CPU time of one synchronous ``pluribus.all_reduce`` (4 float32s, a threads world of one) with
the flight recorder off and on, in one process: what ``pluribus-run`` jobs, which switch the
recorder on, pay per call for it.

    python benchmarks/recorder_cost.py
"""

from __future__ import annotations

import time

import numpy as np
import pluribus as pb
from pluribus.debug import flight_recorder
from pluribus.store import HashStore


def per_call(x: np.ndarray, calls: int = 20000, blocks: int = 5) -> float:
    """Best block's CPU microseconds per call (CPU time: other load does not inflate it)."""
    best = float("inf")
    for _ in range(blocks):
        start = time.thread_time()
        for _ in range(calls):
            pb.all_reduce(x)
        best = min(best, (time.thread_time() - start) / calls * 1e6)
    return best


def main() -> None:
    pb.init_process_group("threads", rank=0, world_size=1, store=HashStore())
    x = np.ones(4, np.float32)
    for size in (0, 256, 0, 256):
        flight_recorder.recorder.configure(size)
        print(f"flight recorder {'on ' if size else 'off'}: {per_call(x):5.2f} us CPU per call")
    pb.destroy_process_group()


if __name__ == "__main__":
    main()

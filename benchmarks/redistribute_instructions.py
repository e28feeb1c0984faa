"""Instructions per call of redistribute and of the same collective by hand, counted by
valgrind's callgrind in a gloo world of one (4 KiB pieces): unlike a timing, the count is the
same on a loaded machine, so it shows what a change to redistribute's own Python saves.

    python benchmarks/redistribute_instructions.py           # every pair, about 5 minutes
    python benchmarks/redistribute_instructions.py all_gather
    PYTHONPATH=<old tree>/core/src python benchmarks/redistribute_instructions.py  # other code

Each figure is (count after 1200 calls - count after 200 calls) / 1000, so start-up cancels.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

PAIRS = ["all_gather", "all_reduce vs out=", "all_reduce donated", "reduce_scatter"]
FEW, MANY = 200, 1200


def _calls(name: str, side: str):
    """The function that ``side`` ("redistribute" or "hand") of pair ``name`` calls: the
    pairs of benchmarks/dtensor_redistribute.py, on 4 KiB."""
    import numpy as np
    import pluribus as pb
    from dtensor_redistribute import _pairs
    from pluribus.dtensor import init_device_mesh
    from pluribus.store import HashStore

    pb.init_process_group("gloo", rank=0, world_size=1, store=HashStore())
    pairs = _pairs(init_device_mesh("cpu", (1,)), 4096, np)  # as many DTensors for any count
    return pairs[name][side == "hand"]


def _child(name: str, side: str, count: int) -> None:
    fn = _calls(name, side)
    for _ in range(count + 5):  # 5 to warm up
        fn()


def _instructions(name: str, side: str, count: int) -> int:
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    run = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         __file__, "--child", name, side, str(count)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(re.search(r"Collected : (\d+)", run.stderr).group(1))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    for name in sys.argv[1:] or PAIRS:
        per_call = {}
        for side in ("redistribute", "hand"):
            few = _instructions(name, side, FEW)
            per_call[side] = (_instructions(name, side, MANY) - few) / (MANY - FEW)
        extra = per_call["redistribute"] - per_call["hand"]
        print(
            f"{name:<20} redistribute {per_call['redistribute']:8.0f}  by hand "
            f"{per_call['hand']:8.0f}  instructions per call; redistribute adds {extra:6.0f}"
        )


if __name__ == "__main__":
    main()

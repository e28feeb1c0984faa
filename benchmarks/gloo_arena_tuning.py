"""The two choices of gloo's shared arena that were settled by measurement, each setting
alternated with the others in one world so that all see the same machine load:

- ``--experiment spin``: how a waiting rank polls the flags: a pure spin of a given length
  against the shipped poll (yield the CPU every other poll for 100 µs) and against waiting in
  the engine at once (``engine``; the shipped choice when the host runs more ranks than cores);
- ``--experiment one-shot``: where an all-reduce switches from reducing whole arrays in one
  phase to reduce-scatter + all-gather.

    python benchmarks/gloo_arena_tuning.py                          # spin, 2 ranks
    python benchmarks/gloo_arena_tuning.py --nproc 4 --sizes 65536 --pure 50,1000
    python benchmarks/gloo_arena_tuning.py --experiment one-shot --sizes 131072,524288,1048576

Calls the backend's ``all_reduce`` directly (no core dispatch), float32 sum; for every size and
setting, 5 batches are alternated and the minimum and median batch mean (µs per call) of rank 0
are printed with the load average.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import pluribus as pb
from pluribus.testing import run_ranks


def _pure_spin(arena) -> bool:
    deadline = time.monotonic() + arena.spin
    while time.monotonic() < deadline:
        if arena._arrived():
            return True
    return False


def _apply(setting: str, arena, arena_mod, local, shipped) -> None:
    arena_mod.Arena._spin = shipped
    arena.spin = arena_mod.SPIN_SECONDS
    local.ONE_SHOT_BYTES = local_default[0]
    if setting == "one-shot":
        local.ONE_SHOT_BYTES = 1 << 40
    elif setting == "two-phase":
        local.ONE_SHOT_BYTES = 0
    elif setting == "engine":
        arena.spin = 0.0  # straight to the engine's wait (what ranks > cores get)
    elif setting != "yield":
        arena_mod.Arena._spin = _pure_spin
        arena.spin = float(setting) / 1e6


local_default: list[int] = []


def _measure(sizes: list[int], settings: list[str]) -> dict:
    from pluribus_gloo import arena as arena_mod
    from pluribus_gloo import local

    local_default.append(local.ONE_SHOT_BYTES)

    shipped = arena_mod.Arena._spin
    backend = pb.get_default_group().backends["cpu"]
    arena = backend.arena
    results = {}
    for nbytes in sizes:
        x = np.zeros(nbytes // 4, np.float32)
        iters = max(5, min(100, (4 << 20) // nbytes * 5))
        samples: dict[str, list[float]] = {s: [] for s in settings}
        for _ in range(5):
            for setting in settings:
                _apply(setting, arena, arena_mod, local, shipped)
                backend.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    backend.all_reduce(x, pb.ReduceOp.SUM)
                samples[setting].append((time.perf_counter() - start) / iters * 1e6)
        for setting, values in samples.items():
            values.sort()
            results[(nbytes, setting)] = (values[0], values[len(values) // 2])
    _apply("yield", arena, arena_mod, local, shipped)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", choices=("spin", "one-shot"), default="spin")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sizes", default="4096,65536,262144,4194304")
    parser.add_argument("--pure", default="50,300,1000", help="pure-spin lengths in µs")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.experiment == "spin":
        settings = ["yield", "engine", *args.pure.split(",")]
    else:
        settings = ["one-shot", "two-phase"]
    print(f"# load before: {os.getloadavg()}")
    got = run_ranks(_measure, args.nproc, "gloo", "processes", timeout=600, args=(sizes, settings))
    print(f"# load after: {os.getloadavg()}")
    print(f"# {'bytes':>10} {'setting':>12} {'min us':>10} {'median us':>10}")
    for (nbytes, setting), (low, mid) in got[0].items():
        name = setting if not setting[0].isdigit() else f"pure {setting}us"
        print(f"  {nbytes:>10} {name:>12} {low:>10.1f} {mid:>10.1f}")


if __name__ == "__main__":
    main()

"""The choices of gloo's shared arena that were settled by measurement, each setting alternated
with the others in one world so that all see the same machine load:

- ``--experiment spin``: how a waiting rank waits for its peers. ``shipped`` is what ships
  (poll 100 µs yielding the CPU every other poll, or on every poll when the host runs more ranks
  than cores, then sleep on a peer's futex, then the engine); against it ``yield:US`` (poll US µs
  yielding on every poll, then the futex; ``yield:0`` sleeps at once), ``poll:US`` (yield every
  other poll), ``every:N:US`` (every N polls), ``pure:US`` (never yield), ``nofutex`` (the
  shipped poll, then the engine) and ``engine`` (straight to the engine's wait: what ranks >
  cores got before the futex), ``pin`` (each rank alone on one CPU, rank modulo the CPUs);
- ``--experiment one-shot``: where an all-reduce switches from reducing whole arrays in one
  phase to reduce-scatter + all-gather;
- ``--experiment half``: the bytes of one half of a rank's slot (``--halves``; one group per
  size, all in one world).

    python benchmarks/gloo_arena_tuning.py                          # spin, 2 ranks
    python benchmarks/gloo_arena_tuning.py --nproc 4 --sizes 4096,65536 \
        --settings shipped,yield:0,yield:30,yield:300,engine
    python benchmarks/gloo_arena_tuning.py --experiment one-shot --sizes 131072,524288,1048576
    python benchmarks/gloo_arena_tuning.py --experiment half --sizes 4194304,8388608,16777216

Calls the backend's ``all_reduce`` directly (no core dispatch), float32 sum; for every size and
setting, 5 batches are alternated and the minimum and median batch mean (µs per call) of rank 0
are printed with the load average, and rank 0's CPU time and voluntary context switches (sleeps)
per call, which depend less on what else the machine runs.
"""

from __future__ import annotations

import argparse
import os
import resource
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


def _apply(setting: str, arena, arena_mod, local, shipped: dict) -> None:
    """Put the shipped choices back, then change the one that ``setting`` names."""
    arena_mod.Arena._spin = shipped["_spin"]
    arena.spin, arena.yield_mask, arena.futex = shipped["spin"], shipped["mask"], shipped["futex"]
    local.ONE_SHOT_BYTES = shipped["one_shot"]
    os.sched_setaffinity(0, shipped["cpus"])
    kind, _, micros = setting.partition(":")
    polls, _, micros = micros.rpartition(":")  # "every:N:US" has a poll count
    seconds = float(micros or 0) / 1e6
    if kind == "one-shot":
        local.ONE_SHOT_BYTES = 1 << 40
    elif kind == "two-phase":
        local.ONE_SHOT_BYTES = 0
    elif kind == "engine":  # straight to the engine's wait (the choice before the futex)
        arena.spin, arena.futex = 0.0, None
    elif kind == "nofutex":  # the shipped poll, then the engine's wait
        arena.futex = None
    elif kind == "yield":  # poll and yield the CPU on every poll, then sleep on the futex
        arena.spin, arena.yield_mask = seconds, 0
    elif kind == "poll":  # poll and yield every other poll, then sleep on the futex
        arena.spin, arena.yield_mask = seconds, 1
    elif kind == "every":  # poll and yield the CPU every N polls (N a power of 2), then the futex
        arena.spin, arena.yield_mask = seconds, int(polls) - 1
    elif kind == "pin":  # this rank alone on one CPU (rank modulo the CPUs it may use)
        cpus = sorted(shipped["cpus"])
        os.sched_setaffinity(0, {cpus[arena.rank % len(cpus)]})
    elif kind == "pure":  # poll without yielding, then sleep on the futex
        arena_mod.Arena._spin = _pure_spin
        arena.spin = seconds


def _measure(sizes: list[int], settings: list[str]) -> dict:
    from pluribus_gloo import arena as arena_mod
    from pluribus_gloo import local

    backend = pb.get_default_group().backends["cpu"]
    arena = backend.arena
    shipped = {
        "_spin": arena_mod.Arena._spin,
        "spin": arena.spin,
        "mask": arena.yield_mask,
        "futex": arena.futex,
        "one_shot": local.ONE_SHOT_BYTES,
        "cpus": os.sched_getaffinity(0),
    }
    # "half:BYTES": a group of every rank whose arena halves hold BYTES (the setting is read when
    # a group opens its arena), so that several half sizes alternate in one world
    backends = {}
    for setting in settings:
        if setting.startswith("half:"):
            os.environ[arena_mod.ARENA_BYTES_ENV] = setting.partition(":")[2]
            backends[setting] = pb.new_group().backends["cpu"]
            os.environ.pop(arena_mod.ARENA_BYTES_ENV)
    results = {}
    for nbytes in sizes:
        x = np.zeros(nbytes // 4, np.float32)
        iters = max(5, min(100, (4 << 20) // nbytes * 5))
        samples: dict[str, list[float]] = {s: [] for s in settings}
        costs: dict[str, list[float]] = {s: [0.0, 0.0] for s in settings}
        for _ in range(5):
            for setting in settings:
                _apply(setting, arena, arena_mod, local, shipped)
                run = backends.get(setting, backend)
                run.barrier()
                before = resource.getrusage(resource.RUSAGE_SELF)
                start = time.perf_counter()
                for _ in range(iters):
                    run.all_reduce(x, pb.ReduceOp.SUM)
                samples[setting].append((time.perf_counter() - start) / iters * 1e6)
                after = resource.getrusage(resource.RUSAGE_SELF)
                cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
                costs[setting][0] += cpu / iters / 5 * 1e6
                costs[setting][1] += (after.ru_nvcsw - before.ru_nvcsw) / iters / 5
        for setting, values in samples.items():
            values.sort()
            cpu, sleeps = costs[setting]
            results[(nbytes, setting)] = (values[0], values[len(values) // 2], cpu, sleeps)
    _apply("shipped", arena, arena_mod, local, shipped)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", choices=("spin", "one-shot", "half"), default="spin")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sizes", default="4096,65536,262144,4194304")
    parser.add_argument(
        "--settings",
        default="shipped,engine,nofutex,yield:20,yield:100,pure:50",
        help="--experiment spin: shipped, engine, nofutex, yield:US, poll:US, every:N:US, pure:US",
    )
    parser.add_argument(
        "--halves", default="262144,524288,1048576,2097152", help="--experiment half: bytes"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.experiment == "spin":
        settings = args.settings.split(",")
    elif args.experiment == "one-shot":
        settings = ["one-shot", "two-phase"]
    else:
        settings = [f"half:{b}" for b in args.halves.split(",")]
    print(f"# load before: {os.getloadavg()}")
    got = run_ranks(_measure, args.nproc, "gloo", "processes", timeout=600, args=(sizes, settings))
    print(f"# load after: {os.getloadavg()}")
    head = ("bytes", "setting", "min us", "median us", "cpu us", "sleeps")
    print("# {:>10} {:>12} {:>10} {:>10} {:>8} {:>7}".format(*head))
    for (nbytes, setting), (low, mid, cpu, sleeps) in got[0].items():
        print(f"  {nbytes:>10} {setting:>12} {low:>10.1f} {mid:>10.1f} {cpu:>8.1f} {sleeps:>7.2f}")


if __name__ == "__main__":
    main()

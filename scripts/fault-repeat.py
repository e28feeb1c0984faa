"""Repeat the kill-a-rank run of tests/faults many times per backend and count broken promises.

    python scripts/fault-repeat.py [--runs 20] [--backends gloo-shm,ucc,mpi] [--victims 0,2]

(``mpi-2hosts``, not in the default list: the mpi run with two "hosts" of two ranks on this
machine, each with its own watcher.)

Each run starts a 4-rank env:// job (rank 0 serves the store), lets every rank loop all_reduce
of 1 MiB float32, SIGKILLs one rank (the victims take turns) and checks every promise: each
survivor raises a PeerError naming the dead rank within 5 s, a later collective fails as fast, no
survivor dies of a signal, no process or /dev/shm segment is left. The mpi job runs under
mpiexec, which kills the other ranks itself: its output must name the dead rank and pid (once)
and the job end within 5 s, leaving no process (ranks, the plugin's watcher) or MPICH segment.
A race that breaks one run in three cannot hide in 20. The last lines are the counts per
backend (the table in BENCHMARKS.md); "slowest" is the slowest survivor to raise, or for mpi
the time until mpiexec returned.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "faults")
)

from killing import kill_a_rank  # noqa: E402

#: name: (backend, environment, "hosts" the ranks are split into on this machine)
SETTINGS = {
    "gloo-shm": ("gloo", {"PLURIBUS_GLOO_SHM": "1"}, 1),
    "gloo-tcp": ("gloo", {"PLURIBUS_GLOO_SHM": "0"}, 1),
    "ucc": ("ucc", {}, 1),
    "mpi": ("mpi", {}, 1),
    "mpi-2hosts": ("mpi", {}, 2),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--backends", default="gloo-shm,gloo-tcp,ucc,mpi")
    parser.add_argument("--victims", default="0,1,2,3")
    args = parser.parse_args()
    victims = [int(v) for v in args.victims.split(",")]
    summary = {}
    for name in args.backends.split(","):
        backend, env, hosts = SETTINGS[name]
        kinds: collections.Counter[str] = collections.Counter()
        good, slowest = 0, 0.0
        start = time.monotonic()
        for run in range(args.runs):
            victim = victims[run % len(victims)]
            outcome = kill_a_rank(backend, victim, env=env, hosts=hosts)
            problems = outcome.problems()
            for got in outcome.survivors.values():
                if "raised_at" in got:
                    slowest = max(slowest, got["raised_at"] - outcome.killed_at)
            if outcome.ended_at:
                slowest = max(slowest, outcome.ended_at - outcome.killed_at)
            if problems:
                print(f"{name} run {run + 1} (killed rank {victim}): {'; '.join(problems)}")
                kinds.update(p.split(":")[0] for p in problems)
            else:
                good += 1
        took = time.monotonic() - start
        summary[name] = (good, kinds, slowest, took)
    print()
    print("| backend | runs | all promises held | slowest | problems | took |")
    print("|---|---|---|---|---|---|")
    for name, (good, kinds, slowest, took) in summary.items():
        what = ", ".join(f"{k} ({n})" for k, n in kinds.most_common()) or "none"
        print(f"| {name} | {args.runs} | {good} | {slowest:.2f}s | {what} | {took:.0f}s |")
    return 0 if all(g == args.runs for g, *_ in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

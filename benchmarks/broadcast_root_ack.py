"""What it would cost a broadcast's root to learn of a mismatch inside the call: a small
broadcast alone against the same broadcast followed by an acknowledgement tree to the root,
on the same ranks, taking turns.

    python benchmarks/broadcast_root_ack.py [--ranks 4] [--rounds 5] [--calls 1000] [--bytes 4096]

A root that only sends returns once its messages are out; to hear that every receiver called the
same broadcast (same root, dtype and size) it must wait for word from them. The cheapest word is
one flag per rank combined up a tree to the root, which is what ``reduce`` of one int32 with
``MIN`` is (1 = matched): the second setting times ``broadcast`` + that ``reduce``. Each round
times ``--calls`` calls per setting and keeps the slower rank's median per-call wall time; the
report is the median over rounds of the ack/plain ratio (the machine is shared: only ratios
measured side by side mean anything). gloo on one host with its shared-memory arena is not
measured: its broadcast already ends with a barrier of the arena, so the root learns in the call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pluribus as pb
from pluribus.testing import RankPool

SETTINGS = {
    "gloo-tcp": ("gloo", {"PLURIBUS_GLOO_SHM": "0"}),
    "ucc": ("ucc", {}),
}


def _time_calls(ack: bool, nbytes: int, calls: int) -> float:
    x = np.zeros(nbytes // 4, np.float32)
    flag = np.ones(1, np.int32)

    def call() -> None:
        pb.broadcast(x, 0)
        if ack:
            pb.reduce(flag, 0, op=pb.ReduceOp.MIN)

    for _ in range(50):
        call()
    pb.barrier()
    samples = []
    for _ in range(calls // 50):
        start = time.perf_counter()
        for _ in range(50):
            call()
        samples.append((time.perf_counter() - start) / 50)
    pb.barrier()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--backends", default=",".join(SETTINGS))
    args = parser.parse_args()
    for name in args.backends.split(","):
        backend, env = SETTINGS[name]
        pool = RankPool(args.ranks, backend, "processes", 120, env)
        try:
            ratios, times = [], {True: [], False: []}
            for turn in range(args.rounds):
                got = {}
                for ack in (False, True) if turn % 2 else (True, False):
                    got[ack] = max(pool.run(_time_calls, ack, args.bytes, args.calls))
                    times[ack].append(got[ack])
                ratios.append(got[True] / got[False])
            print(
                f"{name} broadcast {args.bytes} B, {args.ranks} ranks: plain "
                f"{statistics.median(times[False]) * 1e6:.1f} us, with the ack "
                f"{statistics.median(times[True]) * 1e6:.1f} us per call (ack/plain median "
                f"{statistics.median(ratios):.2f}, rounds {', '.join(f'{r:.2f}' for r in ratios)})",
                flush=True,
            )
        finally:
            pool.close()


if __name__ == "__main__":
    main()

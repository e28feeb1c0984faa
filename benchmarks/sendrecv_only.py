"""A backend with only send and recv against gloo, in the same run: what the core's generic path
costs (its lifelines, the generic algorithms over send/recv) with calls on the calling thread
(what a backend declaring nothing gets) and on the group's worker thread
(``abort_wakes_calls = False``).

The send/recv-only backend is gloo's transport with every native collective hidden, and with
failure detection left to the core (``detects_failures = False``), as a third-party backend
written from docs/backend-authors.md would be (gloo's ``abort`` wakes its waits, so declaring
nothing is right for it). Run::

    PLURIBUS_GLOO_ARENA=0 pluribus-run --nproc-per-node 2 benchmarks/sendrecv_only.py [--json F]

(``PLURIBUS_GLOO_ARENA=0``: gloo on its message path, the transport both send/recv-only groups
use.) For each size it times blocks of synchronous float32 SUM all-reduces on gloo and on the
two send/recv-only groups in turn and reports the best block per call of each, and the ratios
(the goal: the group declaring nothing at most 2x gloo at 4 KiB).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import pluribus as pb
from pluribus.operations import OPERATIONS
from pluribus_gloo import plugin as gloo_plugin
from pluribus_gloo.backend import GlooBackend

SIZES = [4, 1 << 10, 4 << 10, 64 << 10, 1 << 20]
GOAL_RATIO, GOAL_AT = 2.0, 4 << 10


class SendRecvOnly(GlooBackend):
    """gloo's send and recv, nothing else: the core runs every collective and watches peers."""

    name = "sendrecv-only"
    detects_failures = False
    sendrecv = pb.Backend.sendrecv  # the default: the send on the backend's sender thread


class OnWorker(SendRecvOnly):
    """The same, declaring that a failure may not end its calls: they run on the worker."""

    name = "sendrecv-worker"
    abort_wakes_calls = False


for _op in OPERATIONS.values():
    if _op.collective:
        setattr(SendRecvOnly, _op.name, None)  # the core's generic algorithm instead


def _creator(cls):
    def create(ctx):
        backend = gloo_plugin.create(ctx)
        backend.__class__ = cls
        return backend

    return create


@pb.hookimpl
def pluribus_backends():
    for cls in (SendRecvOnly, OnWorker):
        yield pb.BackendSpec(name=cls.name, create=_creator(cls), description="benchmark")


def _time(group, x: np.ndarray, calls: int) -> float:
    pb.barrier(group)
    start = time.perf_counter()
    for _ in range(calls):
        pb.all_reduce(x, group=group)
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json")
    parser.add_argument(
        "--send-inline", action="store_true", help="send_blocks = False: sendrecv sends inline"
    )
    args = parser.parse_args(argv)
    SendRecvOnly.send_blocks = not args.send_inline
    pb.get_plugin_manager().register(sys.modules[__name__], name="sendrecv-only-benchmark")
    pb.init_process_group("gloo")
    world = pb.get_default_group()
    store, rank, size = world.store, world.rank, world.size
    groups = {"gloo": world}
    for name in (SendRecvOnly.name, OnWorker.name):  # through the same store
        groups[name] = pb.distributed._create_group(
            name, list(range(size)), rank, {"cpu": name}, store, 60.0, {}
        )
    if rank == 0:
        print(
            f"{'bytes':>8}  {'gloo us':>9} {'caller us':>10} {'ratio':>6} "
            f"{'worker us':>10} {'ratio':>6}"
        )
    rows = []
    for nbytes in SIZES:
        x = np.zeros(nbytes // 4, np.float32)  # stays 0: no overflow however many calls
        calls = max(20, min(2000, int(2e6 / max(nbytes, 64))))
        best = dict.fromkeys(groups, float("inf"))
        for _ in range(args.rounds):
            for name, group in groups.items():
                best[name] = min(best[name], _time(group, x, calls))
        row = {
            "bytes": nbytes,
            "gloo_us": best["gloo"],
            "caller_us": best[SendRecvOnly.name],
            "worker_us": best[OnWorker.name],
            "ratio": best[SendRecvOnly.name] / best["gloo"],
            "worker_ratio": best[OnWorker.name] / best["gloo"],
        }
        rows.append(row)
        if rank == 0:
            goal = ""
            if nbytes == GOAL_AT:
                goal = "ok" if row["ratio"] <= GOAL_RATIO else "MISS"
                goal += f" (caller <= {GOAL_RATIO}x gloo)"
            print(
                f"{nbytes:>8}  {row['gloo_us']:9.1f} {row['caller_us']:10.1f} "
                f"{row['ratio']:5.2f}x {row['worker_us']:10.1f} {row['worker_ratio']:5.2f}x  "
                f"{goal}",
                flush=True,
            )
    for name in (SendRecvOnly.name, OnWorker.name):
        groups[name].close()
        groups[name].lifeline.close()
    if rank == 0 and args.json:
        with open(args.json, "w") as out:
            json.dump({"ranks": size, "rows": rows}, out, indent=2)
    pb.destroy_process_group()
    missed = [r for r in rows if r["bytes"] == GOAL_AT and r["ratio"] > GOAL_RATIO]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

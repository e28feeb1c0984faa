"""A backend with only send and recv against gloo, in the same run: what the core's generic path
costs (its lifelines, the worker thread that lets a failure end a waiting call, the generic
algorithms over send/recv).

The send/recv-only backend is gloo's transport with every native collective hidden, and with
failure detection left to the core (``detects_failures = False``), as a third-party backend
written from docs/backend-authors.md would be. Run::

    pluribus-run --nproc-per-node 2 benchmarks/sendrecv_only.py [--json out.json]

For each size it times blocks of synchronous float32 SUM all-reduces on gloo and on the
send/recv-only backend alternately and reports the best block per call of each, and the ratio
(the goal: at most 2x gloo at 4 KiB).
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


for _op in OPERATIONS.values():
    if _op.collective:
        setattr(SendRecvOnly, _op.name, None)  # the core's generic algorithm instead


def _create(ctx):
    backend = gloo_plugin.create(ctx)
    backend.__class__ = SendRecvOnly
    return backend


@pb.hookimpl
def pluribus_backends():
    yield pb.BackendSpec(name="sendrecv-only", create=_create, description="benchmark")


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
    parser.add_argument(
        "--abort-wakes",
        action="store_true",
        help="abort_wakes_calls = True (gloo's abort does wake its waits): calls run on the "
        "calling thread, the core's lifelines still watch",
    )
    args = parser.parse_args(argv)
    SendRecvOnly.send_blocks = not args.send_inline
    SendRecvOnly.abort_wakes_calls = args.abort_wakes
    pb.get_plugin_manager().register(sys.modules[__name__], name="sendrecv-only-benchmark")
    pb.init_process_group("gloo")
    world = pb.get_default_group()
    store, rank, size = world.store, world.rank, world.size
    # A second group on the send/recv-only backend, through the same store.
    other = pb.distributed._create_group(
        "sendrecv-only", list(range(size)), rank, {"cpu": "sendrecv-only"}, store, 60.0, {}
    )
    rows = []
    for nbytes in SIZES:
        x = np.zeros(nbytes // 4, np.float32)  # stays 0: no overflow however many calls
        calls = max(20, min(2000, int(2e6 / max(nbytes, 64))))
        best = {"gloo": float("inf"), "sendrecv-only": float("inf")}
        for _ in range(args.rounds):
            best["gloo"] = min(best["gloo"], _time(world, x, calls))
            best["sendrecv-only"] = min(best["sendrecv-only"], _time(other, x, calls))
        ratio = best["sendrecv-only"] / best["gloo"]
        rows.append(
            {
                "bytes": nbytes,
                "gloo_us": best["gloo"],
                "sendrecv_only_us": best["sendrecv-only"],
                "ratio": ratio,
            }
        )
        if rank == 0:
            goal = ""
            if nbytes == GOAL_AT:
                goal = "ok" if ratio <= GOAL_RATIO else "MISS"
                goal += f" (<= {GOAL_RATIO}x gloo)"
            print(
                f"{nbytes:>8} B  gloo {best['gloo']:8.1f} us  send/recv-only "
                f"{best['sendrecv-only']:8.1f} us  {ratio:5.2f}x  {goal}",
                flush=True,
            )
    other.close()
    other.lifeline.close()
    if rank == 0 and args.json:
        with open(args.json, "w") as out:
            json.dump({"ranks": size, "rows": rows}, out, indent=2)
    pb.destroy_process_group()
    missed = [r for r in rows if r["bytes"] == GOAL_AT and r["ratio"] > GOAL_RATIO]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

"""A broadcast whose root only sends: rank 0 broadcasts from itself while the others broadcast
from rank 1, then everyone broadcasts from rank 0. The root returns before its receivers can
tell it of the mismatch (hearing back would cost an acknowledgement per call: 2-5x a 4 KiB
broadcast, BENCHMARKS.md), so the promise is that no rank takes the stale message for the
next call's data and that the root's next call that waits names the broadcast that mismatched.

gloo checks every message's header (root and number in the group); ucc does with
``ucc_check_calls=True``, whose signature carries the call's number. ucc's default does not
check roots (it costs more than 5 % at 4 KiB): its next call that receives the stale message
says that an earlier call may have mismatched.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pluribus as pb
import pytest
from pluribus import is_available
from pluribus.testing import run_ranks

WORLD = 4
N = 1024  # 4 KiB of float32


def _said(call) -> str:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def _roots_differ_then_broadcast() -> dict:
    rank = pb.get_rank()
    x = np.full(N, float(rank), np.float32)
    first = _said(lambda: pb.broadcast(x, src=0 if rank == 0 else 1))
    y = np.full(N, 100.0 + rank, np.float32)
    second = _said(lambda: pb.broadcast(y, src=0))
    if rank == 0:
        time.sleep(1.5)  # the others' abort reaches the root before its next call
    then = _said(pb.barrier)
    return {"first": first, "second": second, "then": then, "y": float(y[0])}


SETTINGS = {
    "gloo-tcp": ("gloo", {"PLURIBUS_GLOO_SHM": "0"}, {}),
    "gloo-shm": ("gloo", {"PLURIBUS_GLOO_SHM": "1"}, {}),
    "ucc-checked": ("ucc", {}, {"ucc_check_calls": True}),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.timeout(90)
def test_no_rank_takes_a_mismatched_broadcast_for_the_next_and_the_root_hears(setting):
    backend, env, options = SETTINGS[setting]
    if not is_available(backend):
        pytest.skip(f"{backend} is not available here")
    results = run_ranks(
        _roots_differ_then_broadcast,
        WORLD,
        backend,
        "processes",
        timeout=60,
        env={"PLURIBUS_TIMEOUT": "10", **env},
        backend_options=options,
    )
    for rank, result in enumerate(results):
        if result["second"] == "returned":
            # rank 0's data of the second broadcast, never the stale message of the first
            assert result["y"] == 100.0, (rank, results)
        assert result["then"] != "returned", (rank, results)
    root = results[0]
    heard = next(root[k] for k in ("first", "second", "then") if root[k] != "returned")
    assert "Mismatch" in heard or "mismatch" in heard, heard
    assert re.search(r"broadcast\(float32[^)]*root[= ]0", heard), heard
    assert re.search(r"root[= ]1", heard) or "#1" in heard, heard


def _roots_differ_then_barrier() -> str:
    rank = pb.get_rank()
    x = np.full(N, float(rank), np.float32)
    pb.broadcast(x, src=0 if rank == 0 else 1)
    if rank != 1:
        time.sleep(1.0)  # rank 1's barrier meets rank 0's stale message first
    return _said(pb.barrier)


@pytest.mark.timeout(90)
def test_ucc_unchecked_says_an_earlier_call_may_have_mismatched():
    if not is_available("ucc"):
        pytest.skip("ucc is not available here")
    results = run_ranks(
        _roots_differ_then_barrier,
        WORLD,
        "ucc",
        "processes",
        timeout=60,
        env={"PLURIBUS_TIMEOUT": "10"},
    )
    # (a rank whose barrier peers had sent their tokens before the abort may return: its next
    # call fails)
    assert "an earlier call mismatched" in results[1], results

"""Failures on real processes: a killed rank, mismatched collectives, wrong auth tokens.

Each must make every rank raise an error that names the culprit, within seconds, and leave no
process, socket or shared-memory segment behind.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import pluribus as pb
import pytest
from pluribus.errors import PeerError
from pluribus.testing import RanksFailed, run_ranks


def _kill_rank_one_mid_all_reduce() -> None:
    rank = pb.get_rank()
    store = pb.get_default_group().store
    x = np.ones(4 << 20, dtype=np.float32)  # 16 MiB: each all_reduce takes a while
    pb.all_reduce(x)
    if rank == 1:

        def die() -> None:
            time.sleep(0.05)
            store.set("test/killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die, daemon=True).start()
    try:
        for _ in range(100000):
            pb.all_reduce(x)
    except PeerError:
        waited = time.time() - float(store.get("test/killed_at", 10))
        assert waited < 5, f"rank {rank} noticed the dead peer only after {waited:.1f}s"
        raise
    raise AssertionError("all_reduce kept succeeding although rank 1 was killed")


@pytest.mark.parametrize("world, shm", [(2, "0"), (3, "1")], ids=["world2-socket", "world3-shm"])
@pytest.mark.timeout(120)
def test_gloo_killed_rank_is_reported_within_seconds(world, shm):
    with pytest.raises(RanksFailed) as info:
        run_ranks(
            _kill_rank_one_mid_all_reduce,
            world,
            "gloo",
            "processes",
            timeout=60,
            env={"PLURIBUS_GLOO_SHM": shm},
        )
    errors = {e.rank: e for e in info.value.errors}
    assert errors[1].kind == "died"
    for rank in range(world):
        if rank != 1:
            assert errors[rank].kind == "PeerError", errors[rank]
            assert "rank 1" in errors[rank].message, errors[rank].message


def _mismatched_sizes() -> None:
    rank = pb.get_rank()
    n = 300_000 if rank == 1 else 250_000  # large enough for the ring algorithm
    pb.all_reduce(np.ones(n, dtype=np.float32))


def _mismatched_small_sizes() -> None:
    rank = pb.get_rank()
    pb.all_reduce(np.ones(12 if rank == 1 else 10, dtype=np.float32))


def _mismatched_ops() -> None:
    rank = pb.get_rank()
    pb.all_reduce(np.ones(100, dtype=np.float32), pb.ReduceOp.MAX if rank == 1 else pb.ReduceOp.SUM)


def _mismatched_collectives() -> None:
    rank = pb.get_rank()
    x = np.ones(100, dtype=np.float32)
    if rank == 1:
        pb.broadcast(x, src=0)
    else:
        pb.all_reduce(x)


def _mismatched_roots_then_barrier() -> None:
    rank = pb.get_rank()
    pb.broadcast(np.ones(100, dtype=np.float32), src=rank)  # each root only sends
    pb.barrier()  # meets the peer's broadcast, which arrived late for this rank's own


def _mismatched_dtypes() -> None:
    rank = pb.get_rank()
    pb.all_reduce(np.ones(64, dtype=np.float64 if rank == 1 else np.float32))


@pytest.mark.parametrize(
    "fn, world, shm, words",
    [
        (_mismatched_sizes, 3, "1", ("300000 elements", "250000 elements")),
        (_mismatched_sizes, 3, "0", ("300000 elements", "250000 elements")),
        (_mismatched_small_sizes, 2, "1", ("12 elements", "10 elements")),
        (_mismatched_ops, 2, "0", ("op=MAX", "op=SUM")),
        (_mismatched_collectives, 3, "1", ("broadcast", "all_reduce")),
        (_mismatched_dtypes, 2, "0", ("float64", "float32")),
        (_mismatched_roots_then_barrier, 2, "0", ("root=0", "root=1")),
    ],
    ids=[
        "sizes-ring-shm",
        "sizes-ring-socket",
        "sizes-small-shm",
        "ops-socket",
        "collectives-shm",
        "dtypes-socket",
        "stale-broadcast-socket",
    ],
)
@pytest.mark.timeout(120)
def test_gloo_mismatch_raises_on_every_rank(fn, world, shm, words):
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(fn, world, "gloo", "processes", timeout=60, env={"PLURIBUS_GLOO_SHM": shm})
    assert time.monotonic() - start < 30, "a mismatch must be reported at once, not at a timeout"
    errors = {e.rank: e for e in info.value.errors}
    assert sorted(errors) == list(range(world)), info.value
    for error in errors.values():
        assert error.kind == "CollectiveMismatchError", error
        # every rank names the odd one out and what both sides called
        assert "rank 1 " in error.message, error.message
        for word in words:
            assert word in error.message, (word, error.message)


# -- authentication -------------------------------------------------------------------------------


def _auth_rank(rank: int, port: int, token: str, results) -> None:
    try:
        store = pb.TCPStore("127.0.0.1", port, auth_token="", timeout=10)
        pb.init_process_group(
            "gloo",
            rank=rank,
            world_size=2,
            store=store,
            timeout=4,
            backend_options={"auth_token": token},
        )
        pb.destroy_process_group()
        results.put((rank, "ok", ""))
    except BaseException as exc:  # reported to the test
        results.put((rank, type(exc).__name__, str(exc)))


@pytest.mark.timeout(60)
def test_gloo_wrong_auth_token_is_refused():
    ctx = multiprocessing.get_context("spawn")
    store = pb.TCPStore("127.0.0.1", 0, is_master=True, auth_token="", timeout=10)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_auth_rank, args=(rank, store.port, token, results), daemon=True)
        for rank, token in ((0, "the-job-secret"), (1, "a-wrong-guess"))
    ]
    try:
        for p in procs:
            p.start()
        outcome = {}
        for _ in procs:
            rank, kind, message = results.get(timeout=40)
            outcome[rank] = (kind, message)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        store.close()
    assert outcome[1][0] == "AuthenticationError", outcome
    assert "auth token" in outcome[1][1]
    assert outcome[0][0] == "DistTimeoutError", outcome  # rank 0 never accepted the impostor
    assert "[1]" in outcome[0][1]


def _ok_with_token() -> str:
    x = np.ones(10)
    pb.all_reduce(x)
    assert (x == pb.get_world_size()).all()
    return "ok"


@pytest.mark.timeout(60)
def test_gloo_matching_auth_tokens_connect():
    env = {"PLURIBUS_AUTH_TOKEN": "shared-secret-for-this-test"}
    assert run_ranks(_ok_with_token, 2, "gloo", "processes", timeout=40, env=env) == ["ok"] * 2

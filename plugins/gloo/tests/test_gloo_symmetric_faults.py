"""Failures on gloo's symmetric-memory paths, with real processes: a rank killed in the middle of
``pluribus.empty_symmetric``, or while its peers run a zero-copy collective on symmetric
arrays, makes every survivor raise a ``PeerError`` naming it within seconds (the group's
timeout is far longer), as on the copying paths (test_gloo_faults.py); a peer that runs another
collective is a mismatch on every rank. No segment is left in /dev/shm (conftest's autouse
fixture) and no process (``run_ranks`` stops them).

Each victim dies at a point the test makes certain by replacing, in the victim only, the
function it calls there."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np
import pluribus as pb
import pytest
from pluribus.errors import PeerError
from pluribus.testing import RanksFailed, run_ranks
from pluribus_gloo import local, symmetric

WORLD = 3
#: the group's timeout: a survivor that only noticed the death at the timeout fails the test
TIMEOUT = 90.0
#: a survivor must name the dead rank this soon after it died
NOTICED_WITHIN = 5.0
DIED_AT = "test/died_at"
#: above the one-shot all-reduce and inside the zero-copy window of the other collectives
N = 300_001


def _die() -> None:
    pb.get_default_group().store.set(DIED_AT, repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _survivor(body) -> None:
    """Run ``body``, which must fail with a PeerError soon after the victim died."""
    store = pb.get_default_group().store
    try:
        body()
    except PeerError:
        waited = time.time() - float(store.get(DIED_AT, 10))
        assert waited < NOTICED_WITHIN, f"noticed the dead peer only after {waited:.1f}s"
        raise
    raise AssertionError("the call returned although a rank was killed")


def _allocate_while(victim: int, death: str) -> None:
    """Every rank allocates a symmetric array; ``victim`` dies at ``death`` inside the call."""
    if pb.get_rank() == victim:
        backend = pb.get_default_group().backends["cpu"]
        if death == "after creating the segment":
            create = symmetric.shm.create_mapping

            def create_then_die(*args, **kwargs):
                create(*args, **kwargs)
                _die()

            symmetric.shm.create_mapping = create_then_die
        elif death == "before mapping it":
            symmetric.shm.map_if_possible = lambda *args: _die()
        elif death == "after mapping it":
            map_it = symmetric.shm.map_if_possible

            def map_then_die(*args):
                assert map_it(*args) is not None
                _die()

            symmetric.shm.map_if_possible = map_then_die
        elif death == "before agreeing":
            backend.all_reduce = lambda *args: _die()
        pb.empty_symmetric(1 << 18, np.float32)
        raise AssertionError(f"rank {victim} should have died {death}")
    _survivor(lambda: pb.empty_symmetric(1 << 18, np.float32))


def _collective(name: str, x: np.ndarray) -> None:
    size = pb.get_world_size()
    if name == "all_reduce":
        pb.all_reduce(x)
    elif name == "all_gather":
        pb.all_gather([np.empty_like(x) for _ in range(size)], x)
    elif name == "broadcast":
        pb.broadcast(x, src=0)
    else:
        part = x.size // size
        out = np.empty(part, x.dtype)
        pb.reduce_scatter(out, [x[q * part : (q + 1) * part] for q in range(size)])


def _zero_copy_while(name: str, victim: int, death: str) -> None:
    """Every rank runs ``name`` on symmetric arrays; ``victim`` never arrives, or dies once the
    announcements agreed (its peers then read its array, which stays mapped in them)."""
    x = pb.empty_symmetric(N, np.float32)
    x[...] = pb.get_rank() + 1
    if pb.get_rank() == victim:
        if death == "never arrives":
            _die()
        agree = local._announce_and_agree

        def agree_then_die(*args):
            assert agree(*args) is not None, "the zero-copy path did not run"
            _die()

        local._announce_and_agree = agree_then_die
        _collective(name, x)
        raise AssertionError(f"rank {victim} should have died {death}")
    _survivor(lambda: _collective(name, x))


def _assert_survivors_name(info: pytest.ExceptionInfo, victim: int) -> None:
    assert not multiprocessing.active_children(), "a rank's process is still running"
    errors = {e.rank: e for e in info.value.errors}
    assert sorted(errors) == list(range(WORLD)), info.value
    assert errors[victim].kind == "died", errors[victim]
    for rank in range(WORLD):
        if rank != victim:
            assert errors[rank].kind == "PeerError", errors[rank]
            assert f"rank {victim}" in errors[rank].message, errors[rank].message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "victim, death",
    [
        (0, "after creating the segment"),
        (0, "before agreeing"),
        (1, "before mapping it"),
        (2, "after mapping it"),
    ],
)
def test_a_rank_killed_inside_empty_symmetric(victim, death):
    """The creator dying with the segment made (before any peer opened it), or between the
    two syncs, or another rank dying before or after mapping it: the survivors name it and
    unlink the segment themselves."""
    with pytest.raises(RanksFailed) as info:
        run_ranks(_allocate_while, WORLD, "gloo", "processes", TIMEOUT, args=(victim, death))
    _assert_survivors_name(info, victim)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "name, victim, death",
    [
        ("all_reduce", 1, "never arrives"),
        ("all_reduce", 1, "after announcing"),
        ("all_gather", 2, "after announcing"),
        ("broadcast", 0, "after announcing"),
        ("reduce_scatter", 1, "after announcing"),
    ],
)
def test_a_rank_killed_during_a_zero_copy_collective(name, victim, death):
    with pytest.raises(RanksFailed) as info:
        run_ranks(_zero_copy_while, WORLD, "gloo", "processes", TIMEOUT, args=(name, victim, death))
    _assert_survivors_name(info, victim)


def _symmetric_against_broadcast() -> None:
    """Rank 0 reduces a symmetric array zero-copy; rank 1 broadcasts it instead."""
    x = pb.empty_symmetric(N, np.float32)
    x[...] = 1
    if pb.get_rank() == 0:
        pb.all_reduce(x)
    else:
        pb.broadcast(x, 0)


@pytest.mark.timeout(60)
def test_another_collective_on_symmetric_arrays_is_a_mismatch_on_every_rank():
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_symmetric_against_broadcast, 2, "gloo", "processes", TIMEOUT)
    assert time.monotonic() - start < 30, "a mismatch must be reported at once, not at a timeout"
    errors = {e.rank: e for e in info.value.errors}
    assert [errors[r].kind for r in (0, 1)] == ["CollectiveMismatchError"] * 2, errors
    assert "all_reduce" in errors[0].message and "broadcast" in errors[0].message

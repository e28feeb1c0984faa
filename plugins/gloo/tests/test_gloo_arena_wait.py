"""How a rank waits on its group's arena: it sleeps on a peer's counter (a futex) and that
peer's publish wakes it, not the end of a sleep slice; a failure or an abort in another thread
wakes it too; with the futex turned off it waits in the engine as before. With processes (4
ranks on CI's 2 cores: more ranks than cores), a late peer, a killed peer, an abort and a
close of the engine while the others sleep.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time

import numpy as np
import pluribus as pb
import pytest
from pluribus.errors import PeerError, PluribusError
from pluribus.testing import RanksFailed, run_ranks
from pluribus_gloo import arena as arena_mod
from pluribus_gloo import futex
from test_gloo_arena import _FakeEngine, _in_threads, _thread_arenas

needs_futex = pytest.mark.skipif(not futex.available(), reason="no futex on this system")


class _CountingEngine(_FakeEngine):
    """A fake engine that counts the waits handed to it."""

    def __init__(self, size):
        super().__init__(size)
        self.waits = 0

    def wait(self, op, timeout, position=None):
        self.waits += 1
        return super().wait(op, timeout, position)


def _sleepy_arenas(monkeypatch, size: int):
    """Arenas whose waiters sleep at once, in slices far longer than any test: a waiter that
    returns early was woken by a peer (or an interrupt), not by its slice."""
    monkeypatch.setattr(arena_mod, "SLEEP_SLICE", 60.0)
    monkeypatch.setattr(arena_mod, "SLEEP_SECONDS", 120.0)
    arenas = _thread_arenas(size, 4096)
    for a in arenas:
        a.engine = _CountingEngine(size)
        a.spin = 0.0
    return arenas


@needs_futex
@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [2, 4])
def test_sleepers_are_woken_by_the_late_peers_publish(monkeypatch, size):
    arenas = _sleepy_arenas(monkeypatch, size)
    late = size - 1

    def rank_fn(arena, r):
        if r == late:
            time.sleep(0.3)
        start = time.monotonic()
        x = np.full(100, r + 1.0, dtype=np.float32)
        arena.begin(1, 2, 11, 1, 100)
        local_all_reduce(arena, x)
        return time.monotonic() - start, x

    results = _in_threads(arenas, rank_fn)
    expected = sum(range(1, size + 1))
    for r, (took, x) in enumerate(results):
        assert (x == expected).all()
        assert took < 10, f"rank {r} waited {took:.1f}s: the publish did not wake it"
    assert all(a.engine.waits == 0 for a in arenas), "every wait was a sleep on the arena"


@needs_futex
@pytest.mark.timeout(30)
def test_a_rank_that_does_not_sleep_on_futexes_still_wakes_its_sleeping_peers(monkeypatch):
    late, sleeper = _sleepy_arenas(monkeypatch, 2)
    late.futex = None  # as with PLURIBUS_GLOO_FUTEX=0 in that process only

    def rank_fn(arena, r):
        if arena is late:
            time.sleep(0.3)
        start = time.monotonic()
        x = np.full(10, r + 1.0, dtype=np.float32)
        arena.begin(1, 2, 11, 1, 10)
        local_all_reduce(arena, x)
        return time.monotonic() - start, x

    results = _in_threads([late, sleeper], rank_fn)
    assert all((x == 3).all() for _, x in results)
    assert results[1][0] < 10, "the late rank's publish woke the sleeper"
    assert sleeper.engine.waits == 0


def local_all_reduce(arena, x):
    from pluribus_gloo import local

    local.all_reduce(arena, x, np.add)


@needs_futex
@pytest.mark.timeout(30)
def test_a_failure_in_another_thread_wakes_the_sleeper(monkeypatch):
    a, _ = _sleepy_arenas(monkeypatch, 2)  # rank 1 never arrives
    error = PluribusError("rank 0: aborted: test")

    def abort_soon():
        time.sleep(0.3)
        a.engine.failed = error
        a.interrupt()  # what the engine's failure does for every arena

    threading.Thread(target=abort_soon).start()
    start = time.monotonic()
    a.begin(1, 2, 11, 1, 10)
    with pytest.raises(PluribusError, match="aborted: test"):
        a.sync()
    assert time.monotonic() - start < 10, "the interrupt woke the sleep"


@pytest.mark.timeout(30)
def test_without_futex_the_wait_goes_to_the_engine(monkeypatch):
    monkeypatch.setenv(futex.FUTEX_ENV, "0")
    arenas = _thread_arenas(2, 4096)
    for a in arenas:
        assert a.futex is None
        a.engine = _CountingEngine(2)
        a.spin = 0.0

    def rank_fn(arena, r):
        if r == 1:
            time.sleep(0.2)
        x = np.full(10, r + 1.0, dtype=np.float32)
        arena.begin(1, 2, 11, 1, 10)
        local_all_reduce(arena, x)
        return x

    for x in _in_threads(arenas, rank_fn):
        assert (x == 3).all()
    assert arenas[0].engine.waits == 1


@needs_futex
def test_futex_wait_returns_at_once_when_the_word_differs_and_wakes_on_wake():
    word = np.zeros(2, dtype=np.uint64)
    handle = futex.word(word.ctypes.data)
    sleeper = futex.Futex(30.0)
    start = time.monotonic()
    sleeper.wait(handle, 5)  # holds 0, not 5
    assert time.monotonic() - start < 5

    def publish():
        time.sleep(0.2)
        word[0] = 1
        futex.wake(handle)

    thread = threading.Thread(target=publish)
    thread.start()
    sleeper.wait(handle, 0)
    thread.join(10)
    assert time.monotonic() - start < 10, "woken by the wake, not the 30 s slice"
    word[0] = (1 << 32) + 7  # only the low 32 bits count
    start = time.monotonic()
    sleeper.wait(handle, 8)
    assert time.monotonic() - start < 5


# -- real processes: 4 ranks (more than CI's 2 cores) ----------------------------------------------


def _late_rank(delay: float) -> tuple[float, bool]:
    rank, size = pb.get_rank(), pb.get_world_size()
    x = np.arange(1000, dtype=np.float32) * (rank + 1)
    pb.all_reduce(x)  # everyone is up
    if rank == size - 1:
        time.sleep(delay)
    start = time.monotonic()
    for _ in range(3):
        x = np.arange(1000, dtype=np.float32) * (rank + 1)
        pb.all_reduce(x)
    ok = bool((x == np.arange(1000, dtype=np.float32) * sum(range(1, size + 1))).all())
    return time.monotonic() - start, ok


@pytest.mark.timeout(90)
@pytest.mark.parametrize("futex_setting", ["1", "0"])
def test_a_late_peer_arrives_and_everyone_goes_on(futex_setting):
    got = run_ranks(
        _late_rank,
        4,
        "gloo",
        "processes",
        timeout=60,
        args=(1.0,),
        env={futex.FUTEX_ENV: futex_setting},
    )
    for rank, (took, ok) in enumerate(got):
        assert ok, f"rank {rank} got a wrong sum"
        if rank != 3:
            assert 0.9 < took < 15, f"rank {rank} took {took:.1f}s for a peer 1 s late"


def _killed_while_others_sleep(folder: str) -> None:
    rank = pb.get_rank()
    pb.all_reduce(np.ones(10))
    if rank == 3:
        time.sleep(0.5)
        os._exit(1)
    start = time.monotonic()
    try:
        pb.all_reduce(np.ones(10))
        report = {"peer": None}
    except PeerError as exc:
        report = {"peer": exc.peer, "message": str(exc)}
    report["took"] = time.monotonic() - start
    with open(os.path.join(folder, f"{rank}.json"), "w") as f:
        json.dump(report, f)


@pytest.mark.timeout(90)
def test_a_peer_killed_while_the_others_sleep_is_named_within_seconds(tmp_path):
    with pytest.raises(RanksFailed) as info:
        run_ranks(
            _killed_while_others_sleep, 4, "gloo", "processes", timeout=60, args=(str(tmp_path),)
        )
    assert sorted(e.rank for e in info.value.errors) == [3], info.value
    for rank in range(3):
        report = json.loads((tmp_path / f"{rank}.json").read_text())
        assert report["peer"] == 3, (rank, report)
        assert report["took"] < 10, (rank, report)


def _blamer_exits_before_the_late_rank_looks(folder: str) -> None:
    """Rank 2 dies; rank 0 finds it, gives up and exits at once (without destroy_process_group);
    rank 1 joins the call only when both are gone, and its store does not answer, as when rank 0
    served it (here the test's process serves it)."""
    rank = pb.get_rank()
    pb.all_reduce(np.ones(10))
    if rank == 2:
        os._exit(1)
    if rank == 1:  # wait until both connections are closed
        engine = pb.get_default_group().backends["cpu"].engine
        engine.store_down = True
        deadline = time.monotonic() + 30
        while not (engine.links[0].eof and engine.links[2].eof) and time.monotonic() < deadline:
            engine._check_control()
            time.sleep(0.02)
    try:
        pb.all_reduce(np.ones(10))
        report = {"peer": None}
    except PeerError as exc:
        report = {"peer": exc.peer, "message": str(exc)}
    with open(os.path.join(folder, f"{rank}.json"), "w") as f:
        json.dump(report, f)
    if rank == 0:
        os._exit(1)


@pytest.mark.timeout(90)
def test_a_late_survivor_names_the_dead_rank_after_the_store_server_left(tmp_path):
    """Rank 1 finds the connections of ranks 0 and 2 both closed and no store to ask: rank 0's
    last word on the arena says it blamed rank 2, so rank 1 names rank 2 too (not rank 0, whose
    connection it checks first)."""
    with pytest.raises(RanksFailed) as info:
        run_ranks(
            _blamer_exits_before_the_late_rank_looks,
            3,
            "gloo",
            "processes",
            timeout=60,
            args=(str(tmp_path),),
        )
    assert sorted(e.rank for e in info.value.errors) == [0, 2], info.value
    for rank in (0, 1):
        report = json.loads((tmp_path / f"{rank}.json").read_text())
        assert report["peer"] == 2, (rank, report)
    assert "rank 0 gave up on the group because rank 2" in report["message"], report


def _interrupted_while_sleeping(how: str) -> str:
    """Rank 0 sleeps in an all-reduce the others never join; 0.3 s in, ``how`` ends it."""
    group = pb.get_default_group()
    pb.all_reduce(np.ones(10))
    if pb.get_rank() != 0:
        time.sleep(1.5)  # not in the next call before rank 0's interruption ends it
        return "late"
    if how == "abort":
        interrupt = functools.partial(group.abort, "stopped by a test")
    else:  # the close unmaps the segment under the sleeper
        interrupt = group.backends["cpu"].engine.close
    timer = threading.Timer(0.3, interrupt)
    timer.start()
    start = time.monotonic()
    try:
        pb.all_reduce(np.ones(10))
    except PluribusError as exc:
        return f"{time.monotonic() - start:.2f} {exc}"
    finally:
        timer.cancel()
    return "returned"


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "how, world, expected",
    [("abort", 4, "stopped by a test"), ("close", 2, "destroyed while this call waited")],
)
def test_an_abort_or_a_close_while_sleeping_raises_at_once(how, world, expected):
    """Sleeping on the arena for the whole wait (not handed to the engine after 50 ms): an
    abort, or a close of the engine (which must wake the sleeper, not let it read unmapped
    memory), ends the call within seconds, not at the group's timeout."""
    env = {"PLURIBUS_GLOO_ARENA_SLEEP_MS": "60000"}
    got = run_ranks(
        _interrupted_while_sleeping, world, "gloo", "processes", timeout=60, args=(how,), env=env
    )
    took, message = got[0].split(" ", 1)
    assert expected in message, message
    assert float(took) < 5.0, got[0]

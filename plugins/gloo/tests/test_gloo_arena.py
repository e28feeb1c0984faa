"""The single-host data path: a group's shared arena and the collectives that run on it.

In one process (threads standing in for ranks, over one mapping) the algorithms are checked
against numpy for random sizes, half sizes and rank counts; with real processes, every
collective is checked against numpy on the world and on a sub-group, with halves small enough
that the round structure is exercised, and the promises are kept: mismatches and timeouts raise
at once on every rank, and no segment is left behind. The zero-copy all-reduce on symmetric
arrays is checked against the copying path, with ranks that agree and ranks that do not.
"""

from __future__ import annotations

import glob
import mmap
import os
import threading
import time

import numpy as np
import pluribus as pb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pluribus.errors import CollectiveMismatchError, DistTimeoutError
from pluribus.store import HashStore, PrefixStore
from pluribus.testing import RanksFailed, run_ranks
from pluribus_gloo import arena as arena_mod
from pluribus_gloo import cma, local, symmetric
from pluribus_gloo.engine import Op


def gloo_segments() -> set[str]:
    return set(glob.glob("/dev/shm/plrb-*"))


# -- one process: threads as ranks ----------------------------------------------------------------


class _Link:
    shm = True
    eof = False


class _FakeEngine:
    """What an arena needs from the engine: a lock, failure, and a wait loop over ``op.poll``."""

    yield_while_spinning = False

    def __init__(self, size: int):
        self.links = {r: _Link() for r in range(size)}
        self.mutex = threading.Lock()
        self.failed = None
        self.arenas = []

    def _fail(self, error, code, origin):
        self.failed = self.failed or error

    def _ring_doorbell(self, link):
        pass

    def _check_control(self):
        pass

    def wait(self, op: Op, timeout: float, position: tuple | None = None):
        deadline = time.monotonic() + timeout
        while True:
            with self.mutex:
                if self.failed is not None:
                    raise self.failed
                op.poll(op)
                if op.pending == 0:
                    return
            if time.monotonic() > deadline:
                raise DistTimeoutError(f"{op.what} timed out")
            time.sleep(0)


def _thread_arenas(size: int, half: int, pids: list[int] | None = None):
    """``size`` arenas over one anonymous mapping, as the ranks of one group would see it
    (``pids``: the process of each rank, when the group may read its members' memory)."""
    total = arena_mod._control_bytes(size) + 2 * size * half
    segment = mmap.mmap(-1, total)
    engines = [_FakeEngine(size) for _ in range(size)]
    return [
        arena_mod.Arena(segment, size, r, half, engines[r], list(range(size)), 10.0, pids=pids)
        for r in range(size)
    ]


def _in_threads(arenas, fn):
    results, errors = [None] * len(arenas), []

    def run(r):
        try:
            results[r] = fn(arenas[r], r)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(arenas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return results


def _announce(a, kind, count):
    a.call_seq += 1
    a.begin(a.call_seq, kind, 0, 0, count)


@settings(max_examples=25, deadline=None)
@given(
    size=st.integers(2, 4),
    n=st.integers(0, 3000),
    half=st.sampled_from([4096, 8192]),
    one_shot=st.sampled_from([0, 1 << 20]),
    calls=st.integers(1, 3),
)
def test_arena_algorithms_match_numpy(size, n, half, one_shot, calls):
    """Back-to-back all-reduces, reduce-scatters (uneven), all-gathers (uneven) and broadcasts,
    with rounds much smaller than the arrays, give numpy's answer on every rank, and every
    rank's all-reduce is bit-identical (the same sums in the same order), whether the rank
    reduced in place or into another array (which ranks do which alternates; an out-of-place
    rank's input stays as it was)."""
    arenas = _thread_arenas(size, half)
    rng = np.random.default_rng(n)
    inputs = rng.standard_normal((calls, size, n)).astype(np.float32)
    blocks = [n // size + (q % 2) * 3 for q in range(size)]  # uneven blocks
    scatter_in = rng.integers(-100, 100, (size, sum(blocks))).astype(np.int64)

    def rank_fn(a, r):
        out = []
        for c in range(calls):
            x = inputs[c, r].copy()
            _announce(a, 2, n)
            if (c + r) % 2:
                result = np.full_like(x, np.nan)
                local.all_reduce(a, x, np.add, result)
                np.testing.assert_array_equal(x, inputs[c, r])
                x = result
            else:
                local.all_reduce(a, x, np.add)
            out.append(x)
        ins = np.split(scatter_in[r], np.cumsum(blocks)[:-1])
        got = np.empty(blocks[r], dtype=np.int64)
        _announce(a, 6, sum(blocks))
        local.reduce_scatter(a, got, list(ins), np.add, blocks)
        outs = [np.full(blocks[q], -1, dtype=np.int64) for q in range(size)]  # own one too
        _announce(a, 5, sum(blocks))
        local.all_gather(a, outs, ins[r], blocks)
        root = size - 1
        b = inputs[0, r].copy()
        _announce(a, 3, n)
        local.broadcast(a, b, root)
        local.barrier(a)
        return out, got, outs, b

    default, local.ONE_SHOT_BYTES = local.ONE_SHOT_BYTES, one_shot
    try:
        results = _in_threads(arenas, rank_fn)
    finally:
        local.ONE_SHOT_BYTES = default
    starts = np.concatenate([[0], np.cumsum(blocks)])
    for r, (out, got, outs, b) in enumerate(results):
        for c in range(calls):
            np.testing.assert_allclose(out[c], inputs[c].sum(axis=0), rtol=1e-5, atol=1e-5)
            assert out[c].tobytes() == results[0][0][c].tobytes()
        expected = scatter_in[:, starts[r] : starts[r + 1]].sum(axis=0)
        np.testing.assert_array_equal(got, expected)
        for q in range(size):
            np.testing.assert_array_equal(outs[q], scatter_in[q, starts[q] : starts[q + 1]])
        np.testing.assert_array_equal(b, inputs[0, size - 1])


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("crowded", [False, True])
def test_arena_all_reduce_reduces_in_one_phase_while_the_peers_copies_fit(size, crowded):
    """One sync while the ``p - 1`` peers' copies a rank reads fit ``ONE_SHOT_BYTES`` (times
    ``CROWDED_ONE_SHOT_FACTOR`` when the host runs more ranks than cores), the two-phase
    path's syncs from one element more; numpy's sum either way."""
    bound = local.ONE_SHOT_BYTES * (local.CROWDED_ONE_SHOT_FACTOR if crowded else 1)
    fits = bound // (4 * (size - 1))  # float32 elements
    arenas = _thread_arenas(size, 4 * (fits + 1))
    for a in arenas:
        a.crowded = crowded

    def rank_fn(a, r):
        syncs = []
        for n in (fits, fits + 1):
            data = np.full(n, r + 1.0, np.float32)
            before = a.stage
            _announce(a, 1, n)
            local.all_reduce(a, data, np.add)
            syncs.append(a.stage - before)
            assert (data == size * (size + 1) / 2).all()
        return syncs

    for one_shot, two_phase in _in_threads(arenas, rank_fn):
        assert one_shot == 1 and two_phase > 1, (one_shot, two_phase)


@pytest.mark.parametrize("size", [3, 4, 8])
@pytest.mark.parametrize(
    "dtype, ufunc",
    [(np.float32, np.add), (np.int8, np.add), (np.int64, np.maximum), (np.bool_, np.logical_or)],
)
def test_arena_one_element_all_reduce(size, dtype, ufunc):
    """One element takes its own path (one reduction over every rank's first element, in both
    halves): numpy's answer on every rank, the same bits everywhere, and an int8 sum wraps as
    numpy's does."""
    arenas = _thread_arenas(size, 4096)
    rng = np.random.default_rng(size)
    inputs = (rng.standard_normal((3, size, 1)) * 60).astype(dtype)

    def rank_fn(a, r):
        out = []
        for c in range(3):
            x = inputs[c, r].copy()
            _announce(a, 2, 1)
            local.all_reduce(a, x, ufunc)
            out.append(x)
        return out

    results = _in_threads(arenas, rank_fn)
    for c in range(3):
        expected = ufunc.reduce(inputs[c], axis=0, dtype=dtype)  # int8 wraps, as one call does
        for out in results:
            assert out[c].dtype == dtype
            np.testing.assert_allclose(out[c], expected, rtol=1e-6)
            assert out[c].tobytes() == results[0][c].tobytes()


def test_arena_keeps_each_ranks_last_word_for_its_peers():
    """A rank that gives up leaves the rank it blamed in its control line; the peers read it by
    engine rank (a sub-group's ranks are not the engine's), and nothing after a close."""
    segment = mmap.mmap(-1, arena_mod._control_bytes(3) + 6 * 4096)
    engine_ranks = [1, 4, 6]
    a, b, c = (
        arena_mod.Arena(segment, 3, r, 4096, _FakeEngine(7), engine_ranks, 10.0) for r in range(3)
    )
    assert a.blamed_by(4) is None and a.blamed_by(6) is None
    b.record_failure(6)
    c.record_failure(-1)  # gave up, blaming no rank (an abort, a mismatch)
    assert a.blamed_by(4) == 6 and c.blamed_by(4) == 6
    assert a.blamed_by(6) is None and a.blamed_by(1) is None
    assert a.blamed_by(5) is None  # not a member
    a.close()
    assert a.blamed_by(4) is None
    a.record_failure(4)  # after the close: ignored, no error
    assert c.blamed_by(1) is None


def test_arena_mismatch_is_found_even_without_waiting():
    """Both ranks publish before either looks: each still compares the other's announcement."""
    a, b = _thread_arenas(2, 4096)

    def rank_fn(arena, r):
        arena.begin(1, 2, 11, 1, 12 if r == 1 else 10)
        try:
            arena.sync()
        except CollectiveMismatchError as exc:
            return str(exc)
        return "no error"

    messages = _in_threads([a, b], rank_fn)
    for r, message in enumerate(messages):
        assert "12 elements" in message and "10 elements" in message, message
        assert f"rank {1 - r} called" in message, message


@settings(max_examples=20, deadline=None)
@given(
    size=st.integers(2, 4),
    half=st.sampled_from([4096, 8192]),
    seed=st.integers(0, 2**16),
    big=st.integers(0, 5000),
    read_in_place=st.booleans(),
)
def test_arena_all_to_all_uneven_over_rounds_that_ranks_need_in_different_numbers(
    size, half, seed, big, read_in_place
):
    """Random uneven blocks (empty ones too), one of which may need many rounds while every
    other fits in one (only its sender knows before the first sync), twice in a row with the
    own block in place: every rank gets exactly what was sent to it, through the segment or,
    where the group may read its members' memory, the large block copied out of its sender's."""
    arenas = _thread_arenas(size, half, [os.getpid()] * size if read_in_place else None)
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 40, (size, size))
    counts[0, size - 1] = big  # counts[s, d]: elements rank s sends rank d
    sent = {(s, d): rng.standard_normal(counts[s, d]) for s in range(size) for d in range(size)}

    def rank_fn(a, r):
        got = []
        for call in range(2):
            ins = [sent[r, d] + call for d in range(size)]
            outs = [np.full(counts[s, r], np.nan) for s in range(size)]
            outs[r] = ins[r]  # the own block in place
            _announce(a, 7, 0)
            local.all_to_all(a, outs, ins)
            got.append(outs)
        return got

    for r, got in enumerate(_in_threads(arenas, rank_fn)):
        for call, outs in enumerate(got):
            for s in range(size):
                np.testing.assert_array_equal(outs[s], sent[s, r] + call)


def test_arena_all_to_all_takes_one_round_when_only_an_own_block_is_large():
    """A rank's own block never goes through the segment, so it adds no round."""
    arenas = _thread_arenas(2, 4096)

    def rank_fn(a, r):
        ins = [np.full(10_000 if q == r else 3, float(r)) for q in range(2)]
        outs = [np.empty(10_000 if q == r else 3) for q in range(2)]
        before = a.round
        _announce(a, 7, 0)
        local.all_to_all(a, outs, ins)
        return a.round - before, outs

    for r, (rounds, outs) in enumerate(_in_threads(arenas, rank_fn)):
        assert rounds == 1
        assert (outs[r] == r).all() and (outs[1 - r] == 1 - r).all()


@pytest.mark.parametrize("n", [4, 4000])
def test_arena_all_to_all_size_mismatch_raises_on_both_ranks_of_the_pair(n):
    """Rank 1 expects n + 1 elements from rank 0, which sends n: both name the other and the
    sizes, before any element is copied out (of the segment, or for a large block, of the
    sender's memory)."""
    arenas = _thread_arenas(2, 4096, [os.getpid()] * 2)

    def rank_fn(a, r):
        ins = [np.ones(n), np.ones(n)]
        outs = [np.zeros(n + 1 if r == 1 else n), np.zeros(n)]
        _announce(a, 7, 0)
        try:
            local.all_to_all(a, outs, ins)
        except CollectiveMismatchError as exc:
            return str(exc), outs
        return "no error", outs

    for r, (message, outs) in enumerate(_in_threads(arenas, rank_fn)):
        assert f"rank {r}: all_to_all" in message and f"rank {1 - r} sends" in message, message
        assert f"receives {n + 1}" in message or f"expects {n + 1}" in message, message
        assert not outs[1 - r].any(), "nothing of the peer's block was copied out"


def test_arena_all_to_all_reads_a_large_block_in_place_in_one_round_and_one_more_sync():
    """A block too large for one round, where the group may read its members' memory, is
    copied out of its sender's array: no rounds for it, one sync more so that its sender keeps
    it until then; the small blocks still go through the segment."""
    arenas = _thread_arenas(3, 4096, [os.getpid()] * 3)

    def rank_fn(a, r):
        sizes = [[2, 5000, 3], [4, 1, 6], [7, 8, 9]]  # sizes[s][d]: rank s sends rank d
        ins = [np.full(sizes[r][d], 10.0 * r + d) for d in range(3)]
        outs = [np.empty(sizes[s][r]) for s in range(3)]
        round_before, stage_before = a.round, a.stage
        _announce(a, 7, 0)
        local.all_to_all(a, outs, ins)
        return a.round - round_before, a.stage - stage_before, outs

    for r, (rounds, syncs, outs) in enumerate(_in_threads(arenas, rank_fn)):
        assert (rounds, syncs) == (1, 2), "the large block took no round, and one sync more"
        for s in range(3):
            assert (outs[s] == 10.0 * s + r).all()


def test_arena_all_to_all_that_cannot_read_a_peer_raises_naming_the_switch():
    """When the kernel refuses the read (here: a process that does not exist), the rank says
    which peer's block it could not read and how to send it through the segment instead, and
    fails its engine, so that its peers hear of it too."""
    arenas = _thread_arenas(2, 4096, [2**22 + 12345] * 2)

    def rank_fn(a, r):
        ins = [np.ones(5000), np.ones(5000)]
        _announce(a, 7, 0)
        try:
            local.all_to_all(a, [np.zeros(5000), np.zeros(5000)], ins)
        except pb.PluribusError as exc:
            return str(exc), a.engine.failed is exc
        return "no error", False

    for r, (message, failed) in enumerate(_in_threads(arenas, rank_fn)):
        assert f"rank {r}: all_to_all" in message and f"rank {1 - r}'s block" in message, message
        assert "PLURIBUS_GLOO_CMA=0" in message, message
        assert failed, "the engine failed with it"


def test_arena_broadcast_roots_must_agree():
    a, b = _thread_arenas(2, 4096)

    def rank_fn(arena, r):
        arena.begin(1, 3, 11, 0, 100, root=r)  # each rank thinks it is the root
        try:
            local.broadcast(arena, np.zeros(100, dtype=np.float32), r)
        except CollectiveMismatchError as exc:
            return str(exc)
        return "no error"

    for message in _in_threads([a, b], rank_fn):
        assert "root 0" in message and "root 1" in message, message


def _setup(
    ranks_ok: list[bool], cma_ok: list[bool] | None = None, crowded: list[bool] | None = None
):
    """Run the store agreement on threads; return each rank's arena (or None). ``crowded``:
    whether each rank's engine counts more ranks than cores."""
    size = len(ranks_ok)
    store = PrefixStore("g", HashStore())
    engines = [_FakeEngine(size) for _ in range(size)]
    for engine, says in zip(engines, crowded or [False] * size, strict=True):
        engine.yield_while_spinning = says
    opts = [
        {"arena": "1" if ok else "0", "arena_bytes": 4096, "cma": cma_ok is None or cma_ok[r]}
        for r, ok in enumerate(ranks_ok)
    ]
    got = [None] * size

    def run(r):
        got[r] = arena_mod.open_arena(engines[r], list(range(size)), r, store, 10.0, opts[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


def test_arena_setup_agrees_and_leaves_nothing_in_dev_shm():
    before = gloo_segments()
    arenas = _setup([True, True, True])
    assert all(a is not None for a in arenas)
    assert gloo_segments() == before, "the segment is unlinked once every rank has mapped it"
    arenas[2].halves[0][2][:4] = 7  # one mapping: what rank 2 writes, rank 0 reads
    assert list(arenas[0].halves[0][2][:4]) == [7, 7, 7, 7]
    for a in arenas:
        a.close()
    # one member that cannot (or will not) share: nobody uses an arena
    assert _setup([True, False, True]) == [None, None, None]
    assert gloo_segments() == before


def test_arena_setup_agrees_whether_members_may_read_each_others_memory():
    """Every member of a group reads a word from every other before the group copies blocks
    out of its members' memory; one member that will not makes the whole group keep the
    segment."""
    arenas = _setup([True, True, True])
    assert all(a.pids == [os.getpid()] * 3 for a in arenas)  # threads: one process
    for a in arenas:
        a.close()
    arenas = _setup([True, True, True], cma_ok=[True, False, True])
    assert all(a is not None and a.pids is None for a in arenas)
    for a in arenas:
        a.close()


def test_arena_setup_agrees_whether_ranks_outnumber_cores():
    """The all-reduce chooses its algorithm by it, so one member that counts more ranks than
    cores (pinned to fewer CPUs) makes every member's arena crowded; each still waits its own
    way."""
    for says, agreed in (([False, False, False], False), ([False, True, False], True)):
        arenas = _setup([True, True, True], crowded=says)
        assert [a.crowded for a in arenas] == [agreed] * 3
        assert [a.yield_mask == 0 for a in arenas] == says
        for a in arenas:
            a.close()


# -- real processes -------------------------------------------------------------------------------


def _every_collective(sub_ranks: list[int]) -> dict:
    """Every arena collective on the world and on a sub-group, against numpy."""
    rank, size = pb.get_rank(), pb.get_world_size()
    sub = pb.new_group(sub_ranks)
    arena = pb.get_default_group().backends["cpu"].arena
    report = {"world": arena is not None, "cma": arena is not None and arena.pids is not None}
    if rank in sub_ranks:
        report["sub"] = sub.backends["cpu"].arena is not None
    for group, members in ((None, list(range(size))), (sub, sub_ranks)):
        if rank not in members:
            continue
        p, me = len(members), members.index(rank)
        for n in (0, 3, 1000, 70_000):  # 70 000 float64: several rounds of 64 KiB halves
            for dtype, op, reference in (
                (np.float64, pb.ReduceOp.SUM, np.sum),
                (np.int32, pb.ReduceOp.MAX, np.max),
                (np.float32, pb.ReduceOp.AVG, np.mean),
            ):
                every = [(np.arange(n) % 97 * (j + 1)).astype(dtype) for j in members]
                x = every[me].copy()
                pb.all_reduce(x, op=op, group=group)
                np.testing.assert_allclose(x, reference(np.stack(every), axis=0), rtol=1e-6)
                into = np.empty_like(x)  # out of place on odd ranks, in place on even ones
                y = every[me].copy()
                pb.all_reduce(y, op=op, group=group, out=into if me % 2 else None)
                np.testing.assert_array_equal(into if me % 2 else y, x)
                if me % 2:
                    np.testing.assert_array_equal(y, every[me])
            blocks = [n // p + (q == 0) for q in range(p)]
            ins = [np.full(blocks[q], me + 10 * q, dtype=np.int64) for q in range(p)]
            out = np.empty(blocks[me], dtype=np.int64)
            pb.reduce_scatter(out, ins, group=group)
            assert (out == sum(j + 10 * me for j in range(p))).all()
            outs = [np.empty(blocks[q], dtype=np.float32) for q in range(p)]
            pb.all_gather(outs, np.full(blocks[me], me, dtype=np.float32), group=group)
            assert all((outs[q] == q).all() for q in range(p))
            for root in range(p):
                b = np.full(n, me, dtype=np.uint8)
                pb.broadcast(b, src=members[root], group=group)
                assert (b == root).all()
            sends = [np.full(blocks[(me + q) % p], 100 * me + q, np.int16) for q in range(p)]
            got = [np.empty(blocks[(j + me) % p], np.int16) for j in range(p)]
            pb.all_to_all(got, sends, group=group)
            assert all((got[j] == 100 * j + me).all() for j in range(p))
            pb.barrier(group=group)
    if rank in sub_ranks:
        engine = sub.backends["cpu"].engine
        before = len(engine.arenas)
        pb.destroy_process_group(sub)
        report["released"] = len(engine.arenas) == before - 1
    return report


def _offer_a_word(conn) -> None:
    word = np.array([12345], dtype=np.uint64)
    conn.send((os.getpid(), word.ctypes.data))
    conn.poll(30)  # keep the word until the reader is done (or gave up)


def _processes_may_read_each_other() -> bool:
    """Whether this host lets one process read another's memory (what the arena checks)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    child = context.Process(target=_offer_a_word, args=(there,))
    child.start()
    try:
        if not here.poll(30):
            raise TimeoutError("the child process did not offer its word within 30 s")
        pid, address = here.recv()
        seen = np.zeros(1, dtype=np.uint64)
        try:
            cma.read(pid, seen, address)
        except OSError:
            return False
        return int(seen[0]) == 12345
    finally:
        here.send("done")
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join(5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "world, sub_ranks, read_in_place",
    [(2, [0, 1], "1"), (2, [0, 1], "0"), (3, [0, 2], "1")],
)
def test_gloo_arena_collectives_on_processes(world, sub_ranks, read_in_place):
    """Also with large all-to-all blocks read out of their senders' memory where the host
    allows it, and with that turned off."""
    got = run_ranks(
        _every_collective,
        world,
        "gloo",
        "processes",
        timeout=90,
        args=(sub_ranks,),
        env={"PLURIBUS_GLOO_CMA": read_in_place},
        backend_options={"arena_bytes": 64 << 10},
    )
    expected = read_in_place == "1" and _processes_may_read_each_other()
    for rank, report in enumerate(got):
        assert report["world"], "every rank is on this host: the world uses an arena"
        assert report["cma"] == expected, report
        if rank in sub_ranks:
            assert report["sub"], "so does a sub-group of them"
            assert report["released"], "destroying the sub-group unmaps its arena"


def _uses_arena() -> bool:
    pb.all_reduce(np.ones(10))
    return pb.get_default_group().backends["cpu"].arena is not None


@pytest.mark.timeout(60)
def test_gloo_arena_can_be_turned_off():
    assert run_ranks(_uses_arena, 2, "gloo", "processes", env={"PLURIBUS_GLOO_ARENA": "0"}) == [
        False,
        False,
    ]


def _out_of_place(sizes: tuple[int, ...]) -> bool:
    """``all_reduce(x, out=y)`` against numpy, the input untouched; returns whether the group
    has an arena."""
    rank, size = pb.get_rank(), pb.get_world_size()
    for n in sizes:
        for op, reference in ((pb.ReduceOp.SUM, np.sum), (pb.ReduceOp.AVG, np.mean)):
            every = [np.arange(n, dtype=np.float64) * (j + 1) for j in range(size)]
            x = every[rank].copy()
            out = np.full_like(x, np.nan)
            pb.all_reduce(x, op, out=out)
            np.testing.assert_allclose(out, reference(np.stack(every), axis=0), rtol=1e-12)
            np.testing.assert_array_equal(x, every[rank])
    return pb.get_default_group().backends["cpu"].arena is not None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arena", ["1", "0"])
def test_gloo_out_of_place_all_reduce_on_the_arena_and_over_tcp(arena):
    """One-shot, rounds of small halves (arena) or direct exchange and ring (TCP)."""
    got = run_ranks(
        _out_of_place,
        3,
        "gloo",
        "processes",
        timeout=90,
        env={"PLURIBUS_GLOO_ARENA": arena},
        args=((0, 5, 3000, 200_000),),
        backend_options={"arena_bytes": 64 << 10},
    )
    assert got == [arena == "1"] * 3


def _arena_vs_ring_collective() -> None:
    x = np.ones(100, dtype=np.float32)
    if pb.get_rank() == 1:
        pb.gather(x, [np.empty_like(x) for _ in range(2)], dst=1)  # not an arena collective
    else:
        pb.all_reduce(x)


def _all_to_all_sizes_disagree() -> None:
    rank = pb.get_rank()
    outputs = [np.empty(3 if rank == 1 else 2), np.empty(2)]  # rank 1 expects 3 from rank 0
    pb.all_to_all(outputs, [np.ones(2), np.ones(2)])


def _mismatch_on_both_ranks(fn) -> dict:
    """Run ``fn`` on 2 gloo processes; both must fail at once with a CollectiveMismatchError.
    Returns each rank's error."""
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(fn, 2, "gloo", "processes", timeout=30)
    assert time.monotonic() - start < 20, "a mismatch is reported at once, not at a timeout"
    errors = {e.rank: e for e in info.value.errors}
    assert sorted(errors) == [0, 1]
    for error in errors.values():
        assert error.kind == "CollectiveMismatchError", error
    return errors


@pytest.mark.timeout(60)
def test_gloo_arena_all_to_all_sizes_that_disagree_raise_on_both_ranks():
    for rank, error in _mismatch_on_both_ranks(_all_to_all_sizes_disagree).items():
        assert f"rank {1 - rank} sends this rank 2 elements" in error.message, error.message


def _one_rank_late() -> float:
    group = pb.new_group([0, 1], timeout=1.5)
    if pb.get_rank() == 1:
        time.sleep(4)
        return 0.0
    start = time.monotonic()
    with pytest.raises(DistTimeoutError, match="rank 0"):
        pb.all_reduce(np.ones(10), group=group)
    return time.monotonic() - start


@pytest.mark.timeout(60)
def test_gloo_arena_mismatch_with_a_ring_collective_raises_on_every_rank():
    for error in _mismatch_on_both_ranks(_arena_vs_ring_collective).values():
        assert "gather" in error.message and "all_reduce" in error.message, error.message


@pytest.mark.timeout(60)
def test_gloo_arena_wait_times_out():
    took = run_ranks(_one_rank_late, 2, "gloo", "processes", timeout=30)[0]
    assert 1.0 < took < 3.5, took


# -- symmetric allocations: the zero-copy all-reduce ----------------------------------------------


def _symmetric_arrays(arenas, elements: int, number: int = 1):
    """One mapping holding every rank's ``elements`` float32s, registered for each thread-rank's
    arena as :func:`pluribus_gloo.symmetric.allocate` registers a process's; the mapping lives
    as long as the returned arrays."""
    size = len(arenas)
    stride = -(-elements * 4 // mmap.PAGESIZE) * mmap.PAGESIZE
    mapping = mmap.mmap(-1, stride * size)
    arrays = []
    for r, a in enumerate(arenas):
        array = np.frombuffer(mapping, np.float32, elements, offset=r * stride)
        start = array.__array_interface__["data"][0]
        alloc = symmetric.Allocation(number, a, stride, start, start + array.nbytes, mapping)
        symmetric._register(alloc, mapping)
        arrays.append(array)
    return arrays


@settings(max_examples=30, deadline=None)
@given(
    size=st.integers(2, 4),
    n=st.integers(1, 5000),
    offset=st.integers(0, 300),
    modes=st.lists(st.sampled_from(["shared", "shared", "plain", "elsewhere"]), min_size=4),
    one_shot=st.sampled_from([0, 1 << 20]),
)
def test_arena_symmetric_all_reduce_matches_the_copying_path(size, n, offset, modes, one_shot):
    """Ranks pass a slice of their symmetric array (``shared``), a plain copy (``plain``) or
    another slice of it (``elsewhere``): every rank gets the rank-order sum bit for bit, as the
    copying path computes it, the zero-copy path runs exactly when every rank passed the same
    slice and the array is above the one-shot size, and a second call right after (which
    overwrites the arrays) is right too: no rank left while a peer still read its array."""
    modes = modes[:size]
    arenas = _thread_arenas(size, 4096)
    arrays = _symmetric_arrays(arenas, offset + n + 7)
    rng = np.random.default_rng(n + offset)
    inputs = rng.standard_normal((2, size, n)).astype(np.float32)
    zero_copy = []
    original = local._all_reduce_symmetric

    def counted(arena, parts, ufunc):
        zero_copy.append(arena.rank)
        original(arena, parts, ufunc)

    def rank_fn(a, r):
        out = []
        for c in range(2):
            at = offset + 7 if modes[r] == "elsewhere" else offset
            x = arrays[r][at : at + n] if modes[r] != "plain" else np.empty(n, np.float32)
            x[...] = inputs[c, r]
            _announce(a, 2, n)
            local.all_reduce(a, x, np.add)
            out.append(x.copy())
        return out

    default, local.ONE_SHOT_BYTES = local.ONE_SHOT_BYTES, one_shot
    local._all_reduce_symmetric = counted
    try:
        results = _in_threads(arenas, rank_fn)
    finally:
        local.ONE_SHOT_BYTES = default
        local._all_reduce_symmetric = original
    for c in range(2):
        expected = inputs[c, 0].copy()
        for j in range(1, size):
            expected += inputs[c, j]
        for r in range(size):
            np.testing.assert_array_equal(results[r][c], expected)
    one_shot_path = n * 4 * size <= one_shot and n * 4 <= 4096
    same_place = len(set(modes)) == 1 and modes[0] != "plain"  # every rank "elsewhere" agrees
    agreed = same_place and not one_shot_path
    assert sorted(zero_copy) == (sorted(list(range(size)) * 2) if agreed else [])


# -- symmetric allocations: zero-copy broadcast, all-gather and reduce-scatter ---------------------


def _rank_order_block(inputs: np.ndarray, r: int, lo: int, hi: int) -> np.ndarray:
    """Block ``r`` reduced as the copying reduce-scatter does: own first, then the others in
    rank order."""
    total = inputs[r, lo:hi].copy()
    for j in range(len(inputs)):
        if j != r:
            total += inputs[j, lo:hi]
    return total


@settings(max_examples=30, deadline=None)
@given(
    size=st.integers(2, 4),
    n=st.integers(1, 2000),
    offset=st.integers(0, 300),
    modes=st.lists(st.sampled_from(["shared", "shared", "plain", "elsewhere"]), min_size=4),
    threshold=st.sampled_from([0, 1 << 30]),
)
def test_arena_symmetric_gather_scatter_broadcast_match_the_copying_path(
    size, n, offset, modes, threshold
):
    """Broadcast, all-gather and reduce-scatter (uneven blocks) on a slice of each rank's
    symmetric array (``shared``), a plain copy (``plain``) or another slice (``elsewhere``),
    each twice in a row (the second call overwrites the inputs: no rank left while a peer still
    read them): every rank gets numpy's answer bit for bit as the copying path computes it, and
    the zero-copy path runs exactly when every rank passed the same slice above the size."""
    modes = modes[:size]
    blocks = [n + (q % 2) * 3 for q in range(size)]
    bounds = np.concatenate([[0], np.cumsum(blocks)])
    total = int(bounds[-1])
    arenas = _thread_arenas(size, 4096)
    arrays = _symmetric_arrays(arenas, offset + total + 7)
    rng = np.random.default_rng(n + offset)
    inputs = rng.standard_normal((2, size, total)).astype(np.float32)
    agreed_calls = []
    original = local._announce_and_agree

    def counted(arena, data, found):
        peers = original(arena, data, found)
        agreed_calls.append(peers is not None)
        return peers

    def input_of(r, c, count):
        at = offset + 7 if modes[r] == "elsewhere" else offset
        x = arrays[r][at : at + count] if modes[r] != "plain" else np.empty(count, np.float32)
        x[...] = inputs[c, r, :count]
        return x

    def rank_fn(a, r):
        got = []
        for c in range(2):
            x = input_of(r, c, n)
            _announce(a, 3, n)
            local.broadcast(a, x, c % size)
            got.append(("broadcast", x.copy()))
            x = input_of(r, c, n)
            outs = [np.zeros(n, np.float32) for _ in range(size)]  # own one too
            _announce(a, 4, n * size)
            local.all_gather(a, outs, x, [n] * size)
            got.append(("all_gather", np.stack(outs)))
            x = input_of(r, c, total)
            out = np.empty(blocks[r], np.float32)
            _announce(a, 5, total)
            parts = [x[bounds[q] : bounds[q + 1]] for q in range(size)]
            local.reduce_scatter(a, out, parts, np.add, [part.size for part in parts])
            got.append(("reduce_scatter", out))
        return got

    default, local.ZERO_COPY_BYTES = local.ZERO_COPY_BYTES, threshold
    local._announce_and_agree = counted
    try:
        results = _in_threads(arenas, rank_fn)
    finally:
        local.ZERO_COPY_BYTES = default
        local._announce_and_agree = original
    for r in range(size):
        for c in range(2):
            (_, bcast), (_, gathered), (_, reduced) = results[r][3 * c : 3 * c + 3]
            np.testing.assert_array_equal(bcast, inputs[c, c % size, :n])
            np.testing.assert_array_equal(gathered, inputs[c, :, :n])
            lo, hi = bounds[r], bounds[r + 1]
            np.testing.assert_array_equal(reduced, _rank_order_block(inputs[c], r, lo, hi))
    agreed = len(set(modes)) == 1 and modes[0] != "plain"
    if threshold:
        assert agreed_calls == []
    else:
        assert agreed_calls == [agreed] * (6 * size)

"""One dispatch path: synchronous calls skip pluggy only where no plugin could tell, asynchronous
calls reach a backend's native start, and the flight recorder sees what a wrapper sees."""

from __future__ import annotations

import numpy as np
import pluribus as pb
import pytest
from pluribus import hookimpl, hookspecs
from pluribus.builtin import threads
from pluribus.debug import flight_recorder
from pluribus.operations import OPERATIONS
from pluribus.testing import run_ranks
from pluribus.work import CompletedWork


class Counting:
    @hookimpl(wrapper=True)
    def pluribus_all_reduce(self, group, array, op, async_op):
        self.calls = getattr(self, "calls", 0) + 1
        return (yield)


@pytest.mark.timeout(60)
def test_a_plugin_registered_mid_run_sees_the_next_synchronous_call():
    counting = Counting()
    manager = pb.get_plugin_manager()

    def body():
        group = pb.get_default_group()
        pb.all_reduce(np.ones(2))  # caches the direct all_reduce for float64 SUM
        before = group.direct("all_reduce", "cpu")
        pb.barrier()
        if pb.get_rank() == 0:
            manager.register(counting, name="test-late")
        pb.barrier()
        pb.all_reduce(np.ones(2))
        return before is not None, group.direct("all_reduce", "cpu") is None

    try:
        assert run_ranks(body, 2) == [(True, True)] * 2
    finally:
        manager.unregister(name="test-late")
    assert counting.calls == 2


@pytest.mark.timeout(60)
def test_hook_call_monitoring_turns_the_shortcut_off_until_undone():
    manager = pb.get_plugin_manager()
    seen = []

    def body():
        group = pb.get_default_group()
        undo = manager.add_hookcall_monitoring(lambda name, impls, kw: seen.append(name), print)
        try:
            pb.all_reduce(np.ones(2))
            monitored = group.direct("all_reduce", "cpu")
        finally:
            undo()
        return monitored is None, group.direct("all_reduce", "cpu") is not None

    assert run_ranks(body, 1) == [(True, True)]
    assert seen.count("pluribus_all_reduce") == 1


class Started(threads.ThreadsBackend):
    """A threads backend that says it starts every operation natively."""

    started: list[str] = []

    def start(self, name, args):
        self.started.append(name)
        self.all_reduce_natively(*args)
        return CompletedWork("native")

    def all_reduce_natively(self, array, op):
        array *= self.size  # every rank holds the same ones: the sum


@hookimpl
def pluribus_backends():
    def create(ctx):
        backend = threads.create(ctx)
        backend.__class__ = Started
        return backend

    yield pb.BackendSpec(name="started", create=create)


@pytest.fixture
def started_backend():
    """The "started" backend offered for one test; yields the list of names its start saw."""
    import sys

    manager = pb.get_plugin_manager()
    manager.register(sys.modules[__name__], name="test-started")
    registry = pb.plugins.registry()
    registry.specs = None  # offer the new backend
    Started.started = []
    try:
        yield Started.started
    finally:
        manager.unregister(name="test-started")
        registry.specs = None
        pb.plugins._probe_cache.pop("started", None)


@pytest.mark.timeout(60)
def test_async_calls_use_the_backends_start_and_sync_calls_its_blocking_path(started_backend):
    def body():
        x = np.ones(3)
        work = pb.all_reduce(x, async_op=True)
        assert work.result() == "native"
        y = np.ones(3)
        pb.all_reduce(y)  # the generic algorithm over send/recv
        return x.tolist(), y.tolist()

    assert run_ranks(body, 2, backend="started", mode="threads") == [([2.0] * 3, [2.0] * 3)] * 2
    assert started_backend == ["all_reduce", "all_reduce"]


@pytest.mark.timeout(60)
def test_async_out_of_place_on_a_backend_without_it_starts_the_in_place_form_on_out(
    started_backend,
):
    """The core copies the input into ``out`` and asks the backend's start for "all_reduce" on
    ``out``: a start that knows only its own operations never sees "all_reduce_into"."""

    def body():
        x, out = np.ones(3), np.zeros(3)
        work = pb.all_reduce(x, async_op=True, out=out)
        assert work.result() == "native"
        y, out_sync = np.ones(3), np.zeros(3)
        pb.all_reduce(y, out=out_sync)  # copy, then the generic algorithm on out
        return x.tolist(), out.tolist(), y.tolist(), out_sync.tolist()

    got = run_ranks(body, 2, backend="started", mode="threads")
    assert got == [([1.0] * 3, [2.0] * 3, [1.0] * 3, [2.0] * 3)] * 2
    assert started_backend == ["all_reduce", "all_reduce"]


@pytest.mark.timeout(60)
def test_ranks_may_mix_in_place_and_out_of_place_under_the_mismatch_detector(monkeypatch):
    """Both forms meet each other (the same messages), so PLURIBUS_DEBUG=DETAIL lets ranks mix
    them, and still names a real mismatch between them."""
    from pluribus.errors import CollectiveMismatchError

    monkeypatch.setenv("PLURIBUS_DEBUG", "DETAIL")

    def body():
        rank = pb.get_rank()
        x, out = np.full(4, rank + 1.0), np.zeros(4)
        pb.all_reduce(x, out=out) if rank else pb.all_reduce(x)
        mixed = (out if rank else x).tolist()
        with pytest.raises(CollectiveMismatchError, match="all_reduce") as info:
            if rank:
                pb.all_reduce(np.ones(5), out=np.zeros(5))
            else:
                pb.all_reduce(np.ones(4))
        return mixed, "shape=(5,)" in str(info.value) and "shape=(4,)" in str(info.value)

    try:
        assert run_ranks(body, 2) == [([3.0] * 4, True)] * 2
    finally:
        monkeypatch.delenv("PLURIBUS_DEBUG")
        from pluribus.debug import detail

        detail.detector.enabled = detail.enabled_by_env()
        detail.set_registered(detail.detector, "debug-detail-calls", detail.detector.enabled)


@pytest.mark.timeout(60)
def test_checks_still_run_on_every_call_after_the_first():
    def body():
        pb.all_reduce(np.ones(8))  # caches float64 SUM on the default group
        errors = []
        for bad, op in (
            (np.ones((4, 4))[:, 0], pb.ReduceOp.SUM),  # not contiguous
            (np.ones(8), pb.ReduceOp.BAND),  # bitwise op on floats
            ([1.0, 2.0], pb.ReduceOp.SUM),  # not an array
        ):
            with pytest.raises((ValueError, TypeError)) as info:
                pb.all_reduce(bad, op)
            errors.append(str(info.value))
        read_only = np.ones(8)
        read_only.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            pb.all_reduce(read_only)
        x = np.ones(8)
        pb.all_reduce(x, out=np.empty(8))  # caches float64 SUM for out= too
        for bad in (x, x[:4], np.empty(9), np.empty(8, np.float32), read_only, np.empty(16)[::2]):
            with pytest.raises((ValueError, TypeError), match=f"rank {pb.get_rank()}"):
                pb.all_reduce(x, out=bad)
        whole = np.zeros(12)
        with pytest.raises(ValueError, match="overlaps"):
            pb.all_reduce(whole[:8], out=whole[4:])
        return errors

    for errors in run_ranks(body, 2):
        assert "not contiguous" in errors[0]
        assert "BAND needs an integer" in errors[1]
        assert "must be a numpy or cupy array" in errors[2]


def _collectives_twice_then_bad_input():
    """Run in a rank: see the test below."""
    from pluribus import distributed

    p, r = pb.get_world_size(), pb.get_rank()
    group = pb.get_default_group()
    x = np.full(4, r + 1.0)
    gathered, part, b = np.empty(4 * p), np.empty(2), np.full(3, float(r))
    pb.all_gather(gathered, x)
    pb.reduce_scatter(part, np.arange(2.0 * p))
    pb.broadcast(b, src=p - 1)
    sends, got = np.arange(3.0 * p) + 100 * r, np.empty(3 * p)
    pb.all_to_all_single(got, sends)
    cached = sorted(name for name in group.shortcuts if name != "all_reduce")
    checks, check_array = [], distributed.check_array
    distributed.check_array = lambda *args, **kwargs: checks.append(args)
    try:
        pb.all_gather(gathered, x)
        pieces = [np.empty(4) for _ in range(p)]
        pb.all_gather(pieces, x)  # the list form
        pb.reduce_scatter(part, np.arange(2.0 * p))
        pb.broadcast(b, src=p - 1)
        pb.all_to_all_single(got, sends)
        listed = [np.empty(3) for _ in range(p)]
        pb.all_to_all(listed, [sends[3 * q : 3 * q + 3] for q in range(p)])
    finally:
        distributed.check_array = check_array
    assert np.array_equal(gathered, np.repeat(np.arange(1.0, p + 1), 4))
    assert np.array_equal(np.concatenate(pieces), gathered)
    assert np.array_equal(part, np.arange(2.0 * r, 2.0 * r + 2) * p)
    assert np.array_equal(b, np.full(3, p - 1.0))
    expected = np.concatenate([np.arange(3.0 * r, 3.0 * r + 3) + 100 * q for q in range(p)])
    assert np.array_equal(got, expected) and np.array_equal(np.concatenate(listed), expected)
    read_only = np.empty(4 * p)
    read_only.flags.writeable = False
    errors = []
    for call in (
        lambda: pb.all_gather(np.empty(4 * p + 1), x),  # wrong size
        lambda: pb.all_gather(np.empty(8 * p)[::2], x),  # not contiguous
        lambda: pb.all_gather(read_only, x),
        lambda: pb.all_gather(np.empty(4 * p, np.float32), x),  # another dtype
        lambda: pb.all_gather([np.empty(4)] * (p - 1), x),  # a list one short
        lambda: pb.all_gather(None, x),  # not an array
        lambda: pb.reduce_scatter(part, np.arange(2.0 * p + 1)),  # wrong size
        lambda: pb.reduce_scatter(part, np.arange(2.0 * p), pb.ReduceOp.BAND),
        lambda: pb.reduce_scatter(np.empty(4)[::2], np.arange(2.0 * p)),  # not contiguous
        lambda: pb.broadcast(np.empty(6)[::2], src=0),  # not contiguous
        lambda: pb.broadcast(b, src=p),  # not a member
        lambda: pb.all_to_all_single(np.empty(6 * p)[::2], sends),  # not contiguous
        lambda: pb.all_to_all_single(got, sends, [1] * p),  # split sizes: too few rows
        lambda: pb.all_to_all_single(np.empty(3 * p, np.float32), sends),  # another dtype
        lambda: pb.all_to_all([np.empty(3)] * (p + 1), [sends[:3]] * p),  # one output too many
        lambda: pb.all_to_all([np.empty(4)] * p, [sends[:3]] * p),  # own block of other size
        lambda: pb.all_to_all([read_only[:3]] * p, [sends[:3]] * p),
    ):
        with pytest.raises((ValueError, TypeError), match=f"rank {r}") as info:
            call()
        errors.append(str(info.value))
    pb.all_gather(gathered, x * 2)  # nothing of the refused calls was sent
    assert np.array_equal(gathered, np.repeat(np.arange(2.0, 2 * p + 1, 2), 4))
    recorded = [(e["op"], e["state"], e["shape"]) for e in flight_recorder.recorder.snapshot()]
    return cached, checks, errors, recorded


@pytest.mark.timeout(60)
def test_shortcuts_skip_only_what_the_first_call_settled():
    """After a checked call, the next synchronous all_gather, reduce_scatter, broadcast and
    all_to_all with the same array type, dtype and op skip the checks that call settled, and
    still refuse, on every call and before anything is sent, what a call can get wrong on its
    own; the flight recorder sees the calls that take the shortcut."""
    results = run_ranks(
        _collectives_twice_then_bad_input,
        2,
        backend="gloo",
        env={flight_recorder.SIZE_ENV: "64"},
    )
    for cached, checks, errors, recorded in results:
        assert cached == ["all_gather", "all_to_all", "broadcast", "reduce_scatter"]
        assert checks == []
        assert "has 9 elements" in errors[0] and "not contiguous" in errors[1]
        assert "read-only" in errors[2] and "dtype float32" in errors[3]
        assert "list has 1 arrays" in errors.pop(4) and "numpy or cupy array" in errors.pop(4)
        assert "has 5 elements" in errors[4] and "BAND needs an integer" in errors[5]
        assert "not contiguous" in errors[6] and "not contiguous" in errors[7]
        assert "src=2 is not a member" in errors[8]
        assert "not contiguous" in errors[9] and "must be 2 non-negative numbers" in errors[10]
        assert "dtype float32" in errors[11] and "needs 2 inputs and outputs" in errors[12]
        assert "differ in size" in errors[13] and "read-only" in errors[14]
        once = [("all_gather", [4]), ("reduce_scatter", [2]), ("broadcast", [3])]
        once += [("all_to_all", [3])]
        twice = once + once[:1] + once + [("all_to_all", [3])]  # the list forms twice
        assert [(op, shape) for op, _, shape in recorded[:10]] == twice
        assert {state for _, state, _ in recorded[:10]} == {"completed"}


class Failing:
    @hookimpl(tryfirst=True)
    def pluribus_all_reduce(self, group, array, op, async_op):
        raise RuntimeError(f"wire cut on rank {group.rank}")


@pytest.mark.timeout(60)
def test_the_flight_recorder_records_synchronous_calls_and_their_failures(monkeypatch):
    monkeypatch.setenv(flight_recorder.SIZE_ENV, "8")
    recorder = flight_recorder.recorder
    recorder.entries.clear()
    manager = pb.get_plugin_manager()

    def body():
        rank = pb.get_rank()
        x = np.ones((2, 3), dtype=np.float32)
        pb.broadcast(x, src=0)
        pb.all_reduce(x, pb.ReduceOp.MAX)
        pb.all_reduce(x, pb.ReduceOp.MAX)  # the public all_reduce's cached shortcut
        pb.all_reduce(x, pb.ReduceOp.MAX, out=np.empty_like(x))  # the same shortcut, out=
        manager.register(Failing(), name=f"test-failing-{rank}")
        try:
            with pytest.raises(RuntimeError, match="wire cut"):
                pb.all_reduce(x)
        finally:
            manager.unregister(name=f"test-failing-{rank}")

    try:
        run_ranks(body, 1)
        entries = recorder.snapshot()
    finally:
        monkeypatch.delenv(flight_recorder.SIZE_ENV)
        recorder.configure()
    assert [(e["op"], e["seq"], e["state"]) for e in entries] == [
        ("broadcast", 1, "completed"),
        ("all_reduce", 2, "completed"),
        ("all_reduce", 3, "completed"),
        ("all_reduce_into", 4, "completed"),
        ("all_reduce", 5, "failed"),
    ]
    assert entries[2]["shape"] == [2, 3] and entries[2]["dtype"] == "float32"
    assert entries[2]["reduce_op"] == "max" and entries[2]["bytes"] == 24
    assert entries[3]["shape"] == [2, 3] and entries[3]["reduce_op"] == "max"
    assert entries[0]["root"] == 0
    assert "RuntimeError: wire cut on rank 0" in entries[4]["error"]
    wrappers = [i for i in manager.hook.pluribus_all_reduce.get_hookimpls() if i.wrapper]
    assert not wrappers, "the recorder is the core's, not a hook wrapper"


@pytest.mark.timeout(60)
def test_the_flight_recorder_keeps_no_array_alive_and_describes_list_operations(monkeypatch):
    """Every array a call passes, also in lists and in second place (all_reduce's ``out=``), is
    freed when the caller drops it; the entries still give shapes and bytes."""
    import gc
    import weakref

    monkeypatch.setenv(flight_recorder.SIZE_ENV, "16")
    recorder = flight_recorder.recorder
    recorder.entries.clear()
    refs = []

    def body():
        x = np.ones(6, dtype=np.float32)
        out = np.empty_like(x)
        gathered = [np.empty(6, np.float32) for _ in range(2)]
        pieces = [np.ones(3, np.float64), np.ones(3, np.float64)]
        target = np.empty(3, np.float64)
        pb.all_reduce(x, out=out)
        pb.all_gather(gathered, x)
        pb.reduce_scatter(target, pieces)
        pb.barrier()
        refs.extend(weakref.ref(a) for a in (x, out, *gathered, *pieces, target))

    try:
        run_ranks(body, 2)
        gc.collect()
        alive = [r() is not None for r in refs]  # before snapshot(), which rewrites entries
        entries = recorder.snapshot()
    finally:
        monkeypatch.delenv(flight_recorder.SIZE_ENV)
        recorder.configure()
    assert not any(alive), f"the recorder kept arrays alive: {alive}"
    assert len(entries) == 8 and {e["state"] for e in entries} == {"completed"}  # two ranks
    by_op = {e["op"]: e for e in entries}
    assert set(by_op) == {"all_reduce_into", "all_gather", "reduce_scatter", "barrier"}
    assert by_op["all_gather"]["shape"] == [6] and by_op["all_gather"]["bytes"] == 24
    assert by_op["reduce_scatter"]["dtype"] == "float64"
    assert by_op["reduce_scatter"]["bytes"] == 48  # the inputs it reduces
    assert by_op["barrier"]["shape"] is None and by_op["barrier"]["bytes"] == 0


def test_every_operation_hook_takes_the_tables_arguments():
    for op in OPERATIONS.values():
        code = getattr(hookspecs, op.hook_name).__code__
        assert code.co_varnames[: code.co_argcount] == ("group", *op.args, "async_op")
    assert not hasattr(hookspecs, "pluribus_bind_collective")


def test_the_key_array_and_written_arguments_come_from_the_table():
    a, b = np.ones(2), np.zeros(2)
    assert OPERATIONS["all_to_all"].key_array(([b], [a])) is a
    assert OPERATIONS["gather"].written_indices == (1,)
    assert OPERATIONS["barrier"].key_array(()) is None
    assert not OPERATIONS["send"].collective

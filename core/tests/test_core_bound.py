"""Bound collectives: synchronous calls skip the per-call hooks only where that changes nothing a
plugin can see."""

from __future__ import annotations

import numpy as np
import pluribus as pb
import pytest
from pluribus import hookimpl
from pluribus.debug import flight_recorder
from pluribus.testing import run_ranks


class Counting:
    """A wrapper on the per-call hook and, when ``binds``, on the bound function too."""

    def __init__(self, binds: bool):
        self.hook_calls = 0
        self.bound_calls = 0
        if binds:
            self.pluribus_bind_collective = self._bind

    @hookimpl(wrapper=True)
    def pluribus_all_reduce(self, group, array, op, async_op):
        self.hook_calls += 1
        return (yield)

    @hookimpl(wrapper=True)
    def _bind(self, group, collective, device):
        bound = yield
        if bound is None:
            return None

        def counted(*args):
            self.bound_calls += 1
            bound(*args)

        return counted


@pytest.fixture
def plugin(request):
    manager = pb.get_plugin_manager()
    counting = Counting(binds=request.param)
    manager.register(counting, name="test-counting")
    yield counting
    manager.unregister(name="test-counting")


def _reduce_twice():
    x = np.full(4, pb.get_rank() + 1.0)
    pb.all_reduce(x)
    pb.all_reduce(x, async_op=True).wait()
    return x.tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plugin", [True], indirect=True)
def test_sync_calls_take_the_bound_function_and_async_calls_the_hook(plugin):
    assert run_ranks(_reduce_twice, 2) == [[6.0] * 4] * 2  # (1 + 2) * 2
    assert (plugin.bound_calls, plugin.hook_calls) == (2, 2)  # one of each, on each rank


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plugin", [False], indirect=True)
def test_a_plugin_that_does_not_bind_sees_every_call(plugin):
    def body():
        bound_while_registered = pb.get_default_group().bound("all_reduce", "cpu")
        return _reduce_twice(), bound_while_registered

    results = run_ranks(body, 2)
    assert [r[0] for r in results] == [[6.0] * 4] * 2
    assert all(r[1] is None for r in results)
    assert plugin.hook_calls == 4


@pytest.mark.timeout(60)
def test_a_plugin_registered_later_unbinds_the_groups():
    counting = Counting(binds=False)
    manager = pb.get_plugin_manager()

    def body():
        rank = pb.get_rank()
        group = pb.get_default_group()
        before = group.bound("all_reduce", "cpu")
        pb.barrier()
        if rank == 0:
            manager.register(counting, name="test-late")
        pb.barrier()
        pb.all_reduce(np.ones(2))
        return before is not None, group.bound("all_reduce", "cpu") is None

    try:
        assert run_ranks(body, 2) == [(True, True)] * 2
    finally:
        manager.unregister(name="test-late")
    assert counting.hook_calls == 2


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
        return errors

    for errors in run_ranks(body, 2):
        assert "not contiguous" in errors[0]
        assert "BAND needs an integer" in errors[1]
        assert "must be a numpy or cupy array" in errors[2]


class Failing:
    @hookimpl(tryfirst=True)
    def pluribus_bind_collective(self, group, collective, device):
        if collective != "all_reduce":
            return None

        def fail(array, op):
            raise RuntimeError(f"wire cut on rank {group.rank}")

        return fail


@pytest.mark.timeout(60)
def test_the_flight_recorder_records_bound_calls_and_their_failures():
    recorder = flight_recorder.FlightRecorder(size=8)
    manager = pb.get_plugin_manager()
    manager.register(recorder, name="test-recorder")

    def body():
        rank = pb.get_rank()
        x = np.ones((2, 3), dtype=np.float32)
        pb.broadcast(x, src=0)
        pb.all_reduce(x, pb.ReduceOp.MAX)
        manager.register(Failing(), name=f"test-failing-{rank}")
        try:
            with pytest.raises(RuntimeError, match="wire cut"):
                pb.all_reduce(x)
        finally:
            manager.unregister(name=f"test-failing-{rank}")

    try:
        run_ranks(body, 1)
    finally:
        manager.unregister(recorder)
    entries = recorder.snapshot()
    assert [(e["op"], e["seq"], e["state"]) for e in entries] == [
        ("broadcast", 1, "completed"),
        ("all_reduce", 2, "completed"),
        ("all_reduce", 3, "failed"),
    ]
    assert entries[1]["shape"] == [2, 3] and entries[1]["dtype"] == "float32"
    assert entries[1]["reduce_op"] == "max" and entries[1]["bytes"] == 24
    assert entries[0]["root"] == 0
    assert "RuntimeError: wire cut on rank 0" in entries[2]["error"]

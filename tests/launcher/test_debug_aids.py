"""The debugging wrappers: mismatch detector, flight recorder, trace files."""

from __future__ import annotations

import json
import threading

import numpy as np
import pluribus
import pytest
from launcher_helpers import (
    assert_no_processes,
    clean_env,
    job_backends,
    run_launcher,
    write_script,
)
from pluribus import CollectiveMismatchError, HashStore
from pluribus.debug import detail, flight_recorder, trace
from pluribus.debug.common import CollectiveCall


def run_thread_ranks(size: int, body, timeout: float = 30.0) -> list:
    """Run ``body(rank)`` as ``size`` ranks of the threads backend; results or exceptions."""
    store = HashStore(timeout)
    results: list = [None] * size

    def rank_main(rank: int) -> None:
        pluribus.init_process_group(
            "threads", rank=rank, world_size=size, store=store, timeout=timeout
        )
        try:
            results[rank] = body(rank)
        except BaseException as exc:
            results[rank] = exc
        finally:
            pluribus.destroy_process_group()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


@pytest.fixture
def detail_on(monkeypatch):
    monkeypatch.setenv(detail.DEBUG_ENV, "DETAIL")
    yield
    monkeypatch.delenv(detail.DEBUG_ENV)
    detail.detector.enabled = detail.enabled_by_env()


# -- mismatch detector, in one process ------------------------------------------------------------


@pytest.mark.timeout(60)
def test_detector_names_the_rank_with_another_shape(detail_on):
    def body(rank):
        x = np.ones(5 if rank == 2 else 4, dtype=np.float32)
        pluribus.all_reduce(x)

    results = run_thread_ranks(4, body)
    assert all(isinstance(r, CollectiveMismatchError) for r in results), results
    messages = {str(r).split(": ", 1)[1] for r in results}
    assert len(messages) == 1  # the same verdict on every rank
    message = messages.pop()
    assert "ranks 0, 1, 3 called all_reduce(shape=(4,), dtype=float32, op=sum)" in message
    assert "rank 2 called all_reduce(shape=(5,), dtype=float32, op=sum)" in message
    assert "collective #1 on group 'world'" in message


@pytest.mark.timeout(60)
def test_detector_catches_different_operations_dtypes_and_roots(detail_on):
    def body(rank):
        x = np.zeros(3, dtype=np.float32)
        pluribus.broadcast(x, src=0)  # agreed: no error
        if rank == 1:
            pluribus.broadcast(x, src=1)
        else:
            pluribus.broadcast(x, src=0)

    results = run_thread_ranks(3, body)
    assert all(isinstance(r, CollectiveMismatchError) for r in results), results
    assert "collective #2" in str(results[0])
    assert "rank 1 called broadcast(shape=(3,), dtype=float32, root=1)" in str(results[0])

    def other_op(rank):
        x = np.zeros(3, dtype=np.float64 if rank == 0 else np.float32)
        if rank == 2:
            pluribus.barrier()
        else:
            pluribus.all_reduce(x)

    results = run_thread_ranks(3, other_op)
    text = str(results[1])
    assert "rank 0 called all_reduce(dtype=float64" not in text  # shapes shown for all_reduce
    assert "rank 0 called all_reduce(shape=(3,), dtype=float64, op=sum)" in text
    assert "rank 1 called all_reduce(shape=(3,), dtype=float32, op=sum)" in text
    assert "rank 2 called barrier()" in text


@pytest.mark.timeout(60)
def test_detector_checks_uneven_sizes_against_what_peers_send(detail_on):
    def agreed(rank):
        mine = np.full(rank + 1, rank, dtype=np.int32)
        outputs = [np.empty(r + 1, dtype=np.int32) for r in range(3)]
        pluribus.all_gather(outputs, mine)
        return [o.tolist() for o in outputs]

    results = run_thread_ranks(3, agreed)
    assert results == [[[0], [1, 1], [2, 2, 2]]] * 3

    def disagreed(rank):
        mine = np.full(rank + 1, rank, dtype=np.int32)
        sizes = [1, 2, 3] if rank != 0 else [1, 3, 3]  # rank 0 expects 3 elements from rank 1
        outputs = [np.empty(n, dtype=np.int32) for n in sizes]
        pluribus.all_gather(outputs, mine)

    results = run_thread_ranks(3, disagreed)
    assert all(isinstance(r, CollectiveMismatchError) for r in results), results
    assert "rank 0 expects 3 elements from rank 1, which has 2" in str(results[2])


@pytest.mark.timeout(60)
def test_fingerprints_go_through_the_store_when_the_group_has_no_cpu_backend():
    def body(rank):
        group = pluribus.get_default_group()
        first = detail._exchange_over_store(group, 1, f"one from {rank}".encode())
        second = detail._exchange_over_store(group, 2, f"two from {rank}".encode())
        return first, second, group.store

    results = run_thread_ranks(3, body)
    for first, second, _ in results:
        assert first == [f"one from {r}".encode() for r in range(3)]
        assert second == [f"two from {r}".encode() for r in range(3)]
    store = results[0][2]
    prefix = "pluribus-debug/world"
    # each call's keys are deleted once every rank is past it: only the last call's remain
    assert [store.check([f"{prefix}/1/{r}"]) for r in range(3)] == [False] * 3
    assert [store.check([f"{prefix}/2/{r}"]) for r in range(3)] == [True] * 3


def test_find_mismatch_rules_for_lists_and_roots():
    def fp(op, **kw):
        base = {
            "seq": 1,
            "op": op,
            "shape": None,
            "numel": 0,
            "dtype": "float32",
            "reduce_op": None,
            "root": None,
            "in_sizes": None,
            "out_sizes": None,
        }
        return base | kw

    ranks = [0, 1]
    good = [
        fp("all_to_all", in_sizes=[1, 2], out_sizes=[1, 3]),
        fp("all_to_all", in_sizes=[3, 4], out_sizes=[2, 4]),
    ]
    assert detail.find_mismatch(good, ranks, "world") is None
    bad = [
        fp("all_to_all", in_sizes=[1, 2], out_sizes=[1, 3]),
        fp("all_to_all", in_sizes=[5, 4], out_sizes=[2, 4]),
    ]
    assert "rank 0 expects 3 elements from rank 1, which has 5" in detail.find_mismatch(
        bad, ranks, "world"
    )
    scatter = [fp("scatter", root=0, numel=2, in_sizes=[2, 2]), fp("scatter", root=0, numel=1)]
    assert "rank 1 expects 1 elements from rank 0, which has 2" in detail.find_mismatch(
        scatter, ranks, "g"
    )
    skipped = [fp("all_reduce", seq=4, shape=[2]), fp("all_reduce", seq=5, shape=[2])]
    assert "called #4 all_reduce" in detail.find_mismatch(skipped, ranks, "g")


@pytest.mark.timeout(30)
def test_detector_is_off_by_default(monkeypatch):
    monkeypatch.delenv(detail.DEBUG_ENV, raising=False)
    calls = []
    original = detail.MismatchDetector.check
    monkeypatch.setattr(
        detail.MismatchDetector,
        "check",
        lambda self, call: calls.append(call) or original(self, call),
    )

    def body(rank):
        x = np.ones(4, dtype=np.float32)
        pluribus.all_reduce(x)
        return x.tolist()

    assert run_thread_ranks(2, body) == [[2.0] * 4] * 2
    assert calls == []


# -- mismatch detector and trace across processes (pluribus-run) --------------------------------

MISMATCH_JOB = """
import os
import numpy as np
import pluribus
pluribus.init_process_group(os.environ["JOB_BACKEND"], timeout=30)
rank = pluribus.get_rank()
x = np.ones(4, dtype=np.float32)
pluribus.all_reduce(x)
y = np.ones(6 if rank == 2 else 5, dtype=np.float32)
pluribus.all_reduce(y)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", job_backends())
def test_detector_across_processes_raises_on_every_rank(tmp_path, backend):
    script = write_script(tmp_path, "mismatch.py", MISMATCH_JOB, storewire=True)
    env = clean_env(PLURIBUS_DEBUG="DETAIL", JOB_BACKEND=backend)
    result = run_launcher("--nproc-per-node", "4", str(script), env=env)
    assert result.returncode == 1
    expected = (
        "ranks 0, 1, 3 called all_reduce(shape=(5,), dtype=float32, op=sum); "
        "rank 2 called all_reduce(shape=(6,), dtype=float32, op=sum)"
    )
    assert "collective #2 on group 'world'" in result.stderr
    assert "CollectiveMismatchError" in result.stderr and expected in result.stderr
    summary = result.stderr[result.stderr.index("=" * 72) :]
    root_part = summary.split("other ranks:")[0]
    assert "raised CollectiveMismatchError" in root_part
    # the summary's traceback leaves out the hook machinery between the call and the check
    assert "frames of pluggy and pluribus.debug hook wrappers not shown" in root_part
    assert "_multicall" not in root_part and "pluribus.all_reduce(y)" in root_part
    for line in summary.split("other ranks:")[1].splitlines()[1:4]:
        # every other rank raised too, unless the launcher stopped it first
        assert "raised CollectiveMismatchError" in line or "stopped by the launcher" in line
    assert_no_processes(str(tmp_path))


TRACED_JOB = """
import os
import numpy as np
import pluribus
pluribus.init_process_group(os.environ["JOB_BACKEND"], timeout=30)
x = np.ones(256, dtype=np.float64)
pluribus.all_reduce(x)
pluribus.broadcast(x, src=1)
work = pluribus.all_reduce(x, async_op=True)
work.wait()
pluribus.barrier()
pluribus.destroy_process_group()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", job_backends())
def test_trace_files_are_valid_chrome_traces(tmp_path, backend):
    script = write_script(tmp_path, "traced.py", TRACED_JOB, storewire=True)
    traces = tmp_path / "traces"
    env = clean_env(PLURIBUS_TRACE=str(traces), JOB_BACKEND=backend)
    result = run_launcher("--nproc-per-node", "2", str(script), env=env)
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        data = json.loads((traces / f"trace_r{rank}.json").read_text())
        events = [e for e in data["traceEvents"] if e["ph"] == "X"]
        assert [e["name"] for e in events] == ["all_reduce", "broadcast", "all_reduce", "barrier"]
        for e in events:
            assert e["pid"] == rank and isinstance(e["ts"], int) and e["dur"] >= 0
        assert events[0]["args"]["bytes"] == 256 * 8
        assert events[1]["args"]["root"] == 1
        assert events[0]["tid"] != events[2]["tid"]  # async calls get their own track
        assert events[0]["ts"] <= events[1]["ts"] <= events[3]["ts"]
        names = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
        assert names == {"world", "world async"}
    merged = json.loads((traces / "trace_all_ranks.json").read_text())
    assert sorted({e["pid"] for e in merged["traceEvents"] if e["ph"] == "X"}) == [0, 1]
    assert "trace_all_ranks.json (open it in ui.perfetto.dev)" in result.stderr


# -- flight recorder ------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_flight_recorder_keeps_the_last_calls_and_dumps_them(tmp_path, monkeypatch):
    monkeypatch.setenv(flight_recorder.SIZE_ENV, "5")
    recorder = flight_recorder.recorder
    recorder.entries.clear()
    try:

        def body(rank):
            x = np.ones(3, dtype=np.int64)
            for _ in range(6):
                pluribus.all_reduce(x)
            pluribus.all_reduce(x, async_op=True).wait()

        run_thread_ranks(1, body)
    finally:
        monkeypatch.delenv(flight_recorder.SIZE_ENV)
    entries = recorder.snapshot()
    assert len(entries) == 5  # a ring: the oldest two are gone
    assert [e["seq"] for e in entries] == [3, 4, 5, 6, 7]
    assert all(e["state"] == "completed" and e["end"] >= e["start"] for e in entries)
    assert entries[-1]["op"] == "all_reduce" and entries[-1]["bytes"] == 24
    path = recorder.dump("test", tmp_path)
    record = json.loads(path.read_text())
    assert path.name == "flight_recorder_r0.json" and record["reason"] == "test"
    assert flight_recorder.stuck_in(record) is None
    record["entries"][2]["state"] = "started"
    assert flight_recorder.stuck_in(record)["seq"] == 5
    recorder.configure()


@pytest.mark.timeout(30)
def test_aids_that_are_off_add_no_wrapper_to_the_hooks(monkeypatch, tmp_path):
    monkeypatch.delenv(detail.DEBUG_ENV, raising=False)
    monkeypatch.delenv(trace.TRACE_ENV, raising=False)
    monkeypatch.setenv(flight_recorder.SIZE_ENV, "0")
    manager = pluribus.get_plugin_manager()

    def wrappers(rank):
        impls = manager.hook.pluribus_all_reduce.get_hookimpls()
        return sorted(i.plugin_name for i in impls if i.wrapper)

    assert run_thread_ranks(1, wrappers) == [[]]
    monkeypatch.setenv(flight_recorder.SIZE_ENV, "16")
    monkeypatch.setenv(detail.DEBUG_ENV, "detail")
    # the flight recorder is the core's own: no wrapper, so it records the calls the detector
    # stops, and a job under pluribus-run keeps the shortcut past pluggy
    assert run_thread_ranks(1, wrappers) == [["debug-detail-calls"]]
    assert flight_recorder.recorder.enabled
    monkeypatch.delenv(detail.DEBUG_ENV)
    monkeypatch.delenv(flight_recorder.SIZE_ENV)
    # by default the recorder runs only where its dumps have somewhere to go (pluribus-run)
    monkeypatch.setenv(flight_recorder.DIR_ENV, str(tmp_path))
    assert run_thread_ranks(1, wrappers) == [[]]
    assert flight_recorder.recorder.enabled
    monkeypatch.delenv(flight_recorder.DIR_ENV)
    assert run_thread_ranks(1, wrappers) == [[]]
    assert not flight_recorder.recorder.enabled


def test_trace_of_a_failed_call_records_the_error(tmp_path):
    tracer = trace.Tracer(str(tmp_path))
    tracer.rank = 0

    class Group:
        name, global_rank = "world", 0

    call = CollectiveCall("barrier", Group())
    gen = tracer.around(call)
    next(gen)
    with pytest.raises(RuntimeError):
        gen.throw(RuntimeError("peer died"))
    tracer.write()
    data = json.loads((tmp_path / "trace_r0.json").read_text())
    (event,) = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert event["name"] == "barrier" and event["args"]["error"] == "RuntimeError: peer died"

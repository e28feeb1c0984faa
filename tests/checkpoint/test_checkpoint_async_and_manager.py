"""async_save snapshots the state and commits in the background without disturbing the
training loop's collectives; its errors reach the caller; CheckpointManager numbers, finds and
retires steps."""

from __future__ import annotations

import os

import numpy as np
import pluribus as pb
import pytest
from pluribus import checkpoint
from pluribus.checkpoint import CheckpointError, CheckpointManager
from pluribus.dtensor import Shard, distribute_tensor, init_device_mesh
from pluribus.testing import RanksFailed, require_backend, run_ranks

pytestmark = pytest.mark.timeout(60)


def _state(value: float):
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    full = np.arange(10.0) + value
    return {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "b": np.full(3, value),
        "step": int(value),
    }


def _async_snapshot_body(path, explicit_world=False):
    state = _state(1.0)
    group = pb.get_default_group() if explicit_world else None
    future = checkpoint.async_save(state, path, process_group=group)
    # the training step goes on: the arrays change and collectives run on the default group
    state["w"].to_local()[...] = -1
    state["b"][...] = -1
    for _ in range(20):
        x = np.ones(1000)
        pb.all_reduce(x)
        assert x[0] == pb.get_world_size()
    future.result()
    loaded = _state(0.0)
    checkpoint.load(loaded, path)
    return loaded["w"].full_tensor().tolist(), loaded["b"].tolist(), loaded["step"]


@pytest.mark.parametrize("explicit_world", [False, True])
def test_async_save_writes_the_snapshot_while_training_goes_on(tmp_path, explicit_world):
    """With no process group or the default one named: the background commit's collectives run
    on a group of their own either way."""
    results = run_ranks(_async_snapshot_body, 3, args=(str(tmp_path / "c"), explicit_world))
    for w, b, step in results:
        assert w == (np.arange(10.0) + 1).tolist() and b == [1.0] * 3 and step == 1


def _async_save_of_a_sub_group(path):
    sub = pb.new_group([0, 1])
    if pb.get_rank() > 1:
        return None
    try:
        checkpoint.async_save({"b": np.ones(3)}, path, process_group=sub)
    except ValueError as e:
        return str(e)


def test_async_save_of_a_sub_group_is_refused(tmp_path):
    errors = run_ranks(_async_save_of_a_sub_group, 3, args=(str(tmp_path / "c"),))
    for rank, error in enumerate(errors[:2]):
        assert error.startswith(f"rank {rank}: async_save(process_group=...) of a sub-group")
    assert not os.path.exists(tmp_path / "c")


def test_async_save_on_gloo_processes_overlaps_the_loops_collectives(tmp_path):
    """Real processes: the background commit's collectives (on its own group) run while the
    main thread all-reduces on the default group."""
    require_backend("gloo")
    results = run_ranks(_async_snapshot_body, 2, "gloo", args=(str(tmp_path / "c"),))
    for w, b, step in results:
        assert w == (np.arange(10.0) + 1).tolist() and b == [1.0] * 3 and step == 1


def _async_error_body(bad, good):
    failed = checkpoint.async_save(_state(1.0), bad)
    with pytest.raises(CheckpointError, match="cannot create"):
        checkpoint.async_save(_state(2.0), good)  # the next save reports the first's error
    assert failed.done()
    checkpoint.async_save(_state(3.0), good).result()
    with pytest.raises(CheckpointError, match="cannot create"):
        checkpoint.async_save(_state(4.0), bad).result()  # or wait() does
    checkpoint.save(_state(5.0), good)  # the error was raised once, not again here
    loaded = _state(0.0)
    checkpoint.load(loaded, good)
    return loaded["step"]


def test_an_error_in_the_background_reaches_the_caller_once(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert run_ranks(_async_error_body, 2, args=(str(blocker / "c"), str(tmp_path / "ok"))) == [
        5,
        5,
    ]


def _manager_body(directory, use_async):
    manager = CheckpointManager(directory, keep_last=2, async_save=use_async)
    assert manager.load_latest(_state(0.0)) is None
    for step in range(1, 6):
        manager.save(step, _state(float(step)))
    manager.wait()
    again = CheckpointManager(directory, keep_last=2)
    state = _state(0.0)
    assert again.load_latest(state) == 5
    return again.steps(), state["b"].tolist()


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_manager_numbers_steps_keeps_the_last_k_and_resumes_the_newest(tmp_path, use_async):
    directory = str(tmp_path / "run")
    for steps, b in run_ranks(_manager_body, 2, args=(directory, use_async)):
        assert steps == [4, 5] and b == [5.0] * 3
    assert sorted(os.listdir(directory)) == ["latest", "step-4", "step-5"]
    with open(os.path.join(directory, "latest")) as f:
        assert f.read() == "step-5\n"


def test_single_process_async_save_and_manager(tmp_path):
    state = {"x": np.arange(4.0), "n": 1}
    future = checkpoint.async_save(state, tmp_path / "c")
    state["x"][...] = 0
    future.result()
    out = {"x": np.zeros(4), "n": 0}
    checkpoint.load(out, tmp_path / "c")
    assert out["x"].tolist() == [0.0, 1.0, 2.0, 3.0] and out["n"] == 1
    manager = CheckpointManager(tmp_path / "run", keep_last=1)
    manager.save(7, state)
    assert manager.steps() == [7] and manager.load_latest(out) == 7
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def _rank_values_body(path, load_world):
    state = {"seed": pb.get_rank(), "w": np.ones(2)}
    if pb.get_world_size() != load_world:
        checkpoint.save(state, path)
        return None
    checkpoint.load(state, path)
    return state["seed"]


def test_values_that_differ_per_rank_come_back_to_each_rank_or_refuse_another_world(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(_rank_values_body, 2, args=(path, 0))
    assert checkpoint.read_metadata(path).rank_values == {"seed": [0, 1]}
    assert run_ranks(_rank_values_body, 2, args=(path, 2)) == [0, 1]
    with pytest.raises(RanksFailed, match="different value on each of 2 ranks"):
        run_ranks(_rank_values_body, 3, args=(path, 3))

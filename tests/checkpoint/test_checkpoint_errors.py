"""Bad input and damaged checkpoints: a clear error on every rank, naming what is wrong, and
the previous checkpoint untouched."""

from __future__ import annotations

import errno
import importlib
import json
import os
import resource
import signal

import numpy as np
import pluribus as pb
import pytest
from ckpt_cases import build_state, random_layout, save_body
from pluribus import checkpoint
from pluribus.checkpoint import CheckpointError
from pluribus.dtensor import Partial, Shard, distribute_tensor, init_device_mesh
from pluribus.testing import RanksFailed, run_ranks

pytestmark = pytest.mark.timeout(60)

LAYOUT2 = random_layout(np.random.default_rng(3), 2, (2,))
LAYOUT2["tensors"]["model.layers.0.weight"] = [[0, [4, 3]]]


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "c")
    assert run_ranks(save_body, 2, args=(LAYOUT2, path)) == [True, True]
    return path


def _load_into(path, edit=None, strict=True, only_rank=None):
    state = build_state(LAYOUT2, fill=False)
    if edit is not None and (only_rank is None or pb.get_rank() == only_rank):
        edit(state)
    checkpoint.load(state, path, strict=strict)
    return state


def _every_rank_says(excinfo, *words, world=2):
    errors = excinfo.value.errors
    assert [e.rank for e in errors] == list(range(world)), excinfo.value
    for e in errors:
        assert e.kind == "CheckpointError", excinfo.value
        for word in words:
            assert word in e.message, (word, e.message)


def _drop_bias(state):
    del state["model"]["layers"][0]["bias"]


def _add_extra(state):
    state["extra"] = np.zeros(3)


def test_missing_and_extra_keys_are_listed_and_strict_false_allows_them(saved):
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(_load_into, 2, args=(saved, _drop_bias))
    _every_rank_says(excinfo, "model.layers.0.bias", "strict=False")
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(_load_into, 2, args=(saved, _add_extra))
    _every_rank_says(excinfo, "extra", "missing from the checkpoint")
    states = run_ranks(_load_into, 2, args=(saved, _add_extra, False))
    assert states[0]["step"] == 1234 and not states[0]["extra"].any()


def _wrong_shape(state):
    state["model"]["embedding"] = np.zeros((4, 4))


def _wrong_dtype(state):
    state["model"]["embedding"] = np.zeros((4, 3), np.float32)


def test_shape_or_dtype_that_disagrees_fails_every_rank_even_if_only_one_is_wrong(saved):
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(_load_into, 2, args=(saved, _wrong_shape, True, 1))
    _every_rank_says(excinfo, "rank 1", "model.embedding", "[4, 3] float64", "[4, 4]")
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(_load_into, 2, args=(saved, _wrong_dtype))
    _every_rank_says(excinfo, "float32")


def test_newer_format_version_and_missing_checkpoint(saved, tmp_path):
    meta = os.path.join(saved, "metadata.json")
    with open(meta) as f:
        doc = json.load(f)
    doc["version"] = checkpoint.VERSION + 1
    with open(meta, "w") as f:
        json.dump(doc, f)
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(_load_into, 2, args=(saved,))
    _every_rank_says(excinfo, "newer", "upgrade pluribus")
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(_load_into, 2, args=(str(tmp_path / "nothing"),))
    _every_rank_says(excinfo, "is not a checkpoint")


def _data_file(path) -> str:
    return os.path.join(path, "rank-00000.safetensors")


def test_missing_data_file_is_named(saved):
    os.remove(_data_file(saved))
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(_load_into, 2, args=(saved,))
    _every_rank_says(excinfo, "rank-00000.safetensors", "cannot open")


def test_a_flipped_byte_names_file_tensor_and_chunk(saved):
    path = _data_file(saved)
    with open(path, "rb") as f:
        head = 8 + int.from_bytes(f.read(8), "little")
    with open(path, "r+b") as f:
        f.seek(head + 5)
        byte = f.read(1)
        f.seek(head + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(_load_into, 2, args=(saved,))
    _every_rank_says(excinfo, "checksum mismatch", "rank-00000.safetensors", "chunk at offsets")
    assert "of 'model." in excinfo.value.errors[0].message or "of 'optim." in str(excinfo.value)
    # verify=False is the user's explicit choice: the damaged value is then loaded as it is
    assert run_ranks(_load_unverified, 2, args=(saved,)) == [True, True]


def _load_unverified(path):
    checkpoint.load(build_state(LAYOUT2, fill=False), path, verify=False)
    return True


def test_a_truncated_file_is_detected(saved):
    path = _data_file(saved)
    os.truncate(path, os.path.getsize(path) - 7)
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(_load_into, 2, args=(saved,))
    _every_rank_says(excinfo, "truncated")


def _save_unsupported(path):
    state = build_state(LAYOUT2, fill=True)
    if pb.get_rank() == 1:
        state["bad"] = object()
    else:
        state["bad"] = 1
    checkpoint.save(state, path)


def _save_partial(path):
    mesh = init_device_mesh("cpu", (2,))
    checkpoint.save({"x": distribute_tensor(np.ones(4), mesh, [Partial()])}, path)


def test_bad_input_at_save_fails_every_rank_and_leaves_the_previous_checkpoint(saved):
    before = {n: os.path.getmtime(os.path.join(saved, n)) for n in os.listdir(saved)}
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(_save_unsupported, 2, args=(saved,))
    _every_rank_says(excinfo, "rank 1", "'bad' is a object", "nothing was saved")
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(_save_partial, 2, args=(saved,))
    _every_rank_says(excinfo, "Partial", "redistribute")
    assert {n: os.path.getmtime(os.path.join(saved, n)) for n in os.listdir(saved)} == before
    assert sorted(os.listdir(os.path.dirname(saved))) == ["c"]  # no temporary folder left
    assert run_ranks(_load_into, 2, args=(saved,))[0]["step"] == 1234


def _load_into_partial_and_scalar(path):
    """A Partial DTensor cannot take a value (each rank holds a term); a 0-d DTensor made by an
    operation (numpy gives a scalar there) is filled in place, and stays a DTensor."""
    mesh = init_device_mesh("cpu", (2,))
    checkpoint.save({"x": np.arange(4.0), "scale": np.array(2.5)}, path)
    state = {"x": distribute_tensor(np.zeros(4), mesh, [Partial()])}
    with pytest.raises(CheckpointError) as refused:
        checkpoint.load(state, path, strict=False)
    scale = distribute_tensor(np.array(1.0), mesh) * 2.0
    state = {"scale": scale}
    checkpoint.load(state, path, strict=False)
    assert state["scale"] is scale and scale.full_tensor() == 2.5
    return str(refused.value)


def test_a_partial_dtensor_is_refused_at_load_and_a_0d_one_is_filled_in_place(tmp_path):
    path = str(tmp_path / "c")
    for refused in run_ranks(_load_into_partial_and_scalar, 2, args=(path,)):
        assert "is a DTensor with placements [Partial()]" in refused
        assert "load into a Replicate (or Shard) DTensor" in refused


def test_a_full_disk_is_a_clear_error_and_the_previous_checkpoint_survives(tmp_path):
    """RLIMIT_FSIZE makes writes past 1 MiB fail with EFBIG, as a full disk fails them."""
    path = str(tmp_path / "c")
    checkpoint.save({"x": np.arange(10.0), "step": 1}, path)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, old[1]))
    try:
        with pytest.raises(CheckpointError, match="rank-00000.safetensors.*File too large"):
            checkpoint.save({"x": np.zeros(1 << 18), "step": 2}, path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)
    assert sorted(os.listdir(tmp_path)) == ["c"]
    state = {"x": np.zeros(10), "step": 0}
    checkpoint.load(state, path)
    assert state["step"] == 1 and (state["x"] == np.arange(10.0)).all()


def test_one_rank_out_of_space_fails_every_rank_and_removes_the_partial_save(saved, monkeypatch):
    save_module = importlib.import_module("pluribus.checkpoint.save")
    write_file = save_module.write_file

    def full_on_rank1(path, *args, **kwargs):
        if path.endswith("rank-00001.safetensors"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return write_file(path, *args, **kwargs)

    monkeypatch.setattr(save_module, "write_file", full_on_rank1)
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(save_body, 2, args=(LAYOUT2, saved))
    _every_rank_says(excinfo, "rank 1: writing", "No space left on device")
    assert sorted(os.listdir(os.path.dirname(saved))) == ["c"]
    assert run_ranks(_load_into, 2, args=(saved,))[0]["step"] == 1234


def _save_tp_pieces(path, drift):
    """A DTensor on the tp dimension of a 2 x 2 mesh: each dp replica writes the same boxes.
    With ``drift`` the second replica's values differ from the first's. Returns the error, caught
    here: a rank that raised first would abort the others' wait for the outcome."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    whole = np.arange(12.0).reshape(4, 3)
    if drift and mesh.get_local_rank("dp") == 1:
        whole = whole + 1.0
    try:
        checkpoint.save({"w": distribute_tensor(whole, mesh["tp"], [Shard(0)])}, path)
    except CheckpointError as e:
        return str(e)
    return None


def test_replicas_that_save_different_values_under_one_key_fail_every_rank(tmp_path):
    path = str(tmp_path / "c")
    # equal replicas: one copy kept
    assert run_ranks(_save_tp_pieces, 4, args=(path, False)) == [None] * 4
    np.testing.assert_array_equal(checkpoint.read_whole(path)["w"], np.arange(12.0).reshape(4, 3))
    before = {n: os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)}
    for error in run_ranks(_save_tp_pieces, 4, args=(path, True)):
        assert "ranks 0 and 2 save different values for the same piece of 'w'" in error
    assert {n: os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)} == before
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no temporary folder left


def _save_per_rank_statistics(path):
    """Plain arrays that differ between ranks for a reason (a DDP model's batch-norm running
    statistics, updated by each rank's own batches): saved, from one rank, as torch's DCP
    does."""
    rank = pb.get_rank()
    checkpoint.save({"running_mean": np.full(3, float(rank))}, path)
    return rank


def test_plain_arrays_that_differ_between_ranks_are_saved_from_one_rank(tmp_path):
    path = str(tmp_path / "c")
    assert run_ranks(_save_per_rank_statistics, 2, args=(path,)) == [0, 1]
    saved = checkpoint.read_whole(path)["running_mean"]
    assert saved.tolist() in ([0.0] * 3, [1.0] * 3)


# -- a sub-group names its ranks by their global rank ----------------------------------------


def _save_bad_dtype_in_sub_group(path: str):
    sub = pb.new_group([1, 2, 3])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    state = {"w": distribute_tensor(np.ones((4, 4)), mesh["tp"], [Shard(0)])}
    bad = pb.get_rank() == 3  # group rank 2
    state["x"] = np.zeros(2, np.complex64 if bad else np.float32)
    if pb.get_rank() == 0:
        return None
    try:
        checkpoint.save(state, path, process_group=sub)
    except CheckpointError as e:
        return str(e)
    return "saved"


def test_a_bad_entry_in_a_sub_group_save_names_the_global_rank(tmp_path):
    errors = run_ranks(_save_bad_dtype_in_sub_group, 4, args=(str(tmp_path / "c"),))
    for error in errors[1:]:
        assert "rank 3: state dict entry 'x' has dtype complex64" in error, error
        assert "rank 2: state dict entry" not in error, error


def _load_missing_key_in_sub_group(path: str):
    sub = pb.new_group([1, 2, 3])
    if pb.get_rank() == 0:
        return None
    state = {"w": np.arange(4.0)}
    checkpoint.save(state, path, process_group=sub)
    if pb.get_rank() == 3:  # group rank 2
        state["extra"] = np.zeros(2)
    try:
        checkpoint.load(state, path, process_group=sub)
    except CheckpointError as e:
        return str(e)
    return "loaded"


def test_a_bad_state_dict_in_a_sub_group_load_names_the_global_rank(tmp_path):
    errors = run_ranks(_load_missing_key_in_sub_group, 4, args=(str(tmp_path / "c"),))
    for error in errors[1:]:
        assert "rank 3: the state dict and the checkpoint hold different keys" in error, error

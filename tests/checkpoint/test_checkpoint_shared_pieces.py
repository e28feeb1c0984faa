"""A DTensor box that several ranks hold is written once, whichever meshes they hold it on (a
tensor-parallel piece under data parallelism, or ranks that no mesh dimension groups), by one
of its holders, spreading the bytes; the holders that do not write it still check that their
copy agrees, so replicas that drifted apart fail the save on every rank."""

from __future__ import annotations

import json
import os

import numpy as np
import pluribus as pb
import pytest
from pluribus import checkpoint
from pluribus.checkpoint import CheckpointError, planning
from pluribus.dtensor import (
    DeviceMesh,
    DTensor,
    Layout,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)
from pluribus.testing import require_backend, run_ranks

pytestmark = pytest.mark.timeout(60)


def _whole(i: int, shape=(8, 3)) -> np.ndarray:
    return np.arange(np.prod(shape), dtype=np.float64).reshape(shape) * (i + 1)


def _files(path: str) -> dict[str, dict]:
    """Each data file's safetensors header: tensor name -> dtype, shape, data_offsets."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            header.pop("__metadata__", None)
            out[name] = header
    return out


def _data_bytes(header: dict) -> int:
    return sum(end - begin for begin, end in (e["data_offsets"] for e in header.values()))


def _assert_one_copy(path: str) -> dict[str, int]:
    """Every box of every tensor is in exactly one file, and the files' bytes add up to one copy
    of every tensor; the data bytes of each file."""
    meta, files = checkpoint.read_metadata(path), _files(path)
    for key, info in meta.tensors.items():
        boxes = [(c.offsets, c.sizes) for c in info.chunks]
        assert len(set(boxes)) == len(boxes), (key, boxes)
        holding = sorted(f for f, header in files.items() if key in header)
        assert holding == sorted(c.file for c in info.chunks), (key, holding, info.chunks)
    assert sum(_data_bytes(h) for h in files.values()) == sum(
        info.nbytes for info in meta.tensors.values()
    )
    return {f: _data_bytes(h) for f, h in files.items()}


# -- a tensor-parallel DTensor under data parallelism ---------------------------------------------

TWO, THREE = (3, 3), (3, 4, 5)


def _tp_state(cols: tuple[int, ...], drift: bool = False, whole_array: int = 0) -> dict:
    """DTensors over ``mesh["tp"]`` of a 2 x 2 (dp x tp) mesh, as ``get_model_state_dict`` gives
    a tensor-parallel model, key ``w{i}`` of shape ``(8, cols[i])``: the dp replicas hold the
    same boxes (different values in the second replica's first key with ``drift``). Also a
    DTensor replicated on its own mesh and on the other dp replica, and optionally a whole
    array every rank holds."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    state: dict = {}
    for i, n in enumerate(cols):
        value = _whole(i, (8, n))
        if drift and i == 0 and mesh.get_local_rank("dp") == 1:
            value = value + 1.0
        state[f"w{i}"] = distribute_tensor(value, mesh["tp"], [Shard(0)])
    state["bias"] = distribute_tensor(np.arange(5.0), mesh["tp"], [Replicate()])
    if whole_array:
        state["emb"] = np.arange(float(whole_array))
    state["step"] = 7
    return state


def _save_tp(path: str, cols: tuple, drift: bool = False, use_async: bool = False, whole=0):
    """The error each rank raised, caught here: a rank that raised first would abort the
    others' wait for the outcome."""
    state = _tp_state(cols, drift, whole)
    try:
        if use_async:
            checkpoint.async_save(state, path).result()
        else:
            checkpoint.save(state, path)
    except CheckpointError as e:
        return str(e)
    return None


def _load_replicated(path: str, cols: tuple) -> bool:
    """Load into another layout: every key replicated over a 1-d mesh of the 4 ranks."""
    mesh = init_device_mesh("cpu", (4,))
    state = {
        f"w{i}": distribute_tensor(np.zeros((8, n)), mesh, [Replicate()])
        for i, n in enumerate(cols)
    }
    state["bias"] = distribute_tensor(np.zeros(5), mesh, [Shard(0)])
    state["step"] = 0
    checkpoint.load(state, path)
    for i, n in enumerate(cols):
        np.testing.assert_array_equal(state[f"w{i}"].to_local(), _whole(i, (8, n)))
    bias = state["bias"]
    np.testing.assert_array_equal(
        bias.to_local(), np.arange(5.0)[bias.layout.local_slices(mesh.coordinate)]
    )
    assert state["step"] == 7
    return True


def _check_one_process(path: str, cols: tuple, whole: int = 0) -> None:
    """Load into one process, every array whole."""
    state = {f"w{i}": np.zeros((8, n)) for i, n in enumerate(cols)}
    state.update(bias=np.zeros(5), step=0)
    if whole:
        state["emb"] = np.zeros(whole)
    checkpoint.load(state, path)
    if whole:
        np.testing.assert_array_equal(state["emb"], np.arange(float(whole)))
    for i, n in enumerate(cols):
        np.testing.assert_array_equal(state[f"w{i}"], _whole(i, (8, n)))
    np.testing.assert_array_equal(state["bias"], np.arange(5.0))


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_tp_pieces_under_dp_are_written_once_and_load_in_any_layout(tmp_path, backend):
    if backend != "threads":
        require_backend(backend)
    path = str(tmp_path / "c")
    assert run_ranks(_save_tp, 4, backend, args=(path, TWO)) == [None] * 4
    sizes = _assert_one_copy(path)
    meta = checkpoint.read_metadata(path)
    assert [len(meta.tensors[k].chunks) for k in ("w0", "w1", "bias")] == [2, 2, 1]
    assert len(sizes) >= 2  # the pieces are spread over ranks
    assert run_ranks(_load_replicated, 4, args=(path, TWO)) == [True] * 4
    _check_one_process(path, TWO)


def test_the_bytes_of_shared_boxes_are_spread_over_their_holders(tmp_path):
    """Six tp-split keys of different sizes on a 2 x 2 mesh, and a whole array that rank 0
    writes: the boxes of each tp piece go to its two dp holders, the largest first to the least
    loaded, counting the whole array rank 0 writes anyway."""
    path = str(tmp_path / "c")
    cols = (50, 40, 30, 20, 10, 10)
    assert run_ranks(_save_tp, 4, args=(path, cols, False, False, 200)) == [None] * 4
    sizes = _assert_one_copy(path)
    assert sorted(sizes) == [f"rank-0000{r}.safetensors" for r in range(4)], sizes
    assert max(sizes.values()) <= 1.5 * min(sizes.values()), sizes
    _check_one_process(path, cols, 200)


def test_replicas_that_differ_fail_every_rank_and_publish_nothing(tmp_path):
    path = str(tmp_path / "c")
    for error in run_ranks(_save_tp, 4, args=(path, TWO, True)):
        assert "ranks 0 and 2 save different values for the same piece of 'w0'" in error
        assert "must hold the same values" in error
    assert not os.path.exists(path) and os.listdir(tmp_path) == []
    # equal replicas: saved once; then replicas that drifted leave that checkpoint as it was
    assert run_ranks(_save_tp, 4, args=(path, TWO)) == [None] * 4
    _assert_one_copy(path)
    before = {n: os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)}
    for rank, error in enumerate(run_ranks(_save_tp, 4, args=(path, TWO, True))):
        assert error.startswith(f"rank {rank}: saving {path} failed: ranks 0 and 2 "), error
    assert {n: os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)} == before
    assert os.listdir(tmp_path) == ["c"]  # no temporary folder left
    _check_one_process(path, TWO)


def test_async_save_writes_shared_boxes_once_and_checks_replicas(tmp_path):
    path = str(tmp_path / "c")
    assert run_ranks(_save_tp, 4, args=(path, THREE, False, True)) == [None] * 4
    _assert_one_copy(path)
    _check_one_process(path, THREE)
    before = {n: os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)}
    for error in run_ranks(_save_tp, 4, args=(path, THREE, True, True)):
        assert "ranks 0 and 2 save different values for the same piece of 'w0'" in error
    assert {n: os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)} == before
    assert os.listdir(tmp_path) == ["c"]


# -- holders that no mesh dimension groups ------------------------------------------------------


#: key -> (global shape, rows of the pieces of row [0, 1], rows of the pieces of row [3, 2])
IRREGULAR = {
    "a": ((4, 3), (4, 0), (4, 0)),
    "b": ((5, 2), (0, 5), (5, 0)),
    "c": ((6, 4), (2, 4), (2, 4)),
}


def _irregular_expected() -> dict:
    whole = {key: _whole(i, shape) for i, (key, (shape, _, _)) in enumerate(IRREGULAR.items())}
    return whole | {"e": np.arange(6.0)}


def _irregular_state() -> dict:
    """The mesh ``[[0, 1], [3, 2]]``; each key a DTensor over this rank's row (ranks 0 and 1
    share one, 3 and 2 the other) with uneven pieces, empty ones included:

    - ``a``: rows (4, 0) in both: ranks 0 and 3 hold it whole, ranks 1 and 2 nothing;
    - ``b``: rows (0, 5) and (5, 0): ranks 1 and 3 hold it whole, on no common mesh dimension;
    - ``c``: rows (2, 4) in both: ranks 0 and 3 hold rows 0..2, ranks 1 and 2 rows 2..6.

    And ``e``, a whole array every rank holds."""
    mesh = DeviceMesh("cpu", [[0, 1], [3, 2]], mesh_dim_names=("col", "row"))["row"]
    top = mesh.mesh.tolist()[0] == 0
    expected, state = _irregular_expected(), {}
    for key, (shape, first, second) in IRREGULAR.items():
        layout = Layout(shape, (Shard(0),), ((first if top else second),))
        piece = np.ascontiguousarray(expected[key][layout.local_slices(mesh.coordinate)])
        state[key] = DTensor(piece, mesh, layout)
    state["e"] = expected["e"].copy()
    return state


def _save_irregular(path: str) -> bool:
    checkpoint.save(_irregular_state(), path)
    return True


def _load_irregular(path: str) -> bool:
    """Load into the same irregular layout: every rank gets its pieces back."""
    state, expected = _irregular_state(), _irregular_expected()
    targets = {k: v for k, v in state.items() if isinstance(v, DTensor)}
    for v in targets.values():
        v.to_local()[...] = 0
    state["e"] = np.zeros(6)
    checkpoint.load(state, path)
    for key, value in targets.items():
        want = expected[key][value.layout.local_slices(value.device_mesh.coordinate)]
        np.testing.assert_array_equal(value.to_local(), want, err_msg=f"{pb.get_rank()} {key}")
    np.testing.assert_array_equal(state["e"], expected["e"])
    return True


def test_a_box_held_by_ranks_no_mesh_dimension_groups_is_written_once(tmp_path):
    path = str(tmp_path / "c")
    assert run_ranks(_save_irregular, 4, args=(path,)) == [True] * 4
    _assert_one_copy(path)
    meta = checkpoint.read_metadata(path)
    assert {k: len(meta.tensors[k].chunks) for k in "abce"} == {"a": 1, "b": 1, "c": 2, "e": 1}
    expected = _irregular_expected()
    for key, value in checkpoint.read_whole(path).items():
        np.testing.assert_array_equal(value, expected[key], err_msg=key)
    assert run_ranks(_load_irregular, 4, args=(path,)) == [True] * 4


# -- a sub-group ----------------------------------------------------------------------------------


def _save_sub_group(path: str, drift: bool):
    """Ranks 1, 2 and 3 of a 2 x 2 (dp x tp) mesh save over their own group: ranks 1 and 3 hold
    the same tp piece (different values on rank 3 with ``drift``)."""
    sub = pb.new_group([1, 2, 3])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    value = _whole(0)
    if drift and pb.get_rank() == 3:
        value = value + 1.0
    state = {"w0": distribute_tensor(value, mesh["tp"], [Shard(0)]), "step": 7}
    if pb.get_rank() == 0:
        return None
    try:
        checkpoint.save(state, path, process_group=sub)
    except CheckpointError as e:
        return str(e)
    return None


def test_a_sub_group_saves_shared_boxes_once_and_names_global_ranks(tmp_path):
    path = str(tmp_path / "c")
    assert run_ranks(_save_sub_group, 4, args=(path, False)) == [None] * 4
    sizes = _assert_one_copy(path)
    assert checkpoint.read_metadata(path).world_size == 3
    assert set(sizes) <= {f"rank-0000{r}.safetensors" for r in range(3)}
    np.testing.assert_array_equal(checkpoint.read_whole(path)["w0"], _whole(0))
    errors = run_ranks(_save_sub_group, 4, args=(str(tmp_path / "d"), True))
    assert errors[0] is None
    for error in errors[1:]:
        assert "ranks 1 and 3 save different values for the same piece of 'w0'" in error
    assert not os.path.exists(tmp_path / "d")


def _save_sub_group_of_a_world_mesh(path: str):
    """Ranks 1, 2 and 3 save DTensors on the whole 2 x 2 mesh, replicated over dp: the replica
    on the mesh that would write a piece may be rank 0, which does not save."""
    sub = pb.new_group([1, 2, 3])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    state = {
        key: distribute_tensor(_whole(i), mesh, [Replicate(), Shard(0)])
        for i, key in enumerate(["w0", "k1", "k2"])  # both parities of the key's CRC
    }
    if pb.get_rank() != 0:
        checkpoint.save(state, path, process_group=sub)
    return True


def test_a_sub_group_saves_replicas_whose_mesh_has_ranks_that_do_not_save(tmp_path):
    path = str(tmp_path / "c")
    assert run_ranks(_save_sub_group_of_a_world_mesh, 4, args=(path,)) == [True] * 4
    _assert_one_copy(path)
    whole = checkpoint.read_whole(path)
    for i, key in enumerate(["w0", "k1", "k2"]):
        np.testing.assert_array_equal(whole[key], _whole(i), err_msg=key)


def test_the_choice_of_writers():
    """Only equal boxes are one piece; a box one rank holds is its own and counts towards its
    load; shared boxes go, the largest first, to their least loaded holder; the order the
    boxes come in does not matter."""
    held = [
        [["x", [0], [4], 40], ["y", [0], [2], 20], ["z", [0], [1], 10]],
        [["x", [0], [4], 40], ["y", [0], [2], 20], ["z", [0], [1], 10], ["x", [4], [4], 40]],
        [["y", [0], [3], 30], ["z", [0], [1], 10]],
    ]
    expected = {
        ("x", (4,), (4,)): 1,  # rank 1's alone: loads 5, 40, 0
        ("y", (0,), (3,)): 2,  # not the piece y (0,) (2,): loads 5, 40, 30
        ("x", (0,), (4,)): 0,  # the largest shared box, to the lighter of 0 and 1: 45, 40, 30
        ("y", (0,), (2,)): 1,  # 45, 60, 30
        ("z", (0,), (1,)): 2,  # held by all three: 45, 60, 40
    }
    assert planning.assign_shared_pieces(held, [5, 0, 0]) == expected
    assert planning.assign_shared_pieces([boxes[::-1] for boxes in held], [5, 0, 0]) == expected

"""``checkpoint.Pieces``: a rank's boxes of a global array that no DTensor layout describes (FSDP's
rows of a tensor-parallel piece). Each box is written as a DTensor piece is (a box two ranks
hold, once, its copies compared); each rank file names several boxes of one key apart; loading
fills them from any layout and any layout from them; bad records are refused by name."""

from __future__ import annotations

import json
import os

import numpy as np
import pluribus as pb
import pytest
from pluribus import checkpoint
from pluribus.checkpoint import CheckpointError, Pieces
from pluribus.checkpoint.consolidate import describe
from pluribus.dtensor import Shard, distribute_tensor, init_device_mesh
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(60)

W = np.arange(60, dtype=np.float64).reshape(10, 6)
V = np.arange(24, dtype=np.int32).reshape(4, 3, 2) - 5

#: each rank's boxes (offsets, sizes) of W: uneven, one empty, the row 5 held by ranks 1 and 2
W_BOXES = [
    [((0, 0), (3, 6)), ((3, 0), (2, 2)), ((5, 5), (0, 1))],
    [((3, 2), (2, 4)), ((5, 0), (1, 6))],
    [((6, 0), (4, 3)), ((5, 0), (1, 6))],
    [((6, 3), (4, 3))],
]
#: the same of V; ranks 2 and 3 hold none of it
V_BOXES = [[((0, 0, 0), (2, 3, 2))], [((2, 0, 0), (2, 3, 2))], [], []]


def _pieces(whole: np.ndarray, boxes: list, layout: str = "") -> Pieces:
    parts = [
        (o, whole[tuple(slice(a, a + n) for a, n in zip(o, s, strict=True))].copy())
        for o, s in boxes
    ]
    return Pieces(whole.shape, parts, dtype=whole.dtype, layout=layout)


def _save(path: str, drift: bool = False):
    rank = pb.get_rank()
    w = W + 1 if drift and rank == 2 else W
    state = {
        "w": _pieces(w, W_BOXES[rank], "test boxes"),
        "v": _pieces(V, V_BOXES[rank]),
        "step": 3,
    }
    try:
        checkpoint.save(state, path)
    except CheckpointError as e:
        return str(e)
    return None


def _names(path: str) -> dict[str, list[str]]:
    """Each rank file's tensor names."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            out[name] = sorted(k for k in header if k != "__metadata__")
    return out


def _load_every_way(path: str) -> bool:
    """Into DTensors (uneven Shard(1), Shard(0)), whole arrays, and other boxes (crossing the
    saved ones, one empty; and W in its (2, 5, 6) form, regrouped box by box)."""
    rank, mesh = pb.get_rank(), init_device_mesh("cpu", (4,))
    dtensors = {
        "w": distribute_tensor(np.zeros_like(W), mesh, [Shard(1)]),
        "v": distribute_tensor(np.zeros_like(V), mesh, [Shard(0)]),
        "step": 0,
    }
    checkpoint.load(dtensors, path)
    for key, whole in (("w", W), ("v", V)):
        d = dtensors[key]
        np.testing.assert_array_equal(d.to_local(), whole[d.layout.local_slices(mesh.coordinate)])
    wholes = {"w": np.zeros_like(W), "v": np.zeros_like(V), "step": 0}
    checkpoint.load(wholes, path)
    np.testing.assert_array_equal(wholes["w"], W)
    np.testing.assert_array_equal(wholes["v"], V)
    mine = [((0, rank), (10, 1)), ((rank, 4), (1, 2)), ((9, 5), (0, 1))]
    grouped = W.reshape(2, 5, 6)
    blocks = [((rank % 2, 1, 0), (1, 4, 3)), ((1 - rank % 2, 0, 3), (1, 5, 3))]
    others = {
        "w": _pieces(np.zeros_like(W), mine),
        "v": _pieces(np.zeros_like(V), [((rank, 1, 0), (1, 2, 2))]),
        "step": 0,
    }
    checkpoint.load(others, path)
    regrouped = {"w": _pieces(np.zeros_like(grouped), blocks)}
    checkpoint.load(regrouped, path, strict=False)
    for got, want, boxes in (
        (others["w"], W, mine),
        (others["v"], V, [((rank, 1, 0), (1, 2, 2))]),
        (regrouped["w"], grouped, blocks),
    ):
        expected = _pieces(want, boxes)
        for (o, a), (p, b) in zip(got.pieces, expected.pieces, strict=True):
            assert o == p
            np.testing.assert_array_equal(a, b)
    assert dtensors["step"] == wholes["step"] == others["step"] == 3
    return True


def test_boxes_are_saved_once_each_and_load_into_any_layout(tmp_path):
    path = str(tmp_path / "c")
    assert run_ranks(_save, 4, args=(path,)) == [None] * 4
    meta = checkpoint.read_metadata(path)
    chunks = {k: sorted((c.offsets, c.sizes) for c in meta.tensors[k].chunks) for k in "wv"}
    boxes = {b for rank in W_BOXES for b in rank if np.prod(b[1])}
    assert chunks["w"] == sorted(boxes)  # the shared row once, the empty box not at all
    assert chunks["v"] == [((0, 0, 0), (2, 3, 2)), ((2, 0, 0), (2, 3, 2))]
    assert meta.tensors["w"].saved_layout == "Pieces: test boxes"
    assert meta.tensors["v"].saved_layout == "Pieces: boxes per rank"
    # a rank's boxes of one key are named apart in its file; a single box keeps the key
    names = _names(path)
    assert names["rank-00000.safetensors"] == ["v", "w@0,0", "w@3,0"]
    assert names["rank-00003.safetensors"] == ["w"]
    assert sum(n.startswith("w") for file in names.values() for n in file) == len(boxes)
    for info in meta.tensors.values():
        for c in info.chunks:
            assert c.name in names[c.file]
    assert run_ranks(_load_every_way, 4, args=(path,)) == [True] * 4
    whole = checkpoint.read_whole(path)
    np.testing.assert_array_equal(whole["w"], W)
    np.testing.assert_array_equal(whole["v"], V)
    assert "Pieces: test boxes" in describe(path, verify=True)
    out = str(tmp_path / "all.safetensors")
    checkpoint.consolidate(path, out)
    safetensors = pytest.importorskip("safetensors.numpy")
    np.testing.assert_array_equal(safetensors.load_file(out)["w"], W)


def test_copies_of_a_shared_box_that_differ_fail_the_save(tmp_path):
    path = str(tmp_path / "c")
    for error in run_ranks(_save, 4, args=(path, True)):
        assert "ranks 1 and 2 save different values for the same piece of 'w'" in error
    assert not os.path.exists(path)


def _bad_records() -> list[str]:
    """The error of each bad record, as this rank raises it."""
    z = np.zeros((2, 2))
    bad = [
        lambda: Pieces((4, 4), [((0, 0), z), ((1, 1), z)]),
        lambda: Pieces((4, 4), [((3, 0), z)]),
        lambda: Pieces((4, 4), [((0, 0), z), ((2, 2), z.astype(np.float32))]),
        lambda: Pieces((4, 4), [((0,), z)]),
        lambda: Pieces((4, 4), []),
        lambda: Pieces((4, 4), [((0, 0), [[0.0]])]),
        lambda: Pieces((4, -1), []),
    ]
    errors = []
    for make in bad:
        try:
            make()
        except ValueError as e:
            errors.append(str(e))
        else:
            errors.append("")
    return errors


def test_bad_records_are_refused_naming_the_rank():
    for rank, errors in enumerate(run_ranks(_bad_records, 2)):
        assert all(e.startswith(f"rank {rank}: ") for e in errors), errors
        overlap, outside, dtypes, dims, empty, not_array, shape = errors
        assert "offsets [0, 0] sizes [2, 2] and offsets [1, 1] sizes [2, 2] overlap" in overlap
        assert "piece 0 (offsets [3, 0] sizes [2, 2]) reaches outside" in outside
        assert "dtypes ['float32', 'float64']" in dtypes
        assert "both need 2 dimensions" in dims
        assert "pass dtype=" in empty
        assert "holds a list; each box is a numpy or cupy array" in not_array
        assert "tuple of non-negative ints" in shape
    # empty boxes may touch and sit anywhere inside; an empty record with its dtype is fine
    Pieces((4, 4), [((0, 0), np.zeros((0, 4))), ((0, 0), np.zeros((4, 4)))])
    assert Pieces((4, 4), [], dtype=np.float32).dtype == np.float32


def _save_a_bad_dtype(path: str):
    """Rank 1's boxes have a dtype safetensors cannot hold: every rank refuses the save."""
    dtype = np.complex64 if pb.get_rank() == 1 else np.float32
    state = {"w": Pieces((4,), [((2 * pb.get_rank(),), np.zeros(2, dtype))])}
    try:
        checkpoint.save(state, path)
    except CheckpointError as e:
        return str(e)
    return None


def test_a_bad_leaf_on_one_rank_fails_every_rank_before_writing(tmp_path):
    path = str(tmp_path / "c")
    for rank, error in enumerate(run_ranks(_save_a_bad_dtype, 2, args=(path,))):
        assert error.startswith(f"rank {rank}: nothing was saved to {path}: rank 1: ")
        assert "'w' has dtype complex64" in error
    assert os.listdir(tmp_path) == []


# -- boxes across ranks, and cupy views --------------------------------------------------------

OVERLAPPED = np.arange(12, dtype=np.float64)


def _save_overlapping(path: str):
    """Rank 0 holds A[0:6], rank 1 A[4:10]: they overlap on 4..5 and nobody holds 10..11, so
    the chunks' volumes still add up to 12."""
    lo, hi = [(0, 6), (4, 10)][pb.get_rank()]
    try:
        checkpoint.save({"a": Pieces((12,), [((lo,), OVERLAPPED[lo:hi].copy())])}, path)
    except CheckpointError as e:
        return str(e)
    return None


def test_boxes_of_two_ranks_that_overlap_and_leave_a_hole_are_refused(tmp_path):
    path = str(tmp_path / "c")
    errors = run_ranks(_save_overlapping, 2, args=(path,))
    assert all(e is not None and "do not tile" in e for e in errors), errors


def _load_into_a_cupy_view(path: str):
    import cupy

    whole = cupy.zeros((4, 6))
    view = whole[:, 2:4]  # a box that is a view, as one cuts boxes of a whole array
    checkpoint.load({"w": Pieces((4, 6), [((0, 2), view)])}, path)
    return cupy.asnumpy(whole)


def test_a_cupy_box_that_is_a_view_is_filled_in_place(tmp_path):
    pytest.importorskip("cupy")
    path = str(tmp_path / "c")
    w = np.arange(24, dtype=np.float64).reshape(4, 6)
    checkpoint.save({"w": w}, path)
    got = run_ranks(_load_into_a_cupy_view, 1, args=(path,))[0]
    np.testing.assert_array_equal(got[:, 2:4], w[:, 2:4])

"""Save with N ranks in layout A, load with M ranks in layout B: every piece, the optimizer
state, the RNG and sampler state equal the single-process reference."""

from __future__ import annotations

import importlib
import json
import os

import numpy as np
import pytest
from ckpt_cases import (
    REPLICATED,
    SHARDED,
    load_body,
    random_layout,
    reference,
    save_body,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pluribus import checkpoint
from pluribus.testing import RanksFailed, run_ranks

MESHES = {1: [(1,)], 2: [(2,), (1, 2), (2, 1)], 3: [(3,)], 4: [(4,), (2, 2)]}


def _save(layout, world, path, backend="threads"):
    assert run_ranks(save_body, world, backend, args=(layout, path)) == [True] * world


def _load(layout, world, path, backend="threads"):
    assert run_ranks(load_body, world, backend, args=(layout, path)) == [True] * world


def _data_bytes(path) -> int:
    """Bytes of tensor data in the checkpoint's files (headers excluded)."""
    total = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb") as f:
                head = int.from_bytes(f.read(8), "little")
            total += os.path.getsize(os.path.join(path, name)) - 8 - head
    return total


@st.composite
def layouts(draw):
    world = draw(st.integers(1, 4))
    mesh = draw(st.sampled_from(MESHES[world]))
    seed = draw(st.integers(0, 2**32 - 1))
    return world, random_layout(np.random.default_rng(seed), world, mesh)


@pytest.mark.timeout(150)
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(a=layouts(), b=layouts())
def test_any_layout_loads_into_any_other(tmp_path_factory, a, b):
    """The property: for random A (N in 1..4, 1-d and 2-d meshes, uneven and empty pieces)
    and B (M in 1..4), save A then load B equals the reference; and every tensor's bytes are
    written exactly once, however many ranks hold a replica."""
    path = str(tmp_path_factory.mktemp("ckpt") / "c")
    _save(a[1], a[0], path)
    ref = reference()
    assert _data_bytes(path) == sum(v.nbytes for v in ref.values())
    _load(b[1], b[0], path)


@pytest.mark.timeout(60)
def test_two_d_uneven_to_one_process_and_back(tmp_path):
    path = str(tmp_path / "c")
    rng = np.random.default_rng(5)
    a = random_layout(rng, 4, (2, 2))
    a["tensors"]["model.layers.0.weight"] = [[0, [5, 2]], [1, [0, 5]]]  # an empty piece
    _save(a, 4, path)
    meta = checkpoint.read_metadata(path)
    assert meta.world_size == 4
    assert len(meta.tensors["model.embedding"].chunks) == 1  # replicated: written once
    assert {tuple(c.sizes) for c in meta.tensors["model.layers.0.weight"].chunks} == {
        (5, 5),
        (2, 5),
    }
    assert meta.values["step"] == 1234
    _load(random_layout(rng, 1, (1,)), 1, path)
    _load(random_layout(rng, 3, (3,)), 3, path)


def test_files_open_with_any_safetensors_reader_and_metadata_is_json(tmp_path):
    from safetensors.numpy import load_file

    path = str(tmp_path / "c")
    layout = random_layout(np.random.default_rng(0), 2, (2,))
    layout["tensors"]["model.head"] = [[1, [4, 5]]]
    _save(layout, 2, path)
    pieces = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            for key, array in load_file(os.path.join(path, name)).items():
                pieces.setdefault(key, []).append(array)
    ref = reference()
    head = np.concatenate(pieces["model.head"], axis=1)
    np.testing.assert_array_equal(head, ref["model.head"])
    with open(os.path.join(path, "metadata.json")) as f:
        doc = json.load(f)
    assert doc["format"] == "pluribus-checkpoint" and doc["version"] == checkpoint.VERSION
    assert doc["checksum"] == "crc32c"  # the test extra installs crc32c
    assert set(doc["tensors"]) == set(SHARDED) | set(REPLICATED)
    chunk = doc["tensors"]["model.head"]["chunks"][0]
    assert {"offsets", "sizes", "file", "name", "checksums"} <= set(chunk)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["crc32c", "crc32"])
def test_partial_reads_verify_only_their_blocks_and_catch_a_flip_in_them(
    tmp_path, monkeypatch, algorithm
):
    """With 64-byte checksum blocks a 2-rank load of a 1-rank checkpoint reads parts of
    chunks: it passes, and a flipped byte in a block one rank reads fails that load."""
    save_module = importlib.import_module("pluribus.checkpoint.save")

    monkeypatch.setattr(save_module, "BLOCK_BYTES", 64)
    monkeypatch.setattr(save_module, "preferred", lambda: algorithm)
    path = str(tmp_path / "c")
    _save(random_layout(np.random.default_rng(2), 1, (1,)), 1, path)
    meta = checkpoint.read_metadata(path)
    assert meta.block_bytes == 64 and meta.checksum == algorithm
    assert len(meta.tensors["model.layers.0.weight"].chunks[0].checksums) == -(-7 * 5 * 4 // 64)
    two = random_layout(np.random.default_rng(3), 2, (2,))
    two["tensors"]["model.layers.0.weight"] = [[0, [3, 4]]]
    _load(two, 2, path)
    chunk = meta.tensors["model.layers.0.weight"].chunks[0]
    from safetensors import safe_open

    with safe_open(os.path.join(path, chunk.file), "np") as f:
        assert f.get_tensor(chunk.name).shape == (7, 5)
    with open(os.path.join(path, chunk.file), "rb") as f:
        head = 8 + int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(head - 8))
    begin = head + header[chunk.name]["data_offsets"][0]
    with open(os.path.join(path, chunk.file), "r+b") as f:
        f.seek(begin + 5 * 5 * 4 + 3)  # row 5: only the rank holding rows 3..6 reads it
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(RanksFailed, match="checksum mismatch") as excinfo:
        _load(two, 2, path)
    assert "rank 1: " in str(excinfo.value)

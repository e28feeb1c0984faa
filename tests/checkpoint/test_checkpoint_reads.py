"""Each rank reads only the byte ranges it needs, planned without collectives: loading costs
two small exchanges of outcomes, whatever the layouts."""

from __future__ import annotations

import importlib
import math
import os
import threading
from collections import Counter

import numpy as np
import pluribus as pb
import pytest
from pluribus import checkpoint
from pluribus.dtensor import Shard, distribute_tensor, init_device_mesh
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(60)

SHAPE = (1000, 64)  # float32: 250 KiB, 256 B a row
BLOCK = 4096


def _save(path, dim):
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    full = np.arange(math.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    checkpoint.save({"w": distribute_tensor(full, mesh, [Shard(dim)])}, path)


def _load(path, dim):
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    target = distribute_tensor(np.zeros(SHAPE, np.float32), mesh, [Shard(dim)])
    checkpoint.load({"w": target}, path)
    full = np.arange(math.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    np.testing.assert_array_equal(
        target.to_local(), full[target.layout.local_slices(mesh.coordinate)]
    )
    return target.to_local().nbytes


@pytest.mark.parametrize("saved, loaded", [(4, 3), (3, 4), (2, 2)])
def test_each_rank_reads_its_rows_and_at_most_a_block_more_per_chunk(
    tmp_path, monkeypatch, saved, loaded
):
    monkeypatch.setattr(importlib.import_module("pluribus.checkpoint.save"), "BLOCK_BYTES", BLOCK)
    path = str(tmp_path / "c")
    run_ranks(_save, saved, args=(path, 0))
    read: Counter = Counter()
    preadv = os.preadv

    def counting(fd, buffers, offset, *rest):
        n = preadv(fd, buffers, offset, *rest)
        read[threading.current_thread().name] += n
        return n

    monkeypatch.setattr(os, "preadv", counting)
    needs = run_ranks(_load, loaded, args=(path, 0))
    for rank, need in enumerate(needs):
        chunks = -(-saved // loaded) + 1  # the saved pieces one loading piece can overlap
        assert need <= read[f"rank{rank}"] <= need + 2 * BLOCK * chunks, (rank, read, needs)
    assert sum(read.values()) < 1.5 * math.prod(SHAPE) * 4


def test_loading_exchanges_only_its_outcome(tmp_path, monkeypatch):
    """Two all_gather_object calls (two all-gathers each: sizes, then bytes), in any layout."""
    from pluribus import distributed

    path = str(tmp_path / "c")
    run_ranks(_save, 4, args=(path, 1))
    calls: Counter = Counter()
    original = distributed.all_gather

    def counted(*args, **kwargs):
        calls[threading.current_thread().name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(distributed, "all_gather", counted)
    run_ranks(_load, 3, args=(path, 0))
    assert calls == {"rank0": 4, "rank1": 4, "rank2": 4}

"""DTensor factories: each rank's piece is what distribute_tensor cuts from the whole array,
made without the whole array or any communication."""

from __future__ import annotations

import numpy as np
import pluribus as pb
import pytest
from dtensor_helpers import counting_collectives, errors_of, layout_cases
from hypothesis import given, settings
from pluribus.dtensor import (
    Shard,
    distribute_tensor,
    empty,
    full,
    init_device_mesh,
    ones,
    zeros,
)
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


def _pieces(mesh_shape, shape, placements, dtype, counting):
    mesh = init_device_mesh("cpu", mesh_shape)
    mark = counting.mark(_rank())
    made = {
        "zeros": zeros(*shape, device_mesh=mesh, placements=placements, dtype=dtype),
        "ones": ones(shape, device_mesh=mesh, placements=placements, dtype=dtype),
        "full": full(shape, 7, device_mesh=mesh, placements=placements, dtype=dtype),
        "empty": empty(*shape, device_mesh=mesh, placements=placements, dtype=dtype),
    }
    sent = counting.since(_rank(), mark)
    want = {
        name: distribute_tensor(np.full(shape, value, dtype), mesh, placements)
        for name, value in {"zeros": 0, "ones": 1, "full": 7, "empty": 0}.items()
    }
    out = []
    for name, got in made.items():
        expected = want[name]
        same_layout = got.layout == expected.layout and got.dtype == np.dtype(dtype)
        local = got.to_local()
        if name == "empty":  # uninitialised, but a Partial("sum") term off the first rank
            zero = not expected.to_local().any() and not want["ones"].to_local().any()
            same = local.shape == expected.to_local().shape and (not zero or not local.any())
        else:
            same = np.array_equal(local, expected.to_local())
        out.append((name, same_layout, same))
    return out, sent


def _rank():
    return pb.get_rank()


@settings(max_examples=25, deadline=None)
@given(layout_cases())
def test_each_piece_is_what_distribute_tensor_cuts_with_nothing_sent(case):
    mesh, shape, placements, dtype = case
    with counting_collectives("test-dtensor-factories-counting") as counting:
        results = run_ranks(
            _pieces, int(np.prod(mesh)), args=(mesh, shape, placements, dtype, counting)
        )
    for checks, sent in results:
        assert sent == []
        for name, same_layout, same in checks:
            assert same_layout and same, (name, case)


def _bad_calls():
    mesh = init_device_mesh("cpu", (2,))
    errors = errors_of(
        (
            lambda: zeros(4, 4),
            lambda: zeros(4, -1, device_mesh=mesh),
            lambda: ones(4, "a", device_mesh=mesh),
            lambda: zeros(4, device_mesh=mesh, placements=[Shard(1)]),
            lambda: zeros(4, device_mesh=mesh, placements=[Shard(0), Shard(0)]),
            lambda: zeros(True, 3, device_mesh=mesh),
            lambda: full((2, 2), np.array([1.0, 2.0]), device_mesh=mesh),
            lambda: full((2,), 300, device_mesh=mesh, dtype=np.uint8),
        )
    )
    return errors


def test_bad_sizes_meshes_and_placements_are_refused_by_name():
    for rank, errors in enumerate(run_ranks(_bad_calls, 2)):
        assert all(e is not None and e.startswith(f"rank {rank}: ") for e in errors), errors
        assert "zeros needs device_mesh=" in errors[0]
        assert "non-negative integers" in errors[1] and "non-negative integers" in errors[2]
        assert "non-negative integers, got (True, 3)" in errors[5]
        assert "full's fill value is one number, got an array of shape (2,)" in errors[6]
        assert "full cannot fill uint8 with 300" in errors[7]


def test_no_dtype_is_torchs_default_float32():
    def made():
        return zeros(2, device_mesh=init_device_mesh("cpu", (1,)), dtype=None).dtype

    assert run_ranks(made, 1) == [np.dtype(np.float32)]

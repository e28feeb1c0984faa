"""pluribus-bench's arithmetic: sizes, nccl-tests bandwidth factors, test data and result checks."""

import math

import numpy as np
import pytest
from pluribus import ReduceOp
from pluribus.bench.core import (
    COLLECTIVES,
    Case,
    Row,
    bus_factor,
    element_counts,
    make_input,
    parse_size,
    size_series,
)
from pluribus.bench.report import comparisons, merge_rows

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("collective", "n", "factor"),
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 4, 1.5),
        ("all_reduce", 8, 1.75),
        ("all_gather", 2, 0.5),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 8, 0.875),
        ("all_to_all", 4, 0.75),
        ("broadcast", 8, 1.0),
        ("reduce", 3, 1.0),
    ],
)
def test_bus_factor_matches_nccl_tests(collective, n, factor):
    assert bus_factor(collective, n) == pytest.approx(factor)


def test_bus_factor_rejects_unknown_collective():
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        bus_factor("allreduce", 2)


def test_row_bandwidths_follow_size_over_time():
    row = Row(
        "x",
        "all_reduce",
        size=1 << 20,
        count=1 << 18,
        dtype="float32",
        op="sum",
        root=None,
        nranks=4,
        samples_us=[100.0, 200.0, 300.0],
    )
    assert row.time_us == pytest.approx(200.0)
    assert row.time_us_min == 100.0 and row.time_us_median == 200.0
    assert row.algbw() == pytest.approx((1 << 20) / 200e-6 / 1e9)
    assert row.busbw() == pytest.approx(row.algbw() * 1.5)
    empty = Row("x", "broadcast", 4, 1, "float32", "-", 0, 2)
    assert math.isnan(empty.busbw()) and empty.to_dict()["busbw_GBps"] is None


@pytest.mark.parametrize(
    ("text", "value"),
    [("4", 4), ("8K", 8192), ("64M", 64 << 20), ("1G", 1 << 30), ("2KiB", 2048), ("1kb", 1024)],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_size_rejects_garbage():
    with pytest.raises(ValueError, match="expected a number of bytes"):
        parse_size("lots")


def test_size_series_is_inclusive_geometric():
    assert size_series(4, 64, 2) == [4, 8, 16, 32, 64]
    assert size_series(4, 100, 4) == [4, 16, 64]
    assert len(size_series(4, 64 << 20, 2)) == 25
    with pytest.raises(ValueError):
        size_series(8, 4, 2)
    with pytest.raises(ValueError):
        size_series(4, 8, 1)


def test_element_counts_split_blocked_collectives_per_rank():
    assert element_counts("all_reduce", 1024, 4, 3) == (256, 256)
    # all_gather's size is the gathered buffer: 256 elements -> 85 per rank of 3, 255 in all
    assert element_counts("all_gather", 1024, 4, 3) == (255, 85)
    assert element_counts("reduce_scatter", 4, 4, 2) == (2, 1)  # never an empty block
    assert element_counts("broadcast", 2, 4, 2) == (1, 1)


@pytest.mark.parametrize("dtype", ["float16", "float32", "int8", "uint8", "bfloat16"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MAX, ReduceOp.AVG])
def test_expected_reductions_are_exact(dtype, op):
    """The test data makes every reduction exact, so the expected values are the true ones."""
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dtype = ml_dtypes.bfloat16
    if op is ReduceOp.AVG and np.dtype(dtype).kind in "iu":
        pytest.skip("AVG is for floating point")
    n = 8
    case = Case.make("all_reduce", 0, n, 1000, 1000, dtype, op)
    inputs = [make_input(r, 1000, np.dtype(dtype), op).astype(np.float64) for r in range(n)]
    exact = {
        ReduceOp.SUM: lambda: np.sum(inputs, axis=0),
        ReduceOp.PRODUCT: lambda: np.prod(inputs, axis=0),
        ReduceOp.MAX: lambda: np.max(inputs, axis=0),
        ReduceOp.AVG: lambda: np.sum(inputs, axis=0) / n,
    }[op]()
    if np.dtype(dtype).kind in "iu":
        exact = exact.astype(np.int64).astype(dtype)  # integer types wrap, as on the wire
    np.testing.assert_array_equal(
        case.expected().astype(np.float64), np.asarray(exact).astype(dtype).astype(np.float64)
    )


def test_inputs_differ_between_ranks_and_positions():
    a = make_input(0, 64, np.dtype(np.float32), ReduceOp.SUM)
    b = make_input(1, 64, np.dtype(np.float32), ReduceOp.SUM)
    assert not np.array_equal(a, b)
    assert len(set(a.tolist())) > 4


def _simulate(collective, n, count, per_rank, op=ReduceOp.SUM, root=0):
    """Every rank's Case with the correct result in place, computed independently of expected()."""
    cases = [Case.make(collective, r, n, count, per_rank, np.float32, op, root) for r in range(n)]
    inputs = [c.send.copy() for c in cases]
    for r, case in enumerate(cases):
        if collective == "all_reduce" or (collective == "reduce" and r == root):
            case.recv[...] = sum(inputs)
        elif collective == "broadcast":
            case.recv[...] = inputs[root]
        elif collective == "all_gather":
            case.recv[...] = np.concatenate(inputs)
        elif collective == "reduce_scatter":
            case.recv[...] = sum(x[r * per_rank : (r + 1) * per_rank] for x in inputs)
        elif collective == "all_to_all":
            case.recv[...] = np.concatenate([x[r * per_rank : (r + 1) * per_rank] for x in inputs])
    return cases


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_check_accepts_right_and_catches_wrong_results(collective):
    n, count, per = 3, 24, 8
    cases = _simulate(collective, n, count, per)
    assert [c.wrong() for c in cases] == [0, 0, 0]
    victim = cases[0]  # rank 0 is the root, so its result is checked for every collective
    victim.recv[1] += 1
    assert victim.wrong() == 1
    victim.recv[...] = 0
    assert victim.wrong() > 1


def test_check_catches_blocks_in_the_wrong_order():
    cases = _simulate("all_gather", 2, 8, 4)
    out = cases[1].recv
    out[:] = np.concatenate([out[4:], out[:4]].copy())
    assert cases[1].wrong() > 0


def test_reduce_is_checked_only_on_the_root():
    cases = _simulate("reduce", 2, 8, 8, root=1)
    cases[0].recv[...] = 12345  # not the root: its buffer holds nothing defined
    assert cases[0].wrong() == 0
    cases[1].recv[0] += 1
    assert cases[1].wrong() == 1


def test_fill_clears_outputs_so_stale_results_cannot_pass():
    case = Case.make("all_gather", 0, 2, 8, 4, np.float32, ReduceOp.SUM)
    case.recv[...] = case.expected()
    assert case.wrong() == 0
    case.fill()
    assert case.wrong() > 0


def _row(impl, collective, size, samples, wrong=0):
    return Row(
        impl,
        collective,
        size,
        size // 4,
        "float32",
        "sum",
        None,
        2,
        iters=len(samples),
        wrong=wrong,
        samples_us=list(samples),
    )


def test_merge_pools_samples_of_repeats():
    merged = merge_rows(
        [
            _row("a", "all_reduce", 8, [1, 2]),
            _row("a", "all_reduce", 8, [3], 1),
            _row("a", "all_reduce", 16, [5]),
        ]
    )
    first = next(r for r in merged if r.size == 8)
    assert first.samples_us == [1, 2, 3] and first.iters == 3 and first.wrong == 1
    assert len(merged) == 2


def test_comparisons_ratios():
    rows = [
        _row("pluribus-gloo", "all_reduce", 1 << 20, [100, 100, 500]),
        _row("torch-gloo", "all_reduce", 1 << 20, [400, 400, 400]),
        _row("mpi4py", "all_reduce", 1 << 20, [50, 50, 50]),
    ]
    items = {i["peer"]: i for i in comparisons(rows)}
    assert items["torch-gloo"]["busbw_ratio"] == pytest.approx(4.0)
    assert items["torch-gloo"]["latency_ratio"] == pytest.approx(0.25)
    assert items["mpi4py"]["busbw_ratio"] == pytest.approx(0.5)
    assert items["mpi4py"]["busbw_GBps"] == pytest.approx((1 << 20) / 100e-6 / 1e9, rel=1e-5)

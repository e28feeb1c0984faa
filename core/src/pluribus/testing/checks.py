"""The conformance checks. Each runs on every rank of a group, after ``init_process_group``, and
raises AssertionError when the backend gets something wrong.

Inputs are chosen so that every reduction is exact in every dtype (small integers, products of
ones and twos), so results are compared exactly except for AVG.

The suite runs on numpy arrays, or on cupy arrays when ``$PLURIBUS_CONFORMANCE_DEVICE`` is
"cuda" (``--pluribus-device cuda``): inputs are made with numpy and placed with ``on_device``,
results come back with ``to_host``, so the expected values are the same numpy ones on both.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time

import numpy as np

import pluribus as pb
from pluribus.arrays import bfloat16_dtype, is_integer_like
from pluribus.errors import DistTimeoutError, PeerError, PluribusError
from pluribus.operations import OPERATIONS, hook_implementations

ReduceOp = pb.ReduceOp

SIZES = (0, 1, 7, 1000, (1 << 20) + 3)  # the last is a little over 4 MiB of float32
SMALL_SIZES = (0, 1, 7, 1000)

#: Where the suite's arrays live: "cpu" (numpy, the default) or "cuda" (cupy).
DEVICE_ENV = "PLURIBUS_CONFORMANCE_DEVICE"


def device() -> str:
    return os.environ.get(DEVICE_ENV, "cpu")


def on_device(array: np.ndarray):
    """``array`` where the suite runs: itself on cpu, a cupy copy on cuda."""
    if device() != "cuda":
        return array
    import cupy

    return cupy.asarray(array)


def to_host(array) -> np.ndarray:
    """A numpy copy (or view) of a numpy or cupy array, for comparing with numpy results."""
    return array.get() if hasattr(array, "get") else np.asarray(array)


class _ArrayModule:
    """numpy or cupy, whichever holds the suite's arrays: ``xp.zeros(...)`` etc."""

    def __getattr__(self, name: str):
        if device() == "cuda":
            import cupy

            return getattr(cupy, name)
        return getattr(np, name)


xp = _ArrayModule()


def _device_can_hold(dtype: np.dtype) -> bool:
    if device() != "cuda":
        return True
    import cupy

    try:
        cupy.zeros(1, dtype=dtype)
    except (TypeError, ValueError):
        return False
    return True


def dtypes() -> list[np.dtype]:
    """Every dtype pluribus supports that the suite's device can hold (cupy has no bfloat16)."""
    found = [
        np.dtype(t)
        for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8)
        + (np.float16, np.float32, np.float64)
    ]
    bf16 = bfloat16_dtype()
    if bf16 is not None:
        found.append(bf16)
    return [d for d in found if _device_can_hold(d)]


def valid_ops(dtype: np.dtype) -> list[ReduceOp]:
    if is_integer_like(dtype):
        return [op for op in ReduceOp if op is not ReduceOp.AVG]
    return [op for op in ReduceOp if not op.bitwise]


def rank_input(rank: int, n: int, dtype: np.dtype, op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
    """Rank ``rank``'s deterministic input: small values whose reductions are exact."""
    i = np.arange(n)
    if dtype == np.bool_:
        return ((i + rank) % 3 == 0).astype(np.bool_)
    if op is ReduceOp.PRODUCT:
        return (1 + ((i + rank) % 2)).astype(dtype)
    return ((i % 7) + rank + 1).astype(dtype)


def expected_reduction(size: int, n: int, dtype: np.dtype, op: ReduceOp) -> np.ndarray:
    stack = np.stack([rank_input(r, n, dtype, op) for r in range(size)]) if size else None
    if op is ReduceOp.AVG:
        return (stack.astype(np.float64).sum(axis=0) / size).astype(dtype)
    ufunc = {
        ReduceOp.SUM: np.add,
        ReduceOp.PRODUCT: np.multiply,
        ReduceOp.MIN: np.minimum,
        ReduceOp.MAX: np.maximum,
        ReduceOp.BAND: np.bitwise_and,
        ReduceOp.BOR: np.bitwise_or,
        ReduceOp.BXOR: np.bitwise_xor,
    }[op]
    if dtype == np.bool_:
        ufunc = {
            ReduceOp.SUM: np.logical_or,
            ReduceOp.PRODUCT: np.logical_and,
            ReduceOp.MIN: np.logical_and,
            ReduceOp.MAX: np.logical_or,
            ReduceOp.BAND: np.logical_and,
            ReduceOp.BOR: np.logical_or,
            ReduceOp.BXOR: np.logical_xor,
        }[op]
    result = stack[0].copy()
    for row in stack[1:]:
        result = ufunc(result, row).astype(dtype)
    return result


def assert_equal(actual, expected, what: str) -> None:
    actual, expected = to_host(actual), to_host(expected)
    dtype = np.dtype(expected.dtype)
    if dtype.kind == "f" or dtype == bfloat16_dtype():
        a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
        tol = 2e-2 if dtype.itemsize <= 2 else 1e-6
        if not np.allclose(a, e, rtol=tol, atol=tol):
            bad = np.flatnonzero(~np.isclose(a, e, rtol=tol, atol=tol))
            raise AssertionError(
                f"rank {pb.get_rank()}: {what}: {bad.size} wrong values, first at {bad[0]}: got "
                f"{a.reshape(-1)[bad[0]]}, expected {e.reshape(-1)[bad[0]]}"
            )
    elif not np.array_equal(actual, expected):
        bad = np.flatnonzero(np.asarray(actual).reshape(-1) != np.asarray(expected).reshape(-1))
        raise AssertionError(
            f"rank {pb.get_rank()}: {what}: {bad.size} wrong values, first at {bad[0]}: got "
            f"{np.asarray(actual).reshape(-1)[bad[0]]}, expected "
            f"{np.asarray(expected).reshape(-1)[bad[0]]}"
        )


def _refused_as_unsupported(collective, *args, dtype, op) -> bool:
    """True when the backend declares ``op`` on ``dtype`` unsupported and ``collective(*args)``
    refuses it with a TypeError before anything is sent; raises when it runs anyway."""
    if not _unsupported(dtype, op):
        return False
    try:
        collective(*args)
    except TypeError:
        return True
    raise AssertionError(f"{op} on {np.dtype(dtype)}: backend says unsupported but ran")


def _unsupported(dtype, op) -> str | None:
    backend = pb.get_default_group().backends.get(device())
    return backend.unsupported(np.dtype(dtype), op) if backend is not None else None


# -- reductions -----------------------------------------------------------------------------------


def check_all_reduce_ops_dtypes() -> None:
    rank, size = pb.get_rank(), pb.get_world_size()
    for dtype in dtypes():
        for op in valid_ops(dtype):
            for n in SMALL_SIZES:
                x = on_device(rank_input(rank, n, dtype, op))
                if _refused_as_unsupported(pb.all_reduce, x, op, dtype=dtype, op=op):
                    continue
                pb.all_reduce(x, op)
                assert_equal(
                    x, expected_reduction(size, n, dtype, op), f"all_reduce {op.name} {dtype} n={n}"
                )


def check_all_reduce_large() -> None:
    rank, size = pb.get_rank(), pb.get_world_size()
    for dtype in (np.float32, np.int64):
        for n in SIZES:
            x = on_device(rank_input(rank, n, np.dtype(dtype)))
            pb.all_reduce(x)
            assert_equal(
                x,
                expected_reduction(size, n, np.dtype(dtype), ReduceOp.SUM),
                f"all_reduce SUM {np.dtype(dtype)} n={n}",
            )
    # a multi-dimensional array is reduced in place, shape kept
    x = xp.full((3, 5, 2), rank + 1.0, dtype=np.float64)
    pb.all_reduce(x, ReduceOp.MAX)
    assert x.shape == (3, 5, 2) and (x == size).all()


def check_all_reduce_into() -> None:
    """``all_reduce(x, out=y)``: every op and dtype, small and large, synchronous and async,
    the input untouched; ranks mixing the in-place and out-of-place forms in one collective;
    bad outputs refused on the calling rank before anything is sent."""
    rank, size = pb.get_rank(), pb.get_world_size()
    for dtype in dtypes():
        for op in valid_ops(dtype):
            for n in SMALL_SIZES:
                x = on_device(rank_input(rank, n, dtype, op))
                out = xp.zeros_like(x)
                if _refused_as_unsupported(pb.all_reduce, x, op, dtype=dtype, op=op):
                    continue
                pb.all_reduce(x, op, out=out)
                what = f"all_reduce out= {op.name} {dtype} n={n}"
                assert_equal(out, expected_reduction(size, n, dtype, op), what)
                assert_equal(x, rank_input(rank, n, dtype, op), f"{what}: input changed")
    for n in SIZES:
        x = on_device(rank_input(rank, n, np.dtype(np.float32)))
        out = xp.full_like(x, -1.0)
        mine = out if rank % 2 else x  # odd ranks out of place, even ranks in place
        if rank % 2:
            pb.all_reduce(x, out=out)
        else:
            pb.all_reduce(x)
        expected = expected_reduction(size, n, np.dtype(np.float32), ReduceOp.SUM)
        assert_equal(mine, expected, f"all_reduce mixed forms n={n}")
        if rank % 2:
            assert_equal(x, rank_input(rank, n, np.dtype(np.float32)), f"n={n}: input changed")
    inputs = [
        on_device(rank_input(rank, 1000 * (i % 3) + 1, np.dtype(np.float64))) for i in range(6)
    ]
    outs = [xp.zeros_like(x) for x in inputs]
    works = [
        pb.all_reduce(x, ReduceOp.AVG, async_op=True, out=o)
        for x, o in zip(inputs, outs, strict=True)
    ]
    for w in reversed(works):
        w.wait()
    for i, (x, o) in enumerate(zip(inputs, outs, strict=True)):
        n = x.size
        assert_equal(
            o, expected_reduction(size, n, np.dtype(np.float64), ReduceOp.AVG), f"async {i}"
        )
        assert_equal(x, rank_input(rank, n, np.dtype(np.float64)), f"async {i}: input changed")
    if device() == "cpu":  # a read-only input is fine: only out is written
        ro = np.full(4, float(rank))
        ro.flags.writeable = False
        out = np.zeros(4)
        pb.all_reduce(ro, out=out)
        assert (out == sum(range(size))).all()
    x = xp.ones(8, dtype=np.float32)
    _expect(TypeError, pb.all_reduce, x, out=xp.zeros(8, np.float64), must_mention="dtype")
    _expect(ValueError, pb.all_reduce, x, out=xp.zeros(9, np.float32), must_mention="shape")
    _expect(ValueError, pb.all_reduce, x, out=xp.zeros((2, 4), np.float32), must_mention="shape")
    _expect(ValueError, pb.all_reduce, x, out=x, must_mention="overlaps")
    whole = xp.zeros(16, np.float32)
    _expect(ValueError, pb.all_reduce, whole[:8], out=whole[4:12], must_mention="overlaps")
    _expect(ValueError, pb.all_reduce, x, out=xp.zeros((8, 2), np.float32)[:, 0])
    _expect(TypeError, pb.all_reduce, x, out=[0.0] * 8)
    if device() == "cpu":
        ro = np.zeros(8, np.float32)
        ro.flags.writeable = False
        _expect(ValueError, pb.all_reduce, x, out=ro, must_mention="read-only")
    # nothing was sent: the next collective meets the same one on every rank
    out = xp.zeros(8, np.float32)
    pb.all_reduce(x, out=out)
    assert (out == size).all() and (x == 1).all()


def check_reduce() -> None:
    rank, size = pb.get_rank(), pb.get_world_size()
    for dst in range(size):
        for dtype, op in (
            (np.float32, ReduceOp.SUM),
            (np.int32, ReduceOp.MAX),
            (np.float64, ReduceOp.AVG),
            (np.int64, ReduceOp.BXOR),
        ):
            for n in (0, 1, 1000):
                x = on_device(rank_input(rank, n, np.dtype(dtype), op))
                before = x.copy()
                if _refused_as_unsupported(pb.reduce, x, dst, op, dtype=dtype, op=op):
                    continue
                pb.reduce(x, dst, op)
                if rank == dst:
                    assert_equal(
                        x,
                        expected_reduction(size, n, np.dtype(dtype), op),
                        f"reduce {op.name} to {dst}",
                    )
                else:
                    assert_equal(x, before, f"reduce leaves non-root rank {rank} unchanged")


# -- data movement ---------------------------------------------------------------------------------


def check_broadcast() -> None:
    rank, size = pb.get_rank(), pb.get_world_size()
    for src in range(size):
        for dtype in dtypes():
            for n in SIZES if dtype == np.float32 else SMALL_SIZES:
                x = on_device(rank_input(rank, n, dtype))
                pb.broadcast(x, src)
                assert_equal(x, rank_input(src, n, dtype), f"broadcast {dtype} n={n} from {src}")


def check_all_gather() -> None:
    rank, size = pb.get_rank(), pb.get_world_size()
    for dtype in (np.float32, np.int8, np.bool_, np.float64):
        dtype = np.dtype(dtype)
        for n in SIZES if dtype == np.float32 else SMALL_SIZES:
            out = xp.zeros(size * n, dtype=dtype)
            pb.all_gather(out, on_device(rank_input(rank, n, dtype)))
            for r in range(size):
                assert_equal(
                    out[r * n : (r + 1) * n],
                    rank_input(r, n, dtype),
                    f"all_gather into one array, block {r}, n={n}",
                )
            outs = [xp.zeros(n, dtype=dtype) for _ in range(size)]
            pb.all_gather(outs, on_device(rank_input(rank, n, dtype)))
            for r in range(size):
                assert_equal(outs[r], rank_input(r, n, dtype), f"all_gather list [{r}] n={n}")
            # in place: the input is this rank's block of the output (torch's documented use)
            out = xp.zeros(size * n, dtype=dtype)
            mine = out[rank * n : (rank + 1) * n]
            mine[...] = on_device(rank_input(rank, n, dtype))
            pb.all_gather(out, mine)
            for r in range(size):
                assert_equal(
                    out[r * n : (r + 1) * n], rank_input(r, n, dtype), f"in place, {r}, n={n}"
                )

    # uneven: rank r contributes r * 3 + 1 elements (and rank 1 none at all when size > 2)
    def count(r):
        return 0 if (r == 1 and size > 2) else r * 3 + 1

    outs = [xp.zeros(count(r), dtype=np.int32) for r in range(size)]
    pb.all_gather(outs, on_device(rank_input(rank, count(rank), np.dtype(np.int32))))
    for r in range(size):
        assert_equal(outs[r], rank_input(r, count(r), np.dtype(np.int32)), f"uneven [{r}]")


def check_reduce_scatter() -> None:
    rank, size = pb.get_rank(), pb.get_world_size()
    for dtype, op in (
        (np.float32, ReduceOp.SUM),
        (np.int64, ReduceOp.MIN),
        (np.float64, ReduceOp.AVG),
        (np.uint8, ReduceOp.BOR),
    ):
        dtype = np.dtype(dtype)
        for n in (0, 1, 5, 1000, (1 << 18) + 1):
            full = on_device(rank_input(rank, n * size, dtype, op))
            out = xp.zeros(n, dtype=dtype)
            if _refused_as_unsupported(pb.reduce_scatter, out, full, op, dtype=dtype, op=op):
                continue
            pb.reduce_scatter(out, full, op)
            expected = expected_reduction(size, n * size, dtype, op)[rank * n : (rank + 1) * n]
            assert_equal(out, expected, f"reduce_scatter {op.name} {dtype} n={n}")
    # uneven blocks, as a list: block i has i + 2 elements
    sizes = [i + 2 for i in range(size)]
    bounds = np.cumsum([0] + sizes)
    full = on_device(rank_input(rank, int(bounds[-1]), np.dtype(np.float32)))
    inputs = [full[bounds[i] : bounds[i + 1]] for i in range(size)]
    out = xp.zeros(sizes[rank], dtype=np.float32)
    pb.reduce_scatter(out, inputs)
    expected = expected_reduction(size, int(bounds[-1]), np.dtype(np.float32), ReduceOp.SUM)
    assert_equal(out, expected[bounds[rank] : bounds[rank + 1]], "uneven reduce_scatter")
    if device() == "cpu":  # a read-only input is fine, one array or a list: only out is written
        whole = np.full(2 * size, float(rank))
        whole.flags.writeable = False
        for form in (whole, np.split(whole, size)):  # np.split: read-only views
            out = np.zeros(2)
            pb.reduce_scatter(out, form)
            assert (out == sum(range(size))).all(), "reduce_scatter of a read-only input"


def check_all_to_all() -> None:
    rank, size = pb.get_rank(), pb.get_world_size()
    for n in (0, 1, 3, 1000, 1 << 18):
        x = xp.arange(size * n, dtype=np.int64) + 1000 * rank
        out = xp.full(size * n, -1, dtype=np.int64)
        pb.all_to_all_single(out, x)
        for src in range(size):
            expected = np.arange(rank * n, (rank + 1) * n) + 1000 * src
            assert_equal(out[src * n : (src + 1) * n], expected, f"all_to_all n={n} from {src}")

    # uneven: rank s sends (s + d) % 3 rows of width 2 to rank d
    def rows(s, d):
        return (s + d) % 3

    send_sizes = [rows(rank, d) for d in range(size)]
    recv_sizes = [rows(s, rank) for s in range(size)]
    x = (
        xp.concatenate(
            [xp.full((rows(rank, d), 2), 10 * rank + d, dtype=np.float32) for d in range(size)]
        )
        if sum(send_sizes)
        else xp.zeros((0, 2), np.float32)
    )
    out = xp.zeros((sum(recv_sizes), 2), dtype=np.float32)
    pb.all_to_all_single(out, x, recv_sizes, send_sizes)
    start = 0
    for s in range(size):
        block = out[start : start + recv_sizes[s]]
        assert (block == 10 * s + rank).all(), f"uneven all_to_all block from {s}"
        start += recv_sizes[s]
    # list form
    inputs = [xp.full(d + 1, rank * 100 + d, dtype=np.int16) for d in range(size)]
    outputs = [xp.zeros(rank + 1, dtype=np.int16) for _ in range(size)]
    pb.all_to_all(outputs, inputs)
    for s in range(size):
        assert (outputs[s] == s * 100 + rank).all(), f"all_to_all list from {s}"
    if device() == "cpu":  # read-only inputs are fine: only the outputs are written
        sends = np.arange(2 * size, dtype=np.int64) + 100 * rank
        sends.flags.writeable = False
        outputs = [np.zeros(2, np.int64) for _ in range(size)]
        pb.all_to_all(outputs, np.split(sends, size))
        for s in range(size):
            want = np.arange(2 * rank, 2 * rank + 2) + 100 * s
            assert (outputs[s] == want).all(), f"all_to_all of read-only inputs from {s}"


def check_gather_scatter() -> None:
    rank, size = pb.get_rank(), pb.get_world_size()
    for root in range(size):
        for n in (0, 1, 1000):
            x = on_device(rank_input(rank, n, np.dtype(np.float64)))
            outs = [xp.zeros(n) for _ in range(size)] if rank == root else None
            pb.gather(x, outs, dst=root)
            if rank == root:
                for r in range(size):
                    assert_equal(outs[r], rank_input(r, n, np.dtype(np.float64)), "gather")
            y = xp.zeros(n, dtype=np.int32)
            pieces = (
                [on_device(rank_input(r, n, np.dtype(np.int32))) for r in range(size)]
                if rank == root
                else None
            )
            pb.scatter(y, pieces, src=root)
            assert_equal(y, rank_input(rank, n, np.dtype(np.int32)), f"scatter from {root}")


def check_barrier() -> None:
    import time

    rank, size = pb.get_rank(), pb.get_world_size()
    store = pb.get_default_group().store
    for round_ in range(3):
        time.sleep(0.02 * ((rank + round_) % size))
        store.set(f"conformance/barrier/{round_}/{rank}", b"1")
        pb.barrier()
        assert store.check([f"conformance/barrier/{round_}/{r}" for r in range(size)]), (
            f"rank {rank} left barrier {round_} before every rank entered it"
        )
    pb.barrier()


# -- point to point --------------------------------------------------------------------------------


def check_send_recv() -> None:
    rank, size = pb.get_rank(), pb.get_world_size()
    if size == 1:
        return
    right, left = (rank + 1) % size, (rank - 1) % size
    for n in (0, 1, 1000, 1 << 20):
        out = xp.full(n, rank, dtype=np.float32)
        got = xp.zeros(n, dtype=np.float32)
        work = pb.isend(out, right)
        pb.recv(got, left)
        work.wait()
        assert (got == left).all(), f"ring send/recv n={n}"
    # tags are matched, not ordered: receive tag 2 before tag 1
    a, b = xp.zeros(3), xp.zeros(3)
    w1 = pb.isend(xp.full(3, 1.0), right, tag=1)
    w2 = pb.isend(xp.full(3, 2.0), right, tag=2)
    pb.recv(b, left, tag=2)
    pb.recv(a, left, tag=1)
    w1.wait()
    w2.wait()
    assert (a == 1).all() and (b == 2).all(), "tag matching"
    # an irecv posted before the matching send arrives, many in flight
    works = [pb.irecv(xp.zeros(4), left, tag=7) for _ in range(5)]
    pb.barrier()
    sends = [pb.isend(xp.full(4, float(i)), right, tag=7) for i in range(5)]
    for w in sends + works:
        w.wait()
        assert w.is_completed()


def check_async_ordering() -> None:
    rank, size = pb.get_rank(), pb.get_world_size()
    arrays = [xp.full(1000 * (i % 3) + 1, float(i + rank), dtype=np.float64) for i in range(12)]
    works = [pb.all_reduce(a, async_op=True) for a in arrays]
    blocking = xp.full(5, 1.0)
    pb.all_reduce(blocking)  # a synchronous op after queued ones waits for them
    assert (blocking == size).all()
    for w in reversed(works):
        w.wait()
        assert w.is_completed()
    for i, a in enumerate(arrays):
        expected = sum(i + r for r in range(size))
        assert (a == expected).all(), f"async all_reduce {i}"
    mixed = [
        pb.broadcast(xp.full(10, float(rank)), 0, async_op=True),
        pb.all_gather(xp.zeros(size), xp.array([float(rank)]), async_op=True),
        pb.barrier(async_op=True),
    ]
    for w in mixed:
        assert w.wait(timeout=60)


def check_subgroups() -> None:
    rank, size = pb.get_rank(), pb.get_world_size()
    evens = pb.new_group([r for r in range(size) if r % 2 == 0])
    odds = pb.new_group([r for r in range(size) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    other = odds if rank % 2 == 0 else evens
    assert other is pb.NON_GROUP_MEMBER
    members = [r for r in range(size) if r % 2 == rank % 2]
    assert pb.get_world_size(mine) == len(members)
    assert pb.get_rank(mine) == members.index(rank)
    x = xp.array([float(rank)] * 100)
    pb.all_reduce(x, group=mine)
    assert (x == sum(members)).all(), "sub-group all_reduce"
    y = xp.array([rank], dtype=np.int64)
    pb.broadcast(y, members[-1], group=mine)  # src is a global rank
    assert y[0] == members[-1]
    out = xp.zeros(len(members), dtype=np.int64)
    pb.all_gather(out, xp.array([rank], dtype=np.int64), group=mine)
    assert list(to_host(out)) == members
    if len(members) > 1:
        peer = members[(members.index(rank) + 1) % len(members)]
        prev = members[(members.index(rank) - 1) % len(members)]
        got = xp.zeros(2)
        w = pb.isend(xp.full(2, float(rank)), peer, group=mine, tag=3)
        pb.recv(got, prev, group=mine, tag=3)
        w.wait()
        assert (got == prev).all()
    # the world still works, and sub-group traffic did not leak into it
    z = xp.ones(3)
    pb.all_reduce(z)
    assert (z == size).all()
    try:
        pb.all_reduce(xp.ones(1), group=other)
    except ValueError as exc:
        assert "not a member" in str(exc)
    else:
        raise AssertionError("a collective on a group this rank is not in must be refused")
    pb.destroy_process_group(mine)


def check_overlapping_subgroups() -> None:
    """Groups that share ranks, created in the same order everywhere, keep their traffic apart
    even though each rank sees only the groups it belongs to."""
    rank, size = pb.get_rank(), pb.get_world_size()
    pairs = [pb.new_group([r, (r + 1) % size]) for r in range(size)] if size > 2 else []
    for r, group in enumerate(pairs):
        members = {r, (r + 1) % size}
        if rank in members:
            x = xp.array([float(rank + 1)] * 3)
            pb.all_reduce(x, group=group)
            assert (x == sum(m + 1 for m in members)).all(), f"pair group {sorted(members)}"
        else:
            assert group is pb.NON_GROUP_MEMBER
    for group in pairs:
        pb.destroy_process_group(group)


def check_objects() -> None:
    rank, size = pb.get_rank(), pb.get_world_size()
    obj = {"rank": rank, "payload": list(range(rank * 10))}
    assert pb.all_gather_object(obj) == [
        {"rank": r, "payload": list(range(r * 10))} for r in range(size)
    ]
    got = pb.broadcast_object(obj if rank == size - 1 else None, src=size - 1)
    assert got == {"rank": size - 1, "payload": list(range((size - 1) * 10))}


# -- every call reaches every plugin ---------------------------------------------------------------


class CallCounter:
    """A plugin wrapping every operation hook, counting the calls it sees on one group per
    (global rank, operation, async_op). It also offers a backend (none here), as a plugin that
    ships both would."""

    def __init__(self, group_name: str):
        self.group_name = group_name
        self.counts: collections.Counter = collections.Counter()
        for name, impl in hook_implementations(self._count, wrapper=True).items():
            setattr(self, name, impl)

    def _count(self, op, group, args, async_op):
        if group.name == self.group_name:
            self.counts[(group.global_rank, op.name, async_op)] += 1
        return (yield)

    @pb.hookimpl
    def pluribus_backends(self):
        return []


# Observers shared by the ranks of one process (ranks that are threads register them once).
_observers: dict[str, object] = {}
_observers_lock = threading.Lock()


def _observe(key: str, make) -> object:
    with _observers_lock:
        if key not in _observers:
            _observers[key] = make()
        return _observers[key]


def _round(group, rank: int, size: int) -> None:
    """Every operation once synchronously and once with async_op=True on ``group``."""
    n = 2
    for async_op in (False, True):
        works = [
            pb.all_reduce(xp.ones(n), group=group, async_op=async_op),
            pb.all_reduce(xp.ones(n), group=group, async_op=async_op, out=xp.zeros(n)),
            pb.broadcast(xp.ones(n), 0, group=group, async_op=async_op),
            pb.reduce(xp.ones(n), 0, group=group, async_op=async_op),
            pb.all_gather(xp.zeros(n * size), xp.ones(n), group=group, async_op=async_op),
            pb.reduce_scatter(xp.zeros(n), xp.ones(n * size), group=group, async_op=async_op),
            pb.all_to_all(
                [xp.zeros(n) for _ in range(size)],
                [xp.ones(n) for _ in range(size)],
                group=group,
                async_op=async_op,
            ),
            pb.gather(
                xp.ones(n),
                [xp.zeros(n) for _ in range(size)] if rank == 0 else None,
                0,
                group=group,
                async_op=async_op,
            ),
            pb.scatter(
                xp.zeros(n),
                [xp.ones(n) for _ in range(size)] if rank == 0 else None,
                0,
                group=group,
                async_op=async_op,
            ),
            pb.barrier(group=group, async_op=async_op),
        ]
        if size > 1:
            right, left = (rank + 1) % size, (rank - 1) % size
            if async_op:
                works += [
                    pb.isend(xp.ones(n), right, group, 5),
                    pb.irecv(xp.zeros(n), left, group, 5),
                ]
            elif rank % 2 == 0:  # even ranks send first, so rendezvous sends cannot deadlock
                pb.send(xp.ones(n), right, group, 6)
                pb.recv(xp.zeros(n), left, group, 6)
            else:
                pb.recv(xp.zeros(n), left, group, 6)
                pb.send(xp.ones(n), right, group, 6)
        for work in works:
            if work is not None:
                work.wait()


def check_every_call_seen() -> None:
    """A wrapper plugin, one that also offers a backend, and pluggy's hook-call monitoring see
    every call, synchronous or not, whether registered before the first call or mid-run (after
    the group has run calls without any of them)."""
    rank, size = pb.get_rank(), pb.get_world_size()
    group = pb.new_group(list(range(size)))
    manager = pb.get_plugin_manager()
    first = _observe(f"first/{group.name}", lambda: CallCounter(group.name))
    later = _observe(f"later/{group.name}", lambda: CallCounter(group.name))
    monitored = _observe(f"monitored/{group.name}", collections.Counter)

    def before(hook_name, impls, kwargs):
        if hook_name.removeprefix("pluribus_") in OPERATIONS and kwargs["group"].name == group.name:
            monitored[(kwargs["group"].global_rank, hook_name, kwargs["async_op"])] += 1

    def make_monitor():
        return manager.add_hookcall_monitoring(before, lambda *args: None)

    def register(plugin, name):
        with _observers_lock:
            if not manager.has_plugin(name):
                manager.register(plugin, name=name)

    _round(group, rank, size)  # with no plugin: synchronous calls skip pluggy
    pb.barrier()
    register(first, f"conformance-first-{group.name}")
    undo = _observe(f"monitor/{group.name}", make_monitor)
    pb.barrier()
    try:
        assert group.direct("all_reduce", "cpu") is None, "a wrapper is registered: no shortcut"
        _round(group, rank, size)
        pb.barrier()
        register(later, f"conformance-later-{group.name}")
        pb.barrier()
        _round(group, rank, size)
        pb.barrier()
    finally:
        with _observers_lock:
            for name in (f"conformance-first-{group.name}", f"conformance-later-{group.name}"):
                if manager.has_plugin(name):
                    manager.unregister(name=name)
            if _observers.pop(f"monitor/{group.name}", None) is not None:
                undo()
            _observers.pop(f"first/{group.name}", None)
            _observers.pop(f"later/{group.name}", None)
            _observers.pop(f"monitored/{group.name}", None)
        pb.barrier()
    one_round = collections.Counter(
        {
            (rank, name, async_op): 1
            for name, op in OPERATIONS.items()
            for async_op in (False, True)
            if op.collective or size > 1
        }
    )
    mine = {k: v for k, v in first.counts.items() if k[0] == rank}
    assert mine == {k: 2 * v for k, v in one_round.items()}, (
        f"a wrapper registered before the calls saw {mine}, expected two of each of {one_round}"
    )
    mine = {k: v for k, v in later.counts.items() if k[0] == rank}
    assert mine == dict(one_round), (
        f"a wrapper registered mid-run saw {mine}, expected one of each of {one_round}"
    )
    mine = {
        (r, h.removeprefix("pluribus_"), a): v for (r, h, a), v in monitored.items() if r == rank
    }
    assert mine == {k: 2 * v for k, v in one_round.items()}, (
        f"pluggy's hook-call monitoring saw {mine}, expected two of each of {one_round}"
    )
    pb.destroy_process_group(group)


# -- timeouts and errors ---------------------------------------------------------------------------


def check_timeouts() -> None:
    rank, size = pb.get_rank(), pb.get_world_size()
    store = pb.get_default_group().store
    try:
        store.get(f"conformance/never-set/{rank}", timeout=0.2)
    except DistTimeoutError as exc:
        assert "never-set" in str(exc), "the timeout names the key"
    else:
        raise AssertionError("store.get of a missing key must time out")
    if size == 1:
        return
    right, left = (rank + 1) % size, (rank - 1) % size
    late = xp.zeros(2)
    work = pb.irecv(late, left, tag=99)
    _expect_timeout(lambda: work.wait(timeout=0.3), "Work.wait(timeout=0.3)", 0.3)
    assert not work.is_completed()
    pb.barrier()
    pb.send(xp.full(2, 5.0), right, tag=99)  # now satisfy it: nothing is lost
    work.wait(timeout=60)
    assert (late == 5).all()


def _expect_timeout(fn, what: str, seconds: float) -> None:
    """``fn()`` must raise DistTimeoutError naming this rank after about ``seconds``: not a raw
    transport exception (queue.Empty, EOFError, socket.timeout), and not the world's timeout."""
    rank = pb.get_rank()
    start = time.monotonic()
    try:
        fn()
    except DistTimeoutError as exc:
        took = time.monotonic() - start
        assert f"rank {rank}" in str(exc), f"{what}: the timeout error must name the rank: {exc}"
        assert took < seconds + 8, f"{what} timed out after {took:.1f}s, not {seconds}s"
        return
    except Exception as exc:
        raise AssertionError(
            f"{what} raised {type(exc).__name__}: {exc}; a timeout must be a DistTimeoutError "
            "naming the rank, not the transport's own exception"
        ) from exc
    raise AssertionError(f"{what} must time out when nothing arrives")


def check_subgroup_timeout() -> None:
    """A sub-group's own timeout applies to its calls, not the world's."""
    rank, size = pb.get_rank(), pb.get_world_size()
    if size == 1:
        return
    sub = pb.new_group(list(range(size)), timeout=2)
    buf = np.zeros(2)
    _expect_timeout(
        lambda: pb.recv(buf, (rank + 1) % size, group=sub, tag=4242), "recv on a group", 2
    )
    pb.barrier()
    pb.destroy_process_group(sub)


def check_kill_a_rank() -> float | None:
    """The last rank is SIGKILLed inside an all-reduce; every other rank must raise PeerError
    naming it within 5 s (the suite runs this only with ranks in processes)."""
    rank, size = pb.get_rank(), pb.get_world_size()
    victim = size - 1
    x = np.ones(1024)
    pb.barrier()
    if rank == victim:
        pb.all_reduce(x, async_op=True)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    start = time.monotonic()
    try:
        for _ in range(1000):
            pb.all_reduce(x)
    except PeerError as exc:
        took = time.monotonic() - start
        assert f"rank {victim}" in str(exc), f"the PeerError must name rank {victim}: {exc}"
        assert f"rank {rank}" in str(exc), f"the PeerError must name this rank: {exc}"
        assert took < 5, f"rank {victim}'s death took {took:.1f}s to notice (limit 5 s)"
        return took
    except Exception as exc:
        raise AssertionError(
            f"a dead rank {victim} must be a PeerError naming it, not {type(exc).__name__}: {exc}"
        ) from exc
    raise AssertionError(f"all_reduce went on after rank {victim} was killed")


ABORT_REASON = "the conformance suite's abort case"


def check_abort() -> float | None:
    """Rank 0 aborts the world: its later calls raise, and every other rank, waiting in an
    all-reduce rank 0 never joins, raises PeerError naming rank 0 and its reason within 5 s."""
    rank = pb.get_rank()
    pb.barrier()
    if rank == 0:
        time.sleep(0.2)
        pb.get_default_group().abort(ABORT_REASON)
        try:
            pb.all_reduce(np.ones(4))
        except PluribusError as exc:
            assert f"rank {rank}" in str(exc), f"the error must name this rank: {exc}"
            return None
        raise AssertionError("a collective after abort() must raise")
    start = time.monotonic()
    try:
        pb.all_reduce(np.ones(4))
    except PeerError as exc:
        took = time.monotonic() - start
        assert "rank 0" in str(exc) and ABORT_REASON in str(exc), (
            f"the PeerError must name rank 0 and why it aborted: {exc}"
        )
        assert took < 5, f"rank 0's abort took {took:.1f}s to reach rank {rank} (limit 5 s)"
        return took
    raise AssertionError("an all-reduce rank 0 never joined completed")


def _expect(exc_type, fn, *args, must_mention: str = "", names_rank: bool = True, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        if must_mention and must_mention not in str(exc):
            raise AssertionError(f"error {exc!r} should mention {must_mention!r}") from exc
        if names_rank and f"rank {pb.get_rank()}" not in str(exc):
            raise AssertionError(f"error {exc!r} should name the rank") from exc
        return
    raise AssertionError(f"{getattr(fn, '__name__', fn)} should have raised {exc_type.__name__}")


def check_bad_input() -> None:
    rank, size = pb.get_rank(), pb.get_world_size()
    x = xp.ones(8, dtype=np.float32)
    _expect(ValueError, pb.broadcast, x, src=size, must_mention="not a member")
    _expect(ValueError, pb.reduce, x, dst=-1)
    _expect(ValueError, pb.send, x, dst=rank, must_mention="itself")
    _expect(ValueError, pb.recv, x, src=rank)
    _expect(TypeError, pb.all_reduce, x, pb.ReduceOp.BAND, must_mention="BAND")
    _expect(TypeError, pb.all_reduce, xp.ones(3, dtype=np.int32), pb.ReduceOp.AVG)
    _expect(ValueError, pb.all_reduce, xp.ones((4, 4))[:, 1], must_mention="contiguous")
    if device() == "cpu":  # cupy arrays have no read-only flag
        ro = np.ones(4)
        ro.flags.writeable = False
        _expect(ValueError, pb.all_reduce, ro, must_mention="read-only")
    _expect(TypeError, pb.all_reduce, xp.ones(2, dtype=np.complex64))
    _expect(TypeError, pb.all_reduce, [1, 2, 3])
    _expect(ValueError, pb.all_gather, xp.zeros(size * 8 + 1, np.float32), x)
    _expect(ValueError, pb.all_gather, [xp.zeros(8, np.float32)] * (size + 1), x)
    _expect(TypeError, pb.all_gather, xp.zeros(size * 8, np.float64), x)
    _expect(
        ValueError, pb.reduce_scatter, xp.zeros(3, np.float32), xp.zeros(3 * size + 1, np.float32)
    )
    _expect(
        ValueError,
        pb.all_to_all_single,
        xp.zeros(size * 2),
        xp.zeros(size * 2),
        [2] * size,
        [1] * size,
        must_mention="adding up",
    )
    _expect(ValueError, pb.send, x, dst=(rank + 1) % size if size > 1 else 0, tag=-1)
    _expect(
        PluribusError,
        pb.init_process_group,
        "threads",
        rank=rank,
        world_size=size,
        store=pb.HashStore(),
        must_mention="already",
    )
    from pluribus.plugins import resolve_backend

    _expect(
        pb.BackendUnavailableError,
        resolve_backend,
        "no-such-backend-xyz",
        must_mention="pip install",
        names_rank=False,
    )
    # nothing was sent by the refused calls: the group still works and is in step
    y = xp.full(4, float(rank))
    pb.all_reduce(y)
    assert (y == sum(range(size))).all()

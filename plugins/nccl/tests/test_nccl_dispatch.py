"""Through the public API on the CPU stand-in: the refusal of numpy arrays on an NCCL-only group,
the hybrid "cpu:...,cuda:nccl" group, and every collective checked against numpy.

The stand-in backend is registered as "fakenccl": an NcclBackend on FakeRuntime, so the real
hooks, reductions, pointers and counts run; only the GPU and libnccl are simulated.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pluribus as dist
import pytest
from nccl_fakes import FakeCupyArray, FakeNccl, FakeRuntime, device_array, run_threads
from pluribus import BackendSpec, HashStore, ReduceOp, hookimpl, plugins
from pluribus_nccl.backend import NcclBackend, NcclWork, create_backend

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def fake_nccl():
    """Register backend "fakenccl" (cuda arrays, NCCL logic on the CPU stand-in)."""
    runtime = FakeRuntime(FakeNccl())
    module = types.ModuleType("fakenccl_plugin")

    @hookimpl
    def pluribus_backends():
        yield BackendSpec(
            name="fakenccl",
            create=lambda ctx: create_backend(ctx, runtime, device_id=0),
            devices=("cuda",),
        )

    module.pluribus_backends = pluribus_backends
    manager = plugins.get_plugin_manager()
    manager.register(module, name="fakenccl-test")
    plugins.registry().specs = None
    try:
        yield runtime
    finally:
        manager.unregister(name="fakenccl-test")
        plugins.registry().specs = None
        plugins._probe_cache.pop("fakenccl", None)


def _run(size: int, backend: str, fn, timeout: float = 60.0):
    store = HashStore()

    def rank_main(rank: int):
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=20)
        try:
            return fn(rank, size)
        finally:
            dist.destroy_process_group()

    return run_threads(size, rank_main, timeout)


def _comm_calls(runtime: FakeRuntime, name: str) -> int:
    return sum(1 for c in runtime.nccl.communicators for call in c.calls if call[0] == name)


# -- the CPU refusal ------------------------------------------------------------------------------


def test_numpy_on_an_nccl_only_group_is_refused_naming_the_hybrid_form(fake_nccl):
    def body(rank, size):
        with pytest.raises(TypeError) as info:
            dist.all_reduce(np.ones(3, dtype=np.float32))
        message = str(info.value)
        assert '"cpu:gloo,cuda:nccl"' in message and "cpu array" in message
        assert "carries only cuda (nccl) arrays" in message
        with pytest.raises(TypeError, match="cpu:gloo,cuda:nccl"):
            dist.broadcast(np.ones(3), src=0)
        return message

    (message,) = _run(1, "fakenccl", body)
    assert _comm_calls(fake_nccl, "allReduce") == 0


def test_object_collectives_and_from_local_go_through_the_device(fake_nccl, monkeypatch):
    """An NCCL-only group carries no numpy arrays: the object collectives (and DTensor's
    from_local check, which uses them) copy their bytes to the device and back."""
    from pluribus.dtensor import Shard, from_local, init_device_mesh

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(asarray=device_array))

    def body(rank, size):
        gathered = dist.all_gather_object({"rank": rank, "word": "abc" * 2 * rank})
        said = dist.broadcast_object("from rank 1" if rank == 1 else None, src=1)
        mesh = init_device_mesh("cuda", (size,))
        piece = from_local(device_array(np.full((rank + 1, 3), rank)), mesh, [Shard(0)])
        return gathered, said, piece.layout.sizes

    for gathered, said, sizes in _run(2, "fakenccl", body):
        assert gathered == [{"rank": 0, "word": ""}, {"rank": 1, "word": "abcabc"}]
        assert said == "from rank 1"
        assert sizes == ((1, 2),)


def test_bitwise_ops_are_refused_before_anything_is_sent(fake_nccl):
    def body(rank, size):
        x = device_array([1, 2, 3], np.int32)
        for op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
            with pytest.raises(TypeError, match="NCCL has no bitwise reductions"):
                dist.all_reduce(x, op=op)
        flags = device_array([True, False, True])
        dist.all_reduce(flags, op=ReduceOp.BAND)  # bool BAND is MIN on bytes: supported
        with pytest.raises(TypeError, match="bool arrays with BXOR"):
            dist.all_reduce(flags, op=ReduceOp.BXOR)

    _run(2, "fakenccl", body)


def test_unsupported_reasons():
    nccl = FakeNccl(version=20907)  # before NCCL_AVG existed
    backend = NcclBackend(object(), 0, 2, 5.0, 0, FakeRuntime(nccl))
    assert backend.unsupported(np.float32, ReduceOp.SUM) is None
    assert backend.unsupported(np.int16, ReduceOp.PRODUCT) is None  # reduced as int32
    assert backend.unsupported(np.bool_, ReduceOp.BOR) is None
    assert "bitwise" in backend.unsupported(np.int64, ReduceOp.BXOR)
    assert not backend.native_avg
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    assert "no reduction for dtype bfloat16" in backend.unsupported(bf16, ReduceOp.SUM)
    nccl.NCCL_BFLOAT16 = 9
    assert backend.unsupported(bf16, ReduceOp.SUM) is None
    assert "NCCL 2.10" in backend.unsupported(bf16, ReduceOp.AVG)


# -- the hybrid group -----------------------------------------------------------------------------


def test_hybrid_group_sends_numpy_through_cpu_and_cupy_through_nccl(fake_nccl):
    def body(rank, size):
        assert dist.get_backend() == "cpu:threads,cuda:nccl"  # the backend's own name
        host = np.full(4, rank + 1, dtype=np.float64)
        device = device_array(np.full(4, 10 * (rank + 1), dtype=np.float32))
        dist.all_reduce(host)
        dist.all_reduce(device)
        assert isinstance(device, FakeCupyArray)
        np.testing.assert_array_equal(host, np.full(4, sum(range(1, size + 1))))
        np.testing.assert_array_equal(device, np.full(4, 10 * sum(range(1, size + 1))))
        host_bits = np.array([1 << rank], dtype=np.int32)
        dist.all_reduce(host_bits, op=ReduceOp.BOR)  # bitwise on the CPU backend is fine
        assert host_bits[0] == (1 << size) - 1
        gathered = [np.empty(2, np.int64) for _ in range(size)]
        dist.all_gather(gathered, np.array([rank, rank], np.int64))
        assert [int(g[0]) for g in gathered] == list(range(size))
        dist.barrier()

    _run(3, "cpu:threads,cuda:fakenccl", body)
    # Exactly the cupy all_reduce went through NCCL (one call per rank), nothing else.
    assert _comm_calls(fake_nccl, "allReduce") == 3
    assert _comm_calls(fake_nccl, "allGather") == 0


def test_the_plugin_leaves_dispatch_to_the_core():
    from pluribus.builtin.collectives import backend_of
    from pluribus.operations import OPERATIONS
    from pluribus_nccl import plugin

    assert not [name for name in dir(plugin) if name.removeprefix("pluribus_") in OPERATIONS]
    cpu = object()
    nccl_like = NcclBackend(object(), 0, 1, 5.0, 0, FakeRuntime())
    hybrid = types.SimpleNamespace(backends={"cpu": cpu, "cuda": nccl_like})
    assert backend_of(hybrid, OPERATIONS["barrier"], ()) is cpu  # the CPU backend does barriers
    nccl_only = types.SimpleNamespace(backends={"cuda": nccl_like})
    assert backend_of(nccl_only, OPERATIONS["barrier"], ()) is nccl_like


# -- every collective against numpy ---------------------------------------------------------------


def _data(rank: int, n: int, dtype) -> np.ndarray:
    return (np.arange(n) % 7 + rank + 1).astype(dtype)


@pytest.mark.parametrize("version", [22103, 20907], ids=["native-avg", "sum-then-divide"])
def test_all_reduce_every_op_and_dtype(fake_nccl, version):
    fake_nccl.nccl.version = version
    size = 3
    cases = [
        (np.float32, ReduceOp.SUM),
        (np.float64, ReduceOp.AVG),
        (np.float16, ReduceOp.AVG),
        (np.float32, ReduceOp.PRODUCT),
        (np.int64, ReduceOp.MIN),
        (np.uint8, ReduceOp.MAX),
        (np.int16, ReduceOp.SUM),
        (np.int16, ReduceOp.PRODUCT),
        (np.int8, ReduceOp.SUM),
    ]

    def body(rank, size):
        for dtype, op in cases:
            x = device_array(_data(rank, 11, dtype))
            dist.all_reduce(x, op=op)
            parts = [_data(r, 11, dtype) for r in range(size)]
            if op is ReduceOp.AVG:
                expected = (sum(p.astype(np.float64) for p in parts) / size).astype(dtype)
            else:
                ufunc = {
                    ReduceOp.SUM: np.add,
                    ReduceOp.PRODUCT: np.multiply,
                    ReduceOp.MIN: np.minimum,
                    ReduceOp.MAX: np.maximum,
                }[op]
                expected = ufunc.reduce(np.stack(parts), axis=0).astype(dtype)
            np.testing.assert_allclose(x, expected, rtol=1e-3, err_msg=f"{dtype} {op}")
            assert x.dtype == np.dtype(dtype)
        flags = device_array([rank == 0, True, False])
        dist.all_reduce(flags, op=ReduceOp.SUM)  # logical or
        np.testing.assert_array_equal(flags, [True, True, False])
        flags = device_array([rank == 0, True, False])
        dist.all_reduce(flags, op=ReduceOp.PRODUCT)  # logical and
        np.testing.assert_array_equal(flags, [False, True, False])

    _run(size, "fakenccl", body)
    avg_ops = [
        c[5]
        for comm in fake_nccl.nccl.communicators
        for c in comm.calls
        if c[0] == "allReduce" and c[4] in (6, 8)
    ]  # float16/float64 rows are AVG
    assert (4 in avg_ops) == (version >= 21000)


def test_broadcast_reduce_send_recv(fake_nccl):
    def body(rank, size):
        x = device_array(_data(rank, 5, np.float32))
        dist.broadcast(x, src=2)
        np.testing.assert_array_equal(x, _data(2, 5, np.float32))
        y = device_array(_data(rank, 5, np.int32))
        dist.reduce(y, dst=1, op=ReduceOp.MAX)
        expected = np.max([_data(r, 5, np.int32) for r in range(size)], axis=0)
        np.testing.assert_array_equal(y, expected if rank == 1 else _data(rank, 5, np.int32))
        z = device_array(_data(rank, 4, np.int16))
        dist.reduce(z, dst=0, op=ReduceOp.SUM)  # widened to int32 and cast back on the root
        if rank == 0:
            np.testing.assert_array_equal(z, sum(_data(r, 4, np.int16) for r in range(size)))
        if rank == 0:
            dist.send(device_array([1.5, 2.5]), dst=1)
        elif rank == 1:
            got = device_array([0.0, 0.0])
            dist.recv(got, src=0)
            np.testing.assert_array_equal(got, [1.5, 2.5])
        work = dist.broadcast(device_array(np.zeros(3)), src=0, async_op=True)
        assert isinstance(work, NcclWork) and work.wait()

    _run(3, "fakenccl", body)


def test_all_gather_even_into_tensor_list_and_uneven(fake_nccl):
    def body(rank, size):
        mine = device_array(_data(rank, 3, np.float32))
        flat = device_array(np.zeros(3 * size, np.float32))
        dist.all_gather_into_tensor(flat, mine)  # consecutive views: one ncclAllGather
        np.testing.assert_array_equal(
            flat, np.concatenate([_data(r, 3, np.float32) for r in range(size)])
        )
        separate = [device_array(np.zeros(3, np.float32)) for _ in range(size)]
        dist.all_gather(separate, mine)  # separate arrays: gathered and copied out
        for r in range(size):
            np.testing.assert_array_equal(separate[r], _data(r, 3, np.float32))
        uneven_in = device_array(_data(rank, rank + 1, np.int64))
        uneven_out = [device_array(np.zeros(r + 1, np.int64)) for r in range(size)]
        dist.all_gather(uneven_out, uneven_in)  # grouped send/recv
        for r in range(size):
            np.testing.assert_array_equal(uneven_out[r], _data(r, r + 1, np.int64))

    _run(3, "fakenccl", body)
    calls = {name: _comm_calls(fake_nccl, name) for name in ("allGather", "send", "recv")}
    assert calls["allGather"] == 6 and calls["send"] == 6 and calls["recv"] == 6


def test_reduce_scatter_even_packed_and_uneven(fake_nccl):
    def body(rank, size):
        n = 4
        full = device_array(_data(rank, n * size, np.float32))
        out = device_array(np.zeros(n, np.float32))
        dist.reduce_scatter_tensor(out, full)  # one ncclReduceScatter on the buffer itself
        total = sum(_data(r, n * size, np.float32) for r in range(size))
        np.testing.assert_array_equal(out, total[rank * n : (rank + 1) * n])
        blocks = [device_array(_data(rank + i, n, np.int16)) for i in range(size)]
        out16 = device_array(np.zeros(n, np.int16))
        dist.reduce_scatter(out16, blocks, op=ReduceOp.SUM)  # packed, widened
        expected = sum(_data(r + rank, n, np.int16).astype(np.int32) for r in range(size))
        np.testing.assert_array_equal(out16, expected.astype(np.int16))
        sizes = [1, 3, 2]
        uneven = [device_array(_data(rank, sizes[i], np.float64)) for i in range(size)]
        out_uneven = device_array(np.zeros(sizes[rank], np.float64))
        dist.reduce_scatter(out_uneven, uneven, op=ReduceOp.AVG)  # grouped reduces
        expected = sum(_data(r, sizes[rank], np.float64) for r in range(size)) / size
        np.testing.assert_allclose(out_uneven, expected)

    _run(3, "fakenccl", body)
    assert _comm_calls(fake_nccl, "reduceScatter") == 6
    assert _comm_calls(fake_nccl, "reduce") == 9


def test_all_to_all_gather_scatter_barrier(fake_nccl):
    def body(rank, size):
        # rank r sends (r + 1) * 10 + j, repeated j + 1 times, to rank j
        inputs = [device_array(np.full(j + 1, (rank + 1) * 10 + j, np.int32)) for j in range(size)]
        outputs = [device_array(np.zeros(rank + 1, np.int32)) for _ in range(size)]
        dist.all_to_all(outputs, inputs)
        for j in range(size):
            np.testing.assert_array_equal(outputs[j], np.full(rank + 1, (j + 1) * 10 + rank))
        single_in = device_array(np.arange(size * 2, dtype=np.float32) + 100 * rank)
        single_out = device_array(np.zeros(size * 2, np.float32))
        dist.all_to_all_single(single_out, single_in)
        expected = np.concatenate(
            [np.arange(rank * 2, rank * 2 + 2) + 100 * j for j in range(size)]
        )
        np.testing.assert_array_equal(single_out, expected)
        mine = device_array(np.full(2, rank, np.float64))
        gathered = [device_array(np.zeros(2)) for _ in range(size)] if rank == 1 else None
        dist.gather(mine, gathered, dst=1)
        if rank == 1:
            for r in range(size):
                np.testing.assert_array_equal(gathered[r], [r, r])
        target = device_array(np.zeros(3, np.int64))
        pieces = (
            [device_array(np.full(3, 7 * r, np.int64)) for r in range(size)] if rank == 0 else None
        )
        dist.scatter(target, pieces, src=0)
        np.testing.assert_array_equal(target, np.full(3, 7 * rank))
        dist.barrier()
        work = dist.barrier(async_op=True)
        assert work.wait()

    _run(3, "fakenccl", body)


def test_async_work_and_subgroups_through_the_api(fake_nccl):
    def body(rank, size):
        x = device_array(np.full(3, rank, np.float32))
        work = dist.all_reduce(x, async_op=True)
        assert isinstance(work, NcclWork)
        assert work.wait() and work.is_completed()
        np.testing.assert_array_equal(x, np.full(3, sum(range(size))))
        sub = dist.new_group([0, 2])
        if rank in (0, 2):
            y = device_array([float(rank)])
            dist.all_reduce(y, group=sub)
            assert y[0] == 2.0
            assert dist.get_rank(sub) == (0 if rank == 0 else 1)
            assert isinstance(sub.backends["cuda"], NcclBackend)
            assert sub.backends["cuda"].comm is not dist.get_default_group().backends["cuda"].comm
            dist.destroy_process_group(sub)
            assert sub.backends["cuda"].comm is None

    _run(3, "fakenccl", body)
    destroyed = [c for c in fake_nccl.nccl.communicators if c.destroyed]
    assert len(destroyed) == 5  # 3 world communicators + 2 of the sub-group


# -- the GPU checks themselves, run on the stand-in so that they are right before a GPU runs them


def _fake_cupy_module() -> types.ModuleType:
    import contextlib

    cupy = types.ModuleType("cupy")

    def wrap(fn):
        return lambda *args, **kwargs: np.asarray(fn(*args, **kwargs)).view(FakeCupyArray)

    cupy.asarray = wrap(lambda a, dtype=None: np.array(a, dtype=dtype))
    cupy.empty = wrap(np.empty)
    cupy.zeros = wrap(np.zeros)
    cupy.full = wrap(np.full)
    cupy.ones = wrap(np.ones)
    cupy.asnumpy = lambda a: np.asarray(a)

    class Stream(contextlib.nullcontext):
        def __init__(self, non_blocking=False):
            super().__init__(self)

        def synchronize(self):
            pass

    cupy.cuda = types.SimpleNamespace(
        Device=lambda device=None: types.SimpleNamespace(id=0), Stream=Stream
    )
    return cupy


def test_the_gpu_checks_pass_on_the_stand_in(fake_nccl, monkeypatch):
    import test_nccl_gpu as gpu

    monkeypatch.setitem(__import__("sys").modules, "cupy", _fake_cupy_module())
    monkeypatch.setattr(gpu, "SIZES", (0, 1, 1000))

    def body(rank, size):
        result = gpu.check_every_collective()
        gpu.check_subgroup()
        gpu.check_refusals()
        return result

    results = _run(3, "fakenccl", body)
    assert [r["rank"] for r in results] == [0, 1, 2]
    _run(3, "cpu:threads,cuda:fakenccl", lambda rank, size: gpu.check_hybrid_group())
    plugins._probe_cache.pop("nccl", None)

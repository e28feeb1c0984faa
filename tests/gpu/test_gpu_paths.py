"""GPU paths that cross plugins: a hybrid ``cpu:gloo,cuda:ucc`` group carrying numpy and cupy
arrays in one job, cupy arrays staged through the host on gloo, and data-parallel training on
cupy over ucc that must equal one numpy process on the whole batch.

Every rank is a spawned process on the one GPU (UCX moves cupy memory between them through CUDA
IPC). ``scripts/gpu-checks.sh`` runs these on a GPU machine; elsewhere they skip with the reason.
"""

from __future__ import annotations

import numpy as np
import pluribus as pb
import pytest
from pluribus import nn
from pluribus.parallel import DistributedDataParallel
from pluribus.testing import RanksFailed, needs_gpu, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

#: Make the GPU's context before UCX starts (see the ucc plugin's ``ucc_cuda`` option).
UCC_CUDA = {"ucc_cuda": True}


# -- what every rank runs (module level: spawned processes import it) -----------------------------


def hybrid_job() -> dict:
    import cupy

    rank, size = pb.get_rank(), pb.get_world_size()
    group = pb.get_default_group()
    total = sum(range(1, size + 1))
    host = np.full(1000, rank + 1, dtype=np.float32)
    gpu = cupy.full(3 << 20, rank + 1, dtype=cupy.float32)  # past the ring's pipelining size
    work = pb.all_reduce(host, async_op=True)  # numpy through gloo while cupy goes through ucc
    pb.all_reduce(gpu)
    work.wait()
    assert isinstance(gpu, cupy.ndarray) and bool((gpu == total).all()), "cupy all_reduce"
    assert (host == total).all(), "numpy all_reduce"
    gathered_host = np.zeros(size * 3, dtype=np.int64)
    gathered_gpu = cupy.zeros(size * 3, dtype=cupy.int64)
    pb.all_gather(gathered_host, np.full(3, rank, dtype=np.int64))
    pb.all_gather(gathered_gpu, cupy.full(3, rank, dtype=cupy.int64))
    expected = np.repeat(np.arange(size), 3)
    assert (gathered_host == expected).all() and (gathered_gpu.get() == expected).all()
    both = [np.full(5, float(rank)), cupy.full(5, float(rank))]
    for array in both:
        pb.broadcast(array, src=size - 1)
    assert (both[0] == size - 1).all() and bool((both[1] == size - 1).all()), "broadcast"
    assert pb.all_gather_object({"rank": rank}) == [{"rank": r} for r in range(size)]
    return {device: backend.name for device, backend in group.backends.items()}


def staged_job() -> list[float]:
    """cupy arrays through a CPU-only backend with host staging: results land on the GPU."""
    import cupy

    rank, size = pb.get_rank(), pb.get_world_size()
    x = cupy.arange(1 << 20, dtype=cupy.float32) + rank
    pb.all_reduce(x)
    assert isinstance(x, cupy.ndarray)
    expected = np.arange(1 << 20, dtype=np.float32) * size + sum(range(size))
    np.testing.assert_array_equal(x.get(), expected)
    out = cupy.zeros(size * 4, dtype=cupy.float64)
    pb.all_gather(out, cupy.full(4, float(rank)))
    np.testing.assert_array_equal(out.get(), np.repeat(np.arange(size, dtype=np.float64), 4))
    return [float(x[1])]


# -- training -------------------------------------------------------------------------------------

FEATURES, CLASSES, STEPS, PER_RANK = 16, 6, 6, 8


def _model(seed: int) -> nn.Module:
    rng = np.random.default_rng(seed)
    model = nn.Sequential(
        nn.Linear(FEATURES, 64, rng=rng),
        nn.Tanh(),
        nn.Linear(64, 32, rng=rng),
        nn.ReLU(),
        nn.Linear(32, CLASSES, rng=rng),
    )
    return model.to(dtype=np.float64)  # round-off small enough to compare GPU with CPU tightly


#: The labels are a fixed function of the features, so the model has something to learn.
TEACHER = np.random.default_rng(0).standard_normal((FEATURES, CLASSES))


def _batch(step: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(step).standard_normal((rows, FEATURES))
    return x, (x @ TEACHER).argmax(axis=1)


def train_one_process_numpy(world: int) -> dict:
    """The reference: one numpy process on the whole batch of ``world`` ranks."""
    model = _model(seed=7)
    opt, loss_fn = nn.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss()
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, world * PER_RANK)
        losses.append(float(loss_fn.forward(model.forward(x), y)))
        model.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
    return {"state": model.state_dict(), "losses": losses}


def train_ddp_on_cupy() -> dict:
    import cupy

    rank, world = pb.get_rank(), pb.get_world_size()
    model = _model(seed=7 + rank).to("cuda")  # DDP broadcasts rank 0's weights
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets in flight
    opt, loss_fn = nn.SGD(ddp.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss()
    for p in ddp.parameters():
        assert isinstance(p.data, cupy.ndarray)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, world * PER_RANK)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = loss_fn.forward(ddp.forward(cupy.asarray(x[mine])), cupy.asarray(y[mine]))
        ddp.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
        local = np.array([float(loss)])
        pb.all_reduce(local, pb.ReduceOp.AVG)  # the whole batch's loss, as the reference's
        losses.append(float(local[0]))
    state = {name: cupy.asnumpy(value) for name, value in ddp.state_dict().items()}
    return {"state": state, "losses": losses}


GPT_VOCAB, GPT_CONTEXT, GPT_STEPS = 13, 8, 4


def _gpt(seed: int) -> nn.GPT:
    config = nn.GPTConfig(
        vocab_size=GPT_VOCAB, block_size=GPT_CONTEXT, n_layer=2, n_head=2, n_embd=16
    )
    return nn.GPT(config, rng=seed).to(dtype=np.float64)


def _gpt_batch(step: int, rows: int) -> np.ndarray:
    """Windows counting up from a random token: inputs and next-token targets."""
    starts = np.random.default_rng(500 + step).integers(0, GPT_VOCAB, (rows, 1))
    return (starts + np.arange(GPT_CONTEXT + 1)) % GPT_VOCAB


def _gpt_step(forward, backward, opt, batch, xp) -> float:
    loss_fn = nn.CrossEntropyLoss()
    batch = xp.asarray(batch)
    logits = forward(batch[:, :-1])
    loss = loss_fn.forward(logits.reshape(-1, GPT_VOCAB), batch[:, 1:].reshape(-1))
    backward(loss_fn.backward().reshape(logits.shape))
    opt.step()
    opt.zero_grad()
    return float(loss)


def train_gpt_one_process_numpy(world: int) -> dict:
    model = _gpt(seed=7)
    opt = nn.AdamW(model.parameters(), lr=1e-2)
    losses = [
        _gpt_step(model.forward, model.backward, opt, _gpt_batch(step, world * PER_RANK), np)
        for step in range(GPT_STEPS)
    ]
    return {"state": model.state_dict(), "losses": losses}


def train_gpt_ddp_on_cupy() -> dict:
    import cupy

    rank, world = pb.get_rank(), pb.get_world_size()
    ddp = DistributedDataParallel(_gpt(seed=7 + rank).to("cuda"), bucket_cap_mb=8192 / 2**20)
    opt = nn.AdamW(ddp.parameters(), lr=1e-2)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    losses = []
    for step in range(GPT_STEPS):
        batch = _gpt_batch(step, world * PER_RANK)[mine]
        local = np.array([_gpt_step(ddp.forward, ddp.backward, opt, batch, cupy)])
        pb.all_reduce(local, pb.ReduceOp.AVG)
        losses.append(float(local[0]))
    state = {name: cupy.asnumpy(value) for name, value in ddp.state_dict().items()}
    return {"state": state, "losses": losses, "buckets": len(ddp.buckets)}


def _assert_same_training(results: list[dict], expected: dict) -> None:
    for name, value in expected["state"].items():
        np.testing.assert_array_equal(results[1]["state"][name], results[0]["state"][name])
        # cuBLAS and the CPU's BLAS sum in different orders: float64 round-off, no more
        np.testing.assert_allclose(results[0]["state"][name], value, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(results[0]["losses"], expected["losses"], rtol=1e-9)
    assert expected["losses"][-1] < expected["losses"][0], "the model must actually learn"


# -- tests ----------------------------------------------------------------------------------------


@needs_gpu("gloo", "ucc")
def test_hybrid_group_carries_numpy_through_gloo_and_cupy_through_ucc():
    results = run_ranks(
        hybrid_job, 2, "cpu:gloo,cuda:ucc", "processes", timeout=300, backend_options=UCC_CUDA
    )
    assert results == [{"cpu": "gloo", "cuda": "ucc"}] * 2


@needs_gpu("gloo")
@pytest.mark.parametrize("shm", ["1", "0"], ids=["gloo-shm", "gloo-tcp"])
def test_cupy_arrays_staged_through_the_host_on_gloo(shm):
    env = {"PLURIBUS_GPU_STAGING": "1", "PLURIBUS_GLOO_SHM": shm}
    assert run_ranks(staged_job, 2, "gloo", "processes", timeout=300, env=env) == [[3.0]] * 2


@needs_gpu("ucc")
def test_ddp_on_cupy_over_ucc_equals_one_numpy_process_on_the_whole_batch():
    world = 2
    results = run_ranks(
        train_ddp_on_cupy, world, "ucc", "processes", timeout=300, backend_options=UCC_CUDA
    )
    _assert_same_training(results, train_one_process_numpy(world))


@needs_gpu("ucc")
def test_gpt_under_ddp_on_cupy_over_ucc_equals_one_numpy_process_on_the_whole_batch():
    world = 2
    results = run_ranks(
        train_gpt_ddp_on_cupy, world, "ucc", "processes", timeout=300, backend_options=UCC_CUDA
    )
    assert results[0]["buckets"] >= 3, "several buckets in flight"
    _assert_same_training(results, train_gpt_one_process_numpy(world))


def _nothing() -> None:
    return None


@needs_gpu("nccl")
def test_two_nccl_ranks_on_one_gpu_are_refused_naming_them_and_ucc():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_nothing, 2, "nccl", "processes", timeout=120, backend_options={"device_id": 0})
    assert info.value.kinds() == {0: "PluribusError", 1: "PluribusError"}, str(info.value)
    text = str(info.value)
    assert "ranks 0, 1 all use GPU 0" in text and "backend='cpu:gloo,cuda:ucc'" in text

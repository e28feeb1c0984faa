"""FSDP on cupy over ucc (two ranks sharing the one GPU, as the other GPU tests do), with and
without CPU offload of the shards: the same parity as on numpy. ``scripts/gpu-checks.sh``'s
gpu-marked tests include these; elsewhere they skip with the reason."""

import numpy as np
import pluribus
import pytest
from fsdp_cases import MODELS, _grad, _loss, global_batch, make_optimizer, reference_train
from pluribus import nn
from pluribus.parallel import OffloadPolicy, fully_shard
from pluribus.testing import needs_gpu, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

UCC_CUDA = {"ucc_cuda": True}
PER_RANK, STEPS = 4, 3


def train_on_cupy(strategy, offload):
    import cupy

    rank, world = pluribus.get_rank(), pluribus.get_world_size()
    model = MODELS["gpt"]().to(device="cuda")
    policy = OffloadPolicy() if offload else None
    for block in model.blocks:
        fully_shard(block, strategy=strategy, offload=policy)
    fully_shard(model, strategy=strategy, offload=policy)
    opt, loss_fn = make_optimizer(model.parameters()), nn.CrossEntropyLoss()
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    losses = []
    for step in range(STEPS):
        x, y = global_batch("gpt", step, 0, world * PER_RANK)
        logits = model.forward(cupy.asarray(x[mine]))
        loss = np.array([float(_loss(loss_fn, logits, cupy.asarray(y[mine])))])
        model.backward(_grad(loss_fn, logits))
        opt.step()
        opt.zero_grad()
        pluribus.all_reduce(loss, op=pluribus.ReduceOp.AVG)
        losses.append(float(loss[0]))
    on_host = all(isinstance(p.data, np.ndarray) for p in model.parameters())
    return {"losses": losses, "full": model.full_state_dict(), "shards_on_host": on_host}


@needs_gpu("ucc")
@pytest.mark.parametrize("offload", [False, True])
def test_fsdp_on_cupy_equals_one_numpy_process(offload):
    results = run_ranks(
        train_on_cupy, 2, "ucc", "processes", timeout=300, backend_options=UCC_CUDA,
        args=("full_shard", offload),
    )  # fmt: skip
    reference = reference_train("gpt", 2, PER_RANK, STEPS)
    np.testing.assert_allclose(results[0]["losses"], reference["losses"], rtol=1e-4, atol=1e-5)
    assert results[0]["shards_on_host"] == offload
    for name, value in results[0]["full"].items():
        np.testing.assert_allclose(value, reference["state"][name], rtol=1e-4, atol=1e-5)

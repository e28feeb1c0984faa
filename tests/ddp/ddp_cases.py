"""Training runs shared by the DDP and SyncBatchNorm tests (importable by rank processes).

Each ``*_on_rank`` function runs on one rank after ``init_process_group`` and returns plain numpy
results; the ``reference_*`` functions train the same model in one process on the concatenated
batch, which DDP must reproduce.
"""

from __future__ import annotations

import numpy as np
import pluribus
from pluribus import nn
from pluribus.parallel import DistributedDataParallel, convert_sync_batchnorm

FEATURES, CLASSES = 12, 5


def make_model(seed: int, batchnorm: bool = False, hidden: int = 48) -> nn.Module:
    rng = np.random.default_rng(seed)
    layers = [nn.Linear(FEATURES, hidden, rng=rng)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(hidden))
    layers += [
        nn.Tanh(),
        nn.Linear(hidden, 32, rng=rng),
        nn.ReLU(),
        nn.Linear(32, CLASSES, rng=rng),
    ]
    return nn.Sequential(*layers)


def global_batch(step: int, micro: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The same batch on every rank: features and labels for one micro-step."""
    rng = np.random.default_rng(1000 * step + micro)
    x = rng.standard_normal((rows, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, rows)
    return x, y


def _optimizer(params):
    return nn.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def reference_train(
    world: int, per_rank: int, steps: int, accum: int, batchnorm=False, hidden: int = 48
) -> dict:
    model = make_model(seed=100, batchnorm=batchnorm, hidden=hidden)
    opt, loss_fn = _optimizer(model.parameters()), nn.CrossEntropyLoss()
    for step in range(steps):
        for micro in range(accum):
            x, y = global_batch(step, micro, world * per_rank)
            loss_fn.forward(model.forward(x), y)
            model.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def ddp_train_on_rank(
    per_rank: int,
    steps: int,
    accum: int,
    bucket_cap_mb: float = 25,
    comm_hook=None,
    batchnorm: bool = False,
    overlap: bool = True,
    hidden: int = 48,
) -> dict:
    """Train with DDP; every rank starts from a different init (DDP broadcasts rank 0's)."""
    rank, world = pluribus.get_rank(), pluribus.get_world_size()
    model = make_model(seed=100 + rank, batchnorm=batchnorm, hidden=hidden)
    if batchnorm:
        model = convert_sync_batchnorm(model)
    ddp = DistributedDataParallel(
        model, bucket_cap_mb=bucket_cap_mb, comm_hook=comm_hook, overlap=overlap
    )
    opt, loss_fn = _optimizer(ddp.parameters()), nn.CrossEntropyLoss()
    losses = []
    for step in range(steps):
        for micro in range(accum):
            x, y = global_batch(step, micro, world * per_rank)
            mine = slice(rank * per_rank, (rank + 1) * per_rank)
            last = micro == accum - 1
            with ddp.no_sync() if not last else _nothing():
                loss = loss_fn.forward(ddp.forward(x[mine]), y[mine])
                ddp.backward(loss_fn.backward())
            losses.append(float(loss))
        opt.step()
        opt.zero_grad()
    return {"state": ddp.state_dict(), "buckets": len(ddp.buckets), "losses": losses}


def ddp_train_counting_zero_copy(*args, **kwargs) -> dict:
    """:func:`ddp_train_on_rank` on gloo, noting the sizes that gloo's zero-copy all-reduce on
    symmetric arrays reduced."""
    from pluribus_gloo import local

    runs = []
    original = local._all_reduce_symmetric

    def counted(arena, arrays, ufunc):
        runs.append(arrays[arena.rank].size)
        original(arena, arrays, ufunc)

    local._all_reduce_symmetric = counted
    try:
        result = ddp_train_on_rank(*args, **kwargs)
    finally:
        local._all_reduce_symmetric = original
    return {**result, "zero_copy": runs}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def check_matches_reference(
    results: list[dict],
    world,
    per_rank,
    steps,
    accum,
    rtol=2e-5,
    atol=2e-6,
    batchnorm=False,
    hidden=48,
) -> None:
    expected = reference_train(world, per_rank, steps, accum, batchnorm=batchnorm, hidden=hidden)
    for name, value in expected.items():
        for rank, result in enumerate(results):
            got = result["state"][name]
            # the reduced gradients are bit-identical on every rank, so the models are too
            np.testing.assert_array_equal(got, results[0]["state"][name], err_msg=f"{name}@{rank}")
        np.testing.assert_allclose(
            results[0]["state"][name], value, rtol=rtol, atol=atol, err_msg=name
        )


# -- the GPT: DDP over ranks equals one process on the whole batch ---------------------------

GPT_VOCAB, GPT_CONTEXT = 13, 8


def make_gpt(seed: int) -> nn.GPT:
    config = nn.GPTConfig(
        vocab_size=GPT_VOCAB, block_size=GPT_CONTEXT, n_layer=2, n_head=2, n_embd=16
    )
    return nn.GPT(config, rng=seed).to(dtype=np.float64)


def gpt_batch(step: int, rows: int) -> np.ndarray:
    """Token windows of length context + 1 (inputs and next-token targets), same on every rank:
    counting from a random start, so that there is something to learn."""
    starts = np.random.default_rng(500 + step).integers(0, GPT_VOCAB, (rows, 1))
    return (starts + np.arange(GPT_CONTEXT + 1)) % GPT_VOCAB


def _gpt_step(forward, backward, opt, batch) -> float:
    loss_fn = nn.CrossEntropyLoss()
    logits = forward(batch[:, :-1])
    loss = loss_fn.forward(logits.reshape(-1, GPT_VOCAB), batch[:, 1:].reshape(-1))
    backward(loss_fn.backward().reshape(logits.shape))
    opt.step()
    opt.zero_grad()
    return float(loss)


def reference_gpt_train(world: int, per_rank: int, steps: int) -> dict:
    model = make_gpt(seed=7)
    opt = nn.AdamW(model.parameters(), lr=1e-2)
    losses = [
        _gpt_step(model.forward, model.backward, opt, gpt_batch(step, world * per_rank))
        for step in range(steps)
    ]
    return {"state": model.state_dict(), "losses": losses}


def ddp_gpt_train_on_rank(per_rank: int, steps: int, bucket_cap_mb: float) -> dict:
    rank = pluribus.get_rank()
    model = make_gpt(seed=7 + rank)  # DDP broadcasts rank 0's weights
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    opt = nn.AdamW(ddp.parameters(), lr=1e-2)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    world = pluribus.get_world_size()
    losses = [
        _gpt_step(ddp.forward, ddp.backward, opt, gpt_batch(step, world * per_rank)[mine])
        for step in range(steps)
    ]
    return {"state": ddp.state_dict(), "losses": losses, "buckets": len(ddp.buckets)}

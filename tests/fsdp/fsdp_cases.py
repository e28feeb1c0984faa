"""Training runs shared by the FSDP tests (importable by rank processes).

Each ``*_on_rank`` function runs on one rank after ``init_process_group`` and returns plain
numpy results; ``reference_train`` trains the same model in one process on the whole batch,
which every sharding strategy must reproduce: per-step losses, the final parameters, and each
rank's shards as the matching rows of the reference.
"""

from __future__ import annotations

import numpy as np
import pluribus
from pluribus import nn
from pluribus.mesh import init_device_mesh
from pluribus.parallel import MixedPrecisionPolicy, fully_shard

FEATURES, CLASSES = 12, 5


def make_mlp(seed: int = 100) -> nn.Module:
    """First dimensions 30, 3 and 5: not divisible by 2 or 4, and 3 is smaller than 4."""
    rng = np.random.default_rng(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, 30, rng=rng),
        nn.Tanh(),
        nn.Linear(30, 3, rng=rng),
        nn.Tanh(),
        nn.Linear(3, CLASSES, rng=rng),
    )


def make_gpt(seed: int = 100) -> nn.GPT:
    return nn.GPT(nn.GPTConfig(**nn.PRESETS["tiny"]), rng=seed)


MODELS = {"mlp": make_mlp, "gpt": make_gpt}


def global_batch(model: str, step: int, micro: int, rows: int):
    rng = np.random.default_rng(1000 * step + micro)
    if model == "mlp":
        x = rng.standard_normal((rows, FEATURES)).astype(np.float32)
        return x, rng.integers(0, CLASSES, rows)
    tokens = rng.integers(0, 128, (rows, 17))
    return tokens[:, :-1], tokens[:, 1:]


def _loss(loss_fn, logits, y):
    return loss_fn.forward(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _grad(loss_fn, logits):
    return loss_fn.backward().reshape(logits.shape)


def make_optimizer(params):
    # eps well above float32 noise: the key bias gets a zero gradient up to rounding, which
    # Adam with a tiny eps would turn into full-size steps of either sign
    return nn.AdamW(params, lr=1e-2, eps=1e-5, weight_decay=0.01)


def reference_train(model_name, world, per_rank, steps, accum=1, clip=None) -> dict:
    model = MODELS[model_name]()
    opt, loss_fn = make_optimizer(model.parameters()), nn.CrossEntropyLoss()
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            x, y = global_batch(model_name, step, micro, world * per_rank)
            logits = model.forward(x)
            total += float(_loss(loss_fn, logits, y)) / accum
            model.backward(_grad(loss_fn, logits) / accum)
        if clip is not None:
            norms.append(reference_clip(model, *clip))
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "state": model.state_dict(), "norms": norms}


def reference_clip(model, max_norm, norm_type) -> float:
    grads = [p.grad.astype(np.float64) for p in model.parameters() if p.grad is not None]
    if np.isinf(norm_type):
        norm = max(float(np.abs(g).max()) for g in grads)
    else:
        norm = sum(float((np.abs(g) ** norm_type).sum()) for g in grads) ** (1 / norm_type)
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1:
        for p in model.parameters():
            p.grad *= coefficient
    return norm


def shard_model(model, model_name, strategy, world, prefetch=True, mp=None):
    mesh = None
    if strategy == "hybrid_shard":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    options = dict(mesh=mesh, strategy=strategy, prefetch=prefetch, mp_policy=mp)
    units = model.blocks if model_name == "gpt" else [model[0], model[2], model[4]]
    for unit in units:
        fully_shard(unit, **options)
    return fully_shard(model, **options)


def fsdp_train_on_rank(
    model_name, strategy, per_rank, steps, accum=1, prefetch=True, mp=False, clip=None
) -> dict:
    rank, world = pluribus.get_rank(), pluribus.get_world_size()
    policy = MixedPrecisionPolicy(param_dtype=np.float16) if mp else None
    model = shard_model(MODELS[model_name](), model_name, strategy, world, prefetch, policy)
    opt, loss_fn = make_optimizer(model.parameters()), nn.CrossEntropyLoss()
    losses, norms = [], []
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for step in range(steps):
        total = np.zeros(1)
        for micro in range(accum):
            x, y = global_batch(model_name, step, micro, world * per_rank)
            x, y = x[mine], y[mine]
            logits = model.forward(x)
            total += float(_loss(loss_fn, logits, y)) / accum
            if micro < accum - 1:
                with model.no_sync():
                    model.backward(_grad(loss_fn, logits) / accum)
            else:
                model.backward(_grad(loss_fn, logits) / accum)
        if clip is not None:
            norms.append(model.clip_grad_norm_(*clip))
        pluribus.all_reduce(total, op=pluribus.ReduceOp.AVG)
        losses.append(float(total[0]))
        opt.step()
        opt.zero_grad()
    shards = {name: d.to_local().copy() for name, d in model.state_dict().items()}
    return {
        "losses": losses,
        "norms": norms,
        "full": model.full_state_dict(),
        "shards": shards,
        "slices": {  # plain numbers: results may travel through the object collectives
            name: [[s.start, s.stop] for s in d.layout.local_slices(d.device_mesh.coordinate)]
            for name, d in model.state_dict().items()
        },
    }


def check_matches_reference(results, reference, rtol=1e-4, atol=1e-5):
    for r, result in enumerate(results):
        np.testing.assert_allclose(
            result["losses"], reference["losses"], rtol=rtol, atol=atol, err_msg=f"rank {r}"
        )
        for name, shard in result["shards"].items():
            where = tuple(slice(start, stop) for start, stop in result["slices"][name])
            expected = reference["state"][name][where]
            np.testing.assert_allclose(
                shard, expected, rtol=rtol, atol=atol, err_msg=f"rank {r} shard of {name}"
            )
    full = results[0]["full"]
    assert sorted(full) == sorted(reference["state"])
    for name, value in full.items():
        np.testing.assert_allclose(
            value, reference["state"][name], rtol=rtol, atol=atol, err_msg=f"full {name}"
        )
    for result in results[1:]:
        assert result["full"] == {}

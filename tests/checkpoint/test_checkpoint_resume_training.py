"""Training resumed from a checkpoint in another world size and layout continues with the same
losses as training that never stopped: sharded parameters and Adam state (stand-ins for FSDP),
the step count, the RNG that draws the batches and the sampler position all come back."""

from __future__ import annotations

import numpy as np
import pluribus as pb
import pytest
from pluribus import checkpoint
from pluribus.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(60)

FEATURES, OUTPUTS, SAMPLES, BATCH = 7, 5, 64, 8
LR, BETAS, EPS = 0.05, (0.9, 0.999), 1e-8


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES))
    y = x @ rng.normal(size=(FEATURES, OUTPUTS)) + 0.1 * rng.normal(size=(SAMPLES, OUTPUTS))
    return x, y


def _fresh_state(placements):
    """Step 0: zero weights, zero Adam moments, the batch RNG seeded, the sampler at 0."""
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))

    def zeros():  # distribute_tensor may keep a view of its input: one array each
        return distribute_tensor(np.zeros((FEATURES, OUTPUTS)), mesh, placements)

    return {
        "model": {"w": zeros()},
        "optim": {
            "exp_avg": zeros(),
            "exp_avg_sq": zeros(),
            "step": 0,
        },
        "rng": np.random.default_rng(42).bit_generator.state,
        "sampler": {"position": 0},
    }


def _train(state, steps):
    """Adam on a least-squares model, each rank updating its piece; the losses."""
    x, y = _data()
    rng = np.random.default_rng()
    rng.bit_generator.state = state["rng"]
    w = state["model"]["w"]
    m, v = state["optim"]["exp_avg"], state["optim"]["exp_avg_sq"]
    rows = w.layout.local_slices(w.device_mesh.coordinate)
    losses = []
    for _ in range(steps):
        batch = rng.choice(SAMPLES, BATCH, replace=False)
        residual = x[batch] @ w.full_tensor() - y[batch]
        losses.append(float(np.mean(residual**2)))
        grad = (2 / residual.size) * (x[batch].T @ residual)[rows]
        t = state["optim"]["step"] = state["optim"]["step"] + 1
        local_m, local_v = m.to_local(), v.to_local()
        local_m[...] = BETAS[0] * local_m + (1 - BETAS[0]) * grad
        local_v[...] = BETAS[1] * local_v + (1 - BETAS[1]) * grad**2
        m_hat = local_m / (1 - BETAS[0] ** t)
        v_hat = local_v / (1 - BETAS[1] ** t)
        w.to_local()[...] -= LR * m_hat / (np.sqrt(v_hat) + EPS)
        state["sampler"]["position"] += BATCH
    state["rng"] = rng.bit_generator.state
    return losses


def _unbroken(steps):
    return _train(_fresh_state([Shard(0)]), steps)


def _first_part(path, steps):
    state = _fresh_state([Shard(0)])
    losses = _train(state, steps)
    checkpoint.save(state, path)
    return losses


def _resumed(path, steps, placements):
    state = _fresh_state(placements)
    checkpoint.load(state, path)
    assert state["optim"]["step"] == 3 and state["sampler"]["position"] == 3 * BATCH
    return _train(state, steps)


@pytest.mark.parametrize(
    "world, placements",
    [(1, [Replicate()]), (3, [Shard(0)]), (4, [Shard(1)])],
    ids=["one-process", "3-ranks-uneven-rows", "4-ranks-uneven-columns"],
)
def test_resumed_training_continues_with_the_same_losses(tmp_path, world, placements):
    path = str(tmp_path / "step-3")
    unbroken = run_ranks(_unbroken, 2, args=(6,))[0]
    first = run_ranks(_first_part, 2, args=(path, 3))
    assert first[0] == unbroken[:3]
    resumed = run_ranks(_resumed, world, args=(path, 3, placements))
    for losses in resumed:
        np.testing.assert_allclose(losses, unbroken[3:], rtol=1e-12)
    assert unbroken[5] < unbroken[0]

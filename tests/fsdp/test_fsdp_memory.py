"""The memory ledger against the ZeRO formulas, for each strategy at N = 2 and 4.

With float32 parameters and gradients and AdamW's two float32 moments (4 + 4 + 8 bytes per
parameter, the paper's (2 + 2 + K)Psi with float32 sizes), the bytes a rank holds between
steps are: NO_SHARD 16Psi, ZeRO-1 8Psi + 8Psi/N, ZeRO-2 4Psi + 12Psi/N, ZeRO-3 and hybrid
16Psi/N (N the shard group's size). The ledger must give exactly that between steps, agree
with ``nn.memory_report`` (which counts the same arrays from the model's side), and peak
within a few units' full parameters of it (the unit computing, the next one prefetched, one
unit's full gradients and its packed reduce-scatter input)."""

import numpy as np
import pluribus
import pytest
from pluribus import nn
from pluribus.mesh import init_device_mesh
from pluribus.parallel import MixedPrecisionPolicy, fully_shard
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(120)

WIDTH, UNITS = 64, 8
PSI = UNITS * (WIDTH * WIDTH + WIDTH)
UNIT_BYTES = 4 * PSI // UNITS


def formula(strategy: str, n: int) -> float:
    """Bytes per rank between steps, float32 parameters and gradients, AdamW."""
    return {
        "no_shard": 16 * PSI,
        "shard_optimizer_state": 8 * PSI + 8 * PSI / n,
        "shard_grad_op": 4 * PSI + 12 * PSI / n,
        "full_shard": 16 * PSI / n,
        "hybrid_shard": 16 * PSI / n,
    }[strategy]


def ledger_on_rank(strategy: str, mp: bool = False) -> list:
    world = pluribus.get_world_size()
    policy = MixedPrecisionPolicy(param_dtype=np.float16) if mp else None
    mesh = init_device_mesh("cpu", (2, world // 2)) if strategy == "hybrid_shard" else None
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, rng=i) for i in range(UNITS)])
    for layer in model:
        fully_shard(layer, mesh=mesh, strategy=strategy, mp_policy=policy)
    fully_shard(model, mesh=mesh, strategy=strategy, mp_policy=policy)
    opt = nn.AdamW(model.parameters())
    out = []
    for _ in range(3):
        model.reset_peak_memory()
        y = model.forward(np.ones((4, WIDTH), np.float32))
        model.backward(np.ones_like(y))
        opt.step()
        report = model.memory_ledger(opt)
        counted = nn.memory_report(model, opt, include_peak_rss=False)
        out.append(
            (report.steady, report.peak_total, counted.parameters + counted.gradients,
             report.parameters + report.gradients)
        )  # fmt: skip
        opt.zero_grad()
    return out


@pytest.mark.parametrize(
    "strategy,world",
    [
        (s, w)
        for s in ["full_shard", "shard_grad_op", "shard_optimizer_state", "no_shard"]
        for w in (2, 4)
    ]
    + [("hybrid_shard", 4)],
)
def test_ledger_matches_the_zero_formula(strategy, world):
    n = 2 if strategy == "hybrid_shard" else world
    expected = formula(strategy, n)
    for rank, steps in enumerate(run_ranks(ledger_on_rank, world, "threads", args=(strategy,))):
        steady, peak, counted, ledger_pg = steps[-1]
        assert steady == pytest.approx(expected, rel=0.03), f"rank {rank}"
        assert counted == ledger_pg, f"rank {rank}: memory_report disagrees with the ledger"
        assert steady <= peak <= expected * 1.03 + 4 * UNIT_BYTES, f"rank {rank}"


def test_full_shard_is_under_a_third_of_no_shard_at_four_ranks():
    sharded = run_ranks(ledger_on_rank, 4, "threads", args=("full_shard",))[0][-1][0]
    replicated = run_ranks(ledger_on_rank, 4, "threads", args=("no_shard",))[0][-1][0]
    assert sharded / replicated <= 0.30


def mixed_precision_formula(strategy: str, n: int) -> float:
    """float16 parameters gathered and kept, float32 master weights, gradient shards and Adam
    moments. Against ZeRO's mixed-precision accounting (16Psi, 4Psi + 12Psi/N,
    2Psi + 14Psi/N, 16Psi/N) the gradients the optimizer reads are float32 here (Adam squares
    them: float16 squares of small gradients underflow), which adds 4Psi/N to ZeRO-1 (its
    float16 full gradients cannot be the shards), 2Psi/N to ZeRO-2 and 2Psi to NO_SHARD, and
    ZeRO-3 keeps no float16 copy of its shards, which makes it equal."""
    return {
        "no_shard": 18 * PSI,
        "shard_optimizer_state": 4 * PSI + 16 * PSI / n,
        "shard_grad_op": 2 * PSI + 16 * PSI / n,
        "full_shard": 16 * PSI / n,
    }[strategy]


@pytest.mark.parametrize(
    "strategy", ["full_shard", "shard_grad_op", "shard_optimizer_state", "no_shard"]
)
def test_ledger_under_float16_mixed_precision(strategy):
    world = 4
    expected = mixed_precision_formula(strategy, world)
    for rank, steps in enumerate(
        run_ranks(ledger_on_rank, world, "threads", args=(strategy, True))
    ):
        steady, peak, counted, ledger_pg = steps[-1]
        assert steady == pytest.approx(expected, rel=0.03), f"rank {rank}"
        # the float16 parameters (and ZeRO-1's float16 full gradients) kept between steps are
        # FSDP's, out of the model's sight
        kept = {"full_shard": 0, "shard_optimizer_state": 4 * PSI}.get(strategy, 2 * PSI)
        assert ledger_pg - counted == kept, f"rank {rank}"
        assert steady <= peak <= expected * 1.03 + 4 * UNIT_BYTES, f"rank {rank}"

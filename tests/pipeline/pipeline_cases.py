"""Rank functions and single-process references for the pipeline tests (importable, so that
process ranks can run them)."""

import numpy as np
import pluribus as dist
from pluribus import nn
from pluribus.parallel import pipeline as pp

FEATURES, BLOCKS = 6, 8


def blocks_model(seed: int = 0) -> nn.Sequential:
    """Eight Linear+Tanh blocks in float64 (float64: gradients compare to 1e-12)."""
    rng = np.random.default_rng(seed)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(FEATURES, FEATURES, dtype=np.float64, rng=rng), nn.Tanh())
            for _ in range(BLOCKS)
        ]
    )


def batches(m: int, steps: int = 2, seed: int = 1):
    """Inputs and targets per step; the batch size changes between steps (2 then 3 rows per
    micro-batch), so the messages' shapes change too."""
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(rows * m, FEATURES)), rng.normal(size=(rows * m, FEATURES)))
        for rows in [2, 3][:steps]
    ]


def reference(m: int, steps: int = 2, lr: float = 0.1):
    """One process, whole batch: per step the loss, output and every parameter's gradient."""
    model, loss_fn = blocks_model(), nn.MSELoss()
    opt = nn.SGD(model.parameters(), lr=lr)
    results = []
    for x, y in batches(m, steps):
        out = model.forward(x)
        loss = float(loss_fn.forward(out, y))
        model.backward(loss_fn.backward())
        results.append((loss, out, {n: p.grad.copy() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return results


#: Stages per rank of the schedules that take more than one.
STAGES_PER_RANK = {"Interleaved1F1B": 2, "ZBV": 2}


def last_stage_rank(name: str, p: int) -> int:
    """ZB-V's V brings the last stage back to rank 0; the others end on rank p - 1."""
    return 0 if name == "ZBV" else p - 1


def stages_on_rank(
    model: nn.Sequential, p: int, v: int, group=None, name: str | None = None
) -> list[pp.PipelineStage]:
    """Stage s holds BLOCKS / (p v) consecutive blocks and lives on rank s % p (on the rank
    ZB-V's V gives it when ``name`` is "ZBV")."""
    n = p * v
    per = BLOCKS // n
    rank = dist.get_rank(group)
    blocks = list(model)
    mine = pp.build("ZBV", p, 1).stages_of(rank) if name == "ZBV" else range(rank, n, p)
    return [
        pp.PipelineStage(nn.Sequential(*blocks[s * per : (s + 1) * per]), s, n, group=group)
        for s in mine
    ]


def _on_host(array):
    """numpy for the comparisons (cupy arrays come back with ``.get()``)."""
    return array if array is None or isinstance(array, np.ndarray) else array.get()


def pipeline_train_on_rank(name: str, m: int, steps: int = 2, lr: float = 0.1, device: str = "cpu"):
    """The pipeline's losses, output and gradients of this rank's parameters, per step, with
    the stages' parameters and the batch on ``device`` ("cuda": cupy)."""
    p = dist.get_world_size()
    model = blocks_model().to(device=device)
    xp = np
    if device == "cuda":
        import cupy as xp
    stages = stages_on_rank(model, p, STAGES_PER_RANK.get(name, 1), name=name)
    schedule = pp.SCHEDULE_CLASSES[name](stages, m, nn.MSELoss())
    params = [q for s in stages for q in s.module.parameters()]
    opt = nn.SGD(params, lr=lr)
    mine = {id(q) for q in params}
    results = []
    for x, y in batches(m, steps):
        x, y = xp.asarray(x), xp.asarray(y)
        losses: list = []
        first, last = dist.get_rank() == 0, dist.get_rank() == last_stage_rank(name, p)
        out = schedule.step(
            x if first else None, target=y if last else None, losses=losses if last else None
        )
        assert out is None or isinstance(out, xp.ndarray), type(out)
        grads = {n: _on_host(q.grad).copy() for n, q in model.named_parameters() if id(q) in mine}
        results.append(([float(v) for v in losses], _on_host(out), grads))
        opt.step()
        opt.zero_grad()
    return results


def check_parity(results_per_rank, m: int, steps: int = 2, name: str = "") -> None:
    """Each step: the mean of the micro-batch losses is the whole batch's loss, the output is
    the whole batch's, and every parameter's gradient is the single process's."""
    expected = reference(m, steps)
    p = len(results_per_rank)
    last = last_stage_rank(name, p)
    for step, (loss, out, grads) in enumerate(expected):
        got_losses, got_out, _ = results_per_rank[last][step]
        assert len(got_losses) == m
        np.testing.assert_allclose(np.mean(got_losses), loss, rtol=1e-12)
        np.testing.assert_allclose(got_out, out, rtol=1e-12, atol=1e-14)
        merged = {}
        for rank_results in results_per_rank:
            merged.update(rank_results[step][2])
            if rank_results is not results_per_rank[last]:
                assert rank_results[step][1] is None  # only the last stage returns outputs
        assert sorted(merged) == sorted(grads), "every parameter lives on exactly one rank"
        for name, g in grads.items():
            np.testing.assert_allclose(merged[name], g, rtol=1e-10, atol=1e-13, err_msg=name)


def tiny_gpt() -> nn.GPT:
    config = nn.GPTConfig(vocab_size=16, tie_weights=False, **nn.PRESETS["tiny"])
    return nn.GPT(config, dtype=np.float64, rng=0)


def gpt_batches(m: int, lengths=(8, 5)):
    """Token batches whose sequence length changes from step to step."""
    rng = np.random.default_rng(3)
    return [(rng.integers(0, 16, (2 * m, t)), rng.integers(0, 16, (2 * m, t))) for t in lengths]


def gpt_reference(m: int):
    gpt, loss_fn = tiny_gpt(), nn.CrossEntropyLoss()
    out = []
    for idx, tgt in gpt_batches(m):
        logits = gpt.forward(idx)
        loss = float(loss_fn.forward(logits.reshape(-1, 16), tgt.reshape(-1)))
        gpt.backward(loss_fn.backward().reshape(logits.shape))
        out.append((loss, [q.grad.copy() for q in gpt.parameters()]))
        gpt.zero_grad()
    return out


def gpt_pipeline_on_rank(name: str, m: int, by: str = "params"):
    """The GPT cut by the splitter into one stage per rank; per step the losses and the
    gradient of each GPT parameter this rank holds (by its index in gpt.parameters())."""
    p, rank = dist.get_world_size(), dist.get_rank()
    gpt = tiny_gpt()
    sample = gpt_batches(m)[0][0][:2] if by == "time" else None
    parts = pp.split_gpt(gpt, p, by=by, sample_input=sample)
    stage = pp.PipelineStage(parts[rank], rank, p)
    schedule = pp.SCHEDULE_CLASSES[name](stage, m, nn.CrossEntropyLoss())
    mine = {id(q) for q in parts[rank].parameters()}
    out = []
    for idx, tgt in gpt_batches(m):
        losses: list = []
        schedule.step(idx, target=tgt, losses=losses)
        grads = {i: q.grad.copy() for i, q in enumerate(gpt.parameters()) if id(q) in mine}
        out.append(([float(v) for v in losses], grads))
        gpt.zero_grad()
    return out


def pipeline_ddp_on_rank(name: str, m: int):
    """Four ranks as a 2 x 2 layout: pipelines {0, 1} and {2, 3}, data-parallel pairs {0, 2}
    and {1, 3}; each pipeline takes half the batch. Returns this rank's gradients by name."""
    rank = dist.get_rank()
    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipe, pair = pipes[rank // 2], pairs[rank % 2]
    model = blocks_model()
    stages = stages_on_rank(model, 2, 1, group=pipe)
    schedule = pp.SCHEDULE_CLASSES[name](stages, m, nn.MSELoss(), data_parallel_group=pair)
    (x, y), half = batches(m, 1)[0], rank // 2
    rows = x.shape[0] // 2
    x, y = x[half * rows : (half + 1) * rows], y[half * rows : (half + 1) * rows]
    losses: list = []
    schedule.step(x, target=y, losses=losses)
    mine = {id(q) for s in stages for q in s.module.parameters()}
    return {n: q.grad.copy() for n, q in model.named_parameters() if id(q) in mine}, losses


def traced_step_on_rank(name: str, m: int):
    """One step; every rank's events, this rank's activation ledger, and the program."""
    p = dist.get_world_size()
    stages = stages_on_rank(blocks_model(), p, STAGES_PER_RANK.get(name, 1), name=name)
    schedule = pp.SCHEDULE_CLASSES[name](stages, m, nn.MSELoss())
    x, y = batches(m, 1)[0]
    schedule.step(x, target=y)
    s = stages[0]
    return (
        pp.gather_events(schedule),
        s.peak_microbatches,
        s.peak_activation_bytes,
        schedule.program,
    )

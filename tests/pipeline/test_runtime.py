"""The runtime against one process: every schedule at 2 and 4 stages, m in {1, p, 2p+1}; bad input
refused before the step; a stage failing mid-step reaches every rank without a hang."""

import numpy as np
import pluribus as dist
import pytest
from pipeline_cases import (
    STAGES_PER_RANK,
    blocks_model,
    check_parity,
    pipeline_train_on_rank,
    stages_on_rank,
)
from pluribus import nn
from pluribus.parallel import pipeline as pp
from pluribus.testing import RankPool, RanksFailed, require_backend, run_ranks

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_blas_thread")]


@pytest.mark.parametrize("name", list(pp.SCHEDULES))
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("which_m", ["1", "p", "2p+1"])
def test_every_schedule_equals_one_process_on_threads(name, p, which_m):
    m = {"1": 1, "p": p, "2p+1": 2 * p + 1}[which_m]
    results = run_ranks(pipeline_train_on_rank, p, args=(name, m), timeout=60)
    check_parity(results, m, name=name)


@pytest.fixture(scope="module")
def gloo_pool():
    require_backend("gloo")
    pools = {}

    def get(world):
        if world not in pools:
            pools[world] = RankPool(world, "gloo", mode="processes", timeout=120)
        return pools[world]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "name,p,m",
    [
        ("1F1B", 2, 5),
        ("Interleaved1F1B", 2, 2),
        ("ZeroBubble", 4, 9),
        ("ZBH2", 4, 9),
        ("GPipe", 4, 1),
        ("ZBV", 2, 5),
        ("ZBV", 4, 9),
    ],
)
def test_schedules_on_gloo_processes_equal_one_process(gloo_pool, name, p, m):
    check_parity(gloo_pool(p).run(pipeline_train_on_rank, name, m), m, name=name)


# -- bad input, refused before anything runs ------------------------------------------------------


def _errors(fn, world=2, *args):
    with pytest.raises(RanksFailed) as info:
        run_ranks(fn, world, args=args, timeout=30)
    return {e.rank: f"{e.kind}: {e.message}" for e in info.value.errors}


def _count_forwards(stages):
    calls = []
    for s in stages:
        s.module.register_forward_hook(lambda mod, args, out: calls.append(1))
    return calls


def _stage_count_wrong():
    model = blocks_model()
    rank = dist.get_rank()
    stage = pp.PipelineStage(nn.Sequential(*list(model)[rank * 2 : rank * 2 + 2]), rank, 3)
    pp.Schedule1F1B(stage, 2, nn.MSELoss())


def test_a_stage_count_that_does_not_match_the_group_is_refused_on_every_rank():
    errors = _errors(_stage_count_wrong)
    assert sorted(errors) == [0, 1]
    for rank, text in errors.items():
        assert f"rank {rank} (stage {rank}): Schedule1F1B cannot place 3 stages" in text
        assert "it needs one stage per rank (2 stages)" in text


def _zbv_with_one_stage_per_rank():
    pp.ScheduleZBVZeroBubble(stages_on_rank(blocks_model(), 2, 1), 4, nn.MSELoss())


def test_zbv_with_one_stage_per_rank_says_it_needs_two():
    for rank, text in _errors(_zbv_with_one_stage_per_rank).items():
        assert f"rank {rank} (stage {rank}): ScheduleZBVZeroBubble cannot place 2 stages" in text
        assert "it needs two stages per rank (4 stages)" in text


def _widths_disagree():
    rank = dist.get_rank()
    rng = np.random.default_rng(0)
    module = nn.Sequential(nn.Linear(6, 5, rng=rng)) if rank == 0 else nn.Linear(6, 6, rng=rng)
    stage = pp.PipelineStage(module, rank, 2)
    calls = _count_forwards([stage])
    try:
        pp.ScheduleGPipe(stage, 2, nn.MSELoss()).step(
            np.ones((4, 6), np.float32) if rank == 0 else None,
            target=np.ones((4, 6), np.float32) if rank == 1 else None,
        )
    finally:
        assert not calls, "nothing ran forward"


def test_stages_whose_output_and_next_input_disagree_are_refused_before_the_step():
    for text in _errors(_widths_disagree).values():
        assert "stage 0 (rank 0) ends with 5 features but stage 1 (rank 1) takes 6" in text


def _batch_not_divisible():
    rank = dist.get_rank()
    stages = stages_on_rank(blocks_model(), 2, 1)
    calls = _count_forwards(stages)
    try:
        pp.Schedule1F1B(stages, 2, nn.MSELoss()).step(
            np.ones((7, 6)) if rank == 0 else None, target=np.ones((8, 6)) if rank else None
        )
    finally:
        assert not calls, "nothing ran forward"


def test_a_batch_that_does_not_split_into_the_microbatches_names_the_stage_on_every_rank():
    errors = _errors(_batch_not_divisible)
    assert sorted(errors) == [0, 1]
    for text in errors.values():
        assert "stage 0 (rank 0) raised ValueError before the step" in text
        assert "multiple of n_microbatches=2 rows" in text and "got 7 rows" in text


def _different_schedules():
    stages = stages_on_rank(blocks_model(), 2, 1)
    cls = pp.ScheduleGPipe if dist.get_rank() == 0 else pp.Schedule1F1B
    cls(stages, 3, nn.MSELoss()).step(np.ones((3, 6)), target=np.ones((3, 6)))


def test_ranks_running_different_schedules_are_refused():
    for text in _errors(_different_schedules).values():
        assert "the ranks run different schedules" in text
        assert "GPipe: 2 rank(s)" in text and "1F1B: 2 rank(s)" in text


def _user_program_deadlocks():
    stages = stages_on_rank(blocks_model(), 2, 1)
    program = pp.Program.parse(["0B0 0F0", "1F0 1B0"], 1)
    pp.ScheduleFromProgram(stages, program, nn.MSELoss())


def test_a_user_program_the_checker_rejects_is_refused_on_every_rank():
    for text in _errors(_user_program_deadlocks).values():
        assert "ScheduleError" in text and "(0B0) runs before 0F0, which it needs" in text


def _user_program_runs():
    stages = stages_on_rank(blocks_model(), 2, 1)
    program = pp.Program.parse(["0F0 0F1 0I0 0W0 0I1 0W1", "1F0 1I0 1F1 1I1 1W0 1W1"], 2)
    losses = []
    pp.ScheduleFromProgram(stages, program, nn.MSELoss()).step(
        np.ones((4, 6)), target=np.zeros((4, 6)), losses=losses
    )
    return {n: q.grad for s in stages for n, q in s.module.named_parameters()}, losses


def test_a_user_written_program_runs_like_the_builtins():
    results = run_ranks(_user_program_runs, 2, timeout=30)
    model, loss_fn = blocks_model(), nn.MSELoss()
    loss = loss_fn.forward(model.forward(np.ones((4, 6))), np.zeros((4, 6)))
    model.backward(loss_fn.backward())
    np.testing.assert_allclose(np.mean(results[1][1]), loss, rtol=1e-12)
    got = [g for r in results for g in r[0].values()]
    want = [q.grad for q in model.parameters()]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-13)


# -- failures mid-step ----------------------------------------------------------------------------


class Boom(nn.Module):
    """Raises in forward of one micro-batch (or in backward_weight), else the identity."""

    def __init__(self, at: int, where: str = "forward"):
        super().__init__()
        self.at, self.where, self.seen = at, where, 0

    def forward(self, x):
        if self.where == "forward" and self.seen == self.at:
            raise RuntimeError("boom in forward")
        self.seen += 1
        return x

    def backward(self, g):
        return g

    def backward_weight(self):
        if self.where == "weight":
            raise FloatingPointError("boom in backward_weight")


def _failing_stage(name, bad_stage, where):
    p = dist.get_world_size()
    stages = stages_on_rank(blocks_model(), p, STAGES_PER_RANK.get(name, 1), name=name)
    for s in stages:
        if s.stage_index == bad_stage:
            s.module = nn.Sequential(*list(s.module), Boom(1, where))
            s.__init__(s.module, s.stage_index, s.num_stages)
    rank = dist.get_rank()
    schedule = pp.SCHEDULE_CLASSES[name](stages, 4, nn.MSELoss())
    schedule.step(np.ones((8, 6)) if rank == 0 else None, target=np.ones((8, 6)))


@pytest.mark.parametrize(
    "name,bad_stage,where,during",
    [
        ("1F1B", 1, "forward", "1F1"),
        ("ZeroBubble", 3, "weight", "3W0"),
        ("ZBH2", 2, "weight", "2W0"),
        ("GPipe", 0, "forward", "0F1"),
    ],
)
def test_a_stage_raising_mid_step_reaches_every_rank_naming_it(name, bad_stage, where, during):
    errors = _errors(_failing_stage, 4, name, bad_stage, where)
    assert sorted(errors) == [0, 1, 2, 3]
    for rank, text in errors.items():
        assert text.startswith("PipelineError: pipeline step failed"), text
        assert f"stage {bad_stage} (rank {bad_stage}) raised" in text, text
        assert f"during {during}: boom" in text, text
        if rank != bad_stage:
            assert "on another rank" in text


def test_a_zbv_stage_raising_reaches_every_rank_naming_it():
    """Stage 6 of 8 lives on rank 1 with stage 1; its W fails after every forward has run."""
    errors = _errors(_failing_stage, 4, "ZBV", 6, "weight")
    assert sorted(errors) == [0, 1, 2, 3]
    for rank, text in errors.items():
        assert text.startswith("PipelineError: pipeline step failed"), text
        assert "stage 6 (rank 1) raised FloatingPointError during 6W0: boom" in text, text
        if rank != 1:
            assert "on another rank" in text


class BadGradient(nn.Module):
    """The identity forward; backward returns a gradient with one row too few."""

    def forward(self, x):
        return x

    def backward(self, g):
        return g[1:]


def _wrong_gradient_shape():
    rank = dist.get_rank()
    stages = stages_on_rank(blocks_model(), 2, 1)
    if rank == 1:
        stages = [pp.PipelineStage(nn.Sequential(BadGradient(), *stages[0].module), 1, 2)]
    pp.Schedule1F1B(stages, 2, nn.MSELoss()).step(np.ones((4, 6)), target=np.ones((4, 6)))


def test_a_gradient_shaped_unlike_the_output_names_both_stages_on_every_rank():
    errors = _errors(_wrong_gradient_shape)
    assert sorted(errors) == [0, 1]
    for text in errors.values():
        assert (
            "stage 1 (rank 1) sent a gradient of shape (1, 6) for micro-batch 0, but the output "
            "of stage 0 (rank 0) had shape (2, 6)" in text
        )


@pytest.mark.timeout(240)
def test_a_stage_raising_on_gloo_processes_reaches_every_rank(gloo_pool):
    with pytest.raises(RanksFailed) as info:
        gloo_pool(4).run(_failing_stage, "ZeroBubble", 2, "forward")
    assert sorted(e.rank for e in info.value.errors) == [0, 1, 2, 3]
    for e in info.value.errors:
        assert "stage 2 (rank 2) raised RuntimeError during 2F1: boom in forward" in e.message

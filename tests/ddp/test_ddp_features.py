"""DDP's other promises, on thread ranks: overlap, unused parameters, comm hooks, checks."""

import numpy as np
import pluribus
import pytest
from ddp_cases import ddp_train_on_rank, make_model, reference_train
from pluribus import nn
from pluribus.parallel import DistributedDataParallel, GradBucket
from pluribus.parallel.comm_hooks import allreduce_hook
from pluribus.testing import RanksFailed, run_ranks

pytestmark = pytest.mark.timeout(120)


def _overlap_trace():
    """Which buckets started their all-reduce before the first layer's gradient existed."""
    model = make_model(seed=1)
    first_weight = model[0].weight
    launched_early = []

    def recording_hook(state, bucket: GradBucket):
        launched_early.append(first_weight.grad is None)
        return allreduce_hook(state, bucket)

    ddp = DistributedDataParallel(model, bucket_cap_mb=4096 / 2**20, comm_hook=recording_hook)
    x = np.ones((4, 12), dtype=np.float32)
    for _ in range(3):
        model.zero_grad()
        launched_early.clear()
        ddp.backward(np.ones_like(ddp.forward(x)[:, :5]))
    return len(ddp.buckets), launched_early


def test_buckets_start_reducing_while_backward_still_runs():
    for n_buckets, early in run_ranks(_overlap_trace, 2, "threads"):
        assert len(early) == n_buckets >= 3
        # every bucket but the one holding the first layer went out before that layer's backward
        assert early[:-1] == [True] * (n_buckets - 1) and early[-1] is False


class TwoBranch(nn.Module):
    """A model whose second branch is used only when asked, to make unused parameters."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(3, 2, rng=0)
        self.branch = nn.Linear(2, 2, rng=1)
        self.use_branch = True

    def forward(self, x):
        y = self.trunk.forward(x)
        return self.branch.forward(y) if self.use_branch else y

    def backward(self, g):
        if self.use_branch:
            g = self.branch.backward(g)
        return self.trunk.backward(g)


def _unused_on_rank(find_unused: bool):
    rank = pluribus.get_rank()
    model = TwoBranch()
    ddp = DistributedDataParallel(model, find_unused_parameters=find_unused)
    for step in range(3):
        model.zero_grad()
        model.use_branch = rank == 0 or step == 0  # rank 1 stops using it after step 0
        out = ddp.forward(np.full((1, 3), rank + 1.0, dtype=np.float32))
        ddp.backward(np.ones_like(out))
    return {n: p.grad.copy() for n, p in model.named_parameters()}


def test_find_unused_parameters_reduces_zeros_instead_of_hanging():
    grads = run_ranks(_unused_on_rank, 2, "threads", args=(True,), timeout=30)
    np.testing.assert_array_equal(grads[0]["branch.weight"], grads[1]["branch.weight"])
    # rank 0's branch gradient averaged with rank 1's zeros
    trunk_out = TwoBranch().trunk.forward(np.ones((1, 3), dtype=np.float32))
    np.testing.assert_allclose(
        grads[0]["branch.weight"], np.ones((2, 1)) @ trunk_out / 2, rtol=1e-6
    )


def test_unused_parameters_without_the_flag_raise_a_clear_error_everywhere_it_happens():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_unused_on_rank, 2, "threads", args=(False,), timeout=30)
    kinds = info.value.kinds()
    assert kinds[1] == "RuntimeError"
    # rank 0 learns at its next collective that rank 1 stopped: an error, not a hang
    assert kinds.get(0) in (None, "PeerError")
    assert "['branch.weight', 'branch.bias']" in str(info.value)
    assert "find_unused_parameters=True" in str(info.value)


def _mismatched_model():
    width = 4 if pluribus.get_rank() == 0 else 5
    DistributedDataParallel(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, width)))


def test_different_models_are_refused_naming_the_first_difference():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_mismatched_model, 2, "threads", timeout=30)
    assert info.value.kinds() == {0: "ValueError", 1: "ValueError"}
    assert "'1.weight' with shape (5, 3) and dtype float32 on rank 1" in str(info.value)
    assert "'1.weight' with shape (4, 3) and dtype float32 on rank 0" in str(info.value)


def _broadcast_on_wrap():
    rank = pluribus.get_rank()
    model = nn.Sequential(nn.Linear(3, 4, rng=rank), nn.BatchNorm1d(4))
    model[1].running_mean[...] = rank + 1
    ddp = DistributedDataParallel(model)
    wrapped = ddp.state_dict()
    model[1].running_var[...] = rank + 7  # ranks drift apart; the next forward re-syncs
    ddp.forward(np.ones((2, 3), dtype=np.float32) * (rank + 1))
    return wrapped, model[1].running_var.copy()


def test_wrap_broadcasts_rank0_parameters_and_buffers_and_forward_resyncs_buffers():
    (state0, var0), (state1, var1) = run_ranks(_broadcast_on_wrap, 2, "threads")
    expected = nn.Sequential(nn.Linear(3, 4, rng=0), nn.BatchNorm1d(4)).state_dict()
    for name in expected:
        if "running_mean" not in name:
            np.testing.assert_array_equal(state1[name], expected[name], err_msg=name)
    np.testing.assert_array_equal(state1["1.running_mean"], np.ones(4))
    np.testing.assert_array_equal(var0, var1)


@pytest.mark.parametrize("hook, tolerance", [("fp16", 2e-4), ("bf16", 1e-3)])
def test_compression_hooks_train_close_to_full_precision(hook, tolerance):
    """Stated tolerance: after 6 SGD steps every parameter is within ``tolerance`` (absolute)
    of the full-precision run (measured: 3e-5 for fp16, 2e-4 for bf16; weights are O(0.3)),
    and the loss curve agrees to 1 %."""
    world, per_rank, steps = 2, 16, 6
    results = run_ranks(
        ddp_train_on_rank, world, "threads", args=(per_rank, steps, 1, 4096 / 2**20, hook)
    )
    exact = run_ranks(ddp_train_on_rank, world, "threads", args=(per_rank, steps, 1))
    reference = reference_train(world, per_rank, steps, 1)
    worst = 0.0
    for name, value in reference.items():
        difference = np.abs(results[0]["state"][name] - value).max()
        worst = max(worst, difference)
        np.testing.assert_array_equal(results[0]["state"][name], results[1]["state"][name])
    assert 0 < worst < tolerance
    np.testing.assert_allclose(results[0]["losses"], exact[0]["losses"], rtol=1e-2)


def _tied_weights_step(steps):
    model = nn.Sequential(nn.Linear(4, 4, rng=5), nn.Tanh(), nn.Linear(4, 4, rng=6))
    model[2].weight = model[0].weight  # used twice in one backward
    ddp = DistributedDataParallel(model, bucket_cap_mb=32 / 2**20)  # a bucket per parameter
    opt = nn.SGD(ddp.parameters(), lr=0.1)
    rank, world = pluribus.get_rank(), pluribus.get_world_size()
    x = np.arange(world * 8 * 4, dtype=np.float32).reshape(world * 8, 4) / 50
    for _ in range(steps):
        out = ddp.forward(x[rank * 8 : (rank + 1) * 8])
        ddp.backward(out / out.size)  # d(0.5 * mean of squares)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_a_parameter_used_twice_is_reduced_after_both_uses():
    results = run_ranks(_tied_weights_step, 2, "threads", args=(3,))
    model = nn.Sequential(nn.Linear(4, 4, rng=5), nn.Tanh(), nn.Linear(4, 4, rng=6))
    model[2].weight = model[0].weight
    opt = nn.SGD(model.parameters(), lr=0.1)
    x = np.arange(2 * 8 * 4, dtype=np.float32).reshape(16, 4) / 50
    for _ in range(3):
        out = model.forward(x)
        model.backward(out / out.size)
        opt.step()
        opt.zero_grad()
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(results[1][name], value, rtol=1e-5, atol=1e-7, err_msg=name)


def test_custom_comm_hook_gets_its_state_and_every_bucket():
    def run():
        seen = []

        def hook(state, bucket):
            seen.append((state, bucket.index))
            return allreduce_hook(None, bucket)

        ddp = DistributedDataParallel(make_model(0), bucket_cap_mb=4096 / 2**20)
        ddp.register_comm_hook("my-state", hook)
        out = ddp.forward(np.ones((2, 12), dtype=np.float32))
        ddp.backward(np.ones_like(out))
        return seen, len(ddp.buckets)

    for seen, n in run_ranks(run, 2, "threads"):
        assert seen == [("my-state", i) for i in range(n)]


def _branch_schedule(step: int) -> bool:
    return step == 0  # every rank stops using the branch after the first step


def _train_two_branch(model, forward, backward, rows):
    opt = nn.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    snapshots = []
    for step in range(4):
        model.use_branch = _branch_schedule(step)
        out = forward(rows(step))
        backward(out / out.size)  # d(0.5 * mean of squares)
        snapshots.append(
            {n: None if p.grad is None else p.grad.copy() for n, p in model.named_parameters()}
        )
        opt.step()
        opt.zero_grad()
    return model.state_dict(), snapshots


def _global_rows(step: int) -> np.ndarray:
    return np.random.default_rng(step).standard_normal((8, 3)).astype(np.float32)


def _unused_everywhere_on_rank():
    rank = pluribus.get_rank()
    model = TwoBranch()
    ddp = DistributedDataParallel(model, find_unused_parameters=True, process_group=None)
    return _train_two_branch(
        model, ddp.forward, ddp.backward, lambda step: _global_rows(step)[rank * 4 : rank * 4 + 4]
    )


def test_a_parameter_no_rank_used_keeps_no_gradient_and_matches_one_process():
    """Weight decay and momentum must not move it, as in torch and in one process."""
    results = run_ranks(_unused_everywhere_on_rank, 2, "threads", timeout=60)
    model = TwoBranch()
    expected, snapshots = _train_two_branch(model, model.forward, model.backward, _global_rows)
    for state, grads in results:
        assert grads[1]["branch.weight"] is None and grads[1]["branch.bias"] is None
        for name, value in expected.items():
            np.testing.assert_allclose(state[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
    assert snapshots[1]["branch.weight"] is None  # the single-process oracle


def _process_group_keyword():
    group = pluribus.new_group([0, 1])
    ddp = DistributedDataParallel(make_model(pluribus.get_rank()), process_group=group)
    assert ddp.process_group is group
    try:
        DistributedDataParallel(
            make_model(0), group=pluribus.new_group([0, 1]), process_group=group
        )
    except ValueError as error:
        return str(error)
    return None


def test_process_group_is_accepted_as_torch_spells_it():
    for message in run_ranks(_process_group_keyword, 2, "threads", timeout=60):
        assert "both group= and process_group=" in message

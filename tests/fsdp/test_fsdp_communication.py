"""Bytes per step counted by a wrapper plugin on every collective: FULL_SHARD moves
3Psi(N-1)/N (two parameter all-gathers and one gradient reduce-scatter), SHARD_GRAD_OP
2Psi(N-1)/N, NO_SHARD's all-reduce 2Psi(N-1)/N (a ring's bytes), so FULL_SHARD moves 1.5 times
DDP's. Each all-gather also carries one tag element per rank (the unit check)."""

import collections
import threading

import numpy as np
import pluribus
import pytest
from pluribus import nn
from pluribus.operations import hook_implementations
from pluribus.parallel import fully_shard
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(120)

WIDTH, UNITS = 32, 4
PSI_BYTES = 4 * UNITS * (WIDTH * WIDTH + WIDTH)


class ByteCounter:
    """Counts the bytes each rank sends or receives per collective (what a ring moves)."""

    def __init__(self):
        self.bytes: collections.Counter = collections.Counter()
        self.on = False
        self.lock = threading.Lock()
        for name, impl in hook_implementations(self._count, wrapper=True).items():
            setattr(self, name, impl)

    def _count(self, op, group, args, async_op):
        if self.on:
            n, me = group.size, group.rank
            if op.name == "all_gather":
                outputs = args[0]
                moved = sum(o.nbytes for i, o in enumerate(outputs) if i != me)
            elif op.name == "reduce_scatter":
                moved = sum(x.nbytes for i, x in enumerate(args[1]) if i != me)
            elif op.name == "all_reduce":
                moved = 2 * args[0].nbytes * (n - 1) / n
            else:
                moved = 0
            with self.lock:
                self.bytes[(group.global_rank, op.name)] += moved
        return (yield)


def step_on_rank(strategy, counter):
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, rng=i) for i in range(UNITS)])
    for layer in model:
        fully_shard(layer, strategy=strategy)
    fully_shard(model, strategy=strategy)
    for step in range(2):
        pluribus.barrier()
        counter.on = step == 1  # the second step: prefetch follows the first one's order
        y = model.forward(np.ones((2, WIDTH), np.float32))
        model.backward(np.ones_like(y))
        pluribus.barrier()
        counter.on = False


def moved(strategy, world):
    counter = ByteCounter()
    manager = pluribus.get_plugin_manager()
    manager.register(counter, name="fsdp-byte-counter")
    try:
        run_ranks(step_on_rank, world, "threads", args=(strategy, counter))
    finally:
        manager.unregister(counter)
    return counter.bytes


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_step_follow_the_zero_accounting(world):
    share = (world - 1) / world
    tags = 4 * (world - 1) * UNITS  # one float32 tag per rank and unit in each all-gather
    full, grad_op, ddp = (moved(s, world) for s in ("full_shard", "shard_grad_op", "no_shard"))
    for rank in range(world):
        assert full[(rank, "all_gather")] == 2 * PSI_BYTES * share + 2 * tags
        assert full[(rank, "reduce_scatter")] == PSI_BYTES * share
        assert grad_op[(rank, "all_gather")] == PSI_BYTES * share + tags
        assert grad_op[(rank, "reduce_scatter")] == PSI_BYTES * share
        assert ddp[(rank, "all_reduce")] == pytest.approx(2 * PSI_BYTES * share)
        assert ddp[(rank, "all_gather")] == 0
        total = full[(rank, "all_gather")] + full[(rank, "reduce_scatter")] - 2 * tags
        assert total / ddp[(rank, "all_reduce")] == pytest.approx(1.5)

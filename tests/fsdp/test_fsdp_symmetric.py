"""FSDP's send buffers are symmetric memory, allocated once per root: on gloo with both ranks on
one host, every all-gather and reduce-scatter of a unit above gloo's zero-copy size reads the
peers' inputs straight out of their memory, at every step, with results bit for bit those of
the copying path (and of one process on the whole batch); the allocations and the ledger's
buffers do not grow with the steps, and nothing is left in /dev/shm."""

import os
import threading

import numpy as np
import pluribus
import pytest
from pluribus import nn
from pluribus.parallel import fully_shard

pytestmark = pytest.mark.timeout(180)

# 641 output rows: 321 on rank 0, 320 on rank 1 (uneven shards, so the all-gather's segments
# are padded). One unit is 641 x 641 float32 = 1.6 MB, above gloo's 1 MiB zero-copy size.
WIDTH, ROWS, CLASSES, STEPS = 640, 641, 5, 3


def make_model() -> nn.Module:
    rng = np.random.default_rng(7)
    return nn.Sequential(
        nn.Linear(WIDTH, ROWS, rng=rng),
        nn.Tanh(),
        nn.Linear(ROWS, WIDTH, rng=rng),
        nn.Tanh(),
        nn.Linear(WIDTH, CLASSES, rng=rng),
    )


def batch(step: int, rows: int):
    rng = np.random.default_rng(step)
    return rng.standard_normal((rows, WIDTH)).astype(np.float32), rng.integers(0, CLASSES, rows)


def train(model, rows: int, mine: slice, after_step=lambda: None, mean=float) -> list[float]:
    """AdamW steps on ``mine`` of each global batch; ``mean``: the loss over the ranks."""
    opt, loss_fn, losses = nn.AdamW(model.parameters(), eps=1e-5), nn.CrossEntropyLoss(), []
    for step in range(STEPS):
        x, y = batch(step, rows)
        loss = loss_fn.forward(model.forward(x[mine]), y[mine])
        model.backward(loss_fn.backward())
        losses.append(mean(loss))
        opt.step()
        opt.zero_grad()
        after_step()
    return losses


class ZeroCopyRecorder:
    """Notes, per gloo all-gather and reduce-scatter that announced its input (those of at
    least ``ZERO_COPY_BYTES``), whether every rank's input was symmetric and it ran zero-copy;
    and every symmetric allocation."""

    def __init__(self):
        from pluribus_gloo import local, symmetric

        self.local, self.symmetric = local, symmetric
        self.runs: list[tuple[str, bool]] = []
        self.allocations = 0
        self.current = threading.local()
        self.originals = {
            (local, "all_gather"): local.all_gather,
            (local, "reduce_scatter"): local.reduce_scatter,
            (local, "_announce_and_agree"): local._announce_and_agree,
            (symmetric, "allocate"): symmetric.allocate,
        }

    def __enter__(self):
        originals = self.originals
        local, symmetric = self.local, self.symmetric

        def collective(name):
            def run(*args):
                self.current.name = name
                return originals[(local, name)](*args)

            return run

        def announce(arena, data, found):
            peers = originals[(local, "_announce_and_agree")](arena, data, found)
            self.runs.append((getattr(self.current, "name", "?"), peers is not None))
            return peers

        def allocate(*args):
            self.allocations += 1
            return originals[(symmetric, "allocate")](*args)

        local.all_gather = collective("all_gather")
        local.reduce_scatter = collective("reduce_scatter")
        local._announce_and_agree = announce
        symmetric.allocate = allocate
        return self

    def __exit__(self, *exc):
        for (module, name), original in self.originals.items():
            setattr(module, name, original)


def fsdp_on_rank(strategy: str, copying: bool) -> dict:
    """Train on this rank's rows with FSDP, counting zero-copy runs and allocations per step;
    ``copying``: raise gloo's zero-copy size out of reach (the copying path everywhere)."""
    from pluribus_gloo import local

    rank, world = pluribus.get_rank(), pluribus.get_world_size()
    threshold = local.ZERO_COPY_BYTES
    if copying:
        local.ZERO_COPY_BYTES = 1 << 62
    try:
        with ZeroCopyRecorder() as recorder:
            model = make_model()
            for layer in (model[0], model[2], model[4]):
                fully_shard(layer, strategy=strategy)
            fully_shard(model, strategy=strategy)
            per_step = []

            def note():
                ledger = model.memory_ledger()
                per_step.append(
                    {
                        "runs": list(recorder.runs),
                        "allocations": recorder.allocations,
                        "buffers": ledger.buffers,
                        "peak": ledger.peak_total,
                        "steady": ledger.steady,
                    }
                )
                recorder.runs.clear()

            def mean(loss):
                total = np.array([float(loss)])
                pluribus.all_reduce(total, op=pluribus.ReduceOp.AVG)
                return float(total[0])

            losses = train(model, 4 * world, slice(rank * 4, (rank + 1) * 4), note, mean)
            state = {name: d.to_local().copy() for name, d in model.state_dict().items()}
            units = [u for u in model.fsdp_units() if u.pieces]
            sizes = [max(u.segment for u in units), max(sum(u.counts) for u in units)]
    finally:
        local.ZERO_COPY_BYTES = threshold
    pid = f"plrb-{os.getpid()}-"
    left = [name for name in os.listdir("/dev/shm") if name.startswith(pid)]
    return {
        "steps": per_step,
        "losses": losses,
        "state": state,
        "largest": sizes,  # elements: the longest all-gather segment, the largest unit
        "shm_left": left,
    }


def reference() -> dict:
    model = make_model()
    losses = train(model, 8, slice(0, 8))
    return {"losses": losses, "state": model.state_dict()}


@pytest.fixture(scope="module")
def gloo_pair(process_pools):
    return process_pools("gloo", 2)


@pytest.mark.parametrize("strategy", ["full_shard", "shard_optimizer_state"])
def test_fsdp_gathers_and_scatters_zero_copy_with_the_same_results(gloo_pair, strategy):
    zero_copy = gloo_pair.run(fsdp_on_rank, strategy, False)
    copying = gloo_pair.run(fsdp_on_rank, strategy, True)
    expected = reference()
    gathers = 4 if strategy == "full_shard" else 2  # the two large units, again in backward
    for rank, (fast, slow) in enumerate(zip(zero_copy, copying, strict=True)):
        for step in fast["steps"]:
            kinds = [name for name, _ in step["runs"]]
            assert sorted(kinds) == ["all_gather"] * gathers + ["reduce_scatter"] * 2, kinds
            assert all(agreed for _, agreed in step["runs"]), f"rank {rank}: {step['runs']}"
        for step in slow["steps"]:
            assert step["runs"] == []
        # bit for bit the copying path's results, and one process's up to rounding
        assert fast["losses"] == slow["losses"], f"rank {rank}"
        for name, shard in fast["state"].items():
            np.testing.assert_array_equal(shard, slow["state"][name], err_msg=f"rank {rank}")
        np.testing.assert_allclose(fast["losses"], expected["losses"], rtol=1e-5)
        for name, shard in fast["state"].items():
            rows = expected["state"][name].shape[0]
            lo, hi = (0, (rows + 1) // 2) if rank == 0 else ((rows + 1) // 2, rows)
            np.testing.assert_allclose(
                shard, expected["state"][name][lo:hi], rtol=1e-4, atol=1e-5, err_msg=name
            )
        # allocated once, at the first step; held, bounded, the same at every step
        in_flight = 1 if strategy == "full_shard" else 2
        first = fast["steps"][0]
        assert first["allocations"] == 1 + in_flight, f"rank {rank}"
        assert first["buffers"] > 0
        for step in fast["steps"]:
            assert step["allocations"] == first["allocations"]
            assert step["buffers"] == first["buffers"]
            assert step["steady"] == first["steady"]
        # the peak (never reset) stops growing once prefetch follows the first step's order
        assert fast["steps"][-1]["peak"] == fast["steps"][1]["peak"], f"rank {rank}"
        segment, unit = fast["largest"]
        assert first["buffers"] == 4 * (segment + in_flight * unit), f"rank {rank}"
        assert fast["shm_left"] == [] and slow["shm_left"] == []


def unshard_all_on_rank() -> dict:
    """Both large units' all-gathers in flight at once: the second finds the one all-gather
    buffer lent and sends a plain array (the copying path); both give whole parameters, and
    the buffer is lent again afterwards."""
    model = make_model()
    whole = {name: p.data.copy() for name, p in model.named_parameters()}
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    model.unshard()  # the root first runs: it finds its units and allocates their buffers
    with ZeroCopyRecorder() as recorder:
        model[0].unshard(async_op=True)
        model[2].unshard(async_op=True)
        model[0].unshard()
        model[2].unshard()
        gathered = {name: p.data.copy() for name, p in model.named_parameters() if p.data.ndim}
        together = list(recorder.runs)
        model[0].reshard()
        model[2].reshard()
        recorder.runs.clear()
        model[2].unshard()
        model[2].reshard()
        return {
            "together": together,
            "after": list(recorder.runs),
            "allocations": recorder.allocations,
            "equal": [
                bool(np.array_equal(gathered[n], whole[n])) for n in ("0.weight", "2.weight")
            ],
        }


def test_gathers_beyond_the_buffers_take_the_copying_path(gloo_pair):
    for result in gloo_pair.run(unshard_all_on_rank):
        assert result["equal"] == [True, True]
        assert result["together"] == [("all_gather", True), ("all_gather", False)]
        assert result["after"] == [("all_gather", True)]
        assert result["allocations"] == 0  # made when the root first ran, before the recorder

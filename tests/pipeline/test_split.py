"""The splitter balances stages; the GPT cut by it trains like one process (with the sequence
length changing between steps); pipeline x data parallelism on a 2 x 2 layout."""

import numpy as np
import pytest
from pipeline_cases import (
    batches,
    gpt_pipeline_on_rank,
    gpt_reference,
    pipeline_ddp_on_rank,
    reference,
    tiny_gpt,
)
from pluribus import nn
from pluribus.parallel import pipeline as pp
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


def test_balance_minimises_the_costliest_stage():
    assert pp.balance([1, 1, 1, 1, 10, 1, 1], 3) == [range(0, 4), range(4, 5), range(5, 7)]
    assert pp.balance([4, 1, 1, 1, 1, 4], 2) == [range(0, 3), range(3, 6)]
    assert pp.balance([1] * 8, 4) == [range(i, i + 2) for i in range(0, 8, 2)]
    with pytest.raises(ValueError, match="cannot cut 3 layer"):
        pp.balance([1, 1, 1], 4)


def test_split_sequential_by_parameters_and_by_time():
    model = nn.Sequential(
        nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )
    parts = pp.split_sequential(model, 2)
    assert [len(p) for p in parts] == [1, 4]  # 320 | 4160 + 260 beats 320 + 4160 | 260
    assert parts[0][0] is model[0]  # shared, not copied
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    timed = pp.split_sequential(model, 2, by="time", sample_input=x)
    assert sum(len(p) for p in timed) == 5
    assert all(p.grad is None for p in model.parameters())  # measuring leaves no gradients
    with pytest.raises(ValueError, match="pass sample_input"):
        pp.split_sequential(model, 2, by="time")


def test_split_gpt_puts_embeddings_first_and_head_last_and_composes_to_the_model():
    gpt = tiny_gpt()
    parts = pp.split_gpt(gpt, 3)
    assert isinstance(parts[0][0], pp.GPTEmbedding) and isinstance(parts[-1][-1], pp.GPTHead)
    idx = np.random.default_rng(0).integers(0, 16, (2, 8))
    x = idx
    for part in parts:
        x = part.forward(x)
    np.testing.assert_array_equal(x, gpt.forward(idx))
    counted = sum(q.data.size for part in parts for q in part.parameters())
    assert counted == gpt.num_parameters()
    tied = nn.GPT(nn.GPTConfig(vocab_size=16, **nn.PRESETS["tiny"]), rng=0)
    with pytest.raises(ValueError, match="tie_weights=False"):
        pp.split_gpt(tied, 2)


@pytest.mark.parametrize("name,by", [("1F1B", "params"), ("ZeroBubble", "time")])
def test_the_split_gpt_trains_like_one_process_with_changing_sequence_length(name, by):
    m = 2
    results = run_ranks(gpt_pipeline_on_rank, 2, args=(name, m, by), timeout=60)
    for step, (loss, grads) in enumerate(gpt_reference(m)):
        np.testing.assert_allclose(np.mean(results[1][step][0]), loss, rtol=1e-12)
        merged = {**results[0][step][1], **results[1][step][1]}
        assert sorted(merged) == list(range(len(grads)))
        for i, g in enumerate(grads):
            np.testing.assert_allclose(merged[i], g, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["1F1B", "ZeroBubble"])
def test_pipeline_times_data_parallel_equals_one_process(name):
    m = 2
    results = run_ranks(pipeline_ddp_on_rank, 4, args=(name, m), timeout=60)
    ((loss, _, grads),) = reference(m, 1)
    x, _ = batches(m, 1)[0]
    assert x.shape[0] == 2 * m  # each pipeline took half: one row per micro-batch
    for rank in (1, 3):
        assert np.mean(results[rank][1]) != pytest.approx(loss)  # each half has its own loss
    np.testing.assert_allclose(np.mean(results[1][1] + results[3][1]), loss, rtol=1e-12)
    for rank in range(4):
        for n, g in results[rank][0].items():
            np.testing.assert_allclose(g, grads[n], rtol=1e-10, atol=1e-13, err_msg=n)
    assert sorted({**results[0][0], **results[1][0]}) == sorted(grads)

"""examples/parameter_server.py: with one trainer and one handler thread on the server, every
pull sees every earlier push, so asynchronous training must equal plain sequential training of
the same model on the same batches (the single-process reference); with two trainers it must
still learn the digits."""

import argparse
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from pluribus import HashStore, nn, rpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import parameter_server as example  # noqa: E402
from train_digits import build_model, load_data  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _workers(world, main, **options):
    store, results, errors = HashStore(), {}, {}

    def body(rank):
        try:
            name = example.PS if rank == 0 else f"trainer{rank}"
            rpc.init_rpc(name, rank=rank, world_size=world, store=store, timeout=60, **options)
            try:
                results[rank] = main(rank)
            finally:
                rpc.shutdown(timeout=60)
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    if errors:
        raise errors[min(errors)]
    return results[0]


def _reference(hidden, lr, seed, epochs, batch):
    (x, y), _ = load_data(seed)
    model = build_model(hidden, seed)
    opt = nn.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    rng = np.random.default_rng(seed)  # trainer 0 of 1
    mine = np.arange(0, len(y), 1)
    for _ in range(epochs):
        order = rng.permutation(mine)
        for start in range(0, len(order), batch):
            indices = order[start : start + batch]
            loss_fn.forward(model.forward(x[indices]), y[indices])
            model.backward(loss_fn.backward())
            opt.step()
            opt.zero_grad()
    return {name: p.data for name, p in model.named_parameters()}


def test_one_trainer_matches_sequential_training_exactly():
    hidden, lr, seed, epochs, batch = 16, 3e-3, 0, 1, 128

    def main(rank):
        if rank != 0:
            return None
        with rpc.remote(example.PS, example.ParameterServer, args=(hidden, lr, seed)) as ps:
            report = rpc.rpc_sync("trainer1", example.train, args=(ps, 0, 1, epochs, batch, seed))
            return report, ps.rpc_sync().get_weights()

    report, weights = _workers(2, main, num_worker_threads=1)
    expected = _reference(hidden, lr, seed, epochs, batch)
    assert report["steps"] == -(-1437 // batch)
    assert weights.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(weights[name], expected[name], rtol=1e-6, atol=1e-7)


def test_two_trainers_learn_the_digits_asynchronously():
    args = argparse.Namespace(epochs=3, batch_size=32, lr=3e-3, hidden=64, seed=0, world_size=3)
    result = _workers(3, lambda rank: example.run(args))
    assert result["accuracy"] > 0.85
    steps = sum(r["steps"] for r in result["reports"])
    assert result["updates"] == steps
    assert all(r["last_loss"] < r["first_loss"] for r in result["reports"])

"""Asynchronous training with a parameter server: the digits MLP, over pluribus.rpc.

    pluribus-run --nproc-per-node 3 examples/parameter_server.py

Worker 0 ("ps") creates the ParameterServer with ``rpc.remote`` and hands its ``RRef`` to every
trainer (workers 1, 2, ...) with ``rpc_async``. Each trainer loops over its share of the
data: it pulls the current weights (``ps.rpc_sync().get_weights()``), computes gradients on a
batch with its local copy of the model, and pushes them (``ps.rpc_async().apply_gradients``)
without waiting, so trainers never wait for each other (Hogwild-style staleness of at most one
step per trainer). At the end the server's model is scored on the held-out digits. Nothing is
pickled: weights and gradients travel as raw arrays, and only the exposed names can be called.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from pluribus import nn, rpc  # noqa: E402
from train_digits import build_model, load_data  # noqa: E402

PS = "ps"


@rpc.expose(name="parameter_server.ParameterServer")
class ParameterServer:
    """The one copy of the weights that every trainer reads and updates."""

    def __init__(self, hidden: int, lr: float, seed: int):
        self.model = build_model(hidden, seed)
        self.params = dict(self.model.named_parameters())
        self.optimizer = nn.AdamW(self.model.parameters(), lr=lr, weight_decay=1e-4)
        self.lock = threading.Lock()  # handlers run concurrently on the pool
        self.version = 0

    def get_weights(self) -> dict:
        with self.lock:
            return {name: p.data.copy() for name, p in self.params.items()}

    def apply_gradients(self, grads: dict) -> int:
        with self.lock:
            for name, grad in grads.items():
                self.params[name].grad = grad
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.version += 1
            return self.version

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        with self.lock:
            self.model.eval()
            correct = (self.model.forward(x).argmax(axis=1) == y).mean()
            self.model.train()
            return float(correct)


@rpc.expose(name="parameter_server.train")
def train(ps: rpc.RRef, trainer: int, trainers: int, epochs: int, batch: int, seed: int):
    """One trainer's loop: pull weights, compute gradients, push them asynchronously."""
    (x, y), _ = load_data(seed)
    mine = np.arange(trainer, len(y), trainers)
    model = build_model(int(ps.rpc_sync().get_weights()["0.weight"].shape[0]), seed)
    params = dict(model.named_parameters())
    loss_fn = nn.CrossEntropyLoss()
    rng = np.random.default_rng(seed + trainer)
    pushed, losses = None, []
    with ps:  # this trainer's handle: released when the loop ends
        for _ in range(epochs):
            order = rng.permutation(mine)
            for start in range(0, len(order), batch):
                indices = order[start : start + batch]
                model.load_state_dict(ps.rpc_sync().get_weights())
                loss = loss_fn.forward(model.forward(x[indices]), y[indices])
                model.backward(loss_fn.backward())
                grads = {name: p.grad for name, p in params.items()}
                if pushed is not None:
                    pushed.wait()  # at most one push in flight per trainer
                pushed = ps.rpc_async().apply_gradients(grads)
                model.zero_grad()
                losses.append(float(loss))
        if pushed is not None:
            pushed.wait()
    return {"steps": len(losses), "first_loss": losses[0], "last_loss": float(np.mean(losses[-5:]))}


def run(args: argparse.Namespace) -> dict | None:
    """The job, on a worker that called init_rpc; worker 0 drives it and returns its results."""
    me = rpc.get_worker_info()
    if me.id != 0:
        return None
    trainers = [f"trainer{r}" for r in range(1, args.world_size)]
    started = time.perf_counter()
    with rpc.remote(PS, ParameterServer, args=(args.hidden, args.lr, args.seed)) as ps:
        futures = [
            rpc.rpc_async(
                name, train, args=(ps, i, len(trainers), args.epochs, args.batch_size, args.seed)
            )
            for i, name in enumerate(trainers)
        ]
        reports = [f.wait() for f in futures]
        _, (x_test, y_test) = load_data(args.seed)
        accuracy = ps.rpc_sync().accuracy(x_test, y_test)
        updates = ps.local_value().version  # the server lives on this worker
    elapsed = time.perf_counter() - started
    print(
        f"held-out accuracy {accuracy:.2%} after {updates} asynchronous updates from "
        f"{len(trainers)} trainers in {elapsed:.1f}s",
        flush=True,
    )
    return {"accuracy": accuracy, "updates": updates, "reports": reports}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.world_size = int(os.environ.get("WORLD_SIZE", "3"))
    return args


def main() -> None:
    args = parse_args()
    rank = int(os.environ.get("RANK", "0"))
    rpc.init_rpc(PS if rank == 0 else f"trainer{rank}", timeout=300)
    try:
        run(args)
    finally:
        rpc.shutdown()


if __name__ == "__main__":
    main()

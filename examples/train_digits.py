"""Train an MLP on scikit-learn's handwritten digits with data parallelism.

    pluribus-run --nproc-per-node 2 examples/train_digits.py

Every rank holds the same model (DistributedDataParallel keeps it so by averaging gradients),
reads its own shard of each epoch (DistributedSampler), and held-out accuracy is counted over
all ranks' shares of the test set. Rank 0 shows progress; after every epoch the ranks save a
checkpoint together (``pluribus.checkpoint.CheckpointManager``, the last two kept), and a
restarted job (``pluribus-run --max-restarts 3 ...``) resumes from the newest complete one.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

# Before numpy loads OpenBLAS: one BLAS pool per rank, sized to its share of the cores (as
# torchrun does). More BLAS threads than cores, summed over the ranks, makes OpenBLAS spin
# against itself and slows this small model down tenfold.
_RANKS_HERE = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
if _RANKS_HERE > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _RANKS_HERE)))

import numpy as np  # noqa: E402
import pluribus  # noqa: E402
from pluribus import checkpoint, nn  # noqa: E402
from pluribus.data import DistributedSampler  # noqa: E402
from pluribus.parallel import DistributedDataParallel  # noqa: E402


def default_checkpoint_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/pluribus/checkpoints/<name>`` (``~/.cache`` without it): a run started
    from any folder finds its checkpoint again and leaves nothing where it was started."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache).resolve() / "pluribus" / "checkpoints" / name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="gloo", help="collective backend (default: gloo)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint-dir",
        default=str(default_checkpoint_dir("digits")),
        help="where the checkpoint is saved and resumed from ('' turns it off; default: "
        "%(default)s, under the user's cache folder, never the working directory)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint (a job restarted by pluribus-run --max-restarts "
        "always does); without it a run starts afresh",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--simulate-failure-at-epoch",
        type=int,
        default=None,
        metavar="E",
        help="the last rank exits at the start of epoch E on the first attempt "
        "(to try --max-restarts)",
    )
    return parser.parse_args(argv)


def load_data(seed: int = 0):
    """Digits scaled to [0, 1], split 80/20 into train and held-out test the same everywhere."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    split = int(0.8 * len(y))
    return (x[order[:split]], y[order[:split]]), (x[order[split:]], y[order[split:]])


def build_model(hidden: int, seed: int) -> nn.Module:
    rng = np.random.default_rng(seed)
    return nn.Sequential(
        nn.Linear(64, hidden, rng=rng),
        nn.ReLU(),
        nn.Linear(hidden, hidden, rng=rng),
        nn.ReLU(),
        nn.Linear(hidden, 10, rng=rng),
    )


def checkpoint_state(model: nn.Module, opt: nn.Optimizer, epoch: int) -> dict:
    """What a checkpoint holds: every rank passes its (replicated) state; each array is
    written once."""
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": epoch}


def restore_checkpoint(manager: checkpoint.CheckpointManager | None, model, opt) -> int:
    """Load the newest complete checkpoint into every rank; return the epoch to start from."""
    step = manager.latest_step() if manager is not None else None
    if step is None:
        return 0
    state = checkpoint.read_whole(manager.path(step))  # the optimizer has no state to fill yet
    model.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("model.")})
    opt.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("optim.")})
    return int(state["epoch"])


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    """Accuracy over the whole held-out set: each rank scores its share, counts are summed."""
    rank, world = pluribus.get_rank(), pluribus.get_world_size()
    model.eval()
    mine = slice(rank, None, world)
    correct = (model.forward(x[mine]).argmax(axis=1) == y[mine]).sum()
    counts = np.array([correct, y[mine].size], dtype=np.int64)
    pluribus.all_reduce(counts)
    model.train()
    return float(counts[0] / counts[1])


def train(args: argparse.Namespace) -> dict:
    """The training loop; needs an initialised process group (tests run it on thread ranks)."""
    rank, world = pluribus.get_rank(), pluribus.get_world_size()
    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    model = build_model(args.hidden, args.seed)
    ddp = DistributedDataParallel(model)
    opt = nn.AdamW(ddp.parameters(), lr=args.lr, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    ckpt = None
    if args.checkpoint_dir:
        ckpt = checkpoint.CheckpointManager(args.checkpoint_dir, keep_last=2)
    restarts = int(os.environ.get("PLURIBUS_RESTART_COUNT", "0"))
    resume = args.resume or restarts > 0
    start_epoch = restore_checkpoint(ckpt, model, opt) if resume else 0
    if rank == 0 and start_epoch:
        where = ckpt.path(start_epoch)
        print(f"resuming from {where} at epoch {start_epoch} (restart {restarts})", flush=True)

    sampler = DistributedSampler(len(y_train), world, rank, shuffle=True, seed=args.seed)
    steps_per_epoch = -(-len(sampler) // args.batch_size)
    progress = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(
            total=(args.epochs - start_epoch) * steps_per_epoch,
            unit="step",
            desc=f"{world} ranks on {pluribus.get_backend()}",
        )
    losses, accuracy, started = [], 0.0, time.perf_counter()
    seen = 0
    for epoch in range(start_epoch, args.epochs):
        if args.simulate_failure_at_epoch == epoch and restarts == 0 and rank == world - 1:
            print(f"rank {rank}: simulating a crash at epoch {epoch}", flush=True)
            os._exit(17)
        sampler.set_epoch(epoch)
        for indices in sampler.batches(args.batch_size):
            loss = loss_fn.forward(ddp.forward(x_train[indices]), y_train[indices])
            ddp.backward(loss_fn.backward())
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
            seen += len(indices) * world
            if progress is not None:
                rate = seen / (time.perf_counter() - started)
                progress.set_postfix(
                    epoch=epoch,
                    loss=f"{float(loss):.3f}",
                    samples_per_s=f"{rate:,.0f}",
                    refresh=False,
                )
                progress.update()
        accuracy = evaluate(model, x_test, y_test)
        if ckpt is not None:  # every rank takes part; each array is written once
            ckpt.save(epoch + 1, checkpoint_state(model, opt, epoch + 1))
    if progress is not None:
        progress.close()
    if start_epoch >= args.epochs:  # nothing left to train: report the restored model
        accuracy = evaluate(model, x_test, y_test)
    elapsed = time.perf_counter() - started
    if rank == 0:
        print(
            f"held-out accuracy {accuracy:.2%} on {len(y_test)} digits after {args.epochs} "
            f"epochs ({elapsed:.1f}s, {world} ranks, backend {pluribus.get_backend()})",
            flush=True,
        )
    return {
        "accuracy": accuracy,
        "start_epoch": start_epoch,
        "losses": losses,
        "state": model.state_dict(),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pluribus.init_process_group(backend=args.backend)
    try:
        train(args)
    finally:
        pluribus.destroy_process_group()


if __name__ == "__main__":
    main()

"""Train a character-level GPT on the Python standard library's own source code.

    pluribus-run --nproc-per-node 2 examples/train_gpt.py

The text is every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (no download): files
whose path hashes to 0 mod 10 are held out, the rest are for training. A "dataset" is a fixed
set of windows drawn from the training text; each epoch the ranks split it with
``DistributedSampler``. Every epoch prints the training loss, the held-out loss (next to the
loss of a unigram model, the baseline to beat) and tokens/s; at the end rank 0 samples some
code. After every epoch the ranks save a checkpoint together (``pluribus.checkpoint``);
``--resume`` or a restart by ``pluribus-run --max-restarts`` continues from the newest.

``--parallel`` picks how the model is spread over the ranks (``ddp``; ``fsdp``: each block
fully sharded; ``tp``: each block's heads and MLP split over ``--tp-size`` ranks, data parallel
over the rest, and with ``--vocab-parallel`` the embedding, the head and the loss split by
vocabulary; ``fsdp-tp``: the same split, its pieces fully sharded over the rest),
``--preset`` the model size (``10M`` and ``100M`` for memory benchmarks). A checkpoint
written under one ``--parallel`` resumes under any other.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time
import zlib
from pathlib import Path

# Before numpy loads OpenBLAS: one BLAS pool per rank, sized to its share of the cores (as
# torchrun does); oversubscribed BLAS threads spin against each other.
_RANKS_HERE = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
if _RANKS_HERE > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _RANKS_HERE)))

import numpy as np  # noqa: E402
import pluribus  # noqa: E402
from pluribus import checkpoint, nn  # noqa: E402
from pluribus.data import DistributedSampler  # noqa: E402
from pluribus.dtensor import init_device_mesh  # noqa: E402
from pluribus.parallel import (  # noqa: E402
    DistributedDataParallel,
    FullyShardedDataParallel,
    VocabParallelCrossEntropyLoss,
    fully_shard,
    get_model_state_dict,
    get_optimizer_state_dict,
    parallelize_module,
    set_model_state_dict,
    set_optimizer_state_dict,
    transformer_plan,
)

VOCAB = 128  # ASCII; any other character reads as "?"
PARALLEL = ["ddp", "fsdp", "tp", "fsdp-tp", "none"]  # pipeline and the other combinations join here
HELD_OUT_SEED = 12345  # the held-out windows never depend on --seed


def default_checkpoint_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/pluribus/checkpoints/<name>`` (``~/.cache`` without it)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache).resolve() / "pluribus" / "checkpoints" / name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="gloo", help="collective backend (default: gloo)")
    parser.add_argument("--parallel", choices=PARALLEL, default="ddp")
    parser.add_argument(
        "--tp-size",
        type=int,
        default=2,
        help="with --parallel tp or fsdp-tp: ranks per tensor-parallel group (the world "
        "divided by it trains data parallel)",
    )
    parser.add_argument(
        "--vocab-parallel",
        action="store_true",
        help="with --parallel tp or fsdp-tp: split the token embedding and the head by "
        "vocabulary too, and compute the loss from the split logits (no sample is drawn: "
        "sampling needs the whole vocabulary's logits)",
    )
    parser.add_argument("--preset", choices=sorted(nn.PRESETS), default="small", help="model size")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--epochs", type=int, default=4, help="epochs of the whole schedule")
    parser.add_argument(
        "--epochs-this-run",
        type=int,
        default=None,
        metavar="N",
        help="stop after N epochs (a time-limited job); --resume continues the same schedule",
    )
    parser.add_argument(
        "--train-windows", type=int, default=8192, help="windows in the training set"
    )
    parser.add_argument("--eval-windows", type=int, default=256, help="held-out windows")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="recompute each block's activations in backward (less memory, more compute)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-chars", type=int, default=300, help="characters to sample")
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="where the checkpoint is saved and resumed from ('' turns it off; default: "
        "the user's cache folder, pluribus/checkpoints/gpt-<preset>)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint (a job restarted by pluribus-run --max-restarts "
        "always does); without it a run starts afresh",
    )
    args = parser.parse_args(argv)
    if args.vocab_parallel and args.parallel not in ("tp", "fsdp-tp"):
        parser.error(
            "--vocab-parallel splits a tensor-parallel model: add --parallel tp (or fsdp-tp)"
        )
    if args.checkpoint_dir is None:
        args.checkpoint_dir = str(default_checkpoint_dir(f"gpt-{args.preset}"))
    return args


# -- data ------------------------------------------------------------------------------------


def stdlib_sources() -> tuple[str, str]:
    """The standard library's ``.py`` files as (training text, held-out text), split by file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    train, held_out = [], []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        (held_out if zlib.crc32(relative.encode()) % 10 == 0 else train).append(text)
    if not train or not held_out:
        raise RuntimeError(f"found no Python sources under {root}; is the standard library there?")
    return "\n".join(train), "\n".join(held_out)


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8)


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("ascii", errors="replace")


def windows(tokens: np.ndarray, count: int, length: int, seed: int) -> np.ndarray:
    """``count`` windows of ``length`` tokens at random offsets (the same on every rank)."""
    starts = np.random.default_rng(seed).integers(0, tokens.size - length, count)
    return tokens[starts[:, None] + np.arange(length)].astype(np.int64)


def unigram_loss(train: np.ndarray, targets: np.ndarray) -> float:
    """Cross-entropy of ``targets`` under the training text's character frequencies."""
    counts = np.bincount(train, minlength=VOCAB).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[targets.reshape(-1)].mean())


# -- model -----------------------------------------------------------------------------------


def build_model(args: argparse.Namespace) -> nn.GPT:
    config = nn.GPTConfig(vocab_size=VOCAB, dropout=args.dropout, **nn.PRESETS[args.preset])
    model = nn.GPT(config, rng=args.seed)
    if args.checkpoint_activations:
        model.blocks = nn.Sequential(*[nn.Checkpoint(block) for block in model.blocks])
    model.to(device=args.device, dtype=np.dtype(args.dtype))
    return model


def tensor_parallel(model: nn.GPT, args: argparse.Namespace, world: int):
    """Split every block (and with ``--vocab-parallel`` the vocabulary) over ``--tp-size``
    ranks on a (dp, tp) mesh, with DDP over its data parallel dimension (``fsdp-tp``: each
    block, then the root, fully sharded over it). Returns the model to train, the
    data-parallel slice of the mesh and the loss."""
    if world % args.tp_size:
        raise SystemExit(f"--tp-size {args.tp_size} does not divide the {world} ranks")
    shape = (world // args.tp_size, args.tp_size)
    mesh = init_device_mesh(args.device, shape, mesh_dim_names=("dp", "tp"))
    plan = transformer_plan(model, vocab_parallel=args.vocab_parallel)
    parallelize_module(model, mesh["tp"], plan)
    loss_fn = VocabParallelCrossEntropyLoss(mesh["tp"]) if args.vocab_parallel else None
    data = mesh["dp"]
    if args.parallel == "fsdp-tp":
        for block in model.blocks:
            fully_shard(block, mesh=data)
        return fully_shard(model, mesh=data), data, loss_fn
    if data.size() == 1:
        return model, data, loss_fn
    return DistributedDataParallel(model, process_group=data.get_group()), data, loss_fn


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> nn.AdamW:
    """Weight decay on matrices only (not on biases, norms or position embeddings)."""
    decay = [p for n, p in model.named_parameters() if p.data.ndim == 2 and "wpe" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.data.ndim == 2 and "wpe" not in n)]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return nn.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def warmup_then_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# -- checkpoints -----------------------------------------------------------------------------


def checkpoint_state(runner, opt, scheduler, epoch: int) -> dict:
    """What a checkpoint holds, with the same keys however the model is spread
    (``pluribus.parallel``'s state dict): every rank passes its own state (cupy arrays too),
    whole arrays under ddp (each written once), DTensors for fsdp's rows and tp's pieces,
    ``checkpoint.Pieces`` for fsdp-tp's rows of its pieces."""
    return {
        "model": get_model_state_dict(runner),
        "optim": get_optimizer_state_dict(runner, opt),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
    }


def restore_checkpoint(manager: checkpoint.CheckpointManager | None, runner, opt, scheduler) -> int:
    """Load the newest complete checkpoint into every rank; return the epoch to start from.
    Each rank reads its part in this run's layout, whatever the world size and parallelism
    that saved it."""
    step = manager.latest_step() if manager is not None else None
    if step is None:
        return 0
    state = checkpoint_state(runner, opt, scheduler, 0)  # this run's arrays, to be filled
    checkpoint.load(state, manager.path(step))
    set_model_state_dict(runner, state["model"])
    set_optimizer_state_dict(runner, opt, state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["epoch"])


def _host(array):
    return array.get() if hasattr(array, "get") else array


# -- training --------------------------------------------------------------------------------


def evaluate(
    model: nn.GPT, data: np.ndarray, batch_size: int, xp, rank: int, world: int, loss_fn
) -> float:
    """Mean loss over all held-out windows: each data-parallel ``rank`` of ``world`` scores its
    share, and the sums of every rank are added (tensor-parallel ranks each count the same, so
    the mean is the same)."""
    model.eval()
    total, count = 0.0, 0
    mine = data[rank::world]
    most = -(-len(data) // world)  # every rank runs as many forwards (FSDP gathers in each)
    for start in range(0, most, batch_size):
        part = mine[start : start + batch_size]
        chunk = xp.asarray(part if len(part) else data[:1])  # none left here: counted as 0
        logits = model.forward(chunk[:, :-1])
        targets = chunk[:, 1:].reshape(-1)
        logits = logits.reshape(-1, logits.shape[-1])  # split by vocabulary: this rank's part
        loss = float(loss_fn.forward(logits, targets))
        if len(part):
            total += loss * targets.size
            count += targets.size
    model.release_saved()
    loss_fn.release_saved()  # the training loss: its last probabilities are no longer needed
    model.train()
    sums = np.array([total, count], dtype=np.float64)
    pluribus.all_reduce(sums)
    return float(sums[0] / sums[1])


def train(args: argparse.Namespace) -> dict:
    """The training loop; needs an initialised process group (tests run it on thread ranks)."""
    rank, world = pluribus.get_rank(), pluribus.get_world_size()
    if args.parallel == "none" and world > 1:
        raise SystemExit("--parallel none trains one process; run it without pluribus-run")
    xp = np
    if args.device == "cuda":
        import cupy as xp
    model = build_model(args)
    block = model.config.block_size
    train_text, held_out_text = stdlib_sources()
    train_tokens, held_tokens = encode(train_text), encode(held_out_text)
    train_set = windows(train_tokens, args.train_windows, block + 1, seed=args.seed)
    held_out = windows(held_tokens, args.eval_windows, block + 1, seed=HELD_OUT_SEED)
    baseline = unigram_loss(train_tokens, held_out[:, 1:])

    described = repr(model)  # before sharding: fsdp leaves each rank its rows only
    runner = DistributedDataParallel(model) if args.parallel == "ddp" else model
    data_rank, data_world = rank, world  # the ranks that see different windows
    if args.parallel == "fsdp":  # each block a unit, then the root; the model is sharded in place
        runner = FullyShardedDataParallel(model)
    loss_fn = nn.CrossEntropyLoss()
    if args.parallel in ("tp", "fsdp-tp"):
        runner, data, split_loss = tensor_parallel(model, args, world)
        data_rank, data_world = data.get_local_rank(), data.size()
        loss_fn = split_loss or loss_fn
    opt = make_optimizer(model, args)
    sampler = DistributedSampler(train_set, data_world, data_rank, shuffle=True, seed=args.seed)
    steps_per_epoch = len(sampler) // args.batch_size
    scheduler = nn.LambdaLR(
        opt, warmup_then_cosine(args.warmup_steps, args.epochs * steps_per_epoch)
    )
    ckpt = None
    if args.checkpoint_dir:
        ckpt = checkpoint.CheckpointManager(args.checkpoint_dir, keep_last=2)
    restarts = int(os.environ.get("PLURIBUS_RESTART_COUNT", "0"))
    start_epoch = 0
    if args.resume or restarts > 0:
        start_epoch = restore_checkpoint(ckpt, runner, opt, scheduler)
    if rank == 0:
        print(
            f"{described} on {world} rank(s), backend {pluribus.get_backend()}, parallel "
            f"{args.parallel}; {train_tokens.size:,} training and {held_tokens.size:,} held-out "
            f"characters of {sysconfig.get_paths()['stdlib']}; unigram baseline "
            f"{baseline:.3f} nats/char",
            flush=True,
        )
        if start_epoch:
            where = ckpt.path(start_epoch)
            print(f"resuming from {where} at epoch {start_epoch} (restart {restarts})", flush=True)

    history: dict = {"losses": [], "held_out": [], "tokens_per_s": []}
    tokens_per_step = data_world * args.batch_size * block
    stop = args.epochs if args.epochs_this_run is None else start_epoch + args.epochs_this_run
    for epoch in range(start_epoch, min(stop, args.epochs)):
        sampler.set_epoch(epoch)
        started, epoch_losses = time.perf_counter(), []
        for step, indices in enumerate(sampler.batches(args.batch_size, drop_last=True)):
            batch = xp.asarray(train_set[indices])
            logits = runner.forward(batch[:, :-1])
            flat = logits.reshape(-1, logits.shape[-1])
            loss = loss_fn.forward(flat, batch[:, 1:].reshape(-1))
            if epoch == start_epoch and step == 0 and rank == 0:
                report = nn.memory_report([model, loss_fn], opt)
                print(f"memory at the first step, before backward: {report}", flush=True)
            runner.backward(loss_fn.backward().reshape(logits.shape))
            opt.step()
            opt.zero_grad()
            scheduler.step()
            epoch_losses.append(float(loss))
        elapsed = time.perf_counter() - started
        mean_loss = np.array([np.mean(epoch_losses)], dtype=np.float64)
        pluribus.all_reduce(mean_loss, op=pluribus.ReduceOp.AVG)
        held = evaluate(model, held_out, args.batch_size, xp, data_rank, data_world, loss_fn)
        rate = steps_per_epoch * tokens_per_step / elapsed
        history["losses"] += epoch_losses
        history["held_out"].append(held)
        history["tokens_per_s"].append(rate)
        if rank == 0:
            print(
                f"epoch {epoch + 1}/{args.epochs}: loss {mean_loss[0]:.3f}, held-out {held:.3f} "
                f"(unigram {baseline:.3f}), {rate:,.0f} tokens/s, {elapsed:.1f}s",
                flush=True,
            )
        if ckpt is not None:  # every rank takes part
            ckpt.save(epoch + 1, checkpoint_state(runner, opt, scheduler, epoch + 1))
    if not history["held_out"]:  # nothing left to train: report the restored model
        history["held_out"].append(
            evaluate(model, held_out, args.batch_size, xp, data_rank, data_world, loss_fn)
        )
    sample = ""
    # under every --parallel but ddp every rank runs the forwards (they gather parameters or
    # activations); under ddp rank 0 alone samples
    if args.sample_chars and args.vocab_parallel:
        if rank == 0:
            print("--- no sample: the head gives each rank its part of the vocabulary ---")
    elif args.sample_chars and (rank == 0 or args.parallel != "ddp"):
        prompt = xp.asarray(encode("def ")[None, :].astype(np.int64))
        generated = model.generate(prompt, args.sample_chars, temperature=0.8, rng=args.seed)
        sample = decode(_host(generated[0])) if rank == 0 else ""
        if rank == 0:
            print(f"--- sample (temperature 0.8) ---\n{sample}\n---", flush=True)
    return {
        **history,
        "baseline": baseline,
        "start_epoch": start_epoch,
        "sample": sample,
        # the whole parameters on every rank, however they are spread
        "state": {
            k: _host(v) for k, v in get_model_state_dict(runner, full_state_dict=True).items()
        },
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pluribus.init_process_group(backend=args.backend)
    try:
        train(args)
    finally:
        pluribus.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

"""A language model's head and loss split by vocabulary, against the same head gathering its
logits, on gloo ranks: time per forward + backward and the logits each rank holds.

    python benchmarks/vocab_parallel.py                       # vocabulary 32768, 2 ranks
    python benchmarks/vocab_parallel.py --vocab 8192 --tokens 1024 --ranks 2,4

Three ways, each on the same head (``Linear(embd, vocab)``) and labels:
- ``one process``: the whole head and ``nn.CrossEntropyLoss`` on one rank (the reference);
- ``gathered``: ``ColwiseParallel(output_layouts=Replicate())``, each rank computes its part
  of the logits, all-gathers the whole ``(tokens, vocab)`` logits and runs the loss on them;
- ``vocab parallel``: ``ColwiseParallel(output_layouts=Shard(-1))`` and
  ``VocabParallelCrossEntropyLoss``, which never gathers the logits.
The ratio column is vocab parallel / gathered, the median over alternating rounds.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _setup(embd: int, vocab: int, tokens: int, how: str):
    import pluribus as pb
    from pluribus import nn
    from pluribus.dtensor import Replicate, Shard, init_device_mesh
    from pluribus.parallel import ColwiseParallel, VocabParallelCrossEntropyLoss, parallelize_module

    head = nn.Linear(embd, vocab, bias=False, rng=0)
    loss_fn = nn.CrossEntropyLoss()
    if how != "one process":
        mesh = init_device_mesh("cpu", (pb.get_world_size(),))
        split = how == "vocab parallel"
        out = Shard(-1) if split else Replicate()
        parallelize_module(head, mesh, ColwiseParallel(output_layouts=out))
        if split:
            loss_fn = VocabParallelCrossEntropyLoss(mesh)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(tokens, embd)).astype(np.float32)
    labels = rng.integers(0, vocab, tokens)
    held = {}

    def step():
        logits = head.forward(x)
        held["logits"] = logits.nbytes
        loss_fn.forward(logits, labels)
        head.backward(loss_fn.backward())
        head.zero_grad()

    return step, held


def _compare(embd: int, vocab: int, tokens: int, seconds: float):
    """Median seconds per step of gathered and vocab parallel (alternating rounds), the
    median per-round ratio, and the logits bytes each holds."""
    import pluribus as pb

    steps = {how: _setup(embd, vocab, tokens, how) for how in ("gathered", "vocab parallel")}
    for step, _ in steps.values():
        step()
    start = time.perf_counter()
    steps["gathered"][0]()
    once = time.perf_counter() - start
    rounds = pb.broadcast_object(max(5, min(200, int(seconds / (2 * once)))))
    times = {how: [] for how in steps}
    for n in range(rounds):
        for how in list(steps)[:: 1 if n % 2 else -1]:  # alternate which goes first
            pb.barrier()
            start = time.perf_counter()
            steps[how][0]()
            times[how].append(time.perf_counter() - start)
    ratio = float(np.median(np.array(times["vocab parallel"]) / np.array(times["gathered"])))
    return {how: (float(np.median(t)), steps[how][1]["logits"]) for how, t in times.items()} | {
        "ratio": ratio
    }


def _alone(embd: int, vocab: int, tokens: int, seconds: float):
    step, held = _setup(embd, vocab, tokens, "one process")
    step()
    samples, end = [], time.perf_counter() + seconds
    while len(samples) < 5 or time.perf_counter() < end:
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples)), held["logits"]


def main() -> None:
    from pluribus.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--ranks", default="2")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    shape = f"embd {args.embd}, vocab {args.vocab}, {args.tokens} tokens"
    t, nbytes = run_ranks(_alone, 1, backend="gloo", env=ENV, timeout=600,
                          args=(args.embd, args.vocab, args.tokens, args.seconds))[0]  # fmt: skip
    print(f"{shape}: one process {t * 1e3:.1f} ms per step, logits {nbytes / 2**20:.1f} MiB")
    for p in (int(s) for s in args.ranks.split(",")):
        out = run_ranks(_compare, p, backend="gloo", env=ENV, timeout=600,
                        args=(args.embd, args.vocab, args.tokens, args.seconds))[0]  # fmt: skip
        ratio = out.pop("ratio")
        parts = [
            f"{how} {t * 1e3:.1f} ms, logits {nbytes / 2**20:.1f} MiB"
            for how, (t, nbytes) in out.items()
        ]
        print(f"{shape}, {p} ranks: " + "; ".join(parts) + f"; ratio {ratio:.2f}")


if __name__ == "__main__":
    main()

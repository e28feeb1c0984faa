"""Step time of FULL_SHARD against DDP on the same GPT and ranks, and how much of the
all-gather time prefetch hides.

    python benchmarks/fsdp_step_time.py --preset 10M --nproc 2 --batch 4 --tokens 64

The ranks are processes (gloo, spawned by pluribus.testing.run_ranks) with one BLAS thread
each. Every rank builds four copies of the model; each round runs one step (forward, backward,
AdamW) of each, so a change in the machine's load hits them all alike:

* ``local``: the model alone, no communication (the compute floor with N ranks busy);
* ``ddp``: ``DistributedDataParallel`` (bucketed all-reduce overlapped with backward);
* ``fsdp``: ``fully_shard`` per block and on the root, FULL_SHARD, prefetch on;
* ``fsdp, no prefetch``: the same with every all-gather issued when its unit needs it.

A step's time is the slowest rank's. Hidden = 1 - (fsdp - local) / (no prefetch - local), the
part of the exposed communication prefetch removes, as DDP's overlap is measured
(benchmarks/ddp_overlap.py); the time ranks spend waiting in all-gathers is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
CONFIGS = ["local", "ddp", "fsdp", "fsdp, no prefetch"]


def measure(preset: str, batch: int, tokens: int, rounds: int, warmup: int) -> dict:
    import numpy as np
    import pluribus
    from pluribus import nn
    from pluribus.parallel import DistributedDataParallel, fully_shard

    def build(config):
        model = nn.GPT(nn.GPTConfig(**nn.PRESETS[preset]), rng=0)
        if config == "ddp":
            return model, DistributedDataParallel(model)
        if config.startswith("fsdp"):
            prefetch = config == "fsdp"
            for block in model.blocks:
                fully_shard(block, prefetch=prefetch)
            return model, fully_shard(model, prefetch=prefetch)
        return model, model

    runs = {}
    for config in CONFIGS:
        model, runner = build(config)
        runs[config] = (runner, nn.AdamW(model.parameters()))
    loss_fn = nn.CrossEntropyLoss()
    rng = np.random.default_rng(pluribus.get_rank())
    times = {c: [] for c in CONFIGS}
    waits = {c: [] for c in CONFIGS if c.startswith("fsdp")}
    for step in range(warmup + rounds):
        data = rng.integers(0, 128, (batch, tokens + 1))
        for k in range(len(CONFIGS)):  # a different configuration goes first each round
            config = CONFIGS[(step + k) % len(CONFIGS)]
            runner, opt = runs[config]
            waited = runner.gather_wait_seconds() if config in waits else 0.0
            pluribus.barrier()
            start = time.perf_counter()
            logits = runner.forward(data[:, :-1])
            loss_fn.forward(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
            runner.backward(loss_fn.backward().reshape(logits.shape))
            opt.step()
            opt.zero_grad()
            elapsed = np.array([time.perf_counter() - start])
            pluribus.all_reduce(elapsed, op=pluribus.ReduceOp.MAX)
            if step >= warmup:
                times[config].append(float(elapsed[0]))
                if config in waits:
                    waits[config].append(runner.gather_wait_seconds() - waited)
    return {
        "params": runs["local"][0].num_parameters(),
        "median_s": {c: statistics.median(t) for c, t in times.items()},
        "fastest_s": {c: min(t) for c, t in times.items()},
        "gather_wait_s": {c: statistics.median(w) for c, w in waits.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="10M")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.update({v: "1" for v in THREAD_VARS})
    from pluribus.testing import run_ranks

    result = run_ranks(
        measure, args.nproc, args.backend, mode="processes", timeout=1800,
        args=(args.preset, args.batch, args.tokens, args.rounds, args.warmup),
    )[0]  # fmt: skip
    med, fast, waits = result["median_s"], result["fastest_s"], result["gather_wait_s"]
    print(
        f"GPT {args.preset} ({result['params']:,} parameters), {args.nproc} ranks on "
        f"{args.backend}, batch {args.batch} x {args.tokens} tokens per rank, AdamW; ms per "
        f"step, median (fastest) of {args.rounds}:"
    )
    for config in CONFIGS:
        print(f"  {config:<18} {1e3 * med[config]:8.1f} ({1e3 * fast[config]:8.1f})")
    local, on, off = med["local"], med["fsdp"], med["fsdp, no prefetch"]
    hidden = 1 - (on - local) / (off - local) if off > local else float("nan")
    print(
        f"  fsdp / ddp: {on / med['ddp']:.2f} (median), {fast['fsdp'] / fast['ddp']:.2f} (fastest)"
    )
    print(f"  communication hidden by prefetch: {100 * hidden:.0f} %")
    print(
        f"  waiting in all-gathers per step: {1e3 * waits['fsdp']:.1f} ms with prefetch, "
        f"{1e3 * waits['fsdp, no prefetch']:.1f} ms without"
    )
    if args.json:
        print(json.dumps({"args": vars(args), **result}))


if __name__ == "__main__":
    main()

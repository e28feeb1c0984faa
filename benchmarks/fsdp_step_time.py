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

Then the collectives alone: ``--comm-rounds`` times, every unit of the ``fsdp`` model gathered
and freed one after the other (pack, all-gather, copy out), then every unit's gradients packed
and reduce-scattered one after the other, nothing overlapped: the bare cost of a step's
all-gathers (FULL_SHARD runs them twice per step) and reduce-scatters, slowest rank, median
and fastest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
CONFIGS = ["local", "ddp", "fsdp", "fsdp, no prefetch"]


def measure(
    preset: str, batch: int, tokens: int, rounds: int, warmup: int, comm_rounds: int, backend: str
) -> dict:
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
        "collectives_s": collectives_alone(*runs["fsdp"], comm_rounds, backend),
    }


def collectives_alone(runner, opt, rounds: int, backend: str) -> dict:
    """Seconds (slowest rank; median and fastest round) to gather every unit once, and to
    reduce-scatter every unit's gradients once, one unit after the other. On gloo each round
    is run twice, in alternating order: as it comes (zero-copy where the inputs are symmetric)
    and with gloo's zero-copy size out of reach (the copying path), so that the two are
    compared within the same seconds; ``*_copying_ratio`` is the median of the rounds' ratios
    (below 1: zero-copy is faster)."""
    import numpy as np
    import pluribus

    units = [u for u in runner.fsdp_units() if u.pieces]

    def timed(work) -> float:
        pluribus.barrier()
        start = time.perf_counter()
        work()
        elapsed = np.array([time.perf_counter() - start])
        pluribus.all_reduce(elapsed, op=pluribus.ReduceOp.MAX)
        return float(elapsed[0])

    def gather_all():
        for unit in units:
            unit.start_unshard()
            unit.finish_unshard()
            unit.reshard()

    def reduce_all():
        for unit in units:
            unit.start_reduction()
            unit.finish_reduction()

    def one_round() -> tuple[float, float]:
        gathered = timed(gather_all)
        for unit in units:  # full-size zero gradients, outside the timing
            unit.prepare_gradients()
        reduced = timed(reduce_all)
        opt.zero_grad()
        return gathered, reduced

    modes = ["as is"]
    if backend == "gloo":
        from pluribus_gloo import local

        threshold = local.ZERO_COPY_BYTES
        modes.append("copying")
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            if backend == "gloo":
                local.ZERO_COPY_BYTES = threshold if mode == "as is" else 1 << 62
            times[mode].append(one_round())
    if backend == "gloo":
        local.ZERO_COPY_BYTES = threshold
    out = {}
    for k, name in enumerate(["all_gather", "reduce_scatter"]):
        mine = [t[k] for t in times["as is"]]
        out[name] = statistics.median(mine)
        out[f"{name}_fastest"] = min(mine)
        if "copying" in times:
            copying = [t[k] for t in times["copying"]]
            out[f"{name}_copying"] = statistics.median(copying)
            out[f"{name}_copying_ratio"] = statistics.median(
                a / b for a, b in zip(mine, copying, strict=True)
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="10M")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--comm-rounds", type=int, default=8)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.update({v: "1" for v in THREAD_VARS})
    from pluribus.testing import run_ranks

    result = run_ranks(
        measure, args.nproc, args.backend, mode="processes", timeout=1800,
        args=(
            args.preset, args.batch, args.tokens, args.rounds, args.warmup, args.comm_rounds,
            args.backend,
        ),
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
    comm = result["collectives_s"]
    print(
        f"  fsdp collectives alone, every unit once, ms, median (fastest): all-gathers "
        f"{1e3 * comm['all_gather']:.1f} ({1e3 * comm['all_gather_fastest']:.1f}), "
        f"reduce-scatters {1e3 * comm['reduce_scatter']:.1f} "
        f"({1e3 * comm['reduce_scatter_fastest']:.1f})"
    )
    if "all_gather_copying" in comm:
        print(
            f"  the same with gloo's copying path, alternated: all-gathers "
            f"{1e3 * comm['all_gather_copying']:.1f} ms, reduce-scatters "
            f"{1e3 * comm['reduce_scatter_copying']:.1f} ms; as is / copying, median of the "
            f"rounds' ratios: all-gathers {comm['all_gather_copying_ratio']:.2f}, "
            f"reduce-scatters {comm['reduce_scatter_copying_ratio']:.2f}"
        )
    if args.json:
        print(json.dumps({"args": vars(args), **result}))


if __name__ == "__main__":
    main()

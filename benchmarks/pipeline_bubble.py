"""Pipeline schedules on the GPT over gloo processes: measured bubble against the simulator's
prediction from the measured per-action times, and the activation ledger of each schedule.

    python benchmarks/pipeline_bubble.py --ranks 2 4 --out benchmarks/results/pipeline-<stamp>

The schedules take turns, one step each, so that their k-th steps ran under the same load and
the bubbles of ZeroBubble (ZB-H1), ZBH2 (ZB-H2) and ZBV (ZB-V) are compared with 1F1B's, and
ZBH2's and ZBV's with ZeroBubble's, step by step. For each schedule: warm-up steps, then
``--steps`` measured steps; each step's events are gathered from every rank, its bubble
measured (the part of the step in which a rank computes nothing, averaged over ranks) and
simulated from that same step's action times, with one median message latency and with each
message's own; the idle part is split into receives, sends and the gaps between actions.
Writes ``results.json`` and one Perfetto file per schedule with the run and the prediction side
by side.

``--allocators default retain`` repeats everything in the same run with glibc's allocator as it
comes and with it keeping freed memory (``retain``: no ``mmap`` per large temporary), to see
whether page faults on numpy's temporaries make the forward and the input gradient costlier
against the weight gradient. ``--profile`` prints, in one process, the time of each layer
kind's forward, input gradient and weight gradient on the split model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _config(args):
    from pluribus import nn

    return nn.GPTConfig(
        vocab_size=128,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=4,
        n_embd=args.embd,
        tie_weights=False,
    )


#: Stages per rank of the schedules that take more than one (the model is cut into p v stages).
STAGES_PER_RANK = {"Interleaved1F1B": 2, "ZBV": 2}

#: glibc settings per ``--allocators`` choice: ``retain`` serves every temporary from memory
#: already faulted in instead of a fresh ``mmap`` (numpy frees its temporaries at once).
ALLOCATORS = {
    "default": {},
    "retain": {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**31)},
}


def _split_model(args, num_stages: int, rng):
    """The model cut into ``num_stages`` parts, its loss, and one batch of ``rows`` rows."""
    from pluribus import nn
    from pluribus.parallel import pipeline as pp

    if args.model == "gpt":
        model = nn.GPT(_config(args), rng=0)
        return model, pp.split_gpt(model, num_stages), nn.CrossEntropyLoss()
    # Linear layers only: forward, input gradient and weight gradient cost one matmul each
    c = args.embd
    layers = [nn.Sequential(nn.Linear(c, c, rng=rng), nn.ReLU()) for _ in range(args.layers)]
    model = nn.Sequential(*layers)
    return model, pp.split_sequential(model, num_stages), nn.MSELoss()


def profile_layers(args, num_stages: int, repeats: int = 10) -> dict:
    """Milliseconds per micro-batch of each stage's F, I and W, and of each layer kind's
    ``forward``, ``backward_input`` and ``backward_weight`` (summed over the model), run in
    this process one stage after another."""
    from collections import defaultdict

    rng = np.random.default_rng(0)
    model, parts, loss_fn = _split_model(args, num_stages, rng)
    if args.model == "gpt":
        x0 = rng.integers(0, 128, (args.microbatch, args.seq))
        target = rng.integers(0, 128, (args.microbatch * args.seq,))
    else:
        x0 = rng.normal(size=(args.microbatch, args.embd)).astype(np.float32)
        target = rng.normal(size=(args.microbatch, args.embd)).astype(np.float32)
    per_layer: dict = defaultdict(float)
    per_stage: dict = defaultdict(float)

    def timed(key, fn, table):
        def run(*a):
            start = time.perf_counter()
            out = fn(*a)
            table[key] += time.perf_counter() - start
            return out

        return run

    for part in parts:
        for _, leaf in part.named_modules():
            if not leaf._modules:
                for method in ("forward", "backward_input", "backward_weight"):
                    key = (type(leaf).__name__, method)
                    object.__setattr__(leaf, method, timed(key, getattr(leaf, method), per_layer))
    for i in range(repeats + 2):
        if i == 2:  # two warm-up iterations
            per_layer.clear()
            per_stage.clear()
        x = x0
        for s, part in enumerate(parts):
            x = timed((s, "F"), part.forward, per_stage)(x)
        logits = x.reshape(-1, x.shape[-1]) if args.model == "gpt" else x
        loss_fn.forward(logits, target)
        g = loss_fn.backward().reshape(x.shape)
        for s in reversed(range(num_stages)):
            g = timed((s, "I"), parts[s].backward_input, per_stage)(g)
        for s in reversed(range(num_stages)):
            timed((s, "W"), parts[s].backward_weight, per_stage)()
        model.zero_grad()
    ms = 1e3 / repeats
    return {
        "stages": {f"{s}{k}": round(t * ms, 2) for (s, k), t in sorted(per_stage.items())},
        "layers": {
            f"{kind}.{method}": round(t * ms, 2)
            for (kind, method), t in sorted(per_layer.items(), key=lambda kv: -kv[1])
        },
    }


def run_schedules(names: list[str], m: int, steps: int, warmup: int, args_dict: dict) -> dict:
    """On every rank: each schedule's step events and this rank's activation ledger. The
    schedules take turns step by step (each on its own copy of the model), so their k-th
    steps ran under the same load of a shared machine and can be compared pairwise."""
    import pluribus as dist
    from pluribus.parallel import pipeline as pp

    args = argparse.Namespace(**args_dict)
    p, rank = dist.get_world_size(), dist.get_rank()
    runs = {}
    for name in names:
        v = STAGES_PER_RANK.get(name, 1)
        rng = np.random.default_rng(0)
        model, parts, loss_fn = _split_model(args, p * v, rng)
        if args.model == "gpt":
            shape = (args.microbatch * m, args.seq)
            idx, tgt = rng.integers(0, 128, shape), rng.integers(0, 128, shape)
        else:
            c = args.embd
            idx = rng.normal(size=(args.microbatch * m, c)).astype(np.float32)
            tgt = rng.normal(size=(args.microbatch * m, c)).astype(np.float32)
        placed = pp.build(name, p, m, v).stages_of(rank)  # ZB-V's V: stages r and 2p - 1 - r
        stages = [pp.PipelineStage(parts[s], s, p * v) for s in placed]
        schedule = pp.SCHEDULE_CLASSES[name](stages, m, loss_fn)
        runs[name] = (model, stages, schedule, idx, tgt)
    out: dict[str, list] = {name: [] for name in names}
    for i in range(warmup + steps):
        for name, (model, stages, schedule, idx, tgt) in runs.items():
            for s in stages:
                s.reset_peak()
            dist.barrier()
            start = time.perf_counter()
            schedule.step(idx, target=tgt)
            wall = time.perf_counter() - start
            model.zero_grad()
            events = pp.gather_events(schedule)
            if i >= warmup:
                out[name].append(
                    {
                        "events": [(e.rank, str(e.action), e.start, e.end) for e in events],
                        "wall": wall,
                        "peak_bytes": sum(s.peak_activation_bytes for s in stages),
                        "peak_microbatches": max(s.peak_microbatches for s in stages),
                    }
                )
    return {name: {"steps": out[name]} for name in names}


def idle_breakdown(events) -> dict:
    """Where the non-compute part of a step went, as fractions of the step averaged over ranks:
    inside receives (waiting for a message, and reading it), inside sends, and between actions
    (the runtime's own bookkeeping, plus the start and end of the step on each rank)."""
    from pluribus.parallel.pipeline.schedules import RECV_B, RECV_F, SEND_B, SEND_F

    start, end = min(e.start for e in events), max(e.end for e in events)
    ranks = sorted({e.rank for e in events})
    parts = {"recv": 0.0, "send": 0.0, "between": 0.0}
    for r in ranks:
        mine = sorted((e for e in events if e.rank == r), key=lambda e: e.start)
        inside = sum(e.end - e.start for e in mine)
        parts["between"] += (end - start) - inside
        for e in mine:
            if e.action.kind in (RECV_F, RECV_B):
                parts["recv"] += e.end - e.start
            elif e.action.kind in (SEND_F, SEND_B):
                parts["send"] += e.end - e.start
    return {k: v / ((end - start) * len(ranks)) for k, v in parts.items()}


def analyse(
    name: str, p: int, m: int, result_per_rank: list, trace_dir: Path | None, label: str = ""
):
    from pluribus.parallel import pipeline as pp
    from pluribus.parallel.pipeline.simulator import Event

    v = STAGES_PER_RANK.get(name, 1)
    program = pp.build(name, p, m, v)
    rows = []
    for k, step in enumerate(result_per_rank[0]["steps"]):
        events = [Event(r, pp.Action.parse(a), s, e) for r, a, s, e in step["events"]]
        run = pp.measured(events)
        latency = pp.message_latency(events, program)
        predicted = pp.simulate(program, pp.action_costs(events, per_action=True), latency)
        each_latency = pp.message_latency(events, program, per_message=True)
        per_message = pp.simulate(program, pp.action_costs(events, per_action=True), each_latency)
        from_means = pp.simulate(program, pp.action_costs(events), latency)
        cost = pp.action_costs(events)
        kinds = {(e.action.stage, e.action.kind): e.action for e in events if e.action.is_compute}
        rows.append(
            {
                "costs_ms": {f"{s}{k}": round(cost(0, a) * 1e3, 2) for (s, k), a in kinds.items()},
                "step_s": run.step_time,
                "message_latency_s": latency,
                "measured_bubble": run.bubble,
                "predicted_bubble": predicted.bubble,
                "predicted_step_s": predicted.step_time,
                "predicted_bubble_mean_costs": from_means.bubble,
                "predicted_bubble_per_message": per_message.bubble,
                "idle": idle_breakdown(events),
                "peak_bytes": [r["steps"][k]["peak_bytes"] for r in result_per_rank],
                "peak_microbatches": [r["steps"][k]["peak_microbatches"] for r in result_per_rank],
            }
        )
        if trace_dir is not None and k == len(result_per_rank[0]["steps"]) - 1:
            pp.write_trace(
                trace_dir / f"pipeline-{name}-p{p}-m{m}{label}.json",
                {"measured": events, "predicted": predicted.events},
            )
    best = min(rows, key=lambda r: r["step_s"])  # the least disturbed step on a shared machine
    return {
        "schedule": name,
        "p": p,
        "v": v,
        "m": m,
        "steps": rows,
        "median_measured_bubble": statistics.median(r["measured_bubble"] for r in rows),
        "median_predicted_bubble": statistics.median(r["predicted_bubble"] for r in rows),
        # per step |measured - predicted| / predicted, then the median over steps
        "median_relative_difference": statistics.median(
            abs(r["measured_bubble"] - r["predicted_bubble"]) / r["predicted_bubble"] for r in rows
        ),
        "median_relative_difference_per_message": statistics.median(
            abs(r["measured_bubble"] - r["predicted_bubble_per_message"])
            / r["predicted_bubble_per_message"]
            for r in rows
        ),
        "median_predicted_bubble_mean_costs": statistics.median(
            r["predicted_bubble_mean_costs"] for r in rows
        ),
        "best_step": best,
        "median_idle": {k: statistics.median(r["idle"][k] for r in rows) for k in rows[0]["idle"]},
    }


#: Measured bubbles compared step by step: (numerator, denominator).
BUBBLE_RATIOS = [
    ("ZeroBubble", "1F1B"),
    ("ZBH2", "1F1B"),
    ("ZBV", "1F1B"),
    ("ZBH2", "ZeroBubble"),
    ("ZBV", "ZeroBubble"),
]
#: Schedules whose activation ledger is measured at each ``--memory-m``.
MEMORY_SCHEDULES = ["GPipe", "1F1B", "ZeroBubble", "ZBH2", "ZBV"]


def pairs_of(rows: dict, top: str, bottom: str):
    return zip(rows[top]["steps"], rows[bottom]["steps"], strict=True)


def _profile_on_rank(num_stages: int, args_dict: dict) -> dict:
    return profile_layers(argparse.Namespace(**args_dict), num_stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=["GPipe", "1F1B", "Interleaved1F1B", "ZeroBubble", "ZBH2", "ZBV"],
    )
    parser.add_argument("--m", type=int, default=0, help="micro-batches (default 2p)")
    parser.add_argument("--memory-m", type=int, nargs="*", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--model", choices=["gpt", "mlp"], default="gpt")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatch", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--allocators", nargs="+", choices=list(ALLOCATORS), default=["default"])
    parser.add_argument("--profile", action="store_true", help="per-layer F, I, W times first")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from pluribus.testing import RankPool

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "profile": [],
        "bubble": [],
        "bubble_ratios": [],
        "memory": [],
    }
    for allocator in args.allocators:
        env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **ALLOCATORS[allocator]}
        if args.profile:
            with RankPool(1, "gloo", mode="processes", timeout=600, env=env) as pool:
                for p in args.ranks:
                    (times,) = pool.run(_profile_on_rank, p, vars(args))
                    report["profile"].append({"allocator": allocator, "p": p, **times})
                    print(f"[{allocator}] p={p} ms per micro-batch: {times}", flush=True)
        for p in args.ranks:
            with RankPool(p, "gloo", mode="processes", timeout=600, env=env) as pool:
                m = args.m or 2 * p
                per_rank = pool.run(
                    run_schedules, args.schedules, m, args.steps, args.warmup, vars(args)
                )
                rows = {}
                for name in args.schedules:
                    result = [r[name] for r in per_rank]
                    label = "" if allocator == "default" else f"-{allocator}"
                    row = {"allocator": allocator, **analyse(name, p, m, result, args.out, label)}
                    rows[name] = row
                    report["bubble"].append(row)
                    print(
                        f"[{allocator}] p={p} m={m} {name:16s} step "
                        f"{row['best_step']['step_s'] * 1e3:7.1f} ms  bubble measured "
                        f"{row['median_measured_bubble']:.3f} predicted "
                        f"{row['median_predicted_bubble']:.3f} (each message's latency: off by "
                        f"{row['median_relative_difference_per_message']:.0%}; from mean costs "
                        f"{row['median_predicted_bubble_mean_costs']:.3f}) idle in recv/send/"
                        f"between {[round(v, 3) for v in row['median_idle'].values()]}  costs (ms) "
                        f"{row['best_step']['costs_ms']}",
                        flush=True,
                    )
                for top, bottom in BUBBLE_RATIOS:
                    if top not in rows or bottom not in rows:
                        continue
                    ratios = [
                        z["measured_bubble"] / o["measured_bubble"]
                        for z, o in pairs_of(rows, top, bottom)
                    ]
                    steps = [z["step_s"] / o["step_s"] for z, o in pairs_of(rows, top, bottom)]
                    report["bubble_ratios"].append(
                        {
                            "allocator": allocator,
                            "p": p,
                            "m": m,
                            "ratio": f"{top}/{bottom}",
                            "per_step": ratios,
                            "step_time_per_step": steps,
                        }
                    )
                    print(
                        f"[{allocator}] p={p} m={m} {top} / {bottom} measured bubble, step by "
                        f"step: median {statistics.median(ratios):.2f}, "
                        f"{[round(x, 2) for x in ratios]}; step time median "
                        f"{statistics.median(steps):.2f}",
                        flush=True,
                    )
                memory_schedules = [n for n in MEMORY_SCHEDULES if n in args.schedules]
                for name in memory_schedules if args.memory_m else ():
                    for mm in args.memory_m:
                        result = pool.run(run_schedules, [name], mm, 1, 1, vars(args))
                        peaks = [r[name]["steps"][0]["peak_bytes"] for r in result]
                        counts = [r[name]["steps"][0]["peak_microbatches"] for r in result]
                        report["memory"].append(
                            {
                                "allocator": allocator,
                                "schedule": name,
                                "p": p,
                                "m": mm,
                                "peak_bytes": peaks,
                                "peak_mb": counts,
                            }
                        )
                        print(
                            f"[{allocator}] p={p} m={mm:2d} {name:10s} peak activations per "
                            f"rank {[round(b / 2**20, 2) for b in peaks]} MiB, micro-batches "
                            f"{counts}",
                            flush=True,
                        )
    if args.out:
        (args.out / "results.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

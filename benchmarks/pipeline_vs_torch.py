"""Pipeline step time of pluribus against torch.distributed.pipelining, same model, same run.

    python benchmarks/pipeline_vs_torch.py --ranks 2 4 --out benchmarks/results/pp-torch-<stamp>

The model is a stack of ``--layers`` blocks of ``Linear(c, c)`` and ``ReLU`` (float32, MSE
loss), cut into ``p`` equal stages (``2p`` for ZBV, in its V), with the same weights in both
libraries. Each rank is one process of a gloo pool: pluribus's pipeline runs on pluribus's gloo
backend, torch's on ``torch.distributed``'s gloo (its own port), both on CPU with one BLAS thread
per process. The two take turns step by step, so that their k-th steps ran under the same load;
the ratio reported is pluribus's step time over torch's, per step, then the median.

The bubble is estimated the same way for both: one minus the time this rank needs for its
stage(s) on ``m`` micro-batches alone (forward and backward, no messages, the least of three
runs in the same process after the steps, one rank at a time), over the median step time,
averaged over ranks. With more ranks than cores a step also waits for a core, which this
estimate counts as bubble.
pluribus's bubble measured from its own per-action timeline is reported next to it. The first
step's losses of the two are compared (same weights, same batch: they must agree to float32
rounding). Without torch the script says so and exits 0.
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

#: torch.distributed.pipelining's class for each schedule compared.
TORCH_SCHEDULES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "ZBV": "ScheduleZBVZeroBubble",
}
STAGES_PER_RANK = {"ZBV": 2}


def _weights(layers: int, width: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(weight, bias) of each Linear, shaped (out, in) as in both libraries."""
    rng = np.random.default_rng(0)
    bound = 1 / np.sqrt(width)
    return [
        (
            rng.uniform(-bound, bound, (width, width)).astype(np.float32),
            rng.uniform(-bound, bound, width).astype(np.float32),
        )
        for _ in range(layers)
    ]


def _ours(weights, first: int, count: int):
    from pluribus import nn

    blocks = []
    for w, b in weights[first : first + count]:
        linear = nn.Linear(w.shape[1], w.shape[0], dtype=np.float32)
        linear.weight.data[...] = w
        linear.bias.data[...] = b
        blocks += [linear, nn.ReLU()]
    return nn.Sequential(*blocks)


def _theirs(weights, first: int, count: int):
    import torch

    blocks = []
    for w, b in weights[first : first + count]:
        linear = torch.nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w))
            linear.bias.copy_(torch.from_numpy(b))
        blocks += [linear, torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks)


def _compute_alone_ours(stages, m: int, rows: int, width: int) -> float:
    """Seconds for this rank's stages to run m micro-batches forward and backward, no messages."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(rows, width)).astype(np.float32)
    start = time.perf_counter()
    for s in stages:
        for mb in range(m):
            s.forward(mb, x)
        for mb in range(m):
            s.backward(mb, x)
    elapsed = time.perf_counter() - start
    for s in stages:
        s.module.zero_grad()
    return elapsed


def _compute_alone_theirs(modules, m: int, rows: int, width: int) -> float:
    import torch

    x = torch.randn(rows, width, requires_grad=True)
    start = time.perf_counter()
    for module in modules:
        outs = [module(x) for _ in range(m)]
        for out in outs:
            out.backward(torch.ones_like(out))
    elapsed = time.perf_counter() - start
    for module in modules:
        module.zero_grad()
    return elapsed


def compare_on_rank(
    names: list[str], m: int, steps: int, warmup: int, args_dict: dict, torch_port: int
) -> dict:
    """On every rank: both libraries' step times for each schedule, steps interleaved."""
    import pluribus as dist
    import torch
    import torch.distributed as tdist
    import torch.distributed.pipelining as tpp
    from pluribus import nn
    from pluribus.parallel import pipeline as pp

    args = argparse.Namespace(**args_dict)
    torch.set_num_threads(1)
    p, rank = dist.get_world_size(), dist.get_rank()
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=p
    )
    weights = _weights(args.layers, args.width)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(args.microbatch * m, args.width)).astype(np.float32)
    y = rng.normal(size=(args.microbatch * m, args.width)).astype(np.float32)
    out: dict = {}
    try:
        for name in names:
            v = STAGES_PER_RANK.get(name, 1)
            n = p * v
            per = args.layers // n
            program = pp.build(name, p, m, v)
            mine = program.stages_of(rank)
            first, last = 0 in mine, n - 1 in mine
            stages = [pp.PipelineStage(_ours(weights, s * per, per), s, n) for s in mine]
            ours = pp.SCHEDULE_CLASSES[name](stages, m, nn.MSELoss())
            modules = [_theirs(weights, s * per, per) for s in mine]
            their_stages = [
                tpp.PipelineStage(mod, s, n, torch.device("cpu"))
                for mod, s in zip(modules, mine, strict=True)
            ]
            cls = getattr(tpp, TORCH_SCHEDULES[name])
            theirs = cls(their_stages if v > 1 else their_stages[0], m, loss_fn=torch.nn.MSELoss())
            tx, ty = torch.from_numpy(x), torch.from_numpy(y)
            row: dict = {"ours_s": [], "torch_s": [], "ours_bubble": []}

            for i in range(warmup + steps):
                our_losses: list = []
                their_losses: list = []
                dist.barrier()
                start = time.perf_counter()
                ours.step(x if first else None, target=y if last else None, losses=our_losses)
                for s in stages:
                    s.module.zero_grad()
                ours_s = time.perf_counter() - start
                events = pp.gather_events(ours)
                tdist.barrier()
                start = time.perf_counter()
                if last:
                    theirs.step(*((tx,) if first else ()), target=ty, losses=their_losses)
                else:
                    theirs.step(*((tx,) if first else ()))
                for mod in modules:
                    mod.zero_grad()
                torch_s = time.perf_counter() - start
                if i == 0 and last:
                    row["loss_ours"] = float(np.mean([float(v) for v in our_losses]))
                    row["loss_torch"] = float(np.mean([v.item() for v in their_losses]))
                if i >= warmup:
                    row["ours_s"].append(ours_s)
                    row["torch_s"].append(torch_s)
                    row["ours_bubble"].append(pp.measured(events).bubble)
            # one rank at a time (more ranks than cores would slow each other down), the least
            # disturbed of three runs: the compute a step cannot do without
            for turn in range(p):
                dist.barrier()
                if turn == rank:
                    row["alone_ours_s"] = min(
                        _compute_alone_ours(stages, m, args.microbatch, args.width)
                        for _ in range(3)
                    )
                    row["alone_torch_s"] = min(
                        _compute_alone_theirs(modules, m, args.microbatch, args.width)
                        for _ in range(3)
                    )
            out[name] = row
    finally:
        tdist.destroy_process_group()
    return out


def summarise(name: str, p: int, m: int, per_rank: list[dict]) -> dict:
    rows = [r[name] for r in per_rank]
    ours = [max(r["ours_s"][k] for r in rows) for k in range(len(rows[0]["ours_s"]))]
    theirs = [max(r["torch_s"][k] for r in rows) for k in range(len(rows[0]["torch_s"]))]
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    best_ours, best_theirs = min(ours), min(theirs)
    median_ours, median_theirs = statistics.median(ours), statistics.median(theirs)
    last = next(r for r in rows if "loss_ours" in r)

    def bubble(alone_key, step):
        return statistics.mean(1 - r[alone_key] / step for r in rows)

    return {
        "schedule": name,
        "p": p,
        "m": m,
        "ours_step_ms_median": statistics.median(ours) * 1e3,
        "torch_step_ms_median": statistics.median(theirs) * 1e3,
        "ours_step_ms_best": best_ours * 1e3,
        "torch_step_ms_best": best_theirs * 1e3,
        "ratio_per_step": ratios,
        "ratio_median": statistics.median(ratios),
        "ours_bubble_estimated": bubble("alone_ours_s", median_ours),
        "torch_bubble_estimated": bubble("alone_torch_s", median_theirs),
        "ours_bubble_measured": statistics.median(rows[0]["ours_bubble"]),
        "compute_alone_ms": {
            "ours": [round(r["alone_ours_s"] * 1e3, 2) for r in rows],
            "torch": [round(r["alone_torch_s"] * 1e3, 2) for r in rows],
        },
        "first_step_loss": {"ours": last["loss_ours"], "torch": last["loss_torch"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schedules", nargs="+", default=list(TORCH_SCHEDULES))
    parser.add_argument("--m", type=int, default=0, help="micro-batches (default 2p)")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--microbatch", type=int, default=64, help="rows per micro-batch")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    try:
        import torch
        import torch.distributed.pipelining  # noqa: F401
    except ImportError as exc:
        print(f"torch is not installed ({exc}); nothing to compare against, skipping")
        return
    from pluribus.bench.launch import free_port
    from pluribus.testing import RankPool

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__}
    report["load_before"] = os.getloadavg()
    results = []
    for p in args.ranks:
        m = args.m or 2 * p
        with RankPool(p, "gloo", mode="processes", timeout=600, env=env) as pool:
            per_rank = pool.run(
                compare_on_rank, args.schedules, m, args.steps, args.warmup, vars(args), free_port()
            )
        for name in args.schedules:
            row = summarise(name, p, m, per_rank)
            results.append(row)
            print(
                f"p={p} m={m} {name:5s} step ms pluribus {row['ours_step_ms_median']:7.1f} "
                f"torch {row['torch_step_ms_median']:7.1f} ratio (median of per-step) "
                f"{row['ratio_median']:.2f} {[round(r, 2) for r in row['ratio_per_step']]}  "
                f"bubble est. pluribus {row['ours_bubble_estimated']:.2f} torch "
                f"{row['torch_bubble_estimated']:.2f} (pluribus measured "
                f"{row['ours_bubble_measured']:.2f})  compute alone ms {row['compute_alone_ms']}"
                f"  first loss {row['first_step_loss']}",
                flush=True,
            )
    report["results"] = results
    report["load_after"] = os.getloadavg()
    print(f"load before {report['load_before']}, after {report['load_after']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

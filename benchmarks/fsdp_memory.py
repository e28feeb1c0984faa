"""Memory per rank of FSDP's strategies against DDP on a GPT preset with AdamW.

    python benchmarks/fsdp_memory.py --preset 10M --nproc 2 4
    python benchmarks/fsdp_memory.py --preset 100M --nproc 2 4 --tokens 16

Each configuration runs in fresh rank processes (gloo, spawned by pluribus.testing.run_ranks)
so that each process's peak resident size is its own. Every rank builds the model, wraps it
(``DistributedDataParallel``, or ``fully_shard`` on every block and then the root), and takes
two AdamW steps on ``--tokens`` tokens per rank (memory for parameters, gradients and
optimizer state does not depend on the batch; a short one keeps a 100 M model quick on a CPU).

Reported per rank (rank 0; every rank is alike up to uneven shards):

* ``steady``: parameters + gradients + optimizer state between steps (the ZeRO formulas'
  quantity): FSDP's ledger, and ``nn.memory_report`` for DDP (which counts its buckets);
* ``peak``: the ledger's peak of the same plus gathered and packed buffers (FSDP only);
* ``rss``: the process's peak resident size. It includes the interpreter, numpy, and the whole
  model every rank builds before sharding it (no meta-device initialisation here).
"""

from __future__ import annotations

import argparse
import json
import os

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
STRATEGIES = ["ddp", "no_shard", "shard_optimizer_state", "shard_grad_op", "full_shard"]


def measure(preset: str, strategy: str, tokens: int) -> dict:
    import numpy as np
    import pluribus
    from pluribus import nn
    from pluribus.parallel import DistributedDataParallel, fully_shard

    model = nn.GPT(nn.GPTConfig(**nn.PRESETS[preset]), rng=0)
    psi = model.num_parameters()
    if strategy == "ddp":
        runner = DistributedDataParallel(model)
    else:
        for block in model.blocks:
            fully_shard(block, strategy=strategy)
        runner = fully_shard(model, strategy=strategy)
    opt = nn.AdamW(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    rng = np.random.default_rng(pluribus.get_rank())
    for _ in range(2):
        if strategy != "ddp":
            runner.reset_peak_memory()
        batch = rng.integers(0, model.config.vocab_size, (1, tokens + 1))
        logits = runner.forward(batch[:, :-1])
        loss_fn.forward(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        runner.backward(loss_fn.backward().reshape(logits.shape))
        opt.step()
        if strategy == "ddp":
            counted = nn.memory_report(model, opt, include_peak_rss=False)
            steady = counted.parameters + counted.gradients + counted.optimizer_state
            peak = None
        else:
            report = runner.memory_ledger(opt)
            steady, peak = report.steady, report.peak_total
        opt.zero_grad()
    model.release_saved()
    return {"psi": psi, "steady": steady, "peak": peak, "rss": nn.peak_rss_bytes()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="10M")
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.update({v: "1" for v in THREAD_VARS})
    from pluribus.testing import run_ranks

    rows = []
    for n in args.nproc:
        for strategy in args.strategies:
            result = run_ranks(
                measure, n, args.backend, mode="processes", timeout=1800,
                args=(args.preset, strategy, args.tokens),
            )[0]  # fmt: skip
            rows.append({"n": n, "strategy": strategy, **result})
            print(json.dumps(rows[-1]) if args.json else _line(rows[-1], rows), flush=True)


def _line(row: dict, rows: list[dict]) -> str:
    mib = 2**20
    ddp = next((r for r in rows if r["n"] == row["n"] and r["strategy"] == "ddp"), None)
    ratio = f"{row['steady'] / ddp['steady']:.3f}x DDP" if ddp else ""
    peak = f"{row['peak'] / mib:8.1f}" if row["peak"] is not None else "       -"
    return (
        f"N={row['n']} {row['strategy']:<22} psi={row['psi']:,} steady "
        f"{row['steady'] / mib:8.1f} MiB ({row['steady'] / row['psi']:5.2f} B/param, {ratio}) "
        f"peak {peak} MiB  rss {row['rss'] / mib:8.1f} MiB"
    )


if __name__ == "__main__":
    main()

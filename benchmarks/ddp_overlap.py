"""How much of DDP's gradient all-reduce hides behind backward, and how well 2 ranks scale.

    python benchmarks/ddp_overlap.py --backend gloo --nproc 2

Spawns the ranks itself (pluribus.testing.run_ranks, processes), each limited to
``--threads-per-rank`` BLAS threads so one rank and N ranks get the same compute per rank.
Per configuration it reports the median step time (forward + backward + SGD step) of:

* ``local``: every rank trains its replica with no communication at all (the compute floor),
* ``allreduce``: the bucketed all-reduce of every gradient alone,
* ``ddp, overlap off``: buckets reduced after backward finishes,
* ``ddp, overlap on``: each bucket reduced as soon as backward has filled it,
* ``single rank``: rank 0 alone while the others wait, same per-rank batch (the scaling
  baseline).

Hidden share = 1 - (on - local) / (off - local): the part of the exposed communication that
overlap removes. Scaling efficiency = single / on (same per-rank batch, so ideal is 1.0).
``--offloaded-ms`` swaps each hidden layer's arithmetic for a wait, as if it ran on a GPU, to
show the overlap when the CPU is free for communication. Results: BENCHMARKS.md (DDP section).

Under a launcher (``mpiexec -n 2 python benchmarks/ddp_overlap.py --backend mpi``; set
OMP_NUM_THREADS yourself) every process is one rank. The single-rank time is rank 0 stepping
alone while the others wait (a backend that busy-polls while waiting, as MPICH does, takes a
core from it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def build(width: int, depth: int, seed: int = 0, offloaded_ms: float = 0.0):
    from pluribus import nn

    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(depth):
        if offloaded_ms:
            layers += [OffloadedLinear(width, rng, offloaded_ms)]
        else:
            layers += [nn.Linear(width, width, rng=rng), nn.ReLU()]
    layers.append(nn.Linear(width, 10, rng=rng))
    return nn.Sequential(*layers)


def _offloaded_linear_class():
    from pluribus import nn

    class OffloadedLinear(nn.Linear):
        """A Linear whose arithmetic runs "elsewhere": the host only waits (``ms`` for forward,
        twice that for backward), as it does for a GPU kernel. Gradients have the real sizes,
        so the communication is real; the CPU stays free for it, as with an accelerator."""

        def __init__(self, width: int, rng, ms: float):
            super().__init__(width, width, rng=rng)
            self.seconds = ms / 1e3
            self._weight_grad = np.full((width, width), 1e-3, dtype=np.float32)
            self._bias_grad = np.full(width, 1e-3, dtype=np.float32)

        def forward(self, x):
            time.sleep(self.seconds)
            return x

        def backward(self, grad_output):
            time.sleep(2 * self.seconds)
            self.bias.accumulate_grad(self._bias_grad)
            self.weight.accumulate_grad(self._weight_grad)
            return grad_output

    return OffloadedLinear


def OffloadedLinear(width: int, rng, ms: float):  # noqa: N802 - a class made on first use
    return _offloaded_linear_class()(width, rng, ms)


def measure(cfg: dict) -> dict:
    """Runs on every rank. The configurations take turns, one step each per round, so that a
    change in the machine's load hits them all alike; returns median seconds per step."""
    import pluribus
    from pluribus import nn
    from pluribus.parallel import DistributedDataParallel
    from pluribus.parallel.comm_hooks import allreduce_hook

    rank = pluribus.get_rank()
    model = build(cfg["width"], cfg["depth"], offloaded_ms=cfg["offloaded_ms"])
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((cfg["batch"], cfg["width"])).astype(np.float32)
    y = rng.integers(0, 10, cfg["batch"])
    loss_fn = nn.CrossEntropyLoss()
    opt = nn.SGD(model.parameters(), lr=1e-4)
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg["bucket_mb"])

    def local_step():
        loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()

    def single_step():  # rank 0 alone; the others wait in the barrier that follows
        if rank == 0:
            local_step()

    def allreduce_only():
        works = [allreduce_hook(None, bucket) for bucket in ddp.buckets]
        for work in works:
            work.wait()

    def ddp_step(overlap):
        ddp.overlap = overlap
        loss_fn.forward(ddp.forward(x), y)
        ddp.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()

    configs = {
        "single": single_step,
        "local": local_step,
        "allreduce": allreduce_only,
        "overlap_off": lambda: ddp_step(False),
        "overlap_on": lambda: ddp_step(True),
    }
    times = {name: [] for name in configs}
    for round_ in range(cfg["warmup"] + cfg["steps"]):
        for name, step in configs.items():
            pluribus.barrier()
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
            if round_ >= cfg["warmup"]:
                times[name].append(elapsed)
    # a step is over when its slowest rank is done (the single-rank step is rank 0's alone)
    table = np.array([times[name] for name in configs])
    pluribus.all_reduce(table, op=pluribus.ReduceOp.MAX)
    result = {name: float(statistics.median(row)) for name, row in zip(configs, table, strict=True)}
    result["best"] = {name: float(row.min()) for name, row in zip(configs, table, strict=True)}
    result["params"] = sum(p.data.size for p in model.parameters())
    result["buckets"] = len(ddp.buckets)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6, help="hidden layers of width x width")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--bucket-mb", type=float, default=25)
    parser.add_argument("--steps", type=int, default=9, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--threads-per-rank", type=int, default=max(1, (os.cpu_count() or 2) // 2 // 2)
    )
    parser.add_argument(
        "--offloaded-ms",
        type=float,
        default=0.0,
        help="replace each hidden layer's arithmetic by a wait of this many ms (forward; twice "
        "that in backward), as if it ran on an accelerator: the CPU stays free for communication",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args()

    cfg = vars(args)
    launched = any(v in os.environ for v in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"))
    if launched:  # started by pluribus-run or mpiexec: this process is one rank
        import pluribus

        if "RANK" not in os.environ and args.backend == "mpi":
            from pluribus_mpi import setup_env  # RANK/WORLD_SIZE from MPI for older cores

            setup_env()
        pluribus.init_process_group(args.backend)
        args.nproc = pluribus.get_world_size()
        multi = measure(cfg)
        is_reporter = pluribus.get_rank() == 0
        pluribus.destroy_process_group()
        if not is_reporter:
            return
    else:
        from pluribus.testing import run_ranks

        # set in this process so that the spawned ranks have it before numpy loads OpenBLAS:
        # more BLAS threads than cores, summed over the ranks, makes OpenBLAS spin against itself
        os.environ.update({v: str(args.threads_per_rank) for v in THREAD_VARS})
        multi = run_ranks(
            measure, args.nproc, args.backend, mode="processes", args=(cfg,), timeout=600
        )[0]
    report(args, multi)


def report(args: argparse.Namespace, multi: dict) -> None:
    single, local, comm = multi["single"], multi["local"], multi["allreduce"]
    off, on = multi["overlap_off"], multi["overlap_on"]
    figures = {
        "backend": args.backend,
        "ranks": args.nproc,
        "params": multi["params"],
        "grad_mib": multi["params"] * 4 / 2**20,
        "buckets": multi["buckets"],
        "batch_per_rank": args.batch,
        "threads_per_rank": args.threads_per_rank,
        "median_s": {
            k: multi[k] for k in ("single", "local", "allreduce", "overlap_off", "overlap_on")
        },
        "fastest_s": multi["best"],
        # the part of the exposed communication that overlap removes
        "hidden_share": 1 - (on - local) / (off - local) if off > local else float("nan"),
        # the part of the all-reduce (timed alone) that does not show in the step
        "hidden_share_of_allreduce": 1 - max(on - local, 0.0) / comm,
        "scaling_efficiency": single / on,
    }
    offloaded = f" (arithmetic offloaded: {args.offloaded_ms:g} ms per layer)"
    print(
        f"model: {args.depth} x Linear({args.width}, {args.width}) + head = "
        f"{figures['params'] / 1e6:.1f} M parameters ({figures['grad_mib']:.0f} MiB of fp32 "
        f"gradients, {figures['buckets']} buckets of <= {args.bucket_mb:g} MiB)"
        + (offloaded if args.offloaded_ms else "")
    )
    print(
        f"{args.nproc} ranks on {args.backend}, batch {args.batch} per rank, "
        f"{args.threads_per_rank} BLAS threads per rank; step times, median (fastest):"
    )
    for label, name in (
        ("single rank, no DDP", "single"),
        (f"{args.nproc} ranks, no communication", "local"),
        ("bucketed all-reduce alone", "allreduce"),
        ("DDP, overlap off", "overlap_off"),
        ("DDP, overlap on", "overlap_on"),
    ):
        print(f"  {label:34s} {multi[name] * 1e3:8.1f} ms ({multi['best'][name] * 1e3:.1f})")
    print(f"  exposed communication hidden         {figures['hidden_share']:7.0%}")
    print(f"  all-reduce time hidden               {figures['hidden_share_of_allreduce']:7.0%}")
    print(f"  scaling efficiency (single / on)     {figures['scaling_efficiency']:7.0%}")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()

"""Quick timing of the gloo backend on one host, optionally beside raw mpi4py (MPICH) in the
same run, so that both see the same machine load.

    python benchmarks/gloo_quick.py                      # all_reduce, 2 ranks, shared memory
    python benchmarks/gloo_quick.py --shm 0 --mpi        # over loopback TCP, and MPICH beside it
    python benchmarks/gloo_quick.py --mpi --torch        # MPICH and torch.distributed gloo too
    python benchmarks/gloo_quick.py --ops all_reduce,all_gather,reduce_scatter,broadcast

Prints one line per size: bytes, time per call (median of batches, in microseconds) and busbw in
GB/s (nccl-tests factors); with --mpi / --torch the same for MPICH / torch.distributed gloo and
the speed ratio (their time / ours: above 1 means gloo is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

SIZES = [4 << k for k in range(0, 25, 2)]  # 4 B .. 64 MiB


def bus_factor(op: str, p: int) -> float:
    if op == "all_reduce":
        return 2 * (p - 1) / p
    if op in ("all_gather", "reduce_scatter"):
        return (p - 1) / p
    return 1.0


def _time(fn, nbytes: int, barrier, agree) -> float:
    """Seconds per call: median of batches sized to about 50 ms each (rank 0's choice)."""
    for _ in range(3):
        fn()
    barrier()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    per_batch = agree(int(min(2000, max(2, 0.05 / once))))
    batches = []
    for _ in range(5):
        barrier()
        start = time.perf_counter()
        for _ in range(per_batch):
            fn()
        batches.append((time.perf_counter() - start) / per_batch)
    return float(np.median(batches))


def _gloo_job(ops: list[str], sizes: list[int]) -> dict:
    import pluribus as pb

    p, r = pb.get_world_size(), pb.get_rank()
    results = {}
    for op in ops:
        for nbytes in sizes:
            n = max(1, nbytes // 4)
            x = np.ones(n, dtype=np.float32)
            if op == "all_reduce":

                def fn(x=x):
                    pb.all_reduce(x)
            elif op == "broadcast":

                def fn(x=x):
                    pb.broadcast(x, 0)
            elif op == "all_gather":
                part = np.ones(max(1, n // p), dtype=np.float32)
                out = np.empty(part.size * p, dtype=np.float32)

                def fn(out=out, part=part):
                    pb.all_gather(out, part)
            elif op == "reduce_scatter":
                out = np.empty(max(1, n // p), dtype=np.float32)
                full = np.ones(out.size * p, dtype=np.float32)

                def fn(out=out, full=full):
                    pb.reduce_scatter(out, full)
            else:
                raise ValueError(op)
            seconds = _time(fn, nbytes, pb.barrier, lambda v: pb.broadcast_object(v, 0))
            times = np.zeros(p)
            pb.all_gather(times, np.array([seconds]))
            results[f"{op}/{nbytes}"] = float(times.max())
            if op == "all_reduce":
                check = np.full(16, r + 1.0, dtype=np.float32)
                pb.all_reduce(check)
                assert (check == p * (p + 1) / 2).all()
    return results


def _mpi_worker(ops: list[str], sizes: list[int]) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    results = {}
    for op in ops:
        for nbytes in sizes:
            n = max(1, nbytes // 4)
            x = np.ones(n, dtype=np.float32)
            y = np.empty_like(x)
            if op == "all_reduce":

                def fn(x=x):
                    comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            elif op == "broadcast":

                def fn(x=x):
                    comm.Bcast(x, root=0)
            elif op == "all_gather":
                part = np.ones(max(1, n // p), dtype=np.float32)
                out = np.empty(part.size * p, dtype=np.float32)

                def fn(out=out, part=part):
                    comm.Allgather(part, out)
            else:
                out = np.empty(max(1, n // p), dtype=np.float32)
                full = np.ones(out.size * p, dtype=np.float32)

                def fn(out=out, full=full):
                    comm.Reduce_scatter_block(full, out, op=MPI.SUM)

            del y
            seconds = _time(fn, nbytes, comm.Barrier, lambda v: comm.bcast(v, 0))
            results[f"{op}/{nbytes}"] = comm.allreduce(seconds, op=MPI.MAX)
    if comm.Get_rank() == 0:
        print(json.dumps(results))


def _torch_worker(ops: list[str], sizes: list[int]) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    p = dist.get_world_size()
    results = {}
    for op in ops:
        for nbytes in sizes:
            n = max(1, nbytes // 4)
            x = torch.ones(n, dtype=torch.float32)
            if op == "all_reduce":

                def fn(x=x):
                    dist.all_reduce(x)
            elif op == "broadcast":

                def fn(x=x):
                    dist.broadcast(x, 0)
            elif op == "all_gather":
                part = torch.ones(max(1, n // p), dtype=torch.float32)
                out = torch.empty(part.numel() * p, dtype=torch.float32)

                def fn(out=out, part=part):
                    dist.all_gather_into_tensor(out, part)
            else:
                out = torch.empty(max(1, n // p), dtype=torch.float32)
                full = torch.ones(out.numel() * p, dtype=torch.float32)

                def fn(out=out, full=full):
                    dist.reduce_scatter_tensor(out, full)

            def agree(v):
                holder = [v]
                dist.broadcast_object_list(holder, 0)
                return holder[0]

            seconds = _time(fn, nbytes, dist.barrier, agree)
            t = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            results[f"{op}/{nbytes}"] = float(t[0])
    if dist.get_rank() == 0:
        print(json.dumps(results))
    dist.destroy_process_group()


def _run_torch(args) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.ranks):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(args.ranks),
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--torch-worker",
                    "--ops",
                    args.ops,
                    "--min-bytes",
                    str(args.min_bytes),
                    "--max-bytes",
                    str(args.max_bytes),
                ],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    return json.loads(outputs[0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--shm", default="1", help="PLURIBUS_GLOO_SHM for the ranks (1 or 0)")
    parser.add_argument("--ops", default="all_reduce")
    parser.add_argument("--min-bytes", type=int, default=4)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--mpi", action="store_true", help="also time mpi4py (mpiexec) here")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--torch", action="store_true", help="also time torch.distributed gloo")
    parser.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    ops = args.ops.split(",")
    sizes = [s for s in SIZES if args.min_bytes <= s <= args.max_bytes]
    if args.mpi_worker:
        _mpi_worker(ops, sizes)
        return
    if args.torch_worker:
        _torch_worker(ops, sizes)
        return

    from pluribus.testing import run_ranks

    gloo = run_ranks(
        _gloo_job,
        args.ranks,
        "gloo",
        "processes",
        timeout=600,
        env={"PLURIBUS_GLOO_SHM": args.shm},
        args=(ops, sizes),
    )[0]
    mpi = {}
    if args.mpi:
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        out = subprocess.run(
            [
                mpiexec,
                "-n",
                str(args.ranks),
                sys.executable,
                __file__,
                "--mpi-worker",
                "--ops",
                args.ops,
                "--max-bytes",
                str(args.max_bytes),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout
        mpi = json.loads(out.strip().splitlines()[-1])
    torch_times = _run_torch(args) if args.torch else {}
    if args.json:
        print(json.dumps({"gloo": gloo, "mpi": mpi, "torch": torch_times}))
        return
    p = args.ranks
    print(f"# {p} ranks, float32, PLURIBUS_GLOO_SHM={args.shm}, load {os.getloadavg()[0]:.1f}")
    head = f"{'op':<15}{'bytes':>10}{'gloo us':>11}{'busbw':>8}"
    if mpi:
        head += f"{'mpi us':>10}{'busbw':>8}{'ratio':>7}"
    if torch_times:
        head += f"{'torch us':>10}{'busbw':>8}{'x torch':>8}"
    print(head)
    for key, seconds in gloo.items():
        op, nbytes = key.split("/")
        nbytes = int(nbytes)
        bus = bus_factor(op, p) * nbytes / seconds / 1e9
        line = f"{op:<15}{nbytes:>10}{seconds * 1e6:>11.1f}{bus:>8.2f}"
        if key in mpi:
            ms = mpi[key]
            line += f"{ms * 1e6:>10.1f}{bus_factor(op, p) * nbytes / ms / 1e9:>8.2f}"
            line += f"{ms / seconds:>7.2f}"
        if key in torch_times:
            ts = torch_times[key]
            line += f"{ts * 1e6:>10.1f}{bus_factor(op, p) * nbytes / ts / 1e9:>8.2f}"
            line += f"{ts / seconds:>8.2f}"
        print(line)


if __name__ == "__main__":
    main()

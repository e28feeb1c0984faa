"""pluribus.rpc against torch.distributed.rpc and gloo send/recv, in the same run.

Run::

    pluribus-run --nproc-per-node 2 benchmarks/rpc_latency.py [--rounds 7] [--json out.json]

Rank 0 calls, rank 1 serves (its main thread blocked on a store key meanwhile). In each round,
blocks of each contender run one after the other (so a noisy moment hits all of them), and the
best block per contender is kept:

- latency: ``rpc_sync(w1, add, args=(1, 2))`` round trips, pluribus.rpc vs torch.distributed.rpc
  (TensorPipe; skipped when torch is not installed), and plain TCP and Unix-socket ping-pongs
  between the same processes as the floors (pluribus.rpc connects workers of one host through a
  Unix socket). Goals: below 100 us, and at most 0.5x torch.
- throughput: a 16 MiB float32 array as the argument of ``rpc_sync`` (the reply is its byte
  count) vs the gloo backend's ``send`` of the same bytes answered by a 4-byte ``send`` back.
  Goal: at least 0.8x gloo. On one host the argument travels in a shared-memory segment that
  the handler's array views without a copy; a second row has the handler copy it into a buffer
  of its own, the work gloo's ``recv`` does, so the two can be compared like for like.

Ratios are also taken per round (the same minute) and their median is reported; the load
average before and after is printed, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import numpy as np
import pluribus as pb
from pluribus import rpc

SIZE = 16 * 2**20


@rpc.expose
def add(a, b):
    return a + b


@rpc.expose
def nbytes(array):
    return int(array.nbytes)


_landing = np.empty(SIZE // 4, dtype=np.float32)


@rpc.expose
def copy_in(array):
    """Land the bytes in the handler's own buffer, as gloo's recv does."""
    np.copyto(_landing, array)
    return int(array.nbytes)


def torch_add(a, b):
    return a + b


def torch_nbytes(tensor):
    return tensor.numel() * tensor.element_size()


_cpu: dict[str, list[float]] = {}


def _best_per_call(fn, calls: int, name: str = "") -> float:
    """Wall seconds per call; the caller process's CPU seconds per call go to ``_cpu[name]``."""
    cpu = time.process_time()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    wall = (time.perf_counter() - start) / calls
    if name:
        _cpu.setdefault(name, []).append((time.process_time() - cpu) / calls)
    return wall


PING = b"x" * 40


def _raw_pair(rank: int, family: int = socket.AF_INET) -> socket.socket:
    """A plain connection between ranks 0 and 1: TCP (with TCP_NODELAY, as the RPC's) or a Unix
    socket in the abstract namespace."""
    listener = None
    address = None
    if rank == 1:
        if family == socket.AF_INET:
            listener = socket.create_server(("127.0.0.1", 0))
            address = listener.getsockname()
        else:
            listener = socket.socket(socket.AF_UNIX)
            address = f"\0rpc-latency-floor-{os.getpid()}"
            listener.bind(address)
            listener.listen()
    address = pb.broadcast_object(address, src=1)
    if rank == 0:
        sock = socket.socket(family)
        sock.connect(tuple(address) if family == socket.AF_INET else address)
    else:
        sock, _ = listener.accept()
        listener.close()
    if family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000, help="small calls per block")
    parser.add_argument("--transfers", type=int, default=20, help="16 MiB transfers per block")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-torch", action="store_true", help="leave torch.distributed.rpc out")
    args = parser.parse_args()

    pb.init_process_group("gloo")
    rank = pb.get_rank()
    rpc.init_rpc(f"w{rank}", timeout=120)  # the default group's store
    try:
        if args.no_torch:
            raise ImportError("left out")
        import torch
        import torch.distributed.rpc as torch_rpc
    except ImportError:
        torch = torch_rpc = None
    if torch_rpc is not None:
        port = None
        if rank == 0:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        port = pb.broadcast_object(port, src=0)
        options = torch_rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=16, rpc_timeout=120
        )
        torch_rpc.init_rpc(f"t{rank}", rank=rank, world_size=2, rpc_backend_options=options)

    raws = {
        "raw_tcp_pingpong_s": _raw_pair(rank),
        "raw_unix_pingpong_s": _raw_pair(rank, socket.AF_UNIX),
    }
    array = np.ones(SIZE // 4, dtype=np.float32)
    ack = np.zeros(1, dtype=np.int32)
    results: dict[str, list[float]] = {"pluribus_rpc_latency_s": [], "torch_rpc_latency_s": []}
    results["raw_tcp_pingpong_s"] = []
    results["raw_unix_pingpong_s"] = []
    results.update({"pluribus_rpc_16MiB_s": [], "gloo_16MiB_s": [], "torch_rpc_16MiB_s": []})
    results["pluribus_rpc_16MiB_copied_s"] = []
    load_before = os.getloadavg()
    tensor = torch.ones(SIZE // 4) if torch is not None else None
    store = pb.get_default_group().store
    for round_ in range(args.rounds):
        pb.barrier()
        if rank == 0:
            for _ in range(50):  # warm the connection
                rpc.rpc_sync("w1", add, args=(1, 2))
            results["pluribus_rpc_latency_s"].append(
                _best_per_call(lambda: rpc.rpc_sync("w1", add, args=(1, 2)), args.calls, "pluribus")
            )
            if torch_rpc is not None:
                results["torch_rpc_latency_s"].append(
                    _best_per_call(
                        lambda: torch_rpc.rpc_sync("t1", torch_add, args=(1, 2)),
                        args.calls,
                        "torch",
                    )
                )
            for _ in range(3):  # the segments this size needs exist after the first calls
                rpc.rpc_sync("w1", copy_in, args=(array,))
            results["pluribus_rpc_16MiB_s"].append(
                _best_per_call(lambda: rpc.rpc_sync("w1", nbytes, args=(array,)), args.transfers)
            )
            results["pluribus_rpc_16MiB_copied_s"].append(
                _best_per_call(lambda: rpc.rpc_sync("w1", copy_in, args=(array,)), args.transfers)
            )
            if torch_rpc is not None:
                results["torch_rpc_16MiB_s"].append(
                    _best_per_call(
                        lambda: torch_rpc.rpc_sync("t1", torch_nbytes, args=(tensor,)),
                        args.transfers,
                    )
                )
            store.set(f"rpc-bench/{round_}", b"done")
        else:
            # the server's main thread waits on a socket, not in a collective that may poll
            # (and take the GIL from the threads serving the calls)
            store.get(f"rpc-bench/{round_}", timeout=600)
        pb.barrier()
        # the floors: a 40-byte ping-pong on a plain socket between the same two processes
        for key, raw in raws.items():
            if rank == 0:

                def ping(raw=raw):
                    raw.sendall(PING)
                    raw.recv(64)

                results[key].append(_best_per_call(ping, args.calls))
            else:
                for _ in range(args.calls):
                    raw.sendall(raw.recv(64))
            pb.barrier()
        if rank == 0:

            def gloo_transfer():
                pb.send(array, 1)
                pb.recv(ack, 1)

            results["gloo_16MiB_s"].append(_best_per_call(gloo_transfer, args.transfers))
        else:
            for _ in range(args.transfers):
                pb.recv(array, 0)
                pb.send(ack, 0)
    pb.barrier()
    if torch_rpc is not None:
        torch_rpc.shutdown()
    rpc.shutdown()
    if rank == 0:
        _report(results, args, torch is not None, (load_before, os.getloadavg()))
    pb.destroy_process_group()


def _round_ratio(results: dict[str, list[float]], ours: str, theirs: str) -> float:
    """The median over rounds of ours/theirs taken within each round (time per call)."""
    return statistics.median(a / b for a, b in zip(results[ours], results[theirs], strict=True))


def _report(results: dict[str, list[float]], args, have_torch: bool, loads) -> None:
    best = {k: min(v) for k, v in results.items() if v}
    median = {k: statistics.median(v) for k, v in results.items() if v}
    gib = 2**30
    lines = [
        f"rounds {args.rounds}, {args.calls} small calls and {args.transfers} 16 MiB transfers "
        "per block; best block (median block)",
        "load average (1, 5, 15 min) before "
        + " ".join(f"{x:.1f}" for x in loads[0])
        + ", after "
        + " ".join(f"{x:.1f}" for x in loads[1]),
        f"pluribus.rpc rpc_sync latency      {best['pluribus_rpc_latency_s'] * 1e6:8.1f} us "
        f"({median['pluribus_rpc_latency_s'] * 1e6:.1f})",
    ]
    lines.append(
        f"raw TCP ping-pong (a floor)        {best['raw_tcp_pingpong_s'] * 1e6:8.1f} us "
        f"({median['raw_tcp_pingpong_s'] * 1e6:.1f})"
    )
    lines.append(
        f"raw Unix-socket ping-pong (floor)  {best['raw_unix_pingpong_s'] * 1e6:8.1f} us "
        f"({median['raw_unix_pingpong_s'] * 1e6:.1f})"
    )
    if have_torch:
        ratio = best["pluribus_rpc_latency_s"] / best["torch_rpc_latency_s"]
        lines.append(
            f"torch.distributed.rpc latency      {best['torch_rpc_latency_s'] * 1e6:8.1f} us "
            f"({median['torch_rpc_latency_s'] * 1e6:.1f})   pluribus/torch = {ratio:.2f} "
            f"(goal <= 0.5); median per-round ratio "
            f"{_round_ratio(results, 'pluribus_rpc_latency_s', 'torch_rpc_latency_s'):.2f}"
        )
    cpu = {k: min(v) * 1e6 for k, v in _cpu.items()}
    line = f"caller process CPU per small call: pluribus.rpc {cpu['pluribus']:.1f} us"
    if have_torch:
        line += f", torch.distributed.rpc {cpu['torch']:.1f} us"
    lines.append(line)
    rpc_bw = SIZE / best["pluribus_rpc_16MiB_s"] / gib
    gloo_bw = SIZE / best["gloo_16MiB_s"] / gib
    lines.append(
        f"pluribus.rpc 16 MiB argument       {rpc_bw:8.2f} GiB/s "
        f"({SIZE / median['pluribus_rpc_16MiB_s'] / gib:.2f})"
    )
    copied_bw = SIZE / best["pluribus_rpc_16MiB_copied_s"] / gib
    lines.append(
        f"pluribus.rpc 16 MiB, handler copies {copied_bw:7.2f} GiB/s "
        f"({SIZE / median['pluribus_rpc_16MiB_copied_s'] / gib:.2f})"
    )
    lines.append(
        f"gloo send/recv 16 MiB              {gloo_bw:8.2f} GiB/s "
        f"({SIZE / median['gloo_16MiB_s'] / gib:.2f})   rpc/gloo = {rpc_bw / gloo_bw:.2f} "
        f"(goal >= 0.8), handler copying {copied_bw / gloo_bw:.2f}"
    )
    per_round = [
        1 / _round_ratio(results, "pluribus_rpc_16MiB_s", "gloo_16MiB_s"),
        1 / _round_ratio(results, "pluribus_rpc_16MiB_copied_s", "gloo_16MiB_s"),
    ]
    lines.append(
        "throughput rpc/gloo, median per-round ratio: "
        f"{per_round[0]:.2f} (viewed), {per_round[1]:.2f} (copied by the handler)"
    )
    if have_torch:
        torch_bw = SIZE / best["torch_rpc_16MiB_s"] / gib
        lines.append(f"torch.distributed.rpc 16 MiB       {torch_bw:8.2f} GiB/s")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"best": best, "median": median, "all": results, "caller_cpu_s": _cpu}, f, indent=1
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()

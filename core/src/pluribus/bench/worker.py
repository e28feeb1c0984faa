"""One rank of a benchmark phase: ``python -m pluribus.bench.worker`` (started by launch.py).

It reads the phase from ``$PLURIBUS_BENCH_CONFIG``, measures, and rank 0 writes the rows as JSON
to ``$PLURIBUS_BENCH_RESULT``. The rank comes from RANK/WORLD_SIZE, or from the MPI launcher's
variables when the phase runs under mpiexec.
"""

from __future__ import annotations

import json
import os
import sys
import time

from .core import BenchConfig, Row, format_size, measure
from .launch import CONFIG_ENV, PROGRESS_ENV, RESULT_ENV, STAGED_PREFIX


def rank_and_size() -> tuple[int, int]:
    env = os.environ
    for rank_key, size_key in (
        ("RANK", "WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ):
        if rank_key in env and size_key in env:
            return int(env[rank_key]), int(env[size_key])
    raise SystemExit("pluribus.bench.worker: no RANK/WORLD_SIZE (or MPI rank) in the environment")


def progress_line(row: Row) -> str:
    if row.skipped:
        return f"# {row.impl} {row.collective} {format_size(row.size)}: skipped ({row.skipped})"
    return (
        f"# {row.impl} {row.collective} {format_size(row.size)}: median "
        f"{row.time_us_median:.1f} us, busbw {row.busbw(row.time_us_median):.3f} GB/s, "
        f"#wrong {row.wrong}"
    )


def open_comm(impl: str, config: BenchConfig):
    """Join the phase's job with ``impl``'s own initialisation and return its Comm."""
    from .comms import MpiComm, PluribusComm, TorchComm

    if impl == "pluribus" or impl.startswith(STAGED_PREFIX):
        import pluribus

        rank, size = rank_and_size()
        if config.device == "cuda":
            _use_gpu()
        staged = impl.startswith(STAGED_PREFIX)
        backend = impl.removeprefix(STAGED_PREFIX) if staged else config.backend
        # a staged phase's launcher set PLURIBUS_GPU_STAGING=1: cupy arrays cross the host
        pluribus.init_process_group(backend, rank=rank, world_size=size, timeout=config.timeout)
        return PluribusComm(
            direct=config.direct,
            device=config.device,
            name=impl if staged else "",
            symmetric=config.symmetric and not staged,
        )
    if impl == "torch-gloo":
        rank, size = rank_and_size()
        return TorchComm(rank, size, config.timeout)
    if impl == "mpi4py":
        return MpiComm()
    raise SystemExit(f"pluribus.bench.worker: unknown implementation {impl!r}")


def _use_gpu() -> None:
    """Make this rank's GPU current (local rank modulo the GPU count) and create its context
    before any backend starts, so transports such as UCX see GPU memory from the first call."""
    import cupy

    local = int(os.environ.get("LOCAL_RANK", rank_and_size()[0]))
    cupy.cuda.Device(local % cupy.cuda.runtime.getDeviceCount()).use()
    cupy.cuda.runtime.free(0)


def close_comm(impl: str, comm) -> None:
    if impl == "pluribus" or impl.startswith(STAGED_PREFIX):
        import pluribus

        pluribus.destroy_process_group()
    else:
        comm.close()


def measure_rank(comm, config: BenchConfig, show=None, profile: bool = True) -> list[Row]:
    """``measure``, under cProfile when the config asks for a profile."""
    if profile and config.profile_dir:
        return _profiled(comm, config, show)
    return measure(comm, config, show)


def _profiled(comm, config: BenchConfig, show) -> list[Row]:
    """``measure`` under cProfile: rank-N.prof (for snakeviz/pstats) and rank-N.txt (the top
    functions by own time and by cumulative time) in ``config.profile_dir``."""
    import cProfile
    import io
    import pstats

    os.makedirs(config.profile_dir, exist_ok=True)
    profiler = cProfile.Profile()
    rows = profiler.runcall(measure, comm, config, show)
    base = os.path.join(config.profile_dir, f"rank-{comm.rank}")
    profiler.dump_stats(base + ".prof")
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    with open(base + ".txt", "w") as out:
        out.write(text.getvalue())
    return rows


def run_rank(
    impl: str, config: BenchConfig, progress: bool = False, repeat: int = 1
) -> list[dict] | None:
    """Measure on this rank ``repeat`` times in one job; rank 0 returns a record per repeat,
    the others None."""
    comm = open_comm(impl, config)
    try:
        show = None
        if progress and comm.rank == 0:
            show = lambda row: print(progress_line(row), file=sys.stderr, flush=True)  # noqa: E731
        records = []
        for _ in range(repeat):
            load_before = os.getloadavg()
            start = time.monotonic()
            rows = measure_rank(comm, config, show, profile=impl == "pluribus")
            records.append(
                {
                    "impl": comm.name,
                    "library": comm.library,
                    "nranks": comm.size,
                    "rows": [row.to_dict() for row in rows],
                    "load_before": list(load_before),
                    "load_after": list(os.getloadavg()),
                    "wall_s": round(time.monotonic() - start, 3),
                }
            )
        return records if comm.rank == 0 else None
    finally:
        close_comm(impl, comm)


def main() -> int:
    spec = json.loads(os.environ[CONFIG_ENV])
    config = BenchConfig.from_dict(spec["config"])
    records = run_rank(spec["impl"], config, os.environ.get(PROGRESS_ENV) == "1")
    if records is not None:
        record = records[0]
        path = os.environ[RESULT_ENV]
        with open(path + ".tmp", "w") as out:
            json.dump(record, out)
        os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

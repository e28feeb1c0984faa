"""What the benchmark measures: sizes, bandwidth factors, test data, result checks, the timing loop.

Everything here works with any :class:`~pluribus.bench.comms.Comm` (pluribus, torch.distributed,
mpi4py), so the three are timed and checked by exactly the same code.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..arrays import reduce_into
from ..types import ReduceOp

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "reduce")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "reduce")
#: Collectives whose "size" is the whole gathered/scattered buffer, split into one block per rank
#: (as in nccl-tests: the size printed is the larger of the send and receive buffers).
BLOCKED = ("all_gather", "reduce_scatter", "all_to_all")


def bus_factor(collective: str, nranks: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth.

    busbw = algbw * factor makes numbers comparable across world sizes: it is the bandwidth each
    rank's link would need if the collective were done optimally.
    """
    n = nranks
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """``"64M"`` -> 67108864. Suffixes K, M, G, T are powers of 1024 (as in nccl-tests)."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"size {text!r}: expected a number of bytes such as 4, 8K, 64M or 1G")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def size_series(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """min, min*f, min*f^2, ... up to max (inclusive), as nccl-tests' -b/-e/-f."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 < min-bytes <= max-bytes, got {min_bytes} and {max_bytes}")
    if factor <= 1:
        raise ValueError(f"step factor must be greater than 1, got {factor}")
    sizes, size = [], float(min_bytes)
    while size <= max_bytes * (1 + 1e-9):
        sizes.append(int(size))
        size *= factor
    return sizes


def element_counts(collective: str, nbytes: int, itemsize: int, nranks: int) -> tuple[int, int]:
    """(total elements, elements per rank block) for a row of ``nbytes``; at least one each."""
    count = max(1, nbytes // itemsize)
    if collective in BLOCKED:
        per_rank = max(1, count // nranks)
        return per_rank * nranks, per_rank
    return count, count


# -- test data --------------------------------------------------------------------------------


def make_input(rank: int, count: int, dtype: np.dtype, op: ReduceOp) -> np.ndarray:
    """Rank ``rank``'s input: small integers, so sums and products are exact in every dtype.

    Values depend on the element index and the rank, so a block sent to the wrong place or a
    missing contribution from one rank changes the result.
    """
    dtype = np.dtype(dtype)
    idx = np.arange(count, dtype=np.int64)
    if dtype == np.bool_:
        return ((idx + rank) % 2).astype(dtype)
    if op is ReduceOp.PRODUCT:
        table = np.array([1, 2, 1, 1] if dtype.kind == "u" else [1, 2, 1, -1], dtype=np.int64)
        return table[(idx + rank) % 4].astype(dtype)
    values = (idx * 5 + rank * 3) % 9
    if dtype.kind in "fc" or (dtype.kind == "i" and not op.bitwise) or dtype.kind == "V":
        values = values - 4
    return values.astype(dtype)


def reduce_all(arrays: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """The reduction of the ranks' arrays with pluribus' semantics (AVG = SUM / n in the dtype)."""
    result = arrays[0].copy()
    for other in arrays[1:]:
        reduce_into(result, other, op)
    if op is ReduceOp.AVG:
        result /= len(arrays)
    return result


@dataclass
class Case:
    """The buffers of one collective at one size on one rank, and how to refill and check them.

    ``send`` is the input and ``recv`` the output; for in-place collectives (all_reduce,
    broadcast, reduce) they are the same array.
    """

    collective: str
    rank: int
    nranks: int
    count: int
    per_rank: int
    dtype: np.dtype
    op: ReduceOp
    root: int
    send: Any
    recv: Any

    @classmethod
    def make(
        cls,
        collective: str,
        rank: int,
        nranks: int,
        count: int,
        per_rank: int,
        dtype: Any,
        op: ReduceOp,
        root: int = 0,
        device: str = "cpu",
        empty: Any = None,
    ) -> Case:
        """The buffers on ``device``: numpy arrays on "cpu", cupy arrays on "cuda", made by
        ``empty(count, dtype)`` when given (the library's own allocator)."""
        dtype = np.dtype(dtype)
        empty = empty or array_module(device).empty
        if collective in ("all_reduce", "broadcast", "reduce"):
            send = recv = empty(count, dtype)
        elif collective == "all_gather":
            send, recv = empty(per_rank, dtype), empty(count, dtype)
        elif collective == "reduce_scatter":
            send, recv = empty(count, dtype), empty(per_rank, dtype)
        elif collective == "all_to_all":
            send, recv = empty(count, dtype), empty(count, dtype)
        else:
            raise ValueError(f"unknown collective {collective!r}")
        case = cls(collective, rank, nranks, count, per_rank, dtype, op, root, send, recv)
        case.fill()
        return case

    def input_of(self, rank: int) -> np.ndarray:
        return make_input(rank, self.send.size, self.dtype, self.op)

    def fill(self) -> None:
        """Put this rank's input in place (and clear the output, so stale data cannot pass)."""
        if self.recv is not self.send:
            self.recv[...] = 0
        if self.collective == "broadcast" and self.rank != self.root:
            self.send[...] = 0
        elif isinstance(self.send, np.ndarray):
            self.send[...] = self.input_of(self.rank)
        else:
            self.send.set(self.input_of(self.rank))  # cupy: one copy from the host

    def expected(self) -> np.ndarray | None:
        """What ``recv`` must hold after the collective; None where nothing is defined."""
        c, r, n, per = self.collective, self.rank, self.nranks, self.per_rank
        if c == "all_reduce":
            return reduce_all([self.input_of(q) for q in range(n)], self.op)
        if c == "reduce":
            if r != self.root:
                return None
            return reduce_all([self.input_of(q) for q in range(n)], self.op)
        if c == "broadcast":
            return self.input_of(self.root)
        if c == "all_gather":
            return np.concatenate([self.input_of(q) for q in range(n)])
        if c == "reduce_scatter":
            return reduce_all(
                [self.input_of(q)[r * per : (r + 1) * per] for q in range(n)], self.op
            )
        if c == "all_to_all":
            return np.concatenate([self.input_of(q)[r * per : (r + 1) * per] for q in range(n)])
        raise ValueError(f"unknown collective {c!r}")

    def wrong(self) -> int:
        """How many elements of ``recv`` differ from the expected values (nccl-tests' #wrong)."""
        recv = self.recv if isinstance(self.recv, np.ndarray) else self.recv.get()
        return count_wrong(recv, self.expected())


def array_module(device: str):
    """numpy for "cpu", cupy for "cuda" (imported only then)."""
    if device == "cpu":
        return np
    if device == "cuda":
        import cupy

        return cupy
    raise ValueError(f"unknown device {device!r}; choose cpu or cuda")


def count_wrong(result: np.ndarray, expected: np.ndarray | None) -> int:
    if expected is None:
        return 0
    if result.shape != expected.shape:
        return int(max(result.size, expected.size))
    return int(np.count_nonzero(result != expected))


# -- one rank's measurement ---------------------------------------------------------------------


@dataclass
class BenchConfig:
    """Everything that decides what is measured; identical on every rank and in every phase."""

    collectives: tuple[str, ...] = COLLECTIVES
    min_bytes: int = 4
    max_bytes: int = 64 << 20
    step_factor: float = 2.0
    iters: int = 20
    warmup: int = 5
    #: Seconds of untimed iterations per size at least, after ``warmup``: a CPU that idled (a
    #: VM's, a laptop's) takes tens of milliseconds of load to reach its full speed, and sizes
    #: timed before that measure the ramp, not the collective.
    warmup_seconds: float = 0.0
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0
    check: bool = True
    #: Seconds of timed iterations per size at most (0: always ``iters``); keeps big sizes short.
    budget: float = 0.0
    min_iters: int = 3
    timeout: float = 300.0
    backend: str = "gloo"
    #: When set, each pluribus rank runs under cProfile and writes its statistics here.
    profile_dir: str = ""
    #: Call the backend's methods directly instead of the public API (the core's overhead).
    direct: bool = False
    #: Where the buffers live: "cpu" (numpy) or "cuda" (cupy; each timed operation ends with a
    #: synchronisation of the current stream, so GPU work counts, as in nccl-tests).
    device: str = "cpu"
    #: pluribus's buffers come from :func:`pluribus.empty_symmetric` (numpy), which a backend
    #: may read on every peer without a copy (gloo on one host); the peers' stay ordinary.
    symmetric: bool = False

    def __post_init__(self) -> None:
        self.collectives = tuple(self.collectives)
        unknown = [c for c in self.collectives if c not in COLLECTIVES]
        if unknown:
            raise ValueError(
                f"unknown collective(s) {unknown}; choose from {', '.join(COLLECTIVES)}"
            )
        if self.iters < 1 or self.warmup < 0 or self.warmup_seconds < 0:
            raise ValueError("need at least one iteration and a non-negative warmup")
        ReduceOp(self.op)  # a clear ValueError for an unknown op name
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}; choose cpu or cuda")

    @property
    def reduce_op(self) -> ReduceOp:
        return ReduceOp(self.op)

    def sizes(self) -> list[int]:
        return size_series(self.min_bytes, self.max_bytes, self.step_factor)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> BenchConfig:
        return cls(**data)


@dataclass
class Row:
    """One line of the report: one implementation, collective and size."""

    impl: str
    collective: str
    size: int
    count: int
    dtype: str
    op: str
    root: int | None
    nranks: int
    iters: int = 0
    wrong: int = 0
    samples_us: list[float] = field(default_factory=list)
    skipped: str | None = None

    @property
    def time_us(self) -> float:
        return statistics.fmean(self.samples_us) if self.samples_us else math.nan

    @property
    def time_us_min(self) -> float:
        return min(self.samples_us) if self.samples_us else math.nan

    @property
    def time_us_median(self) -> float:
        return statistics.median(self.samples_us) if self.samples_us else math.nan

    def algbw(self, time_us: float | None = None) -> float:
        """GB/s (1e9 bytes/s): bytes of the row divided by the time of one operation."""
        t = self.time_us if time_us is None else time_us
        return self.size / (t * 1e3) if t and t > 0 and not math.isnan(t) else math.nan

    def busbw(self, time_us: float | None = None) -> float:
        return self.algbw(time_us) * bus_factor(self.collective, self.nranks)

    def to_dict(self) -> dict:
        return {
            "impl": self.impl,
            "collective": self.collective,
            "size": self.size,
            "count": self.count,
            "dtype": self.dtype,
            "op": self.op,
            "root": self.root,
            "nranks": self.nranks,
            "iters": self.iters,
            "time_us": _finite(self.time_us),
            "time_us_min": _finite(self.time_us_min),
            "time_us_median": _finite(self.time_us_median),
            "algbw_GBps": _finite(self.algbw()),
            "busbw_GBps": _finite(self.busbw()),
            "busbw_median_GBps": _finite(self.busbw(self.time_us_median)),
            "wrong": self.wrong,
            "skipped": self.skipped,
            "samples_us": [float(f"{s:.6g}") for s in self.samples_us],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Row:
        return cls(
            impl=data["impl"],
            collective=data["collective"],
            size=data["size"],
            count=data["count"],
            dtype=data["dtype"],
            op=data["op"],
            root=data["root"],
            nranks=data["nranks"],
            iters=data["iters"],
            wrong=data["wrong"],
            samples_us=list(data.get("samples_us", [])),
            skipped=data.get("skipped"),
        )


def _finite(x: float) -> float | None:
    return None if x is None or math.isnan(x) else float(f"{x:.6g}")


def _time_ops(run: Callable[[], None], iters: int) -> np.ndarray:
    times = np.empty(iters, dtype=np.float64)
    clock = time.perf_counter
    for i in range(iters):
        start = clock()
        run()
        times[i] = clock() - start
    return times


def _synchronised(run: Callable[[], None]) -> Callable[[], None]:
    """``run`` followed by waiting for the current CUDA stream: an operation is done when its
    GPU work is, even where the library returns as soon as the work is queued (NCCL)."""
    import cupy

    stream = cupy.cuda.get_current_stream()

    def run_and_wait() -> None:
        run()
        stream.synchronize()

    return run_and_wait


def measure_size(comm: Any, config: BenchConfig, collective: str, nbytes: int) -> Row:
    """Warm up, check once, then time back-to-back operations of one size; every rank gets the row.

    Each iteration's time is the slowest rank's (an operation is done when every rank is done).
    """
    dtype = np.dtype(_resolve_dtype(config.dtype))
    op = config.reduce_op if collective in REDUCING else ReduceOp.SUM
    count, per_rank = element_counts(collective, nbytes, dtype.itemsize, comm.size)
    row = Row(
        impl=comm.name,
        collective=collective,
        size=count * dtype.itemsize,
        count=count,
        dtype=config.dtype,
        op=config.op if collective in REDUCING else "-",
        root=config.root if collective in ROOTED else None,
        nranks=comm.size,
    )
    reason = comm.unsupported(collective, dtype, op)
    if reason:
        row.skipped = reason
        return row
    case = Case.make(
        collective, comm.rank, comm.size, count, per_rank, dtype, op, config.root, config.device,
        comm.empty,
    )  # fmt: skip
    run = comm.runner(collective, case, op, config.root)
    if config.device == "cuda":
        run = _synchronised(run)
    warm = _time_ops(run, config.warmup) if config.warmup else np.zeros(0)
    per_op = None
    if config.budget > 0 or config.warmup_seconds > 0:
        per_op = float(np.median(warm)) if warm.size else float(_time_ops(run, 1)[0])
        per_op = max(per_op, 1e-9)
    if config.warmup_seconds > 0:  # rank 0's count, so that every rank calls as often
        _time_ops(run, comm.broadcast_int(int(config.warmup_seconds / per_op)))
    wrong = 0
    if config.check:
        case.fill()
        run()
        wrong = case.wrong()
    iters = config.iters
    if config.budget > 0:
        affordable = int(config.budget / per_op)
        iters = comm.broadcast_int(max(config.min_iters, min(config.iters, affordable)))
    comm.barrier()
    times = _time_ops(run, iters)
    gathered = comm.allgather_f64(np.concatenate([[float(wrong)], times]))
    row.iters = iters
    row.wrong = int(gathered[:, 0].sum())
    row.samples_us = [float(t) * 1e6 for t in gathered[:, 1:].max(axis=0)]
    return row


def measure(
    comm: Any, config: BenchConfig, progress: Callable[[Row], None] | None = None
) -> list[Row]:
    """Every configured collective at every configured size on an initialised ``comm``.

    Runs on every rank of the job with the same ``config``; every rank returns the same rows.
    """
    rows: list[Row] = []
    for collective in config.collectives:
        seen: set[int] = set()
        for nbytes in config.sizes():
            dtype = np.dtype(_resolve_dtype(config.dtype))
            count, _ = element_counts(collective, nbytes, dtype.itemsize, comm.size)
            if count in seen:
                continue
            seen.add(count)
            row = measure_size(comm, config, collective, nbytes)
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def _resolve_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        from ..arrays import bfloat16_dtype

        dt = bfloat16_dtype()
        if dt is None:
            raise ValueError("dtype bfloat16 needs ml_dtypes: pip install ml_dtypes")
        return dt
    return np.dtype(name)


resolve_dtype = _resolve_dtype

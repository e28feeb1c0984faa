"""``pluribus-bench``: the command line, and ``run_benchmark`` for programs and tests."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import sys
from typing import Any

from ..errors import PluribusError
from ..plugins import resolve_backend
from .core import COLLECTIVES, BenchConfig, Row, format_size, parse_size
from .launch import PEERS, STAGED_PREFIX, is_peer, peer_unavailable, run_phase
from .report import (
    comparisons,
    format_comparisons,
    format_table,
    markdown,
    merge_rows,
    plot,
)

EPILOG = """\
examples:
  pluribus-bench --nproc 2 --backend gloo -b 4 -e 64M -C all_reduce
  pluribus-bench --nproc 2 -C all_reduce,all_gather --compare torch-gloo --compare mpi4py
  pluribus-run --nproc-per-node 2 -m pluribus.bench -b 1K -e 16M --json
  pluribus-bench --backend threads --nproc 4 -e 1M     # ranks as threads of one process
  pluribus-bench --device cuda --backend ucc -b 1K -e 1G -C all_reduce --compare staged-gloo

size is the per-rank buffer for all_reduce, broadcast and reduce, and the whole gathered or
scattered buffer for all_gather, reduce_scatter and all_to_all (as in nccl-tests). time is per
operation (average, min and median over the timed iterations; each iteration counts the slowest
rank). algbw = size / time; busbw = algbw x (all_reduce 2(n-1)/n; all_gather, reduce_scatter,
all_to_all (n-1)/n; broadcast, reduce 1). #wrong counts result elements that differ from the
values numpy computes. The exit status is 1 when any element was wrong.
"""


def _collectives(values: list[str] | None) -> tuple[str, ...]:
    if not values:
        return COLLECTIVES
    names: list[str] = []
    for value in values:
        for name in value.replace(" ", "").split(","):
            if name == "all":
                names.extend(COLLECTIVES)
            elif name:
                names.append(name.replace("-", "_"))
    return tuple(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pluribus-bench",
        description="Measure pluribus collectives like nccl-tests: time, algbw, busbw, #wrong.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-b", "--min-bytes", default="4", help="smallest size (default 4; K/M/G ok)")
    p.add_argument("-e", "--max-bytes", default="64M", help="largest size (default 64M)")
    p.add_argument(
        "-f",
        "--step-factor",
        type=float,
        default=2.0,
        help="multiply the size by this between rows (default 2)",
    )
    p.add_argument(
        "-n", "--iters", type=int, default=20, help="timed iterations per size (default 20)"
    )
    p.add_argument(
        "-w", "--warmup", type=int, default=5, help="untimed iterations per size (default 5)"
    )
    p.add_argument(
        "--warmup-seconds",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="then untimed iterations for at least this long per size: an idle CPU (a VM's, a "
        "laptop's) needs tens of milliseconds of load to reach full speed",
    )
    p.add_argument(
        "-d",
        "--dtype",
        default="float32",
        help="float32 (default), float64, float16, bfloat16, int32, int64, ...",
    )
    p.add_argument(
        "-o",
        "--op",
        default="sum",
        help="reduction: sum (default), product, min, max, avg, band, bor, bxor",
    )
    p.add_argument(
        "-r", "--root", type=int, default=0, help="root of broadcast and reduce (default 0)"
    )
    p.add_argument(
        "-C",
        "--collectives",
        action="append",
        metavar="NAMES",
        help=f"comma-separated, repeatable; default all: {','.join(COLLECTIVES)}",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="buffers as numpy arrays (cpu, default) or cupy arrays on the rank's GPU (cuda)",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="pluribus backend (default: the best available for CPU arrays)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="start this many ranks here (default 2 when not inside a launched job)",
    )
    p.add_argument(
        "--launcher",
        choices=("auto", "spawn", "mpiexec"),
        default="auto",
        help="how --nproc starts ranks (auto: mpiexec for the mpi backend)",
    )
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="PEER",
        help=f"also measure {' and '.join(PEERS)} on the same sizes, or with --device cuda "
        f"{STAGED_PREFIX}BACKEND: pluribus on a CPU backend staging through the host (repeatable)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every phase this many times, interleaved, and pool the samples",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="at most this many seconds of timed iterations per size (at least 3)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds before an operation fails (default 300)",
    )
    p.add_argument("--no-check", action="store_true", help="do not check the results")
    p.add_argument(
        "--direct",
        action="store_true",
        help="call the backend's methods directly, skipping the public API's checks, "
        "hooks and work queue (the difference is the core's cost per call)",
    )
    p.add_argument(
        "--symmetric",
        action="store_true",
        help="allocate pluribus's buffers with pluribus.empty_symmetric (gloo on one host then "
        "reads peers' arrays without copying them in; the compared libraries keep plain arrays)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--save", metavar="FILE.json", help="also write the JSON results to a file")
    p.add_argument("--plot", metavar="FILE.png", help="draw busbw against size (matplotlib)")
    p.add_argument(
        "--markdown",
        metavar="FILE.md",
        help="also write the comparison tables (with command and load) as Markdown",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="profile every pluribus rank with cProfile into DIR (slows small sizes)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return p


def config_from_args(args: argparse.Namespace, backend: str) -> BenchConfig:
    return BenchConfig(
        collectives=_collectives(args.collectives),
        min_bytes=parse_size(args.min_bytes),
        max_bytes=parse_size(args.max_bytes),
        step_factor=args.step_factor,
        iters=args.iters,
        warmup=args.warmup,
        warmup_seconds=args.warmup_seconds,
        dtype=args.dtype,
        op=args.op.lower(),
        root=args.root,
        check=not args.no_check,
        budget=args.budget,
        timeout=args.timeout,
        backend=backend,
        profile_dir=os.path.abspath(args.profile) if args.profile else "",
        direct=args.direct,
        device=args.device,
        symmetric=args.symmetric,
    )


def _peers(values: list[str]) -> list[str]:
    names: list[str] = []
    for value in values:
        names.extend(v for v in value.replace(" ", "").split(",") if v)
    for name in names:
        if not is_peer(name):
            raise SystemExit(
                f"pluribus-bench: unknown --compare {name!r}; choose from {', '.join(PEERS)} "
                f"or {STAGED_PREFIX}BACKEND"
            )
    return list(dict.fromkeys(names))


def _note(message: str, quiet: bool = False) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def _loads(values: Any) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def run_benchmark(
    config: BenchConfig,
    nproc: int = 2,
    compare: list[str] | tuple[str, ...] = (),
    repeat: int = 1,
    launcher: str = "auto",
    progress: bool = False,
) -> dict[str, Any]:
    """Run every phase (pluribus, then each available peer), ``repeat`` times interleaved.

    Returns the JSON document ``pluribus-bench --json`` prints: config, host, per-phase load
    averages, the pooled rows and the comparisons. A peer that is not installed is listed under
    ``"skipped_peers"`` with the reason instead of failing the run.
    """
    skipped = {
        peer: reason for peer in compare if (reason := peer_unavailable(peer, config.device))
    }
    impls = ["pluribus"] + [p for p in compare if p not in skipped]
    rows: list[Row] = []
    phases = []
    for rep in range(repeat):
        for impl in impls:
            _note(f"# phase {impl} ({rep + 1}/{repeat}) ...", not progress)
            record = run_phase(impl, config, nproc, launcher, progress)
            rows.extend(Row.from_dict(r) for r in record["rows"])
            phases.append(_phase_entry(record, rep, impl))
    return _document(config, nproc, rows, phases, skipped)


def _phase_entry(record: dict, rep: int, impl: str = "") -> dict[str, Any]:
    """What the report keeps of one phase: who ran, how long, and the load around it."""
    return {
        "impl": record.get("impl", impl),
        "library": record.get("library", ""),
        "repeat": rep,
        "wall_s": record["wall_s"],
        "load_before": record["load_before"],
        "load_after": record["load_after"],
    }


def _document(
    config: BenchConfig, nproc: int, rows: list[Row], phases: list[dict], skipped: dict[str, str]
) -> dict[str, Any]:
    from .. import __version__

    merged = merge_rows(rows)
    return {
        "tool": "pluribus-bench",
        "version": __version__,
        "command": _command_line(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {
            "hostname": platform.node(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "nranks": nproc,
        "config": config.to_dict(),
        "phases": phases,
        "skipped_peers": skipped,
        "rows": [row.to_dict() for row in merged],
        "comparisons": comparisons(merged),
        "wrong": sum(row.wrong for row in merged),
    }


def _command_line() -> list[str]:
    program = os.path.basename(sys.argv[0])
    if program == "__main__.py":
        program = "python -m pluribus.bench"
    return [program, *sys.argv[1:]]


def render(doc: dict[str, Any]) -> str:
    """The human-readable report of a ``run_benchmark`` document."""
    cfg = doc["config"]
    rows = [Row.from_dict(r) for r in doc["rows"]]
    budget = f", budget {cfg['budget']:g}s per size" if cfg["budget"] else ""
    if cfg.get("warmup_seconds"):
        budget = f" and at least {cfg['warmup_seconds']:g}s{budget}"
    lines = [
        f"# pluribus-bench {doc['version']}: {doc['nranks']} ranks, backend {cfg['backend']}, "
        f"dtype {cfg['dtype']}, op {cfg['op']}, {format_size(cfg['min_bytes'])} to "
        f"{format_size(cfg['max_bytes'])} x{cfg['step_factor']:g}, {cfg['iters']} iters "
        f"({cfg['warmup']} warmup{budget})",
        f"# host {doc['host']['hostname']}, {doc['host']['cpus']} cpus, {doc['date']}",
    ]
    for phase in doc["phases"]:
        library = f" [{phase['library']}]" if phase.get("library") else ""
        lines.append(
            f"# phase {phase['impl']}{library} #{phase['repeat'] + 1}: {phase['wall_s']:.1f}s, "
            f"load average before {_loads(phase['load_before'])}, after "
            f"{_loads(phase['load_after'])}"
        )
    for peer, reason in doc["skipped_peers"].items():
        lines.append(f"# --compare {peer} skipped: {reason}")
    lines.append("")
    lines.append(format_table(rows))
    lines.append(format_comparisons(doc["comparisons"]))
    return "\n".join(lines).rstrip() + "\n"


def _launched() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _default_backend() -> str:
    from ..plugins import default_backend

    return default_backend("cpu")


def _emit(doc: dict[str, Any], args: argparse.Namespace) -> int:
    if args.save:
        with open(args.save, "w") as out:
            json.dump(doc, out, indent=1)
            out.write("\n")
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        sys.stdout.write(render(doc))
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(markdown(doc))
    if args.plot:
        plot([Row.from_dict(r) for r in doc["rows"]], args.plot)
        _note(f"# plot written to {args.plot}", args.quiet)
    return 1 if doc["wrong"] else 0


def _run_launched(config: BenchConfig, args: argparse.Namespace, peers: list[str]) -> int:
    """Inside a job started by pluribus-run (or any env:// launcher): this process is a rank."""
    from .worker import run_rank

    records = run_rank("pluribus", config, progress=not args.quiet, repeat=args.repeat)
    if records is None:
        return 0  # not rank 0: rank 0 reports
    rows: list[Row] = []
    phases = []
    for rep, record in enumerate(records):
        rows.extend(Row.from_dict(r) for r in record["rows"])
        phases.append(_phase_entry(record, rep))
    nranks = records[0]["nranks"]
    skipped = {peer: reason for peer in peers if (reason := peer_unavailable(peer, config.device))}
    for rep in range(args.repeat):
        for peer in (p for p in peers if p not in skipped):
            _note(f"# phase {peer} ({rep + 1}/{args.repeat}) ...", args.quiet)
            result = run_phase(peer, config, nranks, "auto", not args.quiet)
            rows.extend(Row.from_dict(r) for r in result["rows"])
            phases.append(_phase_entry(result, rep))
    return _emit(_document(config, nranks, rows, phases, skipped), args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A terminated benchmark still runs its cleanup (which kills the ranks it started). Only
    # from the command line: a program calling main(argv) keeps its own signal handling.
    if argv is None and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        peers = _peers(args.compare)
        backend = args.backend or _default_backend()
        config = config_from_args(args, backend)
        resolve_backend(backend)  # an unknown backend fails here, with its install command
        if args.repeat < 1:
            raise ValueError("--repeat must be at least 1")
        if args.nproc is None and _launched():
            return _run_launched(config, args, peers)
        nproc = 2 if args.nproc is None else args.nproc
        if nproc < 1:
            raise ValueError("--nproc must be at least 1")
        doc = run_benchmark(config, nproc, peers, args.repeat, args.launcher, not args.quiet)
        return _emit(doc, args)
    except (ValueError, PluribusError) as exc:
        print(f"pluribus-bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

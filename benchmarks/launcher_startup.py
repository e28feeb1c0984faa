"""Launcher start-up overhead: pluribus-run against torchrun on the same trivial job.

For each launcher, N ranks run a script that notes the wall-clock time at its first line and
right after ``init_process_group`` (gloo for both), then exits. Reported, from the moment the
launcher process is started:

* ``first line``: until every rank runs the script's first line (the launcher's own cost plus
  Python's start-up);
* ``past init``: until every rank has returned from ``init_process_group`` (adds importing the
  library and the rendezvous);
* ``exit``: until the launcher itself has exited.

Runs alternate between the launchers so that a busy machine hurts both alike; the median and
the best run are shown. torchrun is skipped when torch is not installed.

    python benchmarks/launcher_startup.py --ranks 4 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

PLURIBUS_JOB = """
import os, time
first = time.time()
import pluribus
pluribus.init_process_group("{backend}")
past_init = time.time()
with open(os.path.join(os.environ["BENCH_OUT"], os.environ["RANK"]), "w") as f:
    f.write(f"{{first}} {{past_init}}")
pluribus.destroy_process_group()
"""

TORCH_JOB = """
import os, time
first = time.time()
import torch.distributed as dist
dist.init_process_group("gloo")
past_init = time.time()
with open(os.path.join(os.environ["BENCH_OUT"], os.environ["RANK"]), "w") as f:
    f.write(f"{first} {past_init}")
dist.destroy_process_group()
"""


def torch_available() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import torch.distributed"], capture_output=True)
    return probe.returncode == 0


def one_run(command: list[str], ranks: int, workdir: Path, tries: int = 3) -> dict[str, float]:
    """One timed job; a failed one (torch's gloo sometimes drops a connection on a loaded
    machine) is retried and counted."""
    for attempt in range(tries):
        try:
            return dict(_timed(command, ranks, workdir), failed_before=attempt)
        except RuntimeError as exc:
            if attempt == tries - 1:
                raise
            print(f"retrying after a failed run: {str(exc).splitlines()[0]}", file=sys.stderr)
    raise AssertionError("unreachable")


def _timed(command: list[str], ranks: int, workdir: Path) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(dir=workdir))
    env = dict(os.environ, BENCH_OUT=str(out), GLOO_SOCKET_IFNAME="lo")
    start = time.time()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    ended = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stdout}\n{proc.stderr}")
    stamps = [tuple(map(float, (out / str(r)).read_text().split())) for r in range(ranks)]
    shutil.rmtree(out)
    return {
        "first_line": max(s[0] for s in stamps) - start,
        "past_init": max(s[1] for s in stamps) - start,
        "exit": ended - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backend", default="gloo", help="pluribus backend for the job")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="launcher-bench-"))
    try:
        (workdir / "pluribus_job.py").write_text(
            textwrap.dedent(PLURIBUS_JOB.format(backend=args.backend))
        )
        (workdir / "torch_job.py").write_text(textwrap.dedent(TORCH_JOB))
        bindir = Path(sys.executable).parent
        launchers = {
            "pluribus-run": [
                str(bindir / "pluribus-run"),
                "--nproc-per-node",
                str(args.ranks),
                str(workdir / "pluribus_job.py"),
            ]
        }
        if torch_available():
            launchers["torchrun"] = [
                str(bindir / "torchrun"),
                "--standalone",
                "--nproc-per-node",
                str(args.ranks),
                str(workdir / "torch_job.py"),
            ]
        else:
            print("torch is not installed: torchrun skipped", file=sys.stderr)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in launchers}
        for command in launchers.values():  # warm the file cache once
            one_run(command, args.ranks, workdir)
        for _ in range(args.repeats):
            for name, command in launchers.items():
                runs[name].append(one_run(command, args.ranks, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"{args.ranks} ranks, {args.repeats} runs each, {os.cpu_count()} CPUs; seconds from "
        "starting the launcher (median / best)"
    )
    print(f"{'launcher':<14}{'first line':>18}{'past init':>18}{'exit':>18}")
    summary = {}
    for name, results in runs.items():
        row = {}
        cells = []
        for key in ("first_line", "past_init", "exit"):
            values = [r[key] for r in results]
            row[key] = {"median": statistics.median(values), "best": min(values)}
            cells.append(f"{row[key]['median']:.3f} / {row[key]['best']:.3f}")
        row["failed_runs_retried"] = sum(r["failed_before"] for r in results)
        summary[name] = row
        print(f"{name:<14}" + "".join(f"{c:>18}" for c in cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": args.ranks, "results": summary}, indent=1))


if __name__ == "__main__":
    main()

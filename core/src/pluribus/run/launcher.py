"""``pluribus-run``: start and supervise the ranks of a job on one host or several (like torchrun).

Each rank is ``python .../pluribus/run/bootstrap.py script.py args`` in a session of its own, with
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
PLURIBUS_RESTART_COUNT set. The launcher serves the job's store itself (node 0's launcher on
several hosts), so the port is known before any rank starts and ``--master-port 0`` has no race.
When a rank fails, the others are stopped at once (SIGTERM, SIGKILL after ``--grace-period``),
and a summary names the rank that failed first, how, where, and its traceback. ``--max-restarts``
restarts the whole job; Ctrl-C stops every rank.
"""

from __future__ import annotations

import argparse
import functools
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..debug.trace import TRACE_ENV, merge_traces
from ..errors import PluribusError
from ..lifeline import pid_alive
from ..store import AUTH_TOKEN_ENV
from . import bootstrap
from .bootstrap import ERROR_FILE_ENV, LAUNCHER_PID_ENV
from .coordination import MultiNode, SingleNode
from .output import OutputPump
from .summary import RankOutcome, collective_status, format_summary, read_json, root_cause

DEFAULT_GRACE_SECONDS = 5.0
DEFAULT_MULTINODE_PORT = 29500
RESTART_ENV = "PLURIBUS_RESTART_COUNT"
FLIGHT_DIR_ENV = "PLURIBUS_FLIGHT_RECORDER_DIR"


EPILOG = """\
examples:
  pluribus-run --nproc-per-node 4 train.py --epochs 3
  pluribus-run --nproc-per-node 8 --max-restarts 3 --log-dir logs -m mypackage.train
  two hosts (the same command on each, --node-rank 0 on the host at 10.0.0.1):
  PLURIBUS_AUTH_TOKEN=secret pluribus-run --nnodes 2 --node-rank 1 --nproc-per-node 4 \\
      --master-addr 10.0.0.1 --master-port 29500 train.py

debugging (environment variables of the job):
  PLURIBUS_DEBUG=DETAIL          ranks check before each collective that they all called the
                                 same one (op, shape, dtype, root); a mismatch raises on every rank
  PLURIBUS_TRACE=DIR             a Perfetto/Chrome trace per rank, and one of all ranks, in DIR
  PLURIBUS_FLIGHT_RECORDER=N     calls kept per rank for the failure summary (default 256, 0: off)
"""


def say(message: str) -> None:
    print(f"pluribus-run: {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pluribus-run",
        description="Start a job of Python ranks on this host (or on several, with one "
        "pluribus-run per host), supervise them, and report the first failure.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        default="1",
        help="ranks on this host: a number or 'auto' (one per CPU core); default 1",
    )
    p.add_argument("--nnodes", type=int, default=1, help="hosts in the job (default 1)")
    p.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=0,
        help="this host's index, 0..nnodes-1 (default 0)",
    )
    p.add_argument(
        "--master-addr",
        "--master_addr",
        default="127.0.0.1",
        help="address of node 0, where the launcher serves the job's store (default 127.0.0.1)",
    )
    p.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        help="port of the store on node 0; 0 picks a free one (the default on one "
        f"host; {DEFAULT_MULTINODE_PORT} with several)",
    )
    p.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help="restart the whole job up to this many times after a failure",
    )
    p.add_argument(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE_SECONDS,
        help="seconds between SIGTERM and SIGKILL when stopping ranks "
        f"(default {DEFAULT_GRACE_SECONDS:g})",
    )
    p.add_argument(
        "--log-dir",
        "--log_dir",
        default=None,
        help="write each rank's output to LOG_DIR/rank_<r>.log and keep error files "
        "and flight-recorder dumps there",
    )
    p.add_argument(
        "--quiet-ranks",
        action="store_true",
        help="show only rank 0's output on the terminal (the others still go to --log-dir)",
    )
    p.add_argument(
        "--no-prefix", action="store_true", help="do not prefix output lines with [r<rank>]"
    )
    p.add_argument(
        "--join-timeout",
        type=float,
        default=300.0,
        help="seconds the launchers of a multi-host job wait for each other (default 300)",
    )
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run the target as a module (python -m), not a script",
    )
    p.add_argument("target", help="the script to run (or the module, with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    cores = _cores()
    if args.nproc_per_node == "auto":
        args.nproc_per_node = cores
    else:
        try:
            args.nproc_per_node = int(args.nproc_per_node)
        except ValueError:
            parser.error(
                f"--nproc-per-node must be a number or 'auto', got {args.nproc_per_node!r}"
            )
    if args.nproc_per_node < 1:
        parser.error("--nproc-per-node must be at least 1")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        parser.error(
            f"--node-rank {args.node_rank} must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes})"
        )
    if args.master_port is None:
        args.master_port = 0 if args.nnodes == 1 else DEFAULT_MULTINODE_PORT
    if args.nnodes > 1 and args.master_port == 0:
        parser.error(
            "a job on several hosts needs a fixed --master-port, the same on every "
            "host, for the launchers to find node 0"
        )
    if args.max_restarts < 0:
        parser.error("--max-restarts must be 0 or more")
    if not args.module and not os.path.exists(args.target):
        parser.error(f"script {args.target!r} not found (use -m to run a module)")
    return args


#: glibc's tunable that keeps ``memmove`` off ``rep movsb``: on AMD's x86 CPUs a copy of 4 KiB
#: to about 1 MiB whose destination starts 1-31 bytes past its source modulo 4 KiB runs there
#: about ten times slower, and two same-sized arrays allocated one after the other on glibc's
#: heap are 16 bytes apart (``benchmarks/copy_distance.py``). Vector copies cost the same at
#: every distance.
REP_MOVSB_OFF = "glibc.cpu.x86_rep_movsb_threshold=4294967295"


def glibc_tunables_for_ranks(env: dict[str, str], cpuinfo: str | None = None) -> str | None:
    """The ``GLIBC_TUNABLES`` a rank should start with on this host, or None to leave it as it
    is: on AMD x86 CPUs, the user's tunables plus :data:`REP_MOVSB_OFF`, unless the user set
    ``x86_rep_movsb_threshold`` themselves. ``cpuinfo``: /proc/cpuinfo's text (read when None)."""
    existing = env.get("GLIBC_TUNABLES", "")
    if "x86_rep_movsb_threshold" in existing:
        return None
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    if "AuthenticAMD" not in cpuinfo:
        return None
    return f"{existing}:{REP_MOVSB_OFF}" if existing else REP_MOVSB_OFF


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass
class RankProcess:
    outcome: RankOutcome
    proc: subprocess.Popen
    error_file: Path

    @property
    def rank(self) -> int:
        return self.outcome.rank


JOB_DIR_PREFIX = "pluribus-run-"
#: The pid of the launcher that owns a temporary job folder.
OWNER_FILE = "launcher.pid"


def remove_abandoned_job_dirs() -> None:
    """Remove the temporary folders of launchers that died without cleaning up (SIGKILL leaves
    no chance to): each holds its launcher's pid, and a folder whose launcher is gone is
    abandoned."""
    for folder in Path(tempfile.gettempdir()).glob(f"{JOB_DIR_PREFIX}*"):
        try:
            pid = int((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if not pid_alive(pid):
            shutil.rmtree(folder, ignore_errors=True)


class Launcher:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.nproc = args.nproc_per_node
        self.world_size = args.nnodes * self.nproc
        self.host = socket.gethostname()
        self.keep_dir = args.log_dir is not None
        if args.log_dir:
            self.job_dir = Path(args.log_dir)
        else:
            remove_abandoned_job_dirs()
            self.job_dir = Path(tempfile.mkdtemp(prefix=JOB_DIR_PREFIX))
            (self.job_dir / OWNER_FILE).write_text(str(os.getpid()))
        self.job_dir.mkdir(parents=True, exist_ok=True)
        self.pump = OutputPump(
            args.log_dir, quiet_ranks=args.quiet_ranks, prefix=not args.no_prefix
        )
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.interrupted: int | None = None
        self.forced = False
        self.token = os.environ.get(AUTH_TOKEN_ENV) or None
        self.env = dict(os.environ)
        self._configure_env()

    # -- set-up --------------------------------------------------------------------------------

    def _configure_env(self) -> None:
        if self.token is None and self.args.nnodes == 1:
            # A fresh secret per job: the store and the peer connections refuse strangers.
            self.token = secrets.token_hex(16)
        elif self.token is None:
            say(
                f"warning: {AUTH_TOKEN_ENV} is not set, so the job's store and connections "
                "accept anyone who can reach them; set the same secret on every host"
            )
        if self.token:
            self.env[AUTH_TOKEN_ENV] = self.token
        cores = _cores()
        if "OMP_NUM_THREADS" not in self.env and self.nproc > 1:
            # Each rank's BLAS would start one thread per core: with several ranks they spin
            # against each other (torchrun makes the same choice).
            threads = max(1, cores // self.nproc)
            self.env["OMP_NUM_THREADS"] = str(threads)
            say(
                f"note: OMP_NUM_THREADS={threads} for each rank ({self.nproc} ranks on {cores} "
                "cores would fight over them); set OMP_NUM_THREADS yourself to choose otherwise"
            )
        tunables = glibc_tunables_for_ranks(self.env)
        if tunables is not None:
            self.env["GLIBC_TUNABLES"] = tunables
        self.env["PYTHONUNBUFFERED"] = "1"

    def _coordinator(self) -> SingleNode:
        a = self.args
        if a.nnodes == 1:
            return SingleNode(a.master_addr, a.master_port, self.token, a.join_timeout)
        config = {"nnodes": a.nnodes, "nproc_per_node": self.nproc, "max_restarts": a.max_restarts}
        return MultiNode(
            a.master_addr, a.master_port, self.token, a.join_timeout, a.node_rank, a.nnodes, config
        )

    def _on_signal(self, signum, frame) -> None:
        if self.interrupted is not None:
            self.forced = True  # a second Ctrl-C: no more grace
        self.interrupted = signum
        self.events.put(("signal", signum, time.time()))

    # -- the job -------------------------------------------------------------------------------

    def run(self) -> int:
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        coordinator = None
        try:
            try:
                coordinator = self._coordinator()
            except PluribusError as exc:
                say(f"error: {exc}")
                return 1
            attempts = self.args.max_restarts + 1
            for attempt in range(attempts):
                decision = self.run_attempt(coordinator, attempt)
                if decision["ok"]:
                    return 0
                root = RankOutcome.from_json(decision["root"]) if decision["root"] else None
                ranks = [RankOutcome.from_json(r) for r in decision["ranks"]]
                interrupted = decision.get("interrupted")
                where = str(self.job_dir) if self.keep_dir else None
                print(
                    format_summary(root, ranks, attempt, attempts, where, interrupted),
                    file=sys.stderr,
                    flush=True,
                )
                if decision.get("missing_nodes"):
                    say(f"the launchers of nodes {decision['missing_nodes']} did not report")
                if not decision["restart"]:
                    return int(decision["exit_code"])
                say(
                    f"restarting the job (restart {attempt + 1} of {self.args.max_restarts}, "
                    f"{RESTART_ENV}={attempt + 1})"
                )
            return 1
        finally:
            if coordinator is not None:
                coordinator.close()
            self.pump.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
            if not self.keep_dir:
                shutil.rmtree(self.job_dir, ignore_errors=True)

    def run_attempt(self, coordinator: SingleNode, attempt: int) -> dict[str, Any]:
        attempt_dir = self.job_dir / f"attempt_{attempt}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        for stale in attempt_dir.glob("*.json"):
            stale.unlink()
        try:
            addr, port = coordinator.start_attempt(attempt)
        except PluribusError as exc:
            say(f"error: {exc}")
            return {
                "ok": False,
                "restart": False,
                "exit_code": 1,
                "root": None,
                "ranks": [],
                "interrupted": None,
            }
        ranks = self.spawn(attempt, addr, port, attempt_dir)
        stop_time, lost = self.supervise(coordinator, attempt, ranks)
        self.pump.wait_drained(2.0)
        for rp in ranks:
            rp.outcome.error = read_json(rp.error_file)
            rp.outcome.collective = collective_status(self._flight_dir(attempt_dir), rp.rank)
            if not rp.outcome.ok and not rp.outcome.error:
                rp.outcome.stderr_tail = self.pump.tail(rp.rank)
        self._merge_traces()
        report = {
            "node": self.args.node_rank,
            "stop_time": stop_time,
            "interrupted": signal.Signals(self.interrupted).name if self.interrupted else None,
            "ranks": [rp.outcome.to_json() for rp in ranks],
        }
        if lost:
            say(f"error: {lost}")
            return self._decide(attempt, [report], missing_nodes=[0])
        try:
            return coordinator.decide(attempt, report, functools.partial(self._decide, attempt))
        except PluribusError as exc:
            say(f"error: lost the other launchers: {exc}")
            return self._decide(attempt, [report], missing_nodes=[0])

    def _merge_traces(self) -> None:
        directory = self.env.get(TRACE_ENV)
        if not directory:
            return
        try:
            merged = merge_traces(directory)
        except OSError as exc:
            say(f"could not merge the trace files in {directory}: {exc}")
            return
        if merged is not None:
            say(f"trace of this host's ranks: {merged} (open it in ui.perfetto.dev)")

    def _flight_dir(self, attempt_dir: Path) -> Path:
        return Path(self.env[FLIGHT_DIR_ENV]) if FLIGHT_DIR_ENV in os.environ else attempt_dir

    def spawn(self, attempt: int, addr: str, port: int, attempt_dir: Path) -> list[RankProcess]:
        a = self.args
        target = ["-m", a.target] if a.module else [a.target]
        command = [sys.executable, bootstrap.__file__, *target, *a.args]
        ranks = []
        for local in range(self.nproc):
            rank = a.node_rank * self.nproc + local
            error_file = attempt_dir / f"error_r{rank}.json"
            env = dict(self.env)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(local),
                WORLD_SIZE=str(self.world_size),
                LOCAL_WORLD_SIZE=str(self.nproc),
                GROUP_RANK=str(a.node_rank),
                NODE_RANK=str(a.node_rank),
                MASTER_ADDR=addr,
                MASTER_PORT=str(port),
                PLURIBUS_STORE_SERVED="1",
                PLURIBUS_MAX_RESTARTS=str(a.max_restarts),
                **{
                    RESTART_ENV: str(attempt),
                    ERROR_FILE_ENV: str(error_file),
                    LAUNCHER_PID_ENV: str(os.getpid()),
                },
            )
            env.setdefault(FLIGHT_DIR_ENV, str(attempt_dir))
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            try:
                proc = subprocess.Popen(
                    command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out_w,
                    stderr=err_w,
                    start_new_session=True,
                )
            finally:
                os.close(out_w)
                os.close(err_w)
            header = f"===== attempt {attempt} ({RESTART_ENV}={attempt}) =====" if attempt else None
            self.pump.add(rank, out_r, err_r, header)
            outcome = RankOutcome(rank, local, a.node_rank, self.host, proc.pid)
            rp = RankProcess(outcome, proc, error_file)
            threading.Thread(
                target=self._wait, args=(rp,), daemon=True, name=f"pluribus-run-wait-{rank}"
            ).start()
            ranks.append(rp)
        return ranks

    def _wait(self, rp: RankProcess) -> None:
        rp.proc.wait()
        self.events.put(("exit", rp, time.time()))

    def supervise(
        self, coordinator: SingleNode, attempt: int, ranks: list[RankProcess]
    ) -> tuple[float | None, str | None]:
        """Wait for the ranks; stop them all on the first failure, a signal or a remote stop.

        Returns when the SIGTERM went out (None if never) and why the other launchers were lost.
        """
        running = {rp.rank: rp for rp in ranks}
        stop_time: float | None = None
        kill_at: float | None = None
        lost: str | None = None
        while running:
            try:
                event = self.events.get(timeout=0.05)
            except queue.Empty:
                event = None
            reason = None
            if event is not None and event[0] == "exit":
                rp, when = event[1], event[2]
                if rp.rank in running:
                    del running[rp.rank]
                    rp.outcome.returncode = rp.proc.returncode
                    rp.outcome.exit_time = when
                    if rp.proc.returncode != 0:
                        reason = "failure"
            if self.interrupted is not None:
                reason = reason or "signal"
            if stop_time is None and reason is None and running:
                try:
                    if coordinator.stop_requested(attempt):
                        reason = "remote"
                except PluribusError as exc:
                    lost, reason = str(exc), "lost"
            if reason is not None and stop_time is None:
                if reason in ("failure", "signal"):
                    try:
                        coordinator.request_stop(attempt)
                    except PluribusError as exc:
                        lost = str(exc)
                stop_time = time.time()
                kill_at = time.monotonic() + self.args.grace_period
                self._signal_all(running.values(), signal.SIGTERM)
            if kill_at is not None and (self.forced or time.monotonic() > kill_at):
                self._signal_all(running.values(), signal.SIGKILL)
                kill_at = float("inf")
        self._reap_leftovers(ranks)
        return stop_time, lost

    def _signal_all(self, ranks, signum: int) -> None:
        for rp in list(ranks):
            rp.outcome.stopped_by_launcher = True
            _killpg(rp.proc.pid, signum)

    def _reap_leftovers(self, ranks: list[RankProcess]) -> None:
        """Processes a rank started in its session outlive it: stop them too (no orphans)."""
        groups = [rp.proc.pid for rp in ranks if _killpg(rp.proc.pid, 0)]
        if not groups:
            return
        for pgid in groups:
            _killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + min(self.args.grace_period, 2.0)
        while time.monotonic() < deadline and any(_killpg(g, 0) for g in groups):
            time.sleep(0.02)
        for pgid in groups:
            _killpg(pgid, signal.SIGKILL)

    def _decide(
        self, attempt: int, reports: list[dict[str, Any]], missing_nodes: list[int] = ()
    ) -> dict[str, Any]:
        """The verdict on an attempt from every node's report (the same on every node)."""
        outcomes = [RankOutcome.from_json(r) for rep in reports for r in rep["ranks"]]
        outcomes.sort(key=lambda o: o.rank)
        stops = [rep["stop_time"] for rep in reports if rep.get("stop_time") is not None]
        interrupted = next((rep["interrupted"] for rep in reports if rep.get("interrupted")), None)
        ok = (
            bool(outcomes) and all(o.ok for o in outcomes) and not missing_nodes and not interrupted
        )
        root = root_cause(outcomes, min(stops) if stops else None)
        if ok:
            exit_code = 0
        elif root is not None and not interrupted:
            exit_code = root.exit_code
        elif interrupted:
            exit_code = 128 + signal.Signals[interrupted].value
        else:
            exit_code = 1
        restart = (
            not ok and not interrupted and not missing_nodes and attempt < self.args.max_restarts
        )
        return {
            "ok": ok,
            "restart": restart,
            "exit_code": exit_code,
            "root": root.to_json() if root else None,
            "ranks": [o.to_json() for o in outcomes],
            "interrupted": interrupted,
            "missing_nodes": list(missing_nodes),
        }


def _killpg(pgid: int, signum: int) -> bool:
    """Signal a rank's process group; False when it no longer exists."""
    try:
        os.killpg(pgid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code = Launcher(args).run()
    sys.exit(code)

"""Kill one rank of a 4-rank job mid-collective and collect what the survivors said.

Used by ``test_dead_peers.py`` (a few runs per backend) and ``scripts/fault-repeat.py`` (20 per
backend). The job is a plain env:// job whose rank 0 serves the store, so killing rank 0 also
takes the store away, as in a real job.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "kill_job.py")


@dataclass
class Outcome:
    backend: str
    victim: int
    killed_at: float
    survivors: dict[int, dict] = field(default_factory=dict)
    exit_codes: dict[int, int] = field(default_factory=dict)
    leaked_shm: list[str] = field(default_factory=list)
    leaked_processes: list[int] = field(default_factory=list)

    def problems(self, within: float = 5.0) -> list[str]:
        """Every broken promise of this run, in words (empty when all held)."""
        found = []
        for rank, code in self.exit_codes.items():
            if rank != self.victim and code != 0:
                found.append(f"rank {rank} ended with exit code {code} (signal {-code})")
        for rank in self.exit_codes:
            if rank == self.victim:
                continue
            got = self.survivors.get(rank)
            if got is None:
                found.append(f"rank {rank} wrote no result")
                continue
            if got.get("error") != "PeerError":
                found.append(f"rank {rank} raised {got.get('error')}: {got.get('message')}")
            elif got.get("peer") != self.victim:
                found.append(f"rank {rank} blamed rank {got.get('peer')}: {got.get('message')}")
            elif got["raised_at"] - self.killed_at > within:
                took = got["raised_at"] - self.killed_at
                found.append(f"rank {rank} raised after {took:.1f}s")
            if "wrong" in got:
                found.append(f"rank {rank} computed a wrong sum {got['wrong']}")
            if got.get("later") == "returned" or got.get("later_seconds", 0) > within:
                found.append(
                    f"rank {rank}: a later barrier {got.get('later')} after "
                    f"{got.get('later_seconds', 0):.1f}s"
                )
        found += [f"leaked /dev/shm/{name}" for name in self.leaked_shm]
        found += [f"leaked process {pid}" for pid in self.leaked_processes]
        return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shm_of(pids: list[int]) -> list[str]:
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return sorted(n for n in names if any(str(pid) in n for pid in pids))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_a_rank(
    backend: str,
    victim: int,
    world: int = 4,
    env: dict[str, str] | None = None,
    delay: float = 0.3,
    limit: float = 90.0,
) -> Outcome:
    """Start the job, SIGKILL ``victim`` ``delay`` seconds after every rank is in its loop,
    wait for the rest; every process is killed and reaped before this returns."""
    with tempfile.TemporaryDirectory(prefix="pluribus-faults-") as outdir:
        base = dict(os.environ)
        base.update(env or {})
        base.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            WORLD_SIZE=str(world),
            PYTHONUNBUFFERED="1",
        )
        procs = []
        for rank in range(world):
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            procs.append(
                subprocess.Popen(
                    [sys.executable, JOB, backend, outdir],
                    env=rank_env,
                    stdout=subprocess.DEVNULL,
                    stderr=open(os.path.join(outdir, f"stderr{rank}"), "w"),
                )
            )
        pids = [p.pid for p in procs]
        outcome = Outcome(backend, victim, 0.0)
        try:
            deadline = time.monotonic() + limit
            while not all(os.path.exists(os.path.join(outdir, f"ready{r}")) for r in range(world)):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"the job did not start: {_stderr(outdir, world)}")
                time.sleep(0.05)
            time.sleep(delay)
            outcome.killed_at = time.time()
            procs[victim].send_signal(signal.SIGKILL)
            for proc in procs:
                proc.wait(max(1.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        outcome.exit_codes = {r: p.returncode for r, p in enumerate(procs)}
        for rank in range(world):
            path = os.path.join(outdir, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    outcome.survivors[rank] = json.load(f)
        outcome.leaked_shm = _shm_of(pids)
        outcome.leaked_processes = [pid for pid in pids if _alive(pid)]
        if outcome.problems():
            outcome.stderr = _stderr(outdir, world)
        return outcome


def _stderr(outdir: str, world: int) -> str:
    parts = []
    for rank in range(world):
        try:
            with open(os.path.join(outdir, f"stderr{rank}")) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            parts.append(f"--- rank {rank}:\n{text[-1500:]}")
    return "\n".join(parts)

"""Kill one rank of a 4-rank job mid-collective and collect what the survivors said.

Used by ``test_dead_peers.py`` (a few runs per backend) and ``scripts/fault-repeat.py`` (20 per
backend). The job is a plain env:// job whose rank 0 serves the store, so killing rank 0 also
takes the store away, as in a real job. The mpi job runs under mpiexec, which kills the other
ranks itself: there the promise is that the job's output names the dead rank and its pid (the
plugin's watcher says it; mpiexec names a PID, often another rank's) and that the job ends
within seconds.
"""

from __future__ import annotations

import json
import os
import shutil
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
    #: mpi: what mpiexec printed, the dead rank's pid, and when mpiexec returned
    output: str = ""
    victim_pid: int = 0
    ended_at: float = 0.0

    def problems(self, within: float = 5.0) -> list[str]:
        """Every broken promise of this run, in words (empty when all held)."""
        found = self._mpi_problems(within) if self.backend == "mpi" else self._rank_problems(within)
        found += [f"leaked {name}" for name in self.leaked_shm]
        found += [f"leaked process {pid}" for pid in self.leaked_processes]
        return found

    def _mpi_problems(self, within: float) -> list[str]:
        found = []
        if f"rank {self.victim} (pid {self.victim_pid} on" not in self.output:
            found.append(f"the output does not name rank {self.victim} (pid {self.victim_pid})")
        elif self.output.count("without finishing") != 1:
            found.append("the output blames more than one rank")
        if self.ended_at - self.killed_at > within:
            found.append(f"the job ended after {self.ended_at - self.killed_at:.1f}s")
        return found

    def _rank_problems(self, within: float) -> list[str]:
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
    return sorted(f"/dev/shm/{n}" for n in names if any(str(pid) in n for pid in pids))


def deathwatch_processes(ranks: list[int]) -> list[int]:
    """The pids of the mpi plugin's watcher processes running now for the ranks whose pids are
    ``ranks`` (a watcher's command line lists its ranks as ``rank:pid``; other jobs' watchers,
    another session's tests say, are not this job's leak)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                words = f.read().split(b"\0")
        except OSError:
            continue
        if b"pluribus_mpi.deathwatch" not in words:
            continue
        at = words.index(b"pluribus_mpi.deathwatch") + 2  # after the listener's descriptor
        listed = words[at].split(b",") if at < len(words) else []
        if {int(entry.split(b":")[1]) for entry in listed if b":" in entry} & set(ranks):
            found.append(int(pid))
    return found


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
    hosts: int = 1,
) -> Outcome:
    """Start the job, SIGKILL ``victim`` ``delay`` seconds after every rank is in its loop,
    wait for the rest; every process is killed and reaped before this returns. ``hosts``
    (mpi only) splits the ranks into that many "hosts" on this machine, each with its watcher."""
    if backend == "mpi":
        return _kill_under_mpiexec(victim, world, env, delay, limit, hosts)
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


def _kill_under_mpiexec(
    victim: int, world: int, env: dict[str, str] | None, delay: float, limit: float, hosts: int
) -> Outcome:
    """The same run as an mpiexec job: ``mpiexec -n world python kill_job.py mpi OUTDIR``, or
    on ``hosts`` "hosts" ``mpiexec -n 2 -env PLURIBUS_MPI_HOST host0 python ... : -n 2 ...``."""
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which(
        "mpiexec"
    )
    if mpiexec is None:
        raise RuntimeError("no mpiexec: pip install mpich")
    with tempfile.TemporaryDirectory(prefix="pluribus-faults-") as outdir:
        job_env = {k: v for k, v in os.environ.items() if not k.startswith(("PLURIBUS_", "PMI_"))}
        job_env.update(env or {}, PYTHONUNBUFFERED="1")
        with open(os.path.join(outdir, "output"), "w") as out:
            command = [mpiexec]
            for host in range(hosts):
                if host:
                    command.append(":")
                command += ["-n", str(world // hosts)]
                if hosts > 1:
                    command += ["-env", "PLURIBUS_MPI_HOST", f"host{host}"]
                command += [sys.executable, JOB, "mpi", outdir]
            proc = subprocess.Popen(
                command,
                env=job_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        outcome = Outcome("mpi", victim, 0.0)
        pids: list[int] = []
        try:
            deadline = time.monotonic() + limit
            while not all(_read(outdir, f"ready{r}").strip() for r in range(world)):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"the job did not start: {_read(outdir, 'output')}")
                time.sleep(0.05)
            pids = [int(_read(outdir, f"ready{r}")) for r in range(world)]
            time.sleep(delay)
            outcome.killed_at = time.time()
            outcome.victim_pid = pids[victim]
            os.kill(pids[victim], signal.SIGKILL)
            proc.wait(max(1.0, deadline - time.monotonic()))
            outcome.ended_at = time.time()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        outcome.exit_codes = {0: proc.returncode}
        outcome.output = _read(outdir, "output")
        segments = set()
        for rank in range(world):
            segments.update(_read(outdir, f"segments{rank}").split())
        wait_until = time.monotonic() + 5  # the watcher exits once it has seen every rank go
        while deathwatch_processes(pids) and time.monotonic() < wait_until:
            time.sleep(0.05)
        outcome.leaked_shm = sorted(s for s in segments if os.path.exists(s))
        outcome.leaked_processes = [p for p in pids if _alive(p)] + deathwatch_processes(pids)
        if outcome.problems():
            outcome.stderr = outcome.output[-3000:]
        return outcome


def _read(outdir: str, name: str) -> str:
    try:
        with open(os.path.join(outdir, name)) as f:
            return f.read()
    except OSError:
        return ""


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

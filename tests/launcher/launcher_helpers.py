"""Running ``pluribus-run`` in tests: a launcher subprocess that never outlives its test, and a
check that a job left no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: Put at the top of a rank script to reach the test-only ``storewire`` backend.
STOREWIRE_PRELUDE = f"""\
import sys
sys.path.insert(0, {str(HERE)!r})
import launcher_store_backend
launcher_store_backend.register()
"""


def write_script(directory: Path, name: str, body: str, storewire: bool = False) -> Path:
    path = directory / name
    text = textwrap.dedent(body)
    path.write_text((STOREWIRE_PRELUDE if storewire else "") + text)
    return path


def launcher_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pluribus.run", *args]


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without anything a launcher or rank would inherit from
    an outer job."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PLURIBUS_")
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(extra)
    return env


def run_launcher(
    *args: str, timeout: float = 60, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run the launcher to the end; on timeout kill its whole session and fail."""
    proc = start_launcher(*args, cwd=cwd, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        out, err = proc.communicate()
        raise AssertionError(
            f"pluribus-run {' '.join(args)} did not finish in {timeout}s\nstdout:\n{out}\n"
            f"stderr:\n{err}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start_launcher(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, prefix=()
) -> subprocess.Popen:
    return subprocess.Popen(
        [*prefix, *launcher_command(*args)],
        cwd=cwd,
        env=env if env is not None else clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def processes_mentioning(marker: str) -> list[tuple[int, str]]:
    """Live processes whose command line contains ``marker`` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmdline and state != "Z":
            found.append((int(entry.name), cmdline))
    return found


def assert_no_processes(marker: str, within: float = 3.0) -> None:
    """Fail (after killing them) if processes mentioning ``marker`` are still alive."""
    deadline = time.monotonic() + within
    left = processes_mentioning(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = processes_mentioning(marker)
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left behind: {left}"


def job_backends() -> list:
    """Backends a launched test job runs on: the test-only "storewire" backend, and gloo where
    the plugin is installed (installed but unusable fails instead of skipping)."""
    import importlib.util

    import pytest

    return [
        "storewire",
        pytest.param(
            "gloo",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("pluribus_gloo") is None,
                reason='the gloo plugin is not installed (pip install "pluribus[gloo]")',
            ),
        ),
    ]

"""pluribus-run under faults: an exit code is a root cause ordered by when it happened, and a
launcher killed by SIGKILL leaves no temporary folder for long."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launcher"))

from launcher_helpers import (  # noqa: E402
    assert_no_processes,
    kill_session,
    run_launcher,
    start_launcher,
    write_script,
)

EXITS = """
import sys, time
import numpy as np
import pluribus
pluribus.init_process_group("gloo", timeout=30)
x = np.ones(1 << 16, dtype=np.float32)
pluribus.all_reduce(x)
if pluribus.get_rank() == 3:
    time.sleep(0.5)
    sys.exit(1)
for _ in range(1000):
    pluribus.all_reduce(x)  # the others hear of rank 3's exit here
"""


@pytest.mark.timeout(120)
def test_an_exit_code_is_the_root_cause_not_the_peer_errors_it_caused(tmp_path):
    script = write_script(tmp_path, "exits.py", EXITS)
    for _ in range(2):
        result = run_launcher("--nproc-per-node", "4", str(script), timeout=90)
        assert result.returncode == 1
        summary = result.stderr[result.stderr.index("=" * 72) :]
        assert "root cause: rank 3 exited with code 1" in summary, summary
    assert_no_processes(str(tmp_path))


SLEEPS = """
import os, time
print("ready", flush=True)
time.sleep(60)
"""


def _job_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("pluribus-run-*")}


@pytest.mark.timeout(60)
def test_a_launcher_killed_by_sigkill_leaves_no_temporary_folder_behind(tmp_path):
    before = _job_dirs()
    script = write_script(tmp_path, "sleeps.py", SLEEPS)
    proc = start_launcher("--nproc-per-node", "1", str(script))
    try:
        deadline = time.monotonic() + 30
        while not (_job_dirs() - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        kill_session(proc)
    abandoned = _job_dirs() - before
    assert abandoned, "the launcher made no temporary folder"
    # the next launcher removes it
    quick = write_script(tmp_path, "quick.py", "print('done')\n")
    assert run_launcher("--nproc-per-node", "1", str(quick)).returncode == 0
    assert not (abandoned & _job_dirs()), f"left behind: {abandoned & _job_dirs()}"


@pytest.mark.parametrize("message, code", [("1", 1), ("3", 3), ("bad configuration", 1)])
def test_a_rank_stopped_while_its_exit_ran_is_described_by_its_exit_code(message, code):
    """Under load the launcher's stop can reach a rank whose sys.exit is still shutting the
    interpreter down: the summary still names the exit code, not a SystemExit 'raised'."""
    from pluribus.run.summary import RankOutcome

    outcome = RankOutcome(
        rank=3,
        local_rank=3,
        node_rank=0,
        host="h",
        pid=1,
        returncode=-signal.SIGTERM,
        stopped_by_launcher=True,
        error={"exc_type": "SystemExit", "message": message, "time": 1.0},
    )
    assert outcome.how().startswith(f"exited with code {code} ")
    assert outcome.exit_code == code

"""pluribus-run when things go wrong: a rank raises, is killed, hangs; restarts; Ctrl-C."""

from __future__ import annotations

import os
import signal
import time

import pytest
from launcher_helpers import (
    assert_no_processes,
    kill_session,
    processes_mentioning,
    run_launcher,
    start_launcher,
    write_script,
)

# Rank 2 raises from a named function while the others would sleep for a minute.
RAISES = """
import os, time
rank = int(os.environ["RANK"])

def load_shard(index):
    raise RuntimeError(f"shard {index} is corrupt")

if rank == 2:
    time.sleep(0.5)
    load_shard(17)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_rank_that_raises_is_named_with_its_traceback_and_the_others_stopped(tmp_path):
    script = write_script(tmp_path, "raises.py", RAISES)
    start = time.monotonic()
    result = run_launcher("--nproc-per-node", "4", "--grace-period", "3", str(script))
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    summary = result.stderr[result.stderr.index("=" * 72) :]
    assert "root cause: rank 2 raised RuntimeError (exit code 1)" in summary
    assert "Traceback (most recent call last)" in summary
    assert "in load_shard" in summary and "RuntimeError: shard 17 is corrupt" in summary
    assert "bootstrap" not in summary and "runpy" not in summary  # the user's frames only
    for rank in (0, 1, 3):
        assert f"rank {rank} (host " in summary and "stopped by the launcher (SIGTERM)" in summary
    assert elapsed < 30, f"the other ranks were not stopped promptly ({elapsed:.1f}s)"
    assert_no_processes(str(tmp_path))


@pytest.mark.timeout(60)
def test_exit_code_of_the_failing_rank_is_the_launchers(tmp_path):
    script = write_script(
        tmp_path,
        "exit7.py",
        """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(7)
        time.sleep(60)
        """,
    )
    result = run_launcher("--nproc-per-node", "2", str(script))
    assert result.returncode == 7
    assert "root cause: rank 1 exited with code 7" in result.stderr
    assert_no_processes(str(tmp_path))


@pytest.mark.timeout(60)
def test_rank_killed_by_sigkill_is_reported_with_the_signal(tmp_path):
    script = write_script(
        tmp_path,
        "killed.py",
        """
        import os, signal, time
        if os.environ["RANK"] == "1":
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        """,
    )
    result = run_launcher("--nproc-per-node", "3", str(script))
    assert result.returncode == 128 + signal.SIGKILL
    assert "root cause: rank 1 killed by SIGKILL (exit code 137)" in result.stderr
    assert_no_processes(str(tmp_path))


@pytest.mark.timeout(60)
def test_rank_crashing_in_native_code_shows_its_python_stack(tmp_path):
    script = write_script(
        tmp_path,
        "segfault.py",
        """
        import ctypes, os, time
        def parse_header():
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        if os.environ["RANK"] == "0":
            parse_header()
        time.sleep(60)
        """,
    )
    result = run_launcher("--nproc-per-node", "2", str(script))
    assert result.returncode == 128 + signal.SIGSEGV
    summary = result.stderr[result.stderr.index("=" * 72) :]
    assert "root cause: rank 0 killed by SIGSEGV" in summary
    assert "no Python traceback (it died in native code or was killed)" in summary
    assert "Fatal Python error: Segmentation fault" in summary
    assert "in parse_header" in summary
    assert_no_processes(str(tmp_path))


@pytest.mark.timeout(90)
def test_restart_succeeds_on_the_second_attempt(tmp_path):
    attempts = tmp_path / "attempts"
    attempts.mkdir()
    script = write_script(
        tmp_path,
        "flaky.py",
        f"""
        import os, pathlib, time
        rank, restart = os.environ["RANK"], int(os.environ["PLURIBUS_RESTART_COUNT"])
        pathlib.Path({str(attempts)!r}, f"{{restart}}-{{rank}}").touch()
        if rank == "1" and restart == 0:
            # fail only once rank 0 has started, or the launcher stops it before it runs
            deadline = time.monotonic() + 30
            while not pathlib.Path({str(attempts)!r}, "0-0").exists():
                assert time.monotonic() < deadline, "rank 0 never started"
                time.sleep(0.01)
            raise SystemExit("first attempt fails")
        print(f"rank {{rank}} done in attempt {{restart}}")
        """,
    )
    logs = tmp_path / "logs"
    result = run_launcher(
        "--nproc-per-node", "2", "--max-restarts", "3", "--log-dir", str(logs), str(script)
    )
    assert result.returncode == 0, result.stderr
    assert "restarting the job (restart 1 of 3, PLURIBUS_RESTART_COUNT=1)" in result.stderr
    assert sorted(p.name for p in attempts.iterdir()) == ["0-0", "0-1", "1-0", "1-1"]
    assert "[r1] rank 1 done in attempt 1" in result.stdout
    log = (logs / "rank_1.log").read_text()
    assert "first attempt fails" in log and "rank 1 done in attempt 1" in log


@pytest.mark.timeout(90)
def test_restarts_run_out_and_the_last_failure_is_reported(tmp_path):
    script = write_script(
        tmp_path,
        "always.py",
        """
        import os, sys
        if os.environ["RANK"] == "0":
            sys.exit(3)
        """,
    )
    result = run_launcher("--nproc-per-node", "2", "--max-restarts", "2", str(script))
    assert result.returncode == 3
    assert result.stderr.count("root cause: rank 0 exited with code 3") == 3
    assert "attempt 3 of 3" in result.stderr
    assert "restart 2 of 2" in result.stderr and "restart 3" not in result.stderr


# The ranks start a child of their own (a data-loader worker, say) and sleep.
SLEEPERS = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
print("ready", flush=True)
time.sleep(60)
"""


def _wait_for_ready(proc, count: int, timeout: float = 30.0) -> None:
    seen = 0
    deadline = time.monotonic() + timeout
    while seen < count and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += "ready" in line
    assert seen == count, f"only {seen} of {count} ranks started"


@pytest.mark.timeout(60)
def test_ctrl_c_stops_every_rank_and_their_children(tmp_path):
    marker = str(tmp_path)
    script = write_script(tmp_path, "sleepers.py", SLEEPERS.format(marker=marker))
    proc = start_launcher("--nproc-per-node", "2", str(script))
    try:
        _wait_for_ready(proc, 2)
        time.sleep(0.2)  # the grandchildren are started before "ready"
        assert len(processes_mentioning(marker)) >= 5  # launcher, 2 ranks, 2 children
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        kill_session(proc)
    assert proc.returncode == 128 + signal.SIGINT
    assert "stopped by SIGINT" in err
    assert_no_processes(marker)


@pytest.mark.timeout(60)
def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path):
    marker = str(tmp_path)
    script = write_script(tmp_path, "sleepers.py", SLEEPERS.format(marker=marker))
    proc = start_launcher("--nproc-per-node", "2", str(script))
    try:
        _wait_for_ready(proc, 2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        # The ranks get SIGKILL from the kernel (PR_SET_PDEATHSIG) ...
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            ranks = [c for _, c in processes_mentioning(marker) if "bootstrap" in c]
            if not ranks:
                break
            time.sleep(0.05)
        assert not ranks, f"ranks outlived their launcher: {ranks}"
    finally:
        kill_session(proc)
        # ... their own children are orphans that only a launcher still alive could stop.
        for pid, _ in processes_mentioning(marker):
            os.kill(pid, signal.SIGKILL)


HANGS = """
import os
import numpy as np
import pluribus
pluribus.init_process_group("storewire", timeout=60)
rank = pluribus.get_rank()
x = np.ones(8, dtype=np.float32)
pluribus.all_reduce(x)
if rank == 3:
    raise ValueError("rank 3 stops early")
pluribus.all_reduce(x)  # the others wait here for rank 3, or hear of its exit
"""


@pytest.mark.timeout(90)
def test_summary_says_which_collective_each_rank_was_stuck_in(tmp_path):
    script = write_script(tmp_path, "hangs.py", HANGS, storewire=True)
    logs = tmp_path / "logs"
    result = run_launcher("--nproc-per-node", "4", "--log-dir", str(logs), str(script))
    assert result.returncode == 1
    err = result.stderr
    assert "root cause: rank 3 raised ValueError (exit code 1)" in err
    assert "ValueError: rank 3 stops early" in err
    assert "rank 3 last collective all_reduce(shape=(8,), dtype=float32, op=sum) #1" in err
    for rank in range(3):
        line = next(x for x in err.splitlines() if x.strip().startswith(f"rank {rank} (host"))
        # The core's lifelines tell the others of rank 3's exit at once: by the time the
        # launcher stops them their all_reduce has usually failed (PeerError), else it waits.
        call = "all_reduce(shape=(8,), dtype=float32, op=sum) #2 on group 'world'"
        assert f"was in {call}" in line or f"last collective {call} failed" in line, line
    dumps = sorted(p.name for p in (logs / "attempt_0").glob("flight_recorder_r*.json"))
    assert dumps == [f"flight_recorder_r{r}.json" for r in range(4)]
    assert_no_processes(str(tmp_path))

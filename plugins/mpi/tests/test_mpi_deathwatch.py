"""The watcher that names a dead rank (``pluribus_mpi.deathwatch``), without MPI: two stand-in
ranks connect and hold their mutexes, one says goodbye and one is killed; the watcher names only
the killed one, refuses a connection from a process that is not a rank, and exits once both are
gone."""

from __future__ import annotations

import secrets
import signal
import socket
import subprocess
import sys

import pytest

RANK = """
import sys, threading
from pluribus_mpi import deathwatch

sys.stdin.readline()
assert deathwatch.connect(bytes.fromhex(sys.argv[1]))
print("connected", flush=True)
sys.stdin.readline()
if sys.argv[2] == "bye":
    deathwatch.farewell(deathwatch.GOODBYE)
else:
    threading.Event().wait()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets: Linux")
@pytest.mark.timeout(60)
def test_the_watcher_names_the_rank_that_died_and_no_other():
    name = b"\0pluribus-mpi-test-" + secrets.token_hex(8).encode()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(name)
    listener.listen(8)
    ranks = {
        word: subprocess.Popen(
            [sys.executable, "-c", RANK, name.hex(), word],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for word in ("bye", "die")
    }
    table = f"5:{ranks['bye'].pid},7:{ranks['die'].pid}"
    watcher = subprocess.Popen(
        [sys.executable, "-m", "pluribus_mpi.deathwatch", str(listener.fileno()), table],
        pass_fds=[listener.fileno()],
        stderr=subprocess.PIPE,
        text=True,
    )
    listener.close()
    try:
        # while the watcher still listens for the ranks
        assert _refused(name), "the watcher kept a connection from a process that is no rank"
        for rank in ranks.values():
            rank.stdin.write("connect\n")
            rank.stdin.flush()
            assert rank.stdout.readline().strip() == "connected"
        ranks["bye"].communicate("go\n", timeout=10)
        ranks["die"].send_signal(signal.SIGKILL)
        ranks["die"].wait(10)
        _, said = watcher.communicate(timeout=20)
    finally:
        for proc in (*ranks.values(), watcher):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    dead = ranks["die"].pid
    assert f"rank 7 (pid {dead} on {socket.gethostname()}) ended" in said, said
    assert "rank 5" not in said and said.count("without finishing") == 1, said
    assert watcher.returncode == 0, said


def _refused(name: bytes) -> bool:
    with socket.socket(socket.AF_UNIX) as stranger:
        stranger.settimeout(10)
        try:
            stranger.connect(name)
            return stranger.recv(1) == b""
        except (ConnectionRefusedError, ConnectionResetError):
            return True


def test_the_watcher_is_off_when_asked(monkeypatch):
    from pluribus_mpi import deathwatch

    monkeypatch.setenv(deathwatch.ENV, "0")
    assert not deathwatch.enabled()
    monkeypatch.setenv(deathwatch.ENV, "1")
    assert deathwatch.enabled() == sys.platform.startswith("linux")

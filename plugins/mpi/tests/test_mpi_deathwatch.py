"""The watcher that names a dead rank (``pluribus_mpi.deathwatch``), without MPI: two stand-in
ranks connect and hold their mutexes, one says goodbye and one is killed; the watcher names only
the killed one, refuses a connection from a process that is not a rank, and exits once both are
gone."""

from __future__ import annotations

import os
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets: Linux")
@pytest.mark.timeout(60)
def test_the_hub_prints_the_earliest_end_of_every_host_and_ignores_strangers():
    """The hub (the watcher of rank 0's host) takes ends from watchers that send its token: a
    death on another host earlier than this host's own is the one printed, once; a connection
    without the token gets no answer and its forged end is not printed."""
    import json
    import time

    from pluribus_mpi import deathwatch

    name = b"\0pluribus-mpi-test-" + secrets.token_hex(8).encode()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(name)
    listener.listen(8)
    hub = socket.create_server(("127.0.0.1", 0))
    token = secrets.token_hex(16)
    local = subprocess.Popen(
        [sys.executable, "-c", RANK, name.hex(), "die"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    given, giver = os.pipe()
    os.write(giver, token.encode() + b"\n")
    os.close(giver)
    watcher = subprocess.Popen(
        [sys.executable, "-m", "pluribus_mpi.deathwatch", str(listener.fileno()), f"0:{local.pid}"]
        + ["--hub", str(hub.fileno())],
        pass_fds=[listener.fileno(), hub.fileno()],
        stdin=given,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(given)
    address = hub.getsockname()
    listener.close()
    hub.close()

    def end(rank: int, host: str, at: float) -> bytes:
        fields = {"kind": "died", "rank": rank, "pid": 99, "host": host, "at": at, "after": []}
        return json.dumps(fields).encode() + b"\n"

    try:
        local.stdin.write("connect\n")
        local.stdin.flush()
        assert local.stdout.readline().strip() == "connected"
        earlier = time.time() - 1  # before this host's rank dies
        with socket.create_connection(address, timeout=10) as stranger:
            stranger.sendall(b"not the token\n" + end(7, "forged", earlier - 1))
            assert stranger.recv(3) == b"", "the hub answered a connection without its token"
        with socket.create_connection(address, timeout=10) as leaf:
            leaf.sendall(token.encode() + b"\n" + end(3, "far", earlier))
            assert leaf.recv(3) == b"ok\n"
            local.send_signal(signal.SIGKILL)
            local.wait(10)
            _, said = watcher.communicate(timeout=20)
    finally:
        for proc in (local, watcher):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert "rank 3 (pid 99 on far) ended without finishing" in said, said
    assert said.count("without finishing") == 1, said
    assert watcher.returncode == 0, said
    assert deathwatch.End.parse(end(3, "far", 1.5)).host == "far"
    with pytest.raises(ValueError):
        deathwatch.End.parse(b'{"kind": "died", "rank": "3"}')


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

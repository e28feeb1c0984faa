"""Segments left in /dev/shm by a job whose every member was killed while a segment still had its
name: the next group on the host removes those whose creator is gone, once they are old enough,
and nothing else (a live creator's, a young one, another program's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pluribus as pb
import pytest
from pluribus.testing import run_ranks
from pluribus_gloo import shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="no shared-memory path here")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(shm.SHM_DIR, name.lstrip("/")))


def _segment(name: str, age: float) -> str:
    shm.create_mapping(4096, name=name)[1].close()
    if age:
        then = time.time() - age
        os.utime(os.path.join(shm.SHM_DIR, name.lstrip("/")), (then, then))
    return name


@pytest.mark.timeout(60)
def test_only_old_segments_of_dead_creators_are_removed():
    dead, token = _dead_pid(), os.urandom(4).hex()
    orphan = _segment(f"/plrb-{dead}-{token}-a", age=120)
    orphan_allocation = _segment(f"/plrb-{dead}-{token}-a-3", age=120)  # a symmetric one's name
    young = _segment(f"/plrb-{dead}-{token}-b", age=0)
    live = _segment(f"/plrb-{os.getpid()}-{token}-c", age=120)
    other = _segment(f"/plrbx-{dead}-{token}", age=120)  # not ours: another prefix
    try:
        removed = shm.sweep_orphans()
        assert sorted(removed) == sorted(n.lstrip("/") for n in (orphan, orphan_allocation))
        assert not _exists(orphan) and not _exists(orphan_allocation)
        assert _exists(young) and _exists(live) and _exists(other)
        assert shm.sweep_orphans(older_than=0) == [young.lstrip("/")]
    finally:
        for name in (orphan, orphan_allocation, young, live, other):
            shm.unlink(name)


_LEAVE_ONE = """
import os, signal, sys
from pluribus_gloo import shm
name = shm.create_mapping(4096)[0]
print(name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _group_up() -> None:
    pb.barrier()


@pytest.mark.timeout(120)
def test_a_new_group_removes_what_a_killed_process_left():
    """A process killed between creating a segment and unlinking it (as every member of a job
    killed inside an allocation would be) leaves the segment; the next gloo group on the host
    removes it when it sets up its arena."""
    killed = subprocess.run(
        [sys.executable, "-c", _LEAVE_ONE], capture_output=True, text=True, timeout=60
    )
    assert killed.returncode == -signal.SIGKILL
    name = killed.stdout.strip()
    assert name.startswith("/plrb-") and _exists(name)
    then = time.time() - 2 * shm.ORPHAN_SECONDS
    os.utime(os.path.join(shm.SHM_DIR, name.lstrip("/")), (then, then))
    try:
        run_ranks(_group_up, 2, "gloo", "processes", timeout=60)
        assert not _exists(name), "the group's first rank did not remove the killed job's segment"
    finally:
        shm.unlink(name)

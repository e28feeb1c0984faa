"""Shared fixtures of the gloo tests: every test must leave /dev/shm as it found it."""

from __future__ import annotations

import glob
import time

import pytest


def gloo_segments() -> set[str]:
    return set(glob.glob("/dev/shm/plrb-*"))


def assert_no_new_segments(before: set[str]) -> None:
    """Fail when a gloo segment created since ``before`` is still there.

    A segment lives in /dev/shm for the few milliseconds two ranks take to map it, so one seen
    once (another job on this machine may be connecting) must still be there a moment later to
    count as leaked.
    """
    leaked = gloo_segments() - before
    deadline = time.monotonic() + 3.0
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked &= gloo_segments()
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"


@pytest.fixture(autouse=True)
def no_leaked_segments():
    before = gloo_segments()
    yield
    assert_no_new_segments(before)

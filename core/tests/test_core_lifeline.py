"""Lifelines tell a goodbye from a death and pass an abort's reason on."""

from __future__ import annotations

import threading
import time

import pytest
from pluribus.lifeline import Lifeline
from pluribus.store import HashStore, PrefixStore


def _world(size: int) -> list[Lifeline]:
    store = PrefixStore("test", HashStore())
    made: dict[int, Lifeline] = {}
    threads = [
        threading.Thread(target=lambda r=r: made.__setitem__(r, Lifeline(r, size, store, 10.0)))
        for r in range(size)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return [made[r] for r in range(size)]


def _heard(lifeline: Lifeline) -> list:
    heard: list = []
    lifeline.add_listener(lambda peer, reason: heard.append((peer, reason)))
    return heard


def _wait_for(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.timeout(30)
def test_a_goodbye_is_not_a_failure_but_a_vanished_peer_is():
    a, b, c = _world(3)
    heard_a, heard_b = _heard(a), _heard(b)
    c.close()  # says goodbye
    time.sleep(0.3)
    assert heard_a == [] and heard_b == []
    for sock in b._socks.values():  # b vanishes without a word, as a killed process does
        sock.close()
    _wait_for(lambda: heard_a)
    assert heard_a == [(1, "died: its process exited or was killed")]
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_an_abort_reaches_every_peer_with_its_reason_and_the_root_cause_travels_on():
    a, b, c = _world(3)
    heard_a, heard_c = _heard(a), _heard(c)
    b.abort("rank 1: out of memory")
    _wait_for(lambda: heard_a and heard_c)
    assert heard_a == [(1, "aborted: rank 1: out of memory")]
    assert heard_c == [(1, "aborted: rank 1: out of memory")]
    a.abort("rank 0: its own symptom")  # a failed because of b: it passes b's failure on
    time.sleep(0.3)
    assert heard_c == [(1, "aborted: rank 1: out of memory")]  # the first failure stands
    late = []
    c.add_listener(lambda peer, reason: late.append(peer))
    assert late == [1], "a listener added after the failure hears of it at once"
    for lifeline in (a, b, c):
        lifeline.close()

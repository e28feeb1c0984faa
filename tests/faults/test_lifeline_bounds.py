"""A lifeline carries short lines only: a peer that sends more than 8 KiB without a line end is
not speaking the protocol, and counts as failed instead of making this rank buffer forever."""

from __future__ import annotations

import threading

import pytest
from pluribus.lifeline import MAX_LINE, Lifeline
from pluribus.store import HashStore


@pytest.mark.timeout(30)
def test_a_line_without_end_fails_the_peer_instead_of_growing():
    store = HashStore()
    lifelines: dict[int, Lifeline] = {}

    def start(rank: int) -> None:
        lifelines[rank] = Lifeline(rank, 2, store, 10.0)

    threads = [threading.Thread(target=start, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    heard = threading.Event()
    failures = []

    def listener(peer: int, reason: str) -> None:
        failures.append((peer, reason))
        heard.set()

    try:
        lifelines[0].add_listener(listener)
        sock = lifelines[1]._socks[0]  # rank 1's end of the pair
        sock.setblocking(True)
        sock.sendall(b"A" + b"x" * (MAX_LINE + 100))  # an abort line that never ends
        assert heard.wait(5), "rank 0 kept buffering a line without end"
        assert failures == [(1, "failed: it sent a malformed lifeline message")]
        assert len(lifelines[0]._inbox.get(1, b"")) <= MAX_LINE + 4096
    finally:
        for lifeline in lifelines.values():
            lifeline.close()

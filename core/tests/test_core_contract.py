"""What the core does for a backend that has only send and recv: raw transport errors become
pluribus errors naming the rank and the call, sendrecv starts no thread per call, and a group
whose backend leaves failures to the core runs its calls where a failure can end them."""

from __future__ import annotations

import queue
import re
import threading

import numpy as np
import pluribus as pb
import pytest
from pluribus.backend import Backend
from pluribus.builtin import threads
from pluribus.testing import run_ranks


class Leaky(threads.ThreadsBackend):
    """A threads backend whose recv leaks its transport's exception after the first message."""

    leak: type[BaseException] = queue.Empty

    def recv(self, array, src, tag=0):
        raise self.leak("the transport's own words")


def _leaky(leak):
    def body():
        group = pb.get_default_group()
        backend = group.backends["cpu"]
        backend.__class__ = Leaky
        Leaky.leak = leak
        with pytest.raises(pb.PluribusError) as info:
            pb.all_reduce(np.ones(3))
        return type(info.value).__name__, str(info.value)

    return body


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "leak, expected", [(queue.Empty, "DistTimeoutError"), (EOFError, "PeerError")]
)
def test_raw_transport_exceptions_become_pluribus_errors(leak, expected):
    for kind, message in run_ranks(_leaky(leak), 2):
        assert kind == expected
        assert "all_reduce(shape=(3,), dtype=float64)" in message
        assert "rank " in message and leak.__name__ in message


class Counted(Backend):
    def __init__(self):
        super().__init__(0, 2, 5.0)
        self.sent = []

    def send(self, array, dst, tag=0):
        self.sent.append(threading.current_thread().name)

    def recv(self, array, src, tag=0):
        array[...] = 1


def test_the_default_sendrecv_uses_one_sender_thread():
    backend = Counted()
    before = threading.active_count()
    for _ in range(50):
        backend.sendrecv(np.zeros(2), 1, np.zeros(2), 1)
    assert threading.active_count() <= before + 1
    assert len(set(backend.sent)) == 1 and backend.sent[0] != threading.current_thread().name
    backend.send_blocks = False
    backend.sendrecv(np.zeros(2), 1, np.zeros(2), 1)
    assert backend.sent[-1] == threading.current_thread().name


def test_a_view_with_a_shorter_timeout_leaves_the_timeout_to_the_core():
    parent = Counted()
    parent.detects_failures = True
    ctx = pb.BackendContext(rank=0, size=2, store=None, timeout=1.0, group_name="world.1")
    assert not parent.new_subgroup([0, 1], ctx).detects_failures
    ctx = pb.BackendContext(rank=0, size=2, store=None, timeout=9.0, group_name="world.2")
    assert parent.new_subgroup([0, 1], ctx).detects_failures


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"name": "Gloo"}, "lower-case"),
        ({"name": "my backend"}, "lower-case"),
        ({"devices": ["gpu"]}, "devices=['gpu']"),
        ({"devices": "cpu"}, "non-empty tuple"),
        ({"devices": ()}, "non-empty tuple"),
        ({"create": None}, "callables"),
        ({"priority": "high"}, "priority must be an int"),
    ],
)
def test_backend_spec_refuses_bad_fields(fields, words):
    with pytest.raises((ValueError, TypeError), match=re.escape(words)):
        pb.BackendSpec(**{"name": "mine", "create": lambda ctx: None, **fields})


def test_backend_spec_keeps_good_fields():
    spec = pb.BackendSpec(name="my-backend_2", create=lambda ctx: None, devices=["cpu", "cuda"])
    assert spec.devices == ("cpu", "cuda")


def test_availability_refuses_bad_fields():
    with pytest.raises(TypeError, match="ok must be True or False"):
        pb.Availability("yes")
    with pytest.raises(ValueError, match="needs a reason"):
        pb.Availability(False)
    with pytest.raises(TypeError, match="remedy must be a string"):
        pb.Availability(False, "no library", remedy=None)
    assert pb.Availability(False, "no library", "pip install it").remedy == "pip install it"

"""What the core does for a backend that has only send and recv: raw transport errors become
pluribus errors naming the rank and the call, sendrecv starts no thread per call, and a group
whose backend leaves failures to the core runs its calls where a failure can end them."""

from __future__ import annotations

import collections
import queue
import re
import threading
import time

import numpy as np
import pluribus as pb
import pytest
from pluribus import algorithms
from pluribus.backend import Backend
from pluribus.builtin import threads
from pluribus.lifeline import WatchedStore
from pluribus.store import HashStore
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
    def __init__(self, rank=0, size=3):
        super().__init__(rank, size, 5.0)
        self.sent = []
        self.order = []

    def send(self, array, dst, tag=0):
        self.sent.append(threading.current_thread().name)
        self.order.append("send")

    def recv(self, array, src, tag=0):
        array[...] = 1
        self.order.append("recv")


def test_the_default_sendrecv_uses_one_sender_thread_for_a_ring_exchange():
    backend = Counted()
    before = threading.active_count()
    for _ in range(50):
        backend.sendrecv(np.zeros(2), 1, np.zeros(2), 2)
    assert threading.active_count() <= before + 1
    assert len(set(backend.sent)) == 1 and backend.sent[0] != threading.current_thread().name
    backend.send_blocks = False
    backend.sendrecv(np.zeros(2), 1, np.zeros(2), 2)
    assert backend.sent[-1] == threading.current_thread().name


@pytest.mark.parametrize(
    "rank, partner, order", [(0, 1, ["send", "recv"]), (1, 0, ["recv", "send"])]
)
def test_an_exchange_with_one_partner_runs_on_the_caller_lower_rank_sending_first(
    rank, partner, order
):
    """Two sends that wait for their receivers never meet, and no thread hand-off is paid."""
    backend = Counted(rank, 2)
    backend.sendrecv(np.zeros(2), partner, np.zeros(2), partner)
    assert backend.order == order
    assert backend.sent == [threading.current_thread().name]


class Rendezvous(Backend):
    """The strictest send ``Backend`` allows: it returns once the receiver has the message."""

    def __init__(self, rank, size, boxes):
        super().__init__(rank, size, 10.0)
        self.boxes = boxes

    def send(self, array, dst, tag=0):
        taken = threading.Event()
        self.boxes[(self.rank, dst, tag)].put((array.copy(), taken))
        if not taken.wait(self.timeout):
            raise TimeoutError(f"rank {self.rank}: rank {dst} never took the message")

    def recv(self, array, src, tag=0):
        data, taken = self.boxes[(src, self.rank, tag)].get(timeout=self.timeout)
        array[...] = data
        taken.set()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("count", [4, 1 << 16])  # recursive doubling, and the ring
def test_rendezvous_sends_complete_every_generic_exchange(size, count):
    """Pairwise exchanges (lower rank first), ring steps (sender thread) and all-to-all, with
    sends that wait for their receivers: no deadlock, and the results are right."""
    boxes = collections.defaultdict(queue.Queue)
    results, errors = {}, []

    def rank_main(rank):
        try:
            backend = Rendezvous(rank, size, boxes)
            x = np.arange(count, dtype=np.float64) + rank
            algorithms.all_reduce(backend, x, pb.ReduceOp.SUM)
            outputs = [np.empty(3) for _ in range(size)]
            algorithms.all_to_all(
                backend, outputs, [np.full(3, 10.0 * rank + d) for d in range(size)]
            )
            results[rank] = (x, outputs)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads_ = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(size)]
    for t in threads_:
        t.start()
    for t in threads_:
        t.join(30)
    assert not errors and len(results) == size, errors
    expected = size * np.arange(count, dtype=np.float64) + sum(range(size))
    for rank, (x, outputs) in results.items():
        np.testing.assert_array_equal(x, expected)
        assert [o[0] for o in outputs] == [10.0 * s + rank for s in range(size)]


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


class StoreWire(Backend):
    """A send/recv-only backend declaring nothing, messages through a store (as the docs'
    example): it notes the thread each recv runs on."""

    def __init__(self, rank, size, store, timeout=20.0):
        super().__init__(rank, size, timeout)
        self.store = store
        self.seq = collections.Counter()
        self.recv_threads = []

    def send(self, array, dst, tag=0):
        key = (self.rank, dst, tag)
        self.seq[key] += 1
        self.store.set(f"{key}/{self.seq[key]}", array.tobytes())

    def recv(self, array, src, tag=0):
        self.recv_threads.append(threading.current_thread().name)
        key = (src, self.rank, tag)
        self.seq[key] += 1
        array[...] = np.frombuffer(
            self.store.get(f"{key}/{self.seq[key]}", self.timeout), array.dtype
        )


def _store_wire_groups(size, worker=False):
    shared = HashStore(timeout=20.0)
    groups = []
    for rank in range(size):
        store = WatchedStore("world/wire", shared)
        backend = StoreWire(rank, size, store)
        if worker:
            backend.abort_wakes_calls = False
        group = pb.ProcessGroup(
            "world", list(range(size)), rank, {"cpu": backend}, 20.0, shared, stores=[store]
        )
        groups.append(group)
    return groups


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker", [False, True])
def test_a_send_recv_only_backend_runs_calls_on_the_calling_thread_unless_it_says_not(worker):
    groups = _store_wire_groups(2, worker)
    results, callers = {}, {}

    def rank_main(group):
        callers[group.rank] = threading.current_thread().name
        x = np.arange(4.0) + group.rank
        for _ in range(3):
            pb.all_reduce(x, group=group)
        results[group.rank] = x

    threads_ = [
        threading.Thread(target=rank_main, args=(g,), name=f"caller-{g.rank}") for g in groups
    ]
    for t in threads_:
        t.start()
    for t in threads_:
        t.join(30)
    for g in groups:
        g.close()
    expected = 4 * (2 * np.arange(4.0) + 1)
    for rank in range(2):
        np.testing.assert_array_equal(results[rank], expected)
        ran_on = set(groups[rank].backends["cpu"].recv_threads)
        assert (ran_on == {callers[rank]}) is not worker, ran_on


@pytest.mark.timeout(60)
def test_a_failure_ends_a_call_waiting_on_the_store_on_the_calling_thread():
    """Rank 1 never calls: rank 0's all-reduce waits in the store on its own thread, and a
    peer's failure (as the lifeline reports it) ends it at once with PeerError naming rank 1."""
    group = _store_wire_groups(2)[0]
    threading.Timer(0.3, group._peer_failed, args=(1, "died: killed for the test")).start()
    start = time.monotonic()
    with pytest.raises(pb.PeerError, match="rank 1 died: killed for the test") as info:
        pb.all_reduce(np.ones(4), group=group)
    assert info.value.peer == 1
    assert time.monotonic() - start < 5.0
    assert group.backends["cpu"].recv_threads == [threading.current_thread().name]
    with pytest.raises(pb.PeerError):  # and every later call
        pb.all_reduce(np.ones(4), group=group)
    group.close()


@pytest.mark.timeout(30)
def test_an_aborted_store_ends_its_waits_and_keeps_its_timeout():
    store = WatchedStore("g", HashStore(timeout=20.0))
    with pytest.raises(pb.DistTimeoutError, match="'g/missing' not set after 0.[5-9]"):
        store.get("missing", 0.6)
    threading.Timer(0.2, store.abort, args=("rank 3 died",)).start()
    start = time.monotonic()
    with pytest.raises(pb.PluribusError, match="rank 3 died"):
        store.get("missing", 20.0)
    assert time.monotonic() - start < 2.0
    store.set("there", b"1")  # a set still goes through; every get and check raises
    with pytest.raises(pb.PluribusError, match="rank 3 died"):
        store.get("there")
    with pytest.raises(pb.PluribusError, match="rank 3 died"):
        store.check(["there"])


@pytest.mark.timeout(30)
def test_a_threads_mailbox_made_while_a_send_arrives_keeps_the_message():
    """The window in which a mailbox is made (a garbage collection there runs finalizers and
    lets other threads in) is widened to 50 ms: a send landing in it reaches the receiver."""

    def slow_mailbox():
        time.sleep(0.05)
        return collections.deque()

    fabric = threads._Fabric(2)
    fabric.boxes = collections.defaultdict(slow_mailbox)
    sender, receiver = (threads.ThreadsBackend(fabric, r, 2, 2.0) for r in range(2))
    got = np.zeros(3)
    receiving = threading.Thread(target=receiver.recv, args=(got, 0, 7))
    receiving.start()
    time.sleep(0.01)  # the receiver is making the mailbox
    sender.send(np.arange(3.0), 1, 7)
    receiving.join(5)
    assert not receiving.is_alive()
    np.testing.assert_array_equal(got, np.arange(3.0))

"""``PLURIBUS_DEBUG=DETAIL``: check before every collective that all ranks called the same one.

Before a collective is issued, the ranks of its group exchange a fingerprint of their call
(sequence number in the group, operation, shape, dtype, reduce op, root, and the sizes of
list arguments) and each rank checks all of them with the same rules, so a mismatch raises
:class:`~pluribus.errors.CollectiveMismatchError` on every rank with the same message, naming
which ranks called what, instead of hanging or returning garbage.

The exchange goes through the group's CPU backend (the generic all-gather over its send/recv,
on tags of its own so it cannot meet the collective's messages), or through the group's store
when the group has no CPU backend. It costs two small all-gathers per collective, so it is off
by default.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any

import numpy as np

from .. import algorithms
from ..backend import DEBUG_TAG_SHIFT, SubgroupView
from ..errors import CollectiveMismatchError
from ..hookspecs import hookimpl
from ..operations import OPERATIONS
from .common import CollectiveCall, CollectiveWrapper, set_registered

DEBUG_ENV = "PLURIBUS_DEBUG"
#: Operations whose arrays must have the same shape on every rank.
SAME_SHAPE = ("all_reduce", "broadcast", "reduce")


def enabled_by_env() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().upper() == "DETAIL"


def fingerprint(call: CollectiveCall, seq: int) -> dict[str, Any]:
    return {
        "seq": seq,
        "op": OPERATIONS[call.op].meets,  # in place and out of place meet each other
        "shape": list(call.shape) if call.shape is not None else None,
        "numel": call.numel(),
        "dtype": call.dtype,
        "reduce_op": call.reduce_op_name,
        "root": call.root,
        "in_sizes": call.in_sizes,
        "out_sizes": call.out_sizes,
    }


def _signature(fp: dict[str, Any], with_seq: bool) -> str:
    """How a rank's call reads in the error; equal strings mean compatible calls."""
    parts = []
    if fp["op"] in SAME_SHAPE and fp["shape"] is not None:
        parts.append(f"shape={tuple(fp['shape'])}")
    if fp["dtype"] is not None:
        parts.append(f"dtype={fp['dtype']}")
    if fp["reduce_op"] is not None:
        parts.append(f"op={fp['reduce_op']}")
    if fp["root"] is not None:
        parts.append(f"root={fp['root']}")
    prefix = f"#{fp['seq']} " if with_seq else ""
    return f"{prefix}{fp['op']}({', '.join(parts)})"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _size_problems(fps: list[dict[str, Any]], ranks: list[int]) -> list[str]:
    """Element counts that disagree between what one rank sends and another expects."""
    op = fps[0]["op"]
    n = len(fps)
    found: list[str] = []

    def expect(receiver: int, sender: int, expected: int, sent: int) -> None:
        if expected != sent:
            found.append(
                f"rank {ranks[receiver]} expects {expected} elements from rank {ranks[sender]}, "
                f"which has {sent}"
            )

    if op == "all_gather":
        for j in range(n):
            for i in range(n):
                expect(j, i, fps[j]["out_sizes"][i], fps[i]["numel"])
    elif op == "reduce_scatter":
        first = fps[0]["in_sizes"]
        for j in range(1, n):
            if fps[j]["in_sizes"] != first:
                found.append(
                    f"rank {ranks[j]} splits its input as {fps[j]['in_sizes']}, rank {ranks[0]} "
                    f"as {first}"
                )
        for i in range(n):
            expect(i, i, first[i], fps[i]["numel"])
    elif op == "all_to_all":
        for i in range(n):
            for j in range(n):
                expect(j, i, fps[j]["out_sizes"][i], fps[i]["in_sizes"][j])
    elif op == "gather":
        root = fps[0]["root"]
        for i in range(n):
            expect(root, i, fps[root]["out_sizes"][i], fps[i]["numel"])
    elif op == "scatter":
        root = fps[0]["root"]
        for i in range(n):
            expect(i, root, fps[i]["numel"], fps[root]["in_sizes"][i])
    return found


def find_mismatch(fps: list[dict[str, Any]], ranks: list[int], group_name: str) -> str | None:
    """The problem with the group's calls, worded the same on every rank; None when they agree."""
    with_seq = len({fp["seq"] for fp in fps}) > 1
    callers: dict[str, list[int]] = defaultdict(list)
    for i, fp in enumerate(fps):
        callers[_signature(fp, with_seq)].append(ranks[i])
    where = f"collective #{fps[0]['seq']} on group {group_name!r}"
    if len(callers) > 1:
        said = "; ".join(
            f"{_ranks(members)} called {sig}"
            for sig, members in sorted(callers.items(), key=lambda kv: -len(kv[1]))
        )
        return f"ranks disagree at {where}: {said}"
    problems = _size_problems(fps, ranks)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        return (
            f"ranks disagree on sizes at {where}, {_signature(fps[0], False)}: "
            + "; ".join(problems[:3])
            + more
        )
    return None


def _exchange_over_backend(backend, group, payload: bytes) -> list[bytes]:
    view = SubgroupView(
        backend, list(range(group.size)), group.rank, DEBUG_TAG_SHIFT, backend.timeout
    )
    lengths = np.zeros(group.size, dtype=np.int64)
    algorithms.all_gather(
        view,
        [lengths[i : i + 1] for i in range(group.size)],
        np.array([len(payload)], dtype=np.int64),
    )
    outputs = [np.empty(int(n), dtype=np.uint8) for n in lengths]
    algorithms.all_gather(view, outputs, np.frombuffer(payload, dtype=np.uint8).copy())
    return [o.tobytes() for o in outputs]


def _exchange_over_store(group, seq: int, payload: bytes) -> list[bytes]:
    prefix = f"pluribus-debug/{group.name}"
    group.store.set(f"{prefix}/{seq}/{group.rank}", payload)
    found = [group.store.get(f"{prefix}/{seq}/{i}", group.timeout) for i in range(group.size)]
    # Every rank set its key of this call only after reading all keys of the previous one.
    group.store.delete(f"{prefix}/{seq - 1}/{group.rank}")
    return found


class MismatchDetector(CollectiveWrapper):
    def __init__(self):
        super().__init__()
        self.enabled = enabled_by_env()
        # Keyed by group name and rank: the ranks of the threads backend share this process.
        self._seq: dict[tuple[str, int], int] = defaultdict(int)

    def around(self, call: CollectiveCall):
        if self.enabled and call.collective and call.group.size > 1:
            self.check(call)
        return (yield)

    def check(self, call: CollectiveCall) -> None:
        group = call.group
        key = (group.name, group.global_rank)
        self._seq[key] += 1
        seq = self._seq[key]
        payload = json.dumps(fingerprint(call, seq)).encode()
        backend = group.backends.get("cpu")
        if backend is not None:
            raw = _exchange_over_backend(backend, group, payload)
        else:
            raw = _exchange_over_store(group, seq, payload)
        problem = find_mismatch([json.loads(r) for r in raw], group.ranks, group.name)
        if problem:
            raise CollectiveMismatchError(
                f"rank {group.global_rank}: {problem}. Every rank of a group must call the same "
                "collectives in the same order with matching shapes, dtypes and roots "
                f"(checked because {DEBUG_ENV}=DETAIL)"
            )


detector = MismatchDetector()


@hookimpl
def pluribus_group_created(group):
    # Read the setting when a job starts, so that a process may set it before init; a group
    # made again under an old name starts counting again, like its peers' new groups.
    detector.enabled = enabled_by_env()
    detector._seq.pop((group.name, group.global_rank), None)
    set_registered(detector, "debug-detail-calls", detector.enabled)

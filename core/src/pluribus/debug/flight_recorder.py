"""The flight recorder: the last N operations of this process, dumped when something goes wrong.

Every collective and point-to-point call is kept in a ring buffer (``PLURIBUS_FLIGHT_RECORDER=N``
entries, 0 turns it off) with its group, sequence number, shapes, bytes, start and end time and
state (``started``, ``completed``, ``failed``). The buffer is written as JSON to
``$PLURIBUS_FLIGHT_RECORDER_DIR/flight_recorder_r<rank>.json`` when a collective fails or times
out, when the rank dies of an uncaught exception, and when the launcher stops the rank;
``pluribus-run`` sets that directory for every job and reads the files to say which collective
each rank was stuck in.

The recorder is part of the core's dispatch, not a hook wrapper: the public API hands it every
call before any plugin sees it, so it also records the calls a wrapper stops (the mismatch
detector), and switching it on costs no hook chain. Recording costs one small list per call
(about a microsecond; no data is copied), so by default
the recorder keeps 256 calls only where a dump has somewhere to go: when
``PLURIBUS_FLIGHT_RECORDER_DIR`` is set. Elsewhere (a plain ``mpiexec`` job, say) it is off unless
``PLURIBUS_FLIGHT_RECORDER`` asks for it.
"""

from __future__ import annotations

import atexit
import collections
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..hookspecs import hookimpl
from ..operations import ARRAY_ARGUMENTS, LIST_ARGUMENTS, OPERATIONS, Operation
from .common import CollectiveCall, describe, global_rank, when_done

SIZE_ENV = "PLURIBUS_FLIGHT_RECORDER"
DIR_ENV = "PLURIBUS_FLIGHT_RECORDER_DIR"
DEFAULT_SIZE = 256


def dump_path(directory: str | os.PathLike, rank: int | None) -> Path:
    return Path(directory) / f"flight_recorder_r{'unknown' if rank is None else rank}.json"


class ArrayInfo:
    """What the buffer keeps of an array, its shape and dtype (not its memory), as a description
    reads it: with its size and bytes."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: tuple[int, ...], dtype: Any):
        self.shape, self.dtype = shape, dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def _positions(names: frozenset[str]) -> dict[str, tuple[int, ...]]:
    return {
        name: tuple(i for i, a in enumerate(op.args) if a in names)
        for name, op in OPERATIONS.items()
    }


#: Per operation, where its single arrays and its lists of arrays are among its arguments, and
#: the operations whose only array comes first (all_reduce, broadcast, send, ...).
_ARRAYS_AT = _positions(ARRAY_ARGUMENTS)
_LISTS_AT = _positions(LIST_ARGUMENTS)
_FIRST_ONLY = frozenset(n for n in OPERATIONS if _ARRAYS_AT[n] == (0,) and not _LISTS_AT[n])


def _summary(op: Operation, args: tuple) -> Sequence:
    """``args`` with every array, also in a list, as ``(shape, dtype)``: the buffer keeps no
    array alive. Made on every call, so it is plain loops over precomputed positions (a
    generator over every argument cost 1.3-1.5 µs more)."""
    name = op.name
    if name in _FIRST_ONLY:
        first = args[0]
        return ((first.shape, first.dtype), *args[1:])
    kept = list(args)
    for i in _ARRAYS_AT[name]:
        array = kept[i]
        kept[i] = (array.shape, array.dtype)
    for i in _LISTS_AT[name]:
        if kept[i] is not None:
            kept[i] = [(x.shape, x.dtype) for x in kept[i]]
    return kept


def _described_args(op: Operation, summary: Sequence) -> tuple:
    """The arguments :func:`describe` reads, from a :func:`_summary`."""
    args = list(summary)
    for i in _ARRAYS_AT[op.name]:
        args[i] = ArrayInfo(*args[i])
    for i in _LISTS_AT[op.name]:
        if args[i] is not None:
            args[i] = [ArrayInfo(*x) for x in args[i]]
    return tuple(args)


# An entry is a list, the cheapest record to make on every call:
# [seq, group name, call, start, end (None while it runs), error (None unless it failed)].
# ``call`` is a CollectiveCall, or, until the buffer is read, the tuple (operation,
# :func:`_summary` of the arguments, async_op) it is made from.
SEQ, GROUP, CALL, START, END, ERROR = range(6)


def _call_of(entry: list) -> CollectiveCall:
    call = entry[CALL]
    if isinstance(call, tuple):
        op, summary, async_op = call
        call = entry[CALL] = describe(op, None, _described_args(op, summary), async_op)
    return call


def _finish(entry: list, error: BaseException | None) -> None:
    if error is not None:
        entry[ERROR] = f"{type(error).__name__}: {error}"
    entry[END] = time.time()


def entry_dict(entry: list) -> dict[str, Any]:
    """An entry as it is dumped."""
    c = _call_of(entry)
    end, error = entry[END], entry[ERROR]
    return {
        "seq": entry[SEQ],
        "group": entry[GROUP],
        "op": c.op,
        "description": c.describe(),
        "shape": list(c.shape) if c.shape is not None else None,
        "dtype": c.dtype,
        "bytes": c.nbytes,
        "root": c.root,
        "peer": c.peer,
        "reduce_op": c.reduce_op_name,
        "start": entry[START],
        "end": end,
        "state": "failed" if error is not None else "started" if end is None else "completed",
        "error": error,
    }


class FlightRecorder:
    """The recorder; one per process (module-level ``recorder``), which the core's dispatch
    calls for every operation while it is enabled."""

    def __init__(self, size: int | None = None):
        self.entries: collections.deque[list] = collections.deque(maxlen=1)
        self.enabled = False
        self.configure(size)
        # per (group, rank, collective or not): a one-item list, the last sequence number
        self._seq: dict[tuple[str, int, bool], list[int]] = {}
        self._rank: int | None = None

    def configure(self, size: int | None = None) -> None:
        """Keep the last ``size`` calls (default: ``$PLURIBUS_FLIGHT_RECORDER``, else 256 when
        ``$PLURIBUS_FLIGHT_RECORDER_DIR`` is set and 0 when not)."""
        if size is None:
            setting = os.environ.get(SIZE_ENV, "").strip()
            if setting:
                size = int(setting)
            else:
                size = DEFAULT_SIZE if os.environ.get(DIR_ENV) else 0
        self.enabled = size > 0
        if self.entries.maxlen != max(size, 1):
            self.entries = collections.deque(self.entries, maxlen=max(size, 1))

    def _first_call(self, group: Any) -> None:
        if self._rank is None:
            self._rank = group.global_rank
            self._install_excepthook()

    def record(self, group: Any, op: Operation, args: tuple, async_op: bool, run) -> Any:
        """Record one call of ``op`` on ``group`` around ``run(*args)``, which issues it and
        returns its Work (None for a synchronous call, finished when ``run`` returns)."""
        if self._rank is None:
            self._first_call(group)
        counter = self._counter((group.name, group.ranks[group.rank], op.collective))
        counter[0] += 1
        call = (op, _summary(op, args), async_op)
        entry = [counter[0], group.name, call, time.time(), None, None]
        self.entries.append(entry)
        try:
            work = run(*args)
        except BaseException as exc:
            self._finished(entry, exc)
            raise
        if work is None:
            entry[END] = time.time()
        else:
            when_done(work, lambda error: self._finished(entry, error))
        return work

    def _counter(self, key: tuple[str, int, bool]) -> list[int]:
        # One rank issues a group's calls from one thread, so its counter needs no lock.
        counter = self._seq.get(key)
        if counter is None:
            counter = self._seq[key] = [0]
        return counter

    def _finished(self, entry: list, error: BaseException | None) -> None:
        _finish(entry, error)
        if error is not None:
            description = _call_of(entry).describe()
            self.dump(f"{description} on group {entry[GROUP]!r} failed: {error}")

    def snapshot(self) -> list[dict[str, Any]]:
        return [entry_dict(e) for e in self.entries.copy()]

    def dump(self, reason: str, directory: str | os.PathLike | None = None) -> Path | None:
        """Write the buffer as JSON; returns the file, or None when there is nowhere to write."""
        directory = directory or os.environ.get(DIR_ENV)
        if not directory or not self.enabled:
            return None
        rank = self._rank if self._rank is not None else global_rank()
        record = {
            "rank": rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "reason": reason,
            "time": time.time(),
            "entries": self.snapshot(),
        }
        path = dump_path(directory, rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, path)
        except OSError:
            return None
        return path

    def _install_excepthook(self) -> None:
        """Outside pluribus-run nothing else reports an uncaught exception: dump on one."""
        if not os.environ.get(DIR_ENV):
            return
        previous = sys.excepthook

        def excepthook(kind, value, tb):
            atexit.register(self.dump, f"uncaught {kind.__name__}: {value}")
            previous(kind, value, tb)

        sys.excepthook = excepthook


recorder = FlightRecorder()


@hookimpl
def pluribus_group_created(group):
    # A group made again under an old name counts from 1 again, as on its peers.
    for collective in (True, False):
        recorder._seq.pop((group.name, group.global_rank, collective), None)
    recorder.configure()


def dump(reason: str, directory: str | os.PathLike | None = None) -> Path | None:
    """Dump this process's flight recorder (see :meth:`FlightRecorder.dump`)."""
    return recorder.dump(reason, directory)


def stuck_in(record: dict[str, Any]) -> dict[str, Any] | None:
    """The oldest unfinished collective in a dump, or None when every one finished."""
    for entry in record.get("entries", []):
        if entry["state"] == "started" and entry["op"] not in ("send", "recv"):
            return entry
    for entry in record.get("entries", []):
        if entry["state"] == "started":
            return entry
    return None

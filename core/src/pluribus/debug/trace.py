"""``PLURIBUS_TRACE=DIR``: a Chrome/Perfetto trace of every collective, one file per rank.

Each call becomes a complete event (``"ph": "X"``) named after the operation, with its bytes,
shape, dtype and group in ``args``; timestamps are wall-clock microseconds, so the files of all
ranks line up when opened together in ui.perfetto.dev (or chrome://tracing). Synchronous calls of
a group share one track; asynchronous ones get a track of their own per group, since they may
overlap. The file ``DIR/trace_r<rank>.json`` is (re)written when a process group is destroyed
and at exit.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..hookspecs import hookimpl
from .common import CollectiveCall, CollectiveWrapper, set_registered, when_done

log = logging.getLogger("pluribus.debug.trace")

TRACE_ENV = "PLURIBUS_TRACE"
#: Events kept per rank; a long run keeps its first ones (and says how many it dropped).
MAX_EVENTS = 1_000_000


def trace_path(directory: str | os.PathLike, rank: int | None) -> Path:
    return Path(directory) / f"trace_r{'unknown' if rank is None else rank}.json"


class Tracer(CollectiveWrapper):
    def __init__(self, directory: str | None = None):
        super().__init__()
        self.directory = directory if directory is not None else os.environ.get(TRACE_ENV) or None
        self.events: list[dict[str, Any]] = []
        self.dropped = 0
        self.rank: int | None = None
        self._tracks: dict[str, int] = {}
        self._lock = threading.Lock()
        self._atexit = False

    def _track(self, name: str) -> int:
        with self._lock:
            if name not in self._tracks:
                self._tracks[name] = len(self._tracks) + 1
            return self._tracks[name]

    def around(self, call: CollectiveCall):
        if not self.directory:
            return (yield)
        group = call.group
        if self.rank is None:
            self.rank = group.global_rank
        if not self._atexit:
            self._atexit = True
            atexit.register(self.write)
        track = self._track(f"{group.name} async" if call.async_op else group.name)
        start = time.time_ns() // 1000
        args: dict[str, Any] = {"bytes": call.nbytes, "group": group.name}
        for key, value in (
            ("shape", call.shape),
            ("dtype", call.dtype),
            ("reduce_op", call.reduce_op_name),
            ("root", call.root),
            ("peer", call.peer),
            ("tag", call.tag),
        ):
            if value is not None:
                args[key] = list(value) if key == "shape" else value

        def finished(error: BaseException | None) -> None:
            if error is not None:
                args["error"] = f"{type(error).__name__}: {error}"
            event = {
                "name": call.op,
                "cat": "collective" if call.collective else "p2p",
                "ph": "X",
                "ts": start,
                "dur": max(time.time_ns() // 1000 - start, 0),
                "pid": self.rank,
                "tid": track,
                "args": args,
            }
            with self._lock:
                if len(self.events) < MAX_EVENTS:
                    self.events.append(event)
                else:
                    self.dropped += 1

        try:
            work = yield
        except BaseException as exc:
            finished(exc)
            raise
        when_done(work, finished)
        return work

    def trace(self) -> dict[str, Any]:
        """The whole trace as a Chrome trace-event JSON object."""
        pid = self.rank
        with self._lock:
            events = list(self.events)
            tracks = dict(self._tracks)
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}},
        ]
        for name, tid in tracks.items():
            meta.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
            )
        return {
            "traceEvents": meta + events,
            "displayTimeUnit": "ms",
            "otherData": {"rank": pid, "dropped_events": self.dropped},
        }

    def write(self) -> Path | None:
        if not self.directory or self.rank is None:
            return None
        path = trace_path(self.directory, self.rank)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.trace()))
            os.replace(tmp, path)
        except OSError as exc:  # tracing must never break the job
            log.warning("could not write the trace file %s: %s", path, exc)
            return None
        return path


def merge_traces(directory: str | os.PathLike) -> Path | None:
    """Join every rank's trace in ``directory`` into ``trace_all_ranks.json``, so that one file
    shows the whole job (Perfetto opens one file at a time). Returns None when there is none."""
    directory = Path(directory)
    events: list[dict[str, Any]] = []
    ranks = []
    for path in sorted(directory.glob("trace_r*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        events.extend(data.get("traceEvents", []))
        ranks.append(data.get("otherData", {}).get("rank"))
    if not ranks:
        return None
    merged = directory / "trace_all_ranks.json"
    tmp = merged.with_name(f".{merged.name}.{os.getpid()}.tmp")
    tmp.write_text(
        json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"ranks": ranks}})
    )
    os.replace(tmp, merged)
    return merged


tracer = Tracer()


@hookimpl
def pluribus_group_created(group):
    tracer.directory = os.environ.get(TRACE_ENV) or None
    set_registered(tracer, "trace-calls", bool(tracer.directory))


@hookimpl
def pluribus_group_destroyed(group):
    if tracer.directory and tracer.rank is None:
        tracer.rank = group.global_rank
    tracer.write()

"""A real step next to the simulator's prediction: both as Perfetto (Chrome trace-event) JSON,
and the measured bubble computed the way the simulator computes it.

A run's events are the schedule's ``events`` after ``step`` (one per action, wall-clock
seconds), gathered from every rank with :func:`gather_events`. :func:`action_costs` turns them
into per-stage action costs for :func:`~.simulator.simulate`; :func:`write_trace` writes any
number of timelines into one file, one process per rank and timeline, so that ui.perfetto.dev
shows the run and the prediction one above the other.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ... import distributed as dist
from .checker import sender_of
from .schedules import COMPUTE, RECV_B, RECV_F, Action, B, F, I, Program, W
from .simulator import Event, Simulation


def gather_events(schedule: Any) -> list[Event]:
    """Every rank's events of the last step, on every rank (one small collective)."""
    everyone = dist.all_gather_object(
        [(e.rank, str(e.action), e.start, e.end) for e in schedule.events], group=schedule.group
    )
    return [Event(r, Action.parse(a), s, e) for events in everyone for r, a, s, e in events]


def measured(events: Iterable[Event]) -> Simulation:
    """Step time, per-rank compute time and in-flight micro-batches of a real run."""
    events = sorted(events, key=lambda e: (e.start, e.end))
    ranks = 1 + max(e.rank for e in events)
    start, end = min(e.start for e in events), max(e.end for e in events)
    busy = [0.0] * ranks
    held, waiting = [0] * ranks, [0] * ranks
    peak, peak_w = [0] * ranks, [0] * ranks
    for e in events:
        kind = e.action.kind
        if kind in COMPUTE:
            busy[e.rank] += e.end - e.start
        if kind == F:
            held[e.rank] += 1
            peak[e.rank] = max(peak[e.rank], held[e.rank])
        elif kind in (B, I):
            held[e.rank] -= 1
            if kind == I:
                waiting[e.rank] += 1
                peak_w[e.rank] = max(peak_w[e.rank], waiting[e.rank])
        elif kind == W:
            waiting[e.rank] -= 1
    shifted = [Event(e.rank, e.action, e.start - start, e.end - start) for e in events]
    return Simulation(end - start, busy, peak, peak_w, shifted)


def action_costs(
    events: Iterable[Event], per_action: bool = False
) -> Callable[[int, Action], float]:
    """Costs for the simulator from a run: the mean time of each (stage, kind) of compute and
    send, and for receives the shortest (a receive's time beyond that is waiting). With
    ``per_action`` each compute action and send costs exactly what it took in the run, which
    tests the simulator's model of the schedule rather than the averaging of costs."""
    events = list(events)
    spent: dict[tuple[int, str], list[float]] = defaultdict(list)
    for e in events:
        spent[(e.action.stage, e.action.kind)].append(e.end - e.start)
    cost = {
        key: min(v) if key[1] in (RECV_F, RECV_B) else sum(v) / len(v) for key, v in spent.items()
    }
    exact = {e.action: e.end - e.start for e in events if e.action.kind not in (RECV_F, RECV_B)}
    if per_action:
        return lambda rank, action: exact.get(action, cost[(action.stage, action.kind)])
    return lambda rank, action: cost[(action.stage, action.kind)]


def message_latency(
    events: Iterable[Event], program: Program, per_message: bool = False
) -> float | Callable[[Action], float]:
    """The median time from a send's end to its receive's end, over the receives that were
    already waiting when the message was sent: ``comm`` for the simulator (0 if none waited).
    With ``per_message``, ``comm(receive_action)``: each of those receives' own time, the
    median for the others (whose wait the run does not show)."""
    events = list(events)
    by_action = {(e.rank, e.action): e for e in events}
    transits: dict[Action, float] = {}
    for e in events:
        if e.action.kind in (RECV_F, RECV_B):
            send = by_action.get(sender_of(program, e.action))
            if send is not None and e.start <= send.end:
                transits[e.action] = e.end - send.end
    median = statistics.median(transits.values()) if transits else 0.0
    if per_message:
        return lambda action: transits.get(action, median)
    return median


def perfetto(timelines: Mapping[str, Iterable[Event]], unit_seconds: float = 1.0) -> dict:
    """Trace-event JSON of several timelines (label -> events); times in ``unit_seconds``
    (1.0 for measured seconds; pick a length for a unit-cost simulation)."""
    trace: list[dict[str, Any]] = []
    for t, (label, events) in enumerate(timelines.items()):
        events = list(events)
        if not events:
            continue
        origin = min(e.start for e in events)
        for rank in sorted({e.rank for e in events}):
            pid = 1000 * t + rank
            trace.append(
                {
                    "name": "process_name",
                    "ph": "M",
                    "pid": pid,
                    "args": {"name": f"{label} rank {rank}"},
                }
            )
            trace.append(
                {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}
            )
        for e in events:
            a = e.action
            trace.append(
                {
                    "name": str(a),
                    "cat": a.kind,
                    "ph": "X",
                    "pid": 1000 * t + e.rank,
                    "tid": 0 if a.is_compute else 1,
                    "ts": (e.start - origin) * unit_seconds * 1e6,
                    "dur": max(e.end - e.start, 0.0) * unit_seconds * 1e6,
                    "args": {"stage": a.stage, "microbatch": a.microbatch, "kind": a.kind},
                }
            )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_trace(
    path: str | os.PathLike, timelines: Mapping[str, Iterable[Event]], unit_seconds: float = 1.0
) -> Path:
    """Write :func:`perfetto` of ``timelines`` to ``path`` (open it in ui.perfetto.dev)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(perfetto(timelines, unit_seconds)))
    return path

"""Predict a program's step time, bubble and activation memory from per-action costs.

Each action starts when its rank has finished the previous one and, for a receive, when the
matching send has finished plus the link's latency; compute actions take their cost, sends and
receives ``comm`` (default 0). The bubble of a rank is the part of the step in which it computes
nothing; the program's bubble is the mean over ranks. In-flight activations count the
micro-batches a stage has run forward for and not yet its input gradient (``B`` or ``I``, which
release the full activations, as the ZB-H1 paper counts them); micro-batches waiting for a
``W`` are counted apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .checker import check, sender_of
from .schedules import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, I, Program, W

#: Unit costs: forward, input gradient and weight gradient one each, full backward their sum.
UNIT_COSTS = {F: 1.0, I: 1.0, W: 1.0, B: 2.0}

Costs = Mapping[str, float] | Callable[[int, Action], float]


@dataclass
class Event:
    """One action as it ran (or would run): rank, action, start and end (seconds or units)."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass
class Simulation:
    step_time: float
    busy: list[float]  # compute time of each rank
    peak_in_flight: list[int]  # micro-batches between forward and input gradient, per rank
    peak_waiting_w: list[int]  # micro-batches between input gradient and weight gradient
    events: list[Event] = field(default_factory=list)

    @property
    def bubble_per_rank(self) -> list[float]:
        return [1.0 - b / self.step_time if self.step_time else 0.0 for b in self.busy]

    @property
    def bubble(self) -> float:
        """The fraction of the step in which ranks compute nothing, averaged over ranks."""
        per_rank = self.bubble_per_rank
        return sum(per_rank) / len(per_rank)

    def __str__(self) -> str:
        ranks = ", ".join(
            f"rank {r}: bubble {b:.1%}, peak {k} in flight"
            for r, (b, k) in enumerate(zip(self.bubble_per_rank, self.peak_in_flight, strict=True))
        )
        return f"step {self.step_time:.4g}, bubble {self.bubble:.1%} ({ranks})"


def _cost_function(costs: Costs | None) -> Callable[[int, Action], float]:
    if callable(costs):
        return costs
    table = dict(UNIT_COSTS)
    table.update(costs or {})
    if B not in (costs or {}) and (I in (costs or {}) or W in (costs or {})):
        table[B] = table[I] + table[W]
    return lambda rank, action: table.get(action.kind, 0.0)


def simulate(
    program: Program, costs: Costs | None = None, comm: float | Callable[[Action], float] = 0.0
) -> Simulation:
    """Run ``program`` on a clock. ``costs`` maps kinds to durations (missing kinds take
    :data:`UNIT_COSTS`, sends and receives 0; ``B`` defaults to ``I + W``) or is
    ``costs(rank, action)``; a send costs its sender that long, a receive its receiver that
    long after the message arrived. ``comm`` is the time from send to arrival, the same for
    every message or ``comm(receive_action)`` for each."""
    cost = _cost_function(costs)
    latency = comm if callable(comm) else (lambda action: comm)
    order = check(program)
    finish: dict[tuple[int, int], float] = {}
    sent_at: dict[tuple[int, Action], float] = {}
    clock = [0.0] * program.num_ranks
    busy = [0.0] * program.num_ranks
    held, waiting = [0] * program.num_ranks, [0] * program.num_ranks
    peak, peak_w = [0] * program.num_ranks, [0] * program.num_ranks
    events = []
    for rank, index in order:
        a = program.actions[rank][index]
        start = clock[rank]
        if a.kind in (RECV_F, RECV_B):
            start = max(start, sent_at[sender_of(program, a)] + latency(a))
        duration = float(cost(rank, a))
        if a.is_compute:
            busy[rank] += duration
        end = start + duration
        if a.kind in (SEND_F, SEND_B):
            sent_at[(rank, a)] = end
        if a.kind == F:
            held[rank] += 1
            peak[rank] = max(peak[rank], held[rank])
        elif a.kind in (B, I):
            held[rank] -= 1
            if a.kind == I:
                waiting[rank] += 1
                peak_w[rank] = max(peak_w[rank], waiting[rank])
        elif a.kind == W:
            waiting[rank] -= 1
        clock[rank] = finish[(rank, index)] = end
        events.append(Event(rank, a, start, end))
    return Simulation(max(clock) if clock else 0.0, busy, peak, peak_w, events)


def bubble_closed_form(
    name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1
) -> float:
    """The textbook bubble fraction at unit costs (F = I = W = 1, B = 2): ``(p-1)/(m+p-1)`` for
    GPipe and 1F1B, ``(p-1)/(v m+p-1)`` for interleaved 1F1B, ``(p-1)/(3m+p-1)`` for ZB-H1 and ZB-H2
    (whose gain needs ``W < I``), and ``(p-1)/(6m+p-1)`` for ZB-V (``2p`` stages;
    ``m >= 2p - 1``)."""
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    if name in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1)
    if name == "Interleaved1F1B":
        return (p - 1) / (v * m + p - 1)
    if name in ("ZeroBubble", "ZBH2"):
        return (p - 1) / (3 * m + p - 1)
    if name == "ZBV":
        return (p - 1) / (6 * m + p - 1)
    raise ValueError(f"no closed form for schedule {name!r}")

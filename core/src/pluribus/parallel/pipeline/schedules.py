"""Pipeline schedules as data: for each rank, the list of actions it runs in one training step.

An :class:`Action` is one thing a rank does for one stage and one micro-batch, printed as torch's
``torch.distributed.pipelining`` prints them: ``1F3`` is stage 1's forward of micro-batch 3.

==========  ==================================================================================
kind        what the rank does
==========  ==================================================================================
``F``       forward of the stage (the last stage also takes the loss and its gradient)
``B``       full backward: input gradient and parameter gradients
``I``       backward for the input gradient only (parameter gradients wait for ``W``)
``W``       backward for the parameter gradients deferred by ``I``
``SEND_F``  send the stage's output to the rank of the next stage
``RECV_F``  receive the stage's input from the rank of the previous stage
``SEND_B``  send the stage's input gradient to the rank of the previous stage
``RECV_B``  receive the stage's output gradient from the rank of the next stage
==========  ==================================================================================

A :class:`Program` holds the lists of all ranks and where each stage lives. The built-in
schedules write the compute actions; :func:`with_communication` adds the sends and receives
(a receive right before the action that needs it, a send right after the action that produced
it). Sends do not block (the runtime uses ``isend``); a receive waits for its send. That is the
model the checker and the simulator reason about.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

F, B, I, W = "F", "B", "I", "W"  # noqa: E741 (torch's letter for the input-gradient backward)
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, I, W)
COMMUNICATION = (SEND_F, RECV_F, SEND_B, RECV_B)
_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


@dataclass(frozen=True)
class Action:
    """One action of one rank: ``kind`` for ``stage`` and ``microbatch``."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE + COMMUNICATION:
            raise ValueError(
                f"unknown action kind {self.kind!r}: use one of "
                + ", ".join(COMPUTE + COMMUNICATION)
            )

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> Action:
        """``"1F3"`` -> stage 1, forward, micro-batch 3 (the inverse of ``str``)."""
        match = _ACTION.match(text.strip())
        if not match:
            raise ValueError(
                f"cannot read action {text!r}: write <stage><kind><micro-batch>, e.g. 0F1, 1I0, "
                "2SEND_F3"
            )
        return cls(int(match[1]), match[2], int(match[3]))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


@dataclass
class Program:
    """Every rank's action list for one step, and the rank each stage lives on."""

    name: str
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: list[list[Action]] = field(default_factory=list)

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def __str__(self) -> str:
        width = len(str(self.num_ranks - 1))
        lines = [
            f"{self.name}: {self.num_ranks} rank(s), {self.num_stages} stage(s), "
            f"{self.num_microbatches} micro-batch(es)"
        ]
        for rank, actions in enumerate(self.actions):
            lines.append(f"rank {rank:>{width}}: " + " ".join(map(str, actions)))
        return "\n".join(lines)

    def compute_only(self) -> Program:
        """The same program without its sends and receives (easier to read)."""
        return Program(
            self.name,
            self.num_microbatches,
            self.stage_to_rank,
            [[a for a in acts if a.is_compute] for acts in self.actions],
        )

    @classmethod
    def parse(
        cls,
        ranks: Sequence[str | Iterable[str]],
        num_microbatches: int,
        stage_to_rank: Sequence[int] | None = None,
        name: str = "custom",
        add_communication: bool | None = None,
    ) -> Program:
        """A user-written program: one string (or list of strings) of actions per rank.

        Without ``stage_to_rank`` each stage lives where its forward runs. Without sends and
        receives in the text they are added (``add_communication=None`` decides by looking).
        """
        lists = [[Action.parse(t) for t in (r.split() if isinstance(r, str) else r)] for r in ranks]
        if stage_to_rank is None:
            owners: dict[int, int] = {}
            for rank, acts in enumerate(lists):
                for a in acts:
                    owners.setdefault(a.stage, rank)
            if sorted(owners) != list(range(len(owners))):
                raise ValueError(
                    f"{name}: stages {sorted(owners)} are not 0..n-1; pass stage_to_rank"
                )
            stage_to_rank = [owners[s] for s in range(len(owners))]
        if add_communication is None:
            add_communication = not any(not a.is_compute for acts in lists for a in acts)
        program = cls(name, num_microbatches, tuple(stage_to_rank), lists)
        return with_communication(program) if add_communication else program


def with_communication(program: Program) -> Program:
    """Add the sends and receives the compute actions need between ranks."""
    owner = program.stage_to_rank
    last = program.num_stages - 1
    out: list[list[Action]] = []
    for rank, actions in enumerate(program.actions):
        acts: list[Action] = []
        for a in actions:
            s, mb = a.stage, a.microbatch
            if a.kind == F and s > 0 and owner[s - 1] != rank:
                acts.append(Action(s, RECV_F, mb))
            if a.kind in (B, I) and s < last and owner[s + 1] != rank:
                acts.append(Action(s, RECV_B, mb))
            acts.append(a)
            if a.kind == F and s < last and owner[s + 1] != rank:
                acts.append(Action(s, SEND_F, mb))
            if a.kind in (B, I) and s > 0 and owner[s - 1] != rank:
                acts.append(Action(s, SEND_B, mb))
        out.append(acts)
    return Program(program.name, program.num_microbatches, owner, out)


# -- the built-in schedules ---------------------------------------------------------------------


def _check_sizes(name: str, num_ranks: int, num_microbatches: int, per_rank: int = 1) -> None:
    if num_ranks < 1:
        raise ValueError(f"{name}: needs at least one rank, got {num_ranks}")
    if num_microbatches < 1:
        raise ValueError(f"{name}: needs at least one micro-batch, got {num_microbatches}")
    if per_rank < 1:
        raise ValueError(f"{name}: needs at least one stage per rank, got {per_rank}")


def gpipe(num_ranks: int, num_microbatches: int) -> Program:
    """All forwards, then all backwards: simple, and m micro-batches of activations per stage."""
    _check_sizes("GPipe", num_ranks, num_microbatches)
    m = num_microbatches
    lists = [
        [Action(r, F, mb) for mb in range(m)] + [Action(r, B, mb) for mb in range(m)]
        for r in range(num_ranks)
    ]
    return with_communication(Program("GPipe", m, tuple(range(num_ranks)), lists))


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Program:
    """Warm up with ``p - r - 1`` forwards, then alternate forward and backward: the bubble of
    GPipe, at most ``p - r`` micro-batches of activations on rank ``r``."""
    _check_sizes("1F1B", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    lists = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action(r, F, mb) for mb in range(warmup)]
        for k in range(m - warmup):
            acts += [Action(r, F, warmup + k), Action(r, B, k)]
        acts += [Action(r, B, mb) for mb in range(m - warmup, m)]
        lists.append(acts)
    return with_communication(Program("1F1B", m, tuple(range(p)), lists))


def interleaved_1f1b(num_ranks: int, stages_per_rank: int, num_microbatches: int) -> Program:
    """Megatron's interleaved 1F1B: rank ``r`` holds stages ``r, r + p, ...`` (``v`` of them)
    and runs them in rounds of ``p`` micro-batches, which cuts the bubble about ``v`` times.

    Megatron takes ``m`` a multiple of ``p``. Here any ``m <= p`` works too (all forwards
    first), and any other ``m`` whose last, partial round the checker proves deadlock-free;
    the others are refused with the list of valid counts.
    """
    p, v, m = num_ranks, stages_per_rank, num_microbatches
    _check_sizes("Interleaved1F1B", p, m, v)
    program = _interleaved(p, v, m)
    if m > p and m % p:
        if not _interleaved_ok(p, v, m):
            valid = [k for k in range(1, 4 * p + 1) if _interleaved_ok(p, v, k)]
            raise ValueError(
                f"Interleaved1F1B: {m} micro-batches deadlock in the interleaved order over {p} "
                f"ranks with {v} stages each; valid counts up to {4 * p} are "
                f"{', '.join(map(str, valid))} (any multiple of {p} works)"
            ) from None
    return program


@functools.lru_cache(maxsize=4096)
def _interleaved_ok(p: int, v: int, m: int) -> bool:
    from .checker import ScheduleError, check

    if m <= p or m % p == 0:
        return True
    try:
        check(_interleaved(p, v, m))
    except ScheduleError:
        return False
    return True


def _interleaved(p: int, v: int, m: int) -> Program:
    total = v * m
    forwards: list[tuple[int, int]] = []  # (chunk, micro-batch) in the order each rank runs them
    backwards: list[tuple[int, int]] = []
    for first in range(0, m, p):
        round_ = range(first, min(first + p, m))
        forwards += [(c, mb) for c in range(v) for mb in round_]
        backwards += [(c, mb) for c in reversed(range(v)) for mb in round_]
    lists = []
    for r in range(p):
        warmup = total if m <= p else min((p - r - 1) * 2 + (v - 1) * p, total)
        fwd = [Action(c * p + r, F, mb) for c, mb in forwards]
        bwd = [Action(c * p + r, B, mb) for c, mb in backwards]
        acts = fwd[:warmup]
        for k in range(total - warmup):
            acts += [fwd[warmup + k], bwd[k]]
        acts += bwd[total - warmup :]
        lists.append(acts)
    placement = tuple(s % p for s in range(p * v))
    return with_communication(Program("Interleaved1F1B", m, placement, lists))


def zero_bubble(
    num_ranks: int, num_microbatches: int, costs: Mapping[str, float] | None = None
) -> Program:
    """ZB-H1 (Qi et al., 2023): backward split into ``I`` (input gradient, on the critical path)
    and ``W`` (weight gradient, free to move); the ``W``s fill what would be the bubble.

    As in 1F1B, rank ``r`` holds at most ``p - r`` micro-batches between forward and ``I``
    (the full activations), and at most ``2p - r - 1`` between forward and ``W`` (a micro-batch
    waiting for its ``W`` keeps only what the weight gradients need). The order comes from
    running that policy on a clock: an ``I`` when its gradient is there, else a forward when its
    input is there and the limits allow, else the oldest pending ``W``. ``costs`` (``F``, ``I``,
    ``W``; unit costs by default) are the durations it assumes: pass measured ones to order the
    ``W``s for your model. The policy cannot see a gradient coming, so under uneven costs it may
    start a ``W`` just before an ``I`` could run and delay the whole chain behind that ``I``;
    the order it builds at unit costs leaves no such gap whenever ``W`` is no longer than ``F``
    and ``I`` and ``m >= p`` (each rank then idles exactly ``(p - 1)(F + I - W)``, which the
    tests check). So both orders are simulated with ``costs`` and the shorter step is kept.
    """
    _check_sizes("ZeroBubble", num_ranks, num_microbatches)
    cost = {F: 1.0, I: 1.0, W: 1.0, **(costs or {})}
    if any(cost[k] <= 0 for k in (F, I, W)):
        raise ValueError(f"ZeroBubble: costs must be positive, got {dict(costs or {})}")
    p, m = num_ranks, num_microbatches
    program = _zero_bubble_order(p, m, cost, _zb_h1_limits(p))
    if costs is None:
        return program
    from .simulator import simulate  # the simulator imports this module

    unit_order = _zero_bubble_order(p, m, {F: 1.0, I: 1.0, W: 1.0}, _zb_h1_limits(p))
    if simulate(unit_order, cost).step_time < simulate(program, cost).step_time:
        return unit_order
    return program


def _zb_h1_limits(p: int) -> tuple[list[int], list[int]]:
    """ZB-H1's memory per rank: micro-batches between forward and ``I``, and forward and ``W``."""
    return [p - r for r in range(p)], [2 * p - r - 1 for r in range(p)]


def zero_bubble_h2(
    num_ranks: int, num_microbatches: int, costs: Mapping[str, float] | None = None
) -> Program:
    """ZB-H2 (Qi et al., 2023): ZB-H1's policy with more memory, every rank holding up to
    ``2p - 1`` micro-batches between forward and ``W`` (1F1B's rank 0 holds ``p``). Rank 0
    then runs ``2p - 1`` forwards before its first input gradient, and the deferred weight
    gradients fill the wait for the last input gradients, which ZB-H1 cannot when ``W`` is
    shorter than ``I``.

    Within one step the last rank cannot start before ``p - 1`` forwards, so no order idles
    less than ``(p - 1) F`` per rank; the paper's zero bubble needs steps that overlap (its
    optimizer post-validation). With ``W`` no longer than ``F`` and ``m >= 2p`` this order
    idles exactly ``(p - 1) max(F, F + I - 2W)`` per rank (the tests check it), against
    ZB-H1's ``(p - 1)(F + I - W)``: the same at unit costs, less whenever ``W < I``.

    As for :func:`zero_bubble`, ``costs`` are the durations the order is built for: this
    policy's orders and ZB-H1's (which keep within ZB-H2's memory), each built at unit costs
    and at ``costs``, are simulated with ``costs``, and the shortest step is kept.
    """
    _check_sizes("ZBH2", num_ranks, num_microbatches)
    cost = {F: 1.0, I: 1.0, W: 1.0, **(costs or {})}
    if any(cost[k] <= 0 for k in (F, I, W)):
        raise ValueError(f"ZBH2: costs must be positive, got {dict(costs or {})}")
    from .simulator import simulate  # the simulator imports this module

    p, m = num_ranks, num_microbatches
    limit = [2 * p - 1] * p
    built_for = [{F: 1.0, I: 1.0, W: 1.0}] + ([cost] if costs is not None else [])
    orders = [_zero_bubble_order(p, m, c, (limit, limit), "ZBH2") for c in built_for]
    orders += [_zero_bubble_order(p, m, c, _zb_h1_limits(p), "ZBH2") for c in built_for]
    return min(orders, key=lambda program: simulate(program, cost).step_time)  # first if tied


def _zero_bubble_order(
    p: int,
    m: int,
    cost: Mapping[str, float],
    limits: tuple[Sequence[int], Sequence[int]],
    name: str = "ZeroBubble",
) -> Program:
    """ZB-H1's policy (see :func:`zero_bubble`) run on a clock with durations ``cost``;
    ``limits``: per rank, the most micro-batches between forward and ``I``, and between
    forward and ``W``."""
    before_i_limit, before_w_limit = limits
    never = float("inf")
    lists: list[list[Action]] = [[] for _ in range(p)]
    f_end = [[never] * m for _ in range(p)]  # when each forward ends
    i_end = [[never] * m for _ in range(p)]
    next_f, next_i = [0] * p, [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    before_i = [0] * p  # forward done, input gradient not yet
    before_w = [0] * p  # forward done, weight gradient not yet
    clock = [0.0] * p
    done = [False] * p

    def act(r: int, t: float) -> bool:
        """Run rank r's next action at time t if one is ready."""
        mb_i, mb_f = next_i[r], next_f[r]
        if mb_i < m and (f_end[r][mb_i] if r == p - 1 else i_end[r + 1][mb_i]) <= t:
            kind, mb = I, mb_i
            i_end[r][mb] = t + cost[I]
            next_i[r] += 1
            before_i[r] -= 1
            pending_w[r].append(mb)
        elif (
            mb_f < m
            and before_i[r] < before_i_limit[r]
            and before_w[r] < before_w_limit[r]
            and (r == 0 or f_end[r - 1][mb_f] <= t)
        ):
            kind, mb = F, mb_f
            f_end[r][mb] = t + cost[F]
            next_f[r] += 1
            before_i[r] += 1
            before_w[r] += 1
        elif pending_w[r]:
            kind, mb = W, pending_w[r].pop(0)
            before_w[r] -= 1
        else:
            return False
        lists[r].append(Action(r, kind, mb))
        clock[r] = t + cost[kind]
        done[r] = len(lists[r]) == 3 * m
        return True

    _run_clock(act, clock, done, (f_end, i_end), f"{name} (p={p}, m={m})")
    return with_communication(Program(name, m, tuple(range(p)), lists))


def _run_clock(act, clock: list[float], done: list[bool], ends, what: str) -> None:
    """Drive a clocked schedule policy: at the earliest time ``t`` any unfinished rank is free,
    ``act(r, t)`` lets each rank free at ``t`` start its next action (False: it must wait);
    ranks that all wait move on to the next time anything ends (a clock, or an entry of
    ``ends``, tables of per-micro-batch end times, infinite until known)."""
    ranks = range(len(clock))
    while not all(done):
        t = min(clock[r] for r in ranks if not done[r])
        moved = [act(r, t) for r in ranks if not done[r] and clock[r] == t]
        if not any(moved):
            later = [c for c in clock if c > t] + [
                e for rows in ends for row in rows for e in row if t < e < float("inf")
            ]
            if not later:  # the policy always progresses; this guards against a bug
                raise RuntimeError(f"{what}: no order found")
            for r in ranks:
                if not done[r] and clock[r] == t:
                    clock[r] = min(later)


def zbv(num_ranks: int, num_microbatches: int, costs: Mapping[str, float] | None = None) -> Program:
    """ZB-V (Qi et al., 2024, "Pipeline parallelism with controllable memory"): ``2p`` stages in
    a V, rank ``r`` holding stages ``r`` and ``2p - 1 - r``, backward split into ``I`` and ``W``.

    The V puts the first and the last stage on rank 0, so a micro-batch's gradient starts back
    where its forward began, and every rank holds at most ``2p`` half-size stages' micro-batches
    between forward and ``W``: the activation memory of 1F1B's rank 0, on every rank. At unit
    costs (per stage, each half of a 1F1B stage) and ``m >= 2p - 1`` the only idle time is the
    ``p - 1`` forwards before the last rank starts: the bubble is ``(p - 1)/(6m + p - 1)``,
    about half of ZB-H1's on the same model.

    Candidate orders are built and the one with the shortest simulated step under ``costs``
    (unit costs by default) is kept: the paper's fixed pattern (warm-up, ``F I W`` of each
    stage in turn, cool-down), optimal at unit costs once the V is full, and a policy run on a
    clock (a forward when its input is there and the memory allows, else an input gradient,
    else the oldest ``W``) at unit costs and at ``costs``, which does better with few
    micro-batches or uneven costs.
    """
    _check_sizes("ZBV", num_ranks, num_microbatches)
    cost = {F: 1.0, I: 1.0, W: 1.0, **(costs or {})}
    if any(cost[k] <= 0 for k in (F, I, W)):
        raise ValueError(f"ZBV: costs must be positive, got {dict(costs or {})}")
    from .simulator import simulate  # the simulator imports this module

    p, m = num_ranks, num_microbatches
    if costs is None and m >= 2 * p - 1:
        # optimal: the last rank cannot start before p - 1 forwards and has 6m units of work
        return _zbv_pattern(p, m)
    orders = [_zbv_pattern(p, m), _zbv_clocked(p, m, {F: 1.0, I: 1.0, W: 1.0})]
    if costs is not None:
        orders.append(_zbv_clocked(p, m, cost))
    return min(orders, key=lambda program: simulate(program, cost).step_time)  # first if tied


def _v_placement(p: int) -> tuple[int, ...]:
    """Stage s lives on rank s for s < p, on rank 2p - 1 - s after: down and back up a V."""
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


def _zbv_pattern(p: int, m: int) -> Program:
    """The paper's ZB-V order, written for ``max(m, 2p - 1)`` micro-batches, the fewest that
    fill the V; the actions of micro-batches past ``m`` are then dropped (the order stays
    valid, the checker proves it)."""
    n = max(m, 2 * p - 1)
    lists = [[a for a in _zbv_pattern_of_rank(p, r, n) if a.microbatch < m] for r in range(p)]
    return with_communication(Program("ZBV", m, _v_placement(p), lists))


def _zbv_pattern_of_rank(p: int, r: int, n: int) -> list[Action]:
    """Rank r's actions for its stages ``down = r`` and ``up = 2p - 1 - r``, n micro-batches."""
    down, up = r, 2 * p - 1 - r
    count = {(s, k): 0 for s in (down, up) for k in (F, I, W)}
    acts: list[Action] = []

    def run(stage: int, kind: str) -> None:
        acts.append(Action(stage, kind, count[(stage, kind)]))
        count[(stage, kind)] += 1

    for _ in range(2 * (p - r) - 1):  # warm-up: fill the down stage ...
        run(down, F)
    for _ in range(r):  # ... then both, as the first micro-batches come back up
        run(up, F)
        run(down, F)
    for _ in range(p - r):
        for kind in (F, I, W):
            run(up, kind)
    while count[(up, F)] < count[(down, F)] or count[(down, F)] < n:  # steady state
        if count[(down, F)] < n:
            run(down, F)
        run(down, I)
        run(down, W)
        for kind in (F, I, W):
            run(up, kind)
    for _ in range(r):  # cool-down: input gradients first, weight gradients fill the gaps
        run(down, I)
        run(up, I)
    for _ in range(p - r):
        run(down, I)
        run(down, W)
    for stage in (up, down):
        while count[(stage, W)] < count[(stage, I)]:
            run(stage, W)
    return acts


def _zbv_clocked(p: int, m: int, cost: Mapping[str, float]) -> Program:
    """ZB-V's order from a policy run on a clock with durations ``cost``: on each rank, a
    forward when its input is there and fewer than ``2p`` micro-batches wait for their ``W``
    (the up stage first; the down stage keeps one place free for it), else an input gradient
    when its gradient is there (the down stage first), else the oldest pending ``W``."""
    never = float("inf")
    placement = _v_placement(p)
    last = 2 * p - 1
    f_end = [[never] * m for _ in range(2 * p)]  # when each forward ends, per stage
    i_end = [[never] * m for _ in range(2 * p)]
    next_f, next_i = [0] * (2 * p), [0] * (2 * p)
    lists: list[list[Action]] = [[] for _ in range(p)]
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    before_w = [0] * p  # forward done, weight gradient not yet (both stages)
    down_before_i = [0] * p  # forward of the down stage done, input gradient not yet
    clock = [0.0] * p
    done = [False] * p

    def ready_forward(r: int, t: float) -> int | None:
        if before_w[r] >= 2 * p:
            return None
        for s in (last - r, r):
            mb = next_f[s]
            room = s != r or down_before_i[r] < 2 * p - 1
            if mb < m and room and (s == 0 or f_end[s - 1][mb] <= t):
                return s
        return None

    def ready_input_grad(t: float, r: int) -> int | None:
        for s in (r, last - r):
            mb = next_i[s]
            if mb < m and f_end[s][mb] <= t and (s == last or i_end[s + 1][mb] <= t):
                return s
        return None

    def act(r: int, t: float) -> bool:
        """Run rank r's next action at time t if one is ready."""
        if (s := ready_forward(r, t)) is not None:
            kind, mb = F, next_f[s]
            f_end[s][mb] = t + cost[F]
            next_f[s] += 1
            before_w[r] += 1
            down_before_i[r] += s == r
        elif (s := ready_input_grad(t, r)) is not None:
            kind, mb = I, next_i[s]
            i_end[s][mb] = t + cost[I]
            next_i[s] += 1
            down_before_i[r] -= s == r
            pending_w[r].append((s, mb))
        elif pending_w[r]:
            kind, (s, mb) = W, pending_w[r].pop(0)
            before_w[r] -= 1
        else:
            return False
        lists[r].append(Action(s, kind, mb))
        clock[r] = t + cost[kind]
        done[r] = len(lists[r]) == 6 * m
        return True

    _run_clock(act, clock, done, (f_end, i_end), f"ZBV (p={p}, m={m})")
    return with_communication(Program("ZBV", m, placement, lists))


#: The built-in schedules by name (see :func:`build`).
SCHEDULES = {
    "GPipe": gpipe,
    "1F1B": one_f_one_b,
    "Interleaved1F1B": interleaved_1f1b,
    "ZeroBubble": zero_bubble,
    "ZBH2": zero_bubble_h2,
    "ZBV": zbv,
}


def build(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int = 1,
    costs: Mapping[str, float] | None = None,
) -> Program:
    """The built-in schedule ``name`` as a program (``costs``: ZeroBubble's, ZBH2's and ZBV's,
    see there). ``stages_per_rank`` is Interleaved1F1B's ``v``; ZBV always takes 2."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}")
    if name == "Interleaved1F1B":
        return interleaved_1f1b(num_ranks, stages_per_rank, num_microbatches)
    if name == "ZBV":
        if stages_per_rank not in (1, 2):  # 1: the default of every other schedule
            raise ValueError(f"ZBV runs exactly 2 stages per rank, got {stages_per_rank}")
        return zbv(num_ranks, num_microbatches, costs)
    if stages_per_rank != 1:
        raise ValueError(f"{name} runs one stage per rank; use Interleaved1F1B for more")
    if name in ("ZeroBubble", "ZBH2"):
        return SCHEDULES[name](num_ranks, num_microbatches, costs)
    return SCHEDULES[name](num_ranks, num_microbatches)

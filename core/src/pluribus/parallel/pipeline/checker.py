"""Prove, before anything runs, that a program completes: every compute action has its inputs,
every send has its receive (in the same order on each channel), and no set of ranks waits on
each other in a cycle.

The execution model is the runtime's: sends never block; a receive waits until its matching send
has run. Under it a program completes exactly when its wait-for graph (each rank's program order,
plus an edge from each send to its receive) is acyclic, which :func:`execution_order` decides by
running the ranks symbolically until all finish or none can move.
"""

from __future__ import annotations

from collections import defaultdict

from .schedules import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, I, Program, W

#: (sending kind, receiving kind, stage step from sender to receiver)
_CHANNELS = {SEND_F: (RECV_F, +1), SEND_B: (RECV_B, -1)}


class ScheduleError(ValueError):
    """A program that would not run; ``problems`` lists each reason."""

    def __init__(self, name: str, problems: list[str]):
        self.problems = problems
        shown = problems[:20] + (
            [f"... and {len(problems) - 20} more"] if len(problems) > 20 else []
        )
        super().__init__(f"schedule {name!r} is rejected:\n  " + "\n  ".join(shown))


def _where(rank: int, index: int, action: Action) -> str:
    return f"rank {rank} action {index} ({action})"


def _structure(program: Program) -> list[str]:
    """Coverage, ownership and data dependencies, each rank on its own."""
    problems: list[str] = []
    n, m, owner = program.num_stages, program.num_microbatches, program.stage_to_rank
    if any(not 0 <= r < program.num_ranks for r in owner):
        return [f"stage_to_rank {list(owner)} names ranks outside 0..{program.num_ranks - 1}"]
    counts: dict[tuple[int, str, int], int] = defaultdict(int)
    for rank, actions in enumerate(program.actions):
        done: set[tuple[int, str, int]] = set()
        for index, a in enumerate(actions):
            here = _where(rank, index, a)
            s, mb = a.stage, a.microbatch
            if not 0 <= s < n or not 0 <= mb < m:
                problems.append(f"{here}: stage must be in 0..{n - 1}, micro-batch in 0..{m - 1}")
                continue
            if owner[s] != rank:
                problems.append(f"{here}: stage {s} lives on rank {owner[s]}, not rank {rank}")
                continue
            needs: list[tuple[int, str, int]] = []
            if a.kind == F:
                if s > 0:
                    needs.append((s, RECV_F, mb) if owner[s - 1] != rank else (s - 1, F, mb))
            elif a.kind in (B, I):
                needs.append((s, F, mb))
                if s < n - 1:
                    if owner[s + 1] != rank:
                        needs.append((s, RECV_B, mb))
                    else:
                        needs.append((s + 1, B, mb) if (s + 1, B, mb) in done else (s + 1, I, mb))
            elif a.kind == W:
                needs.append((s, I, mb))
            elif a.kind in (SEND_F, RECV_B):
                if s == n - 1:
                    problems.append(f"{here}: the last stage has no next stage")
                    continue
                if owner[s + 1] == rank:
                    problems.append(f"{here}: stage {s + 1} is on this rank too; nothing to send")
                if a.kind == SEND_F:
                    needs.append((s, F, mb))
            elif a.kind in (SEND_B, RECV_F):
                if s == 0:
                    problems.append(f"{here}: stage 0 has no previous stage")
                    continue
                if owner[s - 1] == rank:
                    problems.append(f"{here}: stage {s - 1} is on this rank too; nothing to send")
                if a.kind == SEND_B:
                    needs.append((s, B, mb) if (s, B, mb) in done else (s, I, mb))
            for need in needs:
                if need not in done:
                    problems.append(f"{here} runs before {Action(*need)}, which it needs")
            done.add((s, a.kind, mb))
            counts[(s, a.kind, mb)] += 1
    for s in range(n):
        for mb in range(m):
            f, b, i, w = (counts[(s, k, mb)] for k in (F, B, I, W))
            if f != 1:
                problems.append(f"stage {s} micro-batch {mb}: {f} forwards, needs exactly 1")
            if not ((b == 1 and i == 0 and w == 0) or (b == 0 and i == 1 and w == 1)):
                problems.append(
                    f"stage {s} micro-batch {mb}: needs one B, or one I and one W; has {b} B, "
                    f"{i} I, {w} W"
                )
    return problems


def _matching(program: Program) -> list[str]:
    """Every send has a receive on the other side, in the same order per channel."""
    problems: list[str] = []
    owner = program.stage_to_rank
    sent: dict[tuple, list[int]] = defaultdict(list)
    received: dict[tuple, list[int]] = defaultdict(list)
    for rank, actions in enumerate(program.actions):
        for a in actions:
            if a.kind in _CHANNELS:
                recv_kind, step = _CHANNELS[a.kind]
                peer = a.stage + step
                if 0 <= peer < program.num_stages:
                    sent[(rank, owner[peer], recv_kind, peer)].append(a.microbatch)
            elif a.kind in (RECV_F, RECV_B):
                step = -1 if a.kind == RECV_F else +1
                peer = a.stage + step
                if 0 <= peer < program.num_stages:
                    received[(owner[peer], rank, a.kind, a.stage)].append(a.microbatch)
    for key in sorted(set(sent) | set(received)):
        src, dst, kind, stage = key
        s, r = sent.get(key, []), received.get(key, [])
        what = "activations for" if kind == RECV_F else "gradients for"
        if sorted(s) != sorted(r):
            extra_s = sorted(set(s) - set(r)) or [x for x in s if s.count(x) > r.count(x)]
            extra_r = sorted(set(r) - set(s)) or [x for x in r if r.count(x) > s.count(x)]
            if extra_s:
                problems.append(
                    f"rank {src} sends {what} stage {stage} micro-batch(es) {extra_s} that rank "
                    f"{dst} never receives"
                )
            if extra_r:
                problems.append(
                    f"rank {dst} receives {what} stage {stage} micro-batch(es) {extra_r} that "
                    f"rank {src} never sends"
                )
        elif s != r:
            problems.append(
                f"rank {src} sends {what} stage {stage} in micro-batch order {s} but rank {dst} "
                f"receives them in order {r}; messages on one channel arrive in send order"
            )
    return problems


def sender_of(program: Program, a: Action) -> tuple[int, Action]:
    """The rank and the send action that receive ``a`` waits for."""
    if a.kind == RECV_F:
        return program.stage_to_rank[a.stage - 1], Action(a.stage - 1, SEND_F, a.microbatch)
    return program.stage_to_rank[a.stage + 1], Action(a.stage + 1, SEND_B, a.microbatch)


def execution_order(program: Program) -> list[tuple[int, int]]:
    """``(rank, index)`` of every action in an order that can run; raises ScheduleError naming
    the ranks that wait on each other when the program deadlocks."""
    pos = [0] * program.num_ranks
    sent: set[tuple[int, Action]] = set()
    order: list[tuple[int, int]] = []
    total = sum(len(a) for a in program.actions)
    while len(order) < total:
        moved = False
        for rank, actions in enumerate(program.actions):
            while pos[rank] < len(actions):
                a = actions[pos[rank]]
                if a.kind in (RECV_F, RECV_B) and sender_of(program, a) not in sent:
                    break
                if a.kind in (SEND_F, SEND_B):
                    sent.add((rank, a))
                order.append((rank, pos[rank]))
                pos[rank] += 1
                moved = True
        if not moved:
            raise ScheduleError(program.name, _deadlock(program, pos))
    return order


def _deadlock(program: Program, pos: list[int]) -> list[str]:
    waits: dict[int, int] = {}
    lines = []
    for rank, actions in enumerate(program.actions):
        if pos[rank] < len(actions):
            a = actions[pos[rank]]
            src, send = sender_of(program, a)
            waits[rank] = src
            later = send in program.actions[src][pos[src] :]
            lines.append(
                f"rank {rank} waits at action {pos[rank]} ({a}) for rank {src}'s {send}"
                + ("" if later else ", which it never runs")
            )
    cycle = _find_cycle(waits)
    head = (
        "deadlock: ranks " + " -> ".join(map(str, cycle)) + " wait on each other in a cycle"
        if cycle
        else "deadlock: no rank can move"
    )
    return [head, *lines]


def _find_cycle(waits: dict[int, int]) -> list[int]:
    for start in waits:
        path, node = [], start
        while node in waits and node not in path:
            path.append(node)
            node = waits[node]
        if node in path:
            return path[path.index(node) :] + [node]
    return []


def check(program: Program) -> list[tuple[int, int]]:
    """Raise :class:`ScheduleError` listing every problem of ``program``; return an order in
    which its actions can run (the simulator's and runtime's proof that it completes)."""
    problems = _structure(program) + _matching(program)
    if problems:
        raise ScheduleError(program.name, problems)
    return execution_order(program)

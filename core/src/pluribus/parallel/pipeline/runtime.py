"""One runtime for every schedule: replay this rank's action list, moving activations and
gradients with self-describing messages.

Each message is a small int64 header (status, kind, sending stage, micro-batch, dtype, shape)
followed by the payload, so shapes may change from step to step with no shape-inference pass.
A rank that fails mid-step sends, in place of every message it still owed, a header marked as
an error followed by the error's text; a rank receiving one does the same for its own debts and
raises. Every receive therefore gets an answer: a failure reaches every rank, naming the stage
and rank it started on, and nothing hangs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ... import distributed as dist
from ...errors import PluribusError
from ...nn.module import array_namespace
from .checker import check
from .schedules import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, I, Program, W, build
from .simulator import Event
from .stage import PipelineStage

#: Tags of pipeline messages: TAG_BASE + 2 * receiving stage + (0 activations, 1 gradients).
TAG_BASE = 7 << 20
_MAX_DIMS = 8
_OK, _FAILED = 0, 1
_KINDS = {SEND_F: 0, SEND_B: 1}


class PipelineError(RuntimeError):
    """A pipeline step failed on some rank; the message names the stage and rank it began on."""


class _PeerFailed(Exception):
    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


def _header(kind: str, stage: int, microbatch: int, array: Any, status: int = _OK) -> np.ndarray:
    if array.ndim > _MAX_DIMS:
        raise ValueError(f"pipeline messages carry at most {_MAX_DIMS} dimensions")
    h = np.zeros(6 + _MAX_DIMS, dtype=np.int64)
    h[:6] = status, _KINDS[kind], stage, microbatch, ord(np.dtype(array.dtype).char), array.ndim
    h[6 : 6 + array.ndim] = array.shape
    return h


class PipelineSchedule:
    """Runs a :class:`Program` on this rank's stage(s): ``step(inputs, target=, losses=)``.

    As in ``torch.distributed.pipelining``: the rank of the first stage passes the batch, the
    rank of the last stage the target (and a list to receive each micro-batch's loss); the
    batch is cut into ``n_microbatches`` equal micro-batches along the first axis. Each
    micro-batch's loss gradient is scaled by ``1 / n_microbatches``, so the gradients that
    accumulate in ``.grad`` are those of the mean loss over the batch, as in one process.
    ``data_parallel_group`` averages every stage's gradients over that group after the step
    (pipeline x data parallelism on a 2-d layout).
    """

    #: The built-in schedule this class runs (None: the program is passed in).
    schedule_name: str | None = None

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Any = None,
        *,
        program: Program | None = None,
        data_parallel_group: Any = None,
    ):
        self.stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        if not self.stages:
            raise ValueError("a pipeline schedule needs at least one stage on each rank")
        self.group = self.stages[0].group
        self.rank = dist.get_rank(self.group)
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.data_parallel_group = data_parallel_group
        world = dist.get_world_size(self.group)
        num_stages = self.stages[0].num_stages
        where = f"rank {self.rank} ({', '.join(f'stage {s.stage_index}' for s in self.stages)})"
        if program is None:
            per_rank, extra = divmod(num_stages, world)
            fits, needs = {
                "Interleaved1F1B": (
                    per_rank > 1,
                    f"a multiple of {world} stages, {2 * world} or more",
                ),
                "ZBV": (per_rank == 2, f"two stages per rank ({2 * world} stages)"),
            }.get(self.schedule_name, (per_rank == 1, f"one stage per rank ({world} stages)"))
            if extra or not fits:
                raise ValueError(
                    f"{where}: {type(self).__name__} cannot place {num_stages} stages on a "
                    f"pipeline group of {world} ranks; it needs {needs}"
                )
            program = build(self.schedule_name, world, n_microbatches, per_rank)
        if program.num_ranks != world or program.num_microbatches != n_microbatches:
            raise ValueError(
                f"{where}: the program is for {program.num_ranks} ranks and "
                f"{program.num_microbatches} micro-batches, the group has {world} ranks and "
                f"the schedule was given {n_microbatches} micro-batches"
            )
        mine = sorted(s.stage_index for s in self.stages)
        if mine != program.stages_of(self.rank):
            raise ValueError(
                f"{where}: {program.name} places stages {program.stages_of(self.rank)} on this "
                f"rank, but it was given stages {mine}"
            )
        if any(s.num_stages != program.num_stages for s in self.stages):
            raise ValueError(
                f"{where}: the stages say {num_stages} stages, the program has {program.num_stages}"
            )
        check(program)  # raises ScheduleError before anything runs
        self.program = program
        self._by_index = {s.stage_index: s for s in self.stages}
        self._checked = False
        #: What ran in the last step: one :class:`Event` per action, wall-clock seconds.
        self.events: list[Event] = []

    # -- checks before the first step ---------------------------------------------------------

    def _check_layout(self) -> None:
        """Every rank's stages, schedule and micro-batch count agree (one small collective)."""
        mine = {
            "rank": self.rank,
            "program": str(self.program),
            "stages": [s.describe() for s in self.stages],
        }
        everyone = dist.all_gather_object(mine, group=self.group)
        problems = []
        if len({e["program"] for e in everyone}) > 1:
            names = {e["rank"]: e["program"].splitlines()[0] for e in everyone}
            problems.append(f"the ranks run different schedules: {names}")
        info = {d["stage"]: (e["rank"], d) for e in everyone for d in e["stages"]}
        for s in range(self.program.num_stages - 1):
            (r0, a), (r1, b) = info[s], info[s + 1]
            if a["out_features"] and b["in_features"] and a["out_features"] != b["in_features"]:
                problems.append(
                    f"stage {s} (rank {r0}) ends with {a['out_features']} features but stage "
                    f"{s + 1} (rank {r1}) takes {b['in_features']}: cut the model where one "
                    "layer's output is the next one's input"
                )
        if problems:
            raise ValueError(f"rank {self.rank}: the pipeline cannot run: " + "; ".join(problems))
        self._checked = True

    def _split(self, array: Any, what: str) -> list[Any]:
        m = self.n_microbatches
        if array is None or array.shape[0] % m:
            got = "nothing" if array is None else f"{array.shape[0]} rows"
            raise ValueError(
                f"{what} must have a multiple of n_microbatches={m} rows along the first axis "
                f"(equal micro-batches keep the loss scaling exact), got {got}"
            )
        return [
            array[i * (array.shape[0] // m) : (i + 1) * (array.shape[0] // m)] for i in range(m)
        ]

    # -- the step -----------------------------------------------------------------------------

    def step(self, *inputs: Any, target: Any = None, losses: list | None = None) -> Any:
        """Run one training step; returns the last stage's output (``None`` elsewhere)."""
        if not self._checked:
            self._check_layout()
        self._pending: list[Any] = []
        self._keep: list[Any] = []  # arrays of sends in flight
        self._buffers: dict[tuple[str, int, int], Any] = {}
        self._losses: dict[int, Any] = {}
        self._outputs: dict[int, Any] = {}
        self.events = []
        actions = self.program.actions[self.rank]
        index = 0  # the next action to run
        failure: str | None = None
        error: BaseException | None = None
        started = False
        try:
            self._prepare(inputs, target)
            started = True
            for action in actions:
                start = time.time()
                self._run(action)
                self.events.append(Event(self.rank, action, start, time.time()))
                index += 1
            self._finish_sends()
        except BaseException as exc:
            failure = self._fail(exc, actions, index, started)
            error = exc
        self._agree(failure, error)
        if losses is not None and self._losses:
            losses.extend(self._losses[mb] for mb in sorted(self._losses))
        if self.data_parallel_group is not None:
            self._average_gradients()
        if self._outputs:
            xp = array_namespace(self._outputs[0])
            return xp.concatenate([self._outputs[mb] for mb in sorted(self._outputs)])
        return None

    def _prepare(self, inputs: tuple, target: Any) -> None:
        where = f"rank {self.rank}"
        if 0 in self._by_index:
            if len(inputs) != 1:
                raise ValueError(
                    f"stage 0 ({where}) takes one input batch, got {len(inputs)} arguments"
                )
            for mb, x in enumerate(self._split(inputs[0], f"stage 0 ({where}): the input")):
                # a copy: the activations a micro-batch keeps must not pin the whole batch
                self._buffers[(F, 0, mb)] = x.copy()
        last = self.program.num_stages - 1
        if last in self._by_index:
            if self.loss_fn is None:
                raise ValueError(f"stage {last} ({where}) has no loss_fn: pass one to the schedule")
            self._targets = self._split(target, f"stage {last} ({where}): the target")

    def _stage(self, index: int) -> PipelineStage:
        return self._by_index[index]

    def _run(self, a: Action) -> None:
        s, mb, owner = a.stage, a.microbatch, self.program.stage_to_rank
        last = self.program.num_stages - 1
        if a.kind == F:
            x = self._buffers.pop((F, s, mb))
            y = self._forward(s, mb, x)
            if s == last:
                self._buffers[(B, s, mb)] = self._loss(mb, y)
            else:
                self._buffers[(F, s + 1, mb)] = y  # sent by SEND_F, or used here
        elif a.kind in (B, I):
            g = self._buffers.pop((B, s, mb))
            grad_input = self._stage(s).backward(mb, g, split=a.kind == I)
            if s > 0:
                self._buffers[(B, s - 1, mb)] = grad_input
        elif a.kind == W:
            self._stage(s).backward_weight(mb)
        elif a.kind == SEND_F:
            self._send(a, self._buffers.pop((F, s + 1, mb)), owner[s + 1], s + 1)
        elif a.kind == SEND_B:
            self._send(a, self._buffers.pop((B, s - 1, mb)), owner[s - 1], s - 1)
        elif a.kind == RECV_F:
            self._buffers[(F, s, mb)] = self._recv(a, owner[s - 1], s - 1)
        elif a.kind == RECV_B:
            self._buffers[(B, s, mb)] = self._recv(a, owner[s + 1], s + 1)

    def _forward(self, s: int, mb: int, x: Any) -> Any:
        try:
            return self._stage(s).forward(mb, x)
        except (ValueError, TypeError) as exc:  # what layers raise for an input they cannot take
            if s == 0:
                raise
            src = self.program.stage_to_rank[s - 1]
            raise type(exc)(
                f"{exc} (its input, shape {tuple(x.shape)} {x.dtype}, is the output of stage "
                f"{s - 1} on rank {src})"
            ) from exc

    def _loss(self, mb: int, y: Any) -> Any:
        """Forward and backward of the loss at once; the gradient waits for this stage's B."""
        self._outputs[mb] = y
        t = self._targets[mb]
        flat = y.ndim > 2 and y.ndim == t.ndim + 1  # (..., C) logits against (...) labels
        pred = y.reshape(-1, y.shape[-1]) if flat else y
        loss = self.loss_fn.forward(pred, t.reshape(-1) if flat else t)
        grad = self.loss_fn.backward() * (1.0 / self.n_microbatches)
        self._losses[mb] = loss
        return grad.reshape(y.shape)

    # -- messages -----------------------------------------------------------------------------

    def _peer(self, rank: int) -> int:
        return self.group.ranks[rank]  # send and recv take global ranks

    def _send(self, a: Action, array: Any, dst: int, to_stage: int) -> None:
        tag = TAG_BASE + 2 * to_stage + _KINDS[a.kind]
        array = array if array.flags.c_contiguous else array.copy()
        header = _header(a.kind, a.stage, a.microbatch, array)
        self._pending.append(dist.isend(header, self._peer(dst), self.group, tag))
        self._pending.append(dist.isend(array, self._peer(dst), self.group, tag))
        self._keep.append((header, array))

    def _recv(self, a: Action, src: int, from_stage: int) -> Any:
        kind = SEND_F if a.kind == RECV_F else SEND_B
        tag = TAG_BASE + 2 * a.stage + _KINDS[kind]
        header = np.empty(6 + _MAX_DIMS, dtype=np.int64)
        dist.recv(header, self._peer(src), self.group, tag)
        status, _, stage, mb, char, ndim = (int(v) for v in header[:6])
        shape = tuple(int(v) for v in header[6 : 6 + ndim])
        dtype = np.dtype(chr(char))
        stage_ref = self._stage(a.stage)
        xp = np
        for p in stage_ref.module.parameters():
            xp = array_namespace(p.data)
            break
        payload = (np if status == _FAILED else xp).empty(shape, dtype=dtype)
        dist.recv(payload, self._peer(src), self.group, tag)
        if status == _FAILED:
            raise _PeerFailed(bytes(payload).decode("utf-8", "replace"))
        what = "activation" if a.kind == RECV_F else "gradient"
        me = f"stage {a.stage} (rank {self.rank})"
        them = f"stage {from_stage} (rank {src})"
        if (stage, mb) != (from_stage, a.microbatch):
            raise ValueError(
                f"{me} expected the {what} of micro-batch {a.microbatch} from {them} but received "
                f"micro-batch {mb} of stage {stage}: the ranks run different schedules"
            )
        if a.kind == RECV_B:
            expected = stage_ref.output_shapes.get(a.microbatch)
            if expected is not None and shape != expected:
                raise ValueError(
                    f"{them} sent a gradient of shape {shape} for micro-batch {mb}, but the "
                    f"output of {me} had shape {expected}: stage {from_stage} must return a "
                    "gradient shaped like its input"
                )
        return payload

    def _finish_sends(self) -> None:
        pending, self._pending = self._pending, []
        for work in pending:
            work.wait()
        self._keep = []

    # -- failure ------------------------------------------------------------------------------

    def _fail(self, exc: BaseException, actions: list[Action], index: int, started: bool) -> str:
        """Send an error in place of every message still owed; return the error's text."""
        if isinstance(exc, _PeerFailed):
            text = exc.text
        else:
            action = actions[index] if started and index < len(actions) else None
            during = f" during {action}" if action is not None else " before the step"
            stages = ", ".join(str(s.stage_index) for s in self.stages)
            text = (
                f"stage {action.stage if action else stages} (rank {self.rank}) raised "
                f"{type(exc).__name__}{during}: {exc}"
            )
        for a in actions[index:]:
            if a.kind in (SEND_F, SEND_B):
                to_stage = a.stage + (1 if a.kind == SEND_F else -1)
                dst = self.program.stage_to_rank[to_stage]
                payload = np.frombuffer(text.encode(), dtype=np.uint8).copy()
                header = _header(a.kind, a.stage, a.microbatch, payload, _FAILED)
                tag = TAG_BASE + 2 * to_stage + _KINDS[a.kind]
                try:
                    dist.isend(header, self._peer(dst), self.group, tag)
                    self._pending.append(dist.isend(payload, self._peer(dst), self.group, tag))
                except Exception:
                    pass  # the peer's own failure reaches it another way
        try:
            self._finish_sends()
        except Exception:
            pass
        for stage in self.stages:
            stage.clear()
        if isinstance(exc, _PeerFailed):
            stopped = actions[index] if index < len(actions) else "the end"
            return (
                f"pipeline step failed on another rank: {text} (rank {self.rank} stopped at "
                f"{stopped})"
            )
        return f"pipeline step failed: {text}"

    def _agree(self, failure: str | None, error: BaseException | None) -> None:
        """Every rank learns whether any failed, even one whose peers owed it nothing more."""
        flag = np.array([0 if failure is None else 1], dtype=np.int64)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            texts = dist.all_gather_object(failure, group=self.group) if flag[0] else []
        except PluribusError as exc:
            # A failing rank's group may already be aborted (its peers report the root cause
            # through the group): this rank's own failure stays the error it raises.
            if failure is not None:
                raise PipelineError(failure) from (
                    None if isinstance(error, _PeerFailed) else error
                )
            raise PipelineError(f"pipeline step failed on another rank: {exc}") from exc
        if not flag[0]:
            return
        if failure is None:
            first = next(t for t in texts if t is not None)
            raise PipelineError(
                first.replace("pipeline step failed:", "pipeline step failed on another rank:")
                + f" (rank {self.rank} finished its part)"
            )
        if isinstance(error, _PeerFailed):
            raise PipelineError(failure) from None
        raise PipelineError(failure) from error

    # -- data parallelism ---------------------------------------------------------------------

    def _average_gradients(self) -> None:
        for stage in self.stages:
            params = stage.module.parameters()
            if not params:
                continue
            xp = array_namespace(params[0].data)
            grads = [p.grad if p.grad is not None else xp.zeros_like(p.data) for p in params]
            flat = xp.concatenate([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.data_parallel_group)
            offset = 0
            for p, g in zip(params, grads, strict=True):
                p.grad = flat[offset : offset + g.size].reshape(p.data.shape)
                offset += g.size


class ScheduleGPipe(PipelineSchedule):
    """All forwards, then all backwards."""

    schedule_name = "GPipe"


class Schedule1F1B(PipelineSchedule):
    """One forward, one backward: GPipe's bubble with at most p micro-batches in flight."""

    schedule_name = "1F1B"


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Several stages per rank (pass them as a list), in Megatron's interleaved order."""

    schedule_name = "Interleaved1F1B"


class ScheduleZeroBubble(PipelineSchedule):
    """ZB-H1: split backward, weight gradients fill the bubble (modules need split backward)."""

    schedule_name = "ZeroBubble"


class ScheduleZeroBubbleH2(PipelineSchedule):
    """ZB-H2: ZB-H1 with up to 2p - 1 micro-batches held per rank; the deferred weight gradients
    also fill the wait for the last input gradients (modules need split backward)."""

    schedule_name = "ZBH2"


class ScheduleZBVZeroBubble(PipelineSchedule):
    """ZB-V: two stages per rank in a V (rank r: stages r and 2p - 1 - r), split backward; about
    half ZB-H1's bubble at 1F1B's activation memory (modules need split backward)."""

    schedule_name = "ZBV"


class ScheduleFromProgram(PipelineSchedule):
    """A user-written :class:`Program` (checked by the same checker before it runs)."""

    def __init__(self, stages, program: Program, loss_fn: Any = None, **kwargs: Any):
        super().__init__(stages, program.num_microbatches, loss_fn, program=program, **kwargs)


#: The runtime class of each built-in schedule, by the names :func:`build` takes.
SCHEDULE_CLASSES: dict[str, Callable[..., PipelineSchedule]] = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "ZeroBubble": ScheduleZeroBubble,
    "ZBH2": ScheduleZeroBubbleH2,
    "ZBV": ScheduleZBVZeroBubble,
}

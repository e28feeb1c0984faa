"""DistributedDataParallel: one model replica per rank, gradients averaged during backward.

How the overlap works: every parameter's gradient is assigned to a bucket (in reverse definition
order, which is the order backward produces them). DDP registers a hook on each parameter
(:meth:`~pluribus.nn.Parameter.register_post_accumulate_grad_hook`); when the last gradient of a
bucket has arrived, the bucket is packed into one flat array and its all-reduce starts
asynchronously on the group's work queue, while backward carries on with earlier layers. Buckets
are launched in index order on every rank, so the collectives match everywhere. At the end of
backward DDP waits for every bucket and writes the averaged gradients back into ``.grad``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .. import distributed as dist
from ..arrays import device_of
from ..nn.module import Module, Parameter, array_namespace
from ..symmetric import empty_symmetric
from .comm_hooks import BUILTIN_HOOKS, allreduce_hook

CommHook = Callable[[Any, "GradBucket"], Any]


class GradBucket:
    """Gradients reduced together: what a comm hook gets (torch's ``GradBucket``)."""

    def __init__(
        self,
        index: int,
        params: list[Parameter],
        names: list[str],
        xp: Any,
        dtype: Any,
        group: Any = None,
    ):
        self.index = index
        self.params = params
        self.names = names
        self.offsets: list[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += int(p.data.size)
        if xp is np:  # symmetric memory: a backend that can reduces it without copying it in
            self._buffer = empty_symmetric(total, dtype, group)
            self._buffer[...] = 0
        else:
            self._buffer = xp.zeros(total, dtype=dtype)
        self.views = [
            self._buffer[off : off + p.data.size].reshape(p.data.shape)
            for p, off in zip(params, self.offsets, strict=True)
        ]

    def buffer(self) -> Any:
        """The flat array of this rank's gradients for the bucket's parameters."""
        return self._buffer

    def parameters(self) -> list[Parameter]:
        return self.params

    def nbytes(self) -> int:
        return int(self._buffer.nbytes)

    def pack(self) -> None:
        """Gather the gradients into the buffer (those accumulated in place are there already)."""
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is None:
                view[...] = 0
                p.grad = view
            elif p.grad is not view:
                view[...] = p.grad

    def unpack(self, reduced: Any) -> None:
        """Leave the reduced gradients in ``.grad``, as views of the buffer."""
        if reduced is not self._buffer:
            self._buffer[...] = reduced
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is not view:
                p.grad = view

    def __repr__(self) -> str:
        return f"GradBucket(index={self.index}, params={len(self.params)}, bytes={self.nbytes()})"


class DistributedDataParallel(Module):
    """Wrap ``module`` so that ``backward`` leaves gradients averaged over ``group``.

    Use ``ddp.forward``/``ddp.backward`` (or ``ddp(x)``) instead of the module's own; the
    optimizer takes ``ddp.parameters()`` (the module's own parameters). ``state_dict`` is the
    module's, without a ``module.`` prefix, so checkpoints load with or without DDP.

    ``group`` or ``process_group`` (torch's name; either works): the ranks that average.
    ``bucket_cap_mb``: bytes per bucket (smaller buckets start communicating earlier, larger ones
    have less per-message overhead). ``find_unused_parameters``: parameters that got no gradient
    on some ranks in a step are reduced as zeros instead of raising; a parameter no rank used
    keeps ``.grad`` as it was (``None`` after ``zero_grad``), as in torch and in one process,
    so weight decay and momentum leave it alone. ``comm_hook``: ``"fp16"``, ``"bf16"``,
    ``"allreduce"`` or a ``hook(state, bucket)`` (see :mod:`pluribus.parallel.comm_hooks`).
    ``broadcast_buffers``: copy rank 0's buffers (running statistics) at every training forward.
    ``overlap=False`` starts the first all-reduce only after backward (to measure the overlap).
    """

    def __init__(
        self,
        module: Module,
        group: Any = None,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        comm_hook: CommHook | str | None = None,
        broadcast_buffers: bool = True,
        overlap: bool = True,
        process_group: Any = None,
    ):
        super().__init__()
        if process_group is not None:
            if group is not None and group is not process_group:
                raise ValueError(
                    "DistributedDataParallel got both group= and process_group= with different "
                    "groups; they are the same argument (process_group is torch's name): pass one"
                )
            group = process_group
        self.module = module
        self.process_group = group
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.overlap = overlap
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self._comm_state: Any = group
        self._comm_hook: CommHook = allreduce_hook
        if comm_hook is not None:
            self.register_comm_hook(group, comm_hook)
        self._require_sync = True
        self._named = list(module.named_parameters())
        self._check_same_model()
        self._broadcast_state()
        self.buckets = self._build_buckets()
        self._slot = {id(p): b.index for b in self.buckets for p in b.params}
        self._names = {id(p): n for n, p in self._named}
        self._expected: dict[int, int] | None = None  # hook calls per parameter per backward
        self._active = False
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad) for _, p in self._named
        ]
        for bucket in self.buckets:
            for param, view in zip(bucket.params, bucket.views, strict=True):
                param.grad_view = view

    # -- setup --------------------------------------------------------------------------------

    def _group(self) -> Any:
        return dist.get_default_group() if self.process_group is None else self.process_group

    def _check_same_model(self) -> None:
        """Every rank must hold the same parameters; name the first difference if not."""
        mine = [(n, tuple(p.data.shape), str(p.data.dtype)) for n, p in self._named]
        everyone = dist.all_gather_object(mine, group=self.process_group)
        group = self._group()
        reference = everyone[0]
        for local_rank, theirs in enumerate(everyone[1:], start=1):
            rank = group.ranks[local_rank]
            for i in range(max(len(reference), len(theirs))):
                ref = reference[i] if i < len(reference) else None
                got = theirs[i] if i < len(theirs) else None
                if ref != got:
                    raise ValueError(
                        f"rank {group.global_rank}: DistributedDataParallel needs the same model "
                        f"on every rank, but parameter #{i} is {_describe(got)} on rank {rank} "
                        f"and {_describe(ref)} on rank {group.ranks[0]}; build the model the "
                        "same way everywhere"
                    )

    def _broadcast_state(self) -> None:
        arrays = [p.data for _, p in self._named] + [b for _, b in self.module.named_buffers()]
        _broadcast_coalesced(arrays, self._group(), self.process_group)

    def _build_buckets(self) -> list[GradBucket]:
        """Group parameters in reverse order into buckets of one dtype and at most the cap."""
        open_: dict[tuple, list[tuple[str, Parameter]]] = {}
        sizes: dict[tuple, int] = {}
        closed: list[list[tuple[str, Parameter]]] = []
        for name, param in reversed(self._named):
            key = (np.dtype(param.data.dtype).str, device_of(param.data))
            nbytes = int(param.data.nbytes)
            if key in open_ and sizes[key] + nbytes > self.bucket_cap_bytes and open_[key]:
                del open_[key]
            if key not in open_:
                open_[key], sizes[key] = [], 0
                closed.append(open_[key])
            open_[key].append((name, param))
            sizes[key] += nbytes
        buckets = []
        for index, members in enumerate(closed):
            first = members[0][1].data
            buckets.append(
                GradBucket(
                    index,
                    [p for _, p in members],
                    [n for n, _ in members],
                    array_namespace(first),
                    first.dtype,
                    self.process_group,
                )
            )
        return buckets

    def register_comm_hook(self, state: Any, hook: CommHook | str) -> None:
        """Use ``hook(state, bucket)`` for every bucket from now on."""
        if isinstance(hook, str):
            if hook not in BUILTIN_HOOKS:
                raise ValueError(f"unknown comm hook {hook!r}; built in: {sorted(BUILTIN_HOOKS)}")
            hook = BUILTIN_HOOKS[hook]
        self._comm_state, self._comm_hook = state, hook

    # -- the module protocol ------------------------------------------------------------------

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        return self.module.named_parameters()

    def named_buffers(self) -> Iterator[tuple[str, Any]]:
        return self.module.named_buffers()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self.module.training:
            buffers = [b for _, b in self.module.named_buffers()]
            if buffers and self._group().size > 1:
                _broadcast_coalesced(buffers, self._group(), self.process_group)
        return self.module.forward(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates local gradients only; the next synced backward reduces
        the sum of all of them."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    def backward(self, grad_output: Any) -> Any:
        if not self._require_sync:
            return self.module.backward(grad_output)
        self._start_reduction()
        try:
            grad_input = self.module.backward(grad_output)
        except BaseException:
            self._active = False
            raise
        self._finish_reduction()
        return grad_input

    # -- the reducer --------------------------------------------------------------------------

    def _start_reduction(self) -> None:
        self._calls: dict[int, int] = {}
        self._pending = [len(b.params) for b in self.buckets]
        self._ready: set[int] = set()
        self._works: list[Any] = []
        self._late: list[str] = []
        self._active = True

    def _on_grad(self, param: Parameter) -> None:
        if not self._active:
            return
        pid = id(param)
        self._calls[pid] = self._calls.get(pid, 0) + 1
        index = self._slot[pid]
        if index < len(self._works):  # its bucket is already on the wire
            self._late.append(self._names[pid])
            return
        if self._expected is None or pid in self._ready:
            return  # first step: learn how often each gradient arrives, reduce at the end
        if self._calls[pid] >= self._expected[pid]:
            self._ready.add(pid)
            self._pending[index] -= 1
            if self.overlap:
                self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while len(self._works) < len(self.buckets) and self._pending[len(self._works)] == 0:
            bucket = self.buckets[len(self._works)]
            bucket.pack()
            self._works.append(self._comm_hook(self._comm_state, bucket))

    def _finish_reduction(self) -> None:
        unused = []
        for bucket in self.buckets:
            for name, param in zip(bucket.names, bucket.params, strict=True):
                if id(param) in self._ready:
                    continue
                if id(param) not in self._calls and param.grad is None:
                    unused.append(name)
                self._ready.add(id(param))
                self._pending[bucket.index] -= 1
        self._launch_ready_buckets()
        self._active = False
        unused_everywhere = (
            self._unused_on_every_rank(unused) if self.find_unused_parameters else []
        )
        for bucket, work in zip(self.buckets, self._works, strict=True):
            bucket.unpack(work.result())
        for param in unused_everywhere:
            param.grad = None
        self._expected = {id(p): max(1, self._calls.get(id(p), 0)) for _, p in self._named}
        if self._late:
            raise RuntimeError(
                f"rank {self._group().global_rank}: DistributedDataParallel: the gradients of "
                f"{sorted(set(self._late))} arrived after their bucket was reduced (a parameter "
                "used more times than in the previous step); those contributions are missing "
                "from this step. Keep the graph the same from step to step"
            )
        if unused and not self.find_unused_parameters:
            unused = [n for n, _ in self._named if n in unused]
            raise RuntimeError(
                f"rank {self._group().global_rank}: DistributedDataParallel: parameters "
                f"{unused} got no gradient in this backward; they were reduced as zeros so no "
                "rank hangs. Pass find_unused_parameters=True if that is intended"
            )

    def _unused_on_every_rank(self, unused_here: list[str]) -> list[Parameter]:
        """The parameters no rank used: one all-reduce of a used-here mask, issued after every
        bucket so the collectives stay in the same order on all ranks."""
        xp = array_namespace(self._named[0][1].data)
        unused_here = set(unused_here)
        used = xp.asarray([0 if n in unused_here else 1 for n, _ in self._named], dtype=np.int32)
        dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.process_group)
        used_anywhere = used.tolist()
        return [p for (_, p), hit in zip(self._named, used_anywhere, strict=True) if not hit]

    def remove_hooks(self) -> None:
        """Detach DDP from the module's parameters (the module works on its own again)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for _, param in self._named:
            param.grad_view = None

    def __repr__(self) -> str:
        return f"DistributedDataParallel(buckets={len(self.buckets)}, module={self.module!r})"


def _describe(entry: Any) -> str:
    if entry is None:
        return "missing"
    name, shape, dtype = entry
    return f"{name!r} with shape {shape} and dtype {dtype}"


def _broadcast_coalesced(arrays: list[Any], group: Any, group_arg: Any) -> None:
    """Broadcast ``arrays`` from the group's first rank, one flat message per dtype and device."""
    by_kind: dict[tuple, list[Any]] = {}
    for a in arrays:
        by_kind.setdefault((np.dtype(a.dtype).str, device_of(a)), []).append(a)
    for members in by_kind.values():
        xp = array_namespace(members[0])
        flat = xp.concatenate([a.reshape(-1) for a in members])
        dist.broadcast(flat, src=group.ranks[0], group=group_arg)
        offset = 0
        for a in members:
            a[...] = flat[offset : offset + a.size].reshape(a.shape)
            offset += a.size

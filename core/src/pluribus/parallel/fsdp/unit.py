"""One FSDP unit: the parameters one ``fully_shard`` call manages, their shards, the one
all-gather that makes them whole and the one reduce-scatter that shards their gradients.

Every parameter is split along its first dimension by numpy's ``array_split`` rule over the
shard dimension of the mesh (uneven and empty pieces allowed) and stays a ``Parameter`` with
its own name: between steps ``param.data`` is this rank's rows, so the optimizer updates shards
in place and never sees a flat buffer. The flat buffers are the unit's business:

- the all-gather sends this rank's pieces of every parameter packed together into a segment
  as long as the longest rank's (so that every rank sends the same size), the last element a
  tag (the unit's index), and receives every rank's segment; the pieces are then copied into
  one parameter-major buffer of which each parameter's ``.data`` is a view. The tags are what
  turns ranks that run different units into an error naming the unit and the ranks.
- the reduce-scatter packs the full gradients rank-major (in the group's rank order, so that
  the blocks lie back to back as the backend reads them) and leaves this rank's rows of every
  parameter's averaged gradient in one buffer of which each ``.grad`` is a view.

The arrays the peers read (both collectives' inputs) are lent by the root's
:class:`~.buffers.SendBuffers`: symmetric memory, reused every step.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ... import distributed as dist
from ...dtensor import DTensor, Layout, Replicate, Shard, split_sizes
from ...nn.module import Module, Parameter, array_namespace
from .policy import MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy, StrategyRules


class _Piece:
    """Where one parameter lives: its global shape, every rank's rows, its offsets."""

    def __init__(self, name: str, param: Parameter, n: int):
        if param.data.ndim == 0:
            raise ValueError(
                f"rank {dist.get_rank()}: fully_shard: parameter {name!r} is 0-d; FSDP shards "
                "parameters on their first dimension: give it shape (1,)"
            )
        self.name, self.param = name, param
        param.sharded_by_fsdp = True  # for clip_grad_norm_ of other models, which refuses it
        self.shape = tuple(int(s) for s in param.data.shape)
        self.row_numel = int(np.prod(self.shape[1:], dtype=np.int64))
        self.sizes = split_sizes(self.shape[0], n)
        self.starts = [sum(self.sizes[:k]) for k in range(n)]
        self.numel = self.shape[0] * self.row_numel
        self.full_offset = 0  # in the parameter-major buffers
        self.segment_offsets = [0] * n  # in each rank's segment of the all-gather

    def piece_shape(self, k: int) -> tuple[int, ...]:
        return (self.sizes[k],) + self.shape[1:]

    def piece_numel(self, k: int) -> int:
        return self.sizes[k] * self.row_numel


class Unit:
    """The sharded parameters of one module (those no inner unit manages)."""

    def __init__(
        self,
        module: Module,
        named_params: list[tuple[str, Parameter]],
        mesh: Any,
        strategy: ShardingStrategy,
        rules: StrategyRules,
        reshard_after_forward: bool,
        mp: MixedPrecisionPolicy,
        offload: OffloadPolicy | None,
    ):
        self.module, self.mesh, self.strategy, self.rules = module, mesh, strategy, rules
        self.reshard_after_forward = reshard_after_forward
        self.name, self.index, self.root = "", -1, None  # set by the root's lazy init
        if rules.shards_parameters:
            dim = mesh.ndim - 1
            self.group, self.perm, _ = mesh.group_info(dim)
            self.n, self.me = mesh.shape[dim], mesh.coordinate[dim]
            self.replicate_dims = list(range(mesh.ndim - 1))
            self.placements = (Replicate(),) * (mesh.ndim - 1) + (Shard(0),)
        else:
            self.group, self.perm, self.n, self.me = None, [0], 1, 0
            self.replicate_dims = list(range(mesh.ndim))
            self.placements = (Replicate(),) * mesh.ndim
        self.pieces = [_Piece(name, p, self.n) for name, p in named_params]
        first = self.pieces[0].param.data if self.pieces else np.zeros(0, np.float32)
        dtypes = {str(p.param.data.dtype) for p in self.pieces}
        if len(dtypes) > 1 or np.dtype(first.dtype).kind != "f":
            raise TypeError(
                f"rank {dist.get_rank()}: fully_shard({type(module).__name__}): a unit's "
                f"parameters must share one floating dtype, got {sorted(dtypes)}; wrap modules "
                "of different dtypes apart"
            )
        self.xp = array_namespace(first)
        self.dtype = first.dtype
        self.compute_dtype = np.dtype(mp.param_dtype or first.dtype)
        self.reduce_dtype = np.dtype(mp.reduce_dtype or self.compute_dtype)
        self.offload = offload is not None and offload.offload_params and self.xp is not np
        self.total = 0
        self.counts = [0] * self.n  # elements of each rank's segment
        for piece in self.pieces:
            piece.full_offset = self.total
            self.total += piece.numel
            for k in range(self.n):
                piece.segment_offsets[k] = self.counts[k]
                self.counts[k] += piece.piece_numel(k)
        self.segment = max(self.counts) + 1  # each rank's all-gather segment, the tag last
        self.scatter_starts = [0] * self.n  # each rank's block in the reduce-scatter input
        start = 0
        for k in sorted(range(self.n), key=lambda k: self.perm[k]):
            self.scatter_starts[k] = start
            start += self.counts[k]
        # state between calls
        self.gathered = False  # .data are the full (compute-dtype) arrays
        self._gather: tuple | None = None  # an all-gather in flight
        self._reduction: tuple | None = None  # a reduce-scatter in flight
        self.compute_flat: Any = None  # the gathered parameters, when not full_flat itself
        self.full_grad_flat: Any = None  # full gradients of the running backward
        self._stash: list[Any] = []  # gradient shards from an earlier backward, to add to
        self.accumulating = False  # a no_sync backward left full gradients
        self.gather_wait_s = 0.0  # time spent waiting for this unit's all-gathers
        self._shard_storage()

    # -- storage ----------------------------------------------------------------------------

    def _shard_storage(self) -> None:
        """Move the parameters into their shards. The strategies that keep the full parameters
        keep them in the compute dtype; without mixed precision the shards are views of them,
        with it the float32 shards (the master weights) are a buffer of their own, as
        FULL_SHARD's always are."""
        xp, me = self.xp, self.me
        self.full_flat = self.shard_flat = None
        if self.rules.keeps_full_parameters:
            self.full_flat = xp.empty(self.total, self.compute_dtype)
            for piece in self.pieces:
                self._full_view(self.full_flat, piece)[...] = piece.param.data
        self.shards_in_full = self.full_flat is not None and self.compute_dtype == self.dtype
        if self.shards_in_full:
            self.shard_views = [
                self._full_view(self.full_flat, p)[p.starts[me] : p.starts[me] + p.sizes[me]]
                for p in self.pieces
            ]
        else:
            store = np if self.offload else xp
            self.shard_flat = store.empty(self.counts[me], self.dtype)
            self.shard_views = []
            for piece in self.pieces:
                view = self._segment_view(self.shard_flat, piece, me)
                rows = piece.param.data[piece.starts[me] : piece.starts[me] + piece.sizes[me]]
                view[...] = rows.get() if self.offload else rows
                self.shard_views.append(view)
        for piece, view in zip(self.pieces, self.shard_views, strict=True):
            piece.param.data, piece.param.grad = view, None

    @staticmethod
    def _full_view(flat: Any, piece: _Piece) -> Any:
        return flat[piece.full_offset : piece.full_offset + piece.numel].reshape(piece.shape)

    @staticmethod
    def _segment_view(segment: Any, piece: _Piece, k: int) -> Any:
        start = piece.segment_offsets[k]
        return segment[start : start + piece.piece_numel(k)].reshape(piece.piece_shape(k))

    def layout(self, piece: _Piece) -> Layout:
        sizes = tuple(piece.sizes if p.is_shard() else None for p in self.placements)
        return Layout(piece.shape, self.placements, sizes)

    def dtensor(self, piece: _Piece, local: Any) -> DTensor:
        """``local`` (this rank's rows of ``piece``, or an array shaped like them) as a DTensor
        with the parameter's layout; no communication."""
        return DTensor(local, self.mesh, self.layout(piece))

    # -- all-gather ---------------------------------------------------------------------------

    def _pack_shards(self, arrays: list[Any], dtype: Any) -> Any:
        send = self.root.send_buffers.take("all_gather", self, dtype, self.segment)
        for piece, array in zip(self.pieces, arrays, strict=True):
            view = self._segment_view(send, piece, self.me)
            view[...] = self.xp.asarray(array) if self.offload else array
        send[-1] = self.index
        return send

    def _start_gather(self, arrays: list[Any], dtype: Any) -> tuple:
        send = self._pack_shards(arrays, dtype)
        length = self.segment
        recv = self.xp.empty(length * self.n, dtype)
        segments = [recv[k * length : (k + 1) * length] for k in range(self.n)]
        outputs = [None] * self.n
        for k, segment in enumerate(segments):
            outputs[self.perm[k]] = segment
        work = dist.all_gather(outputs, send, group=self.group, async_op=True)
        return work, segments, send

    def _wait_gather(self, pending: tuple) -> None:
        """Wait for an all-gather, give its send buffer back and check every rank's tag."""
        work, segments, send = pending
        try:
            work.wait()
        except ValueError as exc:  # the backend saw segments of other sizes than this unit's
            names = self.root.unit_names if self.root is not None else {}
            raise RuntimeError(
                f"rank {dist.get_rank()}: FSDP: the all-gather of unit "
                f"{names.get(self.index, self.name)!r} met one of another size ({exc}); ranks "
                "ran different units. Run the same units in the same order on every rank"
            ) from exc
        self.root.send_buffers.give_back(send)
        self._check_tags(segments)

    def _finish_gather(self, pending: tuple, target_flat: Any, skip_own: bool) -> None:
        segments = pending[1]
        started = time.perf_counter()
        self._wait_gather(pending)
        self.gather_wait_s += time.perf_counter() - started
        for piece in self.pieces:
            full = self._full_view(target_flat, piece)
            for k, segment in enumerate(segments):
                if not (skip_own and k == self.me) and piece.sizes[k]:
                    full[piece.starts[k] : piece.starts[k] + piece.sizes[k]] = self._segment_view(
                        segment, piece, k
                    )

    def _check_tags(self, segments: list[Any]) -> None:
        tags = [int(segment[-1]) for segment in segments]
        if all(tag == self.index for tag in tags):
            return
        names = self.root.unit_names if self.root is not None else {}
        row = self._shard_row_ranks()
        seen = ", ".join(
            f"rank {r} gathers {names.get(t, f'unit #{t}')!r}"
            for r, t in zip(row, tags, strict=True)
        )
        odd = [r for r, t in zip(row, tags, strict=True) if t != self.index]
        raise RuntimeError(
            f"rank {dist.get_rank()}: FSDP: ranks ran different units: {seen}; this rank expected "
            f"{names.get(self.index, self.name)!r} and rank(s) {odd} did not (one rank skipped or "
            "added a unit's forward or backward). Run the same units in the same order on every "
            "rank"
        )

    def _shard_row_ranks(self) -> list[int]:
        index = list(self.mesh.coordinate)
        index[-1] = slice(None)
        return [int(r) for r in self.mesh.mesh[tuple(index)]]

    def start_unshard(self) -> None:
        """Start the all-gather of the full parameters (asynchronous: the prefetch)."""
        if self.gathered or self._gather is not None or not self.pieces:
            return
        if self.n == 1:
            return  # nothing to gather: finish_unshard casts or points at the full arrays
        self._gather = self._start_gather(self.shard_views, self.compute_dtype)
        self.root.ledger.sample()

    def finish_unshard(self) -> None:
        """Make ``.data`` the full parameters in the compute dtype (waiting for a prefetch)."""
        if self.gathered or not self.pieces:
            self.gathered = True
            return
        in_place = self.full_flat is not None  # kept, in the compute dtype
        target = self.full_flat if in_place else self.xp.empty(self.total, self.compute_dtype)
        self.compute_flat = None if in_place else target
        if self.n == 1:
            if not self.shards_in_full:  # the float32 master copy, cast
                target[...] = self.xp.asarray(self.shard_flat) if self.offload else self.shard_flat
        else:
            if self._gather is None:
                self.start_unshard()
            pending, self._gather = self._gather, None
            self._finish_gather(pending, target, skip_own=self.shards_in_full)
            self.root.ledger.sample(pending)
        for piece in self.pieces:
            piece.param.data = self._full_view(target, piece)
        self.gathered = True
        self.root.ledger.sample()

    def reshard(self) -> None:
        """Point ``.data`` back at the shards and free the gathered parameters."""
        if self._gather is not None:  # a prefetch nobody used: finish it so ranks stay matched
            pending, self._gather = self._gather, None
            self._wait_gather(pending)
        for piece, view in zip(self.pieces, self.shard_views, strict=True):
            piece.param.data = view
        self.compute_flat = None
        self.gathered = False

    def gather_full(self, arrays: list[Any], dtype: Any) -> list[Any]:
        """Every piece's full array from each rank's ``arrays`` (rows shaped like the shards),
        synchronously: for full state dicts, one unit at a time."""
        if self.n == 1:
            return [self.xp.asarray(a).astype(dtype, copy=True) for a in arrays]
        out = self.xp.empty(self.total, dtype)
        self._finish_gather(self._start_gather(arrays, dtype), out, skip_own=False)
        return [self._full_view(out, piece) for piece in self.pieces]

    # -- gradients ----------------------------------------------------------------------------

    def prepare_gradients(self) -> None:
        """Before backward: full-size zero gradients in the compute dtype (kept when a no_sync
        backward left some), the earlier gradient shards put aside to be added later."""
        if self.accumulating or not self.pieces:
            return
        if self.full_grad_flat is None or self.rules.keeps_full_gradients:
            self._stash = [
                None if p.param.grad is None else p.param.grad.copy() for p in self.pieces
            ]
            self.full_grad_flat = self.xp.zeros(self.total, self.compute_dtype)
        for piece in self.pieces:
            piece.param.grad = self._full_view(self.full_grad_flat, piece)
        self.root.ledger.sample()

    def start_reduction(self) -> None:
        """Average the full gradients over the ranks (reduce-scatter on the shard dimension),
        asynchronously; the full gradients are freed unless the strategy keeps them."""
        self.accumulating = False
        if not self.pieces:
            return
        xp, full = self.xp, self.full_grad_flat
        if self.n > 1:
            send = self.root.send_buffers.take(
                "reduce_scatter", self, self.reduce_dtype, sum(self.counts)
            )
            segments = [
                send[start : start + count]
                for start, count in zip(self.scatter_starts, self.counts, strict=True)
            ]
            for piece in self.pieces:
                grad = self._full_view(full, piece)
                for k, segment in enumerate(segments):
                    if piece.sizes[k]:
                        rows = grad[piece.starts[k] : piece.starts[k] + piece.sizes[k]]
                        self._segment_view(segment, piece, k)[...] = rows
            out = xp.empty(self.counts[self.me], self.reduce_dtype)
            inputs = [None] * self.n
            for k, segment in enumerate(segments):
                inputs[self.perm[k]] = segment
            work = dist.reduce_scatter(
                out, inputs, op=dist.ReduceOp.AVG, group=self.group, async_op=True
            )
        else:
            send = None
            out = full if full.dtype == self.reduce_dtype else full.astype(self.reduce_dtype)
            work = None
            if self.replicate_dims:
                work = dist.all_reduce(
                    out, op=dist.ReduceOp.AVG, group=self.mesh.get_group(0), async_op=True
                )
        self._reduction = (work, out, send)
        self.root.ledger.sample()
        if not self.rules.keeps_full_gradients:
            for piece in self.pieces:
                piece.param.grad = None
            self.full_grad_flat = None

    def finish_reduction(self) -> None:
        """Wait for the reduction; leave this rank's rows of the averaged gradients in
        ``.grad`` (added to the gradient shards of earlier backwards, if not zeroed)."""
        if self._reduction is None:
            return
        (work, out, send), self._reduction = self._reduction, None
        if work is not None:
            work.wait()
        if send is not None:
            self.root.send_buffers.give_back(send)
        later_dims = self.replicate_dims if self.n > 1 else self.replicate_dims[1:]
        for dim in later_dims:
            dist.all_reduce(out, op=dist.ReduceOp.AVG, group=self.mesh.get_group(dim))
        if self.rules.keeps_full_gradients and self.full_grad_flat.dtype == self.dtype:
            shards = []
            for piece in self.pieces:
                rows = self._full_view(self.full_grad_flat, piece)[
                    piece.starts[self.me] : piece.starts[self.me] + piece.sizes[self.me]
                ]
                rows[...] = self._segment_view(out, piece, self.me)
                shards.append(rows)
        else:
            flat = out.astype(self.dtype, copy=False)
            if self.offload:
                flat = flat.get()
            shards = [self._segment_view(flat, piece, self.me) for piece in self.pieces]
        earlier_shards = self._stash or [None] * len(shards)
        for piece, shard, earlier in zip(self.pieces, shards, earlier_shards, strict=True):
            if earlier is not None:
                earlier += shard
                shard = earlier
            piece.param.grad = shard
        self._stash = []
        self.root.ledger.sample()

"""``fully_shard`` and the wrapper form ``FullyShardedDataParallel``.

``fully_shard(block)`` for each transformer block, then ``fully_shard(model)``: each call
shards the parameters its module holds (those no inner call took) and hooks the module:

- forward pre-hook: wait for (or start) the unit's all-gather, then start the next unit's
  (forward prefetch, in the order the previous step ran them);
- forward hook: free the full parameters again (FULL_SHARD, HYBRID_SHARD; not the root,
  whose backward comes next);
- backward pre-hook: gather again if they were freed, start the previous unit's all-gather
  (backward prefetch), give the parameters full-size gradient buffers;
- backward hook: free the full parameters and start the gradient reduce-scatter; the root's
  waits for every reduction, so ``model.backward`` returns with sharded, averaged gradients.

The first forward of the outermost unit (the root) finds every unit below it. The module's
class becomes a subclass of its own and :class:`FSDPModule`, as in torch's FSDP2, which adds
``unshard``/``reshard``, ``no_sync``, ``state_dict`` (DTensors), ``clip_grad_norm_`` and the
memory ledger.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from ... import distributed as dist
from ...mesh import DeviceMesh, init_device_mesh
from ...nn.module import Module
from .buffers import SendBuffers
from .ledger import LedgerReport, MemoryLedger
from .policy import STRATEGIES, MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy
from .unit import Unit


class _RootState:
    """What the units below one root share: their order, the reductions in flight, the
    send buffers, the ledger, and whether this backward synchronises gradients."""

    def __init__(self, root: Module, prefetch: bool):
        self.root_unit: Unit = root._fsdp_unit
        self.units: list[Unit] = []
        for name, module in root.named_modules():
            unit = getattr(module, "_fsdp_unit", None)
            if unit is None:
                continue
            if unit.root is not None and unit is not self.root_unit:
                raise RuntimeError(
                    f"rank {dist.get_rank()}: FSDP unit {name!r} already belongs to another "
                    "root; apply fully_shard to the outermost module once"
                )
            unit.name, unit.index, unit.root = name or "<root>", len(self.units), self
            self.units.append(unit)
        self.unit_names = {u.index: u.name for u in self.units}
        _check_same_units(self.units)
        self.root_unit.reshard_after_forward = False
        self.prefetch = prefetch
        self.requires_sync = True
        self.forward_order: list[Unit] = []
        self.last_forward_order: list[Unit] = []
        self.reductions: list[Unit] = []
        self.send_buffers = SendBuffers(self.units)
        self.ledger = MemoryLedger(self.units, self.send_buffers)

    def next_in_forward(self, unit: Unit) -> Unit | None:
        order = self.last_forward_order
        position = len(self.forward_order)  # this unit was just appended
        if position < len(order) and order[position - 1] is unit:
            return order[position]
        return None


def _check_same_units(units: list[Unit]) -> None:
    """Every rank of the mesh must shard the same parameters the same way, and the same
    tensor-parallel piece of each (ranks that hold other pieces would average them); name the
    first difference (checked along each mesh dimension, so a mesh over part of the world
    works)."""
    mine = [
        [
            u.name,
            u.strategy.value,
            [
                [p.name, list(p.shape), str(p.param.data.dtype), _piece_of(p.param)]
                for p in u.pieces
            ],
        ]
        for u in units
    ]
    mesh = units[0].mesh
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        everyone = dist.all_gather_object(mine, group=group)
        for local_rank, theirs in enumerate(everyone):
            if theirs == mine:
                continue
            first = next(
                (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                min(len(theirs), len(mine)),
            )
            ours = mine[first] if first < len(mine) else "nothing"
            other = theirs[first] if first < len(theirs) else "nothing"
            raise ValueError(
                f"rank {dist.get_rank()}: FSDP needs the same units on every rank, but unit "
                f"#{first} is {other} on rank {group.ranks[local_rank]} and {ours} on this "
                "rank; build and wrap the model the same way everywhere"
            )


def _piece_of(param: Any) -> str:
    """Which tensor-parallel piece a parameter holds ("whole" when it is not split)."""
    layout = getattr(param, "tp_layout", None)
    if layout is None:
        return "whole"
    return f"tensor-parallel piece {layout[0].get_local_rank()} of {layout[0].size()}"


def _state(module: Module) -> _RootState:
    unit: Unit = module._fsdp_unit
    if unit.root is None:
        _RootState(module, module._fsdp_prefetch)
    return unit.root


def _cast(value: Any, dtype: Any) -> Any:
    if dtype is not None and getattr(value, "dtype", None) is not None and value.dtype.kind == "f":
        return value.astype(dtype, copy=False)
    return value


def _pre_forward(module: Module, args: tuple) -> tuple:
    state = _state(module)
    unit: Unit = module._fsdp_unit
    if unit is state.root_unit:
        state.forward_order = []
        if module._fsdp_mp.cast_forward_inputs:
            args = tuple(_cast(a, module._fsdp_mp.param_dtype) for a in args)
    state.forward_order.append(unit)
    unit.finish_unshard()
    if state.prefetch:
        following = state.next_in_forward(unit)
        if following is not None:
            following.start_unshard()
    return args


def _post_forward(module: Module, args: tuple, output: Any) -> None:
    state, unit = _state(module), module._fsdp_unit
    if unit.reshard_after_forward:
        unit.reshard()
    if unit is state.root_unit:
        state.last_forward_order = list(state.forward_order)
        state.reductions = []


def _pre_backward(module: Module, grad_output: tuple) -> tuple:
    state, unit = _state(module), module._fsdp_unit
    if unit is state.root_unit and module._fsdp_mp.cast_forward_inputs:
        grad_output = tuple(_cast(g, module._fsdp_mp.param_dtype) for g in grad_output)
    unit.finish_unshard()
    if state.prefetch and unit in state.forward_order:
        position = state.forward_order.index(unit)
        if position > 0:
            state.forward_order[position - 1].start_unshard()
    unit.prepare_gradients()
    return grad_output


def _post_backward(module: Module, grad_input: tuple, grad_output: tuple) -> None:
    state, unit = _state(module), module._fsdp_unit
    unit.reshard()
    if state.requires_sync and not unit.rules.keeps_full_gradients:
        # the previous unit's reduction had this unit's backward to finish in: collect it, so
        # that one packed gradient buffer at most is in flight
        for pending in state.reductions:
            pending.finish_reduction()
        unit.start_reduction()
        state.reductions = [unit]
    elif not state.requires_sync:
        unit.accumulating = True
    if unit is not state.root_unit or not state.requires_sync:
        return
    for later in state.units:  # ZeRO-1: every unit's gradients after backward, two in flight
        if later.rules.keeps_full_gradients and later.full_grad_flat is not None:
            later.start_reduction()
            state.reductions.append(later)
            if len(state.reductions) > 1:
                state.reductions.pop(0).finish_reduction()
    for pending in state.reductions:
        pending.finish_reduction()
    state.reductions = []
    unit.reshard()
    state.ledger.sample()


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` was applied to."""

    _fsdp_unit: Unit

    def unshard(self, async_op: bool = False) -> None:
        """Gather this unit's full parameters now (``async_op``: start it; the next forward or
        :meth:`unshard` waits). ``reshard`` frees them again."""
        _state(self)
        self._fsdp_unit.start_unshard()
        if not async_op:
            self._fsdp_unit.finish_unshard()

    def reshard(self) -> None:
        _state(self)
        self._fsdp_unit.reshard()

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """False: backward keeps full local gradients (accumulation without communication);
        the next backward with True reduces their sum."""
        _state(self).requires_sync = requires

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        state = _state(self)
        previous, state.requires_sync = state.requires_sync, False
        try:
            yield
        finally:
            state.requires_sync = previous

    def fsdp_units(self) -> list[Unit]:
        return _state(self).units

    def memory_ledger(self, optimizer: Any = None) -> LedgerReport:
        """Bytes this rank holds now and at the peak (see :mod:`.ledger`)."""
        return _state(self).ledger.report(optimizer)

    def reset_peak_memory(self) -> None:
        _state(self).ledger.reset_peak()

    def gather_wait_seconds(self) -> float:
        """Time backward and forward spent waiting for all-gathers (what prefetch hides)."""
        return sum(u.gather_wait_s for u in _state(self).units)

    def state_dict(self) -> dict[str, Any]:
        from .state_dict import sharded_state_dict

        return sharded_state_dict(self)

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        from .state_dict import load_sharded_state_dict

        load_sharded_state_dict(self, state, strict)

    def full_state_dict(self) -> dict[str, Any]:
        from .state_dict import full_state_dict

        return full_state_dict(self)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        from .clip import clip_grad_norm_

        return clip_grad_norm_(self, max_norm, norm_type)


_CLASSES: dict[type, type] = {}


def fully_shard(
    module: Module,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload: OffloadPolicy | None = None,
    strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
    prefetch: bool = True,
) -> Module:
    """Shard ``module``'s parameters (those no inner ``fully_shard`` took) over ``mesh`` and
    hook its forward and backward; returns ``module``, whose class now also derives from
    :class:`FSDPModule`.

    ``mesh``: 1-d (every rank shards), or 2-d for hybrid sharding (replicate over dimension 0,
    shard over dimension 1); default the whole world. A tensor-parallel model (split over
    ``mesh["tp"]``) is sharded over ``mesh["dp"]``: each rank's pieces are what it shards.
    ``strategy``: a :class:`ShardingStrategy` (or its value); ``reshard_after_forward``
    overrides the strategy's (False turns FULL_SHARD into SHARD_GRAD_OP's gathering).
    ``prefetch``: gather the next unit while this one computes, in forward and backward.
    """
    if not isinstance(module, Module):
        raise TypeError(f"fully_shard takes a pluribus.nn.Module, got {type(module).__name__}")
    if getattr(module, "_fsdp_unit", None) is not None:
        raise ValueError(
            f"rank {dist.get_rank()}: fully_shard was already applied to this "
            f"{type(module).__name__}"
        )
    strategy = ShardingStrategy(strategy)
    rules = STRATEGIES[strategy]
    if mesh is None:
        if rules.needs_2d_mesh:
            raise ValueError(
                f"rank {dist.get_rank()}: HYBRID_SHARD needs a 2-d mesh (replicate, shard): "
                'pass mesh=init_device_mesh("cpu", (nodes, ranks_per_node))'
            )
        mesh = init_device_mesh(_device_type(module), (dist.get_world_size(),))
    if rules.needs_2d_mesh and mesh.ndim != 2 or mesh.ndim > 2:
        raise ValueError(
            f"rank {dist.get_rank()}: {strategy.name} got a {mesh.ndim}-d mesh {mesh!r}; "
            "FSDP takes a 1-d mesh, or a 2-d one (replicate, shard) for hybrid sharding"
        )
    if reshard_after_forward is not None and rules.shards_parameters:
        rules = dataclasses.replace(rules, reshard_after_forward=reshard_after_forward)
    taken = {
        id(piece.param)
        for _, inner in module.named_modules()
        if getattr(inner, "_fsdp_unit", None) is not None
        for piece in inner._fsdp_unit.pieces
    }
    own = [(name, p) for name, p in module.named_parameters() if id(p) not in taken]
    _check_tensor_parallel(own, mesh)
    mp = mp_policy or MixedPrecisionPolicy()
    unit = Unit(module, own, mesh, strategy, rules, rules.reshard_after_forward, mp, offload)
    object.__setattr__(module, "_fsdp_unit", unit)
    object.__setattr__(module, "_fsdp_mp", mp)
    object.__setattr__(module, "_fsdp_prefetch", prefetch)
    module.register_forward_pre_hook(_pre_forward)
    module.register_forward_hook(_post_forward)
    module.register_full_backward_pre_hook(_pre_backward)
    module.register_full_backward_hook(_post_backward)
    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _CLASSES[cls]
    return module


def _check_tensor_parallel(own: list[tuple[str, Any]], mesh: DeviceMesh) -> None:
    """FSDP of a tensor-parallel model (2-D parallelism) shards each rank's piece over the
    data-parallel mesh: a 1-d mesh that meets each piece's tensor-parallel mesh at this rank
    only (``mesh["dp"]`` and ``mesh["tp"]`` of one 2-d mesh). Anything else would shard the
    pieces over ranks that hold other pieces."""
    me = dist.get_rank()
    for name, param in own:
        layout = getattr(param, "tp_layout", None)
        if layout is None:
            continue
        shared = set(mesh.mesh.flatten().tolist()) & set(layout[0].mesh.flatten().tolist())
        if mesh.ndim != 1 or shared != {me}:
            raise ValueError(
                f"rank {me}: fully_shard got {name!r}, split by tensor parallelism over "
                f"{layout[0]!r}, to shard over {mesh!r}; a tensor-parallel model is sharded "
                'over the 1-d data-parallel slice of the same 2-d mesh (mesh=mesh["dp"] with '
                'the plan on mesh["tp"])'
            )


def _device_type(module: Module) -> str:
    for _, p in module.named_parameters():
        return "cpu" if type(p.data).__module__.startswith("numpy") else "cuda"
    return "cpu"


class FullyShardedDataParallel(Module):
    """The wrapper form: ``fully_shard`` on every submodule ``auto_wrap`` picks (bottom-up),
    then on ``module``; use it as DDP is used (``fsdp(x)``, ``fsdp.backward(g)``,
    ``fsdp.parameters()`` for the optimizer). ``state_dict`` keys are the module's own.

    ``auto_wrap``: module classes (a tuple) or ``predicate(name, module)``; default
    ``TransformerBlock`` and nothing else.
    """

    def __init__(
        self,
        module: Module,
        mesh: DeviceMesh | None = None,
        sharding_strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
        auto_wrap: tuple[type, ...] | Callable[[str, Module], bool] | None = None,
        mixed_precision: MixedPrecisionPolicy | None = None,
        offload: OffloadPolicy | None = None,
        prefetch: bool = True,
    ):
        super().__init__()
        if auto_wrap is None:
            from ...nn.transformer import TransformerBlock

            auto_wrap = (TransformerBlock,)
        picks = auto_wrap if callable(auto_wrap) and not isinstance(auto_wrap, tuple) else None
        chosen = [
            (name, m)
            for name, m in module.named_modules()
            if name and (picks(name, m) if picks else isinstance(m, auto_wrap))
        ]
        options = dict(mesh=mesh, mp_policy=mixed_precision, offload=offload, prefetch=prefetch)
        for _, inner in sorted(chosen, key=lambda item: -item[0].count(".")):
            fully_shard(inner, strategy=sharding_strategy, **options)
        self.module = fully_shard(module, strategy=sharding_strategy, **options)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.forward(*args, **kwargs)

    def backward(self, grad_output: Any) -> Any:
        return self.module.backward(grad_output)

    def named_parameters(self):
        return self.module.named_parameters()

    def named_buffers(self):
        return self.module.named_buffers()

    def __getattr__(self, name: str) -> Any:
        # unshard, reshard, no_sync, state dicts, clip_grad_norm_, memory_ledger: the root's
        module = self.__dict__.get("module")
        if module is not None and hasattr(FSDPModule, name):
            return getattr(module, name)
        raise AttributeError(f"FullyShardedDataParallel has no attribute {name!r}")

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        self.module.load_state_dict(state, strict)

    def __repr__(self) -> str:
        return f"FullyShardedDataParallel({self.module!r})"

"""State dicts of sharded models and their optimizers, keyed by parameter name.

Sharded (no communication): each parameter, and each of its optimizer state arrays, as a
DTensor with the parameter's layout (``Shard(0)``, global shape kept), which
``pluribus.checkpoint`` saves and reshards on load. Full: plain arrays on rank 0, gathered one
unit at a time, so no rank ever holds more than one unit's gathered parameters besides the
result (empty dicts on the other ranks).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import distributed as dist
from ...dtensor import DTensor
from ..named_state import (
    check_keys,
    group_entries,
    like,
    load_named_optim_state_dict,
    named_optim_state_dict,
)


def _index(model: Any) -> dict[int, tuple[Any, int]]:
    """id(parameter) -> (unit, position of its piece in the unit)."""
    return {
        id(piece.param): (unit, i)
        for unit in model.fsdp_units()
        for i, piece in enumerate(unit.pieces)
    }


def _host(array: Any) -> Any:
    return array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else array


def _sharded_state_dict(model: Any) -> dict[str, Any]:
    index = _index(model)
    out: dict[str, Any] = {}
    for name, param in model.named_parameters():
        unit, i = index[id(param)]
        out[name] = unit.dtensor(unit.pieces[i], unit.shard_views[i].copy())
    out.update({name: b.copy() for name, b in model.named_buffers()})
    return out


def _local_rows(unit: Any, i: int, value: Any, what: str) -> Any:
    """This rank's rows of ``value``: a DTensor (any mesh and layout of the same global shape)
    or the whole array. Its own piece is taken as it is only on the unit's own mesh: on another
    (the same ranks in another order) the same layout puts other rows on this rank."""
    piece = unit.pieces[i]
    if isinstance(value, DTensor):
        if value.shape != piece.shape:
            raise ValueError(
                f"rank {dist.get_rank()}: {what} has global shape {value.shape} in the state "
                f"but {piece.shape} in the model"
            )
        if value.device_mesh == unit.mesh and value.layout == unit.layout(piece):
            return value.to_local()
        value = value.full_tensor()
    if tuple(value.shape) != piece.shape:
        raise ValueError(
            f"rank {dist.get_rank()}: {what} has shape {tuple(value.shape)} in the state but "
            f"{piece.shape} in the model"
        )
    start = piece.starts[unit.me]
    return value[start : start + piece.sizes[unit.me]]


def _load_sharded_state_dict(model: Any, state: dict[str, Any], strict: bool = True) -> None:
    """Load DTensors (any layout: others are gathered first) or whole arrays into the shards."""
    index = _index(model)
    for unit in model.fsdp_units():  # gathered parameters would go stale
        unit.reshard()
    if strict:
        check_keys(state, model, "load_state_dict")
    names = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for name, param in names.items():
        if name in state:
            unit, i = index[id(param)]
            rows = _local_rows(unit, i, state[name], repr(name))
            target = unit.shard_views[i]
            target[...] = like(target, rows)
    for name, target in buffers.items():
        if name in state:
            target[...] = like(target, state[name])


def full_state_dict(model: Any) -> dict[str, Any]:
    """Whole parameters (numpy) and buffers on global rank 0, one unit gathered at a time."""
    _refuse_pieces(model, "full_state_dict")
    names = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, Any] = {}
    on_zero = dist.get_rank() == 0
    for unit in model.fsdp_units():
        fulls = unit.gather_full(unit.shard_views, unit.dtype)
        if on_zero:
            for piece, full in zip(unit.pieces, fulls, strict=True):
                out[names[id(piece.param)]] = np.array(_host(full))
        del fulls
    if on_zero:
        out.update({name: np.array(_host(b)) for name, b in model.named_buffers()})
    return out


def _optim_state_dict(model: Any, optimizer: Any) -> dict[str, Any]:
    """The optimizer state by parameter name (see :mod:`..named_state`), each state array a
    DTensor with its parameter's layout."""
    index = _index(model)

    def save(param: Any, value: Any) -> DTensor:
        unit, i = index[id(param)]
        return unit.dtensor(unit.pieces[i], value.copy())

    return named_optim_state_dict(model, optimizer, save)


def full_optim_state_dict(model: Any, optimizer: Any) -> dict[str, Any]:
    """The same with whole numpy arrays, on global rank 0 only, one unit at a time."""
    _refuse_pieces(model, "full_optim_state_dict")
    names = {id(p): name for name, p in model.named_parameters()}
    by_param = {id(p): entry for p, entry in zip(optimizer.params, optimizer.state, strict=True)}
    on_zero = dist.get_rank() == 0
    state: dict[str, dict[str, Any]] = {}
    for unit in model.fsdp_units():
        entries = [by_param.get(id(piece.param), {}) for piece in unit.pieces]
        keys = sorted({k for e in entries for k, v in e.items() if getattr(v, "ndim", 0) > 0})
        for key in keys:
            local = [
                e[key] if key in e else unit.xp.zeros(unit.shard_views[i].shape, unit.dtype)
                for i, e in enumerate(entries)
            ]
            fulls = unit.gather_full(local, unit.dtype)
            if on_zero:
                for piece, full in zip(unit.pieces, fulls, strict=True):
                    state.setdefault(names[id(piece.param)], {})[key] = np.array(_host(full))
        if on_zero:
            for piece, entry in zip(unit.pieces, entries, strict=True):
                for key, value in entry.items():
                    if getattr(value, "ndim", 0) == 0:
                        state.setdefault(names[id(piece.param)], {})[key] = value.item()
    if not on_zero:
        return {}
    return {
        "state": state,
        "param_groups": group_entries(optimizer, names),
        "step_count": optimizer.step_count,
    }


def _load_optim_state_dict(model: Any, optimizer: Any, osd: dict[str, Any]) -> None:
    """Load a sharded or a full optimizer state dict (the full one given on every rank)."""
    index = _index(model)

    def load(param: Any, value: Any, what: str) -> Any:
        unit, i = index[id(param)]
        rows = _local_rows(unit, i, value, what)
        return like(unit.shard_views[i], rows, copy=True)

    load_named_optim_state_dict(model, optimizer, osd, load)


def _refuse_pieces(model: Any, call: str) -> None:
    """FSDP's own state dicts name each parameter's array as the whole parameter, which a
    tensor-parallel piece is not: refuse them for a split model, on every rank alike."""
    for unit in model.fsdp_units():
        for piece in unit.pieces:
            if getattr(piece.param, "tp_layout", None) is not None:
                raise ValueError(
                    f"rank {dist.get_rank()}: {call} of an FSDP model whose parameters are "
                    "tensor-parallel pieces would give a piece as the whole parameter; use "
                    "pluribus.parallel.get_model_state_dict and set_model_state_dict (and "
                    "get_/set_optimizer_state_dict), which give FSDP's rows of each piece as "
                    "checkpoint.Pieces of the whole parameter"
                )


def sharded_state_dict(model: Any) -> dict[str, Any]:
    """Each parameter as a ``Shard(0)`` DTensor with its whole shape, buffers as copies."""
    _refuse_pieces(model, "state_dict")
    return _sharded_state_dict(model)


def load_sharded_state_dict(model: Any, state: dict[str, Any], strict: bool = True) -> None:
    """Load DTensors (any layout: others are gathered first) or whole arrays into the shards."""
    _refuse_pieces(model, "load_state_dict")
    _load_sharded_state_dict(model, state, strict)


def optim_state_dict(model: Any, optimizer: Any) -> dict[str, Any]:
    """The optimizer state by parameter name, each array in its parameter's layout."""
    _refuse_pieces(model, "optim_state_dict")
    return _optim_state_dict(model, optimizer)


def load_optim_state_dict(model: Any, optimizer: Any, osd: dict[str, Any]) -> None:
    """Load a sharded or a full optimizer state dict (the full one given on every rank)."""
    _refuse_pieces(model, "load_optim_state_dict")
    _load_optim_state_dict(model, optimizer, osd)

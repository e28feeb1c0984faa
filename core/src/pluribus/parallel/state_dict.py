"""One state dict for a model however it is spread over the ranks, torch's
``torch.distributed.checkpoint.state_dict`` functions: what ``pluribus.checkpoint`` saves and
reshards on load, with the same keys for a model alone, under DDP, tensor-parallel or FSDP.

- A tensor-parallel parameter is a DTensor over its mesh, with its global shape; loading it
  into a model split over another number of ranks (or not split) takes that model's pieces.
- A split parameter that stacks equal blocks (``Parameter.blocks``: a fused q, k, v
  projection, each block split alike) has them as a leading dimension, ``(3, C, C)`` for
  ``(3C, C)``, so that each rank's piece is one box; ``checkpoint.load`` fills either form
  from the other.
- An FSDP model's parameters are its ``Shard(0)`` DTensors (its own ``state_dict``). Under
  FSDP of a tensor-parallel model (2-D), a split parameter's rows of this rank's piece are a
  ``checkpoint.Pieces``: those rows placed in the blocked global shape above (one box, or a
  few where they cross a fused projection's blocks), which no DTensor layout describes (two
  mesh dimensions cut one tensor dimension; torch's ``_StridedShard``). No rank gathers its
  whole piece to save or load it, and ``checkpoint.load`` fills the boxes from any layout.
- Anything else is a copy of the array, the same on every rank.

The optimizer's state is keyed by parameter name, each array in its parameter's form. An
optimizer that has not stepped yet first gets the zero state its first step starts from, so
that a checkpoint load has arrays to fill.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import distributed as dist
from ..arrays import device_of
from ..dtensor import DTensor, Shard, from_local
from ..dtensor.boxes import Pieces, dtensor_box, layout_box, regrouped
from ..dtensor.layout import default_layout
from ..nn.module import Parameter, array_namespace
from .ddp import DistributedDataParallel
from .fsdp import FSDPModule, FullyShardedDataParallel
from .fsdp.state_dict import (
    _index,
    _load_optim_state_dict,
    _load_sharded_state_dict,
    _optim_state_dict,
    _sharded_state_dict,
)
from .named_state import check_keys, like, load_named_optim_state_dict, named_optim_state_dict
from .tensor_parallel.pieces import piece_of, rank_span


def _fsdp(model: Any) -> bool:
    return isinstance(model, (FSDPModule, FullyShardedDataParallel))


def _unwrapped(model: Any) -> Any:
    """The model a state dict reads (DDP's module), refused when ``fully_shard`` split some
    of its parameters but the model itself is no FSDP module: each rank's rows would pass for
    whole arrays."""
    model = model.module if isinstance(model, DistributedDataParallel) else model
    for name, param in model.named_parameters():
        if getattr(param, "sharded_by_fsdp", False):
            raise ValueError(
                f"rank {dist.get_rank()}: parameter {name!r} is sharded by fully_shard on a "
                f"submodule, but {type(model).__name__} itself is not: fully_shard the root "
                "too (model = fully_shard(model), as torch's FSDP2 expects) and pass that"
            )
    return model


def _fsdp_value(index: dict, param: Parameter, value: Any, what: str) -> Any:
    """``value`` as an FSDP model takes it: a tensor-parallel parameter's rows (from the
    :class:`Pieces` of :func:`_fsdp_state`, as FSDP's own DTensor) or whole piece, or the whole
    parameter with its blocks merged back. ``index``: the model's ``fsdp.state_dict._index``."""
    if getattr(param, "tp_layout", None) is None:
        return _blocks_merged(param, _no_pieces(value, what))
    if isinstance(value, Pieces):
        unit, i = index[id(param)]
        piece = unit.pieces[i]
        start = piece.starts[unit.me]
        rows = _fsdp_rows(param, value, (start, start + piece.sizes[unit.me]), what)
        return unit.dtensor(piece, rows)
    return _from_state(param, value, what)


def _fsdp_boxes(param: Parameter, rows: tuple[int, int]) -> list[tuple[tuple, tuple, tuple]]:
    """Where FSDP's ``rows`` of this rank's tensor-parallel piece of ``param`` lie in its
    blocked global shape: ``(index into the rows, offsets, sizes)`` of each box, one, or one
    per fused block the rows cross."""
    mesh, piece = param.tp_layout[0], _piece_shape(param)
    layout = default_layout(_blocked_shape(param), (_split_placement(param),), mesh.shape)
    tp_offsets, tp_sizes = layout_box(layout, mesh.coordinate)  # the piece, blocks first
    box = ((rows[0],) + (0,) * (len(piece) - 1), (rows[1] - rows[0], *piece[1:]))
    parts = [((slice(0, box[1][0]),), box)]
    if param.blocks > 1:
        parts = regrouped(box, piece, tp_sizes)
    return [
        (index, tuple(o + t for o, t in zip(offsets, tp_offsets, strict=True)), sizes)
        for index, (offsets, sizes) in parts
    ]


def _fsdp_state(param: Parameter, value: Any) -> Any:
    """An FSDP DTensor (a parameter's rows or its optimizer state's) as the state dict holds
    it: a tensor-parallel parameter's rows as :class:`Pieces` of its blocked global shape
    (nothing gathered); anything else as it is."""
    if getattr(param, "tp_layout", None) is None or not isinstance(value, DTensor):
        return value
    (start, *_), (count, *_) = dtensor_box(value)
    rows = value.to_local()
    boxes = [
        (offsets, rows[index].reshape(sizes))
        for index, offsets, sizes in _fsdp_boxes(param, (start, start + count))
    ]
    layout = (
        f"FSDP {list(value.placements)} over mesh {list(value.device_mesh.shape)} of the "
        f"DTensor mesh {list(param.tp_layout[0].shape)} [{_split_placement(param)}]"
    )
    return Pieces(_blocked_shape(param), boxes, dtype=rows.dtype, layout=layout)


def _fsdp_rows(param: Parameter, value: Pieces, rows: tuple[int, int], what: str) -> Any:
    """FSDP's ``rows`` of this rank's tensor-parallel piece, from the :class:`Pieces` that
    :func:`_fsdp_state` gives (filled by ``checkpoint.load``)."""
    boxes = _fsdp_boxes(param, rows)
    held = {offsets: array for offsets, array in value.pieces}
    want = sorted((offsets, sizes) for _, offsets, sizes in boxes)
    if value.shape != _blocked_shape(param) or want != sorted(
        (offsets, tuple(a.shape)) for offsets, a in value.pieces
    ):
        raise ValueError(
            f"rank {dist.get_rank()}: {what} is Pieces of {list(value.shape)} with boxes "
            f"{sorted((o, tuple(a.shape)) for o, a in value.pieces)}, but this rank's FSDP rows "
            f"of its tensor-parallel piece are the boxes {want} of {list(_blocked_shape(param))}; "
            "pass the state of this model's get_model_state_dict (or get_optimizer_state_dict), "
            "filled by checkpoint.load, or a DTensor or whole array"
        )
    xp = array_namespace(value.pieces[0][1]) if value.pieces else np
    out = xp.empty((rows[1] - rows[0], *_piece_shape(param)[1:]), value.dtype)
    for index, offsets, _ in boxes:
        out[index] = held[offsets].reshape(out[index].shape)
    return out


def _no_pieces(value: Any, what: str) -> Any:
    """``value``, unless it is :class:`Pieces`, which only FSDP of a tensor-parallel model
    gives and takes."""
    if isinstance(value, Pieces):
        raise ValueError(
            f"rank {dist.get_rank()}: {what} is a checkpoint.Pieces, which only a split "
            "parameter under FSDP takes (FSDP's rows of its tensor-parallel piece); load the "
            "checkpoint into this model's own get_model_state_dict (or "
            "get_optimizer_state_dict) and pass that"
        )
    return value


def _blocks_merged(param: Parameter, value: Any) -> Any:
    """``value`` for an FSDP parameter, which holds its whole shape: a blocked one (a DTensor
    is gathered) with its blocks merged back."""
    ndim = getattr(value, "ndim", 0)
    if param.blocks == 1 or ndim != param.data.ndim + 1 or value.shape[0] != param.blocks:
        return value
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.reshape(value.shape[0] * value.shape[1], *value.shape[2:])


def _whole_shape(param: Parameter) -> tuple[int, ...]:
    """The parameter's shape before any split."""
    layout = getattr(param, "tp_layout", None)
    return tuple(param.data.shape) if layout is None else layout[3]


def _blocked_shape(param: Parameter) -> tuple[int, ...]:
    """The whole shape with the parameter's blocks a leading dimension."""
    shape = _whole_shape(param)
    if param.blocks == 1:
        return shape
    return (param.blocks, shape[0] // param.blocks, *shape[1:])


def _piece_shape(param: Parameter) -> tuple[int, ...]:
    """The shape of this rank's tensor-parallel piece (``.data`` under FSDP holds rows of it)."""
    mesh, dim, chunks, shape = param.tp_layout
    span = rank_span(shape[dim] // chunks, mesh)
    return (*shape[:dim], chunks * (span.stop - span.start), *shape[dim + 1 :])


def _split_placement(param: Parameter) -> Shard:
    """The split of a tensor-parallel parameter in its blocked shape."""
    return Shard(param.tp_layout[1] + (1 if param.blocks > 1 else 0))


def _to_state(param: Parameter, array: Any) -> Any:
    """A copy of ``array`` (the parameter's data, or optimizer state of its shape) as the state
    dict holds it: this rank's piece as a DTensor, blocks first, for a split parameter."""
    layout = getattr(param, "tp_layout", None)
    if layout is None:
        return array.copy()
    piece = array.copy()
    if param.blocks > 1:
        piece = piece.reshape(param.blocks, -1, *piece.shape[1:])
    placements = [_split_placement(param)]
    return from_local(piece, layout[0], placements, run_check=False, shape=_blocked_shape(param))


def _from_state(param: Parameter, value: Any, what: str) -> Any:
    """This rank's part of ``value`` for ``param``, in the parameter's local shape: from a
    DTensor or a whole array of the unsplit or the blocked shape (a DTensor in the layout
    :func:`_to_state` makes gives its own piece; in any other it is gathered first)."""
    whole, blocked = _whole_shape(param), _blocked_shape(param)
    layout = getattr(param, "tp_layout", None)
    if isinstance(_no_pieces(value, what), DTensor):
        if layout is not None and value.shape == blocked and value.device_mesh == layout[0]:
            mine = default_layout(blocked, (_split_placement(param),), layout[0].shape)
            if value.layout is mine:  # layouts are interned: equal ones are one object
                return value.to_local().reshape(_piece_shape(param))
        value = value.full_tensor()  # collective over the value's mesh, in the model's order
    shape = tuple(value.shape)
    if shape not in (whole, blocked):
        also = f" (or {blocked}, its {param.blocks} blocks first)" if blocked != whole else ""
        raise ValueError(
            f"rank {dist.get_rank()}: {what} has shape {shape} in the state but {whole} in "
            f"the model{also}"
        )
    value = value.reshape(whole)
    if layout is None:
        return value
    mesh, dim, chunks, _ = layout
    return piece_of(value, dim, mesh, chunks)


def _whole_value(param: Parameter, value: Any) -> Any:
    """``value`` (a parameter's array, or FSDP's DTensor of it) whole, in the parameter's own
    shape: FSDP's rows gathered over their mesh, then a tensor-parallel piece over its mesh."""
    split = getattr(param, "tp_layout", None) is not None
    if isinstance(value, DTensor):
        value = value.full_tensor()  # FSDP: the whole parameter, or its tensor-parallel piece
    elif not split:
        value = value.copy()
    if not split:
        return value
    # on every rank of the tensor-parallel mesh alike, whatever the size of its piece
    return _to_state(param, value).full_tensor().reshape(_whole_shape(param))


def get_model_state_dict(
    model: Any, *, full_state_dict: bool = False, cpu_offload: bool = False
) -> dict[str, Any]:
    """Every parameter and buffer by name, in the forms above (no communication).

    ``full_state_dict=True`` (torch's ``StateDictOptions`` field): every value whole, in the
    model's own shapes, on every rank, as one process holds it (to export or inspect a model
    however it was spread). Collective: each split or sharded parameter is gathered, in the
    same order on every rank. With ``cpu_offload=True`` too (torch's), rank 0 alone keeps the
    values, as host arrays, and every other rank gets ``{}``, holding no more than one whole
    array at a time."""
    if full_state_dict or cpu_offload:
        return _full_model_state(model, *_full_form(full_state_dict, cpu_offload))
    if _fsdp(model):
        params = dict(model.named_parameters())
        state = _sharded_state_dict(model)  # FSDP's own: a split parameter's rows of its piece
        return {k: _fsdp_state(params[k], v) if k in params else v for k, v in state.items()}
    model = _unwrapped(model)
    state = {name: _to_state(param, param.data) for name, param in model.named_parameters()}
    state.update({name: buffer.copy() for name, buffer in model.named_buffers()})
    return state


def _full_form(full_state_dict: bool, cpu_offload: bool):
    """The conversion of each value of a full state dict (refusing ``cpu_offload`` alone): the
    whole array, or with ``cpu_offload`` that array on the host on rank 0 and None elsewhere
    (dropped as soon as it is gathered); and whether this rank keeps the state dict."""
    if not full_state_dict:
        raise ValueError(
            f"rank {dist.get_rank()}: cpu_offload=True gathers the whole state on rank 0 and "
            "needs full_state_dict=True (a sharded state dict stays where it is)"
        )
    keep = not cpu_offload or not dist.is_initialized() or dist.get_rank() == 0

    def form(param: Parameter | None, value: Any) -> Any:
        if param is None:  # a buffer
            whole = value.full_tensor() if isinstance(value, DTensor) else value.copy()
        else:
            whole = _whole_value(param, value)
        if not cpu_offload:
            return whole
        return (whole.get() if device_of(whole) == "cuda" else whole) if keep else None

    return form, keep


def _full_model_state(model: Any, form, keep: bool) -> dict[str, Any]:
    if _fsdp(model):
        params, state = dict(model.named_parameters()), _sharded_state_dict(model)
    else:
        model = _unwrapped(model)
        params = dict(model.named_parameters())
        state = {name: param.data for name, param in params.items()}
        state.update(model.named_buffers())
    whole = {k: form(params.get(k), v) for k, v in state.items()}
    return whole if keep else {}


def set_model_state_dict(model: Any, state: dict[str, Any], strict: bool = True) -> None:
    """Copy ``state`` into the parameters and buffers in place (optimizers keep theirs): a
    state from :func:`get_model_state_dict` of this model or of the same model spread another
    way (filled by ``checkpoint.load``), or whole arrays. Collective when a value's layout
    differs from its parameter's (it is gathered): every rank passes the same keys."""
    if _fsdp(model):
        params, index = dict(model.named_parameters()), _index(model)
        state = {
            k: _fsdp_value(index, params[k], v, repr(k)) if k in params else v
            for k, v in state.items()
        }
        _load_sharded_state_dict(model, state, strict)
        return
    model = _unwrapped(model)
    if strict:
        check_keys(state, model, "set_model_state_dict")
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    for name, param in params.items():
        if name in state:
            param.data[...] = like(param.data, _from_state(param, state[name], repr(name)))
    for name, buffer in buffers.items():
        if name in state:
            value = state[name]
            value = value.full_tensor() if isinstance(value, DTensor) else value
            if tuple(value.shape) != tuple(buffer.shape):
                raise ValueError(
                    f"rank {dist.get_rank()}: buffer {name!r} has shape {tuple(value.shape)} "
                    f"in the state but {tuple(buffer.shape)} in the model"
                )
            buffer[...] = like(buffer, value)


def get_optimizer_state_dict(
    model: Any, optimizer: Any, *, full_state_dict: bool = False, cpu_offload: bool = False
) -> dict[str, Any]:
    """``{"state": {name: {key: array, DTensor or number}}, "param_groups": [...],
    "step_count": n}``, each state array in its parameter's form; gives an optimizer that has
    not stepped the zero state of a first step first (``optimizer.init_state()``).
    ``full_state_dict`` and ``cpu_offload``: as for :func:`get_model_state_dict`."""
    full, keep = (
        _full_form(full_state_dict, cpu_offload) if full_state_dict or cpu_offload else (None, True)
    )
    if _fsdp(model):
        for unit in model.fsdp_units():  # after a forward, .data is the gathered parameter
            unit.reshard()
        optimizer.init_state()
        state = _optim_state_dict(model, optimizer)
        params = dict(model.named_parameters())
        form = full or _fsdp_state
        for name, entry in state["state"].items():
            state["state"][name] = {
                k: form(params[name], v) if isinstance(v, DTensor) else v for k, v in entry.items()
            }
    else:
        optimizer.init_state()
        state = named_optim_state_dict(_unwrapped(model), optimizer, full or _to_state)
    return state if keep else {}


def set_optimizer_state_dict(model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    """Put an optimizer state dict (from :func:`get_optimizer_state_dict` of this model or of
    the same model spread another way, filled by ``checkpoint.load``) into ``optimizer``."""
    if _fsdp(model):
        params, index = dict(model.named_parameters()), _index(model)
        entries = {
            name: {
                k: _fsdp_value(index, params[name], v, f"{name!r} state {k!r}")
                if name in params and (isinstance(v, DTensor) or getattr(v, "ndim", 0))
                else v
                for k, v in entry.items()
            }
            for name, entry in state["state"].items()
        }
        _load_optim_state_dict(model, optimizer, {**state, "state": entries})
        return

    def load(param: Parameter, value: Any, what: str) -> Any:
        return like(param.data, _from_state(param, value, what), copy=True)

    load_named_optim_state_dict(_unwrapped(model), optimizer, state, load)

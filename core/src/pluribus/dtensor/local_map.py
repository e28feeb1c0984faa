"""torch's ``local_map``: a function written for local arrays, run on DTensors' pieces, its
results made DTensors again, for the operations DTensor has no rule for (a fused kernel, a
softmax over an unsharded axis). The caller states the placements the pieces must have and
the ones the results have; nothing else is inferred."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import distributed as dist
from ..mesh import DeviceMesh
from ..nn.module import array_namespace
from .api import DTensor, _rank, from_local
from .placements import Placement

Placements = Sequence[Placement] | None


def _spec(given: Any, what: str) -> tuple[Placement, ...] | None:
    """One argument's or result's placements as a tuple (None: not a DTensor)."""
    if given is None:
        return None
    if isinstance(given, Placement):
        raise TypeError(
            f"rank {_rank()}: local_map's {what} is {given!r}; give a sequence with one "
            f"placement per mesh dimension, such as ({given!r},)"
        )
    spec = tuple(given)
    if not all(isinstance(p, Placement) for p in spec):
        raise TypeError(f"rank {_rank()}: local_map's {what} {given!r} is not placements")
    return spec


def _out_specs(out_placements: Any) -> tuple[bool, list]:
    """Whether ``func`` gives one result, and the placements of each result."""
    if out_placements is None or isinstance(out_placements, Placement):
        return True, [_spec(out_placements, "out_placements")]
    items = tuple(out_placements)
    if all(isinstance(p, Placement) for p in items):  # one result's placements
        return True, [items]
    return False, [_spec(p, f"out_placements[{k}]") for k, p in enumerate(items)]


def local_map(
    func: Callable,
    out_placements: Any,
    in_placements: Sequence[Placements] | None = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = False,
    run_check: bool = True,
) -> Callable:
    """``func`` for DTensors: each DTensor argument is replaced by its piece, and each result
    made a DTensor on the arguments' mesh (or ``device_mesh``) with its placements.

    ``out_placements``: the placements of the one result, or a tuple with the placements of
    each (None for a result that is not an array, handed back as it is). ``in_placements``:
    one entry per positional argument, the placements its DTensor must have (None for an
    argument that is not an array; an array that is no DTensor is taken as this rank's piece,
    as torch takes a plain tensor); a DTensor with others is refused, or redistributed with
    ``redistribute_inputs=True``. The results are made by :func:`from_local`: with
    ``run_check`` (the default) the ranks exchange their pieces' shapes, so uneven shards get
    their true sizes (one small collective per result); without it, the pieces are taken to be
    even, as torch's ``local_map`` takes them. With no DTensor argument, ``func``'s results are
    handed back as they are (torch's rule).

    ``local_map(lambda x: np.exp(x) / np.exp(x).sum(-1, keepdims=True), [Shard(0)],
    [[Shard(0)]])`` is a softmax over the last axis of rows split over the mesh."""
    one, outs = _out_specs(out_placements)
    ins = None
    if in_placements is not None:
        ins = [_spec(p, f"in_placements[{k}]") for k, p in enumerate(in_placements)]

    def mapped(*args: Any, **kwargs: Any) -> Any:
        if ins is not None and len(args) != len(ins):
            raise ValueError(
                f"rank {_rank()}: local_map was given in_placements for {len(ins)} positional "
                f"arguments and called with {len(args)}"
            )
        mesh = device_mesh
        pieces = []
        for k, arg in enumerate(args):
            want = None if ins is None else ins[k]
            if not isinstance(arg, DTensor):  # an array is taken as a piece already (torch's rule)
                if want is not None and getattr(arg, "ndim", None) is None:
                    raise TypeError(
                        f"rank {_rank()}: local_map's argument {k} is a {type(arg).__name__}, "
                        f"not the DTensor with placements {list(want)} that in_placements names"
                    )
                pieces.append(arg)
                continue
            if mesh is None:
                mesh = arg.device_mesh
            elif arg.device_mesh is not mesh and arg.device_mesh != mesh:
                raise ValueError(
                    f"rank {_rank()}: local_map's argument {k} is on {arg.device_mesh!r}, the "
                    f"others on {mesh!r}; every DTensor argument is on one mesh"
                )
            if want is not None and tuple(arg.placements) != want:
                if not redistribute_inputs:
                    raise ValueError(
                        f"rank {_rank()}: local_map's argument {k} has placements "
                        f"{list(arg.placements)}, in_placements names {list(want)}; "
                        "redistribute it first, or pass redistribute_inputs=True"
                    )
                arg = arg.redistribute(placements=want)
            pieces.append(arg.to_local())
        out = func(*pieces, **kwargs)
        if not any(isinstance(a, DTensor) for a in args):
            return out
        if run_check:  # a rank whose results are refused must not leave the others waiting
            try:  # in from_local's exchange: every rank learns of it and raises
                results, problem = _results(out, one, outs), None
            except (TypeError, ValueError) as exc:
                results, problem = None, (type(exc).__name__, str(exc))
            _agree(problem, mesh)
        else:
            results = _results(out, one, outs)
        # each DTensor owns its piece: a result that is (a view of) an argument's piece or an
        # earlier result is copied (a write or a donation of one would change the other)
        owned = [p for a, p in zip(args, pieces, strict=True) if isinstance(a, DTensor)]
        made = []
        for r, spec in zip(results, outs, strict=True):
            if spec is None:
                made.append(r)
                continue
            if isinstance(r, np.generic):
                r = np.asarray(r)
            if any(type(o) is type(r) and _may_share(r, o) for o in owned):
                r = r.copy()
            owned.append(r)
            made.append(from_local(r, mesh, spec, run_check=run_check))
        # the shape of what func gave: one result, or a tuple of them (torch's pytree rule)
        return tuple(made) if isinstance(out, (tuple, list)) and not one else made[0]

    return mapped


def _results(out: Any, one: bool, outs: list) -> tuple:
    """``func``'s results, one per ``out_placements`` entry (torch's: one result given for a
    one-entry tuple), each an array where its entry names placements."""
    if one or (len(outs) == 1 and not isinstance(out, (tuple, list))):
        results = (out,)
    elif isinstance(out, (tuple, list)):
        results = tuple(out)
    else:  # an array is one result, not its rows
        raise ValueError(
            f"rank {_rank()}: local_map's function gave one {type(out).__name__}, "
            f"out_placements names {len(outs)} results"
        )
    if len(results) != len(outs):
        raise ValueError(
            f"rank {_rank()}: local_map's function gave {len(results)} results, "
            f"out_placements names {len(outs)}"
        )
    for k, (r, spec) in enumerate(zip(results, outs, strict=True)):
        if spec is not None and getattr(r, "ndim", None) is None:
            raise TypeError(
                f"rank {_rank()}: local_map's result {k} is a {type(r).__name__}, not an array; "
                "its out_placements entry must be None"
            )
    return results


def _agree(problem: tuple | None, mesh: DeviceMesh) -> None:
    """Raise on every rank of ``mesh`` when any rank's results were refused (one small
    exchange per mesh dimension)."""
    info = [(dist.get_rank(), problem)]
    for m in range(mesh.ndim):
        gathered = dist.all_gather_object(info, group=mesh.get_group(m))
        info = [item for part in gathered for item in part]
    me = dist.get_rank()
    for r, found in sorted(info, key=lambda item: item[0] != me):  # this rank's first
        if found is not None:
            kind, message = found
            error = TypeError if kind == "TypeError" else ValueError
            raise error(message if r == me else f"rank {me}: local_map: rank {r} says {message}")


def _may_share(a: Any, b: Any) -> bool:
    try:
        return bool(array_namespace(a).may_share_memory(a, b))
    except (TypeError, AttributeError):
        return False
